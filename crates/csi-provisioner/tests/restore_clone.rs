//! Restore and clone (issue 21) against a real kube-apiserver, kube-controller-manager and the
//! real Go snapshot-controller v8.6.0 (v1.36.2: the snapshot CRDs need it; one clone test runs
//! on v1.20.2 too), with the test
//! driver serving snapshots and clones: a restored or cloned volume starts as a copy of its
//! source's files, so the tests read the data back from the driver's directory.
//!
//! The snapshots are pre-provisioned: the test takes the snapshot with the driver's
//! CreateSnapshot and writes the VolumeSnapshotContent's status itself, which is the
//! csi-snapshotter sidecar's job (built beside this one, not part of this crate); the Go
//! snapshot-controller binds the VolumeSnapshot to it and copies its status, as in a cluster.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use common::{Env, poll};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use plugreg_csi_test_driver::{DriverConfig, Fault, Method, RunningDriver};
use plugreg_proto::csi::v1::controller_client::ControllerClient;
use plugreg_proto::csi::v1::{
    CapacityRange, CreateSnapshotRequest, CreateVolumeRequest, VolumeCapability, volume_capability,
    volume_content_source,
};
use plugreg_sidecar_kit::snapshot::{VolumeSnapshot, VolumeSnapshotContent};
use plugreg_testpeers::{KubeVersion, SnapshotController};
use serde_json::json;

const SNAPSHOT_FINALIZER: &str =
    "provisioner.storage.kubernetes.io/volumesnapshot-as-source-protection";
const CLONE_FINALIZER: &str = "provisioner.storage.kubernetes.io/cloning-protection";
const MI: i64 = 1 << 20;

/// The Go snapshot-controller, one for the tests of this binary running now (two would fight
/// over the same objects).
async fn snapshot_controller(env: &Env) -> Arc<SnapshotController> {
    static SLOT: OnceLock<tokio::sync::Mutex<Weak<SnapshotController>>> = OnceLock::new();
    let mut slot = SLOT
        .get_or_init(|| tokio::sync::Mutex::new(Weak::new()))
        .lock()
        .await;
    if let Some(c) = slot.upgrade() {
        return c;
    }
    let c = Arc::new(
        SnapshotController::start(&env.cluster.api)
            .await
            .expect("the Go snapshot-controller (interop/build-peers.sh unpacks it)"),
    );
    *slot = Arc::downgrade(&c);
    c
}

/// A test's world: the driver (persistent, with snapshots and clones, `config` applied), a
/// second instance of it on the same data directory for the test's own calls (so that the
/// faults and the call log of the first are the provisioner's alone), and the Go
/// snapshot-controller.
struct World {
    env: Env,
    _seed: RunningDriver,
    seed_socket: PathBuf,
    _snapshots: Arc<SnapshotController>,
}

async fn world(config: impl FnOnce(&mut DriverConfig)) -> World {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.snapshots = true;
        c.clone_volume = true;
        c.persistent = true;
        config(c);
    })
    .await;
    let seed_socket = env.dir.path().join("seed.sock");
    let seed = plugreg_csi_test_driver::start(
        DriverConfig {
            name: env.name.clone(),
            controller: true,
            snapshots: true,
            clone_volume: true,
            persistent: true,
            data_dir: Some(data_dir(&env)),
            mount: plugreg_csi_test_driver::MountMode::Directory,
            ..DriverConfig::default()
        },
        &seed_socket,
    )
    .await
    .unwrap();
    let snapshots = snapshot_controller(&env).await;
    World {
        env,
        _seed: seed,
        seed_socket,
        _snapshots: snapshots,
    }
}

fn data_dir(env: &Env) -> PathBuf {
    env.dir.path().join("volumes")
}

/// The file `name` of the driver's volume `id`.
fn read(env: &Env, id: &str, name: &str) -> Option<String> {
    std::fs::read_to_string(data_dir(env).join(id).join(name)).ok()
}

fn write(env: &Env, id: &str, name: &str, text: &str) {
    std::fs::write(data_dir(env).join(id).join(name), text).unwrap();
}

async fn client(path: &Path) -> ControllerClient<tonic::transport::Channel> {
    ControllerClient::new(
        plugreg_transport::connect_path(path, Duration::from_secs(5))
            .await
            .unwrap(),
    )
}

impl World {
    /// A volume of `bytes` holding `data.txt` = `text`, snapshotted: the snapshot's id.
    async fn seed_snapshot(&self, name: &str, bytes: i64, text: &str) -> String {
        let mut c = client(&self.seed_socket).await;
        let v = c
            .create_volume(CreateVolumeRequest {
                name: format!("seed-{name}"),
                capacity_range: Some(CapacityRange {
                    required_bytes: bytes,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![VolumeCapability {
                    access_type: Some(volume_capability::AccessType::Mount(Default::default())),
                    access_mode: Some(volume_capability::AccessMode {
                        mode: volume_capability::access_mode::Mode::SingleNodeWriter as i32,
                    }),
                }],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        write(&self.env, &v.volume_id, "data.txt", text);
        c.create_snapshot(CreateSnapshotRequest {
            source_volume_id: v.volume_id,
            name: format!("snap-{name}"),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap()
        .snapshot_id
    }

    /// A pre-provisioned VolumeSnapshotContent for `handle` (with `spec` merged into its spec
    /// and `status` as its status, as csi-snapshotter would write it) and the VolumeSnapshot
    /// `name` bound to it by the Go controller. Waits until the snapshot shows the content.
    async fn snapshot(
        &self,
        name: &str,
        handle: &str,
        spec: serde_json::Value,
        status: serde_json::Value,
    ) -> VolumeSnapshot {
        let env = &self.env;
        let content = format!("content-{}-{name}", env.ns);
        let mut vsc = json!({
            "apiVersion": "snapshot.storage.k8s.io/v1",
            "kind": "VolumeSnapshotContent",
            "metadata": {"name": content},
            "spec": {
                "driver": env.name,
                "deletionPolicy": "Retain",
                "source": {"snapshotHandle": handle},
                "volumeSnapshotRef": {"name": name, "namespace": env.ns},
            },
        });
        for (k, v) in spec.as_object().unwrap() {
            vsc["spec"][k] = v.clone();
        }
        // The snapshot types keep no apiVersion and kind: created as dynamic objects.
        let ar = ApiResource::erase::<VolumeSnapshotContent>(&());
        Api::<DynamicObject>::all_with(env.client.clone(), &ar)
            .create(
                &PostParams::default(),
                &serde_json::from_value(vsc).unwrap(),
            )
            .await
            .unwrap();
        let contents: Api<VolumeSnapshotContent> = Api::all(env.client.clone());
        contents
            .patch_status(
                &content,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": status})),
            )
            .await
            .unwrap();
        let ar = ApiResource::erase::<VolumeSnapshot>(&());
        Api::<DynamicObject>::namespaced_with(env.client.clone(), &env.ns, &ar)
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "snapshot.storage.k8s.io/v1",
                    "kind": "VolumeSnapshot",
                    "metadata": {"name": name},
                    "spec": {"source": {"volumeSnapshotContentName": content}},
                }))
                .unwrap(),
            )
            .await
            .unwrap();
        let snapshots: Api<VolumeSnapshot> = env.api();
        poll(&format!("snapshot {name} bound"), || async {
            snapshots.get(name).await.ok().filter(|s| {
                s.status
                    .as_ref()
                    .and_then(|s| s.bound_volume_snapshot_content_name.as_deref())
                    == Some(content.as_str())
            })
        })
        .await
    }

    /// A snapshot of 1 MiB holding `text`, ready, with restore size 1 MiB.
    async fn ready_snapshot(&self, name: &str, text: &str) -> String {
        let handle = self.seed_snapshot(name, MI, text).await;
        self.snapshot(
            name,
            &handle,
            json!({}),
            json!({"snapshotHandle": handle, "readyToUse": true, "restoreSize": MI}),
        )
        .await;
        let api: Api<VolumeSnapshot> = self.env.api();
        poll(&format!("snapshot {name} ready"), || async {
            api.get(name).await.ok().filter(|s| {
                s.status.as_ref().and_then(|s| s.ready_to_use) == Some(true)
                    && s.status
                        .as_ref()
                        .and_then(|s| s.restore_size.as_ref())
                        .is_some()
            })
        })
        .await;
        handle
    }

    async fn snapshot_finalizers(&self, name: &str) -> Option<Vec<String>> {
        let api: Api<VolumeSnapshot> = self.env.api();
        api.get_opt(name)
            .await
            .unwrap()
            .map(|s| s.metadata.finalizers.unwrap_or_default())
    }
}

fn restore_from(snapshot: &str) -> serde_json::Value {
    json!({"spec": {"dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": snapshot}}})
}

fn clone_of(claim: &str) -> serde_json::Value {
    json!({"spec": {"dataSource": {"kind": "PersistentVolumeClaim", "name": claim}}})
}

fn snapshot_id(r: &CreateVolumeRequest) -> Option<&str> {
    match r.volume_content_source.as_ref()?.r#type.as_ref()? {
        volume_content_source::Type::Snapshot(s) => Some(&s.snapshot_id),
        volume_content_source::Type::Volume(_) => None,
    }
}

fn source_volume_id(r: &CreateVolumeRequest) -> Option<&str> {
    match r.volume_content_source.as_ref()?.r#type.as_ref()? {
        volume_content_source::Type::Volume(v) => Some(&v.volume_id),
        volume_content_source::Type::Snapshot(_) => None,
    }
}

fn handle_of(pv: &k8s_openapi::api::core::v1::PersistentVolume) -> String {
    pv.spec
        .as_ref()
        .unwrap()
        .csi
        .as_ref()
        .unwrap()
        .volume_handle
        .clone()
}

/// The first CreateVolume of the provisioner's driver takes `delay`.
fn first_create_takes(delay: Duration) -> impl FnOnce(&mut DriverConfig) {
    move |c| {
        c.faults.insert(
            Method::CreateVolume,
            Fault {
                delay: Some(delay),
                delay_first: Some(1),
                ..Fault::default()
            },
        );
    }
}

/// The first CreateVolume of the provisioner's driver takes 3 s.
fn slow_first_create(c: &mut DriverConfig) {
    first_create_takes(Duration::from_secs(3))(c);
}

/// A restore: CreateVolume names the content's snapshot handle and the claim's size (larger
/// than the snapshot); the new volume holds the snapshot's data; the provisioner's finalizer
/// is on the VolumeSnapshot while CreateVolume runs and gone after.
#[tokio::test]
async fn a_claim_restored_from_a_snapshot_has_its_data() {
    let w = world(slow_first_create).await;
    let env = &w.env;
    let handle = w.ready_snapshot("snap", "hello from the snapshot").await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim("restored", &class, "2Mi", restore_from("snap"))
        .await;
    env.calls.wait_for(Method::CreateVolume, 1).await;
    assert!(
        w.snapshot_finalizers("snap")
            .await
            .unwrap()
            .iter()
            .any(|f| f == SNAPSHOT_FINALIZER),
        "the restore protection is on the snapshot while CreateVolume runs"
    );
    let claim = env.wait_bound("restored").await;
    let creates = env.calls.create_requests();
    assert_eq!(creates.len(), 1);
    assert_eq!(snapshot_id(&creates[0]), Some(handle.as_str()));
    assert_eq!(creates[0].capacity_range.unwrap().required_bytes, 2 * MI);
    let pv = env
        .volumes()
        .get(claim.spec.unwrap().volume_name.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(
        read(env, &handle_of(&pv), "data.txt").as_deref(),
        Some("hello from the snapshot")
    );
    poll("the restore protection removed", || async {
        (!w.snapshot_finalizers("snap")
            .await
            .unwrap()
            .iter()
            .any(|f| f == SNAPSHOT_FINALIZER))
        .then_some(())
    })
    .await;
}

/// Each restore check of upstream's, in its order, with its text in `ProvisioningFailed`, and
/// no CreateVolume for any of them; a conversion the content allows is restored.
#[tokio::test]
async fn restore_checks_fail_with_upstreams_texts() {
    let w = world(|_| {}).await;
    let env = &w.env;
    let handle = w.seed_snapshot("s", MI, "x").await;
    let ready =
        |size: i64| json!({"snapshotHandle": handle, "readyToUse": true, "restoreSize": size});
    let none = json!({});
    w.snapshot(
        "other-driver",
        &handle,
        json!({"driver": "other.csi.example.com"}),
        ready(MI),
    )
    .await;
    w.snapshot(
        "no-handle",
        &handle,
        none.clone(),
        json!({"readyToUse": true}),
    )
    .await;
    w.snapshot("big", &handle, none.clone(), ready(4 * MI))
        .await;
    w.snapshot(
        "block",
        &handle,
        json!({"sourceVolumeMode": "Block"}),
        ready(MI),
    )
    .await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    let fs = json!({"spec": {"volumeMode": "Filesystem"}});
    let who = |c: &str| {
        format!(
            "requested volume {}/{c} modifies the mode of the source volume but does not have permission to do so.",
            env.ns
        )
    };
    let content = |vs: &str| format!("content-{}-{vs}", env.ns);
    let rows: Vec<(&str, &str, &str, serde_json::Value, String)> = vec![
        (
            "missing",
            "nosuch",
            "1Mi",
            none.clone(),
            "error getting snapshot nosuch from api server: volumesnapshots.snapshot.storage.k8s.io \"nosuch\" not found".into(),
        ),
        (
            "foreign",
            "other-driver",
            "1Mi",
            none.clone(),
            "snapshot other-driver not bound".into(),
        ),
        (
            "handleless",
            "no-handle",
            "1Mi",
            none.clone(),
            "snapshot handle no-handle is not available".into(),
        ),
        (
            "small",
            "big",
            "1Mi",
            none.clone(),
            "requested volume size 1048576 is less than the size 4194304 for the source snapshot big".into(),
        ),
        (
            "converted",
            "block",
            "1Mi",
            fs.clone(),
            format!(
                "{} snapshot.storage.kubernetes.io/allow-volume-mode-change annotation is not present on snapshotcontent {}",
                who("converted"),
                content("block")
            ),
        ),
    ];
    for (claim, vs, size, extra, _) in &rows {
        let mut spec = restore_from(vs);
        if let Some(mode) = extra.pointer("/spec/volumeMode") {
            spec["spec"]["volumeMode"] = mode.clone();
        }
        env.claim(claim, &class, size, spec).await;
    }
    for (claim, vs, _, _, msg) in &rows {
        let got = env.wait_event(&env.ns, claim, "ProvisioningFailed").await;
        assert_eq!(
            got,
            format!(
                "failed to provision volume with StorageClass \"{class}\": error getting handle for DataSource Type VolumeSnapshot by Name {vs}: {msg}"
            ),
            "claim {claim}"
        );
    }
    // The content's word on conversion: not a boolean, false, then true.
    let contents: Api<VolumeSnapshotContent> = Api::all(env.client.clone());
    let allow = |v: &str| json!({"metadata": {"annotations": {"snapshot.storage.kubernetes.io/allow-volume-mode-change": v}}});
    contents
        .patch(
            &content("block"),
            &PatchParams::default(),
            &Patch::Merge(&allow("no")),
        )
        .await
        .unwrap();
    let want = format!(
        "failed to provision volume with StorageClass \"{class}\": error getting handle for DataSource Type VolumeSnapshot by Name block: {} failed to convert snapshot.storage.kubernetes.io/allow-volume-mode-change annotation value to boolean with error: strconv.ParseBool: parsing \"no\": invalid syntax",
        who("converted")
    );
    poll("the not-a-boolean text", || async {
        env.event_messages(&env.ns, "converted", "ProvisioningFailed")
            .await
            .contains(&want)
            .then_some(())
    })
    .await;
    contents
        .patch(
            &content("block"),
            &PatchParams::default(),
            &Patch::Merge(&allow("false")),
        )
        .await
        .unwrap();
    let want = format!(
        "failed to provision volume with StorageClass \"{class}\": error getting handle for DataSource Type VolumeSnapshot by Name block: {} snapshot.storage.kubernetes.io/allow-volume-mode-change is set to false on snapshotcontent {}",
        who("converted"),
        content("block")
    );
    poll("the set-to-false text", || async {
        env.event_messages(&env.ns, "converted", "ProvisioningFailed")
            .await
            .contains(&want)
            .then_some(())
    })
    .await;
    assert_eq!(env.calls.count(Method::CreateVolume), 0);
    contents
        .patch(
            &content("block"),
            &PatchParams::default(),
            &Patch::Merge(&allow("true")),
        )
        .await
        .unwrap();
    env.wait_bound("converted").await;
    assert!(
        env.calls
            .create_requests()
            .iter()
            .all(|r| snapshot_id(r) == Some(handle.as_str()))
    );
}

/// A snapshot not ready yet: `ProvisioningFailed` "is not Ready", retried with back-off, and
/// restored once the snapshot is ready.
#[tokio::test]
async fn a_snapshot_not_ready_is_retried_until_it_is() {
    let w = world(|_| {}).await;
    let env = &w.env;
    let handle = w.seed_snapshot("s", MI, "late").await;
    w.snapshot(
        "later",
        &handle,
        json!({}),
        json!({"snapshotHandle": handle, "readyToUse": false}),
    )
    .await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms", "--retry-interval-max=1s"]);
    env.claim("restored", &class, "1Mi", restore_from("later"))
        .await;
    let msg = env
        .wait_event(&env.ns, "restored", "ProvisioningFailed")
        .await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": error getting handle for DataSource Type VolumeSnapshot by Name later: snapshot later is not Ready"
        )
    );
    let contents: Api<VolumeSnapshotContent> = Api::all(env.client.clone());
    contents
        .patch_status(
            &format!("content-{}-later", env.ns),
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"readyToUse": true}})),
        )
        .await
        .unwrap();
    let claim = env.wait_bound("restored").await;
    let creates = env.calls.create_requests();
    assert_eq!(creates.len(), 1);
    assert_eq!(snapshot_id(&creates[0]), Some(handle.as_str()));
    let volume = claim.spec.unwrap().volume_name.unwrap();
    assert_eq!(read(env, &volume, "data.txt").as_deref(), Some("late"));
}

/// A clone: CreateVolume names the source volume's handle, the clone (of another class of the
/// same driver) holds the source's data, the source gets the cloning protection; deleting the
/// source while another clone of it is Pending leaves it in place until that clone is gone,
/// then the finalizer goes and the source with it. `--cloning-protection-threads` sets the
/// cloning-protection workers.
#[tokio::test]
async fn a_clone_has_its_sources_data_and_protects_the_source() {
    let w = world(|_| {}).await;
    let env = &w.env;
    let class = env.class("", json!({})).await;
    let other = env.class("-other", json!({})).await;
    let later = env
        .class(
            "-later",
            json!({"volumeBindingMode": "WaitForFirstConsumer"}),
        )
        .await;
    let p = env.provisioner(&[
        "--retry-interval-start=100ms",
        "--cloning-protection-threads=3",
    ]);
    p.wait_log_line("3 cloning-protection workers").await;
    env.claim("src", &class, "1Mi", json!({})).await;
    let src = env.wait_bound("src").await;
    let src_pv = env
        .volumes()
        .get(src.spec.as_ref().unwrap().volume_name.as_deref().unwrap())
        .await
        .unwrap();
    let src_handle = handle_of(&src_pv);
    write(env, &src_handle, "data.txt", "hello from the source");

    env.claim("copy", &other, "2Mi", clone_of("src")).await;
    let copy = env.wait_bound("copy").await;
    let creates = env.calls.create_requests();
    let create = creates.last().unwrap();
    assert_eq!(source_volume_id(create), Some(src_handle.as_str()));
    assert_eq!(create.capacity_range.unwrap().required_bytes, 2 * MI);
    let copy_pv = env
        .volumes()
        .get(copy.spec.unwrap().volume_name.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(
        read(env, &handle_of(&copy_pv), "data.txt").as_deref(),
        Some("hello from the source")
    );
    let claims = env.api::<PersistentVolumeClaim>();
    assert!(
        claims
            .get("src")
            .await
            .unwrap()
            .finalizers()
            .iter()
            .any(|f| f == CLONE_FINALIZER)
    );

    // A clone waiting for its consumer stays Pending: the source must stay while it does.
    env.claim("waiting", &later, "1Mi", clone_of("src")).await;
    claims
        .delete("src", &DeleteParams::default())
        .await
        .unwrap();
    p.wait_log_line("PVC 'src' is in 'Pending' state, cloning in progress")
        .await;
    let held = claims.get("src").await.unwrap();
    assert!(held.metadata.deletion_timestamp.is_some());
    assert!(held.finalizers().iter().any(|f| f == CLONE_FINALIZER));
    claims
        .delete("waiting", &DeleteParams::default())
        .await
        .unwrap();
    poll("the source claim gone", || async {
        matches!(claims.get_opt("src").await, Ok(None)).then_some(())
    })
    .await;
}

/// Each clone check of upstream's, in its order, with its text, and no CreateVolume.
#[tokio::test]
async fn clone_checks_fail_with_upstreams_texts() {
    let w = world(|_| {}).await;
    let env = &w.env;
    let class = env.class("", json!({})).await;
    let later = env
        .class(
            "-later",
            json!({"volumeBindingMode": "WaitForFirstConsumer"}),
        )
        .await;
    let p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim("src", &class, "2Mi", json!({})).await;
    env.wait_bound("src").await;
    env.claim("pending", &later, "1Mi", json!({})).await;
    // A source bound to a volume of another driver.
    let foreign = format!("{}-foreign", env.ns);
    env.volumes()
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": foreign},
                "spec": {
                    "capacity": {"storage": "1Mi"}, "accessModes": ["ReadWriteOnce"],
                    "storageClassName": class,
                    "csi": {"driver": "other.csi.example.com", "volumeHandle": "h"},
                    "claimRef": {"namespace": env.ns, "name": "elsewhere"},
                },
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    env.claim(
        "elsewhere",
        &class,
        "1Mi",
        json!({"spec": {"volumeName": foreign}}),
    )
    .await;
    env.wait_bound("elsewhere").await;
    let creates_before = env.calls.count(Method::CreateVolume);
    let same_mode =
        "the source PVC and destination PVCs must have the same volume mode for cloning.";
    let rows: Vec<(&str, &str, &str, Option<&str>, String)> = vec![
        (
            "of-nothing",
            "nosuch",
            "2Mi",
            None,
            format!(
                "error getting PVC nosuch (namespace \"{}\") from api server: persistentvolumeclaim \"nosuch\" not found",
                env.ns
            ),
        ),
        (
            "of-pending",
            "pending",
            "2Mi",
            None,
            "the PVC DataSource pending must have a status of Bound.  Got {Pending [] map[] [] map[] map[] <nil> <nil>}".into(),
        ),
        (
            "too-small",
            "src",
            "1Mi",
            None,
            "error, new PVC request must be greater than or equal in size to the specified PVC data source, requested 1048576 but source is 2097152".into(),
        ),
        (
            "of-foreign",
            "elsewhere",
            "2Mi",
            None,
            "claim in dataSource not bound or invalid".into(),
        ),
        (
            "as-block",
            "src",
            "2Mi",
            Some("Block"),
            format!("{same_mode}  Source is Filesystem, but new PVC requested Block"),
        ),
    ];
    for (claim, src, size, mode, _) in &rows {
        let mut spec = clone_of(src);
        if let Some(m) = mode {
            spec["spec"]["volumeMode"] = json!(m);
        }
        env.claim(claim, &class, size, spec).await;
    }
    for (claim, src, _, _, msg) in &rows {
        let got = env.wait_event(&env.ns, claim, "ProvisioningFailed").await;
        assert_eq!(
            got,
            format!(
                "failed to provision volume with StorageClass \"{class}\": error getting handle for DataSource Type PersistentVolumeClaim by Name {src}: {msg}"
            ),
            "claim {claim}"
        );
    }
    assert_eq!(env.calls.count(Method::CreateVolume), creates_before);
    drop(p);
}

/// The first CreateVolume of the provisioner's driver never answers (until it is killed).
fn hang_first_create(c: &mut DriverConfig) {
    first_create_takes(Duration::from_secs(3600))(c);
}

/// No leak (P3): SIGKILL mid-CreateVolume of a restore; the record's request carries the
/// content source, so the new provisioner's CreateVolume is the same call; the claim is Bound
/// with the snapshot's data. The snapshot, deleted meanwhile, is kept by the provisioner's
/// finalizer (the Go controller says `SnapshotDeletePending`) until the restore is done.
#[tokio::test]
async fn a_restore_interrupted_by_a_restart_finishes_and_keeps_its_snapshot() {
    let w = world(hang_first_create).await;
    let env = &w.env;
    let handle = w.ready_snapshot("snap", "kept").await;
    let class = env.class("", json!({})).await;
    let mut first = env.provisioner(&[]);
    let claim = env
        .claim("restored", &class, "1Mi", restore_from("snap"))
        .await;
    let volume = Env::volume_name_of(&claim.uid().unwrap());
    env.calls.wait_for(Method::CreateVolume, 1).await;
    assert!(env.record().await.contains(&volume));
    first.kill();
    let snapshots: Api<VolumeSnapshot> = env.api();
    snapshots
        .delete("snap", &DeleteParams::default())
        .await
        .unwrap();
    let msg = env
        .wait_event(&env.ns, "snap", "SnapshotDeletePending")
        .await;
    assert_eq!(msg, "Snapshot is being used to restore a PVC");
    assert!(
        w.snapshot_finalizers("snap")
            .await
            .unwrap()
            .iter()
            .any(|f| f == SNAPSHOT_FINALIZER)
    );
    let _second = env.provisioner(&[]);
    let bound = env.wait_bound("restored").await;
    assert_eq!(
        bound.spec.unwrap().volume_name.as_deref(),
        Some(volume.as_str())
    );
    env.wait_record_empty().await;
    let creates = env.calls.create_requests();
    assert_eq!(creates.len(), 2);
    assert_eq!(creates[0], creates[1]);
    assert_eq!(snapshot_id(&creates[1]), Some(handle.as_str()));
    assert_eq!(read(env, &volume, "data.txt").as_deref(), Some("kept"));
    // Its restore done, the snapshot goes.
    poll("the snapshot gone", || async {
        w.snapshot_finalizers("snap").await.is_none().then_some(())
    })
    .await;
}

/// No leak (P3): a restore's claim deleted while the provisioner is down mid-CreateVolume; the
/// new provisioner repeats the recorded CreateVolume (content source included) to learn the
/// volume's id and deletes it; the sweeper then releases the snapshot.
#[tokio::test]
async fn a_restore_whose_claim_is_deleted_mid_create_leaks_nothing() {
    let w = world(hang_first_create).await;
    let env = &w.env;
    w.ready_snapshot("snap", "gone").await;
    let class = env.class("", json!({"reclaimPolicy": "Delete"})).await;
    let mut first = env.provisioner(&[]);
    let claim = env
        .claim("restored", &class, "1Mi", restore_from("snap"))
        .await;
    let volume = Env::volume_name_of(&claim.uid().unwrap());
    env.calls.wait_for(Method::CreateVolume, 1).await;
    first.kill();
    let claims = env.api::<PersistentVolumeClaim>();
    claims
        .delete("restored", &DeleteParams::default())
        .await
        .unwrap();
    poll("claim gone", || async {
        matches!(claims.get_opt("restored").await, Ok(None)).then_some(())
    })
    .await;
    let _second = env.provisioner(&["--snapshot-orphan-sweep-interval=1s"]);
    poll("DeleteVolume", || async {
        (!env.calls.delete_requests().is_empty()).then_some(())
    })
    .await;
    env.wait_record_empty().await;
    let creates = env.calls.create_requests();
    assert_eq!(creates.len(), 2);
    assert_eq!(creates[0], creates[1]);
    assert_eq!(env.calls.delete_requests()[0].volume_id, volume);
    assert!(read(env, &volume, "data.txt").is_none());
    assert!(env.volumes().get_opt(&volume).await.unwrap().is_none());
    poll("the orphaned restore protection swept", || async {
        (!w.snapshot_finalizers("snap")
            .await
            .unwrap()
            .iter()
            .any(|f| f == SNAPSHOT_FINALIZER))
        .then_some(())
    })
    .await;
}

/// A restore the driver answers with a smaller capacity than asked: upstream's background
/// error, the volume deleted again with DeleteVolume, CreateVolume retried; an unknown (0)
/// capacity: the PV gets the claim's request.
#[tokio::test]
async fn a_restore_reported_too_small_is_deleted_and_retried() {
    let w = world(|c| c.reported_capacity = Some(MI / 2)).await;
    let env = &w.env;
    w.ready_snapshot("snap", "x").await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms", "--retry-interval-max=1s"]);
    let claim = env
        .claim("small", &class, "1Mi", restore_from("snap"))
        .await;
    let volume = Env::volume_name_of(&claim.uid().unwrap());
    let msg = env.wait_event(&env.ns, "small", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": created volume capacity 524288 less than requested capacity 1048576"
        )
    );
    poll("DeleteVolume and a retry", || async {
        (env.calls
            .delete_requests()
            .iter()
            .any(|d| d.volume_id == volume)
            && env.calls.count(Method::CreateVolume) >= 2)
            .then_some(())
    })
    .await;
    assert!(env.volumes().get_opt(&volume).await.unwrap().is_none());
}

#[tokio::test]
async fn a_restore_of_unknown_capacity_gets_the_requested_size() {
    let w = world(|c| c.reported_capacity = Some(0)).await;
    let env = &w.env;
    w.ready_snapshot("snap", "x").await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim("sized", &class, "3Mi", restore_from("snap"))
        .await;
    let claim = env.wait_bound("sized").await;
    let pv = env
        .volumes()
        .get(claim.spec.unwrap().volume_name.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(pv.spec.unwrap().capacity.unwrap()["storage"].0, "3Mi");
}

/// A clone the driver answers without the content source: upstream's background error
/// "volume content source missing", the volume deleted again, CreateVolume retried, no PV.
#[tokio::test]
async fn a_clone_answered_without_its_content_source_is_deleted() {
    let w = world(|c| c.omit_content_source = true).await;
    let env = &w.env;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms", "--retry-interval-max=1s"]);
    env.claim("src", &class, "1Mi", json!({})).await;
    env.wait_bound("src").await;
    let claim = env.claim("copy", &class, "1Mi", clone_of("src")).await;
    let volume = Env::volume_name_of(&claim.uid().unwrap());
    let msg = env.wait_event(&env.ns, "copy", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": volume content source missing"
        )
    );
    poll("DeleteVolume and a retry", || async {
        (env.calls
            .delete_requests()
            .iter()
            .any(|d| d.volume_id == volume)
            && env
                .calls
                .create_requests()
                .iter()
                .filter(|r| r.name == volume)
                .count()
                >= 2)
            .then_some(())
    })
    .await;
    assert!(env.volumes().get_opt(&volume).await.unwrap().is_none());
}

/// The rules of `deploy/base/controller/rbac.yaml`'s provisioner ClusterRole (upstream's sample),
/// with or without `update` on volumesnapshots.
fn sample_rules(snapshot_update: bool) -> serde_json::Value {
    let snapshot_verbs = if snapshot_update {
        json!(["get", "list", "watch", "update"])
    } else {
        json!(["get", "list", "watch"])
    };
    json!([
        {"apiGroups": [""], "resources": ["persistentvolumes"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
        {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get", "list", "watch", "update"]},
        {"apiGroups": ["storage.k8s.io"], "resources": ["storageclasses"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["list", "watch", "create", "update", "patch"]},
        {"apiGroups": ["snapshot.storage.k8s.io"], "resources": ["volumesnapshots"], "verbs": snapshot_verbs},
        {"apiGroups": ["snapshot.storage.k8s.io"], "resources": ["volumesnapshotcontents"], "verbs": ["get", "list"]},
        {"apiGroups": ["storage.k8s.io"], "resources": ["csinodes"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["storage.k8s.io"], "resources": ["volumeattachments"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["storage.k8s.io"], "resources": ["volumeattributesclasses"], "verbs": ["get"]},
    ])
}

/// A kubeconfig for a ServiceAccount of the test's namespace bound to `rules` (and to the
/// sample's Lease rules in `default`, where the in-flight record lives).
async fn service_account(env: &Env, rules: serde_json::Value) -> PathBuf {
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
    let pp = PostParams::default();
    let account = "provisioner";
    let accounts: Api<ServiceAccount> = env.api();
    accounts
        .create(
            &pp,
            &serde_json::from_value(json!({"metadata": {"name": account}})).unwrap(),
        )
        .await
        .unwrap();
    let subject = json!([{"kind": "ServiceAccount", "name": account, "namespace": env.ns}]);
    let name = format!("{}-provisioner", env.name);
    Api::<ClusterRole>::all(env.client.clone())
        .create(
            &pp,
            &serde_json::from_value(json!({"metadata": {"name": name}, "rules": rules})).unwrap(),
        )
        .await
        .unwrap();
    Api::<ClusterRoleBinding>::all(env.client.clone())
        .create(
            &pp,
            &serde_json::from_value(json!({
                "metadata": {"name": name}, "subjects": subject,
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    Api::<Role>::namespaced(env.client.clone(), "default")
        .create(
            &pp,
            &serde_json::from_value(json!({
                "metadata": {"name": name},
                "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                           "verbs": ["get", "watch", "list", "delete", "update", "create"]}],
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    Api::<RoleBinding>::namespaced(env.client.clone(), "default")
        .create(
            &pp,
            &serde_json::from_value(json!({
                "metadata": {"name": name}, "subjects": subject,
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let path = env.dir.path().join("provisioner.kubeconfig");
    env.cluster
        .api
        .service_account_kubeconfig(&env.ns, account, &path)
        .await
        .unwrap();
    path
}

/// Under the sample RBAC a restore and a clone work, with both protections: the sample is
/// enough.
#[tokio::test]
async fn the_sample_rbac_is_enough_for_restore_and_clone() {
    let w = world(slow_first_create).await;
    let env = &w.env;
    w.ready_snapshot("snap", "x").await;
    let class = env.class("", json!({})).await;
    let kubeconfig = service_account(env, sample_rules(true)).await;
    let _p = env.provisioner_as(&kubeconfig, &["--retry-interval-start=100ms"]);
    env.claim("restored", &class, "1Mi", restore_from("snap"))
        .await;
    env.calls.wait_for(Method::CreateVolume, 1).await;
    assert!(
        w.snapshot_finalizers("snap")
            .await
            .unwrap()
            .iter()
            .any(|f| f == SNAPSHOT_FINALIZER)
    );
    env.wait_bound("restored").await;
    poll("the restore protection removed", || async {
        (!w.snapshot_finalizers("snap")
            .await
            .unwrap()
            .iter()
            .any(|f| f == SNAPSHOT_FINALIZER))
        .then_some(())
    })
    .await;
    env.claim("copy", &class, "1Mi", clone_of("restored")).await;
    env.wait_bound("copy").await;
    let src = env
        .api::<PersistentVolumeClaim>()
        .get("restored")
        .await
        .unwrap();
    assert!(src.finalizers().iter().any(|f| f == CLONE_FINALIZER));
}

/// Without `update` on volumesnapshots the restore protection is skipped (Forbidden is
/// tolerated, as upstream) and the restore still succeeds.
#[tokio::test]
async fn a_forbidden_snapshot_update_is_tolerated() {
    let w = world(slow_first_create).await;
    let env = &w.env;
    w.ready_snapshot("snap", "x").await;
    let class = env.class("", json!({})).await;
    let kubeconfig = service_account(env, sample_rules(false)).await;
    let p = env.provisioner_as(&kubeconfig, &["--retry-interval-start=100ms"]);
    env.claim("restored", &class, "1Mi", restore_from("snap"))
        .await;
    env.calls.wait_for(Method::CreateVolume, 1).await;
    p.wait_log_line("not allowed to add the volumesnapshot-as-source-protection finalizer")
        .await;
    assert!(
        !w.snapshot_finalizers("snap")
            .await
            .unwrap()
            .iter()
            .any(|f| f == SNAPSHOT_FINALIZER)
    );
    env.wait_bound("restored").await;
}

/// `--prevent-volume-mode-conversion=false`: a Block snapshot restores into a Filesystem claim
/// without the content's permission.
#[tokio::test]
async fn mode_conversion_is_allowed_when_not_prevented() {
    let w = world(|_| {}).await;
    let env = &w.env;
    let handle = w.seed_snapshot("s", MI, "x").await;
    w.snapshot(
        "block",
        &handle,
        json!({"sourceVolumeMode": "Block"}),
        json!({"snapshotHandle": handle, "readyToUse": true, "restoreSize": MI}),
    )
    .await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&[
        "--retry-interval-start=100ms",
        "--prevent-volume-mode-conversion=false",
    ]);
    let mut spec = restore_from("block");
    spec["spec"]["volumeMode"] = json!("Filesystem");
    env.claim("converted", &class, "1Mi", spec).await;
    env.wait_bound("converted").await;
}

/// A source claim `src` bound to a pre-provisioned volume of the driver holding `data.txt`
/// (made through the second instance, so the provisioner's driver has seen no call yet).
async fn seeded_source(w: &World, class: &str, text: &str) -> String {
    let env = &w.env;
    let mut c = client(&w.seed_socket).await;
    let id = c
        .create_volume(CreateVolumeRequest {
            name: format!("seed-src-{}", env.ns),
            capacity_range: Some(CapacityRange {
                required_bytes: MI,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![VolumeCapability {
                access_type: Some(volume_capability::AccessType::Mount(Default::default())),
                access_mode: Some(volume_capability::AccessMode {
                    mode: volume_capability::access_mode::Mode::SingleNodeWriter as i32,
                }),
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    write(env, &id, "data.txt", text);
    let pv = format!("{}-src", env.ns);
    env.volumes()
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": pv, "annotations": {"pv.kubernetes.io/provisioned-by": env.name}},
                "spec": {
                    "capacity": {"storage": "1Mi"}, "accessModes": ["ReadWriteOnce"],
                    "storageClassName": class,
                    "persistentVolumeReclaimPolicy": "Delete",
                    "csi": {"driver": env.name, "volumeHandle": id},
                    "claimRef": {"namespace": env.ns, "name": "src"},
                },
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    env.claim("src", class, "1Mi", json!({"spec": {"volumeName": pv}}))
        .await;
    env.wait_bound("src").await;
    id
}

/// No leak (P3) for a clone: SIGKILL mid-CreateVolume; the recorded request carries the source
/// volume, so the next provisioner repeats the same call and the clone is Bound with the
/// source's data, or, if the clone's claim was deleted meanwhile, deletes the volume.
async fn clone_interrupted(delete_claim: bool) {
    let w = world(hang_first_create).await;
    let env = &w.env;
    let class = env.class("", json!({"reclaimPolicy": "Delete"})).await;
    let src = seeded_source(&w, &class, "cloned").await;
    let mut first = env.provisioner(&[]);
    let claim = env.claim("copy", &class, "1Mi", clone_of("src")).await;
    let volume = Env::volume_name_of(&claim.uid().unwrap());
    env.calls.wait_for(Method::CreateVolume, 1).await;
    assert!(env.record().await.contains(&volume));
    first.kill();
    let claims = env.api::<PersistentVolumeClaim>();
    if delete_claim {
        // The source goes too: its protection must hold it until the recorded clone, whose
        // deletion repeats CreateVolume from it, is settled.
        claims
            .delete("copy", &DeleteParams::default())
            .await
            .unwrap();
        claims
            .delete("src", &DeleteParams::default())
            .await
            .unwrap();
        poll("claim gone", || async {
            matches!(claims.get_opt("copy").await, Ok(None)).then_some(())
        })
        .await;
    }
    let _second = env.provisioner(&[]);
    if delete_claim {
        poll("src gone", || async {
            matches!(claims.get_opt("src").await, Ok(None)).then_some(())
        })
        .await;
        poll("DeleteVolume of the source", || async {
            (env.calls.delete_requests().len() == 2).then_some(())
        })
        .await;
        let deleted: Vec<String> = env
            .calls
            .delete_requests()
            .into_iter()
            .map(|d| d.volume_id)
            .collect();
        assert_eq!(deleted, [volume.clone(), src.clone()]);
        assert!(read(env, &volume, "data.txt").is_none());
        env.wait_record_empty().await;
        let creates = env.calls.create_requests();
        assert_eq!(creates.len(), 2);
        assert_eq!(creates[0], creates[1]);
        return;
    }
    env.wait_bound("copy").await;
    assert_eq!(read(env, &volume, "data.txt").as_deref(), Some("cloned"));
    env.wait_record_empty().await;
    let creates = env.calls.create_requests();
    assert_eq!(creates.len(), 2);
    assert_eq!(creates[0], creates[1]);
    assert_eq!(source_volume_id(&creates[1]), Some(src.as_str()));
    assert!(
        claims
            .get("src")
            .await
            .unwrap()
            .finalizers()
            .iter()
            .any(|f| f == CLONE_FINALIZER)
    );
}

#[tokio::test]
async fn a_clone_interrupted_by_a_restart_finishes() {
    clone_interrupted(false).await;
}

#[tokio::test]
async fn a_clone_whose_claim_is_deleted_mid_create_leaks_nothing() {
    clone_interrupted(true).await;
}

/// A restore whose claim is deleted while its CreateVolume is cut short, and whose snapshot is
/// deleted from the storage meanwhile (a content of policy Delete goes with its snapshot): the
/// repeated CreateVolume answers NOT_FOUND, no volume of its name exists, and the record lets
/// it go instead of retrying forever.
#[tokio::test]
async fn a_restore_whose_claim_and_snapshot_are_gone_settles() {
    let w = world(hang_first_create).await;
    let env = &w.env;
    let handle = w.ready_snapshot("snap", "gone").await;
    let class = env.class("", json!({})).await;
    let mut first = env.provisioner(&[]);
    let claim = env
        .claim("restored", &class, "1Mi", restore_from("snap"))
        .await;
    let volume = Env::volume_name_of(&claim.uid().unwrap());
    env.calls.wait_for(Method::CreateVolume, 1).await;
    assert!(env.record().await.contains(&volume));
    first.kill();
    let claims = env.api::<PersistentVolumeClaim>();
    claims
        .delete("restored", &DeleteParams::default())
        .await
        .unwrap();
    client(&w.seed_socket)
        .await
        .delete_snapshot(plugreg_proto::csi::v1::DeleteSnapshotRequest {
            snapshot_id: handle,
            ..Default::default()
        })
        .await
        .unwrap();
    poll("claim gone", || async {
        matches!(claims.get_opt("restored").await, Ok(None)).then_some(())
    })
    .await;
    let _second = env.provisioner(&[]);
    env.wait_record_empty().await;
    let msg = env
        .wait_event(&env.ns, "restored", "ProvisioningCancelled")
        .await;
    assert_eq!(
        msg,
        format!("Volume {volume} that was being provisioned was never created: its source is gone")
    );
    assert_eq!(env.calls.count(Method::CreateVolume), 2);
    assert!(env.calls.delete_requests().is_empty());
    assert!(read(env, &volume, "data.txt").is_none());
}

/// A clone on Kubernetes 1.20 (no snapshot API there, no `dataSourceRef`): the same request,
/// data and protection as on 1.36.
#[tokio::test]
async fn a_clone_works_on_v1_20_2() {
    let env = Env::new(KubeVersion::V1_20_2, |c| {
        c.clone_volume = true;
        c.persistent = true;
    })
    .await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim("src", &class, "1Mi", json!({})).await;
    let src = env.wait_bound("src").await;
    let src_volume = src.spec.unwrap().volume_name.unwrap();
    write(&env, &src_volume, "data.txt", "old but cloned");
    env.claim("copy", &class, "1Mi", clone_of("src")).await;
    let copy = env.wait_bound("copy").await;
    let copy_volume = copy.spec.unwrap().volume_name.unwrap();
    let create = env
        .calls
        .create_requests()
        .into_iter()
        .find(|r| r.name == copy_volume)
        .unwrap();
    assert_eq!(source_volume_id(&create), Some(src_volume.as_str()));
    assert_eq!(
        read(&env, &copy_volume, "data.txt").as_deref(),
        Some("old but cloned")
    );
    let claims = env.api::<PersistentVolumeClaim>();
    assert!(
        claims
            .get("src")
            .await
            .unwrap()
            .finalizers()
            .iter()
            .any(|f| f == CLONE_FINALIZER)
    );
}
