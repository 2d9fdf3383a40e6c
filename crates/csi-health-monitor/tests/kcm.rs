//! Claims bound by the real kube-controller-manager's PV controller (v1.36.2 and v1.20.2), not
//! by hand: a CSI PV and a claim that asks for it are bound after the monitor started, and the
//! monitor follows them on both check paths.

mod common;

use common::{DRIVER, Env, NS, driver_config};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, PostParams};
use plugreg_csi_test_driver::Method;
use plugreg_testpeers::{ControllerManager, KubeVersion};
use serde_json::json;

/// An available CSI PV of the driver with `handle` and a claim `claim` that asks for it by
/// name: the PV controller binds them.
async fn claim_for_kcm(env: &Env, claim: &str, handle: &str) {
    let pvs: Api<PersistentVolume> = Api::all(env.client.clone());
    pvs.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": format!("pv-{claim}")},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "csi": {"driver": DRIVER, "volumeHandle": handle},
            }
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(env.client.clone(), NS);
    pvcs.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": claim},
            "spec": {"accessModes": ["ReadWriteOnce"], "volumeName": format!("pv-{claim}"),
                     "storageClassName": "",
                     "resources": {"requests": {"storage": "1Gi"}}},
        }))
        .unwrap(),
    )
    .await
    .unwrap();
}

async fn claims_bound_by_kcm_are_monitored(version: KubeVersion, list: bool) {
    let env = Env::new(version, driver_config(&["vol-a"], list)).await;
    let _kcm = ControllerManager::start_volume_controllers(&env.api, &[])
        .await
        .expect("kube-controller-manager");
    env.driver.set_condition("vol-a", Some("bad sectors"));
    let _m = env.monitor(&["--list-volumes-interval=300ms", "--monitor-interval=300ms"]);
    // The monitor is up before the claim is bound.
    let method = if list {
        Method::ListVolumes
    } else {
        Method::ControllerGetCapabilities
    };
    env.poll("the monitor started", || async {
        (env.calls.count(method) >= 1).then_some(())
    })
    .await;
    claim_for_kcm(&env, "a", "vol-a").await;
    env.wait_event("a", "VolumeConditionAbnormal", "bad sectors", 1)
        .await;
    env.driver.set_condition("vol-a", None);
    env.wait_event(
        "a",
        "VolumeConditionNormal",
        "The Volume returns to the healthy state",
        1,
    )
    .await;
}

/// v1.36.2, ListVolumes path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_36_claims_bound_by_kcm_are_monitored_through_list_volumes() {
    claims_bound_by_kcm_are_monitored(KubeVersion::V1_36_2, true).await;
}

/// v1.20.2, ControllerGetVolume path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_20_claims_bound_by_kcm_are_monitored_through_get_volume() {
    claims_bound_by_kcm_are_monitored(KubeVersion::V1_20_2, false).await;
}
