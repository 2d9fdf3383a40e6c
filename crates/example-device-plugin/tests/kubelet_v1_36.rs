//! The example device plugin (the plugin-side library) against the real kubelet v1.36.2 code:
//! the `kubelet-plugins` harness runs the kubelet's own plugin manager with its own DevicePlugin
//! handler, and its legacy kubelet.sock server (`-device-plugin-dir`). The plugin registers both
//! ways, its devices and a health flip reach the kubelet's ListAndWatch, a kubelet restart makes
//! it register again, and the kubelet's refusals read as plugreg's handler words them.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use plugreg_handler_api::PluginHandler;
use plugreg_testpeers::{KUBELET_PLUGINS_V1_36, LinesFrom, PeerProcess};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(30);

fn kubelet(registry: &Path, device_dir: Option<&Path>) -> PeerProcess {
    let mut args = vec![
        "-sockets-dir".to_owned(),
        registry.display().to_string(),
        "-types".into(),
        "DevicePlugin".into(),
    ];
    if let Some(d) = device_dir {
        args.extend(["-device-plugin-dir".into(), d.display().to_string()]);
    }
    PeerProcess::spawn(KUBELET_PLUGINS_V1_36, args)
        .expect("the kubelet-plugins v1.36.2 peer (../shared/peers)")
}

fn plugin(args: &[&str], paths: &[(&str, &Path)]) -> PeerProcess {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_plugreg-example-device-plugin"));
    cmd.args(args);
    for (f, p) in paths {
        cmd.arg(f).arg(p);
    }
    PeerProcess::spawn_command("example device plugin", cmd, LinesFrom::Stdout).unwrap()
}

fn is<'a>(event: &'a str, name: &'a str) -> impl FnMut(&Value) -> bool + 'a {
    move |v| v["event"] == event && v["name"] == name
}

fn healths(v: &Value) -> Vec<String> {
    v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["health"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn registers_through_plugins_registry_and_the_kubelet_lists_its_devices() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = tmp.path().join("plugins_registry");
    std::fs::create_dir_all(&registry).unwrap();
    let mut k = kubelet(&registry, None);
    k.next_event("Started", WAIT).await.unwrap();
    let name = "example.com/widget";
    let mut p = plugin(
        &["--resource", name, "--devices", "3", "--numa-nodes", "2"],
        &[
            ("--registry-dir", &registry),
            ("--socket", &tmp.path().join("w.sock")),
        ],
    );
    let v = k
        .next_matching(is("ValidatePlugin", name), WAIT)
        .await
        .unwrap();
    assert_eq!(v["result"], "ok");
    assert_eq!(v["versions"], serde_json::json!(["v1beta1"]));
    let v = k
        .next_matching(is("DevicePluginConnected", name), WAIT)
        .await
        .unwrap();
    assert_eq!(v["options"]["get_preferred_allocation_available"], true);
    // The handler starts ListAndWatch in its own goroutine during Register: the first update
    // and the Register line come in either order.
    let e = k
        .next_each(
            &["RegisterPlugin", "DevicePluginListAndWatch"],
            |v| v["name"] == name,
            WAIT,
        )
        .await
        .unwrap();
    assert_eq!(e["RegisterPlugin"]["result"], "ok");
    let v = &e["DevicePluginListAndWatch"];
    assert_eq!(healths(v), ["Healthy", "Healthy", "Healthy"]);
    assert_eq!(v["devices"][1]["id"], "widget-1");
    assert_eq!(v["devices"][1]["numa"], serde_json::json!([1]));
    let r = p.next_event("registered", WAIT).await.unwrap();
    assert_eq!(r["via"], "plugins_registry");

    // SIGUSR1 flips widget-0; the kubelet sees the new list.
    let ok = Command::new("kill")
        .args(["-USR1", &p.pid().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let v = k
        .next_matching(is("DevicePluginListAndWatch", name), WAIT)
        .await
        .unwrap();
    assert_eq!(healths(&v), ["Unhealthy", "Healthy", "Healthy"]);

    // A clean stop removes the registration socket: the kubelet deregisters the plugin.
    p.terminate().unwrap();
    assert!(p.wait_exit(WAIT).await.unwrap().success());
    k.next_matching(is("DeRegisterPlugin", name), WAIT)
        .await
        .unwrap();
}

#[tokio::test]
async fn registers_through_the_legacy_kubelet_sock_and_again_after_a_kubelet_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = tmp.path().join("plugins_registry");
    let device_dir = tmp.path().join("device-plugins");
    std::fs::create_dir_all(&registry).unwrap();
    std::fs::create_dir_all(&device_dir).unwrap();
    let mut k = kubelet(&registry, Some(&device_dir));
    k.next_event("Started", WAIT).await.unwrap();
    let name = "example.com/gadget";
    let mut p = plugin(
        &["--resource", name, "--devices", "2"],
        &[("--kubelet-socket", &device_dir.join("kubelet.sock"))],
    );
    let v = k
        .next_matching(is("DevicePluginConnected", name), WAIT)
        .await
        .unwrap();
    assert_eq!(
        v["endpoint"],
        device_dir
            .join("example.com_gadget.sock")
            .display()
            .to_string()
    );
    let v = k
        .next_matching(is("DevicePluginListAndWatch", name), WAIT)
        .await
        .unwrap();
    assert_eq!(healths(&v), ["Healthy", "Healthy"]);
    assert_eq!(
        p.next_event("registered", WAIT).await.unwrap()["via"],
        "kubelet.sock"
    );

    // The kubelet restarts: it deletes every socket in the directory and re-creates
    // kubelet.sock. The plugin re-creates its socket and registers again.
    k.terminate().unwrap();
    k.wait_exit(WAIT).await.unwrap();
    let mut k = kubelet(&registry, Some(&device_dir));
    k.next_event("Started", WAIT).await.unwrap();
    p.next_event("kubelet_restarted", WAIT).await.unwrap();
    assert_eq!(
        p.next_event("registered", WAIT).await.unwrap()["via"],
        "kubelet.sock"
    );
    let v = k
        .next_matching(is("DevicePluginListAndWatch", name), WAIT)
        .await
        .unwrap();
    assert_eq!(healths(&v), ["Healthy", "Healthy"]);

    p.terminate().unwrap();
    assert!(p.wait_exit(WAIT).await.unwrap().success());
    assert!(!device_dir.join("example.com_gadget.sock").exists());
}

#[tokio::test]
async fn the_kubelets_refusals_read_as_plugregs_handler_words_them() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = tmp.path().join("plugins_registry");
    let device_dir = tmp.path().join("device-plugins");
    std::fs::create_dir_all(&registry).unwrap();
    std::fs::create_dir_all(&device_dir).unwrap();
    let mut k = kubelet(&registry, Some(&device_dir));
    k.next_event("Started", WAIT).await.unwrap();
    // An invalid resource name, both ways.
    let _a = plugin(
        &["--resource", "gpu"],
        &[
            ("--registry-dir", &registry),
            ("--socket", &tmp.path().join("gpu.sock")),
        ],
    );
    let v = k
        .next_matching(is("ValidatePlugin", "gpu"), WAIT)
        .await
        .unwrap();
    let kubelet_text = v["result"].as_str().unwrap().to_owned();
    let ours =
        plugreg_handler_device::DevicePluginHandler::new(Default::default(), Default::default())
            .validate("gpu", "/x", &["v1beta1".into()])
            .await
            .unwrap_err()
            .to_string();
    assert_eq!(kubelet_text, ours);

    let mut b = plugin(
        &["--resource", "kubernetes.io/gadget"],
        &[("--kubelet-socket", &device_dir.join("kubelet.sock"))],
    );
    // A plugin advertising no v1beta1 (through the registrar directly).
    let registrar = plugreg_registrar::Registrar::new(plugreg_registrar::PluginInfo {
        r#type: "DevicePlugin".into(),
        name: "example.com/old".into(),
        endpoint: tmp.path().join("old.sock").display().to_string(),
        supported_versions: vec!["v1alpha".into(), "v1".into()],
    });
    let token = tokio_util::sync::CancellationToken::new();
    let (r, t, s) = (
        registrar.clone(),
        token.clone(),
        registry.join("old-reg.sock"),
    );
    tokio::spawn(async move { r.serve(&s, Default::default(), t).await });
    let v = k
        .next_matching(is("ValidatePlugin", "example.com/old"), WAIT)
        .await
        .unwrap();
    let ours =
        plugreg_handler_device::DevicePluginHandler::new(Default::default(), Default::default())
            .validate("example.com/old", "/x", &["v1alpha".into(), "v1".into()])
            .await
            .unwrap_err()
            .to_string();
    assert_eq!(v["result"], ours);
    token.cancel();

    // A classic Register with another version (a raw client).
    let ch = plugreg_transport::connect_path(&device_dir.join("kubelet.sock"), WAIT)
        .await
        .unwrap();
    let e = plugreg_deviceplugin::api::registration_client::RegistrationClient::new(ch)
        .register(plugreg_deviceplugin::api::RegisterRequest {
            version: "v1".into(),
            endpoint: "x.sock".into(),
            resource_name: "example.com/x".into(),
            options: None,
        })
        .await
        .unwrap_err();
    let ours = plugreg_handler_device::RegisterRefusal::Version("v1".into());
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::Unknown, ours.to_string().as_str())
    );

    let v = b.next_event("registration_failed", WAIT).await.unwrap();
    let ours = plugreg_handler_device::RegisterRefusal::Name("kubernetes.io/gadget".into());
    assert_eq!(
        v["error"],
        format!("rpc error: code = Unknown desc = {ours}")
    );
    assert_eq!(
        ours.to_string(),
        "the ResourceName \"kubernetes.io/gadget\" is invalid"
    );
}
