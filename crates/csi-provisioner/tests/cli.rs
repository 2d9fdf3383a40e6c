//! The real `csi-provisioner` binary against the real CSI test driver on a Unix socket:
//! command-line syntax, the start-up order (§2 steps 1-18), its log lines and exit codes.
//!
//! No API server is needed up to step 18: `--master` builds a kube config without a call.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use plugreg_csi_test_driver::{Code, DriverConfig, Failure, Fault, Method};
use plugreg_testpeers::sidecar::{self, SOON, Sidecar as Proc};

const BIN: &str = env!("CARGO_BIN_EXE_csi-provisioner");
/// A kube config that builds without contacting anything.
const MASTER: &str = "--master=http://127.0.0.1:1";

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
    let mut v = vec![
        MASTER.to_owned(),
        format!("--csi-address={}", socket.display()),
    ];
    v.extend(extra.iter().map(|s| (*s).to_owned()));
    v
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    sidecar::http_get(addr, path)
}

#[test]
fn version_prints_argv0_and_the_version() {
    let (code, out, _) = run_to_end(&["--version"]);
    assert_eq!(code, 0);
    assert_eq!(out, format!("{BIN} v{}\n", env!("CARGO_PKG_VERSION")));
}

#[test]
fn version_comes_after_logging_and_feature_gates() {
    let (code, out, err) = run_to_end(&["--version", "--feature-gates=Bogus=true"]);
    assert_eq!(code, 255, "{err}");
    assert!(out.is_empty());
    assert!(err.contains("unrecognized feature gate: Bogus"), "{err}");
    let (code, out, err) = run_to_end(&["--logging-format=xml", "--version"]);
    assert_eq!(code, 1, "{err}");
    assert!(out.is_empty());
    assert!(err.contains("LoggingConfiguration is invalid"), "{err}");
    // --node-deployment without NODE_NAME is checked before --version too (exit 255).
    let (code, _, err) = run_to_end(&["--node-deployment", "--version"]);
    assert_eq!(code, 255, "{err}");
    assert!(err.contains("NODE_NAME environment variable must be set"));
    // Accepted-and-ignored things do not stop --version.
    let (code, _, err) = run_to_end(&[
        "--version",
        "--logtostderr",
        "--feature-gates=WatchList=true,AllAlpha=false,Topology=false",
    ]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn help_prints_the_usage_and_exits_0() {
    for flag in ["-h", "--help"] {
        let (code, out, err) = run_to_end(&[flag]);
        assert_eq!(code, 0);
        assert!(out.is_empty());
        assert!(err.starts_with(&format!("Usage of {BIN}:\n")), "{err}");
        assert!(err.contains("      --csi-address string"), "{err}");
        assert!(err.contains("  -v, --v Level"), "{err}");
    }
}

#[test]
fn command_line_errors_exit_2_with_the_usage() {
    let cases: &[(&[&str], &str)] = &[
        (&["--bogus"], "unknown flag: --bogus"),
        (
            &["-csi-address=/x"],
            "unknown shorthand flag: 'c' in -csi-address=/x",
        ),
        (
            &["--timeout=10"],
            "invalid argument \"10\" for \"--timeout\" flag",
        ),
        (&["--csi-address"], "flag needs an argument: --csi-address"),
        (&["--leader-election-labels=a"], "key:value"),
        (&["--feature-gates=Topology"], "malformed pair"),
        (&["--worker-threads=-1"], "--worker-threads"),
    ];
    for (args, message) in cases {
        let (code, _, err) = run_to_end(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        let first = err.lines().next().unwrap_or_default();
        assert!(first.contains(message), "{args:?}: {err}");
        assert!(err.contains("Usage of"), "{args:?}: {err}");
    }
}

#[test]
fn both_http_addresses_exit_1() {
    let (code, _, err) = run_to_end(&[MASTER, "--metrics-address=:1", "--http-endpoint=:2"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("only one of `--metrics-address` and `--http-endpoint` can be set."));
    assert!(
        err.contains("\"Version\""),
        "the Version line comes first: {err}"
    );
}

#[test]
fn features_not_supported_yet_exit_1() {
    let (code, _, err) = run_to_end(&[
        MASTER,
        "--feature-gates=CrossNamespaceVolumeDataSource=true",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("CrossNamespaceVolumeDataSource feature gate is not supported"));
}

#[test]
fn settings_upstream_panics_on_later_exit_1_at_start() {
    let (code, _, err) = run_to_end(&[MASTER, "--volume-name-uuid-length=33"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--volume-name-uuid-length=33 is out of range"),
        "{err}"
    );
    let (code, _, err) = run_to_end(&[
        MASTER,
        "--leader-election",
        "--leader-election-lease-duration=10s",
        "--leader-election-renew-deadline=10s",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("must be greater than --leader-election-renew-deadline"),
        "{err}"
    );
}

#[test]
fn no_kube_config_is_fatal() {
    let (code, _, err) = run_to_end(&["--csi-address=/nonexistent.sock"]);
    assert_eq!(code, 255, "{err}");
    assert!(
        err.contains("Building kube configs for running in cluster..."),
        "{err}"
    );
    assert!(err.contains("Failed to create config: "), "{err}");
}

#[test]
fn kubeconfig_env_overrides_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing-kubeconfig");
    let out = Command::new(BIN)
        .args([
            "--kubeconfig=/flag/kubeconfig",
            "--csi-address=/nonexistent.sock",
        ])
        .env("KUBECONFIG", &missing)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(255), "{err}");
    assert!(
        err.contains("Found KUBECONFIG environment variable set, using that.."),
        "{err}"
    );
    assert!(
        err.contains("Either master or kubeconfig specified. building kube config from that..")
    );
    assert!(err.contains(&missing.display().to_string()), "{err}");
    assert!(!err.contains("/flag/kubeconfig"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_against_a_healthy_driver_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let config = controller();
    let calls = config.calls.clone();
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &["--v=2", "positional-arg"]));
    p.wait_for_line("\"Version\" version=");
    p.wait_for_line("Either master or kubeconfig specified. building kube config from that..");
    p.wait_for_line("Probing CSI driver for readiness");
    p.wait_for_line("Detected CSI driver csi.plugreg.test");
    p.wait_for_line(
        "CSI driver does not support PUBLISH_UNPUBLISH_VOLUME, not watching VolumeAttachments",
    );
    assert_eq!(calls.count(Method::Probe), 1);
    assert_eq!(calls.count(Method::GetPluginInfo), 1);
    assert_eq!(calls.count(Method::GetPluginCapabilities), 1);
    assert_eq!(calls.count(Method::ControllerGetCapabilities), 1);
    assert!(p.is_running());
    p.signal("TERM");
    let (code, log) = p.exit();
    assert_eq!(code, 0, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_publish_unpublish_support() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let config = DriverConfig {
        controller_publish: true,
        ..controller()
    };
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let p = Proc::spawn(BIN, &args(&sock, &[]));
    p.wait_for_line("CSI driver supports PUBLISH_UNPUBLISH_VOLUME, watching VolumeAttachments");
    // Upstream's V(2) line is hidden at -v=0.
    assert!(!p.log().contains("Detected CSI driver"), "{}", p.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_not_ready_is_retried_every_second() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let config = DriverConfig {
        ready: false,
        ..controller()
    };
    let calls = config.calls.clone();
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    p.wait_for_lines("CSI driver is not ready", 3, SOON);
    assert!(p.is_running());
    assert!(calls.count(Method::Probe) >= 3);
    assert_eq!(
        calls.count(Method::GetPluginInfo),
        0,
        "nothing after Probe yet"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_timeouts_are_retried_until_the_driver_answers() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let mut config = controller();
    // The first two Probes take longer than --timeout; the third answers at once.
    config.faults.insert(
        Method::Probe,
        Fault {
            delay: Some(Duration::from_secs(5)),
            delay_first: Some(2),
            ..Default::default()
        },
    );
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let p = Proc::spawn(BIN, &args(&sock, &["--timeout=300ms"]));
    p.wait_for_lines("CSI driver probe timed out", 2, SOON);
    p.wait_for_line("not watching VolumeAttachments");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_unimplemented_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let mut config = controller();
    config.faults.insert(
        Method::Probe,
        Fault {
            error: Some(Failure::new(Code::Unimplemented, "no probe here")),
            ..Default::default()
        },
    );
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains(
            "CSI driver probe failed: rpc error: code = Unimplemented desc = no probe here"
        ),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_driver_name_is_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let config = DriverConfig {
        name: String::new(),
        ..controller()
    };
    let _driver = plugreg_csi_test_driver::start(config, &sock).await.unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    let (code, log) = p.exit();
    assert_eq!(code, 255, "{log}");
    assert!(
        log.contains("Error getting CSI driver name: driver name is empty"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_without_controller_service_is_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let _driver = plugreg_csi_test_driver::start(DriverConfig::default(), &sock)
        .await
        .unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    let (code, log) = p.exit();
    assert_eq!(code, 255, "{log}");
    assert!(
        log.contains("Error getting CSI driver capabilities: rpc error: code = Unimplemented"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_driver_after_start_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let driver = plugreg_csi_test_driver::start(controller(), &sock)
        .await
        .unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    p.wait_for_line("not watching VolumeAttachments");
    driver.stop().await.unwrap();
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("Lost connection to CSI driver, exiting"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_socket_may_appear_late() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let p = Proc::spawn(BIN, &args(&sock, &["--v=5"]));
    p.wait_for_line("\"Version\"");
    let _driver = plugreg_csi_test_driver::start(controller(), &sock)
        .await
        .unwrap();
    p.wait_for_line("not watching VolumeAttachments");
}

#[test]
fn no_driver_within_30_seconds_exits_1() {
    // Upstream has no flag for the window: this test waits the real 30 s.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("absent.sock");
    let started = Instant::now();
    let mut p = Proc::spawn(BIN, &args(&sock, &[]));
    let (code, log) = p.exit_within(Duration::from_secs(60));
    assert_eq!(code, 1, "{log}");
    assert!(started.elapsed() >= Duration::from_secs(30), "{log}");
    let shown = format!("unix://{}", sock.display());
    // csi-lib-utils' Info line: `"Still connecting" address="unix:///..."`.
    assert!(
        log.lines()
            .any(|l| l.contains("Still connecting") && l.contains(&shown)),
        "{log}"
    );
    assert!(log.contains("failed to connect to CSI driver"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_endpoint_serves_metrics_and_leader_health() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let _driver = plugreg_csi_test_driver::start(controller(), &sock)
        .await
        .unwrap();
    // A free port (upstream logs the address as given, before it listens: `:0` would not
    // tell where it went).
    let addr = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let p = Proc::spawn(
        BIN,
        &args(
            &sock,
            &[&format!("--http-endpoint={addr}"), "--leader-election"],
        ),
    );
    p.wait_for_line(&format!("ServeMux listening at \\\"{addr}\\\""));
    // Listening follows the log line.
    let deadline = std::time::Instant::now() + SOON;
    while TcpStream::connect(addr).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "nothing listens on {addr}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(get(addr, "/metrics").0, 200);
    assert_eq!(get(addr, "/healthz/leader-election"), (200, "ok".into()));
    assert_eq!(get(addr, "/other").0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_listen_failure_is_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("csi.sock");
    let _driver = plugreg_csi_test_driver::start(controller(), &sock)
        .await
        .unwrap();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let mut p = Proc::spawn(BIN, &args(&sock, &[&format!("--http-endpoint={addr}")]));
    let (code, log) = p.exit();
    assert_eq!(code, 255, "{log}");
    assert!(
        log.contains("Failed to start HTTP server at specified address"),
        "{log}"
    );
}
