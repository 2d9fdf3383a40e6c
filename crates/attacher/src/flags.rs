//! The command line of external-attacher v4.12.0, in Go `flag` syntax (`-x` or `--x`, as
//! upstream parses it): the sidecar kit's skeleton ([`plugreg_sidecar_kit::flags`]: logging,
//! the removed klog flags, `--version`, the controller block of API server, rate limit, leader
//! election and diagnostics server) plus the attacher's own flags with their types and defaults
//! ([`Options`]) and its feature gates ([`FeatureGates`]).
//!
//! Differences from upstream:
//! - the removed klog flags (`--logtostderr`, `--alsologtostderr`, ...) are accepted and ignored
//!   (with a warning from `main`) instead of exit 2;
//! - the kit's `--master` is accepted (upstream has none; it only adds a way to reach the API
//!   server) and the `KUBECONFIG` environment variable is read, as every plugreg sidecar does;
//! - the apiserver feature-gate names, `AllAlpha` and `AllBeta` are accepted and ignored, as
//!   upstream does;
//! - v1.x's `--connection-timeout`, `--leader-election-identity` and `--leader-election-type`
//!   are accepted with a warning (the kit's [`compat`](plugreg_sidecar_kit::compat) rules).

use std::collections::BTreeMap;
use std::time::Duration;

use plugreg_sidecar_kit::compat::Upstream;
use plugreg_sidecar_kit::flags::{
    self as kit, Command, ControllerFlags, SidecarFlags, Syntax, other_gate,
};
use plugreg_sidecar_kit::goflag::{Kind, Spec, Value, flag};
use plugreg_sidecar_kit::gosyntax::{SyntaxError, parse_duration, parse_int, parse_uint};

pub use plugreg_sidecar_kit::flags::{APISERVER_GATES, UnknownGate, parse_gate_list, parse_labels};
pub use plugreg_sidecar_kit::goflag::{FLAG_ERROR_EXIT, FlagError};

/// The attacher's command line: Go `flag` syntax, the controller block, its own flags.
pub const COMMAND: Command = Command {
    syntax: Syntax::Go,
    legacy_usage: "Removed klog flag (external-attacher no longer registers it): accepted and ignored.",
    version_usage: "Show version.",
    controller: true,
    upstream: Upstream::Attacher,
};

/// The whole command line.
pub type Flags = kit::Flags<Options>;
/// What the command line asks for.
pub type Parsed = kit::Parsed<Options>;

/// Every flag of upstream's command line but the skeleton's, with upstream's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// The API server, its rate limit, leader election, the diagnostics server.
    pub controller: ControllerFlags,
    /// `--feature-gates` as given (repeated flags merged, later wins); checked by
    /// [`FeatureGates::from_requested`] after logging is set up (an unknown name is exit 1).
    pub feature_gates: BTreeMap<String, bool>,
    /// `--csi-address`: the driver socket (`/abs` or `unix://path`).
    pub csi_address: String,
    /// `--automaxprocs` (Go runtime tuning; no effect here).
    pub automaxprocs: bool,
    /// `--resync`: how often every cached VolumeAttachment and PersistentVolume is synced
    /// again.
    pub resync: Duration,
    /// `--timeout`: deadline of each Probe, ControllerPublish and ControllerUnpublish call, and
    /// of one whole ListVolumes reconcile.
    pub timeout: Duration,
    /// `--retry-interval-start`: first back-off of a failed VolumeAttachment or PV sync.
    pub retry_interval_start: Duration,
    /// `--retry-interval-max`: back-off cap.
    pub retry_interval_max: Duration,
    /// `--worker-threads`: workers per queue (0 is refused at start, exit 1).
    pub worker_threads: u64,
    /// `--max-entries`: `ListVolumesRequest.max_entries` (0: the driver decides).
    pub max_entries: i64,
    /// `--default-fstype`: fs type of mount volumes whose PV names none.
    pub default_fstype: String,
    /// `--reconcile-sync`: pause between two ListVolumes reconciles.
    pub reconcile_sync: Duration,
    /// `--max-grpc-log-length`: cap on the logged characters of a gRPC response (-1: none).
    pub max_grpc_log_length: i64,
}

impl Default for Options {
    fn default() -> Self {
        let secs = Duration::from_secs;
        Self {
            controller: ControllerFlags::default(),
            feature_gates: BTreeMap::new(),
            csi_address: "/run/csi/socket".into(),
            automaxprocs: false,
            resync: secs(600),
            timeout: secs(15),
            retry_interval_start: secs(1),
            retry_interval_max: secs(300),
            worker_threads: 10,
            max_entries: 0,
            default_fstype: String::new(),
            reconcile_sync: secs(60),
            max_grpc_log_length: -1,
        }
    }
}

/// The attacher's own flags (help texts in upstream's words where they are right).
const SPECS: &[Spec] = &[
    flag(
        "automaxprocs",
        Kind::Bool,
        "",
        "",
        "Go runtime tuning (GOMAXPROCS from the CPU quota); accepted, no effect here.",
    ),
    flag(
        "csi-address",
        Kind::String,
        "string",
        "/run/csi/socket",
        "Address of the CSI driver socket.",
    ),
    flag(
        "default-fstype",
        Kind::String,
        "string",
        "",
        "The default filesystem type of the volume to publish. Defaults to empty string",
    ),
    flag(
        "feature-gates",
        Kind::Value,
        "mapStringBool",
        "",
        "A set of key=value pairs that describe feature gates for alpha/experimental features. Gates: MutableCSINodeAllocatableCount (GA, default true), ReleaseLeaderElectionOnExit (alpha, default false). The apiserver's gate names, AllAlpha and AllBeta are accepted and ignored.",
    ),
    flag(
        "max-entries",
        Kind::Int,
        "int",
        "0",
        "Max entries per each page in volume lister call, 0 means no limit.",
    ),
    flag(
        "max-grpc-log-length",
        Kind::Int,
        "int",
        "-1",
        "The maximum amount of characters logged for every grpc responses. Defaults to no limit",
    ),
    flag(
        "reconcile-sync",
        Kind::Duration,
        "duration",
        "1m0s",
        "Resync interval of the VolumeAttachment reconciler.",
    ),
    flag(
        "resync",
        Kind::Duration,
        "duration",
        "10m0s",
        "Resync interval of the controller.",
    ),
    flag(
        "retry-interval-max",
        Kind::Duration,
        "duration",
        "5m0s",
        "Maximum retry interval of a failed attach or detach.",
    ),
    flag(
        "retry-interval-start",
        Kind::Duration,
        "duration",
        "1s",
        "Initial retry interval of a failed attach or detach. It doubles with each failure, up to retry-interval-max.",
    ),
    flag(
        "timeout",
        Kind::Duration,
        "duration",
        "15s",
        "Timeout for waiting for attaching or detaching the volume.",
    ),
    flag(
        "worker-threads",
        Kind::Uint,
        "uint",
        "10",
        "Number of attacher worker threads (per queue).",
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
                if spec.name == "automaxprocs" {
                    self.automaxprocs = b;
                }
                return Ok(());
            }
            Value::Text(text) => text,
        };
        let o = self;
        match spec.name {
            "csi-address" => o.csi_address = value.to_owned(),
            "default-fstype" => o.default_fstype = value.to_owned(),
            "resync" => o.resync = parse_duration(value)?,
            "timeout" => o.timeout = parse_duration(value)?,
            "retry-interval-start" => o.retry_interval_start = parse_duration(value)?,
            "retry-interval-max" => o.retry_interval_max = parse_duration(value)?,
            "reconcile-sync" => o.reconcile_sync = parse_duration(value)?,
            "worker-threads" => o.worker_threads = parse_uint(value)?,
            "max-entries" => o.max_entries = parse_int(value)?,
            "max-grpc-log-length" => o.max_grpc_log_length = parse_int(value)?,
            "feature-gates" => o.feature_gates.extend(parse_gate_list(value)?),
            other => unreachable!("--{other} is in no table"),
        }
        Ok(())
    }
}

/// Upstream's refusal of `--worker-threads=0` (exit 1).
pub const ZERO_WORKERS: &str = "Option -worker-threads must be greater than zero";

/// Checks what upstream refuses after parsing (exit 1), and the leader-election timings
/// upstream would panic on later.
pub fn validate(o: &Options) -> Result<(), String> {
    if o.worker_threads == 0 {
        return Err(ZERO_WORKERS.into());
    }
    o.controller.validate()
}

/// The attacher's feature gates (`pkg/features`), after `--feature-gates`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureGates {
    /// `MutableCSINodeAllocatableCount` (GA, default on): write `attachError.errorCode`.
    pub mutable_csinode_allocatable_count: bool,
    /// `ReleaseLeaderElectionOnExit` (alpha, default off): release the Lease on SIGTERM.
    pub release_leader_election_on_exit: bool,
    /// Gates that were given but have no effect here (apiserver gates, `AllAlpha`, `AllBeta`).
    pub ignored: Vec<String>,
}

impl Default for FeatureGates {
    fn default() -> Self {
        Self {
            mutable_csinode_allocatable_count: true,
            release_leader_election_on_exit: false,
            ignored: Vec::new(),
        }
    }
}

impl FeatureGates {
    /// The gates after `requested` (from [`Options::feature_gates`]); the first unknown name (in
    /// name order) is refused. An unknown name is upstream's "failed to store flag gates", exit 1.
    pub fn from_requested(requested: &BTreeMap<String, bool>) -> Result<Self, UnknownGate> {
        let mut gates = Self::default();
        for (name, &on) in requested {
            match name.as_str() {
                "MutableCSINodeAllocatableCount" => gates.mutable_csinode_allocatable_count = on,
                "ReleaseLeaderElectionOnExit" => gates.release_leader_election_on_exit = on,
                other => other_gate(other, &mut gates.ignored)?,
            }
        }
        Ok(gates)
    }
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
        for own in [
            "csi-address",
            "resync",
            "timeout",
            "retry-interval-start",
            "retry-interval-max",
            "worker-threads",
            "max-entries",
            "default-fstype",
            "reconcile-sync",
            "max-grpc-log-length",
            "feature-gates",
            "automaxprocs",
            "kubeconfig",
            "leader-election",
            "leader-election-namespace",
            "leader-election-lease-duration",
            "leader-election-renew-deadline",
            "leader-election-retry-period",
            "leader-election-labels",
            "kube-api-qps",
            "kube-api-burst",
            "http-endpoint",
            "metrics-address",
            "metrics-path",
            "version",
            "v",
            "vmodule",
            "logging-format",
        ] {
            assert!(names.contains(&own), "--{own} is missing");
        }
    }

    #[test]
    fn defaults_are_upstreams() {
        let f = run(&[]);
        let o = &f.options;
        assert_eq!(o, &Options::default());
        assert_eq!(o.csi_address, "/run/csi/socket");
        assert_eq!(o.timeout, Duration::from_secs(15));
        assert_eq!(o.resync, Duration::from_secs(600));
        assert_eq!(o.retry_interval_start, Duration::from_secs(1));
        assert_eq!(o.retry_interval_max, Duration::from_secs(300));
        assert_eq!(o.worker_threads, 10);
        assert_eq!(o.max_entries, 0);
        assert_eq!(o.default_fstype, "");
        assert_eq!(o.reconcile_sync, Duration::from_secs(60));
        assert_eq!(o.max_grpc_log_length, -1);
        assert_eq!(o.controller.kube_api_qps, 5.0);
        assert_eq!(o.controller.kube_api_burst, 10);
        assert_eq!(o.controller.metrics_path, "/metrics");
        assert!(!o.controller.leader_election && !o.automaxprocs);
        assert!(!f.version && f.legacy.is_empty());
    }

    #[test]
    fn every_flag_is_set_by_its_name_with_one_or_two_dashes() {
        let f = run(&[
            "-csi-address=/x.sock",
            "--resync=1m",
            "-timeout",
            "3s",
            "--retry-interval-start=2s",
            "--retry-interval-max=1m",
            "--worker-threads=3",
            "--max-entries=7",
            "--default-fstype=xfs",
            "--reconcile-sync=0s",
            "--max-grpc-log-length=100",
            "--automaxprocs",
            "-leader-election",
            "--leader-election-namespace=ns",
            "--leader-election-labels=a:b,c:d",
            "--kube-api-qps=20",
            "--kube-api-burst=40",
            "--http-endpoint=:8080",
            "--feature-gates=ReleaseLeaderElectionOnExit=true",
            "-v=5",
        ]);
        let o = &f.options;
        assert_eq!(o.csi_address, "/x.sock");
        assert_eq!(o.resync, Duration::from_secs(60));
        assert_eq!(o.timeout, Duration::from_secs(3));
        assert_eq!(o.retry_interval_start, Duration::from_secs(2));
        assert_eq!(o.retry_interval_max, Duration::from_secs(60));
        assert_eq!(o.worker_threads, 3);
        assert_eq!(o.max_entries, 7);
        assert_eq!(o.default_fstype, "xfs");
        assert_eq!(o.reconcile_sync, Duration::ZERO);
        assert_eq!(o.max_grpc_log_length, 100);
        assert!(o.automaxprocs && o.controller.leader_election);
        assert_eq!(o.controller.leader_election_namespace, "ns");
        assert_eq!(o.controller.leader_election_labels.len(), 2);
        assert_eq!(o.controller.kube_api_qps, 20.0);
        assert_eq!(o.controller.kube_api_burst, 40);
        assert_eq!(o.controller.http_endpoint, ":8080");
        assert_eq!(
            o.feature_gates.get("ReleaseLeaderElectionOnExit"),
            Some(&true)
        );
    }

    #[test]
    fn parse_errors_are_flag_errors() {
        assert!(err(&["--bogus"]).contains("flag provided but not defined: -bogus"));
        assert!(err(&["--timeout=x"]).contains("invalid value"));
        assert!(err(&["--worker-threads=-1"]).contains("invalid value"));
        assert!(err(&["--leader-election-labels=a"]).contains("key:value"));
        assert!(
            err(&["--feature-gates=ReleaseLeaderElectionOnExit=yes"]).contains("invalid value")
        );
        assert_eq!(parse(&["-h"]).unwrap(), Parsed::Help);
    }

    #[test]
    fn zero_workers_and_bad_timings_are_refused_after_parsing() {
        let o = run(&["--worker-threads=0"]).options;
        assert_eq!(validate(&o).unwrap_err(), ZERO_WORKERS);
        assert!(validate(&Options::default()).is_ok());
    }

    #[test]
    fn feature_gates_know_the_attachers_and_ignore_the_apiservers() {
        let gates = |list: &str| FeatureGates::from_requested(&parse_gate_list(list).unwrap());
        let g = gates("").unwrap();
        assert!(g.mutable_csinode_allocatable_count && !g.release_leader_election_on_exit);
        let g = gates("MutableCSINodeAllocatableCount=false,AllAlpha=true").unwrap();
        assert!(!g.mutable_csinode_allocatable_count);
        assert_eq!(g.ignored, vec!["AllAlpha".to_owned()]);
        assert_eq!(
            gates("Bogus=true").unwrap_err().to_string(),
            "unrecognized feature gate: Bogus"
        );
    }

    #[test]
    fn removed_klog_flags_are_accepted_and_listed() {
        let f = run(&["--logtostderr", "-alsologtostderr=false"]);
        assert_eq!(f.legacy, vec!["logtostderr", "alsologtostderr"]);
    }

    #[test]
    fn v1_attacher_flags_are_accepted_with_a_warning() {
        let f = run(&[
            "--connection-timeout=15s",
            "--leader-election-identity=pod-0",
            "--leader-election-type=configmaps",
            "--leader-election",
        ]);
        assert!(f.options.controller.leader_election);
        assert_eq!(f.outdated.len(), 3);
        assert!(f.outdated[2].warning.contains("uses a Lease instead"));
        // Today's gate of the EKS manifest is the attacher's own.
        let f = run(&["--feature-gates=MutableCSINodeAllocatableCount=true"]);
        assert!(FeatureGates::from_requested(&f.options.feature_gates).is_ok());
        assert!(f.outdated.is_empty());
        assert!(err(&["--provisioner=x"]).contains("-provisioner"));
    }
}
