//! What `csi-provisioner` does after its start-up checks: the two rate-limited Kubernetes
//! clients and leader election (the kit's [`Kube`]), the in-flight record, the event recorder,
//! and the controller with capacity tracking beside it, run directly or only while this process
//! holds the Lease named after the driver (csi-lib-utils' name, the kit's `leader::lease_name`).

use std::sync::Arc;
use std::time::Duration;

use plugreg_sidecar_kit::events::Recorder;
use plugreg_sidecar_kit::leader::lease_name;
use plugreg_sidecar_kit::ratelimit;
use plugreg_sidecar_kit::service::Kube;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::controller::{self, Clients};
use crate::csi::{Capabilities, Driver};
use crate::metrics::ProvisionMetrics;
use crate::node::NodeDeployment;
use crate::record::Journal;
use crate::request::RequestOptions;

/// Everything the run needs, gathered by the binary's start-up.
#[derive(Clone)]
pub struct Service {
    /// Kubernetes: the clients' settings, leader election, health and metrics.
    pub kube: Kube,
    /// The driver.
    pub driver: Arc<Driver>,
    /// GetPluginInfo's name.
    pub driver_name: String,
    /// The provisioner identity (§2 step 15).
    pub identity: String,
    /// This host's name (event source host).
    pub host: String,
    /// The driver's capabilities.
    pub capabilities: Capabilities,
    /// The request options.
    pub request: RequestOptions,
    /// `--worker-threads`.
    pub workers: usize,
    /// `--retry-interval-start`.
    pub retry_start: Duration,
    /// `--retry-interval-max`.
    pub retry_max: Duration,
    /// `--timeout`.
    pub timeout: Duration,
    /// `--cloning-protection-threads`.
    pub clone_protection_workers: usize,
    /// `--snapshot-orphan-sweep-interval`.
    pub snapshot_sweep: Duration,
    /// The namespace of the in-flight record's Leases (the leader election's namespace, also
    /// without `--leader-election`).
    pub record_namespace: String,
    /// Capacity tracking (`--enable-capacity`): its configuration and its own client.
    pub capacity: Option<(crate::capacity::Config, kube::Client)>,
    /// Distributed provisioning (`--node-deployment`).
    pub node: Option<NodeDeployment>,
}

/// How the run ended badly.
pub type ServiceError = plugreg_sidecar_kit::service::ServiceError<controller::ControllerError>;

impl Service {
    /// Runs until `shutdown` (Ok) or until leadership is lost or the caches fail (Err).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServiceError> {
        let Service {
            mut kube,
            driver,
            driver_name,
            identity,
            host,
            capabilities,
            request,
            workers,
            retry_start,
            retry_max,
            timeout,
            clone_protection_workers,
            snapshot_sweep,
            record_namespace,
            capacity,
            node,
        } = self;
        // The record's client has no bucket of its own: the record takes its tokens from the
        // work's bucket itself, choosing each write's priority.
        let record_client = kube
            .transport()
            .and_then(|t| ratelimit::unlimited_client_on(&t))
            .map_err(ServiceError::Clients)?;
        // Each node keeps a record of its own: a volume one node's driver may have made is
        // finished or deleted by that node only.
        let record = match &node {
            Some(nd) => crate::node::record_base(&lease_name(&driver_name), &nd.local.node),
            None => lease_name(&driver_name),
        };
        let component = format!("{driver_name}_{host}_{}", uuid4());
        let metrics = Arc::clone(&kube.metrics);
        // Registered at start, as upstream's: every replica serves the counters.
        let provisioned = ProvisionMetrics::registered(&metrics);
        let cfg = controller::Config {
            driver: driver_name,
            identity,
            request,
            capabilities,
            workers,
            retry_start,
            retry_max,
            timeout,
            clone_protection_workers,
            snapshot_sweep,
            node: node.map(Arc::new),
        };
        let elected = kube.leader.is_some();
        let events_end = shutdown.clone();
        kube.run(shutdown, |c, token| async move {
            if elected {
                info!("became leader, starting");
            }
            let (journal, found) =
                Journal::new(record_client, c.limiter, &record_namespace, &record);
            let events = Recorder::start(c.low.clone(), &component, &host, events_end);
            let (refresh, refreshes) = crate::capacity::Refresh::channel();
            // Capacity tracking runs beside the provisioning controller, as long as it.
            let child = token.child_token();
            let tracking = capacity.map(|(cfg, client)| {
                // A sidecar of its own watches for capacity on the low-priority client.
                let watches = if c.watches.is_shared() {
                    c.watches.clone()
                } else {
                    plugreg_sidecar_kit::cache::Watches::own(c.low.clone())
                };
                tokio::spawn(crate::capacity::run(
                    cfg,
                    client,
                    watches,
                    Arc::clone(&driver),
                    Arc::clone(&metrics),
                    refreshes,
                    child.clone(),
                ))
            });
            let clients = Clients {
                high: c.high,
                low: c.low,
                events,
                driver,
                provisioned,
                metrics,
                journal,
                found,
                capacity: tracking.is_some().then_some(refresh),
                watches: c.watches,
            };
            let r = controller::run(cfg, clients, token).await;
            child.cancel();
            if let Some(t) = tracking
                && let Ok(Err(e)) = t.await
            {
                tracing::error!("{e}");
            }
            r
        })
        .await
    }
}

/// A random RFC 4122 version-4 UUID (for the event source name, which only has to differ
/// between processes).
fn uuid4() -> String {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&plugreg_runtime::backoff::random_u64().to_le_bytes());
    b[8..].copy_from_slice(&plugreg_runtime::backoff::random_u64().to_le_bytes());
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}
