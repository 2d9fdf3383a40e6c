//! The CSI handler against a real fake driver on a Unix socket, publishing to a file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use plugreg_csi_test_driver::{Code, DriverConfig, Failure, Fault, RunningDriver, start};
use plugreg_handler_api::PluginHandler;
use plugreg_handler_csi::sink::{FileSink, NodeInfoFile};
use plugreg_handler_csi::{CsiHandler, NODE_ID_ANNOTATION};

const DRIVER: &str = "csi.plugreg.test";

struct Fixture {
    dir: tempfile::TempDir,
    handler: CsiHandler,
    sink: Arc<FileSink>,
}

impl Fixture {
    fn new(timeout: Duration) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let sink = Arc::new(FileSink::new(dir.path().join("node-info.json")));
        let handler = CsiHandler::new(sink.clone(), timeout);
        Self { dir, handler, sink }
    }

    fn socket(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    async fn file(&self) -> NodeInfoFile {
        self.sink.read().await.unwrap()
    }

    /// Registers `name` at `ep` with `versions`, expecting a failure; rolls back as the plugin
    /// manager does (deregister with the same name and endpoint, D2); checks that nothing is
    /// left; returns the error text the plugin would get.
    async fn failed_register(&self, name: &str, ep: &str, versions: &[String]) -> String {
        let err = self
            .handler
            .register(name, ep, versions)
            .await
            .expect_err("register must fail")
            .to_string();
        self.handler.deregister(name, ep).await;
        self.assert_not_recorded(name).await;
        err
    }

    /// Asserts that nothing about `driver` is recorded or published.
    async fn assert_not_recorded(&self, driver: &str) {
        assert!(self.handler.driver(driver).is_none(), "{driver} recorded");
        let f = self.file().await;
        let ids = f.node.annotations.get(NODE_ID_ANNOTATION);
        assert!(
            ids.is_none_or(|v| !v.contains(driver)),
            "{driver} in annotation {ids:?}"
        );
        assert!(
            f.csinode.drivers.iter().all(|d| d.name != driver),
            "{driver} in CSINode list"
        );
    }
}

fn versions(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

fn topology(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

async fn driver(config: DriverConfig, socket: &Path) -> RunningDriver {
    start(config, socket).await.expect("start fake CSI driver")
}

fn endpoint(p: &Path) -> String {
    p.display().to_string()
}

#[tokio::test]
async fn registers_and_publishes_node_info() {
    let fx = Fixture::new(Duration::from_secs(5));
    let sock = fx.socket("csi.sock");
    let d = driver(
        DriverConfig {
            node_id: "node-a".into(),
            topology: topology(&[("topology.plugreg.test/zone", "z1")]),
            max_volumes_per_node: 12,
            ..DriverConfig::default()
        },
        &sock,
    )
    .await;
    let ep = format!("unix://{}", sock.display());
    fx.handler
        .validate(DRIVER, &ep, &versions(&["1.0.0"]))
        .await
        .unwrap();
    fx.handler
        .register(DRIVER, &ep, &versions(&["1.0.0"]))
        .await
        .unwrap();
    assert_eq!(d.calls().node_get_info(), 1);

    let rec = fx.handler.driver(DRIVER).expect("recorded");
    assert_eq!(rec.endpoint, ep);
    assert_eq!(rec.highest_version.to_string(), "1.0.0");
    assert_eq!(rec.node_info.node_id, "node-a");

    let f = fx.file().await;
    assert_eq!(
        f.node
            .annotations
            .get(NODE_ID_ANNOTATION)
            .map(String::as_str),
        Some(r#"{"csi.plugreg.test":"node-a"}"#)
    );
    assert_eq!(
        f.node.labels,
        topology(&[("topology.plugreg.test/zone", "z1")])
    );
    assert_eq!(f.csinode.drivers.len(), 1);
    let e = &f.csinode.drivers[0];
    assert_eq!(e.node_id, "node-a");
    assert_eq!(
        e.topology_keys.as_deref(),
        Some(&["topology.plugreg.test/zone".to_owned()][..])
    );
    assert_eq!(e.allocatable.as_ref().and_then(|a| a.count), Some(12));

    fx.handler.deregister(DRIVER, &ep).await;
    fx.assert_not_recorded(DRIVER).await;
    assert_eq!(
        fx.file().await.node.labels,
        topology(&[("topology.plugreg.test/zone", "z1")]),
        "topology labels stay"
    );
}

#[tokio::test]
async fn hanging_node_get_info_times_out_and_a_fixed_driver_registers() {
    let fx = Fixture::new(Duration::from_millis(300));
    let sock = fx.socket("csi.sock");
    let ep = endpoint(&sock);
    let d = driver(
        DriverConfig {
            node_get_info: Fault {
                hang: true,
                ..Fault::default()
            },
            ..DriverConfig::default()
        },
        &sock,
    )
    .await;
    let err = fx.failed_register(DRIVER, &ep, &versions(&["1.0.0"])).await;
    assert_eq!(
        err,
        format!(
            "error getting node info from CSI driver {DRIVER} at endpoint {ep}: \
             NodeGetInfo did not answer within 300ms"
        )
    );
    assert_eq!(d.calls().node_get_info(), 1);

    d.stop().await.unwrap();
    let _d = driver(DriverConfig::default(), &sock).await;
    fx.handler
        .register(DRIVER, &ep, &versions(&["1.0.0"]))
        .await
        .unwrap();
    assert!(fx.handler.driver(DRIVER).is_some());
}

#[tokio::test]
async fn failing_node_get_info_is_reported_and_the_retry_succeeds() {
    let fx = Fixture::new(Duration::from_secs(5));
    let sock = fx.socket("csi.sock");
    let ep = endpoint(&sock);
    let d = driver(
        DriverConfig {
            node_get_info: Fault {
                error: Some(Failure::new(Code::Internal, "disk on fire")),
                fail_first: Some(1),
                ..Fault::default()
            },
            ..DriverConfig::default()
        },
        &sock,
    )
    .await;
    let err = fx.failed_register(DRIVER, &ep, &versions(&["1.0.0"])).await;
    assert!(
        err.ends_with("NodeGetInfo failed: rpc error: code = Internal desc = disk on fire"),
        "{err}"
    );

    fx.handler
        .register(DRIVER, &ep, &versions(&["1.0.0"]))
        .await
        .unwrap();
    assert_eq!(d.calls().node_get_info(), 2);
    assert!(fx.handler.driver(DRIVER).is_some());
}

#[tokio::test]
async fn empty_node_id_is_refused_until_the_driver_reports_one() {
    let fx = Fixture::new(Duration::from_secs(5));
    let sock = fx.socket("csi.sock");
    let ep = endpoint(&sock);
    let d = driver(
        DriverConfig {
            node_id: String::new(),
            ..DriverConfig::default()
        },
        &sock,
    )
    .await;
    let err = fx.failed_register(DRIVER, &ep, &versions(&["1.0.0"])).await;
    assert_eq!(
        err,
        "error adding CSI driver node info: driverNodeID must not be empty"
    );

    d.stop().await.unwrap();
    let _d = driver(DriverConfig::default(), &sock).await;
    fx.handler
        .register(DRIVER, &ep, &versions(&["1.0.0"]))
        .await
        .unwrap();
    assert_eq!(
        fx.handler.driver(DRIVER).unwrap().node_info.node_id,
        "node-1"
    );
}

#[tokio::test]
async fn missing_socket_fails_register_and_records_nothing() {
    let fx = Fixture::new(Duration::from_secs(5));
    let ep = endpoint(&fx.socket("absent.sock"));
    let err = fx.failed_register(DRIVER, &ep, &versions(&["1.0.0"])).await;
    assert!(
        err.starts_with(&format!(
            "error getting node info from CSI driver {DRIVER} at endpoint {ep}: failed to dial the CSI driver at {ep}"
        )),
        "{err}"
    );
}

#[tokio::test]
async fn topology_collision_fails_and_publishes_nothing() {
    let fx = Fixture::new(Duration::from_secs(5));
    let (s1, s2) = (fx.socket("a.sock"), fx.socket("b.sock"));
    let _a = driver(
        DriverConfig {
            name: "a.plugreg.test".into(),
            topology: topology(&[("zone", "z1")]),
            ..DriverConfig::default()
        },
        &s1,
    )
    .await;
    let _b = driver(
        DriverConfig {
            name: "b.plugreg.test".into(),
            topology: topology(&[("zone", "z2")]),
            ..DriverConfig::default()
        },
        &s2,
    )
    .await;
    let v = versions(&["1.0.0"]);
    fx.handler
        .register("a.plugreg.test", &endpoint(&s1), &v)
        .await
        .unwrap();
    let err = fx
        .failed_register("b.plugreg.test", &endpoint(&s2), &v)
        .await;
    assert!(
        err.ends_with(
            r#"detected topology value collision: driver reported "zone":"z2" but existing label is "zone":"z1""#
        ),
        "{err}"
    );
    assert!(fx.handler.driver("a.plugreg.test").is_some());
}

#[tokio::test]
async fn same_name_needs_a_higher_version_and_an_old_instance_does_not_wipe_the_new() {
    let fx = Fixture::new(Duration::from_secs(5));
    let (old, new) = (fx.socket("old.sock"), fx.socket("new.sock"));
    let _o = driver(
        DriverConfig {
            node_id: "n-old".into(),
            ..DriverConfig::default()
        },
        &old,
    )
    .await;
    let _n = driver(
        DriverConfig {
            node_id: "n-new".into(),
            ..DriverConfig::default()
        },
        &new,
    )
    .await;
    let (old_ep, new_ep) = (endpoint(&old), endpoint(&new));
    fx.handler
        .register(DRIVER, &old_ep, &versions(&["1.0.0"]))
        .await
        .unwrap();

    let err = fx
        .handler
        .validate(DRIVER, &new_ep, &versions(&["1.0.0"]))
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "validation failed for CSI Driver {DRIVER} at endpoint {new_ep}: csi: ValidatePlugin for \
             CSI driver \"{DRIVER}\" failed. Another driver with the same name is already registered \
             with a higher supported version: \"1.0.0\""
        )
    );
    fx.handler
        .validate(DRIVER, &new_ep, &versions(&["1.1.0"]))
        .await
        .unwrap();
    fx.handler
        .register(DRIVER, &new_ep, &versions(&["1.1.0"]))
        .await
        .unwrap();

    // The old instance's socket goes away (D6): the new instance stays.
    fx.handler.deregister(DRIVER, &old_ep).await;
    let rec = fx
        .handler
        .driver(DRIVER)
        .expect("new instance still registered");
    assert_eq!(rec.endpoint, new_ep);
    assert_eq!(
        fx.file()
            .await
            .node
            .annotations
            .get(NODE_ID_ANNOTATION)
            .map(String::as_str),
        Some(r#"{"csi.plugreg.test":"n-new"}"#)
    );

    fx.handler.deregister(DRIVER, &new_ep).await;
    fx.assert_not_recorded(DRIVER).await;
}

#[tokio::test]
async fn register_revalidates_versions() {
    let fx = Fixture::new(Duration::from_secs(5));
    let sock = fx.socket("csi.sock");
    let d = driver(DriverConfig::default(), &sock).await;
    let err = fx
        .failed_register(DRIVER, &endpoint(&sock), &versions(&["0.3.0"]))
        .await;
    assert!(
        err.starts_with("csi: RegisterPlugin for CSI driver \"csi.plugreg.test\" failed."),
        "{err}"
    );
    assert_eq!(
        d.calls().node_get_info(),
        0,
        "no call before the versions pass"
    );
}
