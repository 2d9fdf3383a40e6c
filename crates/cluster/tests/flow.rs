//! The flow plugreg exists for, end to end, on a real one-node cluster of each release.

mod common;

use common::*;
use k8s_openapi::api::core::v1::{Event, Node, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::CSINode;
use kube::api::{Api, ListParams};
use plugreg_testpeers::KubeVersion;

/// Defines `<name>::v1_20_2` and `<name>::v1_36_2` running `body(version)`.
macro_rules! on_both_releases {
    ($name:ident, $body:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn v1_20_2() {
                super::$body(plugreg_testpeers::KubeVersion::V1_20_2).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn v1_36_2() {
                super::$body(plugreg_testpeers::KubeVersion::V1_36_2).await;
            }
        }
    };
}

/// Flow step 1: The real kubelet's plugin watcher registers the driver through plugreg's
/// csi-node-driver-registrar: the Node gets the driver's node id annotation and the CSINode
/// lists the driver with the node's topology key.
async fn kubelet_registers_the_driver(version: KubeVersion) {
    let cluster = cluster_with_driver(version, None).await;
    let node = Api::<Node>::all(cluster.client())
        .get(plugreg_cluster::NODE_NAME)
        .await
        .expect("get the Node");
    let ids = node
        .metadata
        .annotations
        .unwrap_or_default()
        .get("csi.volume.kubernetes.io/nodeid")
        .cloned()
        .unwrap_or_default();
    let ids: serde_json::Value = serde_json::from_str(&ids).expect("nodeid annotation JSON");
    assert_eq!(ids[DRIVER], serde_json::json!(plugreg_cluster::NODE_NAME));
    let csinode = Api::<CSINode>::all(cluster.client())
        .get(plugreg_cluster::NODE_NAME)
        .await
        .expect("get the CSINode");
    let driver = csinode
        .spec
        .drivers
        .iter()
        .find(|d| d.name == DRIVER)
        .expect("the driver in the CSINode");
    assert_eq!(driver.node_id, plugreg_cluster::NODE_NAME);
    assert_eq!(driver.topology_keys, Some(vec![TOPOLOGY_KEY.to_owned()]));
    cluster.shutdown().await.expect("tear down");
}
on_both_releases!(kubelet_registers_the_driver, kubelet_registers_the_driver);

/// Flow step 2: WaitForFirstConsumer: the claim waits for its pod; the scheduler picks the node,
/// plugreg's csi-provisioner creates the volume with the node's topology, the claim is Bound,
/// the real kubelet calls NodeStageVolume then NodePublishVolume, the pod runs and the file it
/// writes is in the driver's backing store.
async fn pod_gets_a_provisioned_volume(version: KubeVersion) {
    let cluster = cluster_with_driver(version, None).await;
    let ns = "provision";
    cluster.create_namespace(ns).await.expect("namespace");
    storage_class(&cluster, "provision-wffc").await;
    claim(&cluster, ns, "data", "provision-wffc").await;
    // The PV controller says it waits for a consumer; only then is "not provisioned" a fact.
    let events: Api<Event> = Api::namespaced(cluster.client(), ns);
    wait(&cluster, "the claim's WaitForFirstConsumer event", || {
        let events = events.clone();
        async move {
            let list = events.list(&ListParams::default()).await?;
            Ok(list
                .items
                .iter()
                .any(|e| e.reason.as_deref() == Some("WaitForFirstConsumer"))
                .then_some(()))
        }
    })
    .await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.client(), ns);
    let waiting = claims.get("data").await.expect("get the claim");
    assert_eq!(
        waiting.status.and_then(|s| s.phase).as_deref(),
        Some("Pending")
    );
    assert!(waiting.spec.and_then(|s| s.volume_name).is_none());

    pod_with_claim(&cluster, ns, "app", "data", "hello", "written by the pod").await;
    let pod = wait_running(&cluster, ns, "app").await;
    let pv = bound_volume(&cluster, ns, "data").await;
    let claim = claims.get("data").await.expect("get the claim");
    let annotations = claim.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations
            .get("volume.kubernetes.io/selected-node")
            .map(String::as_str),
        Some(plugreg_cluster::NODE_NAME),
        "the scheduler picked the node"
    );
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    let spec = pv.spec.clone().expect("PV spec");
    let csi = spec.csi.expect("a CSI volume");
    assert_eq!(csi.driver, DRIVER);
    // The test driver's volume id is the CreateVolume name, which is the PV's name.
    assert_eq!(csi.volume_handle, pv_name);
    let terms = spec
        .node_affinity
        .and_then(|a| a.required)
        .map(|r| r.node_selector_terms)
        .unwrap_or_default();
    let topology: Vec<_> = terms
        .iter()
        .flat_map(|t| t.match_expressions.iter().flatten())
        .map(|e| (e.key.as_str(), e.values.clone().unwrap_or_default()))
        .collect();
    assert_eq!(
        topology,
        vec![(TOPOLOGY_KEY, vec![plugreg_cluster::NODE_NAME.to_owned()])],
        "the volume carries the node's topology"
    );
    assert_eq!(
        pv.metadata
            .annotations
            .unwrap_or_default()
            .get("pv.kubernetes.io/provisioned-by")
            .map(String::as_str),
        Some(DRIVER)
    );

    // The drivers' own records: the controller created it, the node plugin staged it, then
    // published it.
    let controller_calls = driver_calls(&cluster, &controller_pod(&cluster).await);
    assert!(
        controller_calls.iter().any(|m| m == "CreateVolume"),
        "{controller_calls:?}"
    );
    let node_calls = driver_calls(&cluster, &node_plugin_pod(&cluster).await);
    let stage = node_calls.iter().position(|m| m == "NodeStageVolume");
    let publish = node_calls.iter().position(|m| m == "NodePublishVolume");
    assert!(
        matches!((stage, publish), (Some(s), Some(p)) if s < p),
        "NodeStageVolume then NodePublishVolume: {node_calls:?}"
    );
    let mounts = csi_mounts(&cluster);
    assert!(mounts.contains(&target_path(&pod, &pv_name)), "{mounts:?}");
    assert!(
        mounts.iter().any(|m| m.ends_with("/globalmount")),
        "a staging mount: {mounts:?}"
    );
    let file = cluster
        .node()
        .host_path(format!("{BACKING_STORE}/{pv_name}/hello"));
    assert_eq!(
        std::fs::read_to_string(&file).unwrap_or_default(),
        "written by the pod\n",
        "{} in the backing store",
        file.display()
    );
    cluster.shutdown().await.expect("tear down");
}
on_both_releases!(pod_gets_a_provisioned_volume, pod_gets_a_provisioned_volume);

/// Flow step 3: The pod is deleted: NodeUnpublishVolume and NodeUnstageVolume, no mount left on the
/// node. The claim is deleted: DeleteVolume, the PV is gone, the backing store is empty.
async fn deleting_pod_and_claim_cleans_up(version: KubeVersion) {
    let cluster = cluster_with_driver(version, None).await;
    let ns = "cleanup";
    let (_, pv) = running_pod_with_volume(&cluster, ns, "bye").await;
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    assert!(!csi_mounts(&cluster).is_empty());

    delete_pod(&cluster, ns, "app").await;
    let node_calls = driver_calls(&cluster, &node_plugin_pod(&cluster).await);
    let unpublish = node_calls.iter().position(|m| m == "NodeUnpublishVolume");
    let unstage = node_calls.iter().position(|m| m == "NodeUnstageVolume");
    assert!(
        matches!((unpublish, unstage), (Some(p), Some(s)) if p < s),
        "NodeUnpublishVolume then NodeUnstageVolume: {node_calls:?}"
    );
    let left = csi_mounts(&cluster);
    assert!(left.is_empty(), "CSI mounts left on the node: {left:?}");

    Api::<PersistentVolumeClaim>::namespaced(cluster.client(), ns)
        .delete("data", &Default::default())
        .await
        .expect("delete the claim");
    let pvs: Api<PersistentVolume> = Api::all(cluster.client());
    wait(&cluster, "the PV gone", || {
        let pvs = pvs.clone();
        let name = pv_name.clone();
        async move { Ok(pvs.get_opt(&name).await?.is_none().then_some(())) }
    })
    .await;
    let controller_calls = driver_calls(&cluster, &controller_pod(&cluster).await);
    assert!(
        controller_calls.iter().any(|m| m == "DeleteVolume"),
        "{controller_calls:?}"
    );
    let store = cluster.node().host_path(BACKING_STORE);
    let left: Vec<_> = std::fs::read_dir(&store)
        .expect("the backing store")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        left.is_empty(),
        "the backing store {} is not empty: {left:?}",
        store.display()
    );
    cluster.shutdown().await.expect("tear down");
}
on_both_releases!(
    deleting_pod_and_claim_cleans_up,
    deleting_pod_and_claim_cleans_up
);
