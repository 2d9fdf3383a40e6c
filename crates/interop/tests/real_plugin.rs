//! The REAL example plugin (`pluginwatcher.NewTestExamplePlugin`, Go) of every release the
//! peers provide (v1.20.2 and v1.36.2) against `plugreg manager` as a process:
//! `<test>::v1_20_2` and `<test>::v1_36_2`.
//!
//! The Go example plugin creates its socket (bind) before it listens, so the manager may see
//! the socket while a connect is still refused and retry after a back-off; the tests wait for
//! events, never for a time.

use std::path::Path;
use std::time::Duration;

use plugreg_interop::{for_each_kube_version, workspace_bin};
use plugreg_testpeers::{KubeVersion, LinesFrom, PeerProcess, RealExamplePlugin};

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

async fn real_plugin(
    k: KubeVersion,
    socket: &Path,
    name: &str,
    plugin_type: &str,
) -> RealExamplePlugin {
    RealExamplePlugin::start(k, socket, name, plugin_type, &["v1beta1", "v1beta2"], WAIT)
        .await
        .unwrap_or_else(|e| panic!("the real example plugin {k}: {e}"))
}

for_each_kube_version! {
    async fn real_example_plugin_registers_with_plugreg_manager_and_is_deregistered(
        k: KubeVersion
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("plugins_registry");
        std::fs::create_dir_all(&dir).unwrap();
        let mut manager = start_manager(&dir);
        let socket = dir.join("real-example.sock");
        let mut plugin = real_plugin(k, &socket, "real-example", "ExamplePlugin").await;

        // Our example handler dials the real plugin and calls GetExampleInfo v1beta1 and v1beta2.
        let line = logged(&mut manager, "plugin registered", &socket).await;
        assert_eq!(line["plugin_type"], "ExamplePlugin");
        assert_eq!(line["name"], "real-example");
        assert_eq!(line["endpoint"], socket.display().to_string());
        let n = plugin
            .next_notification(WAIT)
            .await
            .expect("the real plugin's notification");
        assert!(n.registered, "{}", n.raw);
        assert_eq!(n.error, "", "{}", n.raw);

        plugin.terminate().unwrap();
        plugin.process().wait_exit(WAIT).await.unwrap();
        let line = logged(&mut manager, "plugin deregistered", &socket).await;
        assert_eq!(line["name"], "real-example");
    }

    async fn real_example_plugin_of_unknown_type_hears_upstreams_message(k: KubeVersion) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("plugins_registry");
        std::fs::create_dir_all(&dir).unwrap();
        let _manager = start_manager(&dir);
        let socket = dir.join("stranger.sock");
        let mut plugin = real_plugin(k, &socket, "stranger", "StrangerPlugin").await;
        let n = plugin
            .next_notification(WAIT)
            .await
            .expect("the real plugin's notification");
        assert!(!n.registered, "{}", n.raw);
        assert_eq!(
            n.error,
            format!(
                "RegisterPlugin error -- no handler registered for plugin type: StrangerPlugin at socket {}",
                socket.display()
            )
        );
        plugin.terminate().unwrap();
    }
}
