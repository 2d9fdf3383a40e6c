//! The world a `csi-attacher` test runs in: a real kube-apiserver (shared by the tests of one
//! binary, per release), the test CSI driver serving ControllerPublish/Unpublish on a Unix
//! socket in a temp dir, and the `csi-attacher` binary as a child process.
//!
//! Each test has its own driver name (so its attacher takes only its own VolumeAttachments),
//! namespace, node names and volumes. The tests write what kube-controller-manager's
//! attach/detach controller and the kubelet would write (VolumeAttachments, CSINodes), except
//! where a test runs the real controller manager.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, Secret};
use k8s_openapi::api::storage::v1::{CSINode, VolumeAttachment};
use kube::api::{Api, DeleteParams, PostParams};
use plugreg_csi_test_driver::{Calls, DriverConfig, RunningDriver};
use plugreg_testpeers::sidecar::{self, LoggedSidecar};
// Each test binary uses a part of this module.
#[allow(unused_imports)]
pub use plugreg_testpeers::sidecar::{free_addr as free_local_addr, merge_json as merge};
use plugreg_testpeers::{ApiServer, KubeVersion};
use serde_json::json;
use tempfile::TempDir;

/// How long a test waits for the cluster to get somewhere.
pub const WAIT: Duration = Duration::from_secs(60);
/// The node ID the test driver accepts.
pub const NODE_ID: &str = "node-1";

/// One test's world.
pub struct Env {
    pub api: Arc<ApiServer>,
    pub client: kube::Client,
    pub dir: TempDir,
    pub driver: Option<RunningDriver>,
    pub calls: Calls,
    /// The driver (= attacher) name, unique to the test.
    pub name: String,
    /// The test's namespace (also its prefix for cluster-scoped names).
    pub ns: String,
    pub socket: PathBuf,
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The volume IDs the test driver knows from the start.
pub const VOLUMES: &[&str] = &["vol-a", "vol-b", "vol-c", "vol-d", "vol-e", "vol-f"];

impl Env {
    /// A namespace and a publishing driver of its own; `config` adjusts the driver.
    pub async fn new(version: KubeVersion, config: impl FnOnce(&mut DriverConfig)) -> Env {
        let api = ApiServer::shared(version).await.expect("kube-apiserver");
        Env::on(api, config).await
    }

    pub async fn on(api: Arc<ApiServer>, config: impl FnOnce(&mut DriverConfig)) -> Env {
        let client = api.client().await.unwrap();
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let name = format!("a{}-{n}.csi.plugreg.test", std::process::id());
        let ns = format!("at{}-{n}", std::process::id());
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
            node_id: NODE_ID.into(),
            controller: true,
            controller_publish: true,
            volumes: VOLUMES.iter().map(|v| (*v).to_owned()).collect(),
            data_dir: Some(dir.path().join("volumes")),
            mount: plugreg_csi_test_driver::MountMode::Directory,
            ..DriverConfig::default()
        };
        config(&mut cfg);
        let calls = cfg.calls.clone();
        let driver = plugreg_csi_test_driver::start(cfg, &socket).await.unwrap();
        Env {
            api,
            client,
            dir,
            driver: Some(driver),
            calls,
            name,
            ns,
            socket,
        }
    }

    /// A cluster-scoped name unique to the test.
    pub fn unique(&self, what: &str) -> String {
        format!("{}-{what}", self.ns)
    }

    pub fn vas(&self) -> Api<VolumeAttachment> {
        Api::all(self.client.clone())
    }

    pub fn pvs(&self) -> Api<PersistentVolume> {
        Api::all(self.client.clone())
    }

    /// The CSINode of `node` listing `drivers` (name, node ID), as the kubelet writes it.
    pub async fn csinode(&self, node: &str, drivers: &[(&str, &str)]) {
        let drivers: Vec<_> = drivers
            .iter()
            .map(|(n, id)| json!({"name": n, "nodeID": id}))
            .collect();
        let api: Api<CSINode> = Api::all(self.client.clone());
        api.create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": node}, "spec": {"drivers": drivers}}),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    }

    /// A CSI PV of this driver with `handle`, merged with `extra`.
    pub async fn pv(&self, name: &str, handle: &str, extra: serde_json::Value) -> PersistentVolume {
        let mut pv = json!({
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "csi": {"driver": self.name, "volumeHandle": handle},
            }
        });
        merge(&mut pv, extra);
        self.pvs()
            .create(&PostParams::default(), &serde_json::from_value(pv).unwrap())
            .await
            .unwrap()
    }

    /// A VolumeAttachment of `attacher` (this driver unless given) for PV `pv` on `node`.
    pub async fn va_of(
        &self,
        name: &str,
        attacher: &str,
        pv: &str,
        node: &str,
    ) -> VolumeAttachment {
        self.vas()
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": name},
                    "spec": {
                        "attacher": attacher,
                        "nodeName": node,
                        "source": {"persistentVolumeName": pv},
                    }
                }))
                .unwrap(),
            )
            .await
            .unwrap()
    }

    pub async fn va(&self, name: &str, pv: &str, node: &str) -> VolumeAttachment {
        self.va_of(name, &self.name.clone(), pv, node).await
    }

    pub async fn secret(&self, name: &str, data: &[(&str, &str)]) {
        let data: serde_json::Map<String, serde_json::Value> = data
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.ns);
        api.create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}, "stringData": data}))
                .unwrap(),
        )
        .await
        .unwrap();
    }

    pub async fn delete_va(&self, name: &str) {
        self.vas()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }

    /// Polls the VolumeAttachment until `done` holds.
    pub async fn wait_va(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(&VolumeAttachment) -> bool,
    ) -> VolumeAttachment {
        let api = self.vas();
        poll(what, || async {
            api.get_opt(name).await.ok().flatten().filter(&done)
        })
        .await
    }

    /// Node `name` as the kubelet leaves it for KCM's attach/detach controller (annotated
    /// `controller-managed-attach-detach`; there is no kubelet here).
    pub async fn kcm_managed_node(&self, name: &str) {
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.client.clone());
        nodes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {
                        "name": name,
                        "annotations": {"volumes.kubernetes.io/controller-managed-attach-detach": "true"},
                    },
                }))
                .unwrap(),
            )
            .await
            .unwrap();
    }

    /// Claim `data` of no class for `pv`, once KCM's PV controller has bound it.
    pub async fn bound_claim_data(&self, pv: &str) {
        let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
            Api::namespaced(self.client.clone(), &self.ns);
        claims
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "storageClassName": "",
                        "volumeName": pv,
                        "resources": {"requests": {"storage": "1Gi"}},
                    }
                }))
                .unwrap(),
            )
            .await
            .unwrap();
        poll("claim Bound", || async {
            claims
                .get_opt("data")
                .await
                .ok()
                .flatten()
                .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
        })
        .await;
    }

    /// Pod `app` on `node` using claim `data`, which makes KCM's attach/detach controller
    /// create a VolumeAttachment (the ServiceAccount admission wants the namespace's default
    /// account; no token is mounted); returns that VolumeAttachment of `attacher` once KCM has
    /// made it (named `csi-<sha256(handle + driver + node)>`).
    pub async fn kcm_attachment(&self, node: &str, attacher: &str) -> VolumeAttachment {
        plugreg_testpeers::rbac::default_service_account(&self.client, &self.ns)
            .await
            .unwrap();
        let pods: Api<k8s_openapi::api::core::v1::Pod> =
            Api::namespaced(self.client.clone(), &self.ns);
        pods.create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "app"},
                "spec": {
                    "nodeName": node,
                    "automountServiceAccountToken": false,
                    "containers": [{"name": "c", "image": "example.invalid/app",
                        "volumeMounts": [{"name": "v", "mountPath": "/data"}]}],
                    "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "data"}}],
                }
            }))
            .unwrap(),
        )
        .await
        .unwrap();
        let va = poll("KCM's VolumeAttachment", || async {
            self.vas()
                .list(&Default::default())
                .await
                .ok()?
                .items
                .into_iter()
                .find(|v| v.spec.attacher == attacher)
        })
        .await;
        let name = va.metadata.name.clone().unwrap();
        assert!(name.starts_with("csi-") && name.len() == 68, "{name}");
        va
    }

    pub async fn wait_attached(&self, name: &str) -> VolumeAttachment {
        self.wait_va(name, &format!("{name} attached"), |va| {
            va.status.as_ref().is_some_and(|s| s.attached)
        })
        .await
    }

    /// Waits for an attach error and returns its message.
    pub async fn wait_attach_error(&self, name: &str, contains: &str) -> VolumeAttachment {
        self.wait_va(
            name,
            &format!("attachError on {name} with {contains:?}"),
            |va| {
                va.status
                    .as_ref()
                    .and_then(|s| s.attach_error.as_ref())
                    .and_then(|e| e.message.as_deref())
                    .is_some_and(|m| m.contains(contains))
            },
        )
        .await
    }

    pub async fn wait_va_gone(&self, name: &str) {
        let api = self.vas();
        poll(&format!("{name} gone"), || async {
            matches!(api.get_opt(name).await, Ok(None)).then_some(())
        })
        .await
    }

    pub async fn wait_pv(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(&PersistentVolume) -> bool,
    ) -> PersistentVolume {
        let api = self.pvs();
        poll(what, || async {
            api.get_opt(name).await.ok().flatten().filter(&done)
        })
        .await
    }

    /// The finalizer this test's attacher writes.
    pub fn finalizer(&self) -> String {
        format!("external-attacher/{}", self.name.replace('.', "-"))
    }

    /// Starts `csi-attacher` for this driver with the client of `kubeconfig` and `args` added.
    pub fn attacher_as(&self, kubeconfig: &Path, args: &[&str]) -> Attacher {
        start_attacher(&self.socket, kubeconfig, args, self.dir.path())
    }

    /// Starts `csi-attacher` for this driver with `args` added.
    pub fn attacher(&self, args: &[&str]) -> Attacher {
        start_attacher(
            &self.socket,
            self.api.kubeconfig_path(),
            args,
            self.dir.path(),
        )
    }
}

/// kube-controller-manager's volume controllers of `version` and its attach/detach controller.
pub fn attach_detach_controllers(version: KubeVersion) -> Vec<&'static str> {
    let mut c = plugreg_testpeers::volume_controllers(version).to_vec();
    c.push(match version {
        KubeVersion::V1_20_2 => "attachdetach",
        KubeVersion::V1_36_2 => "persistentvolume-attach-detach-controller",
    });
    c
}

/// Polls `f` every 50 ms until it returns `Some`, for at most [`WAIT`].
pub async fn poll<T, F, Fut>(what: &str, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    sidecar::poll(what, WAIT, Duration::from_millis(50), f).await
}

/// A running `csi-attacher`; killed when dropped. Its stderr goes to a file.
pub type Attacher = LoggedSidecar;

fn start_attacher(socket: &Path, kubeconfig: &Path, args: &[&str], dir: &Path) -> Attacher {
    static N: AtomicUsize = AtomicUsize::new(0);
    let log = dir.join(format!(
        "csi-attacher-{}.log",
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let cmd =
        sidecar::controller_command(env!("CARGO_BIN_EXE_csi-attacher"), socket, kubeconfig, args);
    LoggedSidecar::spawn(cmd, log)
}

/// One HTTP/1.1 GET on a fresh connection: the status code and the body (`None` when
/// nothing listens yet).
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let code = response.split(' ').nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((code, body))
}
