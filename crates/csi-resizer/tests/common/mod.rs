//! The world a `csi-resizer` test runs in: a real kube-apiserver with a real
//! kube-controller-manager (its PV controller binds claims to the test's pre-provisioned PVs),
//! the test CSI driver serving its Controller service on a Unix socket, and the `csi-resizer`
//! binary as a child process.
//!
//! Tests share one API server and one KCM per release; each test has its own driver name (so
//! its resizer takes only its own claims), StorageClass (`allowVolumeExpansion: true`) and
//! namespace.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use plugreg_csi_test_driver::{Calls, DriverConfig, RunningDriver};
// Each test binary uses a part of this module.
#[allow(unused_imports)]
pub use plugreg_testpeers::sidecar::merge_json as merge;
use plugreg_testpeers::sidecar::{self, LoggedSidecar};
use plugreg_testpeers::{ApiServer, ControllerManager, KubeVersion};
use serde_json::json;
use tempfile::TempDir;

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
    /// The driver name, unique to the test.
    pub name: String,
    /// The test's namespace.
    pub ns: String,
    pub socket: PathBuf,
    /// The StorageClass (named after the driver).
    pub class: String,
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The driver's pre-provisioned volumes: `vol-0` .. `vol-9`.
pub fn volume_ids() -> Vec<String> {
    (0..10).map(|i| format!("vol-{i}")).collect()
}

impl Env {
    /// A namespace, a class and a driver of its own (ControllerExpandVolume on; `config`
    /// adjusts it).
    pub async fn new(version: KubeVersion, config: impl FnOnce(&mut DriverConfig)) -> Env {
        Env::on(cluster(version).await, config).await
    }

    /// [`new`](Self::new) on a cluster of the test's own.
    pub async fn on(cluster: Arc<Cluster>, config: impl FnOnce(&mut DriverConfig)) -> Env {
        let client = cluster.api.client().await.unwrap();
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let name = format!("r{}-{n}.csi.plugreg.test", std::process::id());
        let ns = format!("r{}-{n}", std::process::id());
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap(),
            )
            .await
            .unwrap();
        let classes: Api<StorageClass> = Api::all(client.clone());
        classes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": name},
                    "provisioner": name,
                    "allowVolumeExpansion": true,
                }))
                .unwrap(),
            )
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("csi.sock");
        let mut cfg = DriverConfig {
            name: name.clone(),
            controller: true,
            controller_expand: true,
            volumes: volume_ids(),
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
            class: name.clone(),
            name,
            ns,
            socket,
        }
    }

    /// Stops the driver and starts a new one on the same socket (the default test
    /// configuration, then `config`); [`calls`](Self::calls) becomes the new driver's.
    pub async fn restart_driver(&mut self, config: impl FnOnce(&mut DriverConfig)) {
        if let Some(d) = self.driver.take() {
            d.stop().await.unwrap();
        }
        let mut cfg = DriverConfig {
            name: self.name.clone(),
            controller: true,
            controller_expand: true,
            volumes: volume_ids(),
            data_dir: Some(self.dir.path().join("volumes")),
            mount: plugreg_csi_test_driver::MountMode::Directory,
            ..DriverConfig::default()
        };
        config(&mut cfg);
        self.calls = cfg.calls.clone();
        self.driver = Some(
            plugreg_csi_test_driver::start(cfg, &self.socket)
                .await
                .unwrap(),
        );
    }

    pub fn claims(&self) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub fn volumes(&self) -> Api<PersistentVolume> {
        Api::all(self.client.clone())
    }

    /// The PV name of the claim `claim`.
    pub fn pv_name(&self, claim: &str) -> String {
        format!("{}-{claim}", self.ns)
    }

    /// A PV of `driver` (this test's if `None`) with handle `volume` and `size`, and a claim
    /// `name` bound to it by KCM; returns the claim once Bound.
    pub async fn bound_claim_of(
        &self,
        name: &str,
        size: &str,
        volume: &str,
        driver: Option<&str>,
        pv_extra: serde_json::Value,
    ) -> PersistentVolumeClaim {
        let pv_name = self.pv_name(name);
        let mut pv = json!({
            "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": self.class,
                "claimRef": {"namespace": self.ns, "name": name},
                "csi": {"driver": driver.unwrap_or(&self.name), "volumeHandle": volume, "fsType": "ext4"},
                "mountOptions": ["noatime"],
            }
        });
        merge(&mut pv, pv_extra);
        self.volumes()
            .create(&PostParams::default(), &serde_json::from_value(pv).unwrap())
            .await
            .unwrap();
        let pvc = json!({
            "metadata": {"name": name},
            "spec": {
                "storageClassName": self.class,
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": size}},
                "volumeName": pv_name,
            }
        });
        self.claims()
            .create(
                &PostParams::default(),
                &serde_json::from_value(pvc).unwrap(),
            )
            .await
            .unwrap();
        self.wait_claim(name, "Bound with capacity", |c| {
            let st = c.status.as_ref();
            st.and_then(|s| s.phase.as_deref()) == Some("Bound")
                && st.and_then(|s| s.capacity.as_ref()).is_some()
        })
        .await
    }

    /// [`bound_claim_of`](Self::bound_claim_of) for this test's driver.
    pub async fn bound_claim(&self, name: &str, size: &str, volume: &str) -> PersistentVolumeClaim {
        self.bound_claim_of(name, size, volume, None, json!({}))
            .await
    }

    /// Sets the claim's request to `size`.
    pub async fn request(&self, name: &str, size: &str) {
        self.claims()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"resources": {"requests": {"storage": size}}}})),
            )
            .await
            .unwrap();
    }

    /// Patches the claim's status (as the kubelet would).
    pub async fn patch_status(&self, name: &str, body: serde_json::Value) {
        self.claims()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(body))
            .await
            .unwrap();
    }

    /// Starts `csi-resizer` for this driver with `args` added.
    pub fn resizer(&self, args: &[&str]) -> Resizer {
        self.resizer_as(self.cluster.api.kubeconfig_path(), args)
    }

    /// [`resizer`](Self::resizer) with another identity: the kubeconfig at `kubeconfig`.
    pub fn resizer_as(&self, kubeconfig: &std::path::Path, args: &[&str]) -> Resizer {
        static N: AtomicUsize = AtomicUsize::new(0);
        let log = self.dir.path().join(format!(
            "csi-resizer-{}.log",
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let cmd = sidecar::controller_command(
            env!("CARGO_BIN_EXE_csi-resizer"),
            &self.socket,
            kubeconfig,
            args,
        );
        LoggedSidecar::spawn(cmd, log)
    }

    /// Polls the claim until `done` holds (at most [`WAIT`]).
    pub async fn wait_claim(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(&PersistentVolumeClaim) -> bool,
    ) -> PersistentVolumeClaim {
        let api = self.claims();
        poll(&format!("claim {name}: {what}"), || async {
            api.get_opt(name).await.ok().flatten().filter(&done)
        })
        .await
    }

    /// Polls the PV until `done` holds.
    pub async fn wait_pv(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(&PersistentVolume) -> bool,
    ) -> PersistentVolume {
        let api = self.volumes();
        poll(&format!("PV {name}: {what}"), || async {
            api.get_opt(name).await.ok().flatten().filter(&done)
        })
        .await
    }

    /// The events of the object `name` in this test's namespace.
    pub async fn events(&self, name: &str) -> Vec<Event> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), &self.ns);
        api.list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
            .await
            .map(|l| l.items)
            .unwrap_or_default()
    }

    /// Waits for an event of `reason` on `name` and returns its message.
    pub async fn wait_event(&self, name: &str, reason: &str) -> String {
        poll(&format!("event {reason} on {name}"), || async {
            self.events(name)
                .await
                .into_iter()
                .find(|e| e.reason.as_deref() == Some(reason))
                .map(|e| e.message.unwrap_or_default())
        })
        .await
    }

    /// Waits until the driver has had `n` calls of `method`.
    pub async fn wait_calls(&self, method: plugreg_csi_test_driver::Method, n: u64) {
        tokio::time::timeout(WAIT, self.calls.wait_for(method, n))
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {n} {method} calls"));
    }
}

/// Polls `f` every 100 ms until it returns `Some`, for at most [`WAIT`].
pub async fn poll<T, F, Fut>(what: &str, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    sidecar::poll(what, WAIT, Duration::from_millis(100), f).await
}

/// A running `csi-resizer` process; killed when dropped. Its stderr goes to a file.
pub type Resizer = LoggedSidecar;

/// `status.capacity.storage` of a claim.
pub fn capacity(c: &PersistentVolumeClaim) -> Option<String> {
    Some(
        c.status
            .as_ref()?
            .capacity
            .as_ref()?
            .get("storage")?
            .0
            .clone(),
    )
}

/// `status.allocatedResources.storage` of a claim.
pub fn allocated(c: &PersistentVolumeClaim) -> Option<String> {
    Some(
        c.status
            .as_ref()?
            .allocated_resources
            .as_ref()?
            .get("storage")?
            .0
            .clone(),
    )
}

/// `status.allocatedResourceStatuses.storage` of a claim.
pub fn resize_status(c: &PersistentVolumeClaim) -> Option<String> {
    c.status
        .as_ref()?
        .allocated_resource_statuses
        .as_ref()?
        .get("storage")
        .cloned()
}

/// The claim's condition of `type_`.
pub fn condition(
    c: &PersistentVolumeClaim,
    type_: &str,
) -> Option<k8s_openapi::api::core::v1::PersistentVolumeClaimCondition> {
    c.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|x| x.type_ == type_)
        .cloned()
}

/// The claim's condition types.
pub fn condition_types(c: &PersistentVolumeClaim) -> Vec<String> {
    c.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|v| v.iter().map(|x| x.type_.clone()).collect())
        .unwrap_or_default()
}

/// `spec.capacity.storage` of a PV.
pub fn pv_capacity(pv: &PersistentVolume) -> String {
    pv.spec
        .as_ref()
        .and_then(|s| s.capacity.as_ref())
        .and_then(|c| c.get("storage"))
        .map(|q| q.0.clone())
        .unwrap_or_default()
}

/// A VolumeAttributesClass `<ns>-<name>` of this driver with `params`; returns its name.
pub async fn class(env: &Env, name: &str, params: &[(&str, &str)]) -> String {
    let full = format!("{}-{name}", env.ns);
    let api: kube::Api<plugreg_resizer::kube::VolumeAttributesClass> = Api::all(env.client.clone());
    let vac: plugreg_resizer::kube::VolumeAttributesClass = serde_json::from_value(json!({
        "metadata": {"name": full},
        "driverName": env.name,
        "parameters": params.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<std::collections::HashMap<_, _>>(),
    }))
    .unwrap();
    let mut body = serde_json::to_value(&vac).unwrap();
    body["apiVersion"] = json!("storage.k8s.io/v1");
    body["kind"] = json!("VolumeAttributesClass");
    api.create(
        &kube::api::PostParams::default(),
        &serde_json::from_value(body).unwrap(),
    )
    .await
    .unwrap();
    full
}

/// Sets (or clears) the claim's `volumeAttributesClassName`.
pub async fn set_class(env: &Env, claim: &str, class: Option<&str>) {
    env.claims()
        .patch(
            claim,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"volumeAttributesClassName": class}})),
        )
        .await
        .unwrap();
}
