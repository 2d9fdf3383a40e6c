//! The command line and start-up of the real binary: upstream's exit codes (0 help, 1
//! configuration and start-up errors, 2 flag errors) with its messages, and `--version` (a
//! plugreg extension).

mod common;

use std::net::TcpListener;

use common::{DRIVER, Proc, SOON, args, driver, run_to_end};
use plugreg_csi_test_driver::{DriverConfig, Failure, Fault};
use tonic::Code;

#[test]
fn help_is_exit_0_with_the_usage() {
    for h in ["-h", "-help", "--help"] {
        let (code, stdout, stderr) = run_to_end(&[h]);
        assert_eq!(code, 0, "{h}");
        assert!(stdout.is_empty());
        assert!(stderr.starts_with("Usage of "), "{stderr}");
        assert!(stderr.contains("  -probe-timeout duration\n"), "{stderr}");
        assert!(stderr.contains("(default \"9808\")"), "{stderr}");
    }
}

#[test]
fn flag_errors_are_exit_2_with_the_message_and_usage() {
    let cases: &[(&[&str], &str)] = &[
        (&["--bogus"], "flag provided but not defined: -bogus"),
        (&["--timeout=1s"], "flag provided but not defined: -timeout"),
        (
            &["--probe-timeout=soon"],
            "invalid value \"soon\" for flag -probe-timeout: parse error",
        ),
        (&["-v=x"], "invalid value \"x\" for flag -v: parse error"),
        (&["--csi-address"], "flag needs an argument: -csi-address"),
        (&["---x"], "bad flag syntax: ---x"),
    ];
    for (argv, first_line) in cases {
        let (code, _, stderr) = run_to_end(argv);
        assert_eq!(code, 2, "{argv:?}: {stderr}");
        assert_eq!(stderr.lines().next(), Some(*first_line), "{argv:?}");
        assert!(stderr.contains("\nUsage of "), "{argv:?}: {stderr}");
    }
}

#[test]
fn version_prints_the_version() {
    let (code, stdout, _) = run_to_end(&["--version"]);
    assert_eq!(code, 0);
    assert!(
        stdout.trim_end().ends_with(plugreg_livenessprobe::VERSION),
        "{stdout}"
    );
}

#[test]
fn configuration_errors_are_exit_1_with_upstreams_messages() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--logging-format=xml"],
            "\"LoggingConfiguration is invalid\"",
        ),
        (
            &["--log-flush-frequency=0"],
            "\"LoggingConfiguration is invalid\"",
        ),
        (
            &["--health-port=9000", "--http-endpoint=:9001"],
            "\"Only one of `--health-port` and `--http-endpoint` can be explicitly set\"",
        ),
        (
            &["--metrics-address=:9002", "--http-endpoint=:9003"],
            "\"Only one of `--metrics-address` and `--http-endpoint` can be explicitly set\"",
        ),
        (
            &["--csi-address=localhost:10000"],
            "\"Failed to establish connection to CSI driver\"",
        ),
        (
            &["--csi-address=dns:///driver:10000"],
            "only Unix socket addresses",
        ),
    ];
    for (argv, needle) in cases {
        let (code, _, stderr) = run_to_end(argv);
        assert_eq!(code, 1, "{argv:?}: {stderr}");
        assert!(stderr.contains(needle), "{argv:?}: {needle} in {stderr}");
        assert!(stderr.starts_with('E'), "an Error line: {stderr}");
    }
    // --health-port=9808 with --http-endpoint is not detected (as upstream): it goes on.
    let p = Proc::spawn(&[
        "--health-port=9808",
        "--http-endpoint=127.0.0.1:0",
        "--csi-address=/nonexistent/plugreg/csi.sock",
        "-v=2",
    ]);
    p.wait_for_line("\"CSI driver not reachable yet\"", SOON);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_or_failing_driver_name_is_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.sock");
    let failing = dir.path().join("failing.sock");
    let _e = plugreg_csi_test_driver::start(
        DriverConfig {
            name: String::new(),
            ..DriverConfig::default()
        },
        &empty,
    )
    .await
    .unwrap();
    let _f = driver(
        &failing,
        DriverConfig {
            get_plugin_info: Fault {
                error: Some(Failure::new(Code::Unimplemented, "no identity")),
                ..Fault::default()
            },
            ..DriverConfig::default()
        },
    )
    .await;
    for (socket, err) in [
        (&empty, "err=\"driver name is empty\""),
        (
            &failing,
            "err=\"rpc error: code = Unimplemented desc = no identity\"",
        ),
    ] {
        let mut p = Proc::spawn(&args(socket, &[]));
        let (code, log) = tokio::task::spawn_blocking(move || p.exit()).await.unwrap();
        assert_eq!(code, 1, "{log}");
        let line = log
            .lines()
            .find(|l| l.contains("\"Failed to get CSI driver name\""))
            .unwrap_or_else(|| panic!("{log}"));
        assert!(line.contains(err), "{line}");
        assert!(log.contains("\"Calling CSI driver to discover driver name\""));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_that_cannot_bind_is_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let _d = driver(&socket, DriverConfig::default()).await;
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap().to_string();
    for (flag, message) in [
        (
            format!("--metrics-address={busy}"),
            "\"Failed to start prometheus metrics endpoint on specified address and path\"",
        ),
        (
            format!("--health-port={}", taken.local_addr().unwrap().port()),
            "\"Failed to start http server\"",
        ),
    ] {
        // --health-port listens on 0.0.0.0, which a 127.0.0.1 listener on the same port blocks.
        let mut p = Proc::spawn(&[format!("--csi-address={}", socket.display()), flag]);
        let (code, log) = tokio::task::spawn_blocking(move || p.exit()).await.unwrap();
        assert_eq!(code, 1, "{log}");
        assert!(log.contains(message), "{message} in {log}");
        assert!(log.contains(&format!("driver=\"{DRIVER}\"")), "{log}");
    }
}

#[test]
fn legacy_klog_flags_and_automaxprocs_are_accepted_with_a_warning() {
    let p = Proc::spawn(&[
        "--logtostderr",
        "--automaxprocs",
        "--csi-address=/nonexistent/plugreg/csi.sock",
        "--http-endpoint=127.0.0.1:0",
    ]);
    let line = p.wait_for_line("Ignoring legacy klog flag", SOON);
    assert!(
        line.starts_with('W') && line.contains("flag=\"logtostderr\""),
        "{line}"
    );
    p.wait_for_line("Ignoring --automaxprocs", SOON);
}
