//! What `csi-attacher` does after its start-up checks: the rate-limited Kubernetes client and
//! the controller, run directly or only while this process holds the Lease
//! (`external-attacher-leader-<driver>`).

use std::time::Duration;

use plugreg_sidecar_kit::service::Kube;
use tokio_util::sync::CancellationToken;

use crate::controller::{self, Clients, Config};
use crate::csi::Driver;
use crate::decide::DriverCaps;
use crate::flags::{FeatureGates, Options};

/// The controller's settings for the driver `driver` with `caps`, from the command line.
pub fn config(options: &Options, gates: &FeatureGates, driver: &str, caps: DriverCaps) -> Config {
    Config {
        driver: driver.to_owned(),
        caps,
        default_fstype: options.default_fstype.clone(),
        workers: usize::try_from(options.worker_threads).unwrap_or(usize::MAX),
        retry_start: options.retry_interval_start,
        retry_max: options.retry_interval_max,
        resync: options.resync,
        reconcile_sync: options.reconcile_sync,
        timeout: options.timeout,
        max_entries: options.max_entries as i32,
        error_codes: gates.mutable_csinode_allocatable_count,
    }
}

/// Everything the run needs, gathered by the binary's start-up.
#[derive(Clone)]
pub struct Service {
    /// Kubernetes: the clients' settings, leader election, health and metrics.
    pub kube: Kube,
    /// The driver.
    pub driver: Driver,
    /// The controller's settings.
    pub config: Config,
}

/// How the run ended badly.
pub type ServiceError = plugreg_sidecar_kit::service::ServiceError<controller::ControllerError>;

/// How long the leader lets its workers finish after a shutdown before the lease goes.
pub const DRAIN: Duration = Duration::from_secs(10);

impl Service {
    /// Runs until `shutdown` (Ok) or until leadership is lost or the caches fail (Err).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServiceError> {
        let Service {
            kube,
            driver,
            config,
        } = self;
        let metrics = kube.metrics.clone();
        kube.run(shutdown, |c, token| {
            let clients = Clients {
                watches: c.watches,
                kube: c.high,
                driver,
                metrics,
            };
            controller::run(config, clients, token)
        })
        .await
    }
}
