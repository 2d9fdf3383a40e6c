//! The real `csi-snapshotter` binary against the real CSI test driver on a Unix socket:
//! command-line syntax (Go's `flag`), the start-up order, its log lines and exit codes.
//!
//! No API server is needed before the controller starts: `--master` builds a kube config
//! without a call, and the start-up steps tested here come before the first API call.

use std::path::Path;

use plugreg_csi_test_driver::{Code, DriverConfig, Failure, Fault, Method};
use plugreg_testpeers::sidecar::{self, MASTER, SOON, Sidecar as Proc};

const BIN: &str = env!("CARGO_BIN_EXE_csi-snapshotter");

/// Runs the binary to completion; returns (exit code, stdout, stderr).
fn run_to_end(args: &[&str]) -> (i32, String, String) {
    sidecar::run_to_end(BIN, args)
}

/// A driver that can snapshot (CREATE_DELETE_SNAPSHOT, LIST_SNAPSHOTS).
fn snapshotting() -> DriverConfig {
    DriverConfig {
        controller: true,
        snapshots: true,
        ..Default::default()
    }
}

fn args(socket: &Path, extra: &[&str]) -> Vec<String> {
    sidecar::csi_args(socket, extra)
}

#[test]
fn version_prints_argv0_and_the_version() {
    sidecar::assert_prints_version(BIN, concat!("v", env!("CARGO_PKG_VERSION")));
}

#[test]
fn an_unknown_feature_gate_is_fatal_255_before_the_version() {
    let (code, out, err) = run_to_end(&["--version", "--feature-gates=Bogus=true"]);
    assert_eq!(code, 255, "{err}");
    assert!(out.is_empty());
    assert!(
        err.contains("Error while parsing feature gates: unrecognized feature gate: Bogus"),
        "{err}"
    );
    let (code, out, err) = run_to_end(&["--logging-format=xml", "--version"]);
    assert_eq!(code, 1, "{err}");
    assert!(out.is_empty());
    assert!(err.contains("LoggingConfiguration is invalid"), "{err}");
    let (code, _, err) = run_to_end(&[
        "--version",
        "--feature-gates=ReleaseLeaderElectionOnExit=true,AllAlpha=false",
        "--automaxprocs",
        "--logtostderr",
    ]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn help_is_exit_0_and_lists_every_flag_with_its_default() {
    let (code, out, err) = run_to_end(&["-h"]);
    assert_eq!(code, 0);
    assert!(out.is_empty());
    sidecar::assert_usage_defaults(
        &err,
        &[
            ("-csi-address", "(default \"/run/csi/socket\")"),
            ("-timeout", "(default 1m0s)"),
            ("-resync-period", "(default 15m0s)"),
            ("-snapshot-name-prefix", "(default \"snapshot\")"),
            ("-snapshot-name-uuid-length", "(default -1)"),
            ("-groupsnapshot-name-prefix", "(default \"groupsnapshot\")"),
            ("-groupsnapshot-name-uuid-length", "(default -1)"),
            ("-retry-interval-start", "(default 1s)"),
            ("-retry-interval-max", "(default 5m0s)"),
            ("-worker-threads", "(default 10)"),
            ("-kube-api-qps", "(default 5)"),
            ("-kube-api-burst", "(default 10)"),
            ("-leader-election-lease-duration", "(default 15s)"),
            ("-metrics-path", "(default \"/metrics\")"),
        ],
    );
    sidecar::assert_usage_lists(
        &err,
        &[
            "-extra-create-metadata",
            "-node-deployment",
            "-feature-gates",
            "-leader-election-labels",
            "-http-endpoint",
            "-metrics-address",
            "-automaxprocs",
        ],
    );
}

#[test]
fn flag_errors_are_exit_2() {
    for bad in [
        &["--bogus"][..],
        &["--leader-election-labels=a"],
        &["--timeout=soon"],
        &["--worker-threads=many"],
        &["--feature-gates=CSIVolumeGroupSnapshot=maybe"],
    ] {
        let (code, _, err) = run_to_end(bad);
        assert_eq!(code, 2, "{bad:?}: {err}");
    }
    let (_, _, err) = run_to_end(&["--bogus"]);
    assert!(
        err.contains("flag provided but not defined: -bogus"),
        "{err}"
    );
}

#[test]
fn start_up_refusals_are_exit_1_or_upstreams_fatal_255() {
    let (code, _, err) = run_to_end(&[MASTER, "--node-deployment", "--leader-election"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("Leader election cannot happen when node-deployment is set to true"),
        "{err}"
    );
    let (code, _, err) = run_to_end(&[MASTER, "--node-deployment"]);
    assert_eq!(code, 255, "{err}");
    assert!(
        err.contains(
            "The NODE_NAME environment variable must be set when using --enable-node-deployment."
        ),
        "{err}"
    );
    let (code, _, err) = run_to_end(&[
        MASTER,
        "--http-endpoint=127.0.0.1:0",
        "--metrics-address=127.0.0.1:0",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("only one of `--metrics-address` and `--http-endpoint` can be set."),
        "{err}"
    );
    let (code, _, err) = run_to_end(&[MASTER, "--snapshot-name-uuid-length=40"]);
    assert_eq!(code, 1, "{err}");
    let (code, _, err) = run_to_end(&[MASTER, "--csi-address=tcp://x"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("error connecting to CSI driver"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_in_upstreams_order_and_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let config = snapshotting();
    let calls = config.calls.clone();
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &["--v=5"]));
    p.wait_for_line("\"Version\" version=");
    p.wait_for_line("\"CSI driver name\" driver=\"csi.plugreg.test\"");
    p.wait_for_line("Probing CSI driver for readiness");
    p.wait_for_line("Starting CSI snapshotter");
    assert_eq!(calls.count(Method::GetPluginInfo), 1);
    assert_eq!(calls.count(Method::Probe), 1);
    assert_eq!(calls.count(Method::ControllerGetCapabilities), 1);
    // Upstream asks no plugin capabilities.
    assert_eq!(calls.count(Method::GetPluginCapabilities), 0);
    // The name comes before the Probe.
    let log = p.log();
    let name_at = log.find("CSI driver name").unwrap();
    let probe_at = log.find("Probing CSI driver for readiness").unwrap();
    assert!(name_at < probe_at, "{log}");
    assert!(p.is_running());
    p.signal("TERM");
    let (code, log) = p.exit();
    assert_eq!(code, 0, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_that_cannot_snapshot_is_exit_1_with_upstreams_text() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let config = DriverConfig {
        controller: true,
        ..Default::default()
    };
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("CSI driver csi.plugreg.test does not support ControllerCreateSnapshot"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_prefix_or_group_prefix_is_exit_1_after_the_capabilities() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let _driver = plugreg_csi_test_driver::start(snapshotting(), &sock)
        .await
        .unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &["--snapshot-name-prefix="]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("Snapshot name prefix cannot be of length 0"),
        "{log}"
    );
    // With the group gate: the driver without a GroupController is said (upstream goes on),
    // then the empty group prefix is refused.
    let mut p = Proc::spawn(
        BIN,
        &args(
            &sock,
            &[
                "--feature-gates=CSIVolumeGroupSnapshot=true",
                "--groupsnapshot-name-prefix=",
            ],
        ),
    );
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    let said = log
        .find("error determining if driver supports create/delete group snapshot operations")
        .unwrap_or_else(|| panic!("{log}"));
    let refused = log
        .find("group snapshot name prefix cannot be of length 0")
        .unwrap_or_else(|| panic!("{log}"));
    assert!(said < refused, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_not_ready_loops_and_unimplemented_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let config = DriverConfig {
        ready: false,
        ..snapshotting()
    };
    let calls = config.calls.clone();
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    p.wait_for_lines("CSI driver is not ready", 2, SOON);
    assert!(p.is_running());
    assert!(calls.count(Method::Probe) >= 2);
    drop(p);

    let sock = dir.path().join("csi-unimpl.sock");
    let mut config = snapshotting();
    config.faults.insert(
        Method::Probe,
        Fault {
            error: Some(Failure::new(Code::Unimplemented, "no probe")),
            ..Fault::default()
        },
    );
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("error waiting for CSI driver to be ready"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_driver_name_is_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let config = DriverConfig {
        name: String::new(),
        ..snapshotting()
    };
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(log.contains("error getting CSI driver name"), "{log}");
    assert!(log.contains("driver name is empty"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_driver_after_start_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let driver = plugreg_csi_test_driver::start(snapshotting(), &sock)
        .await
        .unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    p.wait_for_line("Starting CSI snapshotter");
    driver.stop().await.unwrap();
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("Lost connection to CSI driver, exiting"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_endpoint_serves_metrics_before_the_probe() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let config = DriverConfig {
        ready: false,
        ..snapshotting()
    };
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let addr = sidecar::free_addr();
    let p = Proc::spawn(BIN, &args(&sock, &[&format!("--http-endpoint={addr}")]));
    // The driver never gets ready, yet the metrics are served (the server starts first).
    p.wait_for_lines("CSI driver is not ready", 1, SOON);
    let (code, body) = sidecar::http_get(addr, "/metrics");
    assert_eq!(code, 200);
    assert!(
        body.contains("csi_sidecar_operations_seconds_count{driver_name=\"unknown-driver\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/GetPluginInfo\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("method_name=\"/csi.v1.Identity/Probe\""),
        "{body}"
    );
    // Without --leader-election: no health check.
    assert_eq!(sidecar::http_get(addr, "/healthz/leader-election").0, 404);
}
