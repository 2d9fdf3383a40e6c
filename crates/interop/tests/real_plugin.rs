//! The REAL example plugin (v1.20.2 `pluginwatcher.NewTestExamplePlugin`, Go) against
//! `plugreg manager` as a process.

use std::path::Path;
use std::time::Duration;

use plugreg_interop::workspace_bin;
use plugreg_testpeers::{EXAMPLE_PLUGIN, LinesFrom, PeerProcess};

const WAIT: Duration = Duration::from_secs(30);

/// `plugreg manager` as a process, its JSON log lines (stderr) read as events.
fn start_manager(dir: &Path) -> PeerProcess {
    let mut cmd = std::process::Command::new(workspace_bin("plugreg"));
    cmd.args(["manager", "--registry-dir"]).arg(dir).args([
        "--plugin-types",
        "ExamplePlugin,DevicePlugin",
        "--log-format",
        "json",
    ]);
    PeerProcess::spawn_command("plugreg manager", cmd, LinesFrom::Stderr).unwrap()
}

/// The manager's next log line `message` about `socket`.
async fn logged(manager: &mut PeerProcess, message: &str, socket: &Path) -> serde_json::Value {
    let socket = socket.display().to_string();
    manager
        .next_matching(
            |v| v["message"] == message && v["socket"] == socket.as_str(),
            WAIT,
        )
        .await
        .unwrap()
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
    let mut manager = start_manager(&dir);
    let socket = dir.join("real-example.sock");
    let mut plugin = real_plugin(&socket, "real-example", "ExamplePlugin");

    // Our example handler dials the real plugin and calls GetExampleInfo v1beta1 and v1beta2.
    let line = logged(&mut manager, "plugin registered", &socket).await;
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
    let line = logged(&mut manager, "plugin deregistered", &socket).await;
    assert_eq!(line["name"], "real-example");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_example_plugin_of_unknown_type_hears_upstreams_message() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    std::fs::create_dir_all(&dir).unwrap();
    let _manager = start_manager(&dir);
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
