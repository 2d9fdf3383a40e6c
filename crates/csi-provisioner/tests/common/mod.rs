//! The world a `csi-provisioner` test runs in: a real kube-apiserver with a real
//! kube-controller-manager (its PV controller binds claims), the test CSI driver serving its
//! Controller service on a Unix socket, and the `csi-provisioner` binary as a child process.
//!
//! Tests share one API server and one KCM per release (started by the first test, stopped
//! after the last); each test has its own driver name (so its provisioner takes only its own
//! claims), StorageClass and namespace.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, ListParams, PostParams};
use plugreg_csi_test_driver::{Calls, DriverConfig, RunningDriver};
use plugreg_testpeers::{ApiServer, ControllerManager, KubeVersion};
use serde_json::json;
use tempfile::TempDir;
use tokio::time::Instant;

/// How long a test waits for the cluster to get somewhere.
pub const WAIT: Duration = Duration::from_secs(60);

/// A real API server and KCM, shared by the tests of this binary that run at the same time.
pub struct Cluster {
    pub api: Arc<ApiServer>,
    pub kcm: ControllerManager,
}

/// The shared cluster of `version`.
pub async fn cluster(version: KubeVersion) -> Arc<Cluster> {
    type Slot = tokio::sync::Mutex<Weak<Cluster>>;
    static SLOTS: OnceLock<Vec<(KubeVersion, Slot)>> = OnceLock::new();
    let slots = SLOTS.get_or_init(|| {
        KubeVersion::ALL
            .iter()
            .map(|v| (*v, tokio::sync::Mutex::new(Weak::new())))
            .collect()
    });
    let (_, slot) = slots.iter().find(|(v, _)| *v == version).unwrap();
    let mut slot = slot.lock().await;
    if let Some(c) = slot.upgrade() {
        return c;
    }
    let api = ApiServer::shared(version).await.expect("kube-apiserver");
    let kcm = ControllerManager::start_volume_controllers(&api, &[])
        .await
        .expect("kube-controller-manager");
    let c = Arc::new(Cluster { api, kcm });
    *slot = Arc::downgrade(&c);
    c
}

/// One test's world.
pub struct Env {
    pub cluster: Arc<Cluster>,
    pub client: kube::Client,
    pub dir: TempDir,
    pub driver: Option<RunningDriver>,
    pub calls: Calls,
    /// The driver (= provisioner) name, unique to the test.
    pub name: String,
    /// The test's namespace.
    pub ns: String,
    pub socket: PathBuf,
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

impl Env {
    /// A namespace and a driver of its own; `config` adjusts the driver.
    pub async fn new(version: KubeVersion, config: impl FnOnce(&mut DriverConfig)) -> Env {
        Env::on(cluster(version).await, config).await
    }

    /// As [`Env::new`], on an API server and KCM of its own (KCM's client limit raised): for a
    /// test whose load would slow the other tests' binding down.
    pub async fn isolated(version: KubeVersion, config: impl FnOnce(&mut DriverConfig)) -> Env {
        let api = Arc::new(
            ApiServer::start_version(version)
                .await
                .expect("kube-apiserver"),
        );
        let kcm = ControllerManager::start_volume_controllers(
            &api,
            &["--kube-api-qps=1000", "--kube-api-burst=1000"],
        )
        .await
        .expect("kube-controller-manager");
        Env::on(Arc::new(Cluster { api, kcm }), config).await
    }

    async fn on(cluster: Arc<Cluster>, config: impl FnOnce(&mut DriverConfig)) -> Env {
        let client = cluster.api.client().await.unwrap();
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let name = format!("p{}-{n}.csi.plugreg.test", std::process::id());
        let ns = format!("t{}-{n}", std::process::id());
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap(),
            )
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("csi.sock");
        let mut cfg = DriverConfig {
            name: name.clone(),
            controller: true,
            data_dir: Some(dir.path().join("volumes")),
            mount: plugreg_csi_test_driver::MountMode::Directory,
            ..DriverConfig::default()
        };
        config(&mut cfg);
        let calls = cfg.calls.clone();
        let driver = plugreg_csi_test_driver::start(cfg, &socket).await.unwrap();
        Env {
            cluster,
            client,
            dir,
            driver: Some(driver),
            calls,
            name,
            ns,
            socket,
        }
    }

    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn volumes(&self) -> Api<PersistentVolume> {
        Api::all(self.client.clone())
    }

    /// A StorageClass named after the driver (plus `suffix`) with `extra` merged into it.
    pub async fn class(&self, suffix: &str, extra: serde_json::Value) -> String {
        let name = format!("{}{suffix}", self.name);
        let mut sc = json!({
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": name},
            "provisioner": self.name,
        });
        merge(&mut sc, extra);
        let classes: Api<StorageClass> = Api::all(self.client.clone());
        classes
            .create(&PostParams::default(), &serde_json::from_value(sc).unwrap())
            .await
            .unwrap();
        name
    }

    /// A claim of `class` for `size` with `extra` merged into it.
    pub async fn claim(
        &self,
        name: &str,
        class: &str,
        size: &str,
        extra: serde_json::Value,
    ) -> PersistentVolumeClaim {
        let mut pvc = json!({
            "metadata": {"name": name},
            "spec": {
                "storageClassName": class,
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": size}},
            }
        });
        merge(&mut pvc, extra);
        self.api::<PersistentVolumeClaim>()
            .create(
                &PostParams::default(),
                &serde_json::from_value(pvc).unwrap(),
            )
            .await
            .unwrap()
    }

    /// Starts `csi-provisioner` for this driver with `args` added.
    pub fn provisioner(&self, args: &[&str]) -> Provisioner {
        self.provisioner_env(args, &[])
    }

    /// Starts `csi-provisioner` for the driver at `socket` (another instance of this test's
    /// driver, a node's in a node deployment) with `args` and `env` added.
    pub fn provisioner_at(
        &self,
        socket: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Provisioner {
        Provisioner::start_env(
            socket,
            self.cluster.api.kubeconfig_path(),
            args,
            self.dir.path(),
            None,
            env,
        )
    }

    /// Starts `csi-provisioner` for this driver with `args` added and the environment
    /// variables `env` set (`NAMESPACE`, `POD_NAME`, as a pod's manifest sets them).
    pub fn provisioner_env(&self, args: &[&str], env: &[(&str, &str)]) -> Provisioner {
        Provisioner::start_env(
            &self.socket,
            self.cluster.api.kubeconfig_path(),
            args,
            self.dir.path(),
            None,
            env,
        )
    }

    /// Starts `csi-provisioner` for this driver with the kubeconfig at `kubeconfig` (another
    /// user's credentials) and `args` added.
    pub fn provisioner_as(&self, kubeconfig: &Path, args: &[&str]) -> Provisioner {
        Provisioner::start(&self.socket, kubeconfig, args, self.dir.path(), None)
    }

    /// Starts `csi-provisioner` in its own UTS namespace with host name `host` (its leader
    /// election identity, as two pods of a Deployment have), with `args` added. Needs root.
    pub fn provisioner_on(&self, host: &str, args: &[&str]) -> Provisioner {
        Provisioner::start(
            &self.socket,
            self.cluster.api.kubeconfig_path(),
            args,
            self.dir.path(),
            Some(host),
        )
    }

    /// Polls the claim until `done` holds (at most [`WAIT`]).
    pub async fn wait_claim(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(&PersistentVolumeClaim) -> bool,
    ) -> PersistentVolumeClaim {
        let api = self.api::<PersistentVolumeClaim>();
        poll(what, || async {
            api.get_opt(name).await.ok().flatten().filter(&done)
        })
        .await
    }

    /// Waits until the claim is Bound (as the API server says).
    pub async fn wait_bound(&self, name: &str) -> PersistentVolumeClaim {
        self.wait_claim(name, &format!("claim {name} Bound"), |c| {
            c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
        })
        .await
    }

    /// The events of the object `name` in this test's namespace (or `default` for PVs).
    pub async fn events(&self, ns: &str, name: &str) -> Vec<Event> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), ns);
        api.list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
            .await
            .map(|l| l.items)
            .unwrap_or_default()
    }

    /// Waits for an event of `reason` on `name` and returns its message.
    pub async fn wait_event(&self, ns: &str, name: &str, reason: &str) -> String {
        poll(&format!("event {reason} on {name}"), || async {
            self.events(ns, name)
                .await
                .into_iter()
                .find(|e| e.reason.as_deref() == Some(reason))
                .map(|e| e.message.unwrap_or_default())
        })
        .await
    }

    /// Waits until the PV `name` is gone.
    pub async fn wait_pv_gone(&self, name: &str) {
        let api = self.volumes();
        poll(&format!("PV {name} deleted"), || async {
            match api.get_opt(name).await {
                Ok(None) => Some(()),
                _ => None,
            }
        })
        .await
    }
}

/// Polls `f` every 100 ms until it returns `Some`, for at most [`WAIT`].
pub async fn poll<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn merge(base: &mut serde_json::Value, extra: serde_json::Value) {
    match (base, extra) {
        (serde_json::Value::Object(b), serde_json::Value::Object(e)) => {
            for (k, v) in e {
                merge(b.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, e) => *b = e,
    }
}

/// A running `csi-provisioner` process; killed when dropped. Its stderr (klog) goes to a file.
pub struct Provisioner {
    child: Child,
    pub log: PathBuf,
}

impl Provisioner {
    fn start(
        socket: &Path,
        kubeconfig: &Path,
        args: &[&str],
        dir: &Path,
        host: Option<&str>,
    ) -> Provisioner {
        Self::start_env(socket, kubeconfig, args, dir, host, &[])
    }

    fn start_env(
        socket: &Path,
        kubeconfig: &Path,
        args: &[&str],
        dir: &Path,
        host: Option<&str>,
        env: &[(&str, &str)],
    ) -> Provisioner {
        static N: AtomicUsize = AtomicUsize::new(0);
        let log = dir.join(format!(
            "csi-provisioner-{}.log",
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let out = std::fs::File::create(&log).unwrap();
        let bin = env!("CARGO_BIN_EXE_csi-provisioner");
        let mut cmd = match host {
            None => Command::new(bin),
            Some(h) => {
                let mut c = Command::new("unshare");
                c.args([
                    "--uts",
                    "--",
                    "sh",
                    "-c",
                    "hostname \"$0\" && exec \"$@\"",
                    h,
                    bin,
                ]);
                c
            }
        };
        let child = cmd
            .arg(format!("--csi-address={}", socket.display()))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg("--v=5")
            .args(args)
            .env_remove("KUBECONFIG")
            .env_remove("NAMESPACE")
            .env_remove("POD_NAME")
            .env_remove("NODE_NAME")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        Provisioner { child, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, as a node failure or an OOM kill would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Provisioner {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Labels of a map, for assertions.
pub fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

// Helpers added for tests/checklist.rs.

impl Env {
    /// A Node `name` with `labels` and its CSINode listing this test's driver with `keys` as
    /// topology keys (what the kubelet and the node-driver-registrar would write; there is no
    /// kubelet here, so the test writes them).
    pub async fn topology_node(&self, name: &str, labels: &[(&str, &str)], keys: &[&str]) {
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.client.clone());
        nodes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": name, "labels": map(labels)}}))
                    .unwrap(),
            )
            .await
            .unwrap();
        self.csinode(name, keys).await;
    }

    /// The CSINode `name` listing this test's driver with topology `keys`.
    pub async fn csinode(&self, name: &str, keys: &[&str]) {
        let csinodes: Api<k8s_openapi::api::storage::v1::CSINode> = Api::all(self.client.clone());
        csinodes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": name},
                    "spec": {"drivers": [{"name": self.name, "nodeID": name, "topologyKeys": keys}]},
                }))
                .unwrap(),
            )
            .await
            .unwrap();
    }

    /// Merge-patches the claim `name` with `patch`.
    pub async fn patch_claim(&self, name: &str, patch: serde_json::Value) {
        self.api::<PersistentVolumeClaim>()
            .patch(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .unwrap();
    }

    /// Polls the PV until `done` holds (at most [`WAIT`]).
    pub async fn wait_pv(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(&PersistentVolume) -> bool,
    ) -> PersistentVolume {
        let api = self.volumes();
        poll(what, || async {
            api.get_opt(name).await.ok().flatten().filter(&done)
        })
        .await
    }

    /// The messages of every event of `reason` on `name` so far.
    pub async fn event_messages(&self, ns: &str, name: &str, reason: &str) -> Vec<String> {
        self.events(ns, name)
            .await
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .map(|e| e.message.unwrap_or_default())
            .collect()
    }
}

impl Provisioner {
    /// Waits for a log line containing `needle` and returns it.
    pub async fn wait_log_line(&self, needle: &str) -> String {
        poll(&format!("log line {needle:?}"), || async {
            self.log()
                .lines()
                .find(|l| l.contains(needle))
                .map(str::to_owned)
        })
        .await
    }

    /// How many established TCP connections the process holds to `port`.
    pub fn connections_to(&self, port: u16) -> usize {
        plugreg_testpeers::sidecar::connections_to(self.child.id(), port)
    }

    /// Waits until the HTTP endpoint at `addr` accepts connections.
    pub async fn wait_http(&self, addr: std::net::SocketAddr) {
        poll(&format!("HTTP endpoint {addr}"), || async {
            tokio::net::TcpStream::connect(addr).await.ok().map(|_| ())
        })
        .await
    }
}

/// A free port on 127.0.0.1 (free when this returns; the OS does not hand it out again at once).
pub fn free_local_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// One HTTP/1.1 GET on a fresh connection: the status code and the body.
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let code = response.split(' ').nth(1).unwrap().parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

// The in-flight record (plugreg_provisioner::record): Leases in the provisioner's namespace,
// which is `default` for these tests unless `--leader-election-namespace` says otherwise.

impl Env {
    /// The volumes the record of this test's provisioner holds in `namespace` now.
    pub async fn record_in(&self, namespace: &str) -> Vec<String> {
        use k8s_openapi::api::coordination::v1::Lease;
        use plugreg_provisioner::record;
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), namespace);
        let base = plugreg_provisioner::flags::lease_name(&self.name);
        let list = leases
            .list(&ListParams::default().labels(&format!("{}={base}", record::LABEL)))
            .await
            .unwrap();
        let mut volumes: Vec<String> = list
            .items
            .iter()
            .filter_map(|l| l.metadata.annotations.as_ref()?.get(record::ANNOTATION))
            .flat_map(|page| record::decode(page).unwrap())
            .map(|e| e.volume)
            .collect();
        volumes.sort();
        volumes
    }

    /// The volumes the record holds in `default`.
    pub async fn record(&self) -> Vec<String> {
        self.record_in("default").await
    }

    /// Waits until the record holds `volume`.
    pub async fn wait_recorded(&self, volume: &str) {
        poll(&format!("volume {volume} recorded"), || async {
            self.record()
                .await
                .iter()
                .any(|v| v == volume)
                .then_some(())
        })
        .await
    }

    /// Waits until the record holds nothing.
    pub async fn wait_record_empty(&self) {
        poll("the in-flight record empty", || async {
            self.record().await.is_empty().then_some(())
        })
        .await
    }

    /// The name the default flags give the volume of a claim with this UID.
    pub fn volume_name_of(uid: &str) -> String {
        format!("pvc-{uid}")
    }
}

impl Provisioner {
    /// Waits until the log has `n` lines containing every one of `needles`.
    pub async fn wait_log_lines(&self, needles: &[&str], n: usize) {
        poll(&format!("{n} log lines with {needles:?}"), || async {
            let count = self
                .log()
                .lines()
                .filter(|l| needles.iter().all(|x| l.contains(x)))
                .count();
            (count >= n).then_some(())
        })
        .await
    }
}
