//! What `csi-resizer` does after its start-up checks: the rate-limited Kubernetes client, the
//! event recorder, and the controllers, run directly or only while this process holds the
//! Lease `external-resizer-<driver>`.

use plugreg_sidecar_kit::events::Recorder;
use plugreg_sidecar_kit::service::Kube;
use tokio_util::sync::CancellationToken;

use crate::controller::{self, Clients, Config};
use crate::csi::Driver;

/// Everything the run needs, gathered by the binary's start-up.
pub struct Service {
    /// Kubernetes: the clients' settings, leader election, health and metrics.
    pub kube: Kube,
    /// The controllers' settings.
    pub config: Config,
    /// The driver.
    pub driver: Driver,
}

/// How the run ended badly.
pub type ServiceError = plugreg_sidecar_kit::service::ServiceError<controller::ControllerError>;

impl Service {
    /// Runs until `shutdown` (Ok) or until leadership is lost or the caches fail (Err).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServiceError> {
        let Service {
            kube,
            config,
            driver,
        } = self;
        let metrics = kube.metrics.clone();
        let component = format!("external-resizer {}", config.driver);
        let events_end = shutdown.clone();
        kube.run(shutdown, |c, token| {
            let clients = Clients {
                client: c.high,
                events: Recorder::start(c.low, &component, "", events_end),
                driver,
                metrics,
            };
            controller::run(config, clients, token)
        })
        .await
    }
}
