//! What `csi-snapshotter` does after its start-up checks: the rate-limited Kubernetes client and
//! the controllers (contents, and group contents with the `CSIVolumeGroupSnapshot` gate), run directly or only while this process holds the Lease
//! (`external-snapshotter-leader-<driver>`).

use std::time::Duration;

use plugreg_sidecar_kit::service::Kube;
use tokio_util::sync::CancellationToken;

use crate::controller::{self, Clients, Config};
use crate::csi::{Driver, DriverCaps};
use crate::flags::{self, FeatureGates, Options};
use crate::group::controller::{self as group, GroupConfig};

/// Why the driver `driver` with `caps` cannot be served as the command line asks (upstream's
/// start-up refusals, exit 1), in upstream's words.
pub fn refusal(options: &Options, driver: &str, caps: DriverCaps) -> Option<String> {
    if !caps.create_delete_snapshot {
        return Some(format!(
            "CSI driver {driver} does not support ControllerCreateSnapshot"
        ));
    }
    if options.snapshot_name_prefix.is_empty() {
        return Some(flags::EMPTY_PREFIX.to_owned());
    }
    None
}

/// With the `CSIVolumeGroupSnapshot` gate: asks the driver whether it can cut group snapshots
/// and says so when it cannot (upstream's lines; the process goes on either way, as
/// upstream's), then refuses an empty `--groupsnapshot-name-prefix` (exit 1).
pub async fn group_check(
    options: &Options,
    gates: &FeatureGates,
    driver: &Driver,
    name: &str,
) -> Option<String> {
    if !gates.volume_group_snapshot {
        return None;
    }
    match driver.group_snapshots().await {
        Err(e) => tracing::error!(
            "error determining if driver supports create/delete group snapshot operations: {}",
            e.message
        ),
        Ok(false) => tracing::warn!(
            "CSI driver {name} does not support GroupControllerCreateVolumeGroupSnapshot when the --feature-gates=CSIVolumeGroupSnapshot=true flag is set"
        ),
        Ok(true) => {}
    }
    options
        .groupsnapshot_name_prefix
        .is_empty()
        .then(|| flags::EMPTY_GROUP_PREFIX.to_owned())
}

/// The controller's settings for the driver `driver` with `caps`, from the command line;
/// `node`: this node's name with `--node-deployment`.
pub fn config(
    options: &Options,
    gates: &FeatureGates,
    driver: &str,
    caps: DriverCaps,
    node: Option<String>,
) -> Config {
    Config {
        group: gates.volume_group_snapshot.then(|| GroupConfig {
            name_prefix: options.groupsnapshot_name_prefix.clone(),
            uuid_length: options.groupsnapshot_name_uuid_length,
        }),
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
            async move {
                let Some(groups) = config.group.clone() else {
                    return controller::run(config, clients, token).await;
                };
                // The group controller only ends at the shutdown; the content controller
                // also when its caches cannot be filled.
                let groups = group::run(config.clone(), groups, clients.clone(), token.clone());
                let contents = controller::run(config, clients, token);
                tokio::pin!(contents);
                tokio::select! {
                    r = &mut contents => r,
                    () = groups => contents.await,
                }
            }
        })
        .await
    }
}
