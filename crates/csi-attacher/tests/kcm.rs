//! Checklist 4 and 12 with the real attach/detach controller of kube-controller-manager
//! (v1.36.2 and v1.20.2): a pod using a bound claim is scheduled to a node, KCM creates the
//! `csi-<sha256>` VolumeAttachment and waits; `csi-attacher` publishes and marks it attached,
//! KCM records the volume in the node's `volumesAttached`; the pod goes, KCM deletes the
//! VolumeAttachment, `csi-attacher` unpublishes it once and releases it.
//!
//! There is no kubelet: the test writes the Node (with the controller-managed-attach-detach
//! annotation the kubelet sets) and the CSINode, as the kubelet and the registrar would.

mod common;

use std::sync::Arc;

use common::{Env, NODE_ID, attach_detach_controllers, poll};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams};
use plugreg_csi_test_driver::Method;
use plugreg_testpeers::{ApiServer, ControllerManager, KubeVersion};
use serde_json::json;

async fn pod_attach_and_detach(version: KubeVersion) {
    let api = Arc::new(
        ApiServer::start_version(version)
            .await
            .expect("kube-apiserver"),
    );
    let kcm = ControllerManager::start(&api, &attach_detach_controllers(version))
        .await
        .expect("kube-controller-manager");
    let env = Env::on(api, |_| {}).await;
    let node = env.unique("node");
    env.kcm_managed_node(&node).await;
    let nodes: Api<Node> = Api::all(env.client.clone());
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(
        &pv,
        "vol-a",
        json!({"spec": {"claimRef": {"namespace": env.ns, "name": "data"}, "storageClassName": ""}}),
    )
    .await;
    env.bound_claim_data(&pv).await;
    let _a = env.attacher(&[]);
    let va = env.kcm_attachment(&node, &env.name).await;
    let name = va.metadata.name.clone().unwrap();
    let done = env.wait_attached(&name).await;
    assert!(done.metadata.finalizers.unwrap().contains(&env.finalizer()));
    // KCM saw it attached.
    let unique = format!("kubernetes.io/csi/{}^vol-a", env.name);
    poll("node volumesAttached", || async {
        let n = nodes.get(&node).await.ok()?;
        let attached = n.status?.volumes_attached?;
        attached.iter().any(|a| a.name == unique).then_some(())
    })
    .await;
    assert_eq!(env.calls.count(Method::ControllerPublishVolume), 1);

    // The pod goes (no kubelet: at once); KCM detaches.
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.ns);
    pods.delete("app", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    env.wait_va_gone(&name).await;
    assert_eq!(env.calls.count(Method::ControllerUnpublishVolume), 1);
    drop(kcm);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_attach_and_detach_through_kcm_v1_36() {
    pod_attach_and_detach(KubeVersion::V1_36_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_attach_and_detach_through_kcm_v1_20() {
    pod_attach_and_detach(KubeVersion::V1_20_2).await;
}
