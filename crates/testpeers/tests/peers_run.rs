//! The Go peers built by `interop/build-peers.sh` work together: the real
//! v1.20 example plugin registers with the real v1.20 plugin manager.

use std::time::Duration;

use plugreg_testpeers::{EXAMPLE_PLUGIN, PLUGIN_MANAGER_HARNESS, PeerProcess};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_plugin_registers_with_real_plugin_manager() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let reg_dir = tmp.path().join("plugins_registry");
    let name = "example.com/plugreg-device";

    let mut harness = PeerProcess::spawn(
        PLUGIN_MANAGER_HARNESS,
        ["--dir".as_ref(), reg_dir.as_os_str()],
    )
    .expect("spawn harness");
    harness
        .next_event("ready", WAIT)
        .await
        .expect("harness ready");

    let socket = reg_dir.join("plugreg-device.sock");
    let mut plugin = PeerProcess::spawn(
        EXAMPLE_PLUGIN,
        [
            "--socket".as_ref(),
            socket.as_os_str(),
            "--name".as_ref(),
            name.as_ref(),
            "--type".as_ref(),
            "DevicePlugin".as_ref(),
            "--versions".as_ref(),
            "v1beta1,v1beta2".as_ref(),
        ],
    )
    .expect("spawn example plugin");
    plugin
        .next_event("ready", WAIT)
        .await
        .expect("plugin ready");

    let v = harness
        .next_event_named("validate", name, WAIT)
        .await
        .expect("validate");
    assert_eq!(v["type"], "DevicePlugin");
    assert_eq!(v["endpoint"], socket.to_str().unwrap());
    assert_eq!(v["versions"], serde_json::json!(["v1beta1", "v1beta2"]));
    let r = harness
        .next_event_named("register", name, WAIT)
        .await
        .expect("register");
    assert_eq!(r["type"], "DevicePlugin");
    assert!(r["ts_ns"].as_i64().unwrap() >= v["ts_ns"].as_i64().unwrap());

    let n = plugin.next_event("notify", WAIT).await.expect("notify");
    assert_eq!(n["registered"], true, "{n}");
    assert_eq!(n["error"], "", "{n}");

    plugin.terminate().expect("SIGTERM example plugin");
    plugin.next_event("stopped", WAIT).await.expect("stopped");
    plugin.wait_exit(WAIT).await.expect("plugin exits");

    let d = harness
        .next_event_named("deregister", name, WAIT)
        .await
        .expect("deregister");
    assert_eq!(d["type"], "DevicePlugin");

    harness.terminate().expect("SIGTERM harness");
    harness.wait_exit(WAIT).await.expect("harness exits");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_rejects_listed_names() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let reg_dir = tmp.path().join("reg");
    let name = "csi.example.com";

    let mut harness = PeerProcess::spawn(
        PLUGIN_MANAGER_HARNESS,
        [
            "--dir".as_ref(),
            reg_dir.as_os_str(),
            "--reject".as_ref(),
            name.as_ref(),
        ],
    )
    .expect("spawn harness");
    harness
        .next_event("ready", WAIT)
        .await
        .expect("harness ready");

    let socket = reg_dir.join("csi.sock");
    let mut plugin = PeerProcess::spawn(
        EXAMPLE_PLUGIN,
        [
            "--socket".as_ref(),
            socket.as_os_str(),
            "--name".as_ref(),
            name.as_ref(),
            "--type".as_ref(),
            "CSIPlugin".as_ref(),
            "--versions".as_ref(),
            "v1beta1".as_ref(),
        ],
    )
    .expect("spawn example plugin");

    let v = harness
        .next_event_named("validate", name, WAIT)
        .await
        .expect("validate");
    assert_eq!(v["type"], "CSIPlugin");
    assert_eq!(v["error"], "rejected by harness");
    let n = plugin.next_event("notify", WAIT).await.expect("notify");
    assert_eq!(n["registered"], false, "{n}");
    assert!(
        n["error"].as_str().unwrap().contains("rejected by harness"),
        "{n}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_fails_register_for_listed_names() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let reg_dir = tmp.path().join("reg");
    let name = "example.com/failing";

    let mut harness = PeerProcess::spawn(
        PLUGIN_MANAGER_HARNESS,
        [
            "--dir".as_ref(),
            reg_dir.as_os_str(),
            "--fail-register".as_ref(),
            name.as_ref(),
        ],
    )
    .expect("spawn harness");
    harness
        .next_event("ready", WAIT)
        .await
        .expect("harness ready");

    let socket = reg_dir.join("failing.sock");
    let mut plugin = PeerProcess::spawn(
        EXAMPLE_PLUGIN,
        [
            "--socket".as_ref(),
            socket.as_os_str(),
            "--name".as_ref(),
            name.as_ref(),
            "--type".as_ref(),
            "DevicePlugin".as_ref(),
        ],
    )
    .expect("spawn example plugin");

    let v = harness
        .next_event_named("validate", name, WAIT)
        .await
        .expect("validate");
    assert!(v.get("error").is_none(), "{v}");
    let r = harness
        .next_event_named("register", name, WAIT)
        .await
        .expect("register");
    assert_eq!(r["error"], "register failed by harness");
    let n = plugin.next_event("notify", WAIT).await.expect("notify");
    assert_eq!(n["registered"], false, "{n}");
    assert!(
        n["error"]
            .as_str()
            .unwrap()
            .contains("register failed by harness"),
        "{n}"
    );
}
