//! The REAL example plugin (v1.20.2 `pluginwatcher.NewTestExamplePlugin`, Go) against
//! `plugreg manager` as a process.

use std::path::Path;
use std::time::Duration;

use plugreg_interop::workspace_bin;
use plugreg_testpeers::{EXAMPLE_PLUGIN, PeerProcess};

const WAIT: Duration = Duration::from_secs(30);

/// `plugreg manager` with JSON logs on stderr.
struct Manager {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<serde_json::Value>,
    seen: Vec<String>,
}

impl Manager {
    fn start(dir: &Path) -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new(workspace_bin("plugreg"))
            .args(["manager", "--registry-dir"])
            .arg(dir)
            .args([
                "--plugin-types",
                "ExamplePlugin,DevicePlugin",
                "--log-format",
                "json",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                let v = serde_json::from_str(&line).unwrap_or(serde_json::Value::String(line));
                if tx.send(v).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    fn expect(&mut self, message: &str, socket: &Path) -> serde_json::Value {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(v) => {
                    self.seen.push(v.to_string());
                    if v["message"] == message && v["socket"] == socket.display().to_string() {
                        return v;
                    }
                }
                Err(_) => panic!(
                    "plugreg manager: no {message:?} for {socket:?}; saw:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn real_plugin(socket: &Path, name: &str, plugin_type: &str) -> PeerProcess {
    PeerProcess::spawn(
        EXAMPLE_PLUGIN,
        [
            "--socket".as_ref(),
            socket.as_os_str(),
            "--name".as_ref(),
            name.as_ref(),
            "--type".as_ref(),
            plugin_type.as_ref(),
            "--versions".as_ref(),
            "v1beta1,v1beta2".as_ref(),
        ],
    )
    .expect("the real example plugin")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_example_plugin_registers_with_plugreg_manager_and_is_deregistered() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    std::fs::create_dir_all(&dir).unwrap();
    let mut manager = Manager::start(&dir);
    let socket = dir.join("real-example.sock");
    let mut plugin = real_plugin(&socket, "real-example", "ExamplePlugin");

    // Our example handler dials the real plugin and calls GetExampleInfo v1beta1 and v1beta2.
    let line = manager.expect("plugin registered", &socket);
    assert_eq!(line["plugin_type"], "ExamplePlugin");
    assert_eq!(line["name"], "real-example");
    assert_eq!(line["endpoint"], socket.display().to_string());
    let n = plugin
        .next_event("notify", WAIT)
        .await
        .expect("the real plugin's notify line");
    assert_eq!(n["registered"], true, "{n}");
    assert_eq!(n["error"], "", "{n}");

    plugin.terminate().unwrap();
    plugin.wait_exit(WAIT).await.unwrap();
    let line = manager.expect("plugin deregistered", &socket);
    assert_eq!(line["name"], "real-example");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_example_plugin_of_unknown_type_hears_upstreams_message() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    std::fs::create_dir_all(&dir).unwrap();
    let _manager = Manager::start(&dir);
    let socket = dir.join("stranger.sock");
    let mut plugin = real_plugin(&socket, "stranger", "StrangerPlugin");
    let n = plugin
        .next_event("notify", WAIT)
        .await
        .expect("the real plugin's notify line");
    assert_eq!(n["registered"], false, "{n}");
    assert_eq!(
        n["error"],
        format!(
            "RegisterPlugin error -- no handler registered for plugin type: StrangerPlugin at socket {}",
            socket.display()
        )
    );
    plugin.terminate().unwrap();
}
