//! `csi-resizer`'s VolumeAttributesClass handling against a real kube-apiserver v1.36.2 and
//! KCM (VolumeAttributesClass v1), and its absence on v1.20.2: the modify items of the upstream
//! test checklist (success, a missing class, infeasible and roll-back, in progress with a
//! locked target, cancel).

mod common;

use common::*;
use plugreg_csi_test_driver::{Failure, Fault, Method};
use plugreg_testpeers::KubeVersion;
use tonic::Code;

fn current(c: &k8s_openapi::api::core::v1::PersistentVolumeClaim) -> Option<String> {
    c.status
        .as_ref()?
        .current_volume_attributes_class_name
        .clone()
}

fn modify_status(
    c: &k8s_openapi::api::core::v1::PersistentVolumeClaim,
) -> Option<(String, String)> {
    let m = c.status.as_ref()?.modify_volume_status.as_ref()?;
    Some((
        m.status.clone(),
        m.target_volume_attributes_class_name
            .clone()
            .unwrap_or_default(),
    ))
}

fn modify_env(faults: Option<Fault>) -> impl FnOnce(&mut plugreg_csi_test_driver::DriverConfig) {
    move |c| {
        c.controller_modify = true;
        if let Some(f) = faults {
            c.faults.insert(Method::ControllerModifyVolume, f);
        }
    }
}

#[tokio::test]
async fn a_new_class_is_applied_v1_36() {
    let env = Env::new(KubeVersion::V1_36_2, modify_env(None)).await;
    let gold = class(&env, "gold", &[("iops", "100")]).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let _resizer = env.resizer(&["--extra-modify-metadata"]);
    set_class(&env, "data", Some(&gold)).await;
    let pvc = env
        .wait_claim("data", "current class", |c| {
            current(c).as_deref() == Some(gold.as_str())
        })
        .await;
    assert_eq!(modify_status(&pvc), None);
    assert!(condition(&pvc, "ModifyingVolume").is_none(), "{pvc:?}");
    let reqs = env.calls.modify_requests();
    assert_eq!(reqs.len(), 1);
    let r = &reqs[0];
    assert_eq!(r.volume_id, "vol-0");
    let p = &r.mutable_parameters;
    assert_eq!(p.get("iops").map(String::as_str), Some("100"));
    assert_eq!(
        p.get("csi.storage.k8s.io/pvc/name").map(String::as_str),
        Some("data")
    );
    assert_eq!(p.get("csi.storage.k8s.io/pvc/namespace"), Some(&env.ns));
    assert_eq!(
        p.get("csi.storage.k8s.io/pv/name"),
        Some(&env.pv_name("data"))
    );
    let pv = env.volumes().get(&env.pv_name("data")).await.unwrap();
    assert_eq!(
        pv.spec.unwrap().volume_attributes_class_name,
        Some(gold.clone())
    );
    assert_eq!(
        env.wait_event("data", "VolumeModify").await,
        format!("external resizer is modifying volume data with vac {gold}")
    );
    assert_eq!(
        env.wait_event("data", "VolumeModifySuccessful").await,
        format!("external resizer modified volume data with vac {gold} successfully")
    );
}

#[tokio::test]
async fn a_missing_class_is_pending_until_it_exists_v1_36() {
    let env = Env::new(KubeVersion::V1_36_2, modify_env(None)).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let _resizer = env.resizer(&[]);
    let missing = format!("{}-missing", env.ns);
    set_class(&env, "data", Some(&missing)).await;
    let pvc = env
        .wait_claim("data", "Pending", |c| {
            modify_status(c).is_some_and(|(s, _)| s == "Pending")
        })
        .await;
    assert_eq!(current(&pvc), None);
    assert_eq!(
        env.wait_event("data", "VolumeModifyFailed").await,
        format!("VAC \"{missing}\" does not exist.")
    );
    assert_eq!(env.calls.count(Method::ControllerModifyVolume), 0);
    // Better than upstream (which waits for the claim's next change): the class appearing
    // brings the claim back.
    let created = class(&env, "missing", &[("iops", "7")]).await;
    assert_eq!(created, missing);
    env.wait_claim("data", "applied", |c| {
        current(c).as_deref() == Some(missing.as_str()) && modify_status(c).is_none()
    })
    .await;
    assert_eq!(env.calls.count(Method::ControllerModifyVolume), 1);
}

#[tokio::test]
async fn infeasible_then_rollback_to_the_current_class_v1_36() {
    let env = Env::new(KubeVersion::V1_36_2, modify_env(None)).await;
    let gold = class(&env, "gold", &[("iops", "100")]).await;
    let bad = class(&env, "bad", &[("invalid", "yes")]).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let _resizer = env.resizer(&["--retry-interval-start=100ms"]);
    set_class(&env, "data", Some(&gold)).await;
    env.wait_claim("data", "gold", |c| {
        current(c).as_deref() == Some(gold.as_str())
    })
    .await;
    set_class(&env, "data", Some(&bad)).await;
    let pvc = env
        .wait_claim("data", "Infeasible", |c| {
            modify_status(c).is_some_and(|(s, _)| s == "Infeasible")
        })
        .await;
    let err = condition(&pvc, "ModifyVolumeError").unwrap();
    assert_eq!(err.reason.as_deref(), Some("InvalidArgument"));
    assert_eq!(
        condition(&pvc, "ModifyingVolume")
            .unwrap()
            .message
            .as_deref(),
        Some(format!("Modifying volume to \"{bad}\" failed. Waiting for retry.").as_str())
    );
    // Roll back to the class the volume has (external-resizer #514): called at once.
    set_class(&env, "data", Some(&gold)).await;
    let pvc = env
        .wait_claim("data", "rolled back", |c| {
            modify_status(c).is_none() && current(c).as_deref() == Some(gold.as_str())
        })
        .await;
    assert!(condition(&pvc, "ModifyVolumeError").is_none(), "{pvc:?}");
    let last = env.calls.modify_requests().pop().unwrap();
    assert_eq!(
        last.mutable_parameters.get("iops").map(String::as_str),
        Some("100")
    );
    // The infeasible target was asked at most twice (the failure and one quick retry) within
    // --retry-interval-max.
    let bad_calls = env
        .calls
        .modify_requests()
        .iter()
        .filter(|r| r.mutable_parameters.contains_key("invalid"))
        .count();
    assert!((1..=2).contains(&bad_calls), "{bad_calls}");
}

#[tokio::test]
async fn in_progress_keeps_its_target_until_a_final_answer_v1_36() {
    let env = Env::new(
        KubeVersion::V1_36_2,
        modify_env(Some(Fault {
            error: Some(Failure::new(Code::Unavailable, "busy")),
            fail_first: Some(1),
            ..Fault::default()
        })),
    )
    .await;
    let silver = class(&env, "silver", &[("iops", "50")]).await;
    let gold = class(&env, "gold", &[("iops", "100")]).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    // The retry comes long after the failure, so the test certainly sees the modification in
    // progress; the class change below brings the claim back at once.
    let _resizer = env.resizer(&["--retry-interval-start=30s"]);
    set_class(&env, "data", Some(&silver)).await;
    let pvc = env
        .wait_claim("data", "still in progress", |c| {
            condition(c, "ModifyingVolume")
                .and_then(|x| x.message)
                .is_some_and(|m| m.contains("is still in progress."))
        })
        .await;
    assert_eq!(
        modify_status(&pvc),
        Some(("InProgress".into(), silver.clone()))
    );
    assert_eq!(
        condition(&pvc, "ModifyVolumeError")
            .unwrap()
            .reason
            .as_deref(),
        Some("Unavailable")
    );
    let event = env.wait_event("data", "VolumeModifyFailed").await;
    assert_eq!(
        event,
        format!("rpc error: code = Unavailable desc = busy. Still modifying to VAC {silver}")
    );
    // The user changes their mind: silver is still pursued first, then gold.
    set_class(&env, "data", Some(&gold)).await;
    env.wait_claim("data", "gold", |c| {
        current(c).as_deref() == Some(gold.as_str())
    })
    .await;
    let iops: Vec<String> = env
        .calls
        .modify_requests()
        .iter()
        .map(|r| r.mutable_parameters["iops"].clone())
        .collect();
    assert_eq!(iops, ["50", "50", "100"]);
}

#[tokio::test]
async fn no_volume_attributes_class_api_disables_modify_v1_20() {
    let env = Env::new(KubeVersion::V1_20_2, modify_env(None)).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let resizer = env.resizer(&[]);
    env.request("data", "2Gi").await;
    env.wait_claim("data", "capacity 2Gi", |c| {
        capacity(c).as_deref() == Some("2Gi")
    })
    .await;
    let log = resizer.log();
    assert!(
        log.contains("Disabling VolumeAttributesClass feature gate because the VolumeAttributesClass v1 API is not available"),
        "{log}"
    );
    assert!(
        !log.contains("Starting external resizer for modify volume"),
        "{log}"
    );
}

#[tokio::test]
async fn clearing_a_class_never_applied_cancels_v1_36() {
    let env = Env::new(KubeVersion::V1_36_2, modify_env(None)).await;
    let bad = class(&env, "bad", &[("invalid", "yes")]).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let _resizer = env.resizer(&[]);
    set_class(&env, "data", Some(&bad)).await;
    env.wait_claim("data", "Infeasible", |c| {
        modify_status(c).is_some_and(|(s, _)| s == "Infeasible")
    })
    .await;
    set_class(&env, "data", None).await;
    let pvc = env
        .wait_claim("data", "ModifyingVolume removed", |c| {
            condition(c, "ModifyingVolume").is_none()
        })
        .await;
    assert_eq!(current(&pvc), None);
    assert_eq!(
        env.wait_event("data", "VolumeModifyCanceled").await,
        "Cancelled modify."
    );
}

/// With the gate set explicitly the modify controller runs and waits for a class cache that
/// never fills (the server has no VolumeAttributesClass v1), as upstream's; resizing goes on.
#[tokio::test]
async fn an_explicit_gate_without_the_api_leaves_resizing_alone_v1_20() {
    let env = Env::new(KubeVersion::V1_20_2, modify_env(None)).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let resizer = env.resizer(&["--feature-gates=VolumeAttributesClass=true"]);
    env.request("data", "2Gi").await;
    env.wait_claim("data", "capacity 2Gi", |c| {
        capacity(c).as_deref() == Some("2Gi")
    })
    .await;
    let log = resizer.log();
    assert!(!log.contains("Disabling VolumeAttributesClass"), "{log}");
    assert!(
        log.contains("Starting external resizer for modify volume"),
        "{log}"
    );
    assert_eq!(env.calls.count(Method::ControllerModifyVolume), 0);
}
