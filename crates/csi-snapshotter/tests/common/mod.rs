//! The world a `csi-snapshotter` test runs in: its own real kube-apiserver v1.36.2 with the
//! snapshot CRDs of v8.6.0 and the real Go snapshot-controller v8.6.0 (one per test: two
//! controllers on one API server would both act on every VolumeSnapshot), the test CSI driver
//! serving snapshots on a Unix socket in a temp dir, and the `csi-snapshotter` binary as a
//! child process.
//!
//! The tests write what kube-controller-manager and the provisioner would have written for a
//! bound claim (a CSI PersistentVolume and its bound PersistentVolumeClaim); everything about
//! snapshots is done by the real controller and the sidecar.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Namespace, Secret};
use kube::api::{Api, ApiResource, DynamicObject, ListParams, PostParams};
use plugreg_csi_test_driver::{Calls, DriverConfig, RunningDriver};
use plugreg_sidecar_kit::snapshot::{VolumeSnapshot, VolumeSnapshotClass, VolumeSnapshotContent};
use plugreg_testpeers::sidecar::{self, LoggedSidecar};
use plugreg_testpeers::{ApiServer, KubeVersion, SnapshotController};
use serde_json::{Value, json};
use tempfile::TempDir;

/// How long a test waits for the cluster to get somewhere.
pub const WAIT: Duration = Duration::from_secs(90);
/// The namespace of every test's objects (each test has its own API server).
pub const NS: &str = "snaps";
/// The volume IDs the test driver knows from the start.
pub const VOLUMES: &[&str] = &["vol-a", "vol-b", "vol-c", "vol-d"];

/// One test's world.
pub struct Env {
    pub api: ApiServer,
    pub controller: SnapshotController,
    pub client: kube::Client,
    pub dir: TempDir,
    pub driver: Option<RunningDriver>,
    pub calls: Calls,
    /// The driver name.
    pub name: String,
    pub socket: PathBuf,
    /// The log files of the sidecars started, shown when a wait times out.
    pub logs: std::sync::Mutex<Vec<PathBuf>>,
}

impl Env {
    /// The API server, the snapshot peers, the namespace and a snapshotting driver; `config`
    /// adjusts the driver.
    pub async fn new(config: impl FnOnce(&mut DriverConfig)) -> Env {
        Env::with_controller(&[], config).await
    }

    /// [`Env::new`] with `controller_args` added to the snapshot-controller's flags.
    pub async fn with_controller(
        controller_args: &[&str],
        config: impl FnOnce(&mut DriverConfig),
    ) -> Env {
        let api = ApiServer::start_version(KubeVersion::V1_36_2)
            .await
            .expect("kube-apiserver v1.36.2");
        let controller = SnapshotController::start_with(&api, controller_args)
            .await
            .expect("snapshot-controller v8.6.0");
        let client = api.client().await.unwrap();
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap(),
            )
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("csi.sock");
        let name = "snap.csi.plugreg.test".to_owned();
        let mut cfg = DriverConfig {
            name: name.clone(),
            controller: true,
            snapshots: true,
            volumes: VOLUMES.iter().map(|v| (*v).to_owned()).collect(),
            data_dir: Some(dir.path().join("volumes")),
            mount: plugreg_csi_test_driver::MountMode::Directory,
            ..DriverConfig::default()
        };
        config(&mut cfg);
        // The volumes' data, as a real driver's backing store holds it (a snapshot copies it).
        for v in VOLUMES {
            std::fs::create_dir_all(dir.path().join("volumes").join(v)).unwrap();
        }
        let calls = cfg.calls.clone();
        let driver = plugreg_csi_test_driver::start(cfg, &socket).await.unwrap();
        Env {
            api,
            controller,
            client,
            dir,
            driver: Some(driver),
            calls,
            name,
            socket,
            logs: std::sync::Mutex::default(),
        }
    }

    pub fn contents(&self) -> Api<VolumeSnapshotContent> {
        Api::all(self.client.clone())
    }

    pub fn snapshots(&self) -> Api<VolumeSnapshot> {
        Api::namespaced(self.client.clone(), NS)
    }

    /// A claim `claim` bound to a CSI PV of this driver with `handle`, as the PV controller
    /// leaves them.
    pub async fn bound_claim(&self, claim: &str, handle: &str) {
        let pv = format!("pv-{claim}");
        sidecar::bound_claim(&self.client, NS, claim, &pv, &self.name, handle, true).await;
    }

    pub async fn class(&self, name: &str, policy: &str, parameters: Value) {
        self.create::<VolumeSnapshotClass>(json!({
            "metadata": {"name": name},
            "driver": self.name, "deletionPolicy": policy, "parameters": parameters,
        }))
        .await;
    }

    /// Creates a snapshot API object (the kit's types do not write `apiVersion` and `kind`)
    /// from `object`, in its `metadata.namespace` if it has one.
    pub async fn create<K: kube::Resource<DynamicType = ()>>(
        &self,
        mut object: Value,
    ) -> DynamicObject {
        let ar = ApiResource::erase::<K>(&());
        object["apiVersion"] = json!(ar.api_version);
        object["kind"] = json!(ar.kind);
        let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &ar),
            None => Api::all_with(self.client.clone(), &ar),
        };
        api.create(
            &PostParams::default(),
            &serde_json::from_value(object).unwrap(),
        )
        .await
        .unwrap()
    }

    pub async fn secret(&self, name: &str, data: &[(&str, &str)]) {
        let data: serde_json::Map<String, Value> = data
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        let api: Api<Secret> = Api::namespaced(self.client.clone(), NS);
        api.create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}, "stringData": data}))
                .unwrap(),
        )
        .await
        .unwrap();
    }

    /// A VolumeSnapshot of `claim` with `class`; returns its UID.
    pub async fn snapshot(&self, name: &str, claim: &str, class: &str) -> String {
        self.create::<VolumeSnapshot>(json!({
            "metadata": {"name": name, "namespace": NS},
            "spec": {"source": {"persistentVolumeClaimName": claim},
                     "volumeSnapshotClassName": class},
        }))
        .await
        .metadata
        .uid
        .unwrap()
    }

    /// Polls the VolumeSnapshot `name` until `done` holds.
    pub async fn wait_snapshot(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(&VolumeSnapshot) -> bool,
    ) -> VolumeSnapshot {
        let api = self.snapshots();
        self.poll(what, || async {
            api.get_opt(name).await.ok().flatten().filter(&done)
        })
        .await
    }

    /// Polls the content `name` until `done` holds.
    pub async fn wait_content(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(&VolumeSnapshotContent) -> bool,
    ) -> VolumeSnapshotContent {
        let api = self.contents();
        self.poll(what, || async {
            api.get_opt(name).await.ok().flatten().filter(&done)
        })
        .await
    }

    pub async fn wait_content_gone(&self, name: &str) {
        let api = self.contents();
        self.poll(&format!("{name} gone"), || async {
            matches!(api.get_opt(name).await, Ok(None)).then_some(())
        })
        .await
    }

    /// Deletes the VolumeSnapshot `snapshot` and waits until its content `content` is gone,
    /// with exactly one DeleteSnapshot sent to the driver.
    pub async fn delete_snapshot_once(&self, snapshot: &str, content: &str) {
        self.snapshots()
            .delete(snapshot, &kube::api::DeleteParams::default())
            .await
            .unwrap();
        self.wait_content_gone(content).await;
        assert_eq!(self.calls.delete_snapshot_requests().len(), 1);
    }

    /// The events about the object `name` (reason, message), oldest first.
    pub async fn events(&self, namespace: &str, name: &str) -> Vec<(String, String)> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        let mut list = api
            .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
            .await
            .unwrap()
            .items;
        list.sort_by_key(|e| e.first_timestamp.clone().map(|t| t.0));
        list.into_iter()
            .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
            .collect()
    }

    /// Waits until the object `name` has an event with `reason` whose message contains
    /// `message`.
    pub async fn wait_event(&self, namespace: &str, name: &str, reason: &str, message: &str) {
        self.poll(&format!("event {reason} {message:?} on {name}"), || async {
            self.events(namespace, name)
                .await
                .into_iter()
                .any(|(r, m)| r == reason && m.contains(message))
                .then_some(())
        })
        .await
    }

    /// Polls `f` every 100 ms until it returns `Some`, for at most [`WAIT`]; on time-out the
    /// panic shows the controller's log and the sidecars' logs.
    pub async fn poll<T, F, Fut>(&self, what: &str, f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let logs = || {
            format!(
                "--- snapshot-controller ---\n{}\n{}",
                self.controller.log_tail(),
                sidecar::log_tails(&self.logs.lock().unwrap(), 60)
            )
        };
        sidecar::poll_showing(what, WAIT, logs, f).await
    }

    /// Starts `csi-snapshotter` for this driver with `args` added.
    pub fn snapshotter(&self, args: &[&str]) -> Snapshotter {
        let s = start_snapshotter(
            &self.socket,
            self.api.kubeconfig_path(),
            args,
            self.dir.path(),
        );
        self.logs.lock().unwrap().push(s.log.clone());
        s
    }
}

/// A running `csi-snapshotter`; killed when dropped. Its stderr goes to a file.
pub type Snapshotter = LoggedSidecar;

/// Starts one for `env`'s driver with `args`, and `NODE_NAME` set to `node` if given.
pub fn start_snapshotter_env(env: &Env, args: &[&str], node: Option<&str>) -> Snapshotter {
    let s = spawn(
        &env.socket,
        env.api.kubeconfig_path(),
        args,
        env.dir.path(),
        node,
    );
    env.logs.lock().unwrap().push(s.log.clone());
    s
}

/// Starts one for the driver at `socket` with the client of `kubeconfig` and `args` added,
/// its log in `dir`.
pub fn start_snapshotter(
    socket: &Path,
    kubeconfig: &Path,
    args: &[&str],
    dir: &Path,
) -> Snapshotter {
    spawn(socket, kubeconfig, args, dir, None)
}

fn spawn(
    socket: &Path,
    kubeconfig: &Path,
    args: &[&str],
    dir: &Path,
    node: Option<&str>,
) -> Snapshotter {
    static N: AtomicUsize = AtomicUsize::new(0);
    let log = dir.join(format!(
        "csi-snapshotter-{}.log",
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let mut cmd = sidecar::controller_command(
        env!("CARGO_BIN_EXE_csi-snapshotter"),
        socket,
        kubeconfig,
        args,
    );
    if let Some(node) = node {
        cmd.env("NODE_NAME", node);
    }
    LoggedSidecar::spawn(cmd, log)
}
