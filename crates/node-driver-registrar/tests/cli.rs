//! The command line of the real binary: Go flag syntax, upstream's exit codes (0, 1, 2) and
//! start-up checks in upstream's order.

mod common;

use std::time::Duration;

use common::{BIN, Proc, run_to_end};

const PATH: &str = "--kubelet-registration-path=/var/lib/kubelet/plugins/x/csi.sock";
const PROBE: &str = "--mode=kubelet-registration-probe";

#[test]
fn version_prints_argv0_and_the_version_and_exits_0() {
    for flag in ["--version", "-version", "-version=true", "--version=1"] {
        let (code, stdout, _) = run_to_end(&[flag]);
        assert_eq!(code, 0, "{flag}");
        assert_eq!(
            stdout,
            format!("{BIN} v{}\n", env!("CARGO_PKG_VERSION")),
            "{flag}"
        );
    }
    // --version wins over every later check, even a missing required flag.
    let (code, _, _) = run_to_end(&["--version", "--health-port=1", "--http-endpoint=:1"]);
    assert_eq!(code, 0);
    let (code, stdout, _) = run_to_end(&["--version=false", PATH, PROBE]);
    assert_eq!(
        (code, stdout.as_str()),
        (0, ""),
        "--version=false turns it off"
    );
}

#[test]
fn help_prints_usage_and_exits_0() {
    for flag in ["-h", "-help", "--help"] {
        let (code, stdout, stderr) = run_to_end(&[flag]);
        assert_eq!(code, 0, "{flag}");
        assert!(stdout.is_empty());
        assert!(
            stderr.starts_with(&format!("Usage of {BIN}:\n")),
            "{stderr}"
        );
        assert!(stderr.contains("  -kubelet-registration-path string"));
        assert!(stderr.contains("  -csi-connect-window duration"));
    }
}

#[test]
fn flag_errors_print_the_go_message_and_usage_and_exit_2() {
    let cases: &[(&[&str], &str)] = &[
        (&["-x"], "flag provided but not defined: -x"),
        (
            &["--metrics-address=:8080"],
            "flag provided but not defined: -metrics-address",
        ),
        (
            &["--leader-election"],
            "flag provided but not defined: -leader-election",
        ),
        (
            &["--timeout=10"],
            "invalid value \"10\" for flag -timeout: parse error",
        ),
        (
            &["--timeout", "1sec"],
            "invalid value \"1sec\" for flag -timeout: parse error",
        ),
        (
            &["--health-port=abc"],
            "invalid value \"abc\" for flag -health-port: parse error",
        ),
        (
            &["-version=yes"],
            "invalid boolean value \"yes\" for -version: parse error",
        ),
        (&["--csi-address"], "flag needs an argument: -csi-address"),
        (&["---x"], "bad flag syntax: ---x"),
    ];
    for (args, message) in cases {
        let (code, stdout, stderr) = run_to_end(args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stdout.is_empty());
        assert!(
            stderr.starts_with(&format!("{message}\nUsage of {BIN}:\n")),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn a_missing_registration_path_exits_1_even_in_probe_mode() {
    for args in [&[][..], &[PROBE][..], &["--csi-address=/x"][..]] {
        let (code, _, stderr) = run_to_end(args);
        assert_eq!(code, 1, "{args:?}");
        assert!(
            stderr.contains("\"kubelet-registration-path is a required parameter\""),
            "{stderr}"
        );
        assert!(stderr.starts_with('E'), "an error line: {stderr}");
    }
}

#[test]
fn probe_mode_exits_0_without_a_word() {
    let (code, stdout, stderr) = run_to_end(&[PATH, PROBE]);
    assert_eq!((code, stdout.as_str(), stderr.as_str()), (0, "", ""));
}

#[test]
fn parsing_stops_at_the_first_non_flag_argument_or_double_dash() {
    for args in [
        &[PATH, PROBE, "positional", "--bogus", "-x"][..],
        &[PATH, PROBE, "--", "--bogus"][..],
        &[
            "-kubelet-registration-path",
            "/p",
            "-mode",
            "kubelet-registration-probe",
            "-",
        ][..],
    ] {
        let (code, _, stderr) = run_to_end(args);
        assert_eq!(code, 0, "{args:?}: {stderr}");
    }
    // The required flag after a positional argument is not seen.
    let (code, _, _) = run_to_end(&[PROBE, "positional", PATH]);
    assert_eq!(code, 1);
}

#[test]
fn health_port_with_http_endpoint_exits_1_after_the_version_lines() {
    let (code, _, stderr) = run_to_end(&[PATH, "--health-port=9809", "--http-endpoint=:9809"]);
    assert_eq!(code, 1);
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(lines[0].contains("\"Version\" version="), "{stderr}");
    assert!(lines[1].contains("\"Running node-driver-registrar\" mode=\"\""));
    assert!(
        lines[2].contains("Only one of `--health-port` and `--http-endpoint` can be set"),
        "{stderr}"
    );
    // A non-positive port means off, so no conflict: the run goes on to the CSI connect.
    let mut p = Proc::spawn(&[
        PATH,
        "--health-port=-1",
        "--http-endpoint=127.0.0.1:0",
        "--csi-address=/nonexistent/csi.sock",
        "--csi-connect-window=100ms",
    ]);
    assert_eq!(p.exit_code(Duration::from_secs(10)), 1);
    assert!(p.log().contains("\"Error connecting to CSI driver\""));
}

#[test]
fn invalid_logging_configuration_exits_1() {
    for flag in [
        "--logging-format=xml",
        "--log-flush-frequency=0",
        "--log-text-split-stream",
        "--log-text-info-buffer-size=1Mi",
        "--log-json-split-stream=true",
        "--log-json-info-buffer-size=512",
    ] {
        let (code, _, stderr) = run_to_end(&[flag, PATH, PROBE]);
        assert_eq!(code, 1, "{flag}");
        assert!(
            stderr.contains("\"LoggingConfiguration is invalid\""),
            "{flag}: {stderr}"
        );
    }
    // Zero values of the alpha options are fine.
    let (code, _, _) = run_to_end(&["--log-text-split-stream=false", PATH, PROBE]);
    assert_eq!(code, 0);
}

#[test]
fn legacy_klog_flags_are_accepted_with_a_warning() {
    let (code, _, stderr) = run_to_end(&[
        "--logtostderr",
        "--alsologtostderr=true",
        "--log-dir=/tmp",
        "--log-file",
        "/tmp/x.log",
        "--log-file-max-size=1800",
        "--skip-headers",
        "--skip-log-headers",
        "--stderrthreshold=INFO",
        "--add-dir-header",
        "--one-output",
        "--log-backtrace-at=main.go:1",
        PATH,
        PROBE,
    ]);
    assert_eq!(code, 0, "{stderr}");
    for flag in [
        "logtostderr",
        "alsologtostderr",
        "log-dir",
        "log-file",
        "log-file-max-size",
        "skip-headers",
        "skip-log-headers",
        "stderrthreshold",
        "add-dir-header",
        "one-output",
        "log-backtrace-at",
    ] {
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with('W') && l.contains(&format!("flag=\"{flag}\""))),
            "{flag}: {stderr}"
        );
    }
}

#[test]
fn deprecated_and_no_op_flags_say_so() {
    let mut p = Proc::spawn(&[
        PATH,
        "--connection-timeout=1m",
        "--enable-pprof",
        "--automaxprocs",
        "--mode=registration",
        "--csi-address=unix:///nonexistent/csi.sock",
        "--csi-connect-window=200ms",
    ]);
    assert_eq!(p.exit_code(Duration::from_secs(10)), 1);
    let log = p.log();
    for line in [
        "\"Running node-driver-registrar\" mode=\"registration\"",
        "\"--connection-timeout is deprecated and will have no effect\"",
        "--enable-pprof has no effect",
        "--automaxprocs has no effect",
        "\"Attempting to open a gRPC connection\" csiAddress=\"unix:///nonexistent/csi.sock\"",
        "\"Error connecting to CSI driver\" err=\"context deadline exceeded\"",
    ] {
        assert!(log.contains(line), "missing {line:?} in:\n{log}");
    }
}

#[test]
fn json_logging_writes_component_base_lines() {
    let mut p = Proc::spawn(&[
        PATH,
        "--logging-format=json",
        "--csi-address=/nonexistent/csi.sock",
        "--csi-connect-window=100ms",
    ]);
    assert_eq!(p.exit_code(Duration::from_secs(10)), 1);
    let log = p.log();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    assert_eq!(lines[0]["msg"], "Version");
    assert_eq!(lines[0]["v"], 0);
    assert!(lines[0]["ts"].as_f64().unwrap() > 1.6e9);
    assert!(lines[0]["caller"].as_str().unwrap().contains(".rs:"));
    let last = lines.last().unwrap();
    assert_eq!(last["msg"], "Error connecting to CSI driver");
    assert_eq!(last["err"], "context deadline exceeded");
    assert!(last.get("v").is_none());
}

#[test]
fn a_csi_address_that_is_not_a_unix_socket_exits_1() {
    let (code, _, stderr) = run_to_end(&[PATH, "--csi-address=localhost:10000"]);
    assert_eq!(code, 1);
    assert!(
        stderr.contains("\"Error connecting to CSI driver\""),
        "{stderr}"
    );
}
