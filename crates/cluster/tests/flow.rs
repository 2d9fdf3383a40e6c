//! The flow plugreg exists for, end to end, on a real one-node cluster of each release.

mod common;

use common::*;
use k8s_openapi::api::core::v1::{Event, Node, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::{CSINode, VolumeAttachment};
use kube::api::{Api, ListParams, Patch, PatchParams};
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
/// writes is in the driver's backing store; the volume, abnormal in the driver's conditions
/// file, gets csi-external-health-monitor-controller's `VolumeConditionAbnormal` event on its
/// claim.
async fn pod_gets_a_provisioned_volume(version: KubeVersion) {
    let cluster = cluster_with_driver(version, None).await;
    let ns = "provision";
    cluster.create_namespace(ns).await.expect("namespace");
    storage_class(&cluster, "provision-wffc").await;
    claim(&cluster, ns, "data", "provision-wffc").await;
    // The volume to come (the provisioner names it `pvc-<claim UID>`, the driver's id is that
    // name) is abnormal from the start, in the controller plugin's conditions file.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.client(), ns);
    let uid = claims
        .get("data")
        .await
        .expect("get the claim")
        .metadata
        .uid
        .unwrap_or_default();
    let conditions = cluster
        .node()
        .host_path("/var/lib/plugreg-csi-test-driver/conditions");
    std::fs::create_dir_all(conditions.parent().unwrap()).unwrap();
    std::fs::write(
        &conditions,
        format!("pvc-{uid}=the backing store is read-only\n"),
    )
    .unwrap();
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

    // The CSIDriver says attachRequired: KCM's attach/detach controller made a
    // VolumeAttachment, plugreg's csi-attacher published the volume and recorded the publish
    // context, which the kubelet handed to the node plugin (it refuses to stage or publish
    // without the `device` ControllerPublishVolume answers).
    let va = attachment_of(&cluster, &pv_name).await;
    let status = va.status.clone().unwrap_or_default();
    assert!(status.attached, "VolumeAttachment {va:?}");
    assert!(
        status
            .attachment_metadata
            .unwrap_or_default()
            .contains_key("device"),
        "the publish context in the VolumeAttachment: {va:?}"
    );
    assert_eq!(va.spec.attacher, DRIVER);
    assert_eq!(va.spec.node_name, plugreg_cluster::NODE_NAME);
    assert!(
        va.metadata
            .finalizers
            .unwrap_or_default()
            .iter()
            .any(|f| f == "external-attacher/csi-plugreg-test"),
        "the attacher's finalizer on the VolumeAttachment"
    );

    // The drivers' own records: the controller created and attached it, the node plugin
    // staged it, then published it.
    let controller_calls = driver_calls(&cluster, &controller_pod(&cluster).await);
    let create = controller_calls.iter().position(|m| m == "CreateVolume");
    let attach = controller_calls
        .iter()
        .position(|m| m == "ControllerPublishVolume");
    assert!(
        matches!((create, attach), (Some(c), Some(a)) if c < a),
        "CreateVolume then ControllerPublishVolume: {controller_calls:?}"
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

    // csi-external-health-monitor-controller asked the controller plugin about the bound
    // volume (ControllerGetVolume) and told the claim it is abnormal, from upstream's component.
    let abnormal = wait(
        &cluster,
        "the claim's VolumeConditionAbnormal event",
        || {
            let events = events.clone();
            async move {
                let list = events.list(&ListParams::default()).await?;
                Ok(list.items.into_iter().find(|e| {
                    e.reason.as_deref() == Some("VolumeConditionAbnormal")
                        && e.involved_object.name.as_deref() == Some("data")
                }))
            }
        },
    )
    .await;
    assert_eq!(
        abnormal.message.as_deref(),
        Some("the backing store is read-only")
    );
    assert_eq!(abnormal.type_.as_deref(), Some("Warning"));
    assert_eq!(
        abnormal.source.and_then(|s| s.component),
        Some(format!("csi-pv-monitor-controller-{DRIVER}"))
    );
    let _ = std::fs::remove_file(&conditions);
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
    // The pod's object goes once its volume is unpublished; the kubelet unstages the volume
    // after that, on a later pass of its volume manager.
    let node_pod = node_plugin_pod(&cluster).await;
    let node_calls = wait(&cluster, "NodeUnstageVolume", || {
        let calls = driver_calls(&cluster, &node_pod);
        async move {
            Ok::<_, plugreg_cluster::Error>(
                calls
                    .iter()
                    .any(|m| m == "NodeUnstageVolume")
                    .then_some(calls),
            )
        }
    })
    .await;
    let unpublish = node_calls.iter().position(|m| m == "NodeUnpublishVolume");
    let unstage = node_calls.iter().position(|m| m == "NodeUnstageVolume");
    assert!(
        matches!((unpublish, unstage), (Some(p), Some(s)) if p < s),
        "NodeUnpublishVolume then NodeUnstageVolume: {node_calls:?}"
    );
    wait(&cluster, "no CSI mount left on the node", || {
        let left = csi_mounts(&cluster);
        async move { Ok::<_, plugreg_cluster::Error>(left.is_empty().then_some(())) }
    })
    .await;
    // Unmounted, the volume is detached: csi-attacher unpublishes it and releases the
    // VolumeAttachment KCM deletes.
    let attachments: Api<VolumeAttachment> = Api::all(cluster.client());
    wait(&cluster, "the VolumeAttachment gone", || {
        let attachments = attachments.clone();
        let name = pv_name.clone();
        async move {
            let list = attachments.list(&ListParams::default()).await?;
            Ok((!list
                .items
                .iter()
                .any(|va| va.spec.source.persistent_volume_name.as_deref() == Some(&name)))
            .then_some(()))
        }
    })
    .await;
    let controller_calls = driver_calls(&cluster, &controller_pod(&cluster).await);
    assert!(
        controller_calls
            .iter()
            .any(|m| m == "ControllerUnpublishVolume"),
        "{controller_calls:?}"
    );

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

/// A claim grown while a pod uses it: plugreg's csi-resizer calls ControllerExpandVolume,
/// grows the PV and, since the driver asks for node expansion, marks the claim
/// FileSystemResizePending; the real kubelet then calls NodeExpandVolume on the mounted volume
/// and records the new capacity in the claim's status. The pod runs on, untouched.
async fn claim_grown_in_use_is_expanded_on_the_node(version: KubeVersion) {
    let cluster = cluster_with_driver(version, None).await;
    let ns = "expand";
    let (pod, pv) = running_pod_with_volume(&cluster, ns, "grow").await;
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
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
    let pvs: Api<PersistentVolume> = Api::all(cluster.client());
    wait(&cluster, "the PV grown to 2Mi", || {
        let pvs = pvs.clone();
        let name = pv_name.clone();
        async move {
            let pv = pvs.get(&name).await?;
            let capacity = pv
                .spec
                .and_then(|s| s.capacity)
                .and_then(|c| c.get("storage").cloned());
            Ok((capacity.map(|q| q.0).as_deref() == Some("2Mi")).then_some(()))
        }
    })
    .await;
    let grown = wait(
        &cluster,
        "the claim's capacity 2Mi, resize finished",
        || {
            let claims = claims.clone();
            async move {
                let claim = claims.get("data").await?;
                let status = claim.status.clone().unwrap_or_default();
                let capacity = status
                    .capacity
                    .as_ref()
                    .and_then(|c| c.get("storage"))
                    .map(|q| q.0.clone());
                let resizing = status
                    .conditions
                    .iter()
                    .flatten()
                    .any(|c| c.type_ == "Resizing" || c.type_ == "FileSystemResizePending");
                Ok((capacity.as_deref() == Some("2Mi") && !resizing).then_some(claim))
            }
        },
    )
    .await;
    let controller_calls = driver_calls(&cluster, &controller_pod(&cluster).await);
    assert!(
        controller_calls
            .iter()
            .any(|m| m == "ControllerExpandVolume"),
        "{controller_calls:?}"
    );
    let node_calls = driver_calls(&cluster, &node_plugin_pod(&cluster).await);
    assert!(
        node_calls.iter().any(|m| m == "NodeExpandVolume"),
        "the kubelet expanded on the node: {node_calls:?}"
    );
    // The same pod, never restarted, still has its volume.
    let now = wait_running(&cluster, ns, "app").await;
    assert_eq!(now.metadata.uid, pod.metadata.uid);
    let restarts: i32 = now
        .status
        .and_then(|s| s.container_statuses)
        .unwrap_or_default()
        .iter()
        .map(|c| c.restart_count)
        .sum();
    assert_eq!(restarts, 0, "the pod was not restarted");
    assert!(csi_mounts(&cluster).contains(&target_path(&pod, &pv_name)));
    assert_eq!(
        grown.spec.and_then(|s| s.volume_name).as_deref(),
        Some(pv_name.as_str())
    );
    cluster.shutdown().await.expect("tear down");
}
on_both_releases!(
    claim_grown_in_use_is_expanded_on_the_node,
    claim_grown_in_use_is_expanded_on_the_node
);

/// The VolumeAttachment of PersistentVolume `pv`, once there is one.
async fn attachment_of(cluster: &plugreg_cluster::Cluster, pv: &str) -> VolumeAttachment {
    let attachments: Api<VolumeAttachment> = Api::all(cluster.client());
    wait(cluster, "the volume's VolumeAttachment", || {
        let attachments = attachments.clone();
        let pv = pv.to_owned();
        async move {
            let list = attachments.list(&ListParams::default()).await?;
            Ok(list
                .items
                .into_iter()
                .find(|va| va.spec.source.persistent_volume_name.as_deref() == Some(&pv)))
        }
    })
    .await
}

/// The node plugin's DaemonSet rolls out with a surge (the new pod starts before the old one
/// stops), as a driver that must never be unavailable would do it.
const SURGE: &str = "apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: csi-node
spec:
  updateStrategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
";

/// A new revision of the node plugin's pod template.
const REVISION_2: &str = "apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: csi-node
spec:
  template:
    metadata:
      annotations:
        plugreg.test/revision: \"2\"
";

/// Flow step 4: a rolling update of the node plugin with `maxSurge: 1` while a pod uses a
/// volume: the kubelet never deregisters the driver (its log has no DeRegister), the pod
/// keeps its volume, and the new node plugin unpublishes it when the pod goes. (DaemonSet
/// surge came with Kubernetes 1.21: see `v1_20_2_has_no_daemonset_surge`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn surge_rollout_keeps_the_driver_registered() {
    let version = KubeVersion::V1_36_2;
    let first = test_overlay(&[("surge.yaml", SURGE)]);
    let cluster = cluster_with_driver(version, Some(first.path())).await;
    let ds = node_daemonset(&cluster).await;
    let rolling = ds
        .spec
        .as_ref()
        .and_then(|s| s.update_strategy.as_ref())
        .and_then(|u| u.rolling_update.as_ref())
        .expect("a rolling update strategy");
    assert_eq!(
        rolling.max_surge,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
    );
    let ns = "surge";
    let (app, pv) = running_pod_with_volume(&cluster, ns, "across the rollout").await;
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    let target = target_path(&app, &pv_name);
    let old_plugin = node_plugin_pod(&cluster).await;
    let from = cluster.node().kubelet_log_text().len();

    // The new revision: the annotation, and (the loopback rules pick them anew) other ports,
    // which host-network pods running side by side need.
    let second = test_overlay(&[("surge.yaml", SURGE), ("revision.yaml", REVISION_2)]);
    cluster
        .deploy(second.path())
        .await
        .expect("apply revision 2");
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(cluster.client(), DRIVER_NS);
    let daemonsets: Api<k8s_openapi::api::apps::v1::DaemonSet> =
        Api::namespaced(cluster.client(), DRIVER_NS);
    let old_uid = old_plugin.metadata.uid.clone();
    let new_plugin = wait(&cluster, "the rollout to finish", || {
        let pods = pods.clone();
        let daemonsets = daemonsets.clone();
        let old_uid = old_uid.clone();
        async move {
            let list = pods
                .list(&ListParams::default().labels("app.kubernetes.io/name=csi-node"))
                .await?;
            let ds = daemonsets.get(NODE_DS).await?;
            let done = ds.status.as_ref().is_some_and(|s| {
                s.observed_generation >= ds.metadata.generation
                    && s.updated_number_scheduled == Some(1)
                    && s.number_available == Some(1)
                    && s.number_unavailable.unwrap_or(0) == 0
            });
            let only_new = list.items.len() == 1 && list.items[0].metadata.uid != old_uid;
            Ok((done && only_new).then(|| list.items[0].clone()))
        }
    })
    .await;
    // A surge, not a replacement: the kubelet took the new pod on while the old one was still
    // there (its log, in order: the new pod's ADD, then the old pod's DELETE; with maxSurge the
    // DaemonSet controller deletes the old pod only once the new one is available).
    let log = kubelet_log_since(&cluster, from);
    let line_of = |what: &str, pod: &str| {
        log.lines()
            .position(|l| l.contains(what) && l.contains(pod))
            .unwrap_or_else(|| panic!("no {what} of {pod} in the kubelet's log"))
    };
    let new_name = new_plugin.metadata.name.clone().unwrap_or_default();
    let old_name = old_plugin.metadata.name.clone().unwrap_or_default();
    assert!(
        line_of("SyncLoop ADD", &new_name) < line_of("SyncLoop DELETE", &old_name),
        "the old node plugin was deleted before the new one came"
    );
    wait_registered(&cluster).await;

    // The pod kept its volume: same pod, never restarted, still mounted, its file intact.
    let app_now = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(cluster.client(), ns)
        .get("app")
        .await
        .expect("get the app pod");
    assert_eq!(app_now.metadata.uid, app.metadata.uid);
    assert_eq!(
        container_status(&app_now, "app").map(|c| c.restart_count),
        Some(0)
    );
    assert!(container_status(&app_now, "app").is_some_and(|c| c.ready));
    assert!(
        csi_mounts(&cluster).contains(&target),
        "{target} unmounted by the rollout"
    );
    let file = cluster
        .node()
        .host_path(format!("{BACKING_STORE}/{pv_name}/hello"));
    assert_eq!(
        std::fs::read_to_string(file).unwrap_or_default(),
        "across the rollout\n"
    );

    // The new node plugin takes the volume down when the pod goes.
    delete_pod(&cluster, ns, "app").await;
    let calls = driver_calls(&cluster, &new_plugin);
    assert!(
        calls.iter().any(|m| m == "NodeUnpublishVolume"),
        "{calls:?}"
    );
    assert!(calls.iter().any(|m| m == "NodeUnstageVolume"), "{calls:?}");
    let left = csi_mounts(&cluster);
    assert!(left.is_empty(), "CSI mounts left on the node: {left:?}");
    // Last, so that a failure here shows that everything above held.
    let log = kubelet_log_since(&cluster, from);
    assert!(
        !log.contains(DEREGISTER),
        "the kubelet deregistered the driver during the surge rollout:\n{}",
        log.lines()
            .filter(|l| l.contains("DeRegister") || l.contains("Register new plugin"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    cluster.shutdown().await.expect("tear down");
}

/// Kubernetes v1.20.2 has no DaemonSet surge (`maxSurge` came with 1.21, behind a gate): its
/// API server drops the field, so the node plugin there can only be replaced by stopping the
/// old pod first (and the kubelet deregisters the driver meanwhile). This is why the surge
/// rollout above runs on v1.36.2 only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_20_2_has_no_daemonset_surge() {
    let api = plugreg_testpeers::ApiServer::start_version(KubeVersion::V1_20_2)
        .await
        .expect("kube-apiserver v1.20.2");
    let client = api.client().await.expect("client");
    let ds = serde_json::json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "csi-node", "namespace": "default"},
        "spec": {
            "selector": {"matchLabels": {"app": "csi-node"}},
            "updateStrategy": {"type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": {"app": "csi-node"}},
                "spec": {"containers": [{"name": "c", "image": "plugreg.test/busybox"}]}}
        }
    });
    // Server-side apply knows the schema and refuses the field...
    let refused = plugreg_cluster::deploy::apply_one(&client, &ds)
        .await
        .expect_err("v1.20.2 applies a DaemonSet with maxSurge");
    assert!(refused.to_string().contains("maxSurge"), "{refused}");
    // ...a plain create refuses what only a surge makes valid (no pod may be unavailable)...
    let daemonsets = Api::<k8s_openapi::api::apps::v1::DaemonSet>::namespaced(client, "default");
    let typed = |v: serde_json::Value| -> k8s_openapi::api::apps::v1::DaemonSet {
        serde_json::from_value(v).expect("a DaemonSet")
    };
    let invalid = daemonsets
        .create(&Default::default(), &typed(ds.clone()))
        .await
        .expect_err("v1.20.2 takes maxUnavailable: 0");
    assert!(invalid.to_string().contains("cannot be 0"), "{invalid}");
    // ...and drops maxSurge where the rest is valid.
    let mut ds = ds;
    ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] = serde_json::json!(1);
    let created = daemonsets
        .create(&Default::default(), &typed(ds))
        .await
        .expect("create the DaemonSet");
    let rolling = serde_json::to_value(
        created
            .spec
            .and_then(|s| s.update_strategy)
            .and_then(|u| u.rolling_update),
    )
    .expect("JSON");
    assert!(rolling.get("maxSurge").is_none(), "{rolling}");
    assert_eq!(rolling["maxUnavailable"], serde_json::json!(1));
}

/// Flow step 5: the kubelet is restarted: it registers the driver again (its log says so after
/// the restart), and a pod created after the restart gets its volume.
async fn kubelet_restart_registers_the_driver_again(version: KubeVersion) {
    let mut cluster = cluster_with_driver(version, None).await;
    let from = cluster.node().kubelet_log_text().len();
    let before = cluster.node().kubelet_pid();
    cluster
        .restart_kubelet()
        .await
        .expect("restart the kubelet");
    assert_ne!(
        cluster.node().kubelet_pid(),
        before,
        "a new kubelet process"
    );
    let c = &cluster;
    wait(
        c,
        "the restarted kubelet to register the driver",
        move || async move { Ok(kubelet_log_since(c, from).contains(REGISTER).then_some(())) },
    )
    .await;
    wait_registered(&cluster).await;

    let ns = "after-restart";
    let (_, pv) = running_pod_with_volume(&cluster, ns, "after the restart").await;
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    let file = cluster
        .node()
        .host_path(format!("{BACKING_STORE}/{pv_name}/hello"));
    assert_eq!(
        std::fs::read_to_string(file).unwrap_or_default(),
        "after the restart\n"
    );
    let calls = driver_calls(&cluster, &node_plugin_pod(&cluster).await);
    assert!(calls.iter().any(|m| m == "NodePublishVolume"), "{calls:?}");
    cluster.shutdown().await.expect("tear down");
}
on_both_releases!(
    kubelet_restart_registers_the_driver_again,
    kubelet_restart_registers_the_driver_again
);

/// The node plugin's liveness probe, quicker than deploy/base's (5 failures 10 s apart, then
/// the pod's 30 s grace): the same probe of plugreg's livenessprobe, checked every 2 s.
const QUICK_LIVENESS: &str = "apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: csi-node
spec:
  template:
    spec:
      terminationGracePeriodSeconds: 3
      containers:
      - name: csi-driver
        livenessProbe:
          initialDelaySeconds: 5
          periodSeconds: 2
          failureThreshold: 2
          timeoutSeconds: 3
";

/// Flow step 6: the driver hangs (its process is stopped: connections queue, Probe never
/// answers); plugreg's livenessprobe answers 500, the kubelet restarts the driver container,
/// and the driver is registered and serving again: a new pod gets a volume through it.
async fn hung_driver_is_restarted_through_the_livenessprobe(version: KubeVersion) {
    let overlay = test_overlay(&[("liveness.yaml", QUICK_LIVENESS)]);
    let cluster = cluster_with_driver(version, Some(overlay.path())).await;
    let ds = node_daemonset(&cluster).await;
    let health = http_endpoint_port(&ds, "liveness-probe");
    wait(&cluster, "livenessprobe to answer 200", || async move {
        Ok((http_status(health, "/healthz") == Some(200)).then_some(()))
    })
    .await;
    let plugin = node_plugin_pod(&cluster).await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(cluster.client(), DRIVER_NS);
    let name = plugin.metadata.name.clone().unwrap_or_default();
    let id = wait(&cluster, "the driver container running", || {
        let pods = pods.clone();
        let name = name.clone();
        async move {
            let p = pods.get(&name).await?;
            Ok(container_status(&p, "csi-driver")
                .filter(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
                .and_then(|c| c.container_id))
        }
    })
    .await;
    let pids = cluster.node().container_processes(&id);
    assert!(!pids.is_empty(), "no process for container {id}");
    for pid in &pids {
        plugreg_cluster::host::signal(*pid, rustix::process::Signal::STOP);
    }

    wait(&cluster, "livenessprobe to answer 500", || async move {
        Ok((http_status(health, "/healthz") == Some(500)).then_some(()))
    })
    .await;
    wait(
        &cluster,
        "the kubelet to restart the driver container",
        || {
            let pods = pods.clone();
            let name = name.clone();
            async move {
                let p = pods.get(&name).await?;
                Ok(container_status(&p, "csi-driver")
                    .filter(|c| c.restart_count >= 1 && c.ready)
                    .map(|_| ()))
            }
        },
    )
    .await;
    let events: Api<Event> = Api::namespaced(cluster.client(), DRIVER_NS);
    let unhealthy: Vec<String> = events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("Unhealthy"))
        .filter_map(|e| e.message)
        .collect();
    assert!(
        unhealthy
            .iter()
            .any(|m| m.contains("Liveness probe failed") && m.contains("statuscode: 500")),
        "the kubelet saw the 500: {unhealthy:?}"
    );
    wait(
        &cluster,
        "livenessprobe to answer 200 again",
        || async move { Ok((http_status(health, "/healthz") == Some(200)).then_some(())) },
    )
    .await;
    wait_registered(&cluster).await;
    let (_, pv) = running_pod_with_volume(&cluster, "after-hang", "after the hang").await;
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    let file = cluster
        .node()
        .host_path(format!("{BACKING_STORE}/{pv_name}/hello"));
    assert_eq!(
        std::fs::read_to_string(file).unwrap_or_default(),
        "after the hang\n"
    );
    cluster.shutdown().await.expect("tear down");
}
on_both_releases!(
    hung_driver_is_restarted_through_the_livenessprobe,
    hung_driver_is_restarted_through_the_livenessprobe
);

/// Flow of snapshots (issue 21), on v1.36.2 (the snapshot CRDs need it): a pod writes a file,
/// its claim is snapshotted (the real snapshot-controller makes the content, plugreg's
/// csi-snapshotter has the driver cut it), a new claim names the snapshot as its data source
/// (plugreg's csi-provisioner restores it with the snapshot as CreateVolume's content source),
/// and a second pod, on the restored claim, reads the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_is_restored_into_a_new_claim() {
    use plugreg_sidecar_kit::snapshot::{VolumeSnapshot, VolumeSnapshotClass};
    let (cluster, _snapshot_controller) = cluster_with_snapshots().await;
    let ns = "snapshot";
    cluster.create_namespace(ns).await.expect("namespace");
    storage_class(&cluster, "snapshot-wffc").await;
    claim(&cluster, ns, "data", "snapshot-wffc").await;
    pod_with_claim(
        &cluster,
        ns,
        "writer",
        "data",
        "hello",
        "written before the snapshot",
    )
    .await;
    wait_running(&cluster, ns, "writer").await;
    let source = bound_volume(&cluster, ns, "data").await;
    let source_file = cluster.node().host_path(format!(
        "{BACKING_STORE}/{}/hello",
        source.metadata.name.clone().unwrap_or_default()
    ));
    wait(&cluster, "the writer's file in the backing store", || {
        let f = source_file.clone();
        async move { Ok(std::fs::read_to_string(&f).ok().filter(|t| !t.is_empty())) }
    })
    .await;

    cluster
        .apply(serde_json::json!({
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
            "metadata": {"name": "snapshots"}, "driver": DRIVER, "deletionPolicy": "Delete",
        }))
        .await
        .expect("the VolumeSnapshotClass");
    let classes: Api<VolumeSnapshotClass> = Api::all(cluster.client());
    assert!(classes.get_opt("snapshots").await.expect("get").is_some());
    cluster
        .apply(serde_json::json!({
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
            "metadata": {"name": "snap", "namespace": ns},
            "spec": {"volumeSnapshotClassName": "snapshots",
                "source": {"persistentVolumeClaimName": "data"}},
        }))
        .await
        .expect("the VolumeSnapshot");
    let snapshots: Api<VolumeSnapshot> = Api::namespaced(cluster.client(), ns);
    let ready = wait(&cluster, "the VolumeSnapshot readyToUse", || {
        let snapshots = snapshots.clone();
        async move {
            let s = snapshots.get("snap").await?;
            Ok(s.status
                .clone()
                .filter(|st| st.ready_to_use == Some(true))
                .map(|_| s))
        }
    })
    .await;
    let status = ready.status.expect("status");
    assert!(status.bound_volume_snapshot_content_name.is_some());
    assert!(status.restore_size.is_some(), "{status:?}");

    cluster
        .apply(serde_json::json!({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "restored", "namespace": ns},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "snapshot-wffc",
                "resources": {"requests": {"storage": "1Mi"}},
                "dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot",
                    "name": "snap"}},
        }))
        .await
        .expect("the restored claim");
    let reader = pod_reading_claim(&cluster, ns, "reader", "restored", "hello").await;
    wait_running(&cluster, ns, "reader").await;
    let restored = bound_volume(&cluster, ns, "restored").await;
    assert_ne!(restored.metadata.name, source.metadata.name);
    let log = wait(&cluster, "the reader's log", || {
        let log = cluster.container_log(&reader, "app");
        async move { Ok(log.contains("written before the snapshot").then_some(log)) }
    })
    .await;
    assert!(log.contains("written before the snapshot"), "{log}");
    let controller_calls = driver_calls(&cluster, &controller_pod(&cluster).await);
    assert!(
        controller_calls.iter().any(|m| m == "CreateSnapshot"),
        "{controller_calls:?}"
    );
    cluster.shutdown().await.expect("tear down");
}

/// The controller plugin with a pool sized by a file in the backing store, and csi-provisioner
/// publishing it (`--enable-capacity`, polled every 2 s, owned by its ReplicaSet).
const CAPACITY: &str = "apiVersion: apps/v1
kind: Deployment
metadata:
  name: csi-controller
spec:
  template:
    spec:
      containers:
      - name: csi-driver
        args:
        - --name=$(DRIVER_NAME)
        - --endpoint=$(CSI_ENDPOINT)
        - --node-id=$(NODE_NAME)
        - --controller
        - --controller-publish
        - --controller-expand
        - --node-expansion-required
        - --snapshots
        - --clone-volume
        - --volume-condition
        - --accessibility-constraints
        - --topology=topology.plugreg.test/node=$(NODE_NAME)
        - --persistent
        - --data-dir=/var/lib/plugreg-csi-test-driver/$(DRIVER_NAME)
        - --capacity-file=/var/lib/plugreg-csi-test-driver/capacity
      - name: csi-provisioner
        args:
        - --csi-address=$(ADDRESS)
        - --leader-election
        - --leader-election-namespace=$(POD_NAMESPACE)
        - --http-endpoint=:8080
        - --v=2
        - --enable-capacity
        - --capacity-poll-interval=2s
        env:
        - name: NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
";

/// Storage capacity tracking with the real kube-scheduler (issue 31): a WaitForFirstConsumer
/// claim larger than the node's published capacity leaves its pod Pending with the scheduler's
/// own reason; once the pool grows, csi-provisioner publishes it, the scheduler places the pod,
/// the volume is provisioned and the pod runs. Here the controller Deployment's provisioner
/// publishes and provisions (its objects owned by its ReplicaSet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waits_for_capacity_and_runs_once_it_grows() {
    use k8s_openapi::api::storage::v1::CSIDriver;
    let overlay = test_overlay(&[("capacity.yaml", CAPACITY)]);
    let cluster = start_cluster_only(KubeVersion::V1_36_2).await;
    let pool = capacity_pool(&cluster, 16 << 20);
    deploy_overlay(&cluster, overlay.path()).await;
    // The scheduler looks at capacity only for a driver that says it publishes it.
    let drivers: Api<CSIDriver> = Api::all(cluster.client());
    drivers
        .patch(
            DRIVER,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"storageCapacity": true}})),
        )
        .await
        .expect("storageCapacity on the CSIDriver");
    let (pv, owner) = waits_for_capacity(&cluster, &pool, "capacity").await;
    assert_eq!(
        owner, "ReplicaSet",
        "the controller Deployment's ReplicaSet"
    );
    assert!(pv.spec.and_then(|s| s.csi).is_some());
    cluster.shutdown().await.expect("tear down");
}

/// Distributed provisioning in the cluster (issue 31): `deploy/test-distributed` runs
/// csi-provisioner in the node DaemonSet with `--node-deployment` and capacity tracking, and
/// none in the controller Deployment. The node's provisioner publishes its node's capacity
/// (owned by its pod), the scheduler keeps the too-large claim's pod Pending and places it once
/// the pool grows, and the node's own provisioner provisions the volume (its identity, in the
/// PV, ends with the node's name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nodes_own_provisioner_provisions_once_the_capacity_allows() {
    // The two test overlays name the same images (the cluster imports deploy/test's).
    let images = |dir: &str| {
        let text = std::fs::read_to_string(repo().join(dir).join("kustomization.yaml")).unwrap();
        let from = text.find("images:").expect("an images list");
        let to = text.find("configMapGenerator:").expect("the driver name");
        text[from..to].to_owned()
    };
    assert_eq!(images("deploy/test-distributed"), images("deploy/test"));
    let cluster = start_cluster_only(KubeVersion::V1_36_2).await;
    let pool = capacity_pool(&cluster, 16 << 20);
    deploy_overlay(&cluster, &repo().join("deploy/test-distributed")).await;
    let (pv, owner) = waits_for_capacity(&cluster, &pool, "distributed").await;
    assert_eq!(owner, "Pod", "the node pod (--capacity-ownerref-level=0)");
    let identity = pv
        .spec
        .and_then(|s| s.csi)
        .and_then(|c| c.volume_attributes)
        .and_then(|a| {
            a.get("storage.kubernetes.io/csiProvisionerIdentity")
                .cloned()
        })
        .unwrap_or_default();
    assert!(
        identity.ends_with(&format!("-{DRIVER}-{}", plugreg_cluster::NODE_NAME)),
        "provisioned by the node's provisioner: {identity}"
    );
    cluster.shutdown().await.expect("tear down");
}

/// The node's pool file of csi-test-driver (`--capacity-file`), holding `bytes`.
fn capacity_pool(cluster: &plugreg_cluster::Cluster, bytes: u64) -> std::path::PathBuf {
    let pool = cluster
        .node()
        .host_path("/var/lib/plugreg-csi-test-driver/capacity");
    std::fs::create_dir_all(pool.parent().unwrap()).unwrap();
    std::fs::write(&pool, bytes.to_string()).unwrap();
    pool
}

/// The scheduler's side of capacity tracking, in namespace `ns` with a WaitForFirstConsumer
/// class named after it: the pool (16 MiB) published, a 64 MiB claim's pod Pending with the
/// scheduler's reason and nothing provisioned, then the pool grown to 1 GiB and the pod
/// running. Returns the claim's PV and the kind of the published object's owner.
async fn waits_for_capacity(
    cluster: &plugreg_cluster::Cluster,
    pool: &std::path::Path,
    ns: &str,
) -> (PersistentVolume, String) {
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::storage::v1::CSIStorageCapacity;
    cluster.create_namespace(ns).await.expect("namespace");
    let class = format!("{ns}-wffc");
    storage_class(cluster, &class).await;
    let capacities: Api<CSIStorageCapacity> = Api::namespaced(cluster.client(), DRIVER_NS);
    let published = wait(cluster, "the node's capacity published", || {
        let capacities = capacities.clone();
        let class = class.clone();
        async move {
            let list = capacities.list(&ListParams::default()).await?;
            Ok(list.items.into_iter().find(|c| {
                c.storage_class_name == class
                    && c.capacity.as_ref().map(|q| q.0.as_str()) == Some("16Mi")
            }))
        }
    })
    .await;
    let owner = published
        .metadata
        .owner_references
        .clone()
        .unwrap_or_default();
    assert_eq!(owner.len(), 1, "{published:?}");
    cluster
        .apply(serde_json::json!({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "big", "namespace": ns},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": class,
                "resources": {"requests": {"storage": "64Mi"}}},
        }))
        .await
        .expect("the claim");
    pod_with_claim(cluster, ns, "big-user", "big", "hello", "it fits").await;
    let pods: Api<Pod> = Api::namespaced(cluster.client(), ns);
    let why = wait(cluster, "the scheduler's reason", || {
        let pods = pods.clone();
        async move {
            let p = pods.get("big-user").await?;
            Ok(p.status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False")
                .and_then(|c| c.message)
                .filter(|m| m.contains("did not have enough free storage")))
        }
    })
    .await;
    assert!(
        why.contains("node(s) did not have enough free storage"),
        "{why}"
    );
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.client(), ns);
    let claim = claims.get("big").await.expect("the claim");
    assert_eq!(
        claim.status.and_then(|s| s.phase).as_deref(),
        Some("Pending"),
        "nothing provisioned while it does not fit"
    );
    // The pool grows: published within a poll, the pod is placed and runs.
    std::fs::write(pool, (1u64 << 30).to_string()).unwrap();
    wait_running(cluster, ns, "big-user").await;
    (
        bound_volume(cluster, ns, "big").await,
        owner[0].kind.clone(),
    )
}
