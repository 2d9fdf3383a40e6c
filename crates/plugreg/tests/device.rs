//! `plugreg manager` with device plugins, all real processes: the example device plugin
//! registers through plugins_registry and through kubelet.sock (`--device-plugin-dir`); its
//! devices, a health flip (SIGUSR1), a kill and a restart reach `/plugins` and `/metrics`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use plugreg_testpeers::{LinesFrom, PeerProcess};
use serde_json::Value;

const SOON: Duration = Duration::from_secs(15);

fn device_plugin_bin() -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_plugreg"))
        .parent()
        .unwrap()
        .to_owned();
    let bin = dir.join("plugreg-example-device-plugin");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p plugreg-example-device-plugin` (cargo test --workspace does)",
        bin.display()
    );
    bin
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

/// Polls `/plugins` until the entry named `name` satisfies `pred`.
async fn until_plugin(addr: &str, name: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + SOON;
    loop {
        let a = addr.to_owned();
        let body = tokio::task::spawn_blocking(move || http_get(&a, "/plugins"))
            .await
            .unwrap();
        let all: Value = serde_json::from_str(&body).unwrap();
        if let Some(e) = all
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name && pred(e))
        {
            return e.clone();
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn healthy(e: &Value) -> usize {
    e["details"]["devices"]
        .as_array()
        .map(|d| d.iter().filter(|d| d["health"] == "Healthy").count())
        .unwrap_or(0)
}

async fn start_manager(registry: &Path, device_dir: &Path) -> (PeerProcess, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_plugreg"));
    cmd.args(["manager", "--registry-dir"])
        .arg(registry)
        .arg("--device-plugin-dir")
        .arg(device_dir)
        .args(["--http-endpoint", "127.0.0.1:0", "--log-format", "json"]);
    let mut m = PeerProcess::spawn_command("plugreg manager", cmd, LinesFrom::Stderr).unwrap();
    let v = m
        .next_matching(|v| v["message"] == "Starting HTTP server", SOON)
        .await
        .unwrap();
    (m, v["endpoint"].as_str().unwrap().to_owned())
}

fn start_plugin(args: &[&str], extra: &[(&str, &Path)]) -> PeerProcess {
    let mut cmd = Command::new(device_plugin_bin());
    cmd.args(args);
    for (flag, path) in extra {
        cmd.arg(flag).arg(path);
    }
    PeerProcess::spawn_command("example device plugin", cmd, LinesFrom::Stdout).unwrap()
}

fn usr1(p: &PeerProcess) {
    let ok = Command::new("kill")
        .args(["-USR1", &p.pid().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
}

#[tokio::test]
async fn device_plugins_registered_either_way_show_devices_health_and_restarts() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = tmp.path().join("plugins_registry");
    let device_dir = tmp.path().join("device-plugins");
    let (_manager, addr) = start_manager(&registry, &device_dir).await;
    let kubelet_sock = device_dir.join("kubelet.sock");

    let mut widget = start_plugin(
        &[
            "--resource",
            "example.com/widget",
            "--devices",
            "3",
            "--numa-nodes",
            "2",
        ],
        &[
            ("--registry-dir", &registry),
            ("--socket", &tmp.path().join("widget.sock")),
        ],
    );
    let v = widget
        .next_matching(|v| v["event"] == "registered", SOON)
        .await
        .unwrap();
    assert_eq!(v["via"], "plugins_registry");
    let gadget_args = ["--resource", "example.com/gadget", "--devices", "2"];
    let mut gadget = start_plugin(&gadget_args, &[("--kubelet-socket", &kubelet_sock)]);
    let v = gadget
        .next_matching(|v| v["event"] == "registered", SOON)
        .await
        .unwrap();
    assert_eq!(v["via"], "kubelet.sock");

    let w = until_plugin(&addr, "example.com/widget", "3 healthy widgets", |e| {
        healthy(e) == 3
    })
    .await;
    assert_eq!(w["type"], "DevicePlugin");
    assert_eq!(w["state"], "registered");
    assert_eq!(w["details"]["registered_via"], "plugins_registry");
    assert_eq!(w["details"]["resource"], "example.com/widget");
    assert_eq!(
        w["details"]["options"]["get_preferred_allocation_available"],
        true
    );
    assert_eq!(
        w["details"]["devices"][1],
        serde_json::json!({"id": "widget-1", "health": "Healthy", "topology": [1]})
    );
    let g = until_plugin(&addr, "example.com/gadget", "2 healthy gadgets", |e| {
        healthy(e) == 2
    })
    .await;
    assert_eq!(g["details"]["registered_via"], "kubelet.sock");
    assert_eq!(
        g["socket"],
        device_dir
            .join("example.com_gadget.sock")
            .display()
            .to_string()
    );

    // SIGUSR1 flips widget-0.
    usr1(&widget);
    let v = widget
        .next_matching(|v| v["event"] == "health", SOON)
        .await
        .unwrap();
    assert_eq!(v["id"], "widget-0");
    let w = until_plugin(&addr, "example.com/widget", "widget-0 unhealthy", |e| {
        healthy(e) == 2
    })
    .await;
    assert_eq!(w["details"]["devices"][0]["health"], "Unhealthy");
    let a = addr.clone();
    let m = tokio::task::spawn_blocking(move || http_get(&a, "/metrics"))
        .await
        .unwrap();
    assert!(
        m.contains("plugreg_devices{resource=\"example.com/widget\",health=\"healthy\"} 2\n"),
        "{m}"
    );
    assert!(
        m.contains("plugreg_devices{resource=\"example.com/widget\",health=\"unhealthy\"} 1\n"),
        "{m}"
    );
    assert!(
        m.contains("plugreg_devices{resource=\"example.com/gadget\",health=\"healthy\"} 2\n"),
        "{m}"
    );

    // The classic plugin killed: its devices turn unhealthy and stay listed; restarted: back.
    drop(gadget);
    let g = until_plugin(&addr, "example.com/gadget", "gadgets unhealthy", |e| {
        e["details"]["connected"] == false && healthy(e) == 0
    })
    .await;
    assert_eq!(g["details"]["devices"].as_array().unwrap().len(), 2);
    let mut gadget = start_plugin(&gadget_args, &[("--kubelet-socket", &kubelet_sock)]);
    gadget
        .next_matching(|v| v["event"] == "registered", SOON)
        .await
        .unwrap();
    until_plugin(&addr, "example.com/gadget", "gadgets back", |e| {
        healthy(e) == 2
    })
    .await;

    // The registry plugin killed (its sockets stay behind) and restarted: the stream broke, so
    // its devices turn unhealthy; the new instance re-creates both sockets and is listed again.
    drop(widget);
    until_plugin(&addr, "example.com/widget", "widgets unhealthy", |e| {
        e["details"]["connected"] == false && healthy(e) == 0
    })
    .await;
    let mut widget = start_plugin(
        &[
            "--resource",
            "example.com/widget",
            "--devices",
            "3",
            "--numa-nodes",
            "2",
        ],
        &[
            ("--registry-dir", &registry),
            ("--socket", &tmp.path().join("widget.sock")),
        ],
    );
    widget
        .next_matching(|v| v["event"] == "registered", SOON)
        .await
        .unwrap();
    until_plugin(&addr, "example.com/widget", "widgets back", |e| {
        e["details"]["connected"] == true && healthy(e) == 3
    })
    .await;

    // The registry plugin stopped: SIGTERM removes both of its sockets; the manager deregisters
    // it and it is no longer listed.
    widget.terminate().unwrap();
    assert!(widget.wait_exit(SOON).await.unwrap().success());
    let deadline = Instant::now() + SOON;
    loop {
        let a = addr.clone();
        let body = tokio::task::spawn_blocking(move || http_get(&a, "/plugins"))
            .await
            .unwrap();
        if !body.contains("example.com/widget") {
            break;
        }
        assert!(Instant::now() < deadline, "widget still listed: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gadget.terminate().unwrap();
    assert!(gadget.wait_exit(SOON).await.unwrap().success());
    assert!(!device_dir.join("example.com_gadget.sock").exists());
}

#[test]
fn demo_shows_a_device_plugins_devices_and_a_health_flip() {
    let out = Command::new(env!("CARGO_BIN_EXE_plugreg"))
        .arg("demo")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "DevicePlugin (options, ListAndWatch: devices and health)",
        "3b. A device plugin (3 widgets of example.com/widget) registers through plugins_registry:",
        "   widget-1  Healthy   NUMA 1\n",
        "widget-1 turned unhealthy",
        "   widget-1  Unhealthy NUMA 1\n",
        "plugins_registry/example.com_widget-reg.sock   DevicePlugin",
    ] {
        assert!(text.contains(want), "demo output lacks {want:?}:\n{text}");
    }
}
