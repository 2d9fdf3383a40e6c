//! The command line of external-provisioner v6.3.0, in spf13/pflag syntax: the sidecar kit's
//! skeleton ([`plugreg_sidecar_kit::flags`]: logging, the removed klog flags, `--version`, the
//! controller block of API server, rate limit, leader election and diagnostics server) plus
//! the provisioner's own flags with their types and defaults ([`Options`]), the feature gates
//! ([`FeatureGates`]), and the small pure rules start-up needs (the identities).
//!
//! Differences from upstream:
//! - the removed klog flags (`--logtostderr`, `--alsologtostderr`, ...) are accepted and ignored
//!   (with a warning from `main`) instead of exit 2;
//! - the apiserver feature-gate names, `AllAlpha` and `AllBeta` are accepted and ignored;
//! - v1.x's `--enable-leader-election`, `--leader-election-type`, `--provisioner` and
//!   `--connection-timeout`, and `HonorPVReclaimPolicy=true`, are accepted with a warning (the
//!   kit's [`compat`](plugreg_sidecar_kit::compat) rules).

use std::collections::BTreeMap;
use std::time::Duration;

use plugreg_sidecar_kit::compat::Upstream;
use plugreg_sidecar_kit::flags::{
    self as kit, Command, ControllerFlags, SidecarFlags, Syntax, other_gate,
};
use plugreg_sidecar_kit::goflag::{Kind, Spec, Value, flag};
use plugreg_sidecar_kit::gosyntax::{SyntaxError, parse_duration, parse_int, parse_uint};
use plugreg_sidecar_kit::pflag;

pub use plugreg_sidecar_kit::flags::{
    APISERVER_GATES, UnknownGate, kubeconfig_path, parse_gate_list, parse_labels,
};
pub use plugreg_sidecar_kit::goflag::{FLAG_ERROR_EXIT, FlagError};
pub use plugreg_sidecar_kit::leader::{leader_identity, lease_name, lock_name, sanitize_name};

/// Exit code of upstream's `klog.Fatal` (an unknown feature gate, a failed start-up step).
pub const FATAL_EXIT: i32 = 255;

/// Upstream's refusal of `--node-deployment` without `NODE_NAME` (§B.2 step 1).
pub const NO_NODE_NAME: &str =
    "The NODE_NAME environment variable must be set when using --enable-node-deployment.";

/// The provisioner's command line: pflag syntax, the controller block, its own flags.
pub const COMMAND: Command = Command {
    syntax: Syntax::Pflag,
    legacy_usage: "Removed klog flag (external-provisioner no longer registers it): accepted and ignored.",
    version_usage: "Print the version and exit.",
    controller: true,
    upstream: Upstream::Provisioner,
};

/// The whole command line.
pub type Flags = kit::Flags<Options>;
/// What the command line asks for.
pub type Parsed = kit::Parsed<Options>;

/// Every flag of upstream's command line but the skeleton's (logging, removed klog flags,
/// `--version`), with upstream's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// The API server, its rate limit, leader election, the diagnostics server.
    pub controller: ControllerFlags,
    /// `--feature-gates` as given (repeated flags merged, later wins); checked by
    /// [`FeatureGates::from_requested`] after logging is set up (an unknown name is exit 255).
    pub feature_gates: BTreeMap<String, bool>,
    /// `--csi-address`: the driver socket (`/abs` or `unix://path`).
    pub csi_address: String,
    /// `--automaxprocs` (Go runtime tuning; no effect here).
    pub automaxprocs: bool,
    /// `--volume-name-prefix`: prefix of the volume and PV name.
    pub volume_name_prefix: String,
    /// `--volume-name-uuid-length`: -1 keeps the whole claim UID, N >= 0 cuts the dashless UID.
    pub volume_name_uuid_length: i64,
    /// `--retry-interval-start`: first back-off of a failed provision or delete.
    pub retry_interval_start: Duration,
    /// `--retry-interval-max`: back-off cap.
    pub retry_interval_max: Duration,
    /// `--worker-threads`: claim workers, and as many volume workers.
    pub worker_threads: u64,
    /// `--cloning-protection-threads`.
    pub cloning_protection_threads: u64,
    /// `--snapshot-orphan-sweep-interval` (0 disables).
    pub snapshot_orphan_sweep_interval: Duration,
    /// `--capacity-threads`.
    pub capacity_threads: u64,
    /// `--timeout`: deadline of every CSI call.
    pub timeout: Duration,
    /// `--strict-topology`.
    pub strict_topology: bool,
    /// `--immediate-topology`.
    pub immediate_topology: bool,
    /// `--extra-create-metadata`: add the PVC/PV name keys to CreateVolume parameters.
    pub extra_create_metadata: bool,
    /// `--enable-pprof` (Go profiling; no effect here).
    pub enable_pprof: bool,
    /// `--default-fstype`.
    pub default_fstype: String,
    /// `--kube-api-capacity-qps` (float32 upstream).
    pub kube_api_capacity_qps: f32,
    /// `--kube-api-capacity-burst`.
    pub kube_api_capacity_burst: i64,
    /// `--enable-capacity`: publish CSIStorageCapacity objects (capacity.rs).
    pub enable_capacity: bool,
    /// `--capacity-for-immediate-binding`.
    pub capacity_for_immediate_binding: bool,
    /// `--capacity-poll-interval`.
    pub capacity_poll_interval: Duration,
    /// `--capacity-ownerref-level`.
    pub capacity_ownerref_level: i64,
    /// `--node-deployment`: provision only this node's claims (node.rs).
    pub node_deployment: bool,
    /// `--node-deployment-immediate-binding`.
    pub node_deployment_immediate_binding: bool,
    /// `--node-deployment-base-delay`.
    pub node_deployment_base_delay: Duration,
    /// `--node-deployment-max-delay`.
    pub node_deployment_max_delay: Duration,
    /// `--controller-publish-readonly`.
    pub controller_publish_readonly: bool,
    /// `--prevent-volume-mode-conversion`.
    pub prevent_volume_mode_conversion: bool,
}

impl Default for Options {
    fn default() -> Self {
        let secs = Duration::from_secs;
        Self {
            controller: ControllerFlags::default(),
            feature_gates: BTreeMap::new(),
            csi_address: "/run/csi/socket".into(),
            automaxprocs: false,
            volume_name_prefix: "pvc".into(),
            volume_name_uuid_length: -1,
            retry_interval_start: secs(1),
            retry_interval_max: secs(300),
            worker_threads: 100,
            cloning_protection_threads: 1,
            snapshot_orphan_sweep_interval: secs(300),
            capacity_threads: 1,
            timeout: secs(10),
            strict_topology: false,
            immediate_topology: true,
            extra_create_metadata: false,
            enable_pprof: false,
            default_fstype: String::new(),
            kube_api_capacity_qps: 1.0,
            kube_api_capacity_burst: 5,
            enable_capacity: false,
            capacity_for_immediate_binding: false,
            capacity_poll_interval: secs(60),
            capacity_ownerref_level: 1,
            node_deployment: false,
            node_deployment_immediate_binding: true,
            node_deployment_base_delay: secs(20),
            node_deployment_max_delay: secs(60),
            controller_publish_readonly: false,
            prevent_volume_mode_conversion: true,
        }
    }
}

/// The provisioner's own flags, sorted by name.
const SPECS: &[Spec] = &[
    flag(
        "automaxprocs",
        Kind::Bool,
        "",
        "",
        "Set GOMAXPROCS from the container's CPU quota. Accepted for compatibility; no effect here.",
    ),
    flag(
        "capacity-for-immediate-binding",
        Kind::Bool,
        "",
        "",
        "Also publish storage capacity for storage classes with immediate binding (with --enable-capacity).",
    ),
    flag(
        "capacity-ownerref-level",
        Kind::Int,
        "int",
        "1",
        "Owner of the CSIStorageCapacity objects: -1 none, 0 this pod, 1 its controller, 2 that controller's owner, ...",
    ),
    flag(
        "capacity-poll-interval",
        Kind::Duration,
        "duration",
        "1m0s",
        "How often GetCapacity is called per topology segment and storage class (with --enable-capacity).",
    ),
    flag(
        "capacity-threads",
        Kind::Uint,
        "uint",
        "1",
        "Number of workers of the storage capacity controller.",
    ),
    flag(
        "cloning-protection-threads",
        Kind::Uint,
        "uint",
        "1",
        "Number of workers that remove the clone-source finalizer.",
    ),
    flag(
        "controller-publish-readonly",
        Kind::Bool,
        "",
        "",
        "Mark PersistentVolumes read-only when the claim's only access mode is ReadOnlyMany.",
    ),
    flag(
        "csi-address",
        Kind::String,
        "string",
        "/run/csi/socket",
        "Address of the CSI driver socket (a path or unix://PATH).",
    ),
    flag(
        "default-fstype",
        Kind::String,
        "string",
        "",
        "File system type for volumes whose StorageClass names none.",
    ),
    flag(
        "enable-capacity",
        Kind::Bool,
        "",
        "",
        "Publish CSIStorageCapacity objects with the capacity the driver reports through GetCapacity (needs the NAMESPACE environment variable, and POD_NAME unless --capacity-ownerref-level=-1).",
    ),
    flag(
        "enable-pprof",
        Kind::Bool,
        "",
        "",
        "Serve Go's pprof handlers. Accepted for compatibility; no effect here.",
    ),
    flag(
        "extra-create-metadata",
        Kind::Bool,
        "",
        "",
        "Pass the claim's name and namespace and the volume's name to CreateVolume as parameters.",
    ),
    flag(
        "feature-gates",
        Kind::Value,
        "mapStringBool",
        "",
        "Comma-separated Name=true|false pairs. Gates: Topology (GA, default true), VolumeAttributesClass (GA, default true), CrossNamespaceVolumeDataSource (alpha, default false; not supported yet), ReleaseLeaderElectionOnExit (alpha, default false). The apiserver's gate names, AllAlpha and AllBeta are accepted and ignored.",
    ),
    flag(
        "immediate-topology",
        Kind::Bool,
        "",
        "true",
        "Send accessibility requirements for claims of storage classes with immediate binding.",
    ),
    flag(
        "kube-api-capacity-burst",
        Kind::Int,
        "int",
        "5",
        "Burst of the Kubernetes API client used for storage capacity.",
    ),
    flag(
        "kube-api-capacity-qps",
        Kind::Value,
        "float32",
        "1",
        "Queries per second of the Kubernetes API client used for storage capacity.",
    ),
    flag(
        "node-deployment",
        Kind::Bool,
        "",
        "",
        "Run one provisioner per node beside the driver (distributed provisioning): it provisions only the claims of its own node (needs the NODE_NAME environment variable).",
    ),
    flag(
        "node-deployment-base-delay",
        Kind::Duration,
        "duration",
        "20s",
        "With --node-deployment: initial delay before trying to take a claim of immediate binding.",
    ),
    flag(
        "node-deployment-immediate-binding",
        Kind::Bool,
        "",
        "true",
        "With --node-deployment: also take claims of storage classes with immediate binding.",
    ),
    flag(
        "node-deployment-max-delay",
        Kind::Duration,
        "duration",
        "1m0s",
        "With --node-deployment: longest delay before trying to take a claim of immediate binding.",
    ),
    flag(
        "prevent-volume-mode-conversion",
        Kind::Bool,
        "",
        "true",
        "Refuse to restore a snapshot into a volume of another mode unless the snapshot content allows it.",
    ),
    flag(
        "retry-interval-max",
        Kind::Duration,
        "duration",
        "5m0s",
        "Longest back-off of a failed provisioning or deletion.",
    ),
    flag(
        "retry-interval-start",
        Kind::Duration,
        "duration",
        "1s",
        "First back-off of a failed provisioning or deletion; it doubles on each failure.",
    ),
    flag(
        "snapshot-orphan-sweep-interval",
        Kind::Duration,
        "duration",
        "5m0s",
        "How often orphaned snapshot-source finalizers are removed (0 disables).",
    ),
    flag(
        "strict-topology",
        Kind::Bool,
        "",
        "",
        "Require only the selected node's topology for delayed binding.",
    ),
    flag(
        "timeout",
        Kind::Duration,
        "duration",
        "10s",
        "Deadline of each call to the CSI driver.",
    ),
    flag(
        "volume-name-prefix",
        Kind::String,
        "string",
        "pvc",
        "Prefix of the names of created volumes and PersistentVolumes.",
    ),
    flag(
        "volume-name-uuid-length",
        Kind::Int,
        "int",
        "-1",
        "Characters of the claim UID (dashes removed) in volume names; -1 keeps the whole UID with dashes.",
    ),
    flag(
        "worker-threads",
        Kind::Uint,
        "uint",
        "100",
        "Number of claim workers, and of volume workers (CreateVolume and DeleteVolume calls at once).",
    ),
];

plugreg_sidecar_kit::command_functions!(Options);

impl SidecarFlags for Options {
    fn specs() -> &'static [Spec] {
        SPECS
    }

    fn controller(&mut self) -> Option<&mut ControllerFlags> {
        Some(&mut self.controller)
    }

    fn set(&mut self, spec: &Spec, value: Value<'_>) -> Result<(), SyntaxError> {
        let value = match value {
            Value::Bool(b) => {
                self.set_bool(spec.name, b);
                return Ok(());
            }
            Value::Text(text) => text,
        };
        let o = self;
        let text = || value.to_owned();
        match spec.name {
            "csi-address" => o.csi_address = text(),
            "volume-name-prefix" => o.volume_name_prefix = text(),
            "default-fstype" => o.default_fstype = text(),
            "retry-interval-start" => o.retry_interval_start = parse_duration(value)?,
            "retry-interval-max" => o.retry_interval_max = parse_duration(value)?,
            "snapshot-orphan-sweep-interval" => {
                o.snapshot_orphan_sweep_interval = parse_duration(value)?;
            }
            "timeout" => o.timeout = parse_duration(value)?,
            "capacity-poll-interval" => o.capacity_poll_interval = parse_duration(value)?,
            "node-deployment-base-delay" => o.node_deployment_base_delay = parse_duration(value)?,
            "node-deployment-max-delay" => o.node_deployment_max_delay = parse_duration(value)?,
            "kube-api-capacity-burst" => o.kube_api_capacity_burst = parse_int(value)?,
            "capacity-ownerref-level" => o.capacity_ownerref_level = parse_int(value)?,
            "volume-name-uuid-length" => o.volume_name_uuid_length = parse_int(value)?,
            "worker-threads" => o.worker_threads = parse_uint(value)?,
            "cloning-protection-threads" => o.cloning_protection_threads = parse_uint(value)?,
            "capacity-threads" => o.capacity_threads = parse_uint(value)?,
            "kube-api-capacity-qps" => o.kube_api_capacity_qps = pflag::parse_float32(value)?,
            "feature-gates" => o.feature_gates.extend(parse_gate_list(value)?),
            other => unreachable!("--{other} is in no table"),
        }
        Ok(())
    }
}

impl Options {
    fn set_bool(&mut self, name: &str, b: bool) {
        let o = self;
        match name {
            "automaxprocs" => o.automaxprocs = b,
            "capacity-for-immediate-binding" => o.capacity_for_immediate_binding = b,
            "controller-publish-readonly" => o.controller_publish_readonly = b,
            "enable-capacity" => o.enable_capacity = b,
            "enable-pprof" => o.enable_pprof = b,
            "extra-create-metadata" => o.extra_create_metadata = b,
            "immediate-topology" => o.immediate_topology = b,
            "node-deployment" => o.node_deployment = b,
            "node-deployment-immediate-binding" => o.node_deployment_immediate_binding = b,
            "prevent-volume-mode-conversion" => o.prevent_volume_mode_conversion = b,
            "strict-topology" => o.strict_topology = b,
            other => unreachable!("--{other} is in no table"),
        }
    }
}

/// The provisioner's feature gates (`pkg/features`), after `--feature-gates`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureGates {
    /// `Topology` (GA, default on): accessibility requirements and PV node affinity.
    pub topology: bool,
    /// `VolumeAttributesClass` (GA, default on).
    pub volume_attributes_class: bool,
    /// Whether `VolumeAttributesClass` was set explicitly (then discovery does not switch it
    /// off, §1.3).
    pub volume_attributes_class_explicit: bool,
    /// `CrossNamespaceVolumeDataSource` (alpha, default off; not supported yet).
    pub cross_namespace_volume_data_source: bool,
    /// `ReleaseLeaderElectionOnExit` (alpha, default off): release the Lease on SIGTERM/SIGINT
    /// and exit 0.
    pub release_leader_election_on_exit: bool,
    /// Gates that were given but have no effect here (apiserver gates, `AllAlpha`, `AllBeta`).
    pub ignored: Vec<String>,
}

impl Default for FeatureGates {
    fn default() -> Self {
        Self {
            topology: true,
            volume_attributes_class: true,
            volume_attributes_class_explicit: false,
            cross_namespace_volume_data_source: false,
            release_leader_election_on_exit: false,
            ignored: Vec::new(),
        }
    }
}

impl FeatureGates {
    /// The gates after `requested` (from [`Options::feature_gates`]); the first unknown name (in
    /// name order) is refused. An unknown name is upstream's `klog.Fatal`, exit [`FATAL_EXIT`].
    pub fn from_requested(requested: &BTreeMap<String, bool>) -> Result<Self, UnknownGate> {
        let mut gates = Self::default();
        for (name, &on) in requested {
            match name.as_str() {
                "Topology" => gates.topology = on,
                "VolumeAttributesClass" => {
                    gates.volume_attributes_class = on;
                    gates.volume_attributes_class_explicit = true;
                }
                "CrossNamespaceVolumeDataSource" => gates.cross_namespace_volume_data_source = on,
                "ReleaseLeaderElectionOnExit" => gates.release_leader_election_on_exit = on,
                other => other_gate(other, &mut gates.ignored)?,
            }
        }
        Ok(gates)
    }
}

/// Settings upstream accepts but fails on later with a Go panic: `--volume-name-uuid-length`
/// outside -1..=32 (on the first claim), and leader-election timings client-go refuses (at
/// election start, [`ControllerFlags::validate`]). Here they are a clear error at start (`main`
/// exits 1).
pub fn validate(o: &Options) -> Result<(), String> {
    if !(-1..=32).contains(&o.volume_name_uuid_length) {
        return Err(format!(
            "--volume-name-uuid-length={} is out of range: -1 (the whole claim UID) or 0 to 32",
            o.volume_name_uuid_length
        ));
    }
    o.controller.validate()
}

/// The provisioner identity stored in PV annotations (§2 step 15):
/// `<unix time in ms>-<random 0..9999>-<driver>`, plus `-<node>` with node deployment.
pub fn provisioner_identity(
    unix_millis: u128,
    random: u32,
    driver: &str,
    node: Option<&str>,
) -> String {
    let mut id = format!("{unix_millis}-{}-{driver}", random % 10_000);
    if let Some(node) = node {
        id.push('-');
        id.push_str(node);
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str]) -> Flags {
        match parse(args) {
            Ok(Parsed::Run(f)) => *f,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    fn err(args: &[&str]) -> String {
        parse(args).unwrap_err().0
    }

    #[test]
    fn specs_are_sorted_and_unique() {
        let names: Vec<_> = names().collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(names, sorted);
    }

    #[test]
    fn defaults_are_upstreams() {
        let f = run(&[]);
        let o = &f.options;
        assert_eq!(o, &Options::default());
        assert_eq!(o.csi_address, "/run/csi/socket");
        assert_eq!(o.timeout, Duration::from_secs(10));
        assert_eq!(o.volume_name_uuid_length, -1);
        assert_eq!(o.worker_threads, 100);
        assert!(o.immediate_topology && o.prevent_volume_mode_conversion);
        assert!(o.node_deployment_immediate_binding);
        assert_eq!(o.controller.kube_api_qps, 5.0);
        assert_eq!(o.controller.kube_api_burst, 10);
        assert_eq!(o.retry_interval_max, Duration::from_secs(300));
        assert_eq!(o.controller.metrics_path, "/metrics");
        assert!(!f.version && f.options.feature_gates.is_empty() && f.legacy.is_empty());
    }

    #[test]
    fn every_flag_is_set_by_its_name() {
        let f = run(&[
            "--csi-address=/x.sock",
            "--kubeconfig",
            "/kc",
            "--master=https://m",
            "--leader-election",
            "--leader-election-namespace=ns",
            "--leader-election-lease-duration=20s",
            "--leader-election-renew-deadline=15s",
            "--leader-election-retry-period=2s",
            "--leader-election-labels=a:b,c:d",
            "--kube-api-qps=50.5",
            "--kube-api-burst=100",
            "--http-endpoint=:8080",
            "--metrics-path=/m",
            "--automaxprocs",
            "--volume-name-prefix=vol",
            "--volume-name-uuid-length=8",
            "--retry-interval-start=2s",
            "--retry-interval-max=1m",
            "--worker-threads=7",
            "--cloning-protection-threads=2",
            "--snapshot-orphan-sweep-interval=0",
            "--capacity-threads=3",
            "--timeout=1m30s",
            "--strict-topology",
            "--immediate-topology=false",
            "--extra-create-metadata",
            "--enable-pprof",
            "--default-fstype=ext4",
            "--kube-api-capacity-qps=2.5",
            "--kube-api-capacity-burst=9",
            "--capacity-for-immediate-binding",
            "--capacity-poll-interval=30s",
            "--capacity-ownerref-level=-1",
            "--node-deployment-immediate-binding=false",
            "--node-deployment-base-delay=1s",
            "--node-deployment-max-delay=2s",
            "--controller-publish-readonly",
            "--prevent-volume-mode-conversion=false",
            "--version",
            "-v=4",
        ]);
        let o = &f.options;
        assert_eq!(o.csi_address, "/x.sock");
        assert_eq!(o.controller.kubeconfig, "/kc");
        assert_eq!(o.controller.master, "https://m");
        assert!(o.controller.leader_election);
        assert_eq!(o.controller.leader_election_namespace, "ns");
        assert_eq!(
            o.controller.leader_election_lease_duration,
            Duration::from_secs(20)
        );
        assert_eq!(
            o.controller.leader_election_renew_deadline,
            Duration::from_secs(15)
        );
        assert_eq!(
            o.controller.leader_election_retry_period,
            Duration::from_secs(2)
        );
        assert_eq!(o.controller.leader_election_labels.len(), 2);
        assert_eq!(o.controller.kube_api_qps, 50.5);
        assert_eq!(o.controller.kube_api_burst, 100);
        assert_eq!(o.controller.http_endpoint, ":8080");
        assert_eq!(o.controller.metrics_path, "/m");
        assert!(o.automaxprocs);
        assert_eq!(o.volume_name_prefix, "vol");
        assert_eq!(o.volume_name_uuid_length, 8);
        assert_eq!(o.retry_interval_start, Duration::from_secs(2));
        assert_eq!(o.retry_interval_max, Duration::from_secs(60));
        assert_eq!(o.worker_threads, 7);
        assert_eq!(o.cloning_protection_threads, 2);
        assert_eq!(o.snapshot_orphan_sweep_interval, Duration::ZERO);
        assert_eq!(o.capacity_threads, 3);
        assert_eq!(o.timeout, Duration::from_secs(90));
        assert!(o.strict_topology && !o.immediate_topology && o.extra_create_metadata);
        assert!(o.enable_pprof);
        assert_eq!(o.default_fstype, "ext4");
        assert_eq!(o.kube_api_capacity_qps, 2.5);
        assert_eq!(o.kube_api_capacity_burst, 9);
        assert!(o.capacity_for_immediate_binding);
        assert_eq!(o.capacity_poll_interval, Duration::from_secs(30));
        assert_eq!(o.capacity_ownerref_level, -1);
        assert!(!o.node_deployment_immediate_binding);
        assert_eq!(o.node_deployment_base_delay, Duration::from_secs(1));
        assert_eq!(o.node_deployment_max_delay, Duration::from_secs(2));
        assert!(o.controller_publish_readonly && !o.prevent_volume_mode_conversion);
        assert!(f.version);
        assert_eq!(f.logging.verbosity, 4);
    }

    #[test]
    fn bad_values_are_flag_errors() {
        assert!(err(&["--timeout=10"]).contains("time: invalid duration"));
        assert!(err(&["--worker-threads=-1"]).contains("--worker-threads"));
        assert!(err(&["--kube-api-qps=fast"]).contains("--kube-api-qps"));
        assert_eq!(err(&["--nope"]), "unknown flag: --nope");
        assert_eq!(
            err(&["-csi-address=/x"]),
            "unknown shorthand flag: 'c' in -csi-address=/x"
        );
    }

    #[test]
    fn leader_election_labels_need_one_colon_per_item() {
        let f = run(&[
            "--leader-election-labels=a:1,b:",
            "--leader-election-labels",
            "c:3",
        ]);
        let labels: Vec<_> = f
            .options
            .controller
            .leader_election_labels
            .into_iter()
            .collect();
        assert_eq!(
            labels,
            [
                ("a".into(), "1".into()),
                ("b".into(), String::new()),
                ("c".into(), "3".into())
            ]
        );
        for bad in ["a", "a:b:c", "a:b,,c:d"] {
            let e = err(&[&format!("--leader-election-labels={bad}")]);
            assert!(e.contains("key:value"), "{bad}: {e}");
        }
        assert!(parse_labels("").unwrap().is_empty());
    }

    #[test]
    fn feature_gates_merge_and_check_syntax() {
        let f = run(&[
            "--feature-gates=Topology=false, WatchList = true",
            "--feature-gates",
            "Topology=true,AllAlpha=false",
        ]);
        assert_eq!(f.options.feature_gates.get("Topology"), Some(&true));
        assert_eq!(f.options.feature_gates.len(), 3);
        assert!(err(&["--feature-gates=Topology"]).contains("malformed pair"));
        assert!(err(&["--feature-gates=Topology=yes"]).contains("invalid value of Topology"));
    }

    #[test]
    fn feature_gates_know_the_provisioners_and_ignore_the_apiservers() {
        let gates = |list: &str| FeatureGates::from_requested(&parse_gate_list(list).unwrap());
        let g = gates("").unwrap();
        assert!(g.topology && g.volume_attributes_class && !g.volume_attributes_class_explicit);
        assert!(!g.cross_namespace_volume_data_source && !g.release_leader_election_on_exit);
        let g = gates(
            "Topology=false,VolumeAttributesClass=true,CrossNamespaceVolumeDataSource=true,ReleaseLeaderElectionOnExit=true,WatchList=true,AllAlpha=true,AllBeta=false",
        )
        .unwrap();
        assert!(!g.topology && g.volume_attributes_class && g.volume_attributes_class_explicit);
        assert!(g.cross_namespace_volume_data_source && g.release_leader_election_on_exit);
        assert_eq!(g.ignored, ["AllAlpha", "AllBeta", "WatchList"]);
        assert_eq!(
            gates("Bogus=true,Topology=true").unwrap_err().to_string(),
            "unrecognized feature gate: Bogus"
        );
        // Removed in v6.2: unknown here (the command line takes it out at its graduated value).
        assert!(gates("HonorPVReclaimPolicy=true").is_err());
    }

    #[test]
    fn removed_klog_flags_are_accepted_and_listed() {
        let f = run(&["--logtostderr", "--alsologtostderr=false", "--log-dir=/tmp"]);
        assert_eq!(f.legacy, ["logtostderr", "alsologtostderr", "log-dir"]);
        assert!(err(&["--logtostderr=maybe"]).contains("strconv.ParseBool"));
    }

    #[test]
    fn logging_flags_reach_the_log_options() {
        let f = run(&["--v", "5", "--logging-format=json", "--vmodule=a=1"]);
        assert_eq!(f.logging.verbosity, 5);
        assert_eq!(f.logging.format, "json");
        let f = run(&["--log-text-split-stream"]);
        assert!(f.logging.validate().is_err());
    }

    #[test]
    fn help_and_positionals() {
        assert_eq!(parse(&["-h"]).unwrap(), Parsed::Help);
        assert_eq!(parse(&["--help"]).unwrap(), Parsed::Help);
        assert_eq!(
            run(&["extra", "--v=1", "more"]).positional,
            ["extra", "more"]
        );
    }

    #[test]
    fn validate_refuses_what_upstream_panics_on() {
        assert!(validate(&Options::default()).is_ok());
        let with = |f: fn(&mut Options)| {
            let mut o = Options::default();
            o.controller.leader_election = true;
            f(&mut o);
            validate(&o)
        };
        assert!(with(|_| {}).is_ok());
        assert!(with(|o| o.volume_name_uuid_length = 32).is_ok());
        assert!(with(|o| o.volume_name_uuid_length = 0).is_ok());
        assert!(with(|o| o.volume_name_uuid_length = 33).is_err());
        assert!(with(|o| o.volume_name_uuid_length = -2).is_err());
        let e = with(|o| o.controller.leader_election_renew_deadline = Duration::from_secs(15))
            .unwrap_err();
        assert!(
            e.contains("must be greater than --leader-election-renew-deadline"),
            "{e}"
        );
        let e = with(|o| o.controller.leader_election_retry_period = Duration::from_secs(9))
            .unwrap_err();
        assert!(e.contains("1.2 x"), "{e}");
        assert!(with(|o| o.controller.leader_election_retry_period = Duration::ZERO).is_err());
        // Without --leader-election the timings do not matter.
        let mut o = Options::default();
        o.controller.leader_election_retry_period = Duration::ZERO;
        assert!(validate(&o).is_ok());
    }

    #[test]
    fn kubeconfig_env_wins_when_set() {
        assert_eq!(kubeconfig_path("/flag", None), ("/flag".into(), false));
        assert_eq!(kubeconfig_path("/flag", Some("")), ("/flag".into(), false));
        assert_eq!(
            kubeconfig_path("/flag", Some("/env")),
            ("/env".into(), true)
        );
        assert_eq!(kubeconfig_path("", Some("/env")), ("/env".into(), true));
    }

    #[test]
    fn lease_names_follow_csi_lib_utils() {
        // The kit's rule (`plugreg_sidecar_kit::leader`), as the provisioner uses it.
        assert_eq!(lease_name("hostpath.csi.k8s.io"), "hostpath-csi-k8s-io");
        assert_eq!(lease_name("example.com/driver"), "example-com-driver");
        assert_eq!(lease_name("driver."), "driver-X");
        assert_eq!(lease_name("a_b"), "a-b");
        assert_eq!(lock_name("example.com/driver"), "example.com-driver");
        assert_eq!(leader_identity("node-1.example"), "node-1-example");
        assert_eq!(leader_identity("host-"), "host-X");
        assert_eq!(sanitize_name(""), "X");
    }

    #[test]
    fn provisioner_identity_has_time_random_and_driver() {
        assert_eq!(
            provisioner_identity(1_700_000_000_000, 12_345, "csi.example", None),
            "1700000000000-2345-csi.example"
        );
        assert_eq!(
            provisioner_identity(1, 7, "d", Some("node-a")),
            "1-7-d-node-a"
        );
    }

    #[test]
    fn usage_lists_every_flag() {
        let text = usage("csi-provisioner");
        assert!(text.starts_with("Usage of csi-provisioner:\n"));
        for name in names() {
            assert!(text.contains(&format!("--{name}")), "{name}");
        }
        assert!(text.contains("  -v, --v Level"));
    }

    #[test]
    fn honor_pv_reclaim_policy_at_its_graduated_value_is_accepted_with_a_warning() {
        // ceph-csi's, csi-driver-nfs's and the Azure drivers' provisioner args.
        let f = run(&["--feature-gates=HonorPVReclaimPolicy=true,VolumeAttributesClass=false"]);
        let gates = FeatureGates::from_requested(&f.options.feature_gates).unwrap();
        assert!(!gates.volume_attributes_class && gates.volume_attributes_class_explicit);
        assert_eq!(f.outdated.len(), 1);
        assert_eq!(f.outdated[0].given, "HonorPVReclaimPolicy=true");
        // Set to the other value it is upstream's fatal error, in upstream's words.
        let f = run(&["--feature-gates=HonorPVReclaimPolicy=false"]);
        assert_eq!(
            FeatureGates::from_requested(&f.options.feature_gates)
                .unwrap_err()
                .to_string(),
            "unrecognized feature gate: HonorPVReclaimPolicy"
        );
    }

    #[test]
    fn v1_flags_are_taken_as_todays() {
        // azuredisk-csi-driver v1.1.1 and csi-cloudscale v1.3.1.
        let f = run(&[
            "--feature-gates=Topology=true",
            "--enable-leader-election",
            "--leader-election-type=leases",
            "--provisioner=ch.cloudscale.csi",
            "--connection-timeout=15s",
        ]);
        assert!(f.options.controller.leader_election);
        let given: Vec<_> = f.outdated.iter().map(|a| a.given.as_str()).collect();
        assert_eq!(
            given,
            [
                "enable-leader-election=true",
                "leader-election-type=leases",
                "provisioner=ch.cloudscale.csi",
                "connection-timeout=15s"
            ]
        );
        assert!(err(&["--leader-election-type=etcd"]).contains("unknown leader election type"));
        // Not in the usage: today's flags only.
        assert!(!usage("csi-provisioner").contains("enable-leader-election"));
    }
}
