//! CSI migration (`spec/upstream-csi-migration.md` §4.3, §5.3 and checklist 31-34): the test
//! driver registered as `ebs.csi.aws.com` expands the volume of a claim bound to an in-tree
//! EBS PV once kube-controller-manager's expand controller hands the claim over.
//!
//! The test has an API server and a KCM of its own: the shared ones run no expand controller,
//! and the driver name is not unique to the test.

mod common;

use std::sync::Arc;

use common::{Cluster, Env, pv_capacity};
use plugreg_csi_test_driver::Method;
use plugreg_testpeers::sidecar::{free_addr, http_get};
use plugreg_testpeers::{ApiServer, ControllerManager, KubeVersion};
use serde_json::json;

const EBS: &str = "ebs.csi.aws.com";

/// Checklist 31 (with EBS: the test driver's volume IDs cannot hold a GCE handle's `/`): a
/// bound claim of a static in-tree EBS PV (`aws://us-east-1a/vol-3`) grows; KCM announces
/// `ExternalExpanding` and sets `volume.kubernetes.io/storage-resizer`; csi-resizer sends
/// ControllerExpandVolume with the translated handle `vol-3` (`migrated="true"`) and writes
/// the new capacity to the in-tree PV, which stays in-tree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_tree_pv_is_expanded_translated_through_kcm() {
    let version = KubeVersion::V1_36_2;
    let api = Arc::new(
        ApiServer::start_version(version)
            .await
            .expect("kube-apiserver"),
    );
    let mut controllers = plugreg_testpeers::volume_controllers(version).to_vec();
    controllers.push("persistentvolume-expander-controller");
    let kcm = ControllerManager::start(&api, &controllers)
        .await
        .expect("kube-controller-manager");
    let cluster = Arc::new(Cluster { api, kcm });
    let mut env = Env::on(cluster, |c| {
        c.name = EBS.into();
        c.controller_modify = true;
    })
    .await;
    env.name = EBS.into();
    env.bound_claim_of(
        "data",
        "1Gi",
        "unused",
        None,
        json!({"spec": {"csi": null,
            "awsElasticBlockStore": {"volumeID": "aws://us-east-1a/vol-3", "fsType": "ext4"}}}),
    )
    .await;
    let addr = free_addr();
    let mut r = env.resizer(&[&format!("--http-endpoint={addr}")]);
    env.request("data", "2Gi").await;
    let message = env.wait_event("data", "ExternalExpanding").await;
    assert_eq!(
        message,
        "CSI migration enabled for kubernetes.io/aws-ebs; waiting for external resizer to expand the pvc"
    );
    env.wait_calls(Method::ControllerExpandVolume, 1).await;
    let req = env.calls.expand_requests().remove(0);
    assert_eq!(req.volume_id, "vol-3", "{req:?}");
    assert_eq!(req.capacity_range.map(|c| c.required_bytes), Some(2 << 30));
    let pv = env
        .wait_pv(&env.pv_name("data"), "capacity 2Gi", |pv| {
            pv_capacity(pv) == "2Gi"
        })
        .await;
    let spec = pv.spec.unwrap();
    assert!(spec.csi.is_none() && spec.aws_elastic_block_store.is_some());
    env.wait_claim("data", "capacity 2Gi", |c| {
        common::capacity(c).as_deref() == Some("2Gi")
    })
    .await;
    let line = format!(
        "csi_sidecar_operations_seconds_count{{driver_name=\"{EBS}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/ControllerExpandVolume\",migrated=\"true\"}} 1"
    );
    let (_, body) = http_get(addr, "/metrics");
    assert!(body.lines().any(|l| l == line), "{body}");

    // Checklist 34: a VolumeAttributesClass on the migrated claim is not the modify
    // controller's (the PV has no CSI source): no ControllerModifyVolume, no modify status.
    // It comes with another expansion, whose end marks that the claim's update was seen.
    let gold = common::class(&env, "gold", &[("iops", "100")]).await;
    common::set_class(&env, "data", Some(&gold)).await;
    env.request("data", "3Gi").await;
    env.wait_claim("data", "capacity 3Gi", |c| {
        common::capacity(c).as_deref() == Some("3Gi")
    })
    .await;
    assert!(
        r.log()
            .contains("Starting external resizer for modify volume"),
        "the modify controller runs: {}",
        r.log()
    );
    assert_eq!(env.calls.count(Method::ControllerModifyVolume), 0);
    let claim = env.claims().get("data").await.unwrap();
    let status = claim.status.unwrap_or_default();
    assert!(
        status.modify_volume_status.is_none()
            && status.current_volume_attributes_class_name.is_none(),
        "{status:?}"
    );
    assert!(r.running(), "{}", r.log());
}

/// Checklist 32: the resizer annotation set by hand to this migration driver on a claim bound
/// to an NFS PV: the resize fails with upstream's translation error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_annotated_claim_of_an_nfs_pv_fails_to_translate() {
    let version = KubeVersion::V1_36_2;
    let api = Arc::new(
        ApiServer::start_version(version)
            .await
            .expect("kube-apiserver"),
    );
    let kcm = ControllerManager::start_volume_controllers(&api, &[])
        .await
        .expect("kube-controller-manager");
    let cluster = Arc::new(Cluster { api, kcm });
    let mut env = Env::on(cluster, |c| c.name = EBS.into()).await;
    env.name = EBS.into();
    env.bound_claim_of(
        "nfs",
        "1Gi",
        "unused",
        None,
        json!({"spec": {"csi": null, "nfs": {"server": "127.0.0.1", "path": "/x"}}}),
    )
    .await;
    let _r = env.resizer(&[]);
    env.claims()
        .patch(
            "nfs",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({
                "metadata": {"annotations": {"volume.kubernetes.io/storage-resizer": EBS}},
                "spec": {"resources": {"requests": {"storage": "2Gi"}}},
            })),
        )
        .await
        .unwrap();
    let pv = env.pv_name("nfs");
    let message = env.wait_event("nfs", "VolumeResizeFailed").await;
    assert_eq!(
        message,
        format!(
            "resize volume \"{pv}\" by resizer \"{EBS}\" failed: failed to translate persistent volume: could not find in-tree plugin translation logic for \"{pv}\""
        )
    );
    assert_eq!(env.calls.count(Method::ControllerExpandVolume), 0);
}
