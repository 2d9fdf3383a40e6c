//! Every tunable of the plugin manager, with upstream's defaults in one place.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use plugreg_runtime::Backoff;

/// Where upstream's kubelet watches for registration sockets.
pub const DEFAULT_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";

/// How the plugin manager behaves. Build with [`ManagerConfig::new`] and adjust the fields.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// The directory watched for registration sockets (created 0755 when missing).
    pub registry_dir: PathBuf,
    /// Limit for connecting to a plugin's registration socket (upstream: 10 s).
    pub dial_timeout: Duration,
    /// Limit for GetInfo (upstream: 1 s).
    pub get_info_timeout: Duration,
    /// Limit for NotifyRegistrationStatus (upstream: 5 s).
    pub notify_timeout: Duration,
    /// Safety-net full reconcile period (D1; upstream's only trigger, 1 s).
    pub resync_period: Duration,
    /// First back-off after a failed registration (upstream: 500 ms).
    pub backoff_initial: Duration,
    /// Back-off cap (upstream: 2 min 2 s).
    pub backoff_max: Duration,
    /// Most registrations and deregistrations running at once in the shared slots (D7).
    pub max_concurrent_operations: usize,
    /// An operation running this long leaves the shared slots for the slow lane, so that a
    /// plugin that takes long (a CSI driver's NodeGetInfo may take 2 min) does not hold up
    /// the others.
    pub slow_operation_after: Duration,
    /// Most operations in the slow lane; when it is full, the plugin holding the most slow
    /// registrations has its oldest one cancelled (and retried with back-off).
    pub max_slow_operations: usize,
    /// Limit for each handler call (validate, register, deregister) (D7); upstream has none.
    pub handler_timeout: Duration,
    /// Per-plugin-type limits for handler calls, overriding `handler_timeout` (e.g. CSI's
    /// register waits for NodeGetInfo, up to 2 min).
    pub handler_timeouts: HashMap<String, Duration>,
    /// Dead-plugin detection (D5); `None` turns it off.
    pub liveness: Option<LivenessConfig>,
}

/// Dead-plugin detection (D5): a registered socket whose file stays but refuses connections is
/// deregistered after `failure_threshold` refusals in a row, probed every `interval`.
#[derive(Debug, Clone, Copy)]
pub struct LivenessConfig {
    /// Time between probes of each registered socket.
    pub interval: Duration,
    /// Refused connects in a row that make a plugin dead.
    pub failure_threshold: u32,
}

impl Default for LivenessConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            failure_threshold: 3,
        }
    }
}

impl ManagerConfig {
    /// Upstream's defaults, watching `registry_dir`.
    pub fn new(registry_dir: impl Into<PathBuf>) -> Self {
        Self {
            registry_dir: registry_dir.into(),
            dial_timeout: Duration::from_secs(10),
            get_info_timeout: Duration::from_secs(1),
            notify_timeout: Duration::from_secs(5),
            resync_period: Duration::from_secs(1),
            backoff_initial: Backoff::KUBELET_OPERATIONS.initial,
            backoff_max: Backoff::KUBELET_OPERATIONS.max,
            max_concurrent_operations: 64,
            slow_operation_after: Duration::from_millis(250),
            max_slow_operations: 256,
            handler_timeout: Duration::from_secs(30),
            handler_timeouts: HashMap::new(),
            liveness: Some(LivenessConfig::default()),
        }
    }
}

impl ManagerConfig {
    /// The back-off policy of failed registrations (D3 keeps one record per socket instance).
    pub fn backoff(&self) -> Backoff {
        Backoff::new(self.backoff_initial, self.backoff_max)
    }
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self::new(DEFAULT_REGISTRY_DIR)
    }
}
