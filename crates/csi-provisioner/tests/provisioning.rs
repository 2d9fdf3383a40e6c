//! `csi-provisioner` (the real binary) against a real kube-apiserver and a real
//! kube-controller-manager (v1.20.2 and v1.36.2), with the test CSI driver: a claim is done when
//! the API server says it is Bound (`docs/upstream/upstream-external-provisioner.md` §22 item 9).

mod common;

use std::time::Duration;

use common::{Env, WAIT, poll};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Secret};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use plugreg_csi_test_driver::{Failure, Fault, Method};
use plugreg_testpeers::KubeVersion;
use serde_json::json;
use tonic::Code;

const PV_FINALIZER: &str = "external-provisioner.volume.kubernetes.io/finalizer";
/// The claim annotation and finalizer of plugreg versions before the Lease record.
const INTENT: &str = "volume.plugreg.io/provisioning";

async fn lifecycle(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    let class = env
        .class("", json!({"reclaimPolicy": "Delete", "mountOptions": ["ro"], "parameters": {"type": "fast", "csi.storage.k8s.io/fstype": "xfs"}}))
        .await;
    let _p = env.provisioner(&[]);
    let claim = env.claim("data", &class, "1Gi", json!({})).await;
    let uid = claim.uid().unwrap();

    let bound = env.wait_bound("data").await;
    // The record held the volume until its PV was saved; nothing is written on the claim.
    env.wait_record_empty().await;
    assert!(!bound.annotations().contains_key(INTENT));
    assert!(!bound.finalizers().iter().any(|f| f == INTENT));
    let ann = bound.annotations();
    assert_eq!(
        ann.get("pv.kubernetes.io/bind-completed")
            .map(String::as_str),
        Some("yes")
    );
    let pv_name = format!("pvc-{uid}");
    assert_eq!(
        bound.spec.as_ref().unwrap().volume_name.as_deref(),
        Some(pv_name.as_str())
    );

    // The PV as upstream makes it.
    let pv = env.volumes().get(&pv_name).await.unwrap();
    assert_eq!(
        pv.annotations().get("pv.kubernetes.io/provisioned-by"),
        Some(&env.name)
    );
    assert_eq!(
        pv.annotations()
            .get("volume.kubernetes.io/provisioner-deletion-secret-name")
            .map(String::as_str),
        Some("")
    );
    assert!(
        pv.finalizers().iter().any(|f| f == PV_FINALIZER),
        "{:?}",
        pv.finalizers()
    );
    let spec = pv.spec.as_ref().unwrap();
    let csi = spec.csi.as_ref().unwrap();
    assert_eq!(csi.driver, env.name);
    assert_eq!(csi.fs_type.as_deref(), Some("xfs"));
    assert!(
        csi.volume_attributes
            .as_ref()
            .is_some_and(|a| a.contains_key("storage.kubernetes.io/csiProvisionerIdentity"))
    );
    assert_eq!(spec.mount_options.as_deref(), Some(&["ro".to_owned()][..]));
    assert_eq!(
        spec.claim_ref.as_ref().unwrap().uid.as_deref(),
        Some(uid.as_str())
    );

    // The request the driver got.
    let req = env.calls.create_requests().pop().unwrap();
    assert_eq!(req.name, pv_name);
    assert_eq!(req.capacity_range.unwrap().required_bytes, 1 << 30);
    assert_eq!(req.parameters.get("type").map(String::as_str), Some("fast"));
    assert!(!req.parameters.contains_key("csi.storage.k8s.io/fstype"));

    // Upstream's events on the claim.
    let msg = env
        .wait_event(&env.ns, "data", "ProvisioningSucceeded")
        .await;
    assert_eq!(msg, format!("Successfully provisioned volume {pv_name}"));
    let msg = env.wait_event(&env.ns, "data", "Provisioning").await;
    assert_eq!(
        msg,
        format!(
            "External provisioner is provisioning volume for claim \"{}/data\"",
            env.ns
        )
    );

    // Deleting the claim releases the PV; the provisioner deletes the volume and the PV.
    env.api::<PersistentVolumeClaim>()
        .delete("data", &DeleteParams::default())
        .await
        .unwrap();
    env.wait_pv_gone(&pv_name).await;
    let deletes = env.calls.delete_requests();
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert_eq!(deletes[0].volume_id, csi.volume_handle);
}

#[tokio::test]
async fn a_claim_is_provisioned_bound_and_deleted_v1_20_2() {
    lifecycle(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn a_claim_is_provisioned_bound_and_deleted_v1_36_2() {
    lifecycle(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn a_claim_of_another_provisioner_is_left_alone() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let classes: kube::Api<k8s_openapi::api::storage::v1::StorageClass> =
        kube::Api::all(env.client.clone());
    let other = format!("other-{}", env.name);
    classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": other}, "provisioner": "other.example.com"}),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    let mine = env.class("", json!({})).await;
    let _p = env.provisioner(&[]);
    env.claim("theirs", &other, "1Mi", json!({})).await;
    env.claim("mine", &mine, "1Mi", json!({})).await;
    env.wait_bound("mine").await;
    // The other claim got KCM's annotation (so the provisioner saw it) and stays Pending.
    let theirs = env
        .wait_claim("theirs", "KCM's storage-provisioner annotation", |c| {
            c.annotations()
                .contains_key("volume.beta.kubernetes.io/storage-provisioner")
        })
        .await;
    assert!(!theirs.annotations().contains_key(INTENT));
    assert_eq!(env.calls.count(Method::CreateVolume), 1);
}

#[tokio::test]
async fn wait_for_first_consumer_waits_for_the_selected_node() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env
        .class("", json!({"volumeBindingMode": "WaitForFirstConsumer"}))
        .await;
    let _p = env.provisioner(&[]);
    env.claim("later", &class, "1Mi", json!({})).await;
    // KCM says it waits for a consumer; no CreateVolume happens.
    env.wait_event(&env.ns, "later", "WaitForFirstConsumer")
        .await;
    assert_eq!(env.calls.count(Method::CreateVolume), 0);
    // The scheduler's selected-node annotation (no scheduler here: the test sets it).
    let patch =
        json!({"metadata": {"annotations": {"volume.kubernetes.io/selected-node": "node-1"}}});
    env.api::<PersistentVolumeClaim>()
        .patch(
            "later",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    env.wait_bound("later").await;
}

#[tokio::test]
async fn transient_errors_are_retried_and_final_ones_reported() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::CreateVolume,
            Fault {
                error: Some(Failure::new(Code::Unavailable, "try later")),
                fail_first: Some(2),
                ..Fault::default()
            },
        );
    })
    .await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim("flaky", &class, "1Mi", json!({})).await;
    env.wait_bound("flaky").await;
    assert_eq!(env.calls.count(Method::CreateVolume), 3);
    let msg = env.wait_event(&env.ns, "flaky", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": rpc error: code = Unavailable desc = try later"
        )
    );
}

#[tokio::test]
async fn an_invalid_argument_is_infeasible_and_delayed() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::CreateVolume,
            Fault {
                error: Some(Failure::new(Code::InvalidArgument, "no such type")),
                ..Fault::default()
            },
        );
    })
    .await;
    let class = env.class("", json!({})).await;
    let p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim("bad", &class, "1Mi", json!({})).await;
    let msg = env.wait_event(&env.ns, "bad", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "Volume provisioning failed with infeasible error. Retries will be delayed. failed to provision volume with StorageClass \"{class}\": rpc error: code = InvalidArgument desc = no such type"
        )
    );
    // A final answer: the volume leaves the record, nothing runs in the driver.
    env.wait_record_empty().await;
    // The slow set keeps it from being retried at the 100 ms back-off: two retries that
    // skipped it, and still one CreateVolume.
    let uid = env
        .api::<PersistentVolumeClaim>()
        .get("bad")
        .await
        .unwrap()
        .uid()
        .unwrap();
    p.wait_log_lines(
        &[&format!("skipping volume provisioning for pvc {uid}, because provisioning previously failed with infeasible error")],
        2,
    )
    .await;
    assert_eq!(env.calls.count(Method::CreateVolume), 1);
}

#[tokio::test]
async fn malformed_class_parameters_and_secrets_get_an_event_not_a_crash() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let bad_key = env
        .class(
            "-badkey",
            json!({"parameters": {"csi.storage.k8s.io/bogus": "x"}}),
        )
        .await;
    let half_secret = env
        .class(
            "-halfsecret",
            json!({"parameters": {"csi.storage.k8s.io/provisioner-secret-name": "s"}}),
        )
        .await;
    let bad_template = env
        .class(
            "-badtemplate",
            json!({"parameters": {
                "csi.storage.k8s.io/provisioner-secret-name": "${pvc.nope}",
                "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}"}}),
        )
        .await;
    let mut p = env.provisioner(&["--retry-interval-start=200ms"]);
    env.claim("a", &bad_key, "1Mi", json!({})).await;
    env.claim("b", &half_secret, "1Mi", json!({})).await;
    env.claim("c", &bad_template, "1Mi", json!({})).await;
    assert_eq!(
        env.wait_event(&env.ns, "a", "ProvisioningFailed").await,
        format!(
            "failed to provision volume with StorageClass \"{bad_key}\": failed to strip CSI Parameters of prefixed keys: found unknown parameter key \"csi.storage.k8s.io/bogus\" with reserved namespace csi.storage.k8s.io/"
        )
    );
    assert_eq!(
        env.wait_event(&env.ns, "b", "ProvisioningFailed").await,
        format!(
            "failed to provision volume with StorageClass \"{half_secret}\": failed to get name and namespace template from params: either name and namespace for Provisioner secrets specified, Both must be specified"
        )
    );
    let c = env.wait_event(&env.ns, "c", "ProvisioningFailed").await;
    assert!(c.contains("invalid tokens"), "{c}");
    assert!(p.running(), "the provisioner survived: {}", p.log());
    assert_eq!(
        env.calls.count(Method::CreateVolume),
        0,
        "{:?}\n{}",
        env.calls.create_requests(),
        p.log()
    );
}

#[tokio::test]
async fn the_provisioner_secret_is_resolved_from_its_templates_and_passed() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let secrets = env.api::<Secret>();
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "creds-data"}, "stringData": {"token": "s3cr3t"}}),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    let class = env
        .class(
            "",
            json!({"parameters": {
                "csi.storage.k8s.io/provisioner-secret-name": "creds-${pvc.name}",
                "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}",
                "csi.storage.k8s.io/node-stage-secret-name": "stage",
                "csi.storage.k8s.io/node-stage-secret-namespace": "${pvc.namespace}"}}),
        )
        .await;
    let _p = env.provisioner(&[]);
    let claim = env.claim("data", &class, "1Mi", json!({})).await;
    env.wait_bound("data").await;
    let req = env.calls.create_requests().pop().unwrap();
    assert_eq!(req.secrets.get("token").map(String::as_str), Some("s3cr3t"));
    let pv = env
        .volumes()
        .get(&format!("pvc-{}", claim.uid().unwrap()))
        .await
        .unwrap();
    let ann = pv.annotations();
    assert_eq!(
        ann.get("volume.kubernetes.io/provisioner-deletion-secret-name"),
        Some(&"creds-data".to_owned())
    );
    assert_eq!(
        ann.get("volume.kubernetes.io/provisioner-deletion-secret-namespace"),
        Some(&env.ns)
    );
    let stage = pv.spec.unwrap().csi.unwrap().node_stage_secret_ref.unwrap();
    assert_eq!(stage.name.as_deref(), Some("stage"));
    assert_eq!(stage.namespace.as_deref(), Some(env.ns.as_str()));
    // Deletion passes the same secret.
    env.api::<PersistentVolumeClaim>()
        .delete("data", &DeleteParams::default())
        .await
        .unwrap();
    env.wait_pv_gone(&pv.metadata.name.unwrap()).await;
    let del = env.calls.delete_requests().pop().unwrap();
    assert_eq!(del.secrets.get("token").map(String::as_str), Some("s3cr3t"));
}

/// Provisioner spec §12 step 4 (and migration checklist 20's non-migrated half): a PV without
/// the deletion-secret annotations (one an older provisioner made) is deleted with the
/// provisioner secret its StorageClass names, resolved again with its claim's name and
/// namespace; when the class is gone, without secrets (with upstream's warning).
#[tokio::test]
async fn a_pv_without_deletion_secret_annotations_is_deleted_with_its_class_secret() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    for claim in ["old", "orphan"] {
        env.api::<Secret>()
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": format!("creds-{claim}")},
                    "stringData": {"token": format!("t-{claim}")}}))
                .unwrap(),
            )
            .await
            .unwrap();
    }
    let params = json!({"parameters": {
        "csi.storage.k8s.io/provisioner-secret-name": "creds-${pvc.name}",
        "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}"}});
    let kept = env.class("kept", params.clone()).await;
    let gone = env.class("gone", params).await;
    let p = env.provisioner(&[]);
    let mut pvs = Vec::new();
    for (claim, class) in [("old", &kept), ("orphan", &gone)] {
        let c = env.claim(claim, class, "1Mi", json!({})).await;
        env.wait_bound(claim).await;
        let pv = format!("pvc-{}", c.uid().unwrap());
        // As an older provisioner left it: no deletion-secret annotations.
        env.volumes()
            .patch(
                &pv,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {
                    "volume.kubernetes.io/provisioner-deletion-secret-name": null,
                    "volume.kubernetes.io/provisioner-deletion-secret-namespace": null}}})),
            )
            .await
            .unwrap();
        let handle = env
            .volumes()
            .get(&pv)
            .await
            .unwrap()
            .spec
            .unwrap()
            .csi
            .unwrap()
            .volume_handle;
        pvs.push((pv, handle));
    }
    kube::Api::<StorageClass>::all(env.client.clone())
        .delete(&gone, &DeleteParams::default())
        .await
        .unwrap();
    for (claim, (pv, _)) in ["old", "orphan"].iter().zip(&pvs) {
        env.api::<PersistentVolumeClaim>()
            .delete(claim, &DeleteParams::default())
            .await
            .unwrap();
        env.wait_pv_gone(pv).await;
    }
    let deletes = env.calls.delete_requests();
    let token = |handle: &str| {
        deletes
            .iter()
            .find(|d| d.volume_id == handle)
            .map(|d| d.secrets.get("token").cloned())
    };
    assert_eq!(
        token(&pvs[0].1),
        Some(Some("t-old".to_owned())),
        "{}",
        p.log()
    );
    assert_eq!(token(&pvs[1].1), Some(None), "{}", p.log());
    assert!(
        p.log().contains(&format!(
            "failed to get storageclass: {gone}, proceeding to delete without secrets"
        )),
        "{}",
        p.log()
    );
}

/// P3: SIGKILL while CreateVolume runs; the record holds the volume; a new provisioner
/// finishes the volume into a PV and the claim is Bound, with one volume in the driver.
async fn restart_in_create_volume(version: KubeVersion) {
    let env = Env::new(version, hang_first_create).await;
    let class = env.class("", json!({})).await;
    let mut first = env.provisioner(&[]);
    let claim = env.claim("data", &class, "1Mi", json!({})).await;
    let volume = Env::volume_name_of(&claim.uid().unwrap());
    env.calls.wait_for(Method::CreateVolume, 1).await;
    // Recorded before the driver heard of it.
    assert!(env.record().await.contains(&volume));
    first.kill();
    let _second = env.provisioner(&[]);
    let bound = env.wait_bound("data").await;
    assert_eq!(
        bound.spec.unwrap().volume_name.as_deref(),
        Some(volume.as_str())
    );
    env.wait_record_empty().await;
    assert!(
        !bound
            .metadata
            .annotations
            .unwrap_or_default()
            .contains_key(INTENT)
    );
    // Same name both times: the driver made one volume.
    let names: Vec<String> = env
        .calls
        .create_requests()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(names, [volume.clone(), volume]);
}

#[tokio::test]
async fn a_restart_in_the_middle_of_create_volume_finishes_the_volume_v1_20_2() {
    restart_in_create_volume(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn a_restart_in_the_middle_of_create_volume_finishes_the_volume_v1_36_2() {
    restart_in_create_volume(KubeVersion::V1_36_2).await;
}

/// The first CreateVolume never answers (until the provisioner is killed).
fn hang_first_create(c: &mut plugreg_csi_test_driver::DriverConfig) {
    c.faults.insert(
        Method::CreateVolume,
        Fault {
            delay: Some(Duration::from_secs(3600)),
            delay_first: Some(1),
            ..Fault::default()
        },
    );
}

/// P3, the harder case: the claim is deleted while the provisioner is down. The record names
/// the volume; the new provisioner repeats the recorded CreateVolume to learn the volume's ID
/// and deletes it: nothing leaks, and no PV is made for a claim that is gone.
async fn claim_deleted_while_down(version: KubeVersion) {
    let env = Env::new(version, hang_first_create).await;
    let class = env.class("", json!({"reclaimPolicy": "Delete"})).await;
    let mut first = env.provisioner(&[]);
    let claim = env.claim("data", &class, "1Mi", json!({})).await;
    let volume = Env::volume_name_of(&claim.uid().unwrap());
    env.calls.wait_for(Method::CreateVolume, 1).await;
    assert!(env.record().await.contains(&volume));
    first.kill();
    env.api::<PersistentVolumeClaim>()
        .delete("data", &DeleteParams::default())
        .await
        .unwrap();
    let api = env.api::<PersistentVolumeClaim>();
    poll("claim gone", || async {
        matches!(api.get_opt("data").await, Ok(None)).then_some(())
    })
    .await;
    let _second = env.provisioner(&[]);
    // The volume CreateVolume made was deleted again.
    poll("DeleteVolume", || async {
        (!env.calls.delete_requests().is_empty()).then_some(())
    })
    .await;
    env.wait_record_empty().await;
    let creates = env.calls.create_requests();
    assert_eq!(creates.len(), 2);
    assert!(creates.iter().all(|r| r.name == volume));
    assert_eq!(env.calls.delete_requests().len(), 1);
    assert!(env.volumes().get_opt(&volume).await.unwrap().is_none());
    env.wait_event(&env.ns, "data", "ProvisioningCancelled")
        .await;
}

#[tokio::test]
async fn a_claim_deleted_while_the_provisioner_is_down_leaks_nothing_v1_20_2() {
    claim_deleted_while_down(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn a_claim_deleted_while_the_provisioner_is_down_leaks_nothing_v1_36_2() {
    claim_deleted_while_down(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn a_standby_takes_over_when_the_leader_is_killed() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env.class("", json!({})).await;
    let le = [
        "--leader-election",
        &format!("--leader-election-namespace={}", env.ns),
        "--leader-election-lease-duration=3s",
        "--leader-election-renew-deadline=2s",
        "--leader-election-retry-period=500ms",
    ];
    let mut a = env.provisioner_on("replica-a", &le);
    env.claim("one", &class, "1Mi", json!({})).await;
    env.wait_bound("one").await;
    let mut b = env.provisioner_on("replica-b", &le);
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = env.api();
    let lease_name = env.name.replace('.', "-");
    let holder = |l: &k8s_openapi::api::coordination::v1::Lease| {
        l.spec
            .as_ref()
            .and_then(|s| s.holder_identity.clone())
            .unwrap_or_default()
    };
    let first = holder(&leases.get(&lease_name).await.unwrap());
    assert_eq!(first, "replica-a");
    a.kill();
    let killed = tokio::time::Instant::now();
    let second = poll("a new holder", || async {
        let l = leases.get(&lease_name).await.ok()?;
        let h = holder(&l);
        (h != first && !h.is_empty()).then_some(h)
    })
    .await;
    assert_eq!(second, "replica-b");
    assert!(killed.elapsed() < WAIT);
    env.claim("two", &class, "1Mi", json!({})).await;
    env.wait_bound("two").await;
    assert!(b.running(), "{}", b.log());
}

// --- Issue 16: no leaks, no lost lease, retries with back-off ---

/// A CreateVolume that timed out may have created the volume: a later definite error (here
/// INTERNAL) does not drop it from the record, so when the claim is deleted the volume is
/// still deleted (before, the intent was cleared on the final error and the volume leaked).
async fn timeout_then_final_error(version: KubeVersion) {
    let env = Env::new(version, |c| {
        c.faults.insert(
            Method::CreateVolume,
            Fault {
                delay: Some(Duration::from_secs(3)),
                delay_first: Some(1),
                error: Some(Failure::new(Code::Internal, "disk on fire")),
                fail_first: Some(3),
                ..Fault::default()
            },
        );
    })
    .await;
    let class = env.class("", json!({"reclaimPolicy": "Delete"})).await;
    let _p = env.provisioner(&["--timeout=1s", "--retry-interval-start=2s"]);
    let claim = env.claim("data", &class, "1Mi", json!({})).await;
    let volume = Env::volume_name_of(&claim.uid().unwrap());
    // The timeout, then the INTERNAL answer to the retry.
    env.calls.wait_for(Method::CreateVolume, 2).await;
    env.wait_event(&env.ns, "data", "ProvisioningFailed").await;
    poll("the INTERNAL answer", || async {
        env.event_messages(&env.ns, "data", "ProvisioningFailed")
            .await
            .iter()
            .any(|m| m.contains("disk on fire"))
            .then_some(())
    })
    .await;
    assert!(
        env.record().await.contains(&volume),
        "dropped after a final error"
    );
    env.api::<PersistentVolumeClaim>()
        .delete("data", &DeleteParams::default())
        .await
        .unwrap();
    poll("DeleteVolume", || async {
        (!env.calls.delete_requests().is_empty()).then_some(())
    })
    .await;
    env.wait_record_empty().await;
    assert!(env.calls.create_requests().iter().all(|r| r.name == volume));
    assert!(env.volumes().get_opt(&volume).await.unwrap().is_none());
}

#[tokio::test]
async fn a_final_error_after_a_timeout_keeps_the_volume_until_it_is_deleted_v1_20_2() {
    timeout_then_final_error(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn a_final_error_after_a_timeout_keeps_the_volume_until_it_is_deleted_v1_36_2() {
    timeout_then_final_error(KubeVersion::V1_36_2).await;
}

/// A restart with another `--volume-name-prefix` between a CreateVolume that may have run and
/// its retry: the recorded name wins, so the driver makes one volume, not two.
async fn recorded_name_wins(version: KubeVersion) {
    let env = Env::new(version, hang_first_create).await;
    let class = env.class("", json!({})).await;
    let mut first = env.provisioner(&[]);
    let claim = env.claim("data", &class, "1Mi", json!({})).await;
    let volume = Env::volume_name_of(&claim.uid().unwrap());
    env.calls.wait_for(Method::CreateVolume, 1).await;
    first.kill();
    let _second = env.provisioner(&["--volume-name-prefix=renamed"]);
    let bound = env.wait_bound("data").await;
    assert_eq!(
        bound.spec.unwrap().volume_name.as_deref(),
        Some(volume.as_str())
    );
    let names: Vec<String> = env
        .calls
        .create_requests()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(names, [volume.clone(), volume]);
    env.wait_record_empty().await;
}

#[tokio::test]
async fn the_recorded_name_wins_over_a_changed_prefix_v1_20_2() {
    recorded_name_wins(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn the_recorded_name_wins_over_a_changed_prefix_v1_36_2() {
    recorded_name_wins(KubeVersion::V1_36_2).await;
}

/// An upgrade from a plugreg that wrote its intent on the claim (annotation and finalizer
/// `volume.plugreg.io/provisioning`): a live claim is finished under the intent's name and
/// released. Two deleted claims are released too (they used to hang forever, and with them
/// their namespace), each volume finished with the recorded name and deleted, and an event
/// says so: one whose StorageClass is gone (the annotation still names the driver), one whose
/// provisioner annotation was changed to another name (the class still names the driver).
///
/// Every other test's provisioner watches these claims too and must leave them alone: the
/// intent's key is the same for every plugreg driver, and a provisioner that took another
/// driver's intent sent its CreateVolume to the wrong driver (seen in CI as a stray
/// CreateVolume in a concurrent test).
async fn old_intents(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    let class = env.class("", json!({"reclaimPolicy": "Delete"})).await;
    let doomed_class = env.class("-doomed", json!({})).await;
    let intent = |name: &str| {
        json!({"metadata": {
            "annotations": {INTENT: name},
            "finalizers": [INTENT],
        }})
    };
    let live_name = format!("legacy-{}-live", env.ns);
    let gone_name = format!("legacy-{}-gone", env.ns);
    let moved_name = format!("legacy-{}-moved", env.ns);
    env.claim("live", &class, "1Mi", intent(&live_name)).await;
    env.claim("gone", &doomed_class, "1Mi", intent(&gone_name))
        .await;
    env.claim("moved", &class, "1Mi", intent(&moved_name)).await;
    // What KCM writes on a claim of an external provisioner's class, set here so that the
    // class's deletion cannot win the race against it.
    env.patch_claim(
        "gone",
        json!({"metadata": {"annotations": {"volume.kubernetes.io/storage-provisioner": env.name}}}),
    )
    .await;
    env.patch_claim(
        "moved",
        json!({"metadata": {"annotations": {"volume.kubernetes.io/storage-provisioner": "someone-else"}}}),
    )
    .await;
    let classes: kube::Api<k8s_openapi::api::storage::v1::StorageClass> =
        kube::Api::all(env.client.clone());
    classes
        .delete(&doomed_class, &DeleteParams::default())
        .await
        .unwrap();
    let api = env.api::<PersistentVolumeClaim>();
    for name in ["gone", "moved"] {
        api.delete(name, &DeleteParams::default()).await.unwrap();
    }
    let _p = env.provisioner(&[]);

    let live = env.wait_bound("live").await;
    assert_eq!(
        live.spec.as_ref().unwrap().volume_name.as_deref(),
        Some(live_name.as_str())
    );
    env.wait_claim("live", "old intent released", |c| {
        !c.annotations().contains_key(INTENT) && !c.finalizers().iter().any(|f| f == INTENT)
    })
    .await;

    // The test driver's ids are not the names: two DeleteVolumes for the two intents.
    poll("DeleteVolume of both old intents' volumes", || async {
        (env.calls.delete_requests().len() >= 2).then_some(())
    })
    .await;
    for (claim, volume) in [("gone", &gone_name), ("moved", &moved_name)] {
        poll("deleted claim released", || async {
            matches!(api.get_opt(claim).await, Ok(None)).then_some(())
        })
        .await;
        assert!(
            env.calls
                .create_requests()
                .iter()
                .any(|r| &r.name == volume)
        );
        let msg = env
            .wait_event(&env.ns, claim, "ProvisioningCancelled")
            .await;
        assert!(msg.contains(volume.as_str()), "{msg}");
        assert!(env.volumes().get_opt(volume).await.unwrap().is_none());
    }
    // Only this test's intents reached this test's driver.
    for r in env.calls.create_requests() {
        assert!(r.name.contains(&env.ns), "{}", r.name);
    }
    env.wait_record_empty().await;
}

#[tokio::test]
async fn an_upgrade_finishes_and_releases_claims_with_an_old_intent_v1_20_2() {
    old_intents(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn an_upgrade_finishes_and_releases_claims_with_an_old_intent_v1_36_2() {
    old_intents(KubeVersion::V1_36_2).await;
}

/// A volume that cannot be recorded (the record's namespace does not exist yet) is never
/// created: its claim goes back through the work queue's rate-limited back-off (the log counts
/// the failures), and is provisioned once the record can be written.
#[tokio::test]
async fn a_volume_that_cannot_be_recorded_is_not_created_and_retried_with_back_off() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env.class("", json!({})).await;
    let later = format!("{}-later", env.ns);
    let p = env.provisioner(&[
        &format!("--leader-election-namespace={later}"),
        "--retry-interval-start=100ms",
        "--retry-interval-max=1s",
    ]);
    env.claim("data", &class, "1Mi", json!({})).await;
    p.wait_log_lines(&["Retrying syncing claim", "failures=3"], 1)
        .await;
    assert_eq!(env.calls.count(Method::CreateVolume), 0);
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> =
        kube::Api::all(env.client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": later}})).unwrap(),
        )
        .await
        .unwrap();
    env.wait_bound("data").await;
    assert_eq!(env.calls.count(Method::CreateVolume), 1);
    poll("record empty", || async {
        env.record_in(&later).await.is_empty().then_some(())
    })
    .await;
}

/// Upstream's defaults (QPS 5, burst 10) with leader election and 500 claims at once: the
/// Lease is renewed on its own client, so it is never lost while the work queues behind the
/// rate limit, and every claim is Bound (before, the Lease was lost after about 25 s).
#[tokio::test]
async fn the_lease_is_kept_while_500_claims_wait_for_the_rate_limit() {
    const N: usize = 500;
    // Its own cluster: 500 claims would hold up the binding of the other tests' claims.
    let env = Env::isolated(KubeVersion::V1_36_2, |_| {}).await;
    let class = env.class("", json!({})).await;
    let ns_flag = format!("--leader-election-namespace={}", env.ns);
    let mut p = env.provisioner(&["--leader-election", &ns_flag]);
    p.wait_log_line("successfully acquired lease").await;
    let claims = futures::stream::iter(0..N)
        .map(|i| {
            let env = &env;
            let class = &class;
            async move { env.claim(&format!("c{i}"), class, "1Mi", json!({})).await }
        })
        .buffer_unordered(16)
        .count()
        .await;
    assert_eq!(claims, N);
    let api = env.api::<PersistentVolumeClaim>();
    // The write floor is N / 5 s; KCM binds behind it. Polled every 2 s, for at most 10 min.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    loop {
        let bound = api
            .list(&Default::default())
            .await
            .map(|l| {
                l.items
                    .iter()
                    .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
                    .count()
            })
            .unwrap_or(0);
        if bound == N {
            break;
        }
        assert!(p.running(), "the provisioner exited:\n{}", tail(&p.log()));
        assert!(
            tokio::time::Instant::now() < deadline,
            "{bound} of {N} claims Bound after 10 minutes"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    assert!(p.running(), "{}", tail(&p.log()));
    let log = p.log();
    assert!(!log.contains("Stopped leading"), "{}", tail(&log));
    assert!(!log.contains("failed to renew"), "{}", tail(&log));
    assert_eq!(log.matches("successfully acquired lease").count(), 1);
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
