//! CSI migration (`spec/upstream-csi-migration.md` §4.2 and checklist 21-23, 27-29): the test
//! driver registered as `ebs.csi.aws.com`, and VolumeAttachments of in-tree PVs and in-line
//! volumes, translated.
//!
//! Every test here serves the same driver name, so each has a kube-apiserver of its own (two
//! attachers of one name on one API server would take each other's VolumeAttachments).

mod common;

use std::sync::Arc;

use common::{Env, NODE_ID, free_local_addr, http_get, poll};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::api::{Api, DeleteParams, PostParams};
use plugreg_csi_test_driver::Method;
use plugreg_proto::csi::v1::volume_capability::AccessType;
use plugreg_testpeers::{ApiServer, ControllerManager, KubeVersion};
use serde_json::{Value, json};

const EBS: &str = "ebs.csi.aws.com";

/// A world of its own (API server, driver named `ebs.csi.aws.com`, a node with its CSINode).
async fn ebs_env(api: Arc<ApiServer>) -> (Env, String) {
    let mut env = Env::on(api, |c| c.name = EBS.into()).await;
    env.name = EBS.into();
    let node = env.unique("node");
    env.csinode(&node, &[(EBS, NODE_ID)]).await;
    (env, node)
}

/// Creates the PV `name` from `spec` (merged into a 1 GiB Retain PV without a source).
async fn create_pv(env: &Env, name: &str, metadata: Value, spec: Value) {
    let mut pv = json!({
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
        },
    });
    common::merge(&mut pv, json!({"metadata": metadata, "spec": spec}));
    env.pvs()
        .create(&PostParams::default(), &serde_json::from_value(pv).unwrap())
        .await
        .unwrap();
}

/// The `csi_sidecar_operations_seconds_count` line of a successful `method` with `migrated`.
fn count_line(method: &str, migrated: bool, n: u64) -> String {
    format!(
        "csi_sidecar_operations_seconds_count{{driver_name=\"{EBS}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/{method}\",migrated=\"{migrated}\"}} {n}"
    )
}

async fn wait_metric(addr: std::net::SocketAddr, line: &str) {
    poll(&format!("{line} in /metrics"), || async {
        let (_, body) = http_get(addr, "/metrics")?;
        body.lines().any(|l| l == line).then_some(())
    })
    .await;
}

/// Checklist 21, 22 and 27 with the real attach/detach controller: a pod on a claim bound to a
/// static in-tree EBS PV (`aws://us-east-1a/vol-a`); kube-controller-manager translates it and
/// creates the `csi-<sha256>` VolumeAttachment naming the PV; `csi-attacher` puts its finalizer
/// on the in-tree PV and publishes the translated volume (`vol-a`, `{"partition": "0"}`,
/// `migrated="true"`); the pod goes, KCM deletes the VolumeAttachment, the attacher
/// unpublishes `vol-a` and releases the PV. KCM never adds `migrated-to` to a PV it did not
/// provision.
///
/// No kubelet: the test writes the Node (annotated `controller-managed-attach-detach`, as the
/// kubelet does) and the CSINode, as kcm.rs does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_tree_pv_is_attached_and_detached_translated_through_kcm() {
    let version = KubeVersion::V1_36_2;
    let api = Arc::new(
        ApiServer::start_version(version)
            .await
            .expect("kube-apiserver"),
    );
    let kcm = ControllerManager::start(&api, &common::attach_detach_controllers(version))
        .await
        .expect("kube-controller-manager");
    let (env, node) = ebs_env(api).await;
    env.kcm_managed_node(&node).await;
    let nodes: Api<Node> = Api::all(env.client.clone());
    let pv = env.unique("pv");
    create_pv(
        &env,
        &pv,
        json!({"labels": {"topology.kubernetes.io/zone": "us-east-1a"}}),
        json!({
            "awsElasticBlockStore": {"volumeID": "aws://us-east-1a/vol-a", "fsType": "ext4"},
            "claimRef": {"namespace": env.ns, "name": "data"},
            "storageClassName": "",
        }),
    )
    .await;
    env.bound_claim_data(&pv).await;
    let addr = free_local_addr();
    let mut a = env.attacher(&[&format!("--http-endpoint={addr}")]);
    let va = env.kcm_attachment(&node, EBS).await;
    let name = va.metadata.name.clone().unwrap();
    assert_eq!(
        va.spec.source.persistent_volume_name.as_deref(),
        Some(pv.as_str())
    );
    env.wait_attached(&name).await;
    let published = env.calls.publish_requests();
    let req = published.last().expect("a ControllerPublishVolume");
    assert_eq!(req.volume_id, "vol-a", "{req:?}");
    assert_eq!(req.node_id, NODE_ID);
    assert_eq!(
        req.volume_context.get("partition").map(String::as_str),
        Some("0")
    );
    let cap = req.volume_capability.clone().unwrap();
    assert!(
        matches!(&cap.access_type, Some(AccessType::Mount(m)) if m.fs_type == "ext4"),
        "{cap:?}"
    );
    let with_fin = env
        .wait_pv(&pv, "attacher finalizer on the in-tree PV", |p| {
            p.metadata
                .finalizers
                .as_ref()
                .is_some_and(|f| f.contains(&env.finalizer()))
        })
        .await;
    assert!(with_fin.spec.unwrap().aws_elastic_block_store.is_some());
    wait_metric(addr, &count_line("ControllerPublishVolume", true, 1)).await;
    // KCM saw it attached, under the translated handle.
    let unique = format!("kubernetes.io/csi/{EBS}^vol-a");
    poll("node volumesAttached", || async {
        let n = nodes.get(&node).await.ok()?;
        let attached = n.status?.volumes_attached?;
        attached.iter().any(|a| a.name == unique).then_some(())
    })
    .await;

    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.ns);
    pods.delete("app", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    env.wait_va_gone(&name).await;
    let unpublished = env.calls.unpublish_requests();
    assert_eq!(unpublished.len(), 1, "{unpublished:?}");
    assert_eq!(unpublished[0].volume_id, "vol-a");
    wait_metric(addr, &count_line("ControllerUnpublishVolume", true, 1)).await;
    let released = env
        .wait_pv(&pv, "attacher finalizer gone", |p| {
            !p.metadata
                .finalizers
                .as_ref()
                .is_some_and(|f| f.contains(&env.finalizer()))
        })
        .await;
    let annotations = released.metadata.annotations.unwrap_or_default();
    assert!(
        !annotations.contains_key("pv.kubernetes.io/migrated-to"),
        "{annotations:?}"
    );
    assert!(a.running(), "{}", a.log());
    drop(kcm);
}

/// Checklist 23, 25, 26, 28 and 29 with VolumeAttachments written by the test (the A/D
/// controller never makes those that fail): in-tree PVs that do not translate (a bad EBS ID, an
/// Azure Disk of the defaulted kind `Shared`, an Azure File without a secret namespace) get
/// upstream's attach errors; an NFS PV is not migratable; an in-line volume (as KCM translates one) is published
/// as it is, with `migrated="false"`, and unpublished when its VolumeAttachment goes.
async fn test_made_attachments_of_in_tree_and_in_line_volumes(version: KubeVersion) {
    let api = Arc::new(
        ApiServer::start_version(version)
            .await
            .expect("kube-apiserver"),
    );
    let (env, node) = ebs_env(api).await;
    let addr = free_local_addr();
    let mut a = env.attacher(&[&format!("--http-endpoint={addr}")]);

    let bad = env.unique("bad");
    create_pv(
        &env,
        &bad,
        json!({}),
        json!({"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/bad"}}),
    )
    .await;
    let bad_va = env.unique("va-bad");
    env.va(&bad_va, &bad, &node).await;
    env.wait_attach_error(
        &bad_va,
        "failed to translate in tree pv to CSI: failed to translate Kubernetes ID to EBS Volume ID Invalid format for AWS volume (aws://us-east-1a/bad)",
    )
    .await;

    // Checklist 25 and 26: the API server defaults an Azure Disk's `kind` to `Shared`, which
    // does not translate; an Azure File PV without `secretNamespace` or a claim has no
    // secret namespace.
    let translation_errors = [
        (
            "disk",
            json!({"azureDisk": {"diskName": "d1", "diskURI": "https://acct.blob.core.windows.net/vhds/d1.vhd"}}),
            "failed to translate in tree pv to CSI: kind(Shared) is not supported in csi migration",
        ),
        (
            "file",
            json!({"azureFile": {"secretName": "azure-storage-account-acct-secret", "shareName": "share"}}),
            "failed to translate in tree pv to CSI: could not find a secret namespace in PersistentVolumeSource or ClaimRef",
        ),
    ];
    for (what, spec, want) in translation_errors {
        let pv = env.unique(what);
        create_pv(&env, &pv, json!({}), spec).await;
        let va = env.unique(&format!("va-{what}"));
        env.va(&va, &pv, &node).await;
        env.wait_attach_error(&va, want).await;
    }

    let nfs = env.unique("nfs");
    create_pv(
        &env,
        &nfs,
        json!({}),
        json!({"nfs": {"server": "127.0.0.1", "path": "/x"}}),
    )
    .await;
    let nfs_va = env.unique("va-nfs");
    env.va(&nfs_va, &nfs, &node).await;
    env.wait_attach_error(
        &nfs_va,
        "pv spec contained non-csi source that was not migrated",
    )
    .await;

    let inline = env.unique("va-inline");
    let va: VolumeAttachment = serde_json::from_value(json!({
        "metadata": {"name": inline},
        "spec": {"attacher": EBS, "nodeName": node, "source": {"inlineVolumeSpec": {
            "accessModes": ["ReadWriteOnce"],
            "volumeMode": "Filesystem",
            "csi": {"driver": EBS, "volumeHandle": "vol-c", "fsType": "ext4",
                    "volumeAttributes": {"partition": "0"}},
        }}},
    }))
    .unwrap();
    env.vas().create(&PostParams::default(), &va).await.unwrap();
    env.wait_attached(&inline).await;
    let published = env.calls.publish_requests();
    assert!(
        published.iter().all(|r| r.volume_id == "vol-c"),
        "only the in-line volume reaches the driver: {published:?}"
    );
    wait_metric(addr, &count_line("ControllerPublishVolume", false, 1)).await;
    env.delete_va(&inline).await;
    env.wait_va_gone(&inline).await;
    assert_eq!(env.calls.count(Method::ControllerUnpublishVolume), 1);
    assert_eq!(env.calls.unpublish_requests()[0].volume_id, "vol-c");
    assert!(a.running(), "{}", a.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_made_attachments_of_in_tree_and_in_line_volumes_v1_36() {
    test_made_attachments_of_in_tree_and_in_line_volumes(KubeVersion::V1_36_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_made_attachments_of_in_tree_and_in_line_volumes_v1_20() {
    test_made_attachments_of_in_tree_and_in_line_volumes(KubeVersion::V1_20_2).await;
}
