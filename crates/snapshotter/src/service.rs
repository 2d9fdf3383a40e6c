//! What `csi-snapshotter` does after its start-up checks: the rate-limited Kubernetes client and
//! the controller, run directly or only while this process holds the Lease
//! (`external-snapshotter-leader-<driver>`).

use std::time::Duration;

use plugreg_sidecar_kit::service::Kube;
use tokio_util::sync::CancellationToken;

use crate::controller::{self, Clients, Config};
use crate::csi::Driver;

/// Everything the run needs, gathered by the binary's start-up.
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
                kube: c.high,
                events: c.low,
                driver,
                metrics,
            };
            controller::run(config, clients, token)
        })
        .await
    }
}
