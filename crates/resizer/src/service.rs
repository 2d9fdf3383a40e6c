//! What `csi-resizer` does after its start-up checks: the rate-limited Kubernetes client, the
//! event recorder, and the controllers, run directly or only while this process holds the
//! Lease `external-resizer-<driver>`.

use plugreg_sidecar_kit::events::Recorder;
use plugreg_sidecar_kit::service::Kube;
use tokio_util::sync::CancellationToken;

use crate::controller::{self, Clients, Config};
use crate::csi::{Driver, Found};
use crate::flags::{self, FeatureGates, Options};

/// The controllers' settings for the driver `driver`, which can do what `found` says, from the
/// command line (`gates` after the VolumeAttributesClass discovery check).
pub fn config(options: &Options, gates: &FeatureGates, driver: &str, found: Found) -> Config {
    Config {
        driver: driver.to_owned(),
        resizer: found.resizer,
        modify: found.modify && gates.volume_attributes_class,
        workers: flags::workers(options),
        retry_start: options.retry_interval_start,
        retry_max: options.retry_interval_max,
        resync: options.resync_period,
        recover: gates.recover_volume_expansion_failure,
        annotate_fs_resize: gates.annotate_fs_resize,
        handle_inuse: options.handle_volume_inuse_error,
        extra_modify_metadata: options.extra_modify_metadata,
    }
}

/// Everything the run needs, gathered by the binary's start-up.
#[derive(Clone)]
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
                watches: c.watches,
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
