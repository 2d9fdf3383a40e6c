//! The churn soak's short form: 2,000 socket create/delete cycles (registrar plugins,
//! bind-then-listen plugins, plugins that die leaving their socket) against the real
//! `plugreg manager` daemon. The end state must hold: every live plugin registered, nothing
//! registered without a live plugin, nothing registered after the clean-up. Memory and speed
//! are the full soak's figures (BENCHMARKS.md), not asserted here.

use std::path::PathBuf;
use std::process::Command;

/// The `plugreg` binary built beside this package's binary (`cargo build -p plugreg`, or any
/// `cargo test --workspace`).
fn plugreg_bin() -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_plugreg-bench"))
        .with_file_name(format!("plugreg{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "the daemon is not built at {}: run `cargo build -p plugreg` first",
        bin.display()
    );
    bin
}

#[test]
fn short_soak_leaves_exactly_the_live_plugins_registered() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_plugreg-bench"))
        .args(["soak", "--cycles", "2000", "--concurrency", "32"])
        .args([
            "--baseline-after",
            "500",
            "--final-live",
            "8",
            "--staying",
            "2",
        ])
        .arg("--json")
        .arg("--manager-bin")
        .arg(plugreg_bin())
        .arg("--work-dir")
        .arg(tmp.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "soak failed: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().expect("a JSON line");
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let end = &v["end"];
    assert_eq!(end["converged"], true, "{v}");
    // Two stay alive from the start, replaced by cycles 999 and 1999, and the 8 started after
    // the last cycle.
    assert_eq!(end["live"], 10, "{v}");
    assert_eq!(
        end["present_but_unregistered"],
        serde_json::json!([]),
        "{v}"
    );
    assert_eq!(end["registered_but_gone"], serde_json::json!([]), "{v}");
    assert!(end["dead_leftovers"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["registered_after_cleanup"], 0, "{v}");
    assert_eq!(v["errors"], serde_json::json!([]), "{v}");
    assert_eq!(v["not_registered"], 0, "{v}");
}
