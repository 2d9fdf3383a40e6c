//! The flow with `csi-sidecars` (deploy/sidecars' controller Deployment: the driver, one
//! container running the controllers and the health monitor's own) on a real one-node cluster
//! of each release: a pod gets a provisioned and attached volume, its claim is grown and
//! expanded on the node, (on v1.36.2, whose snapshot CRDs the real snapshot-controller serves)
//! it is snapshotted and restored into a new claim a second pod reads, and everything deleted
//! is cleaned up: no PV, attachment or content left, the backing store empty.

mod common;

use common::*;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{Api, ListParams, Patch, PatchParams};
use plugreg_testpeers::KubeVersion;

/// deploy/test with deploy/sidecars' controller patch (its image as the cluster imports it); on
/// v1.20.2 without the snapshotter (no snapshot API there).
fn overlay(version: KubeVersion) -> tempfile::TempDir {
    let mut patch = std::fs::read_to_string(repo().join("deploy/sidecars/controller.yaml"))
        .expect("deploy/sidecars/controller.yaml");
    // deploy/test's image names apply to its base; this patch comes after them.
    patch = patch.replace(
        "image: plugreg/csi-sidecars:",
        &format!("image: {}/csi-sidecars:", plugreg_cluster::images::REGISTRY),
    );
    if version == KubeVersion::V1_20_2 {
        patch = patch.replace(
            "--controllers=provisioner,attacher,resizer,snapshotter",
            "--controllers=provisioner,attacher,resizer",
        );
    }
    test_overlay(&[("sidecars.yaml", &patch)])
}

async fn the_flow_runs_on_csi_sidecars(version: KubeVersion) {
    let overlay = overlay(version);
    let (cluster, _snapshot_controller) = if version == KubeVersion::V1_36_2 {
        let (c, s) = cluster_with_snapshots_and(Some(overlay.path())).await;
        (c, Some(s))
    } else {
        (
            cluster_with_driver(version, Some(overlay.path())).await,
            None,
        )
    };
    let controller = controller_pod(&cluster).await;
    let containers: Vec<String> = controller
        .spec
        .as_ref()
        .map(|s| s.containers.iter().map(|c| c.name.clone()).collect())
        .unwrap_or_default();
    // deploy/sidecars replaces the four sidecars only: deploy/base's health monitor stays a
    // container of its own.
    assert_eq!(
        containers,
        [
            "csi-sidecars",
            "csi-driver",
            "csi-external-health-monitor-controller"
        ]
    );

    // Provisioned, attached, mounted.
    let ns = "sidecars";
    let (pod, pv) = running_pod_with_volume(&cluster, ns, "written through csi-sidecars").await;
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    let attachments: Api<VolumeAttachment> = Api::all(cluster.client());
    let attached = attachments
        .list(&ListParams::default())
        .await
        .expect("list attachments")
        .items
        .into_iter()
        .any(|va| {
            va.spec.source.persistent_volume_name.as_deref() == Some(&pv_name)
                && va.status.is_some_and(|s| s.attached)
        });
    assert!(attached, "the volume is attached");

    // Grown: ControllerExpandVolume, then NodeExpandVolume by the kubelet.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.client(), ns);
    claims
        .patch(
            "data",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "spec": {"resources": {"requests": {"storage": "2Mi"}}}
            })),
        )
        .await
        .expect("grow the claim");
    wait(&cluster, "the claim's capacity 2Mi", || {
        let claims = claims.clone();
        async move {
            let claim = claims.get("data").await?;
            let capacity = claim
                .status
                .and_then(|s| s.capacity)
                .and_then(|c| c.get("storage").map(|q| q.0.clone()));
            Ok((capacity.as_deref() == Some("2Mi")).then_some(()))
        }
    })
    .await;

    // Snapshotted and restored (v1.36.2).
    let mut reader: Option<Pod> = None;
    if version == KubeVersion::V1_36_2 {
        cluster
            .apply(serde_json::json!({
                "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
                "metadata": {"name": "sidecars"}, "driver": DRIVER, "deletionPolicy": "Delete",
            }))
            .await
            .expect("the VolumeSnapshotClass");
        cluster
            .apply(serde_json::json!({
                "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
                "metadata": {"name": "snap", "namespace": ns},
                "spec": {"volumeSnapshotClassName": "sidecars",
                    "source": {"persistentVolumeClaimName": "data"}},
            }))
            .await
            .expect("the VolumeSnapshot");
        let snapshots: Api<plugreg_sidecar_kit::snapshot::VolumeSnapshot> =
            Api::namespaced(cluster.client(), ns);
        wait(&cluster, "the VolumeSnapshot readyToUse", || {
            let snapshots = snapshots.clone();
            async move {
                let s = snapshots.get("snap").await?;
                Ok((s.status.and_then(|st| st.ready_to_use) == Some(true)).then_some(()))
            }
        })
        .await;
        cluster
            .apply(serde_json::json!({
                "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": "restored", "namespace": ns},
                "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": format!("{ns}-wffc"),
                    "resources": {"requests": {"storage": "2Mi"}},
                    "dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot",
                        "name": "snap"}},
            }))
            .await
            .expect("the restored claim");
        let r = pod_reading_claim(&cluster, ns, "reader", "restored", "hello").await;
        wait_running(&cluster, ns, "reader").await;
        wait(&cluster, "the reader's log", || {
            let log = cluster.container_log(&r, "app");
            async move { Ok(log.contains("written through csi-sidecars").then_some(())) }
        })
        .await;
        reader = Some(r);
    }

    // Everything deleted, everything cleaned up.
    delete_pod(&cluster, ns, "app").await;
    if reader.is_some() {
        delete_pod(&cluster, ns, "reader").await;
        Api::<plugreg_sidecar_kit::snapshot::VolumeSnapshot>::namespaced(cluster.client(), ns)
            .delete("snap", &Default::default())
            .await
            .expect("delete the snapshot");
        claims
            .delete("restored", &Default::default())
            .await
            .expect("delete the restored claim");
    }
    claims
        .delete("data", &Default::default())
        .await
        .expect("delete the claim");
    let pvs: Api<PersistentVolume> = Api::all(cluster.client());
    wait(&cluster, "no PV and no VolumeAttachment left", || {
        let (pvs, attachments) = (pvs.clone(), attachments.clone());
        async move {
            let pv_left = !pvs.list(&ListParams::default()).await?.items.is_empty();
            let va_left = !attachments
                .list(&ListParams::default())
                .await?
                .items
                .is_empty();
            Ok((!pv_left && !va_left).then_some(()))
        }
    })
    .await;
    if version == KubeVersion::V1_36_2 {
        let contents: Api<plugreg_sidecar_kit::snapshot::VolumeSnapshotContent> =
            Api::all(cluster.client());
        wait(&cluster, "no VolumeSnapshotContent left", || {
            let contents = contents.clone();
            async move {
                Ok(contents
                    .list(&ListParams::default())
                    .await?
                    .items
                    .is_empty()
                    .then_some(()))
            }
        })
        .await;
    }
    // No volume left, and no snapshot (the driver keeps its snapshots in `.snapshots`).
    let store = cluster.node().host_path(BACKING_STORE);
    let entries = |dir: &std::path::Path| -> Vec<std::ffi::OsString> {
        std::fs::read_dir(dir)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default()
    };
    let left: Vec<_> = entries(&store)
        .into_iter()
        .filter(|n| n != ".snapshots")
        .collect();
    assert!(
        left.is_empty(),
        "volumes left in the backing store: {left:?}"
    );
    let snapshots_left = entries(&store.join(".snapshots"));
    assert!(
        snapshots_left.is_empty(),
        "snapshots left: {snapshots_left:?}"
    );

    // Every controller of the one process did its part.
    let calls = driver_calls(&cluster, &controller_pod(&cluster).await);
    let mut wanted = vec![
        "CreateVolume",
        "ControllerPublishVolume",
        "ControllerExpandVolume",
        "ControllerUnpublishVolume",
        "DeleteVolume",
    ];
    if version == KubeVersion::V1_36_2 {
        wanted.extend(["CreateSnapshot", "DeleteSnapshot"]);
    }
    for method in wanted {
        assert!(calls.iter().any(|m| m == method), "{method}: {calls:?}");
    }
    // One identification for every controller of csi-sidecars, and the health monitor's own.
    assert_eq!(
        calls.iter().filter(|m| *m == "GetPluginInfo").count(),
        2,
        "one identification for every controller, one for the health monitor: {calls:?}"
    );
    let _ = pod;
    cluster.shutdown().await.expect("tear down");
}

mod the_flow_runs_on_csi_sidecars {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn v1_20_2() {
        super::the_flow_runs_on_csi_sidecars(plugreg_testpeers::KubeVersion::V1_20_2).await;
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn v1_36_2() {
        super::the_flow_runs_on_csi_sidecars(plugreg_testpeers::KubeVersion::V1_36_2).await;
    }
}
