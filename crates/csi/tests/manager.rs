//! The CSI handler inside the real plugin manager, against the CSI test driver: a driver whose
//! NodeGetInfo fails, hangs or reports no node id, or whose topology collides with a label, is
//! told why with Notify(false), and registers once it is fixed (D2 retries).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use plugreg_csi::{CsiHandler, FileSink, PLUGIN_TYPE};
use plugreg_csi_test_driver::{DriverConfig, Fault, RunningDriver};
use plugreg_manager::{HandlerRegistry, ManagerConfig, PluginManager};
use plugreg_registrar::{PluginInfo, Registrar, ServeOptions, Status};
use tokio_util::sync::CancellationToken;

const SOON: Duration = Duration::from_secs(20);
const DRIVER: &str = "csi.e2e.plugreg.io";

struct Setup {
    tmp: tempfile::TempDir,
    registry: PathBuf,
    csi_sock: PathBuf,
    node_info: PathBuf,
    token: CancellationToken,
}

async fn setup(node_get_info_timeout: Duration) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let registry = tmp.path().join("plugins_registry");
    let csi_sock = tmp.path().join("csi.sock");
    let node_info = tmp.path().join("node-info.json");
    let handler = CsiHandler::new(
        Arc::new(FileSink::new(node_info.clone())),
        node_get_info_timeout,
    );
    let mut config = ManagerConfig::new(&registry);
    config.backoff_initial = Duration::from_millis(50);
    config.backoff_max = Duration::from_millis(400);
    config.liveness = None;
    let token = CancellationToken::new();
    PluginManager::start(
        config,
        HandlerRegistry::new().with(PLUGIN_TYPE, Arc::new(handler)),
        token.clone(),
    )
    .await
    .unwrap();
    Setup {
        tmp,
        registry,
        csi_sock,
        node_info,
        token,
    }
}

/// What node-driver-registrar would serve for the driver.
fn register(s: &Setup) -> Registrar {
    let r = Registrar::new(PluginInfo {
        r#type: PLUGIN_TYPE.into(),
        name: DRIVER.into(),
        endpoint: s.csi_sock.display().to_string(),
        supported_versions: vec!["1.0.0".into()],
    });
    let (rr, sock, t) = (
        r.clone(),
        s.registry.join(format!("{DRIVER}-reg.sock")),
        s.token.clone(),
    );
    tokio::spawn(async move { rr.serve(&sock, ServeOptions::default(), t).await.unwrap() });
    r
}

async fn wait(r: &Registrar, pred: impl Fn(&Status) -> bool) -> Status {
    let mut rx = r.status();
    let s = tokio::time::timeout(SOON, rx.wait_for(|s| pred(s)))
        .await
        .expect("status never matched")
        .unwrap();
    s.clone()
}

async fn driver(socket: &Path, config: DriverConfig) -> RunningDriver {
    plugreg_csi_test_driver::start(
        DriverConfig {
            name: DRIVER.into(),
            ..config
        },
        socket,
    )
    .await
    .unwrap()
}

/// A driver whose NodeGetInfo misbehaves as `fault`, and the registrar serving it.
async fn faulty_driver(s: &Setup, fault: Fault) -> (RunningDriver, Registrar) {
    let config = DriverConfig {
        node_get_info: fault,
        ..Default::default()
    };
    (driver(&s.csi_sock, config).await, register(s))
}

fn last_error(s: &Status) -> String {
    s.last.as_ref().map(|l| l.error.clone()).unwrap_or_default()
}

fn assert_told(s: &Status, want: &str) {
    let err = last_error(s);
    assert!(
        err.starts_with("RegisterPlugin error -- plugin registration failed with err: "),
        "{err}"
    );
    assert!(err.contains(want), "{err:?} should say {want:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_node_id_is_told_and_the_fixed_driver_registers() {
    let s = setup(Duration::from_secs(5)).await;
    let broken = driver(
        &s.csi_sock,
        DriverConfig {
            node_id: String::new(),
            ..Default::default()
        },
    )
    .await;
    let r = register(&s);
    let st = wait(&r, |st| st.rejected_total >= 2).await;
    assert_told(&st, "driverNodeID must not be empty");
    assert!(
        !s.node_info.exists()
            || !std::fs::read_to_string(&s.node_info)
                .unwrap()
                .contains(DRIVER)
    );
    broken.stop().await.unwrap();
    let _fixed = driver(
        &s.csi_sock,
        DriverConfig {
            node_id: "node-7".into(),
            ..Default::default()
        },
    )
    .await;
    wait(&r, Status::is_registered).await;
    let text = std::fs::read_to_string(&s.node_info).unwrap();
    assert!(text.contains("node-7"), "{text}");
    s.token.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_node_get_info_is_told_and_retried_until_it_answers() {
    let s = setup(Duration::from_secs(5)).await;
    let fault = Fault {
        fail_first: Some(2),
        ..Default::default()
    };
    let (_d, r) = faulty_driver(&s, fault).await;
    let st = wait(&r, Status::is_registered).await;
    assert_eq!(st.rejected_total, 2);
    assert_eq!(st.accepted_total, 1);
    s.token.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_node_get_info_is_told_and_retried() {
    let s = setup(Duration::from_millis(300)).await;
    let fault = Fault {
        delay: Some(Duration::from_secs(3)),
        delay_first: Some(1),
        ..Default::default()
    };
    let (_d, r) = faulty_driver(&s, fault).await;
    let st = wait(&r, |st| st.rejected_total >= 1).await;
    assert_told(&st, "300ms");
    wait(&r, Status::is_registered).await;
    s.token.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_collision_is_told_and_retried_once_the_label_is_fixed() {
    let s = setup(Duration::from_secs(5)).await;
    std::fs::write(
        &s.node_info,
        r#"{"node":{"annotations":{},"labels":{"topology.plugreg.io/zone":"zone-b"}},"csinode":{"drivers":[]}}"#,
    )
    .unwrap();
    let topology = [("topology.plugreg.io/zone".to_string(), "zone-a".to_string())].into();
    let _d = driver(
        &s.csi_sock,
        DriverConfig {
            topology,
            ..Default::default()
        },
    )
    .await;
    let r = register(&s);
    let st = wait(&r, |st| st.rejected_total >= 1).await;
    assert_told(
        &st,
        r#"detected topology value collision: driver reported "topology.plugreg.io/zone":"zone-a" but existing label is "topology.plugreg.io/zone":"zone-b""#,
    );
    std::fs::write(
        &s.node_info,
        r#"{"node":{"annotations":{},"labels":{}},"csinode":{"drivers":[]}}"#,
    )
    .unwrap();
    wait(&r, Status::is_registered).await;
    let text = std::fs::read_to_string(&s.node_info).unwrap();
    assert!(text.contains("zone-a"), "{text}");
    let _ = s.tmp.path();
    s.token.cancel();
}
