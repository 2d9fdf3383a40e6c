//! What `csi-provisioner` does after its start-up checks: the two rate-limited
//! Kubernetes clients, the event recorder, and the controller, run directly or only while this
//! process holds the Lease.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::controller::{self, Clients};
use crate::csi::{Capabilities, Driver};
use plugreg_sidecar_kit::events::Recorder;
use plugreg_sidecar_kit::leader::{
    LeaderElection, LeaderError, LeaderHealth, lease_name, run_elected,
};
use plugreg_sidecar_kit::ratelimit;

use crate::metrics::{Metrics, ProvisionMetrics};
use crate::node::NodeDeployment;
use crate::record::Journal;
use crate::request::RequestOptions;

/// Everything the run needs, gathered by the binary's start-up.
pub struct Service {
    /// The Kubernetes client configuration (from `--master`, `--kubeconfig` or in-cluster).
    pub kube_config: kube::Config,
    /// `--kube-api-qps`.
    pub qps: f64,
    /// `--kube-api-burst`.
    pub burst: u32,
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
    /// Leader election, when `--leader-election`.
    pub leader: Option<LeaderElection>,
    /// Shared with `/healthz/leader-election`.
    pub health: LeaderHealth,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// Capacity tracking (`--enable-capacity`): its configuration and its own client.
    pub capacity: Option<(crate::capacity::Config, kube::Client)>,
    /// Distributed provisioning (`--node-deployment`).
    pub node: Option<NodeDeployment>,
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
        self.metrics.register(limiter.clone());
        // Leader election has a client and a bucket of its own: renewing the Lease never
        // waits behind the work (upstream gives it its own clientset too).
        let election = ratelimit::own_client(self.kube_config.clone(), self.qps, self.burst)?;
        // Each node keeps a record of its own: a volume one node's driver may have made is
        // finished or deleted by that node only.
        let record = match &self.node {
            Some(nd) => crate::node::record_base(&lease_name(&self.driver_name), &nd.local.node),
            None => lease_name(&self.driver_name),
        };
        let (journal, found) = Journal::new(
            ratelimit::unlimited_client(self.kube_config)?,
            limiter,
            &self.record_namespace,
            &record,
        );
        let component = format!("{}_{}_{}", self.driver_name, self.host, uuid4());
        let events = Recorder::start(low.clone(), &component, &self.host, shutdown.clone());
        let cfg = controller::Config {
            driver: self.driver_name,
            identity: self.identity,
            request: self.request,
            capabilities: self.capabilities,
            workers: self.workers,
            retry_start: self.retry_start,
            retry_max: self.retry_max,
            timeout: self.timeout,
            clone_protection_workers: self.clone_protection_workers,
            snapshot_sweep: self.snapshot_sweep,
            node: self.node.map(Arc::new),
        };
        let (refresh, refreshes) = crate::capacity::Refresh::channel();
        let capacity = self.capacity.map(|(cfg, client)| {
            (
                cfg,
                client,
                low.clone(),
                Arc::clone(&self.driver),
                Arc::clone(&self.metrics),
                refreshes,
            )
        });
        let clients = Clients {
            high: high.clone(),
            low,
            events,
            driver: self.driver,
            provisioned: ProvisionMetrics::registered(&self.metrics),
            metrics: Arc::clone(&self.metrics),
            journal,
            found,
            capacity: capacity.is_some().then_some(refresh),
        };
        let elected = self.leader.is_some();
        Ok(run_elected(
            self.leader.map(|le| (le, election)),
            self.health,
            shutdown,
            |token| async move {
                if elected {
                    info!("became leader, starting");
                }
                // Capacity tracking runs beside the provisioning controller, as long as it.
                let child = token.child_token();
                let tracking = capacity.map(|(cfg, client, watch, driver, metrics, refreshes)| {
                    tokio::spawn(crate::capacity::run(
                        cfg,
                        client,
                        watch,
                        driver,
                        metrics,
                        refreshes,
                        child.clone(),
                    ))
                });
                let r = controller::run(cfg, clients, token).await;
                child.cancel();
                if let Some(t) = tracking
                    && let Ok(Err(e)) = t.await
                {
                    tracing::error!("{e}");
                }
                r
            },
        )
        .await??)
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
