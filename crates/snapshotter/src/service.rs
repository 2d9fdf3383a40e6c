//! What `csi-snapshotter` does after its start-up checks: the rate-limited Kubernetes client and
//! the controller, run directly or only while this process holds the Lease
//! (`external-snapshotter-leader-<driver>`).

use std::time::Duration;

use plugreg_sidecar_kit::service::Kube;
use tokio_util::sync::CancellationToken;

use crate::controller::{self, Clients, Config};
use crate::csi::{Driver, DriverCaps};
use crate::flags::{self, FeatureGates, Options};

/// Why the driver `driver` with `caps` cannot be served as the command line asks (upstream's
/// start-up refusals, exit 1), in upstream's words.
pub fn refusal(
    options: &Options,
    gates: &FeatureGates,
    driver: &str,
    caps: DriverCaps,
) -> Option<String> {
    if !caps.create_delete_snapshot {
        return Some(format!(
            "CSI driver {driver} does not support ControllerCreateSnapshot"
        ));
    }
    if options.snapshot_name_prefix.is_empty() {
        return Some(flags::EMPTY_PREFIX.to_owned());
    }
    if gates.volume_group_snapshot {
        return Some("--feature-gates=CSIVolumeGroupSnapshot=true: volume group snapshots are not implemented by this csi-snapshotter (upstream has them off by default)".to_owned());
    }
    None
}

/// The controller's settings for the driver `driver` with `caps`, from the command line;
/// `node`: this node's name with `--node-deployment`.
pub fn config(options: &Options, driver: &str, caps: DriverCaps, node: Option<String>) -> Config {
    Config {
        driver: driver.to_owned(),
        caps,
        name_prefix: options.snapshot_name_prefix.clone(),
        uuid_length: options.snapshot_name_uuid_length,
        extra_create_metadata: options.extra_create_metadata,
        workers: usize::try_from(options.worker_threads).unwrap_or(1),
        retry_start: options.retry_interval_start,
        retry_max: options.retry_interval_max,
        resync: options.resync_period,
        node,
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
                events: c.low,
                driver,
                metrics,
            };
            controller::run(config, clients, token)
        })
        .await
    }
}
