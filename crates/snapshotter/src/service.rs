//! What `csi-snapshotter` does after its start-up checks: the rate-limited Kubernetes client and
//! the controller, run directly or only while this process holds the Lease
//! (`external-snapshotter-leader-<driver>`).

use std::sync::Arc;
use std::time::Duration;

use plugreg_sidecar_kit::leader::{LeaderElection, LeaderError, LeaderHealth, run_elected};
use plugreg_sidecar_kit::metrics::Metrics;
use plugreg_sidecar_kit::ratelimit;
use tokio_util::sync::CancellationToken;

use crate::controller::{self, Clients, Config};
use crate::csi::Driver;

/// Everything the run needs, gathered by the binary's start-up.
pub struct Service {
    /// The Kubernetes client configuration.
    pub kube_config: kube::Config,
    /// `--kube-api-qps`.
    pub qps: f64,
    /// `--kube-api-burst`.
    pub burst: u32,
    /// The driver.
    pub driver: Driver,
    /// The controller's settings.
    pub config: Config,
    /// Leader election, when `--leader-election`.
    pub leader: Option<LeaderElection>,
    /// Shared with `/healthz/leader-election`.
    pub health: LeaderHealth,
    /// The metrics.
    pub metrics: Arc<Metrics>,
}

/// How the run ended badly.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The clients could not be built.
    #[error("failed to build the Kubernetes clients: {0}")]
    Clients(#[from] ratelimit::Error),
    /// Leadership was lost (`Stopped leading`): upstream exits 1.
    #[error("Stopped leading: {0}")]
    Leader(#[from] LeaderError),
    /// The caches never filled.
    #[error(transparent)]
    Controller(#[from] controller::ControllerError),
}

/// How long the leader lets its workers finish after a shutdown before the lease goes.
pub const DRAIN: Duration = Duration::from_secs(10);

impl Service {
    /// Runs until `shutdown` (Ok) or until leadership is lost or the caches fail (Err).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServiceError> {
        let (high, low, limiter) =
            ratelimit::clients(self.kube_config.clone(), self.qps, self.burst)?;
        self.metrics.register(limiter);
        let clients = Clients {
            kube: high,
            events: low,
            driver: self.driver,
            metrics: Arc::clone(&self.metrics),
        };
        let leader = match self.leader {
            // Its own client and bucket: renewing the Lease never waits behind the work.
            Some(le) => Some((
                le,
                ratelimit::own_client(self.kube_config, self.qps, self.burst)?,
            )),
            None => None,
        };
        let config = self.config;
        Ok(run_elected(leader, self.health, shutdown, |token| {
            controller::run(config, clients, token)
        })
        .await??)
    }
}
