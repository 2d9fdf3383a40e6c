//! What `csi-resizer` does after its start-up checks: the rate-limited Kubernetes client, the
//! event recorder, and the controllers, run directly or only while this process holds the
//! Lease `external-resizer-<driver>`.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::controller::{self, Clients, Config};
use crate::csi::Driver;
use plugreg_sidecar_kit::events::Recorder;
use plugreg_sidecar_kit::leader::{LeaderElection, LeaderError, LeaderHealth, run_elected};
use plugreg_sidecar_kit::metrics::Metrics;
use plugreg_sidecar_kit::ratelimit;

/// Everything the run needs, gathered by the binary's start-up.
pub struct Service {
    /// The Kubernetes client configuration.
    pub kube_config: kube::Config,
    /// `--kube-api-qps`.
    pub qps: f64,
    /// `--kube-api-burst`.
    pub burst: u32,
    /// The controllers' settings.
    pub config: Config,
    /// The driver.
    pub driver: Driver,
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

impl Service {
    /// Runs until `shutdown` (Ok) or until leadership is lost or the caches fail (Err).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServiceError> {
        let (high, low, limiter) =
            ratelimit::clients(self.kube_config.clone(), self.qps, self.burst)?;
        self.metrics.register(limiter);
        // Leader election has a client and a bucket of its own (upstream: its own clientset).
        let election = ratelimit::own_client(self.kube_config, self.qps, self.burst)?;
        let component = format!("external-resizer {}", self.config.driver);
        let events = Recorder::start(low, &component, "", shutdown.clone());
        let clients = Clients {
            client: high,
            events,
            driver: self.driver,
            metrics: Arc::clone(&self.metrics),
        };
        let cfg = self.config;
        Ok(run_elected(
            self.leader.map(|le| (le, election)),
            self.health,
            shutdown,
            |token| controller::run(cfg, clients, token),
        )
        .await??)
    }
}
