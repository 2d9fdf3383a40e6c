//! `plugreg manager` and `plugreg-example-plugin` as real processes: registration, /plugins,
//! /metrics, the plugin's notify lines, deregistration and a clean stop.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use plugreg_testpeers::{LinesFrom, PeerProcess};
use serde_json::Value;

const SOON: Duration = Duration::from_secs(15);

/// The next JSON line of `p` matching `pred`.
async fn expect(p: &mut PeerProcess, pred: impl FnMut(&Value) -> bool) -> Value {
    p.next_matching(pred, SOON).await.unwrap()
}

fn example_plugin_bin() -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_plugreg"))
        .parent()
        .unwrap()
        .to_owned();
    let bin = dir.join("plugreg-example-plugin");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p plugreg-example-plugin` (cargo test --workspace does)",
        bin.display()
    );
    bin
}

fn http_get(addr: &str, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(SOON)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp.split(' ').nth(1).unwrap().parse().unwrap();
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

async fn start_manager(dir: &Path) -> (PeerProcess, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_plugreg"));
    cmd.args(["manager", "--registry-dir"]).arg(dir).args([
        "--http-endpoint",
        "127.0.0.1:0",
        "--plugin-types",
        "ExamplePlugin,DevicePlugin",
        "--log-format",
        "json",
    ]);
    let mut m = PeerProcess::spawn_command("plugreg manager", cmd, LinesFrom::Stderr).unwrap();
    let v = expect(&mut m, |v| v["message"] == "Starting HTTP server").await;
    let addr = v["endpoint"].as_str().unwrap().to_owned();
    (m, addr)
}

fn start_plugin(
    dir: &Path,
    file: &str,
    plugin_type: &str,
    name: &str,
    versions: &str,
) -> PeerProcess {
    let mut cmd = Command::new(example_plugin_bin());
    cmd.arg("--socket").arg(dir.join(file)).args([
        "--type",
        plugin_type,
        "--name",
        name,
        "--versions",
        versions,
    ]);
    PeerProcess::spawn_command("example plugin", cmd, LinesFrom::Stdout).unwrap()
}

async fn exits_ok(p: &mut PeerProcess) -> bool {
    p.wait_exit(SOON).await.unwrap().success()
}

#[tokio::test]
async fn manager_and_example_plugin_processes_register_report_and_deregister() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    let (mut manager, addr) = start_manager(&dir).await;

    let mut good = start_plugin(
        &dir,
        "good.sock",
        "ExamplePlugin",
        "example.com/good",
        "v1beta1,v1beta2",
    );
    let n = expect(&mut good, |v| v["event"] == "notify").await;
    assert_eq!(n["registered"], true);
    assert_eq!(n["error"], "");
    assert!(n["ts_ns"].as_u64().unwrap() > 0);
    let sock = dir.join("good.sock");
    let line = expect(&mut manager, |v| v["message"] == "plugin registered").await;
    assert_eq!(line["socket"], sock.display().to_string());
    assert_eq!(line["plugin_type"], "ExamplePlugin");
    assert_eq!(line["name"], "example.com/good");
    assert_eq!(line["endpoint"], sock.display().to_string());
    assert_eq!(line["result"], "registered");

    let mut odd = start_plugin(&dir, "odd.sock", "GadgetPlugin", "example.com/odd", "v1");
    let n = expect(&mut odd, |v| v["event"] == "notify").await;
    assert_eq!(n["registered"], false);
    assert_eq!(
        n["error"],
        format!(
            "RegisterPlugin error -- no handler registered for plugin type: GadgetPlugin at socket {}",
            dir.join("odd.sock").display()
        )
    );

    // Not sockets: ignored, and the daemon keeps serving.
    std::fs::write(dir.join("x.sock"), "not a socket").unwrap();

    // The plugin hears its verdict a moment before the manager records the outcome.
    let deadline = Instant::now() + SOON;
    let plugins = loop {
        let (code, body) = http_get(&addr, "/plugins");
        assert_eq!(code, 200);
        let plugins: Vec<Value> = serde_json::from_str(&body).unwrap();
        let settled = plugins
            .iter()
            .any(|p| p["name"] == "example.com/odd" && p["last_error"].is_string())
            && plugins
                .iter()
                .any(|p| p["name"] == "example.com/good" && p["state"] == "registered");
        if settled {
            break plugins;
        }
        assert!(
            Instant::now() < deadline,
            "/plugins never settled: {plugins:#?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let good_rec = plugins
        .iter()
        .find(|p| p["socket"] == sock.display().to_string())
        .expect("good listed");
    assert_eq!(good_rec["state"], "registered");
    assert_eq!(good_rec["type"], "ExamplePlugin");
    assert_eq!(
        good_rec["versions"],
        serde_json::json!(["v1beta1", "v1beta2"])
    );
    let at = good_rec["registered_at"].as_str().unwrap();
    assert!(
        at.ends_with('Z') && at.len() == "2026-11-21T11:16:39.197526123Z".len(),
        "RFC 3339 with ns: {at}"
    );
    let odd_rec = plugins
        .iter()
        .find(|p| p["name"] == "example.com/odd")
        .expect("odd listed");
    assert!(
        odd_rec["last_error"]
            .as_str()
            .unwrap()
            .contains("no handler registered")
    );
    assert!(
        !plugins
            .iter()
            .any(|p| p["socket"].as_str().unwrap().ends_with("x.sock"))
    );

    let (code, metrics) = http_get(&addr, "/metrics");
    assert_eq!(code, 200);
    let path = sock.display();
    assert!(metrics.contains(&format!("plugin_manager_total_plugins{{socket_path=\"{path}\",state=\"actual_state_of_world\"}} 1")), "{metrics}");
    assert!(metrics.contains("plugreg_registration_failures_total{step=\"no_handler\"}"));
    assert_eq!(http_get(&addr, "/healthz"), (200, "ok".into()));

    // SIGTERM the plugin: it removes its socket; the manager deregisters it.
    good.terminate().unwrap();
    assert!(exits_ok(&mut good).await);
    assert!(!sock.exists());
    let line = expect(&mut manager, |v| v["message"] == "plugin deregistered").await;
    assert_eq!(line["name"], "example.com/good");
    assert_eq!(line["result"], "deregistered");

    // SIGTERM the manager: clean exit, plugin sockets untouched.
    manager.terminate().unwrap();
    assert!(exits_ok(&mut manager).await);
    assert!(
        dir.join("odd.sock").exists(),
        "the manager leaves plugin sockets alone"
    );
    odd.interrupt().unwrap();
    assert!(exits_ok(&mut odd).await);
    assert!(
        !dir.join("odd.sock").exists(),
        "SIGINT removes the plugin's socket too"
    );
}

#[tokio::test]
async fn operator_commands_list_inspect_and_probe() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("reg");
    std::fs::create_dir_all(&dir).unwrap();
    let mut p = start_plugin(
        &dir,
        "dev.sock",
        "DevicePlugin",
        "example.com/gpu",
        "v1beta1",
    );
    expect(&mut p, |v| v["event"] == "listening").await;
    let plugreg = env!("CARGO_BIN_EXE_plugreg");

    let out = Command::new(plugreg)
        .args(["list", "-o", "json", "--registry-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["info"]["name"], "example.com/gpu");
    assert_eq!(rows[0]["info"]["type"], "DevicePlugin");

    let sock = dir.join("dev.sock");
    let out = Command::new(plugreg)
        .args(["inspect", "-o", "json"])
        .arg(&sock)
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["mode"], "700");
    assert_eq!(v["info"]["versions"], serde_json::json!(["v1beta1"]));

    let ok = Command::new(plugreg)
        .arg("probe")
        .arg(format!("unix://{}", sock.display()))
        .output()
        .unwrap();
    assert!(ok.status.success());
    assert!(String::from_utf8_lossy(&ok.stdout).starts_with("ok "));
    let missing = Command::new(plugreg)
        .arg("probe")
        .arg(dir.join("nope.sock"))
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stdout).starts_with("FAIL "));
    // The plugin was only asked, never notified.
    p.terminate().unwrap();
    assert!(exits_ok(&mut p).await);
    assert!(!p.lines().seen().iter().any(|l| l.contains("\"notify\"")));
}

#[test]
fn demo_runs_and_exits_zero() {
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
        "[registered] example.com/widget",
        "[refused]    example.com/gadget",
        "no handler registered for plugin type: GadgetPlugin",
        "[refused]    example.com/legacy",
        "plugin validation failed with err",
        "[registered] csi.demo.plugreg.io",
        "\"csi.volume.kubernetes.io/nodeid\"",
        "[deregistered] example.com/widget",
    ] {
        assert!(text.contains(want), "demo output lacks {want:?}:\n{text}");
    }
    // A clean run logs no error: its plugins stop after the manager's clients of them.
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        !log.lines().any(|l| l.contains(" ERROR ")),
        "the demo logged an error:\n{log}"
    );
}

fn metric(body: &str, name: &str) -> Option<u64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn sighup_rescans_the_registry_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    let (mut manager, addr) = start_manager(&dir).await;
    let (_, body) = http_get(&addr, "/metrics");
    assert_eq!(metric(&body, "plugreg_watcher_rescans_total"), Some(0));
    let pid = manager.pid().to_string();
    let sent = Command::new("kill").args(["-HUP", &pid]).status().unwrap();
    assert!(sent.success());
    expect(&mut manager, |v| {
        v["message"] == "rescanning the registry directory"
    })
    .await;
    let deadline = Instant::now() + SOON;
    loop {
        let (code, body) = http_get(&addr, "/metrics");
        assert_eq!(code, 200);
        if metric(&body, "plugreg_watcher_rescans_total") == Some(1) {
            break;
        }
        assert!(Instant::now() < deadline, "{body}");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (code, body) = http_get(&addr, "/healthz");
    assert_eq!(
        (code, body.as_str()),
        (200, "ok"),
        "SIGHUP does not stop it"
    );
}
