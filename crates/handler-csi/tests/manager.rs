//! The CSI handler inside the real plugin manager, against the CSI test driver: a driver whose
//! NodeGetInfo fails, hangs or reports no node id, or whose topology collides with a label, is
//! told why with Notify(false), and registers once it is fixed (D2 retries).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use plugreg_csi_test_driver::{DriverConfig, Fault, Method, RunningDriver};
use plugreg_handler_csi::{CsiHandler, FileSink, PLUGIN_TYPE};
use plugreg_manager::{HandlerRegistry, ManagerConfig, PluginManager, PluginState};
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
    manager: PluginManager,
}

async fn setup(node_get_info_timeout: Duration) -> Setup {
    setup_with(node_get_info_timeout, |_| {}).await
}

/// [`setup`] with the manager's configuration adjusted by `adjust`.
async fn setup_with(
    node_get_info_timeout: Duration,
    adjust: impl FnOnce(&mut ManagerConfig),
) -> Setup {
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
    adjust(&mut config);
    let token = CancellationToken::new();
    let manager = PluginManager::start(
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
        manager,
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

/// A driver (`csi.hang.plugreg.io`) whose NodeGetInfo never answers, registered through
/// `sockets` registration sockets of its own (as a DaemonSet whose registrar restarts under
/// new socket names might leave them).
async fn hanging_driver(s: &Setup, sockets: usize) -> (RunningDriver, Vec<Registrar>) {
    let csi = s.tmp.path().join("hang.sock");
    let config = DriverConfig {
        name: "csi.hang.plugreg.io".into(),
        node_get_info: Fault {
            hang: true,
            ..Fault::default()
        },
        ..Default::default()
    };
    let driver = plugreg_csi_test_driver::start(config, &csi).await.unwrap();
    let mut registrars = Vec::new();
    for i in 0..sockets {
        let r = Registrar::new(PluginInfo {
            r#type: PLUGIN_TYPE.into(),
            name: "csi.hang.plugreg.io".into(),
            endpoint: csi.display().to_string(),
            supported_versions: vec!["1.0.0".into()],
        });
        let (rr, sock, t) = (
            r.clone(),
            s.registry.join(format!("hang-{i}-reg.sock")),
            s.token.clone(),
        );
        tokio::spawn(async move { rr.serve(&sock, ServeOptions::default(), t).await.unwrap() });
        registrars.push(r);
    }
    (driver, registrars)
}

/// Waits until the hanging driver has a NodeGetInfo call and `at_least` registrations run
/// (the CSI handler calls one driver name's NodeGetInfo one at a time: the others wait).
async fn wait_for_hanging(s: &Setup, driver: &RunningDriver, at_least: usize) {
    let deadline = tokio::time::Instant::now() + SOON;
    loop {
        let registering = s
            .manager
            .snapshot()
            .iter()
            .filter(|r| r.state == PluginState::Registering)
            .count();
        if registering >= at_least && driver.calls().count(Method::NodeGetInfo) > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{registering} registrations running"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A well-behaved driver registers while every registration of the hanging driver still runs.
async fn another_driver_registers_while_they_hang(
    s: &Setup,
    hang: RunningDriver,
    hanging: &[Registrar],
) {
    let good = driver(&s.csi_sock, DriverConfig::default()).await;
    let r = register(s);
    wait(&r, |st| st.is_registered()).await;
    for h in hanging {
        assert_eq!(
            h.status().borrow().notifications(),
            0,
            "a hanging registration ended"
        );
    }
    good.stop().await.unwrap();
    hang.stop().await.unwrap();
}

/// Issue 17, finding 8: a driver whose NodeGetInfo hangs on many sockets fills every shared
/// operation slot (4 here, 64 by default), each for up to its NodeGetInfo limit (10 min here, 2
/// min by default). Another driver still registers at once, while those calls still hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_hanging_on_many_sockets_does_not_delay_another() {
    let s = setup_with(Duration::from_secs(600), |c| {
        c.max_concurrent_operations = 4
    })
    .await;
    let (hang, hanging) = hanging_driver(&s, 16).await;
    // Every shared slot is taken by a registration of the hanging driver.
    wait_for_hanging(&s, &hang, 4).await;
    another_driver_registers_while_they_hang(&s, hang, &hanging).await;
}

/// Issue 17, finding 8: a registration whose plugin already has another operation running
/// leaves the shared slots as soon as GetInfo names the plugin, not after the slow threshold
/// (10 min here, so only that rule can free a slot): the hanging driver's sixteen sockets never
/// hold the four shared slots, and another driver registers at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn siblings_of_a_running_registration_leave_the_shared_slots_at_once() {
    let s = setup_with(Duration::from_secs(600), |c| {
        c.max_concurrent_operations = 4;
        c.slow_operation_after = Duration::from_secs(600);
    })
    .await;
    let (hang, hanging) = hanging_driver(&s, 16).await;
    // More of the hanging driver's registrations run than there are shared slots.
    wait_for_hanging(&s, &hang, 8).await;
    another_driver_registers_while_they_hang(&s, hang, &hanging).await;
}

/// Issue 17, finding 8: when the slow lane is full, the plugin holding the most slow
/// registrations gives one up, not the plugin that is merely slow: a driver whose NodeGetInfo
/// takes 2 s registers while another's hangs on 16 sockets and a slow lane of 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_slow_lane_cancels_the_crowding_driver_not_the_slow_one() {
    let s = setup_with(Duration::from_secs(600), |c| {
        c.max_concurrent_operations = 4;
        c.max_slow_operations = 4;
    })
    .await;
    let (hang, hanging) = hanging_driver(&s, 16).await;
    wait_for_hanging(&s, &hang, 4).await;
    let slow = DriverConfig {
        node_get_info: Fault {
            delay: Some(Duration::from_secs(2)),
            ..Fault::default()
        },
        ..Default::default()
    };
    let good = driver(&s.csi_sock, slow).await;
    let r = register(&s);
    let st = wait(&r, |st| st.notifications() > 0).await;
    assert!(
        st.is_registered(),
        "the slow driver was refused: {}",
        last_error(&st)
    );
    // The crowding driver's registrations were cancelled and told why.
    let told = hanging
        .iter()
        .find_map(|h| h.status().borrow().last.clone());
    let told = told.expect("a hanging registration was cancelled and told");
    assert!(!told.plugin_registered);
    assert!(told.error.contains("operation cancelled"), "{}", told.error);
    good.stop().await.unwrap();
    hang.stop().await.unwrap();
}
