//! The command line of external-snapshotter v8.6.0's `csi-snapshotter`, in Go `flag` syntax
//! (`-x` or `--x`, as upstream parses it): the sidecar kit's skeleton
//! ([`plugreg_sidecar_kit::flags`]: logging, the removed klog flags, `--version`, the
//! controller block of API server, rate limit, leader election and diagnostics server) plus the
//! snapshotter's own flags with their types and defaults ([`Options`]) and its feature gates
//! ([`FeatureGates`]).
//!
//! Differences from upstream:
//! - the removed klog flags (`--logtostderr`, `--alsologtostderr`, ...) are accepted and ignored
//!   (with a warning from `main`) instead of exit 2;
//! - the kit's `--master` is accepted and the `KUBECONFIG` environment variable is read, as
//!   every plugreg sidecar does (upstream has neither: it only adds ways to reach the API
//!   server);
//! - values upstream accepts and then fails on (a Go panic at the first snapshot, or workers
//!   that never start) are refused at start with a clear message, exit 1: a
//!   `--snapshot-name-uuid-length` or `--groupsnapshot-name-uuid-length` outside -1..=32,
//!   `--worker-threads` below 1;
//! - v1.x's `--connection-timeout` and `--snapshotter` are accepted with upstream's old warning,
//!   and v8.0's `--enable-volume-group-snapshots` is the CSIVolumeGroupSnapshot gate (the kit's
//!   [`compat`](plugreg_sidecar_kit::compat) rules).

use std::collections::BTreeMap;
use std::time::Duration;

use plugreg_sidecar_kit::compat::Upstream;
use plugreg_sidecar_kit::flags::{
    self as kit, Command, ControllerFlags, SidecarFlags, Syntax, other_gate,
};
use plugreg_sidecar_kit::goflag::{Kind, Spec, Value, flag};
use plugreg_sidecar_kit::gosyntax::{SyntaxError, parse_duration, parse_int};

pub use plugreg_sidecar_kit::flags::{APISERVER_GATES, UnknownGate, parse_gate_list, parse_labels};
pub use plugreg_sidecar_kit::goflag::{FLAG_ERROR_EXIT, FlagError};

/// The snapshotter's command line: Go `flag` syntax, the controller block, its own flags.
pub const COMMAND: Command = Command {
    syntax: Syntax::Go,
    legacy_usage: "Removed klog flag (csi-snapshotter no longer registers it): accepted and ignored.",
    version_usage: "Show version.",
    controller: true,
    upstream: Upstream::Snapshotter,
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
    /// [`FeatureGates::from_requested`] (an unknown name is upstream's fatal error, exit 255).
    pub feature_gates: BTreeMap<String, bool>,
    /// `--csi-address`: the driver socket (`/abs` or `unix://path`).
    pub csi_address: String,
    /// `--automaxprocs` (Go runtime tuning; no effect here).
    pub automaxprocs: bool,
    /// `--resync-period`: how often every cached content is synced again.
    pub resync_period: Duration,
    /// `--snapshot-name-prefix`: the CSI snapshot name prefix (empty is refused, exit 1).
    pub snapshot_name_prefix: String,
    /// `--snapshot-name-uuid-length`: -1 the whole VolumeSnapshot UID, N its first N hex digits.
    pub snapshot_name_uuid_length: i64,
    /// `--worker-threads`: content workers.
    pub worker_threads: i64,
    /// `--timeout`: deadline of each CSI call group.
    pub timeout: Duration,
    /// `--extra-create-metadata`: VolumeSnapshot and content names in CreateSnapshot parameters.
    pub extra_create_metadata: bool,
    /// `--retry-interval-start`: first back-off of a failed content sync.
    pub retry_interval_start: Duration,
    /// `--retry-interval-max`: back-off cap.
    pub retry_interval_max: Duration,
    /// `--node-deployment`: handle only the contents labelled with this node (`NODE_NAME`).
    pub node_deployment: bool,
    /// `--groupsnapshot-name-prefix`.
    pub groupsnapshot_name_prefix: String,
    /// `--groupsnapshot-name-uuid-length`.
    pub groupsnapshot_name_uuid_length: i64,
}

impl Default for Options {
    fn default() -> Self {
        let secs = Duration::from_secs;
        Self {
            controller: ControllerFlags::default(),
            feature_gates: BTreeMap::new(),
            csi_address: "/run/csi/socket".into(),
            automaxprocs: false,
            resync_period: secs(15 * 60),
            snapshot_name_prefix: "snapshot".into(),
            snapshot_name_uuid_length: -1,
            worker_threads: 10,
            timeout: secs(60),
            extra_create_metadata: false,
            retry_interval_start: secs(1),
            retry_interval_max: secs(300),
            node_deployment: false,
            groupsnapshot_name_prefix: "groupsnapshot".into(),
            groupsnapshot_name_uuid_length: -1,
        }
    }
}

/// The snapshotter's own flags (help texts in upstream's words where they are right).
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
        "extra-create-metadata",
        Kind::Bool,
        "",
        "",
        "If set, add snapshot metadata to plugin snapshot requests as parameters.",
    ),
    flag(
        "feature-gates",
        Kind::Value,
        "mapStringBool",
        "",
        "A set of key=value pairs that describe feature gates for alpha/experimental features. Gates: CSIVolumeGroupSnapshot (beta, default false), ReleaseLeaderElectionOnExit (alpha, default false). The apiserver's gate names, AllAlpha and AllBeta are accepted and ignored.",
    ),
    flag(
        "groupsnapshot-name-prefix",
        Kind::String,
        "string",
        "groupsnapshot",
        "Prefix to apply to the name of a created group snapshot",
    ),
    flag(
        "groupsnapshot-name-uuid-length",
        Kind::Int,
        "int",
        "-1",
        "Length in characters for the generated uuid of a created group snapshot. Defaults behavior is to NOT truncate.",
    ),
    flag(
        "node-deployment",
        Kind::Bool,
        "",
        "",
        "Enables deploying the sidecar controller together with a CSI driver on nodes to manage snapshots for node-local volumes.",
    ),
    flag(
        "resync-period",
        Kind::Duration,
        "duration",
        "15m0s",
        "Resync interval of the controller.",
    ),
    flag(
        "retry-interval-max",
        Kind::Duration,
        "duration",
        "5m0s",
        "Maximum retry interval of failed volume snapshot creation or deletion. Default is 5 minutes.",
    ),
    flag(
        "retry-interval-start",
        Kind::Duration,
        "duration",
        "1s",
        "Initial retry interval of failed volume snapshot creation or deletion. It doubles with each failure, up to retry-interval-max. Default is 1 second.",
    ),
    flag(
        "snapshot-name-prefix",
        Kind::String,
        "string",
        "snapshot",
        "Prefix to apply to the name of a created snapshot",
    ),
    flag(
        "snapshot-name-uuid-length",
        Kind::Int,
        "int",
        "-1",
        "Length in characters for the generated uuid of a created snapshot. Defaults behavior is to NOT truncate.",
    ),
    flag(
        "timeout",
        Kind::Duration,
        "duration",
        "1m0s",
        "The timeout for any RPCs to the CSI driver. Default is 1 minute.",
    ),
    flag(
        "worker-threads",
        Kind::Int,
        "int",
        "10",
        "Number of worker threads.",
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
                match spec.name {
                    "automaxprocs" => self.automaxprocs = b,
                    "extra-create-metadata" => self.extra_create_metadata = b,
                    "node-deployment" => self.node_deployment = b,
                    _ => {}
                }
                return Ok(());
            }
            Value::Text(text) => text,
        };
        let o = self;
        match spec.name {
            "csi-address" => o.csi_address = value.to_owned(),
            "resync-period" => o.resync_period = parse_duration(value)?,
            "snapshot-name-prefix" => o.snapshot_name_prefix = value.to_owned(),
            "snapshot-name-uuid-length" => o.snapshot_name_uuid_length = parse_int(value)?,
            "groupsnapshot-name-prefix" => o.groupsnapshot_name_prefix = value.to_owned(),
            "groupsnapshot-name-uuid-length" => {
                o.groupsnapshot_name_uuid_length = parse_int(value)?;
            }
            "worker-threads" => o.worker_threads = parse_int(value)?,
            "timeout" => o.timeout = parse_duration(value)?,
            "retry-interval-start" => o.retry_interval_start = parse_duration(value)?,
            "retry-interval-max" => o.retry_interval_max = parse_duration(value)?,
            "feature-gates" => o.feature_gates.extend(parse_gate_list(value)?),
            other => unreachable!("--{other} is in no table"),
        }
        Ok(())
    }
}

/// Upstream's refusal of `--node-deployment` with `--leader-election` (exit 1).
pub const NODE_DEPLOYMENT_WITH_LEADER_ELECTION: &str =
    "Leader election cannot happen when node-deployment is set to true";
/// Upstream's refusal of an empty `--snapshot-name-prefix` (exit 1).
pub const EMPTY_PREFIX: &str = "Snapshot name prefix cannot be of length 0";
/// Upstream's refusal of an empty `--groupsnapshot-name-prefix` with the
/// `CSIVolumeGroupSnapshot` gate (exit 1).
pub const EMPTY_GROUP_PREFIX: &str = "group snapshot name prefix cannot be of length 0";
/// Upstream's fatal error for `--node-deployment` without `NODE_NAME` (exit 255).
pub const NO_NODE_NAME: &str =
    "The NODE_NAME environment variable must be set when using --enable-node-deployment.";

/// Checks what upstream refuses after parsing (exit 1), in upstream's order, and what upstream
/// accepts but then fails on (see the module docs).
pub fn validate(o: &Options) -> Result<(), String> {
    if o.node_deployment && o.controller.leader_election {
        return Err(NODE_DEPLOYMENT_WITH_LEADER_ELECTION.into());
    }
    if o.worker_threads < 1 {
        return Err(format!(
            "Option -worker-threads must be greater than zero (got {})",
            o.worker_threads
        ));
    }
    for (name, n) in [
        ("snapshot-name-uuid-length", o.snapshot_name_uuid_length),
        (
            "groupsnapshot-name-uuid-length",
            o.groupsnapshot_name_uuid_length,
        ),
    ] {
        if !(-1..=32).contains(&n) {
            return Err(format!(
                "Option -{name} must be -1 (the whole UID) or 0 to 32 (got {n})"
            ));
        }
    }
    o.controller.validate()
}

/// The snapshotter's feature gates (`pkg/features`), after `--feature-gates`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FeatureGates {
    /// `CSIVolumeGroupSnapshot` (beta, default off): group snapshots.
    pub volume_group_snapshot: bool,
    /// `ReleaseLeaderElectionOnExit` (alpha, default off): release the Lease on SIGTERM.
    pub release_leader_election_on_exit: bool,
    /// Gates that were given but have no effect here (apiserver gates, `AllAlpha`, `AllBeta`).
    pub ignored: Vec<String>,
}

impl FeatureGates {
    /// The gates after `requested` (from [`Options::feature_gates`]); the first unknown name (in
    /// name order) is refused. An unknown name is upstream's "Error while parsing feature gates:
    /// unrecognized feature gate: X", exit 255.
    pub fn from_requested(requested: &BTreeMap<String, bool>) -> Result<Self, UnknownGate> {
        let mut gates = Self::default();
        for (name, &on) in requested {
            match name.as_str() {
                "CSIVolumeGroupSnapshot" => gates.volume_group_snapshot = on,
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
    fn every_upstream_flag_is_there_sorted_and_unique() {
        let names: Vec<_> = names().collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(names, sorted);
        for own in [
            "csi-address",
            "kubeconfig",
            "version",
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
            "automaxprocs",
            "resync-period",
            "snapshot-name-prefix",
            "snapshot-name-uuid-length",
            "worker-threads",
            "timeout",
            "extra-create-metadata",
            "retry-interval-start",
            "retry-interval-max",
            "node-deployment",
            "groupsnapshot-name-prefix",
            "groupsnapshot-name-uuid-length",
            "feature-gates",
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
        assert_eq!(o.resync_period, Duration::from_secs(900));
        assert_eq!(o.snapshot_name_prefix, "snapshot");
        assert_eq!(o.snapshot_name_uuid_length, -1);
        assert_eq!(o.worker_threads, 10);
        assert_eq!(o.timeout, Duration::from_secs(60));
        assert!(!o.extra_create_metadata && !o.node_deployment && !o.automaxprocs);
        assert_eq!(o.retry_interval_start, Duration::from_secs(1));
        assert_eq!(o.retry_interval_max, Duration::from_secs(300));
        assert_eq!(o.groupsnapshot_name_prefix, "groupsnapshot");
        assert_eq!(o.groupsnapshot_name_uuid_length, -1);
        assert_eq!(o.controller.kube_api_qps, 5.0);
        assert_eq!(o.controller.kube_api_burst, 10);
        assert_eq!(o.controller.metrics_path, "/metrics");
        assert!(!o.controller.leader_election);
        assert!(!f.version && f.legacy.is_empty());
        assert!(validate(o).is_ok());
    }

    #[test]
    fn every_flag_is_set_by_its_name_with_one_or_two_dashes() {
        let f = run(&[
            "-csi-address=/x.sock",
            "--resync-period=1m",
            "-timeout",
            "3s",
            "--snapshot-name-prefix=snap",
            "--snapshot-name-uuid-length=8",
            "--groupsnapshot-name-prefix=g",
            "--groupsnapshot-name-uuid-length=4",
            "--retry-interval-start=2s",
            "--retry-interval-max=1m",
            "--worker-threads=3",
            "--extra-create-metadata",
            "-node-deployment=true",
            "--automaxprocs",
            "--kube-api-qps=20",
            "--feature-gates=ReleaseLeaderElectionOnExit=true",
            "-v=5",
        ]);
        let o = &f.options;
        assert_eq!(o.csi_address, "/x.sock");
        assert_eq!(o.resync_period, Duration::from_secs(60));
        assert_eq!(o.timeout, Duration::from_secs(3));
        assert_eq!(o.snapshot_name_prefix, "snap");
        assert_eq!(o.snapshot_name_uuid_length, 8);
        assert_eq!(o.groupsnapshot_name_prefix, "g");
        assert_eq!(o.groupsnapshot_name_uuid_length, 4);
        assert_eq!(o.retry_interval_start, Duration::from_secs(2));
        assert_eq!(o.retry_interval_max, Duration::from_secs(60));
        assert_eq!(o.worker_threads, 3);
        assert!(o.extra_create_metadata && o.node_deployment && o.automaxprocs);
        assert_eq!(o.controller.kube_api_qps, 20.0);
        assert_eq!(
            o.feature_gates.get("ReleaseLeaderElectionOnExit"),
            Some(&true)
        );
    }

    #[test]
    fn parse_errors_are_flag_errors() {
        assert!(err(&["--bogus"]).contains("flag provided but not defined: -bogus"));
        assert!(err(&["--timeout=x"]).contains("invalid value"));
        assert!(err(&["--worker-threads=x"]).contains("invalid value"));
        assert!(err(&["--leader-election-labels=a"]).contains("key:value"));
        assert!(err(&["--feature-gates=CSIVolumeGroupSnapshot=yes"]).contains("invalid value"));
        assert_eq!(parse(&["-h"]).unwrap(), Parsed::Help);
    }

    #[test]
    fn what_upstream_refuses_or_panics_on_is_refused_after_parsing() {
        let o = run(&["--node-deployment", "--leader-election"]).options;
        assert_eq!(
            validate(&o).unwrap_err(),
            NODE_DEPLOYMENT_WITH_LEADER_ELECTION
        );
        let o = run(&["--snapshot-name-uuid-length=33"]).options;
        assert!(
            validate(&o)
                .unwrap_err()
                .contains("-snapshot-name-uuid-length")
        );
        let o = run(&["--snapshot-name-uuid-length=-2"]).options;
        assert!(validate(&o).is_err());
        let o = run(&["--worker-threads=0"]).options;
        assert!(validate(&o).unwrap_err().contains("-worker-threads"));
        let o = run(&["--snapshot-name-uuid-length=0"]).options;
        assert!(validate(&o).is_ok());
    }

    #[test]
    fn feature_gates_know_the_snapshotters_and_ignore_the_apiservers() {
        let gates = |list: &str| FeatureGates::from_requested(&parse_gate_list(list).unwrap());
        let g = gates("").unwrap();
        assert!(!g.volume_group_snapshot && !g.release_leader_election_on_exit);
        let g = gates("CSIVolumeGroupSnapshot=true,AllBeta=true").unwrap();
        assert!(g.volume_group_snapshot);
        assert_eq!(g.ignored, vec!["AllBeta".to_owned()]);
        assert_eq!(
            gates("Bogus=true").unwrap_err().to_string(),
            "unrecognized feature gate: Bogus"
        );
    }

    #[test]
    fn old_snapshotter_flags_are_accepted_as_upstream_last_had_them() {
        // csi-digitalocean v1.0.1 runs csi-snapshotter v1.0.1.
        let f = run(&["--connection-timeout=15s", "--csi-address=/s"]);
        assert_eq!(
            f.outdated[0].warning,
            "Warning: option connection-timeout=\"15s\" is deprecated and has no effect"
        );
        // ceph-csi's chart: v8.0's flag is the CSIVolumeGroupSnapshot gate now.
        let f = run(&["--enable-volume-group-snapshots=false"]);
        let gates = FeatureGates::from_requested(&f.options.feature_gates).unwrap();
        assert!(!gates.volume_group_snapshot);
        let f = run(&["--enable-volume-group-snapshots=true"]);
        let gates = FeatureGates::from_requested(&f.options.feature_gates).unwrap();
        assert!(gates.volume_group_snapshot);
        let f = run(&["--snapshotter=dobs.csi.digitalocean.com"]);
        assert_eq!(f.outdated[0].given, "snapshotter=dobs.csi.digitalocean.com");
    }
}
