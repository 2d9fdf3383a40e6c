//! Test bodies more than one test binary of this crate runs.

use std::process::Command;
use std::time::Duration;

use plugreg_testpeers::{
    HandlerCall, KubeVersion, LinesFrom, PeerProcess, PluginManagerOptions, RealPluginManager,
};

/// `csi-node-driver-registrar`, started by `registrar` (the workspace's binary, or a foreign
/// build under qemu) with the usual flags added, registers the test driver with the real
/// kubelet plugin manager of `k` (Validate, Register with the driver's host path); SIGTERM
/// ends it with status 0 and its socket removed, and the kubelet deregisters the driver.
pub async fn node_driver_registrar_registers_and_deregisters(
    k: KubeVersion,
    label: &str,
    mut registrar: Command,
    wait: Duration,
) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins_registry");
    let mut kubelet = RealPluginManager::start(k, &dir, &PluginManagerOptions::default(), wait)
        .await
        .unwrap_or_else(|e| panic!("the real kubelet plugin manager {k}: {e}"));
    let name = "csi.interop.plugreg.io";
    let csi_sock = tmp.path().join("csi.sock");
    let driver = plugreg_csi_test_driver::start(
        plugreg_csi_test_driver::DriverConfig {
            name: name.into(),
            ..Default::default()
        },
        &csi_sock,
    )
    .await
    .unwrap();
    let host_path = "/var/lib/kubelet/plugins/csi.interop.plugreg.io/csi.sock";
    registrar.args([
        format!("--csi-address={}", csi_sock.display()),
        format!("--kubelet-registration-path={host_path}"),
        format!("--plugin-registration-path={}", dir.display()),
        "-v=2".into(),
    ]);
    let mut sidecar = PeerProcess::spawn_command(label, registrar, LinesFrom::Stdout).unwrap();
    let v = kubelet
        .next(HandlerCall::Validate, name, wait)
        .await
        .unwrap_or_else(|e| panic!("real kubelet: validate: {e}\n{}", sidecar.stderr_tail()));
    assert_eq!(v.plugin_type, "CSIPlugin");
    assert_eq!(v.endpoint.as_deref(), Some(host_path));
    assert_eq!(v.versions, ["1.0.0"]);
    let r = kubelet
        .next(HandlerCall::Register, name, wait)
        .await
        .expect("real kubelet: register");
    assert_eq!(r.endpoint.as_deref(), Some(host_path));
    eprintln!("{k} ({label}): register line {}", r.raw);

    sidecar.terminate().unwrap();
    let status = sidecar.wait_exit(wait).await.unwrap();
    assert!(
        status.success(),
        "SIGTERM exits 0: {status:?}\n{}",
        sidecar.stderr_tail()
    );
    assert!(!dir.join(format!("{name}-reg.sock")).exists());
    kubelet
        .next(HandlerCall::Deregister, name, wait)
        .await
        .expect("real kubelet: deregister");
    kubelet.terminate().unwrap();
    let _ = driver.stop().await;
}
