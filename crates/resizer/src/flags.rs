//! The command line of external-resizer v2.2.1, in Go's `flag` syntax (upstream parses with the
//! standard library's `flag` package, not pflag): the sidecar kit's skeleton
//! ([`plugreg_sidecar_kit::flags`]: logging, the removed klog flags, `--version`, the controller
//! block of API server, rate limit, leader election and diagnostics server) plus the resizer's
//! own flags with their types and defaults ([`Options`]) and its feature gates
//! ([`FeatureGates`]).
//!
//! Differences from upstream:
//! - the removed klog flags (`--logtostderr`, ...) are accepted and ignored (with a warning from
//!   `main`) instead of exit 2;
//! - `--timeout`'s help text says what the flag does (upstream's says "Timeout for waiting for
//!   CSI driver socket.", but it is the deadline of every CSI call);
//! - v0.x's `--csiTimeout` is `--timeout` and its `--leader-election-identity` is accepted, each
//!   with a warning (the kit's [`compat`](plugreg_sidecar_kit::compat) rules).

use std::collections::BTreeMap;
use std::time::Duration;

use plugreg_sidecar_kit::compat::Upstream;
use plugreg_sidecar_kit::flags::{
    self as kit, Command, ControllerFlags, SidecarFlags, Syntax, other_gate,
};
use plugreg_sidecar_kit::goflag::{Kind, Spec, Value, flag};
use plugreg_sidecar_kit::gosyntax::{SyntaxError, parse_duration, parse_int};

pub use plugreg_sidecar_kit::flags::{APISERVER_GATES, UnknownGate, parse_gate_list};
pub use plugreg_sidecar_kit::goflag::{FLAG_ERROR_EXIT, FlagError};

/// Exit code of upstream's `klog.Fatalf` (no resizer and no modifier; a failed gate override).
pub const FATAL_EXIT: i32 = 255;

/// The resizer's command line: Go `flag` syntax, the controller block, its own flags.
pub const COMMAND: Command = Command {
    syntax: Syntax::Go,
    legacy_usage: "Removed klog flag (external-resizer no longer registers it): accepted and ignored.",
    version_usage: "Show version.",
    controller: true,
    upstream: Upstream::Resizer,
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
    /// [`FeatureGates::from_requested`].
    pub feature_gates: BTreeMap<String, bool>,
    /// `--csi-address`: the driver socket (`/abs` or `unix://path`).
    pub csi_address: String,
    /// `--automaxprocs` (Go runtime tuning; no effect here).
    pub automaxprocs: bool,
    /// `--resync-period`: how often every claim is looked at again.
    pub resync_period: Duration,
    /// `--workers`: workers of the resize queue and, separately, of the modify queue.
    pub workers: i64,
    /// `--timeout`: deadline of every CSI call.
    pub timeout: Duration,
    /// `--retry-interval-start`: first back-off of a failed claim sync.
    pub retry_interval_start: Duration,
    /// `--retry-interval-max`: back-off cap, and how long an infeasible target is retried
    /// slowly.
    pub retry_interval_max: Duration,
    /// `--handle-volume-inuse-error`: watch pods so that offline-only expansion of a volume in
    /// use is not retried.
    pub handle_volume_inuse_error: bool,
    /// `--extra-modify-metadata`: add the claim and PV names to ControllerModifyVolume's
    /// mutable parameters.
    pub extra_modify_metadata: bool,
}

impl Default for Options {
    fn default() -> Self {
        let secs = Duration::from_secs;
        Self {
            controller: ControllerFlags::default(),
            feature_gates: BTreeMap::new(),
            csi_address: "/run/csi/socket".into(),
            automaxprocs: false,
            resync_period: secs(600),
            workers: 10,
            timeout: secs(10),
            retry_interval_start: secs(1),
            retry_interval_max: secs(300),
            handle_volume_inuse_error: true,
            extra_modify_metadata: false,
        }
    }
}

/// The resizer's own flags (the skeleton's are the kit's).
const SPECS: &[Spec] = &[
    flag(
        "automaxprocs",
        Kind::Bool,
        "",
        "",
        "Set GOMAXPROCS from the container's CPU quota (a Go runtime setting: accepted, no effect here).",
    ),
    flag(
        "csi-address",
        Kind::String,
        "string",
        "/run/csi/socket",
        "Address of the CSI driver socket.",
    ),
    flag(
        "extra-modify-metadata",
        Kind::Bool,
        "",
        "",
        "If set, add pv/pvc metadata to plugin modify requests as parameters.",
    ),
    flag(
        "feature-gates",
        Kind::Value,
        "mapStringBool",
        "",
        "A set of key=value pairs that describe feature gates for alpha/experimental features. Options are:\nAnnotateFsResize=true|false (ALPHA - default=false)\nReleaseLeaderElectionOnExit=true|false (ALPHA - default=false)\nRecoverVolumeExpansionFailure=true|false (GA - default=true)\nVolumeAttributesClass=true|false (GA - default=true)",
    ),
    flag(
        "handle-volume-inuse-error",
        Kind::Bool,
        "",
        "true",
        "Flag to turn on/off capability to handle volume in use error in resizer controller. Defaults to true if not set.",
    ),
    flag(
        "resync-period",
        Kind::Duration,
        "duration",
        "10m0s",
        "Resync period for cache",
    ),
    flag(
        "retry-interval-max",
        Kind::Duration,
        "duration",
        "5m0s",
        "Maximum retry interval of failed volume resize or modify.",
    ),
    flag(
        "retry-interval-start",
        Kind::Duration,
        "duration",
        "1s",
        "Initial retry interval of failed volume resize or modify. It exponentially increases with each failure, up to retry-interval-max.",
    ),
    flag(
        "timeout",
        Kind::Duration,
        "duration",
        "10s",
        "Deadline of each call to the CSI driver (Probe attempt, capabilities, ControllerExpandVolume, ControllerModifyVolume).",
    ),
    flag(
        "workers",
        Kind::Int,
        "int",
        "10",
        "Concurrency to process multiple resize requests (and, separately, as many modify requests).",
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
                    "extra-modify-metadata" => self.extra_modify_metadata = b,
                    "handle-volume-inuse-error" => self.handle_volume_inuse_error = b,
                    other => unreachable!("--{other} is in no table"),
                }
                return Ok(());
            }
            Value::Text(text) => text,
        };
        let o = self;
        match spec.name {
            "csi-address" => o.csi_address = value.to_owned(),
            "resync-period" => o.resync_period = parse_duration(value)?,
            "retry-interval-start" => o.retry_interval_start = parse_duration(value)?,
            "retry-interval-max" => o.retry_interval_max = parse_duration(value)?,
            "timeout" => o.timeout = parse_duration(value)?,
            "workers" => o.workers = parse_int(value)?,
            "feature-gates" => o.feature_gates.extend(parse_gate_list(value)?),
            other => unreachable!("--{other} is in no table"),
        }
        Ok(())
    }
}

/// The resizer's feature gates (`pkg/features`), after `--feature-gates`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureGates {
    /// `RecoverVolumeExpansionFailure` (GA, default on): `allocatedResources`, the resize
    /// status, infeasible handling and recovery by lowering the request; off: the legacy flow.
    pub recover_volume_expansion_failure: bool,
    /// `VolumeAttributesClass` (GA, default on): the modify controller.
    pub volume_attributes_class: bool,
    /// Whether `VolumeAttributesClass` was set explicitly (then discovery does not switch it
    /// off).
    pub volume_attributes_class_explicit: bool,
    /// `AnnotateFsResize` (alpha, default off): the pre-resize capacity annotation on the PV.
    pub annotate_fs_resize: bool,
    /// `ReleaseLeaderElectionOnExit` (alpha, default off).
    pub release_leader_election_on_exit: bool,
    /// Gates that were given but have no effect here (apiserver gates, `AllAlpha`, `AllBeta`).
    pub ignored: Vec<String>,
    /// GA gates set to false (upstream warns that the setting will be removed).
    pub ga_disabled: Vec<String>,
}

impl Default for FeatureGates {
    fn default() -> Self {
        Self {
            recover_volume_expansion_failure: true,
            volume_attributes_class: true,
            volume_attributes_class_explicit: false,
            annotate_fs_resize: false,
            release_leader_election_on_exit: false,
            ignored: Vec::new(),
            ga_disabled: Vec::new(),
        }
    }
}

impl FeatureGates {
    /// The gates after `requested`; the first unknown name (in name order) is an error. An unknown
    /// name is upstream's "Failed to set feature gates", exit 1.
    pub fn from_requested(requested: &BTreeMap<String, bool>) -> Result<Self, UnknownGate> {
        let mut gates = Self::default();
        for (name, &on) in requested {
            match name.as_str() {
                "RecoverVolumeExpansionFailure" => {
                    gates.recover_volume_expansion_failure = on;
                    if !on {
                        gates.ga_disabled.push(name.clone());
                    }
                }
                "VolumeAttributesClass" => {
                    gates.volume_attributes_class = on;
                    gates.volume_attributes_class_explicit = true;
                    if !on {
                        gates.ga_disabled.push(name.clone());
                    }
                }
                "AnnotateFsResize" => gates.annotate_fs_resize = on,
                "ReleaseLeaderElectionOnExit" => gates.release_leader_election_on_exit = on,
                other => other_gate(other, &mut gates.ignored)?,
            }
        }
        Ok(gates)
    }
}

/// The leader-election lock name, as upstream gives it to csi-lib-utils:
/// `external-resizer-<driver>` with the driver name already sanitised (upstream's
/// `"external-resizer-" + util.SanitizeName(leaseHolder)`), so the `LeaderElection` event
/// comes from `external-resizer-hostpath-csi-k8s-io/<host name>`.
pub fn lock_name(driver: &str) -> String {
    format!(
        "external-resizer-{}",
        plugreg_sidecar_kit::leader::sanitize_name(driver)
    )
}

/// The Lease name: the [`lock_name`] sanitised, which changes nothing more
/// (`hostpath.csi.k8s.io` -> `external-resizer-hostpath-csi-k8s-io`).
pub fn lease_name(driver: &str) -> String {
    plugreg_sidecar_kit::leader::sanitize_name(&lock_name(driver))
}

/// The worker count `--workers` asks for (0 or negative: none, as upstream, which starts no
/// worker then).
pub fn workers(o: &Options) -> usize {
    usize::try_from(o.workers.max(0)).unwrap_or(usize::MAX)
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

    #[test]
    fn defaults_are_upstreams() {
        let f = run(&[]);
        let o = &f.options;
        assert_eq!(o.csi_address, "/run/csi/socket");
        assert_eq!(o.resync_period, Duration::from_secs(600));
        assert_eq!(o.workers, 10);
        assert_eq!(o.timeout, Duration::from_secs(10));
        assert_eq!(o.retry_interval_start, Duration::from_secs(1));
        assert_eq!(o.retry_interval_max, Duration::from_secs(300));
        assert!(o.handle_volume_inuse_error);
        assert!(!o.extra_modify_metadata);
        assert_eq!(o.controller.rate_limit(), (5.0, 10));
        assert_eq!(o.controller.metrics_path, "/metrics");
        let gates = FeatureGates::from_requested(&o.feature_gates).unwrap();
        assert_eq!(gates, FeatureGates::default());
        assert!(gates.recover_volume_expansion_failure && gates.volume_attributes_class);
    }

    #[test]
    fn every_upstream_flag_is_known_in_go_syntax() {
        let f = run(&[
            "-csi-address=/x.sock",
            "--resync-period=1m",
            "--workers",
            "3",
            "--timeout=2s",
            "--retry-interval-start=50ms",
            "--retry-interval-max=2s",
            "--handle-volume-inuse-error=false",
            "--extra-modify-metadata",
            "--feature-gates=AnnotateFsResize=true,VolumeAttributesClass=false",
            "--leader-election",
            "--leader-election-namespace=ns",
            "--kube-api-qps=20",
            "--kube-api-burst=30",
            "--http-endpoint=:8080",
            "--automaxprocs",
            "--master=http://127.0.0.1:1",
            "stop-here",
            "--workers=7",
        ]);
        let o = &f.options;
        assert_eq!(o.csi_address, "/x.sock");
        assert_eq!(o.resync_period, Duration::from_secs(60));
        assert_eq!(o.workers, 3);
        assert_eq!(o.retry_interval_start, Duration::from_millis(50));
        assert!(!o.handle_volume_inuse_error);
        assert!(o.extra_modify_metadata && o.automaxprocs);
        assert!(o.controller.leader_election);
        assert_eq!(o.controller.rate_limit(), (20.0, 30));
        let g = FeatureGates::from_requested(&o.feature_gates).unwrap();
        assert!(g.annotate_fs_resize);
        assert!(!g.volume_attributes_class && g.volume_attributes_class_explicit);
        assert_eq!(g.ga_disabled, ["VolumeAttributesClass"]);
        for name in [
            "csi-address",
            "kubeconfig",
            "master",
            "resync-period",
            "workers",
            "timeout",
            "retry-interval-start",
            "retry-interval-max",
            "handle-volume-inuse-error",
            "extra-modify-metadata",
            "feature-gates",
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
            "version",
            "v",
            "vmodule",
        ] {
            assert!(names().any(|n| n == name), "--{name}");
        }
    }

    #[test]
    fn bad_values_and_gates_are_refused() {
        assert!(parse(&["--workers=x"]).is_err());
        assert!(parse(&["--nope"]).is_err());
        assert!(parse(&["--timeout=10"]).is_err());
        let unknown = BTreeMap::from([("Nope".to_owned(), true)]);
        assert_eq!(
            FeatureGates::from_requested(&unknown).unwrap_err(),
            UnknownGate("Nope".into())
        );
        let ignored = BTreeMap::from([("AllAlpha".to_owned(), true)]);
        assert_eq!(
            FeatureGates::from_requested(&ignored).unwrap().ignored,
            ["AllAlpha"]
        );
    }

    #[test]
    fn the_lease_is_named_after_the_driver() {
        assert_eq!(
            lease_name("hostpath.csi.k8s.io"),
            "external-resizer-hostpath-csi-k8s-io"
        );
        assert_eq!(lease_name("a/b_"), "external-resizer-a-b-X");
        assert_eq!(lock_name("a/b_"), "external-resizer-a-b-X");
        assert_eq!(
            lock_name("hostpath.csi.k8s.io"),
            "external-resizer-hostpath-csi-k8s-io"
        );
        let o = Options {
            workers: -3,
            ..Options::default()
        };
        assert_eq!(workers(&o), 0);
    }

    #[test]
    fn csi_timeout_of_v0_is_the_timeout() {
        // csi-cloudscale v1.3.1 and csi-digitalocean v1.3.0 run external-resizer v0.3.0.
        let f = run(&["--v=5", "--csi-address=/s", "--csiTimeout=30s"]);
        assert_eq!(f.options.timeout, Duration::from_secs(30));
        assert_eq!(f.outdated.len(), 1);
        assert!(f.outdated[0].warning.contains("taken as --timeout=30s"));
        let f = run(&["-leader-election-identity=pod-0"]);
        assert_eq!(f.outdated[0].given, "leader-election-identity=pod-0");
        assert!(parse(&["--csiTimeout=30"]).is_err());
    }
}
