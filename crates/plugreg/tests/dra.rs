//! `plugreg dra ...` and the daemon's DRA handler against the example DRA driver, all real
//! processes on real sockets.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use plugreg_testpeers::{LinesFrom, PeerProcess};
use serde_json::Value;

const SOON: Duration = Duration::from_secs(15);

fn dra_driver_bin() -> PathBuf {
    let bin = Path::new(env!("CARGO_BIN_EXE_plugreg"))
        .parent()
        .unwrap()
        .join("plugreg-example-dra-driver");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p plugreg-example-dra-driver`",
        bin.display()
    );
    bin
}

/// Starts the example driver; returns it and its DRA endpoint.
async fn start_driver(dir: &Path, driver: &str) -> (PeerProcess, String) {
    let registry = dir.join("registry");
    std::fs::create_dir_all(&registry).unwrap();
    let mut cmd = Command::new(dra_driver_bin());
    cmd.args(["--driver-name", driver, "--node-name", "node-1"])
        .arg("--registry-dir")
        .arg(&registry)
        .arg("--plugin-dir")
        .arg(dir.join("plugins").join(driver));
    let mut p = PeerProcess::spawn_command("example DRA driver", cmd, LinesFrom::Stdout).unwrap();
    let v = p
        .next_matching(|v| v["event"] == "listening", SOON)
        .await
        .unwrap();
    let ep = v["endpoint"].as_str().unwrap().to_owned();
    (p, ep)
}

fn plugreg(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_plugreg"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn prepare_unprepare_and_health_commands_call_the_driver_as_the_kubelet_would() {
    let dir = tempfile::tempdir().unwrap();
    let (mut driver, ep) = start_driver(dir.path(), "gpu.example.com").await;

    let (code, out, err) = plugreg(&[
        "dra",
        "prepare",
        "--endpoint",
        &ep,
        "--claim",
        "ns/c1/uid-1",
        "--claim",
        "ns/c2/uid-2",
        "-o",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["service"], "v1.DRAPlugin");
    assert_eq!(v["claims"][0]["uid"], "uid-1");
    assert_eq!(v["claims"][0]["devices"][0]["pool"], "node-1");
    assert_eq!(v["claims"][0]["devices"][0]["device"], "dev-0");
    assert_eq!(v["claims"][1]["devices"][0]["device"], "dev-1");
    assert_eq!(
        v["claims"][0]["devices"][0]["cdi_device_ids"],
        serde_json::json!(["gpu.example.com/dev=uid-1"])
    );
    let line = driver
        .next_matching(|v| v["event"] == "NodePrepareResources", SOON)
        .await
        .unwrap();
    assert_eq!(line["claims"][1]["name"], "c2");

    // The same through v1beta1, as a table; idempotent: the same device again.
    let (code, out, err) = plugreg(&[
        "dra",
        "prepare",
        "--endpoint",
        &ep,
        "--claim",
        "ns/c1/uid-1",
        "--service",
        "v1beta1.DRAPlugin",
    ]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0].split_whitespace().collect::<Vec<_>>(),
        ["CLAIM", "UID", "POOL", "DEVICE", "CDI", "ERROR"]
    );
    assert_eq!(
        lines[1].split_whitespace().collect::<Vec<_>>(),
        [
            "c1",
            "uid-1",
            "node-1",
            "dev-0",
            "gpu.example.com/dev=uid-1"
        ]
    );

    let (code, out, err) = plugreg(&[
        "dra",
        "unprepare",
        "--endpoint",
        &ep,
        "--claim",
        "ns/c1/uid-1",
        "-o",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["method"], "NodeUnprepareResources");
    assert_eq!(v["claims"][0]["error"], "");
    driver
        .next_matching(|v| v["event"] == "NodeUnprepareResources", SOON)
        .await
        .unwrap();

    let (code, out, err) = plugreg(&["dra", "health", "--endpoint", &ep, "-o", "json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["devices"].as_array().unwrap().len(), 4);
    assert_eq!(v["devices"][0]["health"], "Healthy");
    let (code, out, _) = plugreg(&["dra", "health", "--endpoint", &ep]);
    assert_eq!(code, 0);
    assert_eq!(
        out.lines()
            .nth(1)
            .unwrap()
            .split_whitespace()
            .collect::<Vec<_>>(),
        ["node-1", "dev-0", "Healthy"],
        "{out}"
    );

    // Bad input: a clear error, no call.
    let (code, _, err) = plugreg(&["dra", "prepare", "--endpoint", &ep, "--claim", "ns/c1"]);
    assert_eq!(code, 2);
    assert!(err.contains("\"ns/c1\" is not NAMESPACE/NAME/UID"), "{err}");
    // Nobody at the socket: Unavailable, exit 1.
    let gone = dir.path().join("none.sock").display().to_string();
    let (code, _, err) = plugreg(&[
        "dra",
        "prepare",
        "--endpoint",
        &gone,
        "--claim",
        "ns/c/u",
        "--timeout",
        "2s",
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("NodePrepareResources: rpc error: code = Unavailable"),
        "{err}"
    );
    driver.terminate().unwrap();
    assert!(driver.wait_exit(SOON).await.unwrap().success());
}

fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(SOON)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    resp.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

#[tokio::test]
async fn the_daemon_shows_each_dra_instance_and_its_device_health() {
    let dir = tempfile::tempdir().unwrap();
    let registry = dir.path().join("registry");
    std::fs::create_dir_all(&registry).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_plugreg"));
    cmd.args(["manager", "--registry-dir"])
        .arg(&registry)
        .args([
            "--http-endpoint",
            "127.0.0.1:0",
            "--plugin-types",
            "DRAPlugin",
            "--log-format",
            "json",
        ]);
    let mut m = PeerProcess::spawn_command("plugreg manager", cmd, LinesFrom::Stderr).unwrap();
    let v = m
        .next_matching(|v| v["message"] == "Starting HTTP server", SOON)
        .await
        .unwrap();
    let addr = v["endpoint"].as_str().unwrap().to_owned();
    let (mut driver, ep) = start_driver(dir.path(), "gpu.example.com").await;
    driver
        .next_matching(|v| v["event"] == "notify" && v["registered"] == true, SOON)
        .await
        .unwrap();

    let deadline = Instant::now() + SOON;
    let details = loop {
        let a = addr.clone();
        let body = tokio::task::spawn_blocking(move || http_get(&a, "/plugins"))
            .await
            .unwrap();
        let v: Value = serde_json::from_str(&body).unwrap();
        let d = v[0]["details"].clone();
        if d["connection"] == "connected" && d["devices"].as_array().is_some_and(|a| a.len() == 4) {
            break v[0].clone();
        }
        assert!(Instant::now() < deadline, "{body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(details["endpoint"], ep.as_str());
    assert_eq!(details["details"]["service"], "v1.DRAPlugin");
    assert_eq!(details["details"]["serving"], true);
    assert_eq!(
        details["details"]["devices"][0],
        serde_json::json!({"pool": "node-1", "device": "dev-0", "health": "Healthy", "message": ""})
    );
    let a = addr.clone();
    let metrics = tokio::task::spawn_blocking(move || http_get(&a, "/metrics"))
        .await
        .unwrap();
    assert!(
        metrics
            .contains(r#"plugreg_dra_instances{driver_name="gpu.example.com",connected="true"} 1"#),
        "{metrics}"
    );
    driver.terminate().unwrap();
    assert!(driver.wait_exit(SOON).await.unwrap().success());
    m.terminate().unwrap();
    assert!(m.wait_exit(SOON).await.unwrap().success());
}

#[test]
fn the_demo_prepares_a_claim_through_a_dra_driver() {
    let (code, out, err) = plugreg(&["demo"]);
    assert_eq!(code, 0, "{err}");
    for want in [
        "[registered] gpu.demo.plugreg.io: service v1.DRAPlugin",
        "[prepared] claim default/gpu-claim -> node-1/dev-0 CDI gpu.demo.plugreg.io/dev=0f1e2d3c-demo",
        "[unprepared] claim default/gpu-claim\n",
    ] {
        assert!(out.contains(want), "demo output lacks {want:?}:\n{out}");
    }
}
