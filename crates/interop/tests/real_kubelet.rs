//! plugreg's plugin side against the REAL kubelet plugin manager (v1.20.2,
//! `pkg/kubelet/pluginmanager`, run by the Go harness from `interop/build-peers.sh`).

use std::time::Duration;

use plugreg_interop::workspace_bin;
use plugreg_registrar::{PluginInfo, Registrar, ServeOptions};
use plugreg_testpeers::{PLUGIN_MANAGER_HARNESS, PeerProcess};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);

async fn harness(dir: &std::path::Path) -> PeerProcess {
    let mut h = PeerProcess::spawn(PLUGIN_MANAGER_HARNESS, ["--dir".as_ref(), dir.as_os_str()])
        .expect("the real kubelet plugin manager harness");
    h.next_event("ready", WAIT).await.expect("harness ready");
    h
}

async fn registrar_library_against_real_kubelet(plugin_type: &str, name: &str, versions: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    let mut kubelet = harness(&dir).await;
    let socket = dir.join("plugreg-reg.sock");
    let endpoint = tmp.path().join("service.sock").display().to_string();
    let registrar = Registrar::new(PluginInfo {
        r#type: plugin_type.into(),
        name: name.into(),
        endpoint: endpoint.clone(),
        supported_versions: versions.iter().map(|v| v.to_string()).collect(),
    });
    let token = CancellationToken::new();
    let task = tokio::spawn({
        let (r, s, t) = (registrar.clone(), socket.clone(), token.clone());
        async move { r.serve(&s, ServeOptions::default(), t).await }
    });

    let v = kubelet
        .next_event_named("validate", name, WAIT)
        .await
        .expect("real kubelet: validate");
    assert_eq!(v["type"], plugin_type);
    assert_eq!(v["endpoint"], endpoint);
    assert_eq!(v["versions"], serde_json::json!(versions));
    let r = kubelet
        .next_event_named("register", name, WAIT)
        .await
        .expect("real kubelet: register");
    assert_eq!(r["endpoint"], endpoint);
    let mut status = registrar.status();
    tokio::time::timeout(WAIT, status.wait_for(|s| s.is_registered()))
        .await
        .expect("the real kubelet never sent Notify(true)")
        .unwrap();

    token.cancel();
    task.await.unwrap().unwrap();
    assert!(!socket.exists());
    let d = kubelet
        .next_event_named("deregister", name, WAIT)
        .await
        .expect("real kubelet: deregister");
    assert_eq!(d["type"], plugin_type);
    kubelet.terminate().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrar_library_registers_a_csi_plugin_with_the_real_kubelet() {
    registrar_library_against_real_kubelet("CSIPlugin", "csi.plugreg.example", &["1.0.0"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrar_library_registers_a_device_plugin_with_the_real_kubelet() {
    registrar_library_against_real_kubelet("DevicePlugin", "example.com/gpu", &["v1beta1"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrar_library_hears_the_real_kubelets_refusal() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    let mut kubelet = PeerProcess::spawn(
        PLUGIN_MANAGER_HARNESS,
        [
            "--dir".as_ref(),
            dir.as_os_str(),
            "--reject".as_ref(),
            "example.com/nope".as_ref(),
        ],
    )
    .expect("the real kubelet plugin manager harness");
    kubelet.next_event("ready", WAIT).await.unwrap();
    let registrar = Registrar::new(PluginInfo {
        r#type: "DevicePlugin".into(),
        name: "example.com/nope".into(),
        endpoint: String::new(),
        supported_versions: vec!["v1beta1".into()],
    });
    let token = CancellationToken::new();
    tokio::spawn({
        let (r, s, t) = (registrar.clone(), dir.join("nope.sock"), token.clone());
        async move { r.serve(&s, ServeOptions::default(), t).await }
    });
    let mut status = registrar.status();
    let s = tokio::time::timeout(WAIT, status.wait_for(|s| s.rejected_total > 0))
        .await
        .expect("the real kubelet never sent Notify(false)")
        .unwrap()
        .clone();
    assert_eq!(
        s.last.unwrap().error,
        "RegisterPlugin error -- plugin validation failed with err: rejected by harness"
    );
    token.cancel();
    kubelet.terminate().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_driver_registrar_with_csi_test_driver_registers_with_the_real_kubelet() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    let mut kubelet = harness(&dir).await;
    let csi_sock = tmp.path().join("csi.sock");
    let driver = plugreg_csi_test_driver::start(
        plugreg_csi_test_driver::DriverConfig {
            name: "csi.interop.plugreg.io".into(),
            ..Default::default()
        },
        &csi_sock,
    )
    .await
    .unwrap();
    let host_path = "/var/lib/kubelet/plugins/csi.interop.plugreg.io/csi.sock";
    let mut sidecar = PeerProcess::spawn_program(
        "csi-node-driver-registrar (plugreg)",
        &workspace_bin("csi-node-driver-registrar"),
        [
            format!("--csi-address={}", csi_sock.display()),
            format!("--kubelet-registration-path={host_path}"),
            format!("--plugin-registration-path={}", dir.display()),
            "-v=2".into(),
        ],
    )
    .unwrap();
    let name = "csi.interop.plugreg.io";
    let v = kubelet
        .next_event_named("validate", name, WAIT)
        .await
        .expect("real kubelet: validate");
    assert_eq!(v["type"], "CSIPlugin");
    assert_eq!(v["endpoint"], host_path);
    assert_eq!(v["versions"], serde_json::json!(["1.0.0"]));
    let r = kubelet
        .next_event_named("register", name, WAIT)
        .await
        .expect("real kubelet: register");
    assert_eq!(r["endpoint"], host_path);

    sidecar.terminate().unwrap();
    let status = sidecar.wait_exit(WAIT).await.unwrap();
    assert!(
        status.success(),
        "SIGTERM exits 0: {status:?}\n{}",
        sidecar.stderr_tail()
    );
    assert!(!dir.join(format!("{name}-reg.sock")).exists());
    kubelet
        .next_event_named("deregister", name, WAIT)
        .await
        .expect("real kubelet: deregister");
    kubelet.terminate().unwrap();
    let _ = driver.stop().await;
}
