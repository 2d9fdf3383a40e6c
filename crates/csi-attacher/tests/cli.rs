//! The real `csi-attacher` binary against the real CSI test driver on a Unix socket:
//! command-line syntax (Go's `flag`), the start-up order, its log lines and exit codes.
//!
//! No API server is needed before the controller starts: `--master` builds a kube config
//! without a call, and the start-up steps tested here come before the first API call.

use std::path::Path;
use std::time::Duration;

use plugreg_csi_test_driver::{Code, DriverConfig, Failure, Fault, Method};
use plugreg_testpeers::sidecar::{self, MASTER, SOON, Sidecar as Proc};

const BIN: &str = env!("CARGO_BIN_EXE_csi-attacher");

/// Runs the binary to completion; returns (exit code, stdout, stderr).
fn run_to_end(args: &[&str]) -> (i32, String, String) {
    sidecar::run_to_end(BIN, args)
}

fn controller() -> DriverConfig {
    DriverConfig {
        controller: true,
        ..Default::default()
    }
}

fn args(socket: &Path, extra: &[&str]) -> Vec<String> {
    sidecar::csi_args(socket, extra)
}

fn publishing() -> DriverConfig {
    DriverConfig {
        controller: true,
        controller_publish: true,
        ..Default::default()
    }
}

#[test]
fn version_prints_argv0_and_the_version() {
    sidecar::assert_prints_version(BIN, concat!("v", env!("CARGO_PKG_VERSION")));
}

#[test]
fn version_comes_after_logging_and_feature_gates() {
    let (code, out, err) = run_to_end(&["--version", "--feature-gates=Bogus=true"]);
    assert_eq!(code, 1, "{err}");
    assert!(out.is_empty());
    assert!(err.contains("failed to store flag gates"), "{err}");
    assert!(err.contains("unrecognized feature gate: Bogus"), "{err}");
    let (code, out, err) = run_to_end(&["--logging-format=xml", "--version"]);
    assert_eq!(code, 1, "{err}");
    assert!(out.is_empty());
    assert!(err.contains("LoggingConfiguration is invalid"), "{err}");
    let (code, _, err) = run_to_end(&[
        "--version",
        "--feature-gates=MutableCSINodeAllocatableCount=false,ReleaseLeaderElectionOnExit=true",
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
            ("-timeout", "(default 15s)"),
            ("-resync", "(default 10m0s)"),
            ("-retry-interval-start", "(default 1s)"),
            ("-retry-interval-max", "(default 5m0s)"),
            ("-worker-threads", "(default 10)"),
            ("-reconcile-sync", "(default 1m0s)"),
            ("-max-grpc-log-length", "(default -1)"),
            ("-kube-api-qps", "(default 5)"),
            ("-kube-api-burst", "(default 10)"),
            ("-leader-election-lease-duration", "(default 15s)"),
            ("-metrics-path", "(default \"/metrics\")"),
        ],
    );
    sidecar::assert_usage_lists(
        &err,
        &[
            "-max-entries",
            "-default-fstype",
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
        &["--worker-threads=-1"],
        &["--leader-election=maybe"],
        &["--feature-gates=ReleaseLeaderElectionOnExit=yes"],
    ] {
        let (code, out, err) = run_to_end(bad);
        assert_eq!(code, 2, "{bad:?}: {err}");
        assert!(out.is_empty());
        assert!(err.contains("Usage of"), "{bad:?}: {err}");
    }
    let (_, _, err) = run_to_end(&["--bogus"]);
    assert!(
        err.starts_with("flag provided but not defined: -bogus"),
        "{err}"
    );
}

#[test]
fn start_up_refusals_are_exit_1() {
    let (code, _, err) = run_to_end(&[MASTER, "--metrics-address=:1", "--http-endpoint=:2"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("Only one of `--metrics-address` and `--http-endpoint` can be set"),
        "{err}"
    );
    let (code, _, err) = run_to_end(&[MASTER, "--worker-threads=0"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("Option -worker-threads must be greater than zero"),
        "{err}"
    );
    // No kubeconfig, not in a cluster.
    let (code, _, err) = run_to_end(&["--csi-address=/nonexistent.sock"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("Failed to build a Kubernetes config"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_against_a_publishing_driver_in_upstreams_order() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let config = publishing();
    let calls = config.calls.clone();
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &["--v=5"]));
    p.wait_for_line("\"Version\" version=");
    p.wait_for_line("Probing CSI driver for readiness");
    p.wait_for_line("\"CSI driver name\" driver=\"csi.plugreg.test\"");
    p.wait_for_line("CSI driver supports ControllerPublishUnpublish, using real CSI handler");
    p.wait_for_line("Starting CSI attacher");
    assert_eq!(calls.count(Method::Probe), 1);
    assert_eq!(calls.count(Method::GetPluginInfo), 1);
    assert_eq!(calls.count(Method::GetPluginCapabilities), 1);
    assert_eq!(calls.count(Method::ControllerGetCapabilities), 1);
    // Without leader election a signal is a clean stop.
    assert!(p.is_running());
    p.signal("TERM");
    let (code, log) = p.exit();
    assert_eq!(code, 0, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_choice_is_logged() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let _driver = plugreg_csi_test_driver::start(controller(), &sock)
        .await
        .unwrap();
    let p = Proc::spawn(BIN, &args(&sock, &["--v=2"]));
    p.wait_for_line(
        "CSI driver does not support ControllerPublishUnpublish, using trivial handler",
    );
    let sock2 = dir.path().join("csi2.sock");
    let config = DriverConfig::default();
    let calls = config.calls.clone();
    let _driver2 = plugreg_csi_test_driver::start(config, &sock2)
        .await
        .unwrap();
    let p2 = Proc::spawn(BIN, &args(&sock2, &["--v=2"]));
    p2.wait_for_line(
        "CSI driver does not support Plugin Controller Service, using trivial handler",
    );
    // Without CONTROLLER_SERVICE, ControllerGetCapabilities is not called.
    assert_eq!(calls.count(Method::ControllerGetCapabilities), 0);
    drop((p, p2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_not_ready_loops_and_unimplemented_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let config = DriverConfig {
        ready: false,
        ..publishing()
    };
    let calls = config.calls.clone();
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    p.wait_for_lines("CSI driver is not ready", 2, SOON);
    assert!(p.is_running());
    assert!(calls.count(Method::Probe) >= 2);
    drop(p);

    let sock = dir.path().join("csi-unimpl.sock");
    let mut config = publishing();
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
    assert!(log.contains("Failed to probe the CSI driver"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_driver_name_is_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let config = DriverConfig {
        name: String::new(),
        ..publishing()
    };
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(log.contains("Failed to get the CSI driver name"), "{log}");
    assert!(log.contains("driver name is empty"), "{log}");
}

/// Capabilities answered after more than the fixed 1 s are a start-up failure (upstream's
/// shared 1 s deadline), even with a long `--timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_capabilities_are_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let mut config = publishing();
    config.faults.insert(
        Method::ControllerGetCapabilities,
        Fault {
            delay: Some(Duration::from_millis(1500)),
            ..Fault::default()
        },
    );
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &["--timeout=1m"]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("Failed to controller capability check"),
        "{log}"
    );
    assert!(log.contains("DeadlineExceeded"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_driver_after_start_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let driver = plugreg_csi_test_driver::start(publishing(), &sock)
        .await
        .unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    p.wait_for_line("Starting CSI attacher");
    driver.stop().await.unwrap();
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("Lost connection to CSI driver, exiting"),
        "{log}"
    );
}

#[test]
fn connect_failure_names_the_address() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("never.sock");
    // A socket path whose directory does not exist never appears: the 30 s window still
    // applies, so only the message is checked on a path that is refused outright.
    let (code, _, err) = run_to_end(&[MASTER, "--csi-address=tcp://x"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("Failed to connect to the CSI driver"), "{err}");
    drop(sock);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_endpoint_serves_metrics_with_the_driver_name() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let _driver = plugreg_csi_test_driver::start(publishing(), &sock)
        .await
        .unwrap();
    let addr = sidecar::free_addr();
    let p = Proc::spawn(BIN, &args(&sock, &[&format!("--http-endpoint={addr}")]));
    // The line after the bind (the kit logs "ServeMux listening at" before it).
    p.wait_for_line("\"ServeMux listening\" address=");
    let want = "csi_sidecar_operations_seconds_count{driver_name=\"csi.plugreg.test\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/ControllerGetCapabilities\"} 1";
    let body = sidecar::wait_for_body(addr, "/metrics", want);
    assert!(
        body.contains("csi_sidecar_operations_seconds_count{driver_name=\"csi.plugreg.test\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/GetPluginCapabilities\"} 1"),
        "{body}"
    );
    // Probe went out before the name was known.
    assert!(body.contains("driver_name=\"unknown-driver\""), "{body}");
    // Without --leader-election: no health check.
    assert_eq!(sidecar::http_get(addr, "/healthz/leader-election").0, 404);
}
