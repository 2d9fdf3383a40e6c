//! The `csi-resizer` command line, run as a process: flags, help, version, and the exit codes
//! of upstream's start-up (the driver is the test driver on a temporary Unix socket; no API
//! server is needed before the steps tested here).

use std::process::{Command, Output, Stdio};

use plugreg_csi_test_driver::{DriverConfig, NodeCapability};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_csi-resizer"))
        .args(args)
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn version_comes_before_the_feature_gates() {
    let o = run(&["--version", "--feature-gates=NoSuchGate=true"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.starts_with(env!("CARGO_BIN_EXE_csi-resizer")), "{out}");
    assert!(
        out.trim_end().ends_with(plugreg_sidecar_kit_version()),
        "{out}"
    );
}

fn plugreg_sidecar_kit_version() -> &'static str {
    option_env!("PLUGREG_VERSION").unwrap_or(concat!("v", env!("CARGO_PKG_VERSION")))
}

#[test]
fn help_lists_upstreams_flags_and_exits_0() {
    let o = run(&["-h"]);
    assert_eq!(o.status.code(), Some(0));
    let usage = text(&o);
    for flag in [
        "-csi-address string",
        "-resync-period duration",
        "-workers int",
        "-timeout duration",
        "-retry-interval-start duration",
        "-retry-interval-max duration",
        "-handle-volume-inuse-error",
        "-extra-modify-metadata",
        "-feature-gates mapStringBool",
        "-leader-election",
        "-kube-api-qps",
        "-http-endpoint string",
    ] {
        assert!(usage.contains(flag), "{flag} missing in:\n{usage}");
    }
}

#[test]
fn a_bad_flag_is_exit_2() {
    let o = run(&["--no-such-flag"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("flag provided but not defined: -no-such-flag"));
    assert_eq!(run(&["--workers=many"]).status.code(), Some(2));
}

#[test]
fn both_http_flags_are_exit_1() {
    let o = run(&["--http-endpoint=:1", "--metrics-address=:2"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("Only one of `--metrics-address` and `--http-endpoint` can be set."),
        "{}",
        text(&o)
    );
}

#[test]
fn an_unknown_gate_is_exit_1() {
    let o = run(&["--feature-gates=NoSuchGate=true"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("Failed to set feature gates"),
        "{}",
        text(&o)
    );
}

/// Runs the binary against a test driver configured by `config`, with a kube config that is
/// never contacted before the driver checks (the VolumeAttributesClass probe is skipped by
/// setting its gate).
async fn against_driver(config: impl FnOnce(&mut DriverConfig)) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let mut cfg = DriverConfig {
        data_dir: Some(dir.path().join("volumes")),
        ..DriverConfig::default()
    };
    config(&mut cfg);
    let driver = plugreg_csi_test_driver::start(cfg, &socket).await.unwrap();
    let args = vec![
        format!("--csi-address={}", socket.display()),
        "--master=http://127.0.0.1:1".to_owned(),
        "--feature-gates=VolumeAttributesClass=true".to_owned(),
    ];
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_csi-resizer"))
            .args(&args)
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    driver.stop().await.unwrap();
    out
}

#[tokio::test]
async fn a_driver_that_can_neither_resize_nor_modify_is_exit_255() {
    let o = against_driver(|c| c.controller = true).await;
    assert_eq!(o.status.code(), Some(255), "{}", text(&o));
    let log = text(&o);
    assert!(log.contains("Resize not supported"), "{log}");
    assert!(log.contains("Modify not supported"), "{log}");
    assert!(
        log.contains("CSI driver does not support resize nor modify"),
        "{log}"
    );
}

#[tokio::test]
async fn a_driver_without_the_controller_service_is_exit_1() {
    // Node expansion alone is not enough: upstream needs CONTROLLER_SERVICE too.
    let o = against_driver(|c| c.node_capabilities = vec![NodeCapability::ExpandVolume]).await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let log = text(&o);
    assert!(log.contains("Failed to create CSI resizer"), "{log}");
    assert!(
        log.contains("CSI driver does not support controller service"),
        "{log}"
    );
}
