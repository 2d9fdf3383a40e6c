//! The command line of external-health-monitor v0.18.0's
//! `csi-external-health-monitor-controller`, in Go `flag` syntax (`-x` or `--x`): the sidecar
//! kit's skeleton ([`plugreg_sidecar_kit::flags`]: logging, the removed klog flags,
//! `--version`, the controller block of API server, rate limit, leader election and
//! diagnostics server) plus the health monitor's own flags with their types and defaults
//! ([`Options`]).
//!
//! Differences from upstream:
//! - the removed klog flags (`--logtostderr`, ...) are accepted and ignored (with a warning from
//!   `main`) instead of exit 2 (`decisions.md` R1);
//! - the kit's `--master` is accepted and the `KUBECONFIG` environment variable is read, as
//!   every plugreg sidecar does;
//! - `--node-failure-grace` (an extension, default upstream's hard-coded 5 min): how long a
//!   node may be not Ready before the claims of its pods are told;
//! - upstream has no `--feature-gates` flag (its one gate, `ReleaseLeaderElectionOnExit`, is
//!   unreachable); neither has this one, so `--feature-gates` stays a flag error (exit 2).

use std::time::Duration;

use plugreg_sidecar_kit::compat::Upstream;
use plugreg_sidecar_kit::flags::{self as kit, Command, ControllerFlags, SidecarFlags, Syntax};
use plugreg_sidecar_kit::goflag::{Kind, Spec, Value, flag};
use plugreg_sidecar_kit::gosyntax::{SyntaxError, parse_duration, parse_uint};

pub use plugreg_sidecar_kit::flags::parse_labels;
pub use plugreg_sidecar_kit::goflag::{FLAG_ERROR_EXIT, FlagError};

/// The health monitor's command line: Go `flag` syntax, the controller block, its own flags.
pub const COMMAND: Command = Command {
    syntax: Syntax::Go,
    legacy_usage: "Removed klog flag (csi-external-health-monitor-controller no longer registers it): accepted and ignored.",
    version_usage: "Show version.",
    controller: true,
    upstream: Upstream::HealthMonitor,
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
    /// `--csi-address`: the driver socket (`/abs` or `unix://path`).
    pub csi_address: String,
    /// `--automaxprocs` (Go runtime tuning; no effect here).
    pub automaxprocs: bool,
    /// `--monitor-interval`: the ControllerGetVolume path's pause of each worker after each
    /// check.
    pub monitor_interval: Duration,
    /// `--resync`: how often every node is evaluated again (the node watcher).
    pub resync: Duration,
    /// `--timeout`: each Probe, each ControllerGetVolume, one whole ListVolumes pass.
    pub timeout: Duration,
    /// `--list-volumes-interval`: the ListVolumes path's pause after each pass.
    pub list_volumes_interval: Duration,
    /// `--volume-list-add-interval`: how often every driver PV not being checked is queued
    /// (ControllerGetVolume path).
    pub volume_list_add_interval: Duration,
    /// `--node-list-add-interval`: how often every node is queued (node watcher).
    pub node_list_add_interval: Duration,
    /// `--worker-threads`: ControllerGetVolume workers (0 is refused, exit 1).
    pub worker_threads: u64,
    /// `--enable-node-watcher`: events on the claims of pods on a failed node.
    pub enable_node_watcher: bool,
    /// `--node-failure-grace` (an extension): how long a node may be not Ready before it
    /// counts as failed (upstream's hard-coded 5 min).
    pub node_failure_grace: Duration,
}

impl Default for Options {
    fn default() -> Self {
        let secs = Duration::from_secs;
        Self {
            controller: ControllerFlags::default(),
            csi_address: "/run/csi/socket".into(),
            automaxprocs: false,
            monitor_interval: secs(60),
            resync: secs(600),
            timeout: secs(15),
            list_volumes_interval: secs(300),
            volume_list_add_interval: secs(300),
            node_list_add_interval: secs(300),
            worker_threads: 10,
            enable_node_watcher: false,
            node_failure_grace: secs(300),
        }
    }
}

/// The health monitor's own flags (help texts in upstream's words, mended where they are
/// wrong).
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
        "enable-node-watcher",
        Kind::Bool,
        "",
        "",
        "Indicates whether the node watcher is enabled or not.",
    ),
    flag(
        "list-volumes-interval",
        Kind::Duration,
        "duration",
        "5m0s",
        "Time interval for calling ListVolumes RPC to check volumes' health condition",
    ),
    flag(
        "monitor-interval",
        Kind::Duration,
        "duration",
        "1m0s",
        "Interval for controller to check volumes health condition.",
    ),
    flag(
        "node-list-add-interval",
        Kind::Duration,
        "duration",
        "5m0s",
        "Time interval for adding nodes into the node queue",
    ),
    flag(
        "node-failure-grace",
        Kind::Duration,
        "duration",
        "5m0s",
        "How long a node may be not Ready before the claims of its pods get NodeFailed (plugreg extension; upstream has 5 minutes fixed).",
    ),
    flag(
        "resync",
        Kind::Duration,
        "duration",
        "10m0s",
        "Resync interval of the controller.",
    ),
    flag(
        "timeout",
        Kind::Duration,
        "duration",
        "15s",
        "Timeout for waiting for the CSI driver's answers: each Probe, each ControllerGetVolume, one whole ListVolumes pass.",
    ),
    flag(
        "volume-list-add-interval",
        Kind::Duration,
        "duration",
        "5m0s",
        "Time interval for adding volumes into the volume queue",
    ),
    flag(
        "worker-threads",
        Kind::Uint,
        "uint",
        "10",
        "Number of pv monitor worker threads",
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
                    "enable-node-watcher" => self.enable_node_watcher = b,
                    _ => {}
                }
                return Ok(());
            }
            Value::Text(text) => text,
        };
        let o = self;
        match spec.name {
            "csi-address" => o.csi_address = value.to_owned(),
            "monitor-interval" => o.monitor_interval = parse_duration(value)?,
            "resync" => o.resync = parse_duration(value)?,
            "timeout" => o.timeout = parse_duration(value)?,
            "list-volumes-interval" => o.list_volumes_interval = parse_duration(value)?,
            "volume-list-add-interval" => o.volume_list_add_interval = parse_duration(value)?,
            "node-list-add-interval" => o.node_list_add_interval = parse_duration(value)?,
            "node-failure-grace" => o.node_failure_grace = parse_duration(value)?,
            "worker-threads" => o.worker_threads = parse_uint(value)?,
            other => unreachable!("--{other} is in no table"),
        }
        Ok(())
    }
}

/// Upstream's refusal of `--worker-threads=0` (exit 1, once a Kubernetes config was built).
pub const NO_WORKERS: &str = "Option --worker-threads must be greater than zero";

/// Checks what upstream refuses after parsing (exit 1) that needs no Kubernetes config, and
/// what upstream accepts but then fails on: a zero `--list-volumes-interval`,
/// `--volume-list-add-interval` or `--node-list-add-interval` would make upstream's loop spin;
/// here it is refused.
pub fn validate(o: &Options) -> Result<(), String> {
    for (name, d) in [
        ("list-volumes-interval", o.list_volumes_interval),
        ("volume-list-add-interval", o.volume_list_add_interval),
        ("node-list-add-interval", o.node_list_add_interval),
        ("timeout", o.timeout),
    ] {
        if d.is_zero() {
            return Err(format!("Option --{name} must be greater than zero"));
        }
    }
    o.controller.validate()
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
            "monitor-interval",
            "resync",
            "timeout",
            "list-volumes-interval",
            "volume-list-add-interval",
            "node-list-add-interval",
            "worker-threads",
            "enable-node-watcher",
            "v",
            "vmodule",
            "logging-format",
        ] {
            assert!(names.contains(&own), "--{own} is missing");
        }
        assert!(!names.contains(&"feature-gates"));
    }

    #[test]
    fn defaults_are_upstreams() {
        let f = run(&[]);
        let o = &f.options;
        assert_eq!(o, &Options::default());
        let secs = Duration::from_secs;
        assert_eq!(o.csi_address, "/run/csi/socket");
        assert_eq!(o.monitor_interval, secs(60));
        assert_eq!(o.resync, secs(600));
        assert_eq!(o.timeout, secs(15));
        assert_eq!(o.list_volumes_interval, secs(300));
        assert_eq!(o.volume_list_add_interval, secs(300));
        assert_eq!(o.node_list_add_interval, secs(300));
        assert_eq!(o.worker_threads, 10);
        assert!(!o.enable_node_watcher && !o.automaxprocs);
        assert_eq!(o.controller.kube_api_qps, 5.0);
        assert_eq!(o.controller.kube_api_burst, 10);
        assert!(validate(o).is_ok());
    }

    #[test]
    fn every_flag_is_set_by_its_name_with_one_or_two_dashes() {
        let f = run(&[
            "-csi-address=/x.sock",
            "--monitor-interval=5s",
            "-resync",
            "1m",
            "--timeout=3s",
            "--list-volumes-interval=10s",
            "-volume-list-add-interval=20s",
            "--node-list-add-interval=30s",
            "--worker-threads=2",
            "--enable-node-watcher",
            "--automaxprocs",
        ]);
        let o = f.options;
        let secs = Duration::from_secs;
        assert_eq!(o.csi_address, "/x.sock");
        assert_eq!(o.monitor_interval, secs(5));
        assert_eq!(o.resync, secs(60));
        assert_eq!(o.timeout, secs(3));
        assert_eq!(o.list_volumes_interval, secs(10));
        assert_eq!(o.volume_list_add_interval, secs(20));
        assert_eq!(o.node_list_add_interval, secs(30));
        assert_eq!(o.worker_threads, 2);
        assert!(o.enable_node_watcher && o.automaxprocs);
    }

    #[test]
    fn feature_gates_and_bad_values_are_flag_errors() {
        assert!(err(&["--feature-gates=A=true"]).contains("feature-gates"));
        assert!(err(&["--worker-threads=-1"]).contains("worker-threads"));
        assert!(err(&["--timeout=ten"]).contains("timeout"));
    }

    #[test]
    fn zero_intervals_are_refused() {
        let o = Options {
            list_volumes_interval: Duration::ZERO,
            ..Options::default()
        };
        assert_eq!(
            validate(&o).unwrap_err(),
            "Option --list-volumes-interval must be greater than zero"
        );
    }
}
