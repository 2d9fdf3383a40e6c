//! The snapshot peers (external-snapshotter v8.6.0's CRDs and Go snapshot-controller) on a real
//! kube-apiserver v1.36.2: the CRDs install (twice: the second time changes nothing), the
//! controller starts, and it binds a pre-provisioned VolumeSnapshot to its
//! VolumeSnapshotContent (the content's `volumeSnapshotRef.uid`, the snapshot's
//! `status.boundVolumeSnapshotContentName`, the content's bound-protection finalizer). On a
//! v1.20.2 API server the CRDs are refused with a clear error.

use std::time::{Duration, Instant};

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use plugreg_testpeers::{ApiServer, KubeVersion, SnapshotController, install_snapshot_crds};
use serde_json::json;

const CONTENT_FINALIZER: &str =
    "snapshot.storage.kubernetes.io/volumesnapshotcontent-bound-protection";

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("snapshot.storage.k8s.io", "v1", kind),
        plural,
    )
}

#[tokio::test]
async fn the_snapshot_controller_binds_a_pre_provisioned_snapshot() {
    let api = ApiServer::start_version(KubeVersion::V1_36_2)
        .await
        .expect("kube-apiserver v1.36.2");
    let controller = SnapshotController::start(&api)
        .await
        .expect("snapshot-controller");
    install_snapshot_crds(&api).await.expect("installed again");
    let client = api.client().await.unwrap();

    let contents_res = resource("VolumeSnapshotContent", "volumesnapshotcontents");
    let snapshots_res = resource("VolumeSnapshot", "volumesnapshots");
    let contents: Api<DynamicObject> = Api::all_with(client.clone(), &contents_res);
    let snapshots: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), "default", &snapshots_res);
    let content: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "snapshot.storage.k8s.io/v1",
        "kind": "VolumeSnapshotContent",
        "metadata": {"name": "static-content"},
        "spec": {
            "deletionPolicy": "Retain",
            "driver": "hostpath.csi.example.com",
            "source": {"snapshotHandle": "snap-handle-1"},
            "volumeSnapshotRef": {"name": "static", "namespace": "default"},
        },
    }))
    .unwrap();
    contents
        .create(&PostParams::default(), &content)
        .await
        .unwrap();
    let snapshot: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "snapshot.storage.k8s.io/v1",
        "kind": "VolumeSnapshot",
        "metadata": {"name": "static", "namespace": "default"},
        "spec": {"source": {"volumeSnapshotContentName": "static-content"}},
    }))
    .unwrap();
    let created = snapshots
        .create(&PostParams::default(), &snapshot)
        .await
        .unwrap();
    let uid = created.metadata.uid.clone().unwrap();

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let c = contents.get("static-content").await.unwrap();
        let s = snapshots.get("static").await.unwrap();
        let bound_uid = c.data["spec"]["volumeSnapshotRef"]["uid"]
            .as_str()
            .map(str::to_owned);
        let bound_name = s.data["status"]["boundVolumeSnapshotContentName"]
            .as_str()
            .map(str::to_owned);
        let finalized = c
            .metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == CONTENT_FINALIZER);
        if bound_uid.as_deref() == Some(uid.as_str())
            && bound_name.as_deref() == Some("static-content")
            && finalized
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not bound within 60 s: content {:?}, snapshot {:?}\n--- snapshot-controller ---\n{}",
            c.data,
            s.data,
            controller.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn the_snapshot_crds_need_a_modern_api_server() {
    let api = ApiServer::start_version(KubeVersion::V1_20_2)
        .await
        .expect("kube-apiserver v1.20.2");
    let e = install_snapshot_crds(&api).await.unwrap_err();
    assert!(e.to_string().contains("Kubernetes 1.25 or later"), "{e}");
}
