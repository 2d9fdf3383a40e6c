//! What `csi-external-health-monitor-controller` does after its start-up checks: the
//! rate-limited Kubernetes client and the controller, run directly or only while this process
//! holds the Lease (`external-health-monitor-leader-<driver>`).

use std::time::Duration;

use plugreg_sidecar_kit::service::Kube;
use tokio_util::sync::CancellationToken;

use crate::controller::{self, Clients, Config};
use crate::csi::Driver;
use crate::decide::Mode;
use crate::flags::Options;

/// The controller's settings for the driver `driver` checked through `mode`, from the command
/// line.
pub fn config(options: &Options, driver: &str, mode: Mode) -> Config {
    Config {
        driver: driver.to_owned(),
        mode,
        timeout: options.timeout,
        monitor_interval: options.monitor_interval,
        list_volumes_interval: options.list_volumes_interval,
        volume_list_add_interval: options.volume_list_add_interval,
        node_list_add_interval: options.node_list_add_interval,
        resync: options.resync,
        workers: usize::try_from(options.worker_threads)
            .unwrap_or(usize::MAX)
            .max(1),
        node_watcher: options.enable_node_watcher,
        node_failure_grace: options.node_failure_grace,
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

/// How long the leader lets its checks finish after a shutdown before the lease goes.
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
                events: c.low,
                driver,
                metrics,
            };
            controller::run(config, clients, token)
        })
        .await
    }
}
