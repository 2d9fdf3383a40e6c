//! `csi-snapshotter` with the real Go snapshot-controller v8.6.0 on a real kube-apiserver
//! v1.36.2 and the test CSI driver: dynamic snapshots become ready (CreateSnapshot re-sent
//! until the driver says ready), errors go into the status and events as upstream writes them,
//! pre-provisioned contents get their status from ListSnapshots, deletion follows the
//! deletion policy, and a create cut short by SIGKILL is sent again after a restart while the
//! deletion that came meanwhile waits for it.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{Env, NS};
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, DeleteParams, ListParams};
use plugreg_csi_test_driver::{Code, Failure, Fault, Method};
use plugreg_sidecar_kit::snapshot::{
    ANN_BEING_CREATED, ANN_BEING_DELETED, VolumeSnapshot, VolumeSnapshotContent,
};
use serde_json::json;

const SECRET_NAME_KEY: &str = "csi.storage.k8s.io/snapshotter-secret-name";
const SECRET_NAMESPACE_KEY: &str = "csi.storage.k8s.io/snapshotter-secret-namespace";

fn annotated(c: &VolumeSnapshotContent, key: &str) -> bool {
    c.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(key))
}

fn ready(c: &VolumeSnapshotContent) -> bool {
    c.status.as_ref().and_then(|s| s.ready_to_use) == Some(true)
}

fn error_message(c: &VolumeSnapshotContent) -> Option<String> {
    c.status.as_ref()?.error.as_ref()?.message.clone()
}

/// The events about a content (namespace `default`, as client-go records events about
/// cluster-scoped objects) with `reason`: (message, count).
async fn content_events(env: &Env, content: &str, reason: &str) -> Vec<(String, i32)> {
    let api: Api<Event> = Api::namespaced(env.client.clone(), "default");
    api.list(&ListParams::default().fields(&format!("involvedObject.name={content}")))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .map(|e| (e.message.unwrap_or_default(), e.count.unwrap_or(1)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_becomes_ready_through_the_real_controller_and_goes_by_its_policy() {
    let env = Env::new(|d| d.snapshot_ready_after = 2).await;
    env.secret("snap-secret", &[("user", "u1")]).await;
    env.class(
        "cls",
        "Delete",
        json!({"a": "1", SECRET_NAME_KEY: "snap-secret", SECRET_NAMESPACE_KEY: NS}),
    )
    .await;
    env.bound_claim("data", "vol-a").await;
    let sidecar = env.snapshotter(&["--extra-create-metadata"]);
    let uid = env.snapshot("snap1", "data", "cls").await;
    let content_name = format!("snapcontent-{uid}");

    let vs = env
        .wait_snapshot("snap1", "snap1 readyToUse", |s| {
            s.status.as_ref().and_then(|s| s.ready_to_use) == Some(true)
        })
        .await;
    let vs_status = vs.status.unwrap();
    assert_eq!(
        vs_status.bound_volume_snapshot_content_name.as_deref(),
        Some(content_name.as_str())
    );
    assert_eq!(vs_status.restore_size.unwrap().0, "1Gi");
    assert!(vs_status.creation_time.is_some());
    assert!(vs_status.error.is_none());

    let content = env.contents().get(&content_name).await.unwrap();
    let status = content.status.clone().unwrap();
    let handle = status.snapshot_handle.clone().unwrap();
    assert_eq!(status.ready_to_use, Some(true));
    assert_eq!(status.restore_size, Some(1 << 30));
    // Unix nanoseconds, not seconds.
    assert!(status.creation_time.unwrap() > 1_000_000_000_000_000_000);
    assert!(!annotated(&content, ANN_BEING_CREATED), "{content:?}");

    // Not ready twice: CreateSnapshot was sent three times, identically; never ListSnapshots.
    let creates = env.calls.create_snapshot_requests();
    assert!(creates.len() >= 3, "{creates:?}");
    let first = &creates[0];
    for c in &creates {
        assert_eq!(c, first);
    }
    assert_eq!(first.name, format!("snapshot-{uid}"));
    assert_eq!(first.source_volume_id, "vol-a");
    let want: HashMap<String, String> = [
        ("a", "1"),
        ("csi.storage.k8s.io/volumesnapshot/name", "snap1"),
        ("csi.storage.k8s.io/volumesnapshot/namespace", NS),
        (
            "csi.storage.k8s.io/volumesnapshotcontent/name",
            content_name.as_str(),
        ),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    assert_eq!(first.parameters, want);
    assert_eq!(first.secrets.get("user").map(String::as_str), Some("u1"));
    assert_eq!(env.calls.count(Method::ListSnapshots), 0);

    // The real controller's events on the VolumeSnapshot.
    for reason in ["CreatingSnapshot", "SnapshotCreated", "SnapshotReady"] {
        env.wait_event(NS, "snap1", reason, "snap1").await;
    }

    // Policy Delete: the VolumeSnapshot's deletion ends in DeleteSnapshot with the secrets.
    env.snapshots()
        .delete("snap1", &DeleteParams::default())
        .await
        .unwrap();
    env.wait_content_gone(&content_name).await;
    env.poll("snap1 gone", || async {
        matches!(env.snapshots().get_opt("snap1").await, Ok(None)).then_some(())
    })
    .await;
    let deletes = env.calls.delete_snapshot_requests();
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert_eq!(deletes[0].snapshot_id, handle);
    assert_eq!(
        deletes[0].secrets.get("user").map(String::as_str),
        Some("u1")
    );
    drop(sidecar);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_written_as_upstream_writes_them_once_and_cleared_when_ready() {
    let env = Env::new(|d| {
        d.faults.insert(
            Method::CreateSnapshot,
            Fault {
                error: Some(Failure::new(Code::Internal, "boom \"quoted\"")),
                fail_first: Some(2),
                ..Fault::default()
            },
        );
    })
    .await;
    env.class("cls", "Delete", json!({})).await;
    env.class("bad", "Delete", json!({"csi.storage.k8s.io/bogus": "x"}))
        .await;
    env.bound_claim("data", "vol-a").await;
    let sidecar = env.snapshotter(&["--retry-interval-start=200ms"]);

    // Two CSI errors, then success: the first is the creation's, the second the check's.
    let uid = env.snapshot("snap1", "data", "cls").await;
    let name = format!("snapcontent-{uid}");
    let content = env
        .wait_content(&name, "snap1's content ready", ready)
        .await;
    assert_eq!(error_message(&content), None);
    let inner = "failed to take snapshot of the volume vol-a: \"rpc error: code = Internal desc = boom \\\"quoted\\\"\"";
    // Events are written in the background: wait for the second failure's.
    env.wait_event(
        "default",
        &name,
        "SnapshotContentCheckandUpdateFailed",
        "Failed to check and update snapshot content",
    )
    .await;
    let created = content_events(&env, &name, "SnapshotCreationFailed").await;
    assert_eq!(
        created,
        vec![(format!("Failed to create snapshot: {inner}"), 1)]
    );
    let checked = content_events(&env, &name, "SnapshotContentCheckandUpdateFailed").await;
    assert_eq!(
        checked,
        vec![(
            format!("Failed to check and update snapshot content: {inner}"),
            1
        )]
    );

    // An unknown reserved parameter: the exact error, mirrored on the VolumeSnapshot; the
    // being-created annotation stays (upstream's order); the same message again is neither
    // written nor recorded again.
    let uid = env.snapshot("snap-bad", "data", "bad").await;
    let name = format!("snapcontent-{uid}");
    let param_err = "failed to remove CSI Parameters of prefixed keys: found unknown parameter key \"csi.storage.k8s.io/bogus\" with reserved namespace csi.storage.k8s.io/";
    let want = format!("Failed to check and update snapshot content: {param_err}");
    let content = env
        .wait_content(&name, "the check error on snap-bad's content", |c| {
            error_message(c).as_deref() == Some(want.as_str())
        })
        .await;
    assert!(annotated(&content, ANN_BEING_CREATED));
    assert_eq!(content.status.as_ref().unwrap().ready_to_use, Some(false));
    env.wait_snapshot("snap-bad", "the error on snap-bad", |s| {
        s.status
            .as_ref()
            .and_then(|s| s.error.as_ref())
            .and_then(|e| e.message.as_deref())
            == Some(want.as_str())
    })
    .await;
    // Let at least two more syncs fail the same way (1.6 s of back-off at most).
    let log_has = |n: usize| {
        sidecar
            .log()
            .lines()
            .filter(|l| l.contains("could not sync content") && l.contains(&name))
            .count()
            >= n
    };
    env.poll("four failed syncs of snap-bad's content", || async {
        log_has(4).then_some(())
    })
    .await;
    assert_eq!(
        content_events(&env, &name, "SnapshotCreationFailed").await,
        vec![(format!("Failed to create snapshot: {param_err}"), 1)]
    );
    assert_eq!(
        content_events(&env, &name, "SnapshotContentCheckandUpdateFailed").await,
        vec![(want.clone(), 1)]
    );
    // Nothing reached the driver for it.
    assert!(
        env.calls
            .create_snapshot_requests()
            .iter()
            .all(|r| r.name != format!("snapshot-{uid}"))
    );
    drop(sidecar);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_and_pre_provisioned_contents() {
    let env = Env::new(|_| {}).await;
    env.class("keep", "Retain", json!({})).await;
    env.bound_claim("data", "vol-b").await;
    let sidecar = env.snapshotter(&[]);

    // Policy Retain: the VolumeSnapshot goes, its content and the snapshot stay.
    let uid = env.snapshot("kept", "data", "keep").await;
    let kept = format!("snapcontent-{uid}");
    let content = env.wait_content(&kept, "kept ready", ready).await;
    let handle = content.status.unwrap().snapshot_handle.unwrap();
    env.snapshots()
        .delete("kept", &DeleteParams::default())
        .await
        .unwrap();
    env.poll("kept gone", || async {
        matches!(env.snapshots().get_opt("kept").await, Ok(None)).then_some(())
    })
    .await;
    let content = env
        .wait_content(
            &kept,
            "the being-deleted annotation on the retained content",
            |c| annotated(c, ANN_BEING_DELETED),
        )
        .await;
    assert!(content.metadata.deletion_timestamp.is_none());

    // A pre-provisioned content of that snapshot: its status comes from ListSnapshots before
    // any VolumeSnapshot exists.
    env.create::<VolumeSnapshotContent>(json!({
        "metadata": {"name": "static-content"},
        "spec": {"driver": env.name, "deletionPolicy": "Delete",
                 "source": {"snapshotHandle": handle},
                 "volumeSnapshotRef": {"name": "restored", "namespace": NS}},
    }))
    .await;
    let c = env
        .wait_content("static-content", "static-content ready", ready)
        .await;
    let s = c.status.unwrap();
    assert_eq!(s.snapshot_handle.as_deref(), Some(handle.as_str()));
    assert_eq!(s.restore_size, Some(1 << 30));
    let lists = env.calls.count(Method::ListSnapshots);
    assert!(lists >= 1);

    // One whose snapshot the driver does not know: upstream's text.
    env.create::<VolumeSnapshotContent>(json!({
        "metadata": {"name": "unknown-content"},
        "spec": {"driver": env.name, "deletionPolicy": "Retain",
                 "source": {"snapshotHandle": "nope"},
                 "volumeSnapshotRef": {"name": "other", "namespace": NS}},
    }))
    .await;
    let want = "Failed to check and update snapshot content: failed to list snapshot for content unknown-content: \"can not find snapshot for snapshotID nope\"";
    env.wait_content("unknown-content", "the list error", |c| {
        error_message(c).as_deref() == Some(want)
    })
    .await;

    // The static VolumeSnapshot binds to it and is ready.
    env.create::<VolumeSnapshot>(json!({
        "metadata": {"name": "restored", "namespace": NS},
        "spec": {"source": {"volumeSnapshotContentName": "static-content"}},
    }))
    .await;
    env.wait_snapshot("restored", "restored ready", |s| {
        s.status.as_ref().and_then(|s| s.ready_to_use) == Some(true)
    })
    .await;

    // The retained content deleted by hand: no CSI call, the finalizer goes.
    env.contents()
        .delete(&kept, &DeleteParams::default())
        .await
        .unwrap();
    env.wait_content_gone(&kept).await;
    assert_eq!(env.calls.count(Method::DeleteSnapshot), 0);
    // An unbound pre-provisioned content goes without a CSI call either.
    env.contents()
        .delete("unknown-content", &DeleteParams::default())
        .await
        .unwrap();
    env.wait_content_gone("unknown-content").await;
    assert_eq!(env.calls.count(Method::DeleteSnapshot), 0);
    drop(sidecar);
}

/// Checklist 10: a pre-provisioned content of a driver without LIST_SNAPSHOTS is taken as it
/// is, as upstream: ready, `creationTime` the time the sidecar saw it, no `restoreSize`, and no
/// ListSnapshots call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_provisioned_content_of_a_driver_that_cannot_list_is_ready() {
    let env = Env::new(|c| c.no_list_snapshots = true).await;
    let _sidecar = env.snapshotter(&[]);
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i64
    };
    let before = now();
    env.create::<VolumeSnapshotContent>(json!({
        "metadata": {"name": "unlisted-content"},
        "spec": {"driver": env.name, "deletionPolicy": "Retain",
                 "source": {"snapshotHandle": "snap-made-elsewhere"},
                 "volumeSnapshotRef": {"name": "unlisted", "namespace": NS}},
    }))
    .await;
    let c = env
        .wait_content("unlisted-content", "unlisted-content ready", ready)
        .await;
    let after = now();
    let s = c.status.unwrap();
    assert_eq!(s.snapshot_handle.as_deref(), Some("snap-made-elsewhere"));
    assert_eq!(s.restore_size, None);
    let t = s.creation_time.unwrap();
    assert!(before <= t && t <= after, "{before} <= {t} <= {after}");
    assert_eq!(env.calls.count(Method::ListSnapshots), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_cut_short_by_sigkill_is_sent_again_and_the_deletion_waits_for_it() {
    let env = Env::new(|d| {
        d.faults.insert(
            Method::CreateSnapshot,
            Fault {
                delay: Some(Duration::from_secs(600)),
                delay_first: Some(1),
                ..Fault::default()
            },
        );
    })
    .await;
    env.class("cls", "Delete", json!({})).await;
    env.bound_claim("data", "vol-c").await;
    let mut sidecar = env.snapshotter(&["--timeout=10m"]);
    let uid = env.snapshot("snap1", "data", "cls").await;
    let name = format!("snapcontent-{uid}");
    env.calls.wait_for(Method::CreateSnapshot, 1).await;
    let content = env.contents().get(&name).await.unwrap();
    assert!(annotated(&content, ANN_BEING_CREATED), "{content:?}");
    sidecar.kill();

    // The VolumeSnapshot is deleted while the create may still be going on in the driver.
    env.snapshots()
        .delete("snap1", &DeleteParams::default())
        .await
        .unwrap();
    env.wait_content(&name, "the content being deleted", |c| {
        c.metadata.deletion_timestamp.is_some() && annotated(c, ANN_BEING_DELETED)
    })
    .await;

    // After the restart: the same CreateSnapshot again, then DeleteSnapshot of its result.
    let sidecar = env.snapshotter(&[]);
    env.wait_content_gone(&name).await;
    env.poll("snap1 gone", || async {
        matches!(env.snapshots().get_opt("snap1").await, Ok(None)).then_some(())
    })
    .await;
    let creates = env.calls.create_snapshot_requests();
    assert!(creates.len() >= 2, "{creates:?}");
    assert!(creates.iter().all(|c| c.name == format!("snapshot-{uid}")));
    let deletes = env.calls.delete_snapshot_requests();
    assert_eq!(deletes.len(), 1, "{deletes:?}");

    // Nothing leaked in the driver.
    let conn = plugreg_csi_core::client::Connection::connect(
        &env.socket.display().to_string(),
        Duration::from_secs(10),
        Duration::from_secs(10),
        plugreg_csi_core::client::Retry::ONCE,
    )
    .await
    .unwrap();
    let mut ctl = conn.controller();
    let left = ctl
        .list_snapshots(plugreg_proto::csi::v1::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(left.entries.is_empty(), "{left:?}");
    drop(sidecar);
}

/// A VolumeSnapshot deleted while the driver is still cutting it (the sidecar running all
/// along): once CreateSnapshot answers and the being-created annotation goes, the snapshot is
/// deleted and the content with it, at once (not at the next resync, 15 min away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_deleted_while_it_is_cut_is_deleted_once_the_cut_ends() {
    let env = Env::new(|d| {
        d.faults.insert(
            Method::CreateSnapshot,
            Fault {
                delay: Some(Duration::from_secs(3)),
                delay_first: Some(1),
                ..Fault::default()
            },
        );
    })
    .await;
    env.class("cls", "Delete", json!({})).await;
    env.bound_claim("data", "vol-d").await;
    let sidecar = env.snapshotter(&[]);
    let uid = env.snapshot("snap1", "data", "cls").await;
    let name = format!("snapcontent-{uid}");
    env.calls.wait_for(Method::CreateSnapshot, 1).await;
    env.delete_snapshot_once("snap1", &name).await;
    drop(sidecar);
}

/// The being-created annotation stays after an error that may mean the snapshot is still being
/// cut (UNAVAILABLE here; also CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED) and
/// goes after a final one (INVALID_ARGUMENT here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_annotation_stays_after_an_error_in_progress_and_goes_after_a_final_one() {
    let failing = |code: Code| {
        move |d: &mut plugreg_csi_test_driver::DriverConfig| {
            d.faults.insert(
                Method::CreateSnapshot,
                Fault {
                    error: Some(Failure::new(code, "no")),
                    ..Fault::default()
                },
            );
        }
    };
    let mut env = Env::new(failing(Code::Unavailable)).await;
    env.class("cls", "Delete", json!({})).await;
    env.bound_claim("data", "vol-d").await;
    let mut sidecar = env.snapshotter(&["--retry-interval-start=30s"]);
    let uid = env.snapshot("busy", "data", "cls").await;
    let name = format!("snapcontent-{uid}");
    let content = env
        .wait_content(&name, "the UNAVAILABLE error", |c| {
            error_message(c).is_some_and(|m| m.contains("code = Unavailable"))
        })
        .await;
    assert!(annotated(&content, ANN_BEING_CREATED), "{content:?}");
    sidecar.kill();

    // The same driver, now refusing for good.
    env.driver.take().unwrap().stop().await.unwrap();
    let mut cfg = plugreg_csi_test_driver::DriverConfig {
        name: env.name.clone(),
        controller: true,
        snapshots: true,
        volumes: common::VOLUMES.iter().map(|v| (*v).to_owned()).collect(),
        data_dir: Some(env.dir.path().join("volumes")),
        mount: plugreg_csi_test_driver::MountMode::Directory,
        ..Default::default()
    };
    failing(Code::InvalidArgument)(&mut cfg);
    env.driver = Some(
        plugreg_csi_test_driver::start(cfg, &env.socket)
            .await
            .unwrap(),
    );
    let sidecar = env.snapshotter(&["--retry-interval-start=30s"]);
    let uid = env.snapshot("refused", "data", "cls").await;
    let name = format!("snapcontent-{uid}");
    let want = "Failed to create snapshot: failed to take snapshot of the volume vol-d: \"rpc error: code = InvalidArgument desc = no\"";
    let content = env
        .wait_content(&name, "the INVALID_ARGUMENT error", |c| {
            error_message(c).as_deref() == Some(want)
        })
        .await;
    assert!(!annotated(&content, ANN_BEING_CREATED), "{content:?}");
    drop(sidecar);
}

/// Only the driver's contents are touched (not another driver's, nor one whose class is another
/// driver's), and with `--node-deployment` only those labelled with its node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_its_own_contents_and_with_node_deployment_only_its_nodes() {
    let env = Env::new(|_| {}).await;
    let foreign_class = json!({
        "metadata": {"name": "foreign"},
        "driver": "other.csi.plugreg.test", "deletionPolicy": "Retain",
    });
    env.create::<plugreg_sidecar_kit::snapshot::VolumeSnapshotClass>(foreign_class)
        .await;
    let content = |name: &str, driver: &str, class: Option<&str>, node: Option<&str>| {
        let mut c = json!({
            "metadata": {"name": name},
            "spec": {"driver": driver, "deletionPolicy": "Retain",
                     "source": {"snapshotHandle": "h-1"},
                     "volumeSnapshotRef": {"name": name, "namespace": NS}},
        });
        if let Some(class) = class {
            c["spec"]["volumeSnapshotClassName"] = json!(class);
        }
        if let Some(node) = node {
            c["metadata"]["labels"] = json!({"snapshot.storage.kubernetes.io/managed-by": node});
        }
        c
    };
    let ours = env.name.clone();
    for c in [
        content("other-driver", "other.csi.plugreg.test", None, None),
        content("foreign-class", &ours, Some("foreign"), None),
        content("elsewhere", &ours, None, Some("node-2")),
        content("here", &ours, None, Some("node-1")),
    ] {
        env.create::<VolumeSnapshotContent>(c).await;
    }
    // With --node-deployment on node-1: only "here" (the unknown handle gives the list error).
    let sidecar = common::start_snapshotter_env(&env, &["--node-deployment"], Some("node-1"));
    let listed = |c: &VolumeSnapshotContent| c.status.is_some();
    env.wait_content("here", "here's status", listed).await;
    // A later event that must come after the first sync of every content: "here"'s second
    // status write would not happen (same error), so wait for its second ListSnapshots.
    env.calls.wait_for(Method::ListSnapshots, 2).await;
    for name in ["other-driver", "foreign-class", "elsewhere"] {
        let c = env.contents().get(name).await.unwrap();
        assert!(c.status.is_none(), "{name} was touched: {c:?}");
    }
    drop(sidecar);
    // Without it, "elsewhere" is its too; the other driver's and the foreign class's never.
    let sidecar = env.snapshotter(&[]);
    env.wait_content("elsewhere", "elsewhere's status", listed)
        .await;
    let lists = env.calls.count(Method::ListSnapshots);
    env.calls.wait_for(Method::ListSnapshots, lists + 2).await;
    for name in ["other-driver", "foreign-class"] {
        let c = env.contents().get(name).await.unwrap();
        assert!(c.status.is_none(), "{name} was touched: {c:?}");
    }
    drop(sidecar);
}

/// Distributed snapshotting (issue 31, checklist 26): the real snapshot-controller with
/// `--enable-distributed-snapshotting` labels a dynamic content with the node its PV's affinity
/// matches, and only that node's `--node-deployment` sidecar cuts the snapshot; a content of a
/// PV without affinity gets no label and no node sidecar touches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distributed_snapshots_are_cut_by_the_node_of_their_volume() {
    let env = Env::with_controller(&["--enable-distributed-snapshotting"], |_| {}).await;
    let key = "topology.plugreg.test/node";
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(env.client.clone());
    for n in ["node-1", "node-2"] {
        nodes
            .create(
                &kube::api::PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": n, "labels": {key: n}}}))
                    .unwrap(),
            )
            .await
            .unwrap();
    }
    env.class("cls", "Delete", json!({})).await;
    env.bound_claim("local", "vol-a").await;
    env.bound_claim("shared", "vol-b").await;
    // The local volume lives on node-2.
    let pvs: Api<k8s_openapi::api::core::v1::PersistentVolume> = Api::all(env.client.clone());
    pvs.patch(
        "pv-local",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(
            json!({"spec": {"nodeAffinity": {"required": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": key, "operator": "In", "values": ["node-2"]}]}
            ]}}}}),
        ),
    )
    .await
    .unwrap();
    let one = common::start_snapshotter_env(&env, &["--node-deployment"], Some("node-1"));
    let two = common::start_snapshotter_env(&env, &["--node-deployment"], Some("node-2"));
    let uid = env.snapshot("snap-local", "local", "cls").await;
    let vs = env
        .wait_snapshot("snap-local", "snap-local readyToUse", |s| {
            s.status.as_ref().and_then(|s| s.ready_to_use) == Some(true)
        })
        .await;
    let content = env
        .contents()
        .get(&format!("snapcontent-{uid}"))
        .await
        .unwrap();
    assert_eq!(
        content
            .metadata
            .labels
            .unwrap_or_default()
            .get("snapshot.storage.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("node-2")
    );
    assert!(
        vs.status
            .unwrap()
            .bound_volume_snapshot_content_name
            .is_some()
    );
    assert!(two.log().contains("CreateSnapshot"), "node-2 cut it");
    assert!(!one.log().contains("CreateSnapshot"), "node-1 did not");
    // No affinity: no label, and no node sidecar makes it ready.
    let uid = env.snapshot("snap-shared", "shared", "cls").await;
    let content = env
        .wait_content(&format!("snapcontent-{uid}"), "the shared content", |_| {
            true
        })
        .await;
    assert!(
        !content
            .metadata
            .labels
            .unwrap_or_default()
            .contains_key("snapshot.storage.kubernetes.io/managed-by")
    );
    let creates = env.calls.count(Method::CreateSnapshot);
    assert_eq!(creates, 1, "only the local snapshot was cut");
    drop((one, two));
}

/// A failed DeleteSnapshot is a `SnapshotDeleteError` event and a retry; the finalizer stays
/// until the driver has deleted the snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_delete_is_an_event_and_retried_with_the_finalizer_kept() {
    let env = Env::new(|d| {
        d.faults.insert(
            Method::DeleteSnapshot,
            Fault {
                error: Some(Failure::new(Code::Internal, "busy")),
                fail_first: Some(2),
                ..Fault::default()
            },
        );
    })
    .await;
    env.class("cls", "Delete", json!({})).await;
    env.bound_claim("data", "vol-a").await;
    let sidecar = env.snapshotter(&["--retry-interval-start=500ms"]);
    let uid = env.snapshot("snap1", "data", "cls").await;
    let name = format!("snapcontent-{uid}");
    env.wait_content(&name, "ready", ready).await;
    env.snapshots()
        .delete("snap1", &DeleteParams::default())
        .await
        .unwrap();
    env.calls.wait_for(Method::DeleteSnapshot, 1).await;
    env.wait_content_gone(&name).await;
    assert_eq!(env.calls.count(Method::DeleteSnapshot), 3);
    // The same event twice is one Event with count 2 (client-go's aggregation); events are
    // written in the background, so wait for the second.
    let events = env
        .poll("the second SnapshotDeleteError", || async {
            let events = content_events(&env, &name, "SnapshotDeleteError").await;
            events.iter().any(|e| e.1 >= 2).then_some(events)
        })
        .await;
    assert_eq!(
        events,
        vec![("Failed to delete snapshot".to_owned(), 2)],
        "{events:?}"
    );
    drop(sidecar);
}

/// The sidecar's own writes (annotation, error status) do not wake it; a label put on the
/// content by someone else does, and the failed create is sent again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn its_own_writes_do_not_wake_it_and_a_label_change_does() {
    let env = Env::new(|d| {
        d.faults.insert(
            Method::CreateSnapshot,
            Fault {
                error: Some(Failure::new(Code::Unavailable, "later")),
                ..Fault::default()
            },
        );
    })
    .await;
    env.class("cls", "Delete", json!({})).await;
    env.bound_claim("data", "vol-b").await;
    // A back-off far longer than the test: only a change can bring the content back.
    let sidecar = env.snapshotter(&["--retry-interval-start=1h", "--retry-interval-max=1h"]);
    let uid = env.snapshot("snap1", "data", "cls").await;
    let name = format!("snapcontent-{uid}");
    env.wait_content(&name, "the first error", |c| error_message(c).is_some())
        .await;
    assert_eq!(env.calls.count(Method::CreateSnapshot), 1);
    env.contents()
        .patch(
            &name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
        )
        .await
        .unwrap();
    env.calls.wait_for(Method::CreateSnapshot, 2).await;
    // The annotation and the error status written by the first attempt did not count.
    assert_eq!(env.calls.count(Method::CreateSnapshot), 2);
    drop(sidecar);
}
