//! `plugreg manager` and `plugreg-example-plugin` as real processes: registration, /plugins,
//! /metrics, the plugin's notify lines, deregistration and a clean stop.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

const SOON: Duration = Duration::from_secs(15);

/// A child process whose stdout or stderr JSON lines arrive on a channel.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    name: &'static str,
}

impl Proc {
    fn spawn(name: &'static str, mut cmd: Command, from_stderr: bool) -> Self {
        cmd.stdin(Stdio::null());
        if from_stderr {
            cmd.stderr(Stdio::piped()).stdout(Stdio::null());
        } else {
            cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let stream: Box<dyn Read + Send> = if from_stderr {
            Box::new(child.stderr.take().unwrap())
        } else {
            Box::new(child.stdout.take().unwrap())
        };
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
            name,
        }
    }

    /// The next JSON line matching `pred`, within [`SOON`].
    fn expect(&mut self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + SOON;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if let Ok(v) = serde_json::from_str::<Value>(&line)
                        && pred(&v)
                    {
                        return v;
                    }
                }
                Err(_) => panic!(
                    "{}: no line with {what} within {SOON:?}; saw:\n{}",
                    self.name,
                    self.seen.join("\n")
                ),
            }
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(ok.success());
    }

    fn wait(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + SOON;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "{} did not exit", self.name);
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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

fn start_manager(dir: &Path) -> (Proc, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_plugreg"));
    cmd.args(["manager", "--registry-dir"]).arg(dir).args([
        "--http-endpoint",
        "127.0.0.1:0",
        "--plugin-types",
        "ExamplePlugin,DevicePlugin",
        "--log-format",
        "json",
    ]);
    let mut m = Proc::spawn("plugreg manager", cmd, true);
    let v = m.expect("the HTTP endpoint", |v| {
        v["message"] == "Starting HTTP server"
    });
    let addr = v["endpoint"].as_str().unwrap().to_owned();
    (m, addr)
}

fn start_plugin(dir: &Path, file: &str, plugin_type: &str, name: &str, versions: &str) -> Proc {
    let mut cmd = Command::new(example_plugin_bin());
    cmd.arg("--socket").arg(dir.join(file)).args([
        "--type",
        plugin_type,
        "--name",
        name,
        "--versions",
        versions,
    ]);
    Proc::spawn("example plugin", cmd, false)
}

#[test]
fn manager_and_example_plugin_processes_register_report_and_deregister() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    let (mut manager, addr) = start_manager(&dir);

    let mut good = start_plugin(
        &dir,
        "good.sock",
        "ExamplePlugin",
        "example.com/good",
        "v1beta1,v1beta2",
    );
    let n = good.expect("notify registered=true", |v| v["event"] == "notify");
    assert_eq!(n["registered"], true);
    assert_eq!(n["error"], "");
    assert!(n["ts_ns"].as_u64().unwrap() > 0);
    let sock = dir.join("good.sock");
    let line = manager.expect("a registration line", |v| {
        v["message"] == "plugin registered"
    });
    assert_eq!(line["socket"], sock.display().to_string());
    assert_eq!(line["plugin_type"], "ExamplePlugin");
    assert_eq!(line["name"], "example.com/good");
    assert_eq!(line["endpoint"], sock.display().to_string());
    assert_eq!(line["result"], "registered");

    let mut odd = start_plugin(&dir, "odd.sock", "GadgetPlugin", "example.com/odd", "v1");
    let n = odd.expect("notify registered=false", |v| v["event"] == "notify");
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
        std::thread::sleep(Duration::from_millis(10));
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
    good.signal("TERM");
    assert!(good.wait().success());
    assert!(!sock.exists());
    let line = manager.expect("a deregistration line", |v| {
        v["message"] == "plugin deregistered"
    });
    assert_eq!(line["name"], "example.com/good");
    assert_eq!(line["result"], "deregistered");

    // SIGTERM the manager: clean exit, plugin sockets untouched.
    manager.signal("TERM");
    assert!(manager.wait().success());
    assert!(
        dir.join("odd.sock").exists(),
        "the manager leaves plugin sockets alone"
    );
    odd.signal("INT");
    assert!(odd.wait().success());
    assert!(
        !dir.join("odd.sock").exists(),
        "SIGINT removes the plugin's socket too"
    );
}

#[test]
fn operator_commands_list_inspect_and_probe() {
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
    p.expect("listening", |v| v["event"] == "listening");
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
    p.signal("TERM");
    assert!(p.wait().success());
    assert!(!p.seen.iter().any(|l| l.contains("\"notify\"")));
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
}
