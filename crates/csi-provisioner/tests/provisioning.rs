//! `csi-provisioner` (the real binary) against a real kube-apiserver and a real
//! kube-controller-manager (v1.20.2 and v1.36.2), with the test CSI driver: a claim is done when
//! the API server says it is Bound (`upstream-external-provisioner.md` §22 item 9).

mod common;

use std::time::Duration;

use common::{Env, WAIT, poll};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Secret};
use kube::ResourceExt;
use kube::api::{DeleteParams, PostParams};
use plugreg_csi_test_driver::{Failure, Fault, Method};
use plugreg_testpeers::KubeVersion;
use serde_json::json;
use tonic::Code;

const PV_FINALIZER: &str = "external-provisioner.volume.kubernetes.io/finalizer";
const INTENT: &str = "volume.plugreg.io/provisioning";

async fn lifecycle(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    let class = env
        .class("", json!({"reclaimPolicy": "Delete", "mountOptions": ["ro"], "parameters": {"type": "fast", "csi.storage.k8s.io/fstype": "xfs"}}))
        .await;
    let _p = env.provisioner(&[]);
    let claim = env.claim("data", &class, "1Gi", json!({})).await;
    let uid = claim.uid().unwrap();

    env.wait_bound("data").await;
    // The intent goes once KCM has bound the claim.
    let bound = env
        .wait_claim("data", "intent cleared", |c| {
            !c.annotations().contains_key(INTENT) && !c.finalizers().iter().any(|f| f == INTENT)
        })
        .await;
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
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim("bad", &class, "1Mi", json!({})).await;
    let msg = env.wait_event(&env.ns, "bad", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "Volume provisioning failed with infeasible error. Retries will be delayed. failed to provision volume with StorageClass \"{class}\": rpc error: code = InvalidArgument desc = no such type"
        )
    );
    // A final answer: the intent is cleared, nothing runs in the driver.
    env.wait_claim("bad", "intent cleared", |c| {
        !c.annotations().contains_key(INTENT) && !c.finalizers().iter().any(|f| f == INTENT)
    })
    .await;
    // The slow set keeps it from being retried at the 100 ms back-off.
    tokio::time::sleep(Duration::from_secs(2)).await;
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
    assert_eq!(env.calls.count(Method::CreateVolume), 0);
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

/// P3: SIGKILL while CreateVolume runs; the claim carries the intent; a new provisioner
/// finishes the volume into a PV and the claim is Bound, with one volume in the driver.
#[tokio::test]
async fn a_restart_in_the_middle_of_create_volume_finishes_the_volume() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::CreateVolume,
            Fault {
                delay: Some(Duration::from_secs(3600)),
                delay_first: Some(1),
                ..Fault::default()
            },
        );
    })
    .await;
    let class = env.class("", json!({})).await;
    let mut first = env.provisioner(&[]);
    env.claim("data", &class, "1Mi", json!({})).await;
    env.calls.wait_for(Method::CreateVolume, 1).await;
    let c = env
        .wait_claim("data", "intent recorded", |c| {
            c.annotations().contains_key(INTENT)
        })
        .await;
    assert!(
        c.finalizers().iter().any(|f| f == INTENT),
        "{:?}",
        c.finalizers()
    );
    first.kill();
    let _second = env.provisioner(&[]);
    env.wait_bound("data").await;
    let c = env
        .wait_claim("data", "intent cleared", |c| {
            !c.annotations().contains_key(INTENT)
        })
        .await;
    assert!(!c.finalizers().iter().any(|f| f == INTENT));
    // Same name both times: the driver made one volume.
    let names: Vec<String> = env
        .calls
        .create_requests()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(names.len(), 2);
    assert_eq!(names[0], names[1]);
}

/// P3, the harder case: the claim is deleted while the provisioner is down. The intent's
/// finalizer keeps the claim; the new provisioner finishes the volume into a PV, the claim
/// goes, and the PV and the volume are deleted: nothing leaks.
#[tokio::test]
async fn a_claim_deleted_while_the_provisioner_is_down_leaks_nothing() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::CreateVolume,
            Fault {
                delay: Some(Duration::from_secs(3600)),
                delay_first: Some(1),
                ..Fault::default()
            },
        );
    })
    .await;
    let class = env.class("", json!({"reclaimPolicy": "Delete"})).await;
    let mut first = env.provisioner(&[]);
    env.claim("data", &class, "1Mi", json!({})).await;
    env.calls.wait_for(Method::CreateVolume, 1).await;
    env.wait_claim("data", "intent recorded", |c| {
        c.annotations().contains_key(INTENT)
    })
    .await;
    first.kill();
    env.api::<PersistentVolumeClaim>()
        .delete("data", &DeleteParams::default())
        .await
        .unwrap();
    let _second = env.provisioner(&[]);
    let api = env.api::<PersistentVolumeClaim>();
    poll("claim gone", || async {
        matches!(api.get_opt("data").await, Ok(None)).then_some(())
    })
    .await;
    // The volume CreateVolume made was deleted again.
    poll("DeleteVolume", || async {
        (!env.calls.delete_requests().is_empty()).then_some(())
    })
    .await;
    let name = env.calls.create_requests()[0].name.clone();
    env.wait_pv_gone(&name).await;
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
