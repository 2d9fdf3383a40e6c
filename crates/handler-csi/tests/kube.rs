//! The CSI handler with the Kubernetes API sink against a real kube-apiserver (v1.20, with etcd)
//! from `plugreg-testpeers`, and a fake CSI driver on a Unix socket.
//!
//! The peers are built by `interop/build-peers.sh`; without them these tests fail with a message
//! naming the missing peer and that script. Tests running at the same time share one API server
//! (each uses its own Node, nodes being cluster-scoped); the last one to finish stops it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::{CSINode, CSINodeDriver, VolumeNodeResources};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use plugreg_csi_test_driver::{DriverConfig, RunningDriver, start};
use plugreg_handler_api::PluginHandler;
use plugreg_handler_csi::{CsiHandler, KubeSink, NODE_ID_ANNOTATION};
use plugreg_testpeers::ApiServer;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

fn shared_slot() -> &'static tokio::sync::Mutex<Weak<ApiServer>> {
    static SLOT: OnceLock<tokio::sync::Mutex<Weak<ApiServer>>> = OnceLock::new();
    SLOT.get_or_init(|| tokio::sync::Mutex::new(Weak::new()))
}

/// The API server shared by the tests running now (started if none runs).
async fn api_server() -> Arc<ApiServer> {
    let mut slot = shared_slot().lock().await;
    if let Some(s) = slot.upgrade() {
        return s;
    }
    let s = Arc::new(ApiServer::start().await.unwrap_or_else(|e| {
        panic!("cannot start the kube-apiserver test peer (built by interop/build-peers.sh): {e}")
    }));
    *slot = Arc::downgrade(&s);
    s
}

struct Env {
    server: Arc<ApiServer>,
    client: kube::Client,
    node: String,
    dir: tempfile::TempDir,
}

impl Env {
    /// An API server, a client, and a fresh Node `node` carrying `labels`.
    async fn new(node: &str, labels: &[(&str, &str)]) -> Self {
        let server = api_server().await;
        let client = server.client().await.expect("API server client");
        let n = Node {
            metadata: ObjectMeta {
                name: Some(node.to_owned()),
                labels: Some(map(labels)),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Node>::all(client.clone())
            .create(&PostParams::default(), &n)
            .await
            .expect("create Node");
        Self {
            server,
            client,
            node: node.to_owned(),
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn handler(&self) -> CsiHandler {
        self.handler_with(KubeSink::new(self.client.clone(), &self.node))
    }

    fn handler_with(&self, sink: KubeSink) -> CsiHandler {
        CsiHandler::new(Arc::new(sink), Duration::from_secs(10))
    }

    fn socket(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    async fn node(&self) -> Node {
        Api::<Node>::all(self.client.clone())
            .get(&self.node)
            .await
            .expect("get Node")
    }

    async fn node_ids(&self) -> Option<String> {
        self.node()
            .await
            .metadata
            .annotations
            .unwrap_or_default()
            .get(NODE_ID_ANNOTATION)
            .cloned()
    }

    async fn labels(&self) -> BTreeMap<String, String> {
        self.node().await.metadata.labels.unwrap_or_default()
    }

    async fn csinode(&self) -> Option<CSINode> {
        Api::<CSINode>::all(self.client.clone())
            .get_opt(&self.node)
            .await
            .expect("get CSINode")
    }

    async fn csinode_drivers(&self) -> Vec<CSINodeDriver> {
        self.csinode()
            .await
            .map(|c| c.spec.drivers)
            .unwrap_or_default()
    }
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn v1() -> Vec<String> {
    vec!["1.0.0".to_owned()]
}

async fn driver(
    name: &str,
    node_id: &str,
    topology: &[(&str, &str)],
    max: i64,
    socket: &Path,
) -> RunningDriver {
    let config = DriverConfig {
        name: name.to_owned(),
        node_id: node_id.to_owned(),
        topology: map(topology),
        max_volumes_per_node: max,
        ..DriverConfig::default()
    };
    start(config, socket).await.expect("start fake CSI driver")
}

/// Registers, expecting a failure, and rolls back as the plugin manager does (deregister with
/// the same name and endpoint, D2); returns the error text the plugin would get.
async fn failed_register(
    h: &CsiHandler,
    name: &str,
    endpoint: &str,
    versions: &[String],
) -> String {
    let err = h
        .register(name, endpoint, versions)
        .await
        .expect_err("register must fail")
        .to_string();
    h.deregister(name, endpoint).await;
    err
}

fn ep(p: &Path) -> String {
    p.display().to_string()
}

fn entry(name: &str, node_id: &str, keys: &[&str], count: Option<i32>) -> CSINodeDriver {
    CSINodeDriver {
        name: name.to_owned(),
        node_id: node_id.to_owned(),
        topology_keys: (!keys.is_empty()).then(|| keys.iter().map(|k| (*k).to_owned()).collect()),
        allocatable: count.map(|c| VolumeNodeResources { count: Some(c) }),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_writes_annotation_labels_and_csinode() {
    let env = Env::new("csi-writes", &[("kubernetes.io/hostname", "csi-writes")]).await;
    let h = env.handler();
    let sock = env.socket("a.sock");
    let _d = driver(
        "a.plugreg.test",
        "node-a",
        &[
            ("topology.plugreg.test/zone", "z1"),
            ("topology.plugreg.test/rack", "r1"),
        ],
        10,
        &sock,
    )
    .await;
    h.validate("a.plugreg.test", &ep(&sock), &v1())
        .await
        .unwrap();
    h.register("a.plugreg.test", &ep(&sock), &v1())
        .await
        .unwrap();

    assert_eq!(
        env.node_ids().await.as_deref(),
        Some(r#"{"a.plugreg.test":"node-a"}"#)
    );
    assert_eq!(
        env.labels().await,
        map(&[
            ("kubernetes.io/hostname", "csi-writes"),
            ("topology.plugreg.test/rack", "r1"),
            ("topology.plugreg.test/zone", "z1"),
        ])
    );
    let node = env.node().await;
    let csinode = env.csinode().await.expect("CSINode created");
    let owners = csinode
        .metadata
        .owner_references
        .clone()
        .unwrap_or_default();
    assert_eq!(owners.len(), 1, "{owners:?}");
    assert_eq!(owners[0].api_version, "v1");
    assert_eq!(owners[0].kind, "Node");
    assert_eq!(owners[0].name, env.node);
    assert_eq!(Some(&owners[0].uid), node.metadata.uid.as_ref());
    assert_eq!(
        csinode.spec.drivers,
        vec![entry(
            "a.plugreg.test",
            "node-a",
            &["topology.plugreg.test/rack", "topology.plugreg.test/zone"],
            Some(10)
        )]
    );

    // Registering the same information again writes nothing.
    let rv_node = node.metadata.resource_version.clone();
    let rv_csinode = csinode.metadata.resource_version.clone();
    let h2 = env.handler();
    h2.register("a.plugreg.test", &ep(&sock), &v1())
        .await
        .unwrap();
    assert_eq!(env.node().await.metadata.resource_version, rv_node);
    assert_eq!(
        env.csinode().await.unwrap().metadata.resource_version,
        rv_csinode
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_driver_merges_into_the_annotation_and_csinode() {
    let env = Env::new("csi-merge", &[]).await;
    let h = env.handler();
    let (sa, sb) = (env.socket("a.sock"), env.socket("b.sock"));
    let _a = driver("a.plugreg.test", "na", &[("topology.a/zone", "z")], 0, &sa).await;
    let _b = driver("b.plugreg.test", "nb", &[], i64::MAX, &sb).await;
    h.register("b.plugreg.test", &ep(&sb), &v1()).await.unwrap();
    h.register("a.plugreg.test", &ep(&sa), &v1()).await.unwrap();

    assert_eq!(
        env.node_ids().await.as_deref(),
        Some(r#"{"a.plugreg.test":"na","b.plugreg.test":"nb"}"#)
    );
    assert_eq!(env.labels().await, map(&[("topology.a/zone", "z")]));
    assert_eq!(
        env.csinode_drivers().await,
        vec![
            entry("b.plugreg.test", "nb", &[], Some(i32::MAX)),
            entry("a.plugreg.test", "na", &["topology.a/zone"], None),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_collision_writes_nothing_until_the_label_is_fixed() {
    let env = Env::new("csi-collision", &[("topology.plugreg.test/zone", "old")]).await;
    let h = env.handler();
    let sock = env.socket("a.sock");
    let _d = driver(
        "a.plugreg.test",
        "na",
        &[("topology.plugreg.test/zone", "new")],
        5,
        &sock,
    )
    .await;

    let err = failed_register(&h, "a.plugreg.test", &ep(&sock), &v1()).await;
    assert_eq!(
        err,
        "error updating Node object with CSI driver node info: detected topology value collision: \
         driver reported \"topology.plugreg.test/zone\":\"new\" but existing label is \
         \"topology.plugreg.test/zone\":\"old\""
    );
    assert_eq!(env.node_ids().await, None);
    assert_eq!(
        env.labels().await,
        map(&[("topology.plugreg.test/zone", "old")])
    );
    assert!(env.csinode_drivers().await.is_empty());
    assert!(h.driver("a.plugreg.test").is_none());

    // The operator fixes the label; the manager's retry then succeeds.
    Api::<Node>::all(env.client.clone())
        .patch(
            &env.node,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"labels": {"topology.plugreg.test/zone": "new"}}}),
            ),
        )
        .await
        .unwrap();
    h.register("a.plugreg.test", &ep(&sock), &v1())
        .await
        .unwrap();
    assert_eq!(
        env.node_ids().await.as_deref(),
        Some(r#"{"a.plugreg.test":"na"}"#)
    );
    assert_eq!(
        env.csinode_drivers().await,
        vec![entry(
            "a.plugreg.test",
            "na",
            &["topology.plugreg.test/zone"],
            Some(5)
        )]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistration_removes_only_its_own_entries() {
    let env = Env::new("csi-deregister", &[]).await;
    let h = env.handler();
    let (sa, sb) = (env.socket("a.sock"), env.socket("b.sock"));
    let _a = driver("a.plugreg.test", "na", &[("topology.a/zone", "z")], 0, &sa).await;
    let _b = driver("b.plugreg.test", "nb", &[("topology.b/rack", "r")], 0, &sb).await;
    h.register("a.plugreg.test", &ep(&sa), &v1()).await.unwrap();
    h.register("b.plugreg.test", &ep(&sb), &v1()).await.unwrap();

    h.deregister("a.plugreg.test", &ep(&sa)).await;
    assert!(h.driver("a.plugreg.test").is_none());
    assert_eq!(
        env.node_ids().await.as_deref(),
        Some(r#"{"b.plugreg.test":"nb"}"#)
    );
    assert_eq!(
        env.csinode_drivers().await,
        vec![entry("b.plugreg.test", "nb", &["topology.b/rack"], None)]
    );
    let labels = map(&[("topology.a/zone", "z"), ("topology.b/rack", "r")]);
    assert_eq!(env.labels().await, labels, "topology labels stay");

    h.deregister("b.plugreg.test", &ep(&sb)).await;
    assert_eq!(env.node_ids().await, None, "annotation removed when empty");
    let csinode = env.csinode().await.expect("the CSINode itself stays");
    assert!(csinode.spec.drivers.is_empty());
    assert_eq!(env.labels().await, labels);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_an_old_instance_does_not_wipe_the_new_one() {
    let env = Env::new("csi-upgrade", &[]).await;
    let h = env.handler();
    let (old, new) = (env.socket("old.sock"), env.socket("new.sock"));
    let _o = driver("a.plugreg.test", "n-old", &[], 0, &old).await;
    let _n = driver("a.plugreg.test", "n-new", &[], 0, &new).await;
    h.register("a.plugreg.test", &ep(&old), &v1())
        .await
        .unwrap();
    let v11 = vec!["1.1.0".to_owned()];
    h.validate("a.plugreg.test", &ep(&new), &v11).await.unwrap();
    h.register("a.plugreg.test", &ep(&new), &v11).await.unwrap();
    assert_eq!(
        env.node_ids().await.as_deref(),
        Some(r#"{"a.plugreg.test":"n-new"}"#)
    );

    h.deregister("a.plugreg.test", &ep(&old)).await;
    assert_eq!(h.driver("a.plugreg.test").unwrap().endpoint, ep(&new));
    assert_eq!(
        env.node_ids().await.as_deref(),
        Some(r#"{"a.plugreg.test":"n-new"}"#)
    );
    assert_eq!(
        env.csinode_drivers().await,
        vec![entry("a.plugreg.test", "n-new", &[], None)]
    );

    h.deregister("a.plugreg.test", &ep(&new)).await;
    assert_eq!(env.node_ids().await, None);
    assert!(env.csinode_drivers().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_csinode_write_undoes_the_node_change() {
    let env = Env::new("csi-undo", &[]).await;
    let h = env.handler();
    let (sa, sb) = (env.socket("a.sock"), env.socket("b.sock"));
    let _a = driver("a.plugreg.test", "na", &[], 0, &sa).await;
    h.register("a.plugreg.test", &ep(&sa), &v1()).await.unwrap();
    let before = env.node().await;

    // The Node takes any annotation value, but the API server refuses a CSINode node id this
    // long: the Node is written first, the CSINode write fails, the Node change is undone.
    let long_id = "x".repeat(300);
    let _b = driver(
        "b.plugreg.test",
        &long_id,
        &[("topology.b/zone", "z")],
        0,
        &sb,
    )
    .await;
    let err = failed_register(&h, "b.plugreg.test", &ep(&sb), &v1()).await;
    assert!(
        err.starts_with(
            "error updating CSINode object with CSI driver node info: failed to update CSINode \"csi-undo\": "
        ),
        "{err}"
    );
    let after = env.node().await;
    assert_eq!(after.metadata.annotations, before.metadata.annotations);
    assert_eq!(after.metadata.labels, before.metadata.labels);
    assert_eq!(
        env.csinode_drivers().await,
        vec![entry("a.plugreg.test", "na", &[], None)]
    );
    assert!(h.driver("b.plugreg.test").is_none());

    // An upgrade whose new entry is refused: the previous entry and node id come back.
    let sa2 = env.socket("a2.sock");
    let _a2 = driver("a.plugreg.test", &long_id, &[], 0, &sa2).await;
    let v11 = vec!["1.1.0".to_owned()];
    let err = failed_register(&h, "a.plugreg.test", &ep(&sa2), &v11).await;
    assert!(
        err.starts_with("error updating CSINode object with CSI driver node info"),
        "{err}"
    );
    assert_eq!(h.driver("a.plugreg.test").unwrap().endpoint, ep(&sa));
    assert_eq!(
        env.node_ids().await.as_deref(),
        Some(r#"{"a.plugreg.test":"na"}"#)
    );
    assert_eq!(
        env.csinode_drivers().await,
        vec![entry("a.plugreg.test", "na", &[], None)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_lose_no_entry() {
    use plugreg_handler_csi::{DriverNodeInfo, NodeInfoSink};
    let env = Env::new("csi-concurrent", &[]).await;
    // One sink per writer, as separate processes would be: only the API server orders them.
    // Each writer writes each object once, so one conflicts at most 3 times: within the 5
    // attempts a sink makes.
    let writers = (0..4).map(|i| {
        let sink = KubeSink::new(env.client.clone(), &env.node);
        async move {
            let info = DriverNodeInfo {
                driver: format!("d{i}.plugreg.test"),
                node_id: format!("n{i}"),
                topology: BTreeMap::new(),
                max_volumes: 0,
            };
            sink.publish(&info).await
        }
    });
    for r in futures::future::join_all(writers).await {
        r.expect("publish");
    }
    let ids: BTreeMap<String, String> =
        serde_json::from_str(&env.node_ids().await.expect("annotation")).unwrap();
    assert_eq!(ids.len(), 4, "{ids:?}");
    let mut names: Vec<String> = env
        .csinode_drivers()
        .await
        .into_iter()
        .map(|d| d.name)
        .collect();
    names.sort();
    assert_eq!(
        names,
        (0..4)
            .map(|i| format!("d{i}.plugreg.test"))
            .collect::<Vec<_>>()
    );
}

/// A TCP forwarder in front of the API server that can be switched off: when off it cuts the
/// open connections and closes new ones at once, as an unreachable server looks to a client.
struct Switch {
    addr: SocketAddr,
    on: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Switch {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (on, rx) = watch::channel(true);
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !*rx.borrow() {
                    continue;
                }
                let mut rx = rx.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = rx.wait_for(|on| !*on) => {}
                    }
                });
            }
        });
        Self { addr, on, task }
    }

    fn set(&self, on: bool) {
        self.on.send_replace(on);
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The server's kubeconfig with its server URL pointing at `addr`.
fn kubeconfig_via(server: &ApiServer, addr: SocketAddr, dir: &Path) -> PathBuf {
    let mut kc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(server.kubeconfig_path()).unwrap()).unwrap();
    kc["clusters"][0]["cluster"]["server"] = format!("https://{addr}").into();
    let path = dir.join("kubeconfig-via-switch");
    std::fs::write(&path, serde_json::to_vec_pretty(&kc).unwrap()).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_api_server_fails_register_without_leftovers_and_a_retry_succeeds() {
    let env = Env::new("csi-unreachable", &[]).await;
    let upstream: SocketAddr = env
        .server
        .url()
        .trim_start_matches("https://")
        .parse()
        .unwrap();
    let switch = Switch::start(upstream).await;
    let kubeconfig = kubeconfig_via(&env.server, switch.addr, env.dir.path());
    let sink = KubeSink::from_config(Some(&kubeconfig), &env.node)
        .await
        .expect("sink from kubeconfig");
    let h = env.handler_with(sink);
    let sock = env.socket("a.sock");
    let _d = driver(
        "a.plugreg.test",
        "na",
        &[("topology.a/zone", "z")],
        3,
        &sock,
    )
    .await;

    switch.set(false);
    let err = failed_register(&h, "a.plugreg.test", &ep(&sock), &v1()).await;
    assert!(
        err.starts_with(
            "error updating Node object with CSI driver node info: failed to get Node \"csi-unreachable\""
        ),
        "{err}"
    );
    // The roll-back deregister could not reach the server either; nothing was written.
    assert!(h.driver("a.plugreg.test").is_none());
    assert_eq!(env.node_ids().await, None);
    assert!(env.labels().await.is_empty());
    assert!(env.csinode().await.is_none());

    switch.set(true);
    h.register("a.plugreg.test", &ep(&sock), &v1())
        .await
        .unwrap();
    assert_eq!(
        env.node_ids().await.as_deref(),
        Some(r#"{"a.plugreg.test":"na"}"#)
    );
    assert_eq!(
        env.csinode_drivers().await,
        vec![entry("a.plugreg.test", "na", &["topology.a/zone"], Some(3))]
    );
}
