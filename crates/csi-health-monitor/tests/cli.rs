//! The real `csi-external-health-monitor-controller` binary against the real CSI test driver on
//! a Unix socket: command-line syntax (Go's `flag`), the start-up order, its log lines, exit
//! codes and HTTP endpoint (checklist items 1-5, 20 and 21 of
//! `upstream-external-health-monitor.md` §17, the parts that need no API server).
//!
//! No API server is needed: `--master` builds a kube config without a call, and every step
//! tested here comes before the first API call (or, for the HTTP endpoint and a lost driver,
//! does not depend on one).

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{BIN, DRIVER, driver_config};
use plugreg_csi_test_driver::{Calls, Code, DriverConfig, Failure, Fault, Method, RunningDriver};
use plugreg_testpeers::sidecar::{self, MASTER, SOON, Sidecar as Proc};
use tempfile::TempDir;

const NO_CONTROLLER: &str = "CSI driver does not support Plugin Controller Service, exiting";
const UNUSABLE: &str = "CSI driver does not support Controller ListVolumes and GetVolume service or does not implement VolumeCondition, exiting";

/// Runs the binary to completion; returns (exit code, stdout, stderr).
fn run_to_end(args: &[&str]) -> (i32, String, String) {
    sidecar::run_to_end(BIN, args)
}

/// The arguments of a run against the driver at `socket` without an API server, then `extra`.
fn args(socket: &Path, extra: &[&str]) -> Vec<String> {
    sidecar::csi_args(socket, extra)
}

/// A driver the health monitor can use: both check paths' capabilities.
fn monitorable() -> DriverConfig {
    driver_config(&["vol-a"], true)
}

/// A running test driver on a socket in a temp dir of its own.
struct Driver {
    _dir: TempDir,
    socket: PathBuf,
    running: Option<RunningDriver>,
    calls: Calls,
}

async fn driver(config: DriverConfig) -> Driver {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let calls = config.calls.clone();
    let running = plugreg_csi_test_driver::start(config, &socket)
        .await
        .unwrap();
    Driver {
        _dir: dir,
        socket,
        running: Some(running),
        calls,
    }
}

/// Checklist 1: `--version` (one or two dashes) prints `<argv0> <version>` and exits 0, after
/// the logging options were validated (upstream's order: an alpha logging option is exit 1
/// even with `--version`); removed klog flags and `--automaxprocs` do not stop it.
#[test]
fn version_prints_argv0_and_the_version_after_the_logging_checks() {
    sidecar::assert_prints_version(BIN, plugreg_sidecar_kit::VERSION);
    let (code, out, err) = run_to_end(&["--log-text-split-stream", "--version"]);
    assert_eq!(code, 1, "{err}");
    assert!(out.is_empty());
    assert!(err.contains("LoggingConfiguration is invalid"), "{err}");
    let (code, out, err) = run_to_end(&["--version", "--logtostderr", "--automaxprocs"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, format!("{BIN} {}\n", plugreg_sidecar_kit::VERSION));
}

/// Checklist 1: `-h` is exit 0 and its usage (on stderr, as Go's `flag`) lists every flag of
/// upstream's command line with its type and upstream's default; there is no
/// `--feature-gates`.
#[test]
fn help_is_exit_0_and_lists_every_flag_with_upstreams_default() {
    for help in ["-h", "--help"] {
        let (code, out, err) = run_to_end(&[help]);
        assert_eq!(code, 0, "{help}: {err}");
        assert!(out.is_empty(), "{help}: {out}");
        assert!(err.starts_with(&format!("Usage of {BIN}:")), "{err}");
    }
    let (_, _, usage) = run_to_end(&["-h"]);
    sidecar::assert_usage_defaults(
        &usage,
        &[
            // Standard sidecar flags.
            ("-csi-address string", "(default \"/run/csi/socket\")"),
            ("-kube-api-qps float", "(default 5)"),
            ("-kube-api-burst int", "(default 10)"),
            ("-leader-election-lease-duration duration", "(default 15s)"),
            ("-leader-election-renew-deadline duration", "(default 10s)"),
            ("-leader-election-retry-period duration", "(default 5s)"),
            ("-metrics-path string", "(default \"/metrics\")"),
            // The health monitor's own.
            ("-monitor-interval duration", "(default 1m0s)"),
            ("-resync duration", "(default 10m0s)"),
            ("-timeout duration", "(default 15s)"),
            ("-list-volumes-interval duration", "(default 5m0s)"),
            ("-volume-list-add-interval duration", "(default 5m0s)"),
            ("-node-list-add-interval duration", "(default 5m0s)"),
            ("-worker-threads uint", "(default 10)"),
            // Logging.
            ("-logging-format string", "(default \"text\")"),
            ("-log-flush-frequency duration", "(default 5s)"),
        ],
    );
    sidecar::assert_usage_lists(
        &usage,
        &[
            "-kubeconfig string",
            "-version",
            "-leader-election",
            "-leader-election-namespace string",
            "-leader-election-labels",
            "-http-endpoint string",
            "-metrics-address string",
            "-automaxprocs",
            "-enable-node-watcher",
            "-v value",
            "-vmodule value",
            "-log-text-split-stream",
            "-log-text-info-buffer-size",
            "-log-json-split-stream",
            "-log-json-info-buffer-size",
        ],
    );
    // Flags whose default is the zero value show none, as Go's `flag` prints them.
    for flag in [
        "-kubeconfig string",
        "-http-endpoint string",
        "-enable-node-watcher",
    ] {
        let line = usage.lines().position(|l| l.trim() == flag).unwrap();
        let help = usage.lines().nth(line + 1).unwrap();
        assert!(!help.contains("(default"), "{flag}: {help}");
    }
    assert!(!usage.contains("-feature-gates"), "{usage}");
}

/// Checklist 1: an unknown flag, `--feature-gates` (upstream has none), and bad values are
/// flag errors: Go's message and the usage on stderr, exit 2.
#[test]
fn unknown_flags_feature_gates_and_bad_values_are_exit_2() {
    for (bad, says) in [
        (&["--bogus"][..], "flag provided but not defined: -bogus"),
        (
            &["--feature-gates=ReleaseLeaderElectionOnExit=true"],
            "flag provided but not defined: -feature-gates",
        ),
        (
            &["--leader-election-labels=a"],
            "invalid value \"a\" for flag -leader-election-labels: ",
        ),
        (
            &["--timeout=soon"],
            "invalid value \"soon\" for flag -timeout: ",
        ),
        (
            &["--worker-threads=-1"],
            "invalid value \"-1\" for flag -worker-threads: ",
        ),
        (
            &["--kube-api-burst=many"],
            "invalid value \"many\" for flag -kube-api-burst: ",
        ),
        (
            &["--enable-node-watcher=maybe"],
            "invalid boolean value \"maybe\" for -enable-node-watcher: ",
        ),
    ] {
        let (code, out, err) = run_to_end(bad);
        assert_eq!(code, 2, "{bad:?}: {err}");
        assert!(out.is_empty(), "{bad:?}: {out}");
        assert!(err.starts_with(says), "{bad:?}: {err}");
        assert!(err.contains(&format!("Usage of {BIN}:")), "{bad:?}: {err}");
    }
}

/// Checklist 2: the refusals after parsing, each exit 1 with upstream's text, in upstream's
/// order (both HTTP flags before the Kubernetes config, the config before
/// `--worker-threads`), none reaching the driver; plus this binary's own refusal of zero
/// intervals (upstream would spin).
#[test]
fn start_up_refusals_are_exit_1_with_upstreams_texts() {
    let nowhere = "--csi-address=/nonexistent/csi.sock";
    // Both HTTP flags: the whole message, with upstream's trailing dot; before the config.
    for config in [MASTER, nowhere] {
        let (code, _, err) = run_to_end(&[
            config,
            nowhere,
            "--metrics-address=127.0.0.1:1",
            "--http-endpoint=127.0.0.1:2",
        ]);
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("\"Only one of `--metrics-address` and `--http-endpoint` can be set.\""),
            "{err}"
        );
        assert!(!err.contains("Kubernetes config"), "{err}");
    }
    // Not in a cluster and no kubeconfig: the in-cluster config fails, before the workers.
    let (code, _, err) = run_to_end(&[nowhere, "--worker-threads=0"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("\"Failed to build a Kubernetes config\""),
        "{err}"
    );
    assert!(!err.contains("worker-threads"), "{err}");
    let (code, _, err) = run_to_end(&[MASTER, nowhere, "--worker-threads=0"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("\"Option --worker-threads must be greater than zero\""),
        "{err}"
    );
    // The alpha logging options: the logging gates cannot be enabled.
    for (flag, field) in [
        ("--log-text-split-stream", "options.text.splitStream"),
        (
            "--log-text-info-buffer-size=1Ki",
            "options.text.infoBufferSize",
        ),
        ("--log-json-split-stream", "options.json.splitStream"),
        (
            "--log-json-info-buffer-size=1Ki",
            "options.json.infoBufferSize",
        ),
    ] {
        let (code, _, err) = run_to_end(&[MASTER, nowhere, flag]);
        assert_eq!(code, 1, "{flag}: {err}");
        assert!(err.contains("\"LoggingConfiguration is invalid\""), "{err}");
        assert!(
            err.contains(&format!(
                "{field}: Forbidden: Feature LoggingAlphaOptions is disabled"
            )),
            "{flag}: {err}"
        );
    }
    // This binary's own: intervals of zero.
    for flag in [
        "list-volumes-interval",
        "volume-list-add-interval",
        "node-list-add-interval",
        "timeout",
    ] {
        let (code, _, err) = run_to_end(&[MASTER, nowhere, &format!("--{flag}=0s")]);
        assert_eq!(code, 1, "{flag}: {err}");
        assert!(
            err.contains(&format!("Option --{flag} must be greater than zero")),
            "{flag}: {err}"
        );
    }
}

/// Checklist 1-3 and §3's order: against a usable driver it logs the version, probes, names
/// the driver, starts the HTTP server (upstream's "ServeMux listening" with the address and no
/// path), chooses the check path, each driver call made once; removed klog flags and
/// `--automaxprocs` are accepted with a warning; without leader election SIGTERM is a clean
/// stop (exit 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_in_upstreams_order_and_stops_cleanly() {
    let d = driver(monitorable()).await;
    let addr = sidecar::free_addr();
    let mut p = Proc::spawn(
        BIN,
        &args(
            &d.socket,
            &[
                "--v=5",
                &format!("--http-endpoint={addr}"),
                "--logtostderr",
                "--automaxprocs",
            ],
        ),
    );
    let order = [
        format!("\"Version\" version=\"{}\"", plugreg_sidecar_kit::VERSION),
        "\"Probing CSI driver for readiness\"".to_owned(),
        format!("\"CSI driver name\" driver=\"{DRIVER}\""),
        format!("\"ServeMux listening\" address=\"{addr}\""),
        "\"Checking volume conditions\" mode=\"ListVolumes\"".to_owned(),
    ];
    for line in &order {
        p.wait_for_line(line);
    }
    let log = p.log();
    let at: Vec<usize> = order
        .iter()
        .map(|l| log.find(l.as_str()).unwrap())
        .collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "{at:?}\n{log}");
    let serving = p.wait_for_line("\"ServeMux listening\" address=");
    assert!(!serving.contains("path"), "{serving}");
    assert!(
        log.contains("\"Ignoring removed klog flag: csi-external-health-monitor-controller no longer registers it and it has no effect\" flag=\"logtostderr\""),
        "{log}"
    );
    assert!(log.contains("Ignoring --automaxprocs"), "{log}");
    assert_eq!(d.calls.count(Method::Probe), 1);
    assert_eq!(d.calls.count(Method::GetPluginInfo), 1);
    assert_eq!(d.calls.count(Method::GetPluginCapabilities), 1);
    assert!(d.calls.count(Method::ControllerGetCapabilities) >= 1);
    assert!(p.is_running());
    p.signal("TERM");
    let (code, log) = p.exit();
    assert_eq!(code, 0, "{log}");
}

/// Checklist 3: no socket: it keeps dialling and says "Still connecting" with the address
/// after 10 s, within the 30 s window (the window's end, exit 1, is the kit's
/// `driver::CONNECT_WINDOW` and its unit tests; here the process is killed once the line
/// shows); an address that can never be a socket is exit 1 at once.
#[test]
fn no_socket_keeps_connecting_and_a_bad_address_is_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("never.sock");
    let mut p = Proc::spawn(BIN, &args(&socket, &[]));
    let line = p.wait_for_lines("Still connecting", 1, Duration::from_secs(25));
    assert!(
        line.contains(&format!("unix://{}", socket.display())),
        "{line}"
    );
    assert!(p.is_running(), "{}", p.log());
    drop(p);

    let (code, _, err) = run_to_end(&[MASTER, "--csi-address=tcp://x"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("\"Failed to connect to the CSI driver\""),
        "{err}"
    );
}

/// Checklist 3: a driver that goes away after start-up ends the process: "Lost connection to
/// CSI driver, exiting", exit 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_driver_after_start_is_exit_1() {
    let mut d = driver(monitorable()).await;
    let mut p = Proc::spawn(BIN, &args(&d.socket, &["--v=2"]));
    p.wait_for_line("\"Checking volume conditions\"");
    d.running.take().unwrap().stop().await.unwrap();
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("\"Lost connection to CSI driver, exiting\""),
        "{log}"
    );
}

/// Checklist 4: Probe `ready=false` loops ("CSI driver is not ready", nothing else asked); a
/// Probe past `--timeout` is "CSI driver probe timed out" and is tried again; any other Probe
/// error is exit 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_not_ready_loops_and_other_probe_errors_are_exit_1() {
    let d = driver(DriverConfig {
        ready: false,
        ..monitorable()
    })
    .await;
    let mut p = Proc::spawn(BIN, &args(&d.socket, &[]));
    p.wait_for_lines("\"CSI driver is not ready\"", 2, SOON);
    assert!(p.is_running());
    assert!(d.calls.count(Method::Probe) >= 2);
    assert_eq!(d.calls.count(Method::GetPluginInfo), 0);
    drop(p);

    let mut slow = monitorable();
    slow.faults.insert(
        Method::Probe,
        Fault {
            delay: Some(Duration::from_secs(2)),
            delay_first: Some(1),
            ..Fault::default()
        },
    );
    let d = driver(slow).await;
    let p = Proc::spawn(BIN, &args(&d.socket, &["--v=2", "--timeout=300ms"]));
    p.wait_for_line("\"CSI driver probe timed out\"");
    p.wait_for_line("\"Checking volume conditions\"");
    assert!(d.calls.count(Method::Probe) >= 2);
    drop(p);

    let mut failing = monitorable();
    failing.faults.insert(
        Method::Probe,
        Fault {
            error: Some(Failure::new(Code::Unimplemented, "no probe")),
            ..Fault::default()
        },
    );
    let d = driver(failing).await;
    let mut p = Proc::spawn(BIN, &args(&d.socket, &[]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(log.contains("\"Failed to probe the CSI driver\""), "{log}");
    assert!(
        log.contains("rpc error: code = Unimplemented desc = no probe"),
        "{log}"
    );
    assert_eq!(d.calls.count(Method::GetPluginInfo), 0);
}

/// Checklist 4: the start-up calls have a fixed 1 s, whatever `--timeout` says: a
/// GetPluginInfo answered after 1.2 s is exit 1 ("Failed to get the CSI driver name",
/// DeadlineExceeded), so are capabilities answered that late; an empty name is exit 1 too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_calls_slower_than_a_second_and_an_empty_name_are_exit_1() {
    let late = || Fault {
        delay: Some(Duration::from_millis(1200)),
        ..Fault::default()
    };
    let d = driver(DriverConfig {
        get_plugin_info: late(),
        ..monitorable()
    })
    .await;
    let mut p = Proc::spawn(BIN, &args(&d.socket, &["--timeout=1m"]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("\"Failed to get the CSI driver name\""),
        "{log}"
    );
    assert!(log.contains("DeadlineExceeded"), "{log}");
    assert_eq!(d.calls.count(Method::GetPluginCapabilities), 0);

    let mut slow_caps = monitorable();
    slow_caps
        .faults
        .insert(Method::ControllerGetCapabilities, late());
    let d = driver(slow_caps).await;
    let mut p = Proc::spawn(BIN, &args(&d.socket, &["--timeout=1m"]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains(
            "\"Failed to check whether the CSI driver supports the Controller Service ListVolumes\""
        ),
        "{log}"
    );
    assert!(
        log.contains("failed to get controller capabilities: "),
        "{log}"
    );
    assert!(log.contains("DeadlineExceeded"), "{log}");

    let d = driver(DriverConfig {
        name: String::new(),
        ..monitorable()
    })
    .await;
    let mut p = Proc::spawn(BIN, &args(&d.socket, &[]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("\"Failed to get the CSI driver name\""),
        "{log}"
    );
    assert!(log.contains("driver name is empty"), "{log}");
}

/// Checklist 5: each row of §7.1. A driver without the controller service, or without
/// VOLUME_CONDITION, or with VOLUME_CONDITION but neither LIST_VOLUMES nor GET_VOLUME, is
/// exit 1 with upstream's "..., exiting" text, logged as an error even at the default
/// verbosity (upstream: V(2), silent at `-v=0`); LIST_VOLUMES is preferred over GET_VOLUME,
/// GET_VOLUME alone is the ControllerGetVolume path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_capability_row_chooses_upstreams_path_or_exit() {
    let controller = || DriverConfig {
        name: DRIVER.to_owned(),
        controller: true,
        ..DriverConfig::default()
    };
    // No CONTROLLER_SERVICE: refused before the controller capabilities are asked.
    let d = driver(DriverConfig {
        controller: false,
        list_volumes: true,
        volume_condition: true,
        ..controller()
    })
    .await;
    let mut p = Proc::spawn(BIN, &args(&d.socket, &[]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    let line = log.lines().find(|l| l.contains(NO_CONTROLLER)).unwrap();
    assert!(line.starts_with('E'), "an error at -v=0: {log}");
    assert_eq!(d.calls.count(Method::ControllerGetCapabilities), 0);

    let unusable = [
        ("no VOLUME_CONDITION", true, false, false),
        ("neither LIST_VOLUMES nor GET_VOLUME", false, true, true),
        ("nothing", false, false, false),
    ];
    for (row, list_volumes, volume_condition, no_get_volume) in unusable {
        let d = driver(DriverConfig {
            list_volumes,
            volume_condition,
            no_get_volume,
            ..controller()
        })
        .await;
        let mut p = Proc::spawn(BIN, &args(&d.socket, &[]));
        let (code, log) = p.exit();
        assert_eq!(code, 1, "{row}: {log}");
        let line = log.lines().find(|l| l.contains(UNUSABLE));
        assert!(
            line.is_some_and(|l| l.starts_with('E')),
            "{row}: an error at -v=0: {log}"
        );
        assert!(d.calls.count(Method::ControllerGetCapabilities) >= 1);
    }

    let usable = [
        ("LIST_VOLUMES and GET_VOLUME", true, false, "ListVolumes"),
        ("LIST_VOLUMES alone", true, true, "ListVolumes"),
        ("GET_VOLUME alone", false, false, "GetVolume"),
    ];
    for (row, list_volumes, no_get_volume, mode) in usable {
        let d = driver(DriverConfig {
            list_volumes,
            volume_condition: true,
            no_get_volume,
            ..controller()
        })
        .await;
        let mut p = Proc::spawn(BIN, &args(&d.socket, &["--v=2"]));
        let line = p.wait_for_line("\"Checking volume conditions\"");
        assert!(line.contains(&format!("mode=\"{mode}\"")), "{row}: {line}");
        assert!(p.is_running(), "{row}: {}", p.log());
    }
}

/// Checklist 20 and 21 without an API server: `--http-endpoint` serves `/metrics` at once:
/// `csi_sidecar_operations_seconds` with the full gRPC method path, the gRPC code, the
/// driver's name, and `unknown-driver` for the Probe and GetPluginInfo made before the name
/// was known; `process_start_time_seconds`. `/healthz/leader-election` is served only with
/// `--leader-election` and `--http-endpoint` (200 `ok`), not without `--leader-election`, nor
/// with `--metrics-address` (404 as Go's ServeMux). `--metrics-path` moves the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_endpoint_serves_metrics_and_leader_health_only_with_leader_election() {
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let d = driver(monitorable()).await;
    let serve = |extra: &[&str]| {
        let addr = sidecar::free_addr();
        let mut a = vec![format!("--http-endpoint={addr}")];
        a.extend(extra.iter().map(|s| (*s).to_owned()));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let p = Proc::spawn(BIN, &args(&d.socket, &a));
        (p, addr)
    };

    let (p, addr) = serve(&[]);
    p.wait_for_line("\"ServeMux listening\"");
    let body = sidecar::wait_for_body(addr, "/metrics", "ControllerGetCapabilities");
    for want in [
        "# HELP csi_sidecar_operations_seconds [ALPHA] Container Storage Interface operation duration with gRPC error code status total",
        "# TYPE csi_sidecar_operations_seconds histogram",
        "csi_sidecar_operations_seconds_count{driver_name=\"unknown-driver\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/Probe\"} 1",
        "csi_sidecar_operations_seconds_count{driver_name=\"unknown-driver\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/GetPluginInfo\"} 1",
        &format!(
            "csi_sidecar_operations_seconds_count{{driver_name=\"{DRIVER}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/GetPluginCapabilities\"}} 1"
        ),
        &format!(
            "csi_sidecar_operations_seconds_bucket{{driver_name=\"{DRIVER}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/ControllerGetCapabilities\",le=\"0.1\"}}"
        ),
        "# TYPE process_start_time_seconds gauge",
        "# HELP process_start_time_seconds [ALPHA] Start time of the process since unix epoch in seconds.",
    ] {
        assert!(body.contains(want), "{want} missing:\n{body}");
    }
    // No `migrated` label (csi-lib-utils adds it only for a CSI-migration driver).
    assert!(!body.contains("migrated="), "{body}");
    let start: f64 = body
        .lines()
        .find_map(|l| l.strip_prefix("process_start_time_seconds "))
        .unwrap()
        .parse()
        .unwrap();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        start >= started.floor() - 1.0 && start <= now,
        "{start} not in [{started}, {now}]"
    );
    assert_eq!(
        sidecar::http_get(addr, "/healthz/leader-election"),
        (404, "404 page not found\n".to_owned())
    );
    assert_eq!(sidecar::http_get(addr, "/other").0, 404);
    drop(p);

    let (p, addr) = serve(&["--leader-election"]);
    p.wait_for_line("\"ServeMux listening\"");
    // Not leading yet (no API server): healthy, as client-go's adaptor.
    assert_eq!(
        sidecar::http_get(addr, "/healthz/leader-election"),
        (200, "ok".to_owned())
    );
    drop(p);

    let addr = sidecar::free_addr();
    let p = Proc::spawn(
        BIN,
        &args(
            &d.socket,
            &[
                &format!("--metrics-address={addr}"),
                "--leader-election",
                "--metrics-path=/m",
            ],
        ),
    );
    p.wait_for_line("\"ServeMux listening\"");
    sidecar::wait_for_body(addr, "/m", "csi_sidecar_operations_seconds");
    assert_eq!(sidecar::http_get(addr, "/metrics").0, 404);
    assert_eq!(sidecar::http_get(addr, "/healthz/leader-election").0, 404);
}

/// §3 step 10: an HTTP address that cannot be listened on is exit 1 with upstream's text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_address_in_use_is_exit_1() {
    let d = driver(monitorable()).await;
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let mut p = Proc::spawn(BIN, &args(&d.socket, &[&format!("--http-endpoint={addr}")]));
    let (code, log) = p.exit();
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("\"Failed to start HTTP server at specified address and metrics path\""),
        "{log}"
    );
    assert!(log.contains(&format!("address=\"{addr}\"")), "{log}");
}
