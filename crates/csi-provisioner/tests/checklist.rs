//! The rest of the spec's test checklist (`docs/upstream/upstream-external-provisioner.md` §22 items 3-9 with
//! §8, §9, §11, §12, §17): topology, rescheduling, the PV's shape, deletion, unsupported
//! claims and metrics, each with the real `csi-provisioner` binary against a real
//! kube-apiserver and kube-controller-manager and the test CSI driver.
//!
//! There is no kubelet or scheduler: where they would write Nodes, CSINodes, the
//! selected-node annotation or VolumeAttachments, the test writes them through the API.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{Env, free_local_addr, http_get, poll};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use plugreg_csi_test_driver::{DriverConfig, Failure, Fault, Method};
use plugreg_proto::csi::v1::{CreateVolumeRequest, Topology, volume_capability};
use plugreg_testpeers::KubeVersion;
use serde_json::json;
use tonic::Code;

const PV_FINALIZER: &str = "external-provisioner.volume.kubernetes.io/finalizer";
/// The claim annotation and finalizer of plugreg versions before the Lease record.
const INTENT: &str = "volume.plugreg.io/provisioning";
const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";

/// The topology key of a test's driver: unique to the test, so the Nodes other tests create
/// in the shared cluster never match.
fn zone_key(driver: &str) -> String {
    format!("{driver}/zone")
}

/// A driver that reports VOLUME_ACCESSIBILITY_CONSTRAINTS and serves zone `zone`.
fn topology_driver(zone: &'static str) -> impl FnOnce(&mut DriverConfig) {
    move |c| {
        c.accessibility_constraints = true;
        c.topology = BTreeMap::from([(zone_key(&c.name), zone.to_owned())]);
    }
}

/// Nodes `<ns>-a` in zone z1 and `<ns>-b` in zone z2, with CSINodes for the test's driver.
async fn two_zones(env: &Env) -> (String, String) {
    let key = zone_key(&env.name);
    let a = format!("{}-a", env.ns);
    let b = format!("{}-b", env.ns);
    env.topology_node(&a, &[(&key, "z1")], &[&key]).await;
    env.topology_node(&b, &[(&key, "z2")], &[&key]).await;
    (a, b)
}

fn terms(list: &[Topology]) -> Vec<BTreeMap<String, String>> {
    list.iter()
        .map(|t| t.segments.clone().into_iter().collect())
        .collect()
}

fn zone(env: &Env, z: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(zone_key(&env.name), z.to_owned())])
}

/// The one CreateVolume request the driver got.
fn only_request(env: &Env) -> CreateVolumeRequest {
    let mut r = env.calls.create_requests();
    assert_eq!(r.len(), 1, "{r:?}");
    r.pop().unwrap()
}

/// The PV of a bound claim.
async fn bound_volume(env: &Env, claim: &str) -> PersistentVolume {
    let c = env.wait_bound(claim).await;
    let name = c.spec.unwrap().volume_name.unwrap();
    env.volumes().get(&name).await.unwrap()
}

/// 32-bit FNV-1 (multiply, then xor), the hash upstream rotates preferred terms with.
fn fnv1_32(data: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in data {
        h = h.wrapping_mul(0x0100_0193);
        h ^= u32::from(*b);
    }
    h
}

// --- Topology (§8) ---

/// Immediate binding with `--immediate-topology` (the default): requisite = every cluster term
/// of the driver's keys, preferred = the same rotated by the claim name's hash; the PV's node
/// affinity is the driver's accessible topology.
async fn immediate_binding(version: KubeVersion) {
    let env = Env::new(version, topology_driver("z1")).await;
    two_zones(&env).await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&[]);
    env.claim("data", &class, "1Mi", json!({})).await;
    let pv = bound_volume(&env, "data").await;

    let req = only_request(&env).accessibility_requirements.unwrap();
    let all = vec![zone(&env, "z1"), zone(&env, "z2")];
    assert_eq!(terms(&req.requisite), all);
    let first = (fnv1_32(b"data") % 2) as usize;
    let mut preferred = all.clone();
    preferred.rotate_left(first);
    assert_eq!(terms(&req.preferred), preferred);

    let affinity = serde_json::to_value(pv.spec.unwrap().node_affinity).unwrap();
    assert_eq!(
        affinity,
        json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": zone_key(&env.name), "operator": "In", "values": ["z1"]}]}]}})
    );
}

#[tokio::test]
async fn immediate_binding_requires_the_cluster_terms_v1_20_2() {
    immediate_binding(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn immediate_binding_requires_the_cluster_terms_v1_36_2() {
    immediate_binding(KubeVersion::V1_36_2).await;
}

/// `--immediate-topology=false`: an immediate claim carries no requirement at all (the PV still
/// gets the driver's accessible topology as node affinity).
#[tokio::test]
async fn immediate_topology_off_sends_no_requirement() {
    let env = Env::new(KubeVersion::V1_36_2, topology_driver("z1")).await;
    two_zones(&env).await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--immediate-topology=false"]);
    env.claim("data", &class, "1Mi", json!({})).await;
    let pv = bound_volume(&env, "data").await;
    assert_eq!(only_request(&env).accessibility_requirements, None);
    let terms = pv.spec.unwrap().node_affinity.unwrap().required.unwrap();
    assert_eq!(terms.node_selector_terms.len(), 1);
}

/// WaitForFirstConsumer with a selected node: requisite = the cluster terms, preferred starts
/// with the selected node's term.
#[tokio::test]
async fn the_selected_nodes_term_is_preferred_first() {
    let env = Env::new(KubeVersion::V1_36_2, topology_driver("z1")).await;
    let (_, b) = two_zones(&env).await;
    let class = env
        .class("", json!({"volumeBindingMode": "WaitForFirstConsumer"}))
        .await;
    let _p = env.provisioner(&[]);
    env.claim(
        "data",
        &class,
        "1Mi",
        json!({"metadata": {"annotations": {SELECTED_NODE: b}}}),
    )
    .await;
    env.wait_bound("data").await;
    let req = only_request(&env).accessibility_requirements.unwrap();
    assert_eq!(
        terms(&req.requisite),
        vec![zone(&env, "z1"), zone(&env, "z2")]
    );
    assert_eq!(
        terms(&req.preferred),
        vec![zone(&env, "z2"), zone(&env, "z1")]
    );
}

/// `--strict-topology`: only the selected node's term, as requisite and preferred.
#[tokio::test]
async fn strict_topology_sends_only_the_selected_nodes_term() {
    let env = Env::new(KubeVersion::V1_36_2, topology_driver("z1")).await;
    let (a, _) = two_zones(&env).await;
    let class = env
        .class("", json!({"volumeBindingMode": "WaitForFirstConsumer"}))
        .await;
    let _p = env.provisioner(&["--strict-topology"]);
    env.claim(
        "data",
        &class,
        "1Mi",
        json!({"metadata": {"annotations": {SELECTED_NODE: a}}}),
    )
    .await;
    env.wait_bound("data").await;
    let req = only_request(&env).accessibility_requirements.unwrap();
    assert_eq!(terms(&req.requisite), vec![zone(&env, "z1")]);
    assert_eq!(terms(&req.preferred), vec![zone(&env, "z1")]);
}

/// `--strict-topology` with allowedTopologies that exclude the selected node: upstream's
/// ProvisioningFailed text, no CreateVolume, the claim keeps its node (no-change, retried).
#[tokio::test]
async fn strict_topology_outside_the_allowed_topologies_fails() {
    let env = Env::new(KubeVersion::V1_36_2, topology_driver("z1")).await;
    let (a, _) = two_zones(&env).await;
    let key = zone_key(&env.name);
    let class = env
        .class(
            "",
            json!({"volumeBindingMode": "WaitForFirstConsumer",
                   "allowedTopologies": [{"matchLabelExpressions": [{"key": key, "values": ["z9"]}]}]}),
        )
        .await;
    let _p = env.provisioner(&["--strict-topology", "--retry-interval-start=100ms"]);
    env.claim(
        "data",
        &class,
        "1Mi",
        json!({"metadata": {"annotations": {SELECTED_NODE: a}}}),
    )
    .await;
    let msg = env.wait_event(&env.ns, "data", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": error generating accessibility requirements: selected node '\"{a}\"' topology '[{{{key} z1}}]' is not in allowed topologies: [[{{{key} z9}}]]"
        )
    );
    let c = env
        .api::<PersistentVolumeClaim>()
        .get("data")
        .await
        .unwrap();
    assert_eq!(c.annotations().get(SELECTED_NODE), Some(&a));
    assert!(!c.annotations().contains_key(INTENT));
    assert!(env.record().await.is_empty());
    assert_eq!(env.calls.count(Method::CreateVolume), 0);
}

/// allowedTopologies of 64 expressions of two values each, which the API server accepts, are
/// 2^64 terms: upstream (and plugreg before the bound) runs out of memory expanding them. Now
/// the attempt fails with a ProvisioningFailed event naming the bound, and no CreateVolume.
#[tokio::test]
async fn allowed_topologies_past_the_bound_fail_with_an_event() {
    let env = Env::new(KubeVersion::V1_36_2, topology_driver("z1")).await;
    two_zones(&env).await;
    let expressions: Vec<serde_json::Value> = (0..64)
        .map(|i| json!({"key": format!("{}/k{i}", env.name), "values": ["a", "b"]}))
        .collect();
    let class = env
        .class(
            "",
            json!({"allowedTopologies": [{"matchLabelExpressions": expressions}]}),
        )
        .await;
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim("data", &class, "1Mi", json!({})).await;
    let msg = env.wait_event(&env.ns, "data", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": error generating accessibility requirements: allowedTopologies expands to more than 16384 topology segments (each term is the product of its matchLabelExpressions' values: 3 expressions of 2 values are 8 combinations of 3 segments); list fewer values or expressions"
        )
    );
    assert_eq!(env.calls.count(Method::CreateVolume), 0);
}

/// A selected node without a CSINode: the attempt reschedules, i.e. the selected-node
/// annotation is removed so that the scheduler picks again; no CreateVolume.
#[tokio::test]
async fn a_selected_node_without_csinode_is_rescheduled() {
    let env = Env::new(KubeVersion::V1_36_2, topology_driver("z1")).await;
    two_zones(&env).await;
    let class = env
        .class("", json!({"volumeBindingMode": "WaitForFirstConsumer"}))
        .await;
    let _p = env.provisioner(&[]);
    let ghost = format!("{}-ghost", env.ns);
    env.claim(
        "data",
        &class,
        "1Mi",
        json!({"metadata": {"annotations": {SELECTED_NODE: ghost}}}),
    )
    .await;
    let c = env
        .wait_claim("data", "selected-node removed", |c| {
            !c.annotations().contains_key(SELECTED_NODE)
        })
        .await;
    assert!(!c.annotations().contains_key(INTENT));
    assert!(!c.finalizers().iter().any(|f| f == INTENT));
    assert!(env.record().await.is_empty());
    let msg = env.wait_event(&env.ns, "data", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": error generating accessibility requirements: failed to get selected CSINode {ghost}: csinode.storage.k8s.io \"{ghost}\" not found"
        )
    );
    assert_eq!(env.calls.count(Method::CreateVolume), 0);
}

/// A selected node with a CSINode but no Node object: no-change (event, the node stays
/// selected), retried until the Node appears, then provisioned.
#[tokio::test]
async fn a_selected_node_without_node_object_is_retried() {
    let env = Env::new(KubeVersion::V1_36_2, topology_driver("z1")).await;
    let key = zone_key(&env.name);
    let late = format!("{}-late", env.ns);
    env.csinode(&late, &[&key]).await;
    let class = env
        .class("", json!({"volumeBindingMode": "WaitForFirstConsumer"}))
        .await;
    let _p = env.provisioner(&["--retry-interval-start=100ms", "--retry-interval-max=1s"]);
    env.claim(
        "data",
        &class,
        "1Mi",
        json!({"metadata": {"annotations": {SELECTED_NODE: late}}}),
    )
    .await;
    let msg = env.wait_event(&env.ns, "data", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": error generating accessibility requirements: topology labels from selected node map[] does not match topology keys from CSINode [{key}]"
        )
    );
    let c = env
        .api::<PersistentVolumeClaim>()
        .get("data")
        .await
        .unwrap();
    assert_eq!(c.annotations().get(SELECTED_NODE), Some(&late));
    assert_eq!(env.calls.count(Method::CreateVolume), 0);
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(env.client.clone());
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": late, "labels": {key.as_str(): "z1"}}}),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    env.wait_bound("data").await;
    let req = only_request(&env).accessibility_requirements.unwrap();
    assert_eq!(terms(&req.preferred)[0], zone(&env, "z1"));
}

/// StatefulSet claims `data-web-0/1/2` without a selected node: the preferred terms are the
/// requisite rotated by FNV-1("web") + the ordinal, so the three replicas start in three
/// different zones.
#[tokio::test]
async fn stateful_set_claims_are_spread_over_the_zones() {
    let env = Env::new(KubeVersion::V1_36_2, topology_driver("z1")).await;
    let key = zone_key(&env.name);
    for z in ["z1", "z2", "z3"] {
        env.topology_node(&format!("{}-{z}", env.ns), &[(&key, z)], &[&key])
            .await;
    }
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--extra-create-metadata"]);
    for i in 0..3 {
        env.claim(&format!("data-web-{i}"), &class, "1Mi", json!({}))
            .await;
    }
    for i in 0..3 {
        env.wait_bound(&format!("data-web-{i}")).await;
    }
    let all = vec![zone(&env, "z1"), zone(&env, "z2"), zone(&env, "z3")];
    let mut firsts = Vec::new();
    for req in env.calls.create_requests() {
        let claim = req.parameters["csi.storage.k8s.io/pvc/name"].clone();
        let i: u32 = claim.strip_prefix("data-web-").unwrap().parse().unwrap();
        let topo = req.accessibility_requirements.unwrap();
        assert_eq!(terms(&topo.requisite), all, "{claim}");
        let mut preferred = all.clone();
        preferred.rotate_left((fnv1_32(b"web").wrapping_add(i) % 3) as usize);
        assert_eq!(terms(&topo.preferred), preferred, "{claim}");
        firsts.push(preferred[0].clone());
    }
    firsts.sort();
    firsts.dedup();
    assert_eq!(firsts.len(), 3, "three replicas, three zones first");
}

// --- RESOURCE_EXHAUSTED (§11.1) ---

fn exhausted(fail_first: Option<u64>) -> impl FnOnce(&mut DriverConfig) {
    move |c| {
        topology_driver("z1")(c);
        c.faults.insert(
            Method::CreateVolume,
            Fault {
                error: Some(Failure::new(Code::ResourceExhausted, "out of space")),
                fail_first,
                ..Fault::default()
            },
        );
    }
}

/// RESOURCE_EXHAUSTED with topology and a selected node: reschedule (the selected-node
/// annotation and the intent are removed; CreateVolume is not retried on that node).
#[tokio::test]
async fn resource_exhausted_on_a_selected_node_reschedules() {
    let env = Env::new(KubeVersion::V1_36_2, exhausted(None)).await;
    let (a, b) = two_zones(&env).await;
    let class = env
        .class("", json!({"volumeBindingMode": "WaitForFirstConsumer"}))
        .await;
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim(
        "data",
        &class,
        "1Mi",
        json!({"metadata": {"annotations": {SELECTED_NODE: a}}}),
    )
    .await;
    let c = env
        .wait_claim("data", "selected-node removed", |c| {
            !c.annotations().contains_key(SELECTED_NODE)
        })
        .await;
    assert!(!c.annotations().contains_key(INTENT), "{c:?}");
    assert!(!c.finalizers().iter().any(|f| f == INTENT), "{c:?}");
    let msg = env.wait_event(&env.ns, "data", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": rpc error: code = ResourceExhausted desc = out of space"
        )
    );
    // A definite answer: nothing runs in the driver, the volume leaves the record.
    env.wait_record_empty().await;
    // The scheduler picks the other node: the next CreateVolume is for that node. A stale
    // cached claim (old node) would have been tried again on the first one before it.
    env.patch_claim(
        "data",
        json!({"metadata": {"annotations": {SELECTED_NODE: b}}}),
    )
    .await;
    env.calls.wait_for(Method::CreateVolume, 2).await;
    let requests = env.calls.create_requests();
    let preferred = |r: &CreateVolumeRequest| {
        terms(&r.accessibility_requirements.as_ref().unwrap().preferred)[0].clone()
    };
    assert_eq!(preferred(&requests[0]), zone(&env, "z1"));
    assert_eq!(preferred(&requests[1]), zone(&env, "z2"), "{requests:?}");
}

/// RESOURCE_EXHAUSTED without a selected node (immediate binding, topology on): final, i.e. an
/// event and a retry with back-off, which then succeeds.
#[tokio::test]
async fn resource_exhausted_without_a_selected_node_is_final_and_retried() {
    let env = Env::new(KubeVersion::V1_36_2, exhausted(Some(2))).await;
    two_zones(&env).await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim("data", &class, "1Mi", json!({})).await;
    env.wait_bound("data").await;
    assert_eq!(env.calls.count(Method::CreateVolume), 3);
    env.wait_event(&env.ns, "data", "ProvisioningFailed").await;
    // Two identical events: client-go's aggregation makes them one with count 2.
    let msgs = env
        .event_messages(&env.ns, "data", "ProvisioningFailed")
        .await;
    assert_eq!(
        msgs,
        vec![format!(
            "failed to provision volume with StorageClass \"{class}\": rpc error: code = ResourceExhausted desc = out of space"
        )]
    );
}

// --- Other errors (§11) ---

/// `--timeout` expiring during CreateVolume: DeadlineExceeded with Go's context text, a
/// background error, so the intent stays and the retry (same name) finishes the volume.
#[tokio::test]
async fn a_create_volume_timeout_is_background_and_retried() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::CreateVolume,
            Fault {
                delay: Some(Duration::from_secs(3)),
                delay_first: Some(1),
                ..Fault::default()
            },
        );
    })
    .await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--timeout=1s", "--retry-interval-start=100ms"]);
    env.claim("slow", &class, "1Mi", json!({})).await;
    let msg = env.wait_event(&env.ns, "slow", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": rpc error: code = DeadlineExceeded desc = context deadline exceeded"
        )
    );
    env.wait_bound("slow").await;
    let names: Vec<String> = env
        .calls
        .create_requests()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert!(names.len() >= 2, "{names:?}");
    assert!(names.iter().all(|n| *n == names[0]), "{names:?}");
}

/// A background error (ABORTED) keeps the volume in the record, so a claim deleted meanwhile
/// (it goes at once: nothing is written on it) has its volume finished with the recorded
/// request and deleted with DeleteVolume; no PV is made for it. (Upstream's claimsInProgress
/// does this in memory only; the record makes it survive restarts.)
#[tokio::test]
async fn a_claim_deleted_during_background_errors_leaks_nothing() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::CreateVolume,
            Fault {
                error: Some(Failure::new(Code::Aborted, "operation pending")),
                fail_first: Some(5),
                ..Fault::default()
            },
        );
    })
    .await;
    let class = env.class("", json!({"reclaimPolicy": "Delete"})).await;
    let _p = env.provisioner(&["--retry-interval-start=200ms"]);
    let claim = env.claim("data", &class, "1Mi", json!({})).await;
    let name = Env::volume_name_of(&claim.uid().unwrap());
    env.calls.wait_for(Method::CreateVolume, 1).await;
    assert!(env.record().await.contains(&name));
    assert!(!claim.finalizers().iter().any(|f| f == INTENT));
    env.api::<PersistentVolumeClaim>()
        .delete("data", &DeleteParams::default())
        .await
        .unwrap();
    let api = env.api::<PersistentVolumeClaim>();
    poll("claim gone", || async {
        matches!(api.get_opt("data").await, Ok(None)).then_some(())
    })
    .await;
    poll("DeleteVolume", || async {
        (!env.calls.delete_requests().is_empty()).then_some(())
    })
    .await;
    env.wait_record_empty().await;
    let creates = env.calls.create_requests();
    assert_eq!(creates.len(), 6);
    assert!(creates.iter().all(|r| r.name == name));
    assert_eq!(env.calls.delete_requests().len(), 1);
    assert!(env.volumes().get_opt(&name).await.unwrap().is_none());
}

/// A claim whose StorageClass does not exist yet (the annotation set by hand: KCM only sets it
/// when it finds the class): retried without an event of the provisioner's, provisioned once
/// the class appears.
#[tokio::test]
async fn a_missing_class_is_retried_until_it_exists() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = format!("{}-later", env.name);
    let mut p = env.provisioner(&["--retry-interval-start=100ms", "--retry-interval-max=1s"]);
    env.claim(
        "data",
        &class,
        "1Mi",
        json!({"metadata": {"annotations": {
            "volume.kubernetes.io/storage-provisioner": env.name,
            "volume.beta.kubernetes.io/storage-provisioner": env.name}}}),
    )
    .await;
    p.wait_log_line("Retrying syncing claim").await;
    assert_eq!(env.calls.count(Method::CreateVolume), 0);
    assert_eq!(env.class("-later", json!({})).await, class);
    env.wait_bound("data").await;
    let ours: Vec<String> = env
        .event_messages(&env.ns, "data", "ProvisioningFailed")
        .await
        .into_iter()
        .filter(|m| m.starts_with("failed to provision volume"))
        .collect();
    assert!(ours.is_empty(), "{ours:?}");
    assert!(p.running());
}

/// A final error drops the volume from the record at once (the record is written for the
/// claims started together, and cleared together). INVALID_ARGUMENT is final and delays the
/// retry by five minutes, so a volume left behind would stay.
#[tokio::test]
async fn a_final_error_clears_the_record_of_every_claim() {
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
    let _p = env.provisioner(&[]);
    const N: usize = 20;
    for i in 0..N {
        env.claim(&format!("c{i}"), &class, "1Mi", json!({})).await;
    }
    env.calls.wait_for(Method::CreateVolume, N as u64).await;
    env.wait_record_empty().await;
    let api = env.api::<PersistentVolumeClaim>();
    let claims = api.list(&Default::default()).await.unwrap().items;
    assert!(
        claims.iter().all(|c| !c.annotations().contains_key(INTENT)
            && !c.finalizers().iter().any(|f| f == INTENT))
    );
    assert_eq!(env.calls.count(Method::CreateVolume), N as u64);
}

// --- PV shape (§7.2, §7.3, §9) ---

/// A Block claim: one Block capability and no fs type (even with an fstype parameter). The
/// test driver keeps volumes as directories and refuses Block with FAILED_PRECONDITION, so the
/// Block PV itself (volumeMode Block, no `csi.fsType`) is left to `pv.rs`'s unit tests; here the
/// refusal comes back as the claim's event.
#[tokio::test]
async fn a_block_claim_gets_a_block_capability_and_no_fs_type() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env
        .class(
            "",
            json!({"parameters": {"csi.storage.k8s.io/fstype": "ext4"}}),
        )
        .await;
    let _p = env.provisioner(&[]);
    env.claim(
        "raw",
        &class,
        "1Mi",
        json!({"spec": {"volumeMode": "Block"}}),
    )
    .await;
    let msg = env.wait_event(&env.ns, "raw", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": rpc error: code = FailedPrecondition desc = block volumes are not supported by this driver"
        )
    );
    let req = env.calls.create_requests().remove(0);
    assert_eq!(req.volume_capabilities.len(), 1);
    assert_eq!(
        req.volume_capabilities[0].access_type,
        Some(volume_capability::AccessType::Block(
            volume_capability::BlockVolume {}
        ))
    );
    assert!(!req.parameters.contains_key("csi.storage.k8s.io/fstype"));
}

/// The claim's access modes become one capability each, in order: ReadWriteMany ->
/// MULTI_NODE_MULTI_WRITER (5), ReadOnlyMany -> MULTI_NODE_READER_ONLY (3).
#[tokio::test]
async fn access_modes_map_to_csi_modes_in_claim_order() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&[]);
    env.claim(
        "shared",
        &class,
        "1Mi",
        json!({"spec": {"accessModes": ["ReadWriteMany", "ReadOnlyMany"]}}),
    )
    .await;
    let pv = bound_volume(&env, "shared").await;
    let modes: Vec<i32> = only_request(&env)
        .volume_capabilities
        .iter()
        .map(|c| c.access_mode.unwrap().mode)
        .collect();
    assert_eq!(modes, vec![5, 3]);
    assert_eq!(
        pv.spec.unwrap().access_modes.unwrap(),
        vec!["ReadWriteMany".to_owned(), "ReadOnlyMany".to_owned()]
    );
}

/// `--extra-create-metadata`: the claim's name and namespace and the PV name reach the driver
/// as parameters, next to the class's own.
#[tokio::test]
async fn extra_create_metadata_reaches_the_driver() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env.class("", json!({"parameters": {"type": "fast"}})).await;
    let _p = env.provisioner(&["--extra-create-metadata"]);
    let claim = env.claim("data", &class, "1Mi", json!({})).await;
    env.wait_bound("data").await;
    let pv_name = format!("pvc-{}", claim.uid().unwrap());
    let params: BTreeMap<String, String> = only_request(&env).parameters.into_iter().collect();
    assert_eq!(
        params,
        BTreeMap::from([
            ("type".to_owned(), "fast".to_owned()),
            ("csi.storage.k8s.io/pvc/name".to_owned(), "data".to_owned()),
            (
                "csi.storage.k8s.io/pvc/namespace".to_owned(),
                env.ns.clone()
            ),
            ("csi.storage.k8s.io/pv/name".to_owned(), pv_name),
        ])
    );
}

/// `--volume-name-prefix` and `--volume-name-uuid-length`: `<prefix>-<uid without dashes, cut>`
/// names the volume and the PV.
#[tokio::test]
async fn volume_name_prefix_and_uuid_length_name_the_volume() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--volume-name-prefix=vol", "--volume-name-uuid-length=8"]);
    let claim = env.claim("data", &class, "1Mi", json!({})).await;
    let bound = env.wait_bound("data").await;
    let uid: String = claim.uid().unwrap().chars().filter(|c| *c != '-').collect();
    let expected = format!("vol-{}", &uid[..8]);
    assert_eq!(only_request(&env).name, expected);
    assert_eq!(bound.spec.unwrap().volume_name, Some(expected.clone()));
    env.volumes().get(&expected).await.unwrap();
}

/// reclaimPolicy Retain: the provisioner's finalizer is removed from the PV, and after the claim
/// is deleted the PV stays Released and its volume is not deleted.
async fn retain(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    let class = env.class("", json!({"reclaimPolicy": "Retain"})).await;
    let p = env.provisioner(&[]);
    env.claim("keep", &class, "1Mi", json!({})).await;
    let pv = bound_volume(&env, "keep").await;
    let name = pv.name_any();
    assert_eq!(
        pv.spec
            .as_ref()
            .unwrap()
            .persistent_volume_reclaim_policy
            .as_deref(),
        Some("Retain")
    );
    env.wait_pv(&name, "finalizer removed", |v| {
        !v.finalizers().iter().any(|f| f == PV_FINALIZER)
    })
    .await;
    env.api::<PersistentVolumeClaim>()
        .delete("keep", &DeleteParams::default())
        .await
        .unwrap();
    env.wait_pv(&name, "PV Released", |v| {
        v.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Released")
    })
    .await;
    // The provisioner has decided about the Released PV once it logs so; it must stay.
    p.wait_log_lines(&[&name, "phase=\"Released\"", "Nothing"], 1)
        .await;
    let v = env.volumes().get(&name).await.unwrap();
    assert_eq!(
        v.status.as_ref().unwrap().phase.as_deref(),
        Some("Released"),
        "still there"
    );
    assert!(!v.finalizers().iter().any(|f| f == PV_FINALIZER));
    assert_eq!(env.calls.count(Method::DeleteVolume), 0);
}

#[tokio::test]
async fn retain_keeps_the_released_volume_and_drops_the_finalizer_v1_20_2() {
    retain(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn retain_keeps_the_released_volume_and_drops_the_finalizer_v1_36_2() {
    retain(KubeVersion::V1_36_2).await;
}

// --- Deletion (§12) ---

/// A driver with PUBLISH_UNPUBLISH_VOLUME: while a VolumeAttachment names the PV, deletion is
/// refused with a VolumeFailedDelete event on the PV; once it is gone, the volume is deleted,
/// at once: the attachment's deletion brings the PV back (issue 33), not its back-off, which
/// here is minutes long.
async fn attached(version: KubeVersion) {
    let env = Env::new(version, |c| c.controller_publish = true).await;
    let class = env.class("", json!({"reclaimPolicy": "Delete"})).await;
    let _p = env.provisioner(&["--retry-interval-start=3m", "--retry-interval-max=5m"]);
    env.claim("data", &class, "1Mi", json!({})).await;
    let pv = bound_volume(&env, "data").await;
    let pv_name = pv.name_any();
    let node = format!("{}-node", env.ns);
    let attachments: Api<VolumeAttachment> = Api::all(env.client.clone());
    let va = format!("{}-va", env.ns);
    attachments
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": va},
                "spec": {"attacher": env.name, "nodeName": node,
                         "source": {"persistentVolumeName": pv_name}},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    env.api::<PersistentVolumeClaim>()
        .delete("data", &DeleteParams::default())
        .await
        .unwrap();
    let msg = env
        .wait_event("default", &pv_name, "VolumeFailedDelete")
        .await;
    assert_eq!(
        msg,
        format!("persistentvolume {pv_name} is still attached to node {node}")
    );
    assert_eq!(env.calls.count(Method::DeleteVolume), 0);
    attachments
        .delete(&va, &DeleteParams::default())
        .await
        .unwrap();
    env.wait_pv_gone(&pv_name).await;
    let deletes = env.calls.delete_requests();
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert_eq!(
        deletes[0].volume_id,
        pv.spec.unwrap().csi.unwrap().volume_handle
    );
}

#[tokio::test]
async fn an_attached_volume_is_deleted_only_after_its_attachment_goes_v1_20_2() {
    attached(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn an_attached_volume_is_deleted_only_after_its_attachment_goes_v1_36_2() {
    attached(KubeVersion::V1_36_2).await;
}

/// A Released CSI PV with policy Delete, claimRef to a claim that is gone.
fn static_pv(name: &str, driver: &str, handle: &str, ns: &str) -> PersistentVolume {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "1Mi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Delete",
            "csi": {"driver": driver, "volumeHandle": handle},
            "claimRef": {"kind": "PersistentVolumeClaim", "apiVersion": "v1", "namespace": ns,
                         "name": "gone", "uid": "9d4a8f0e-0000-4000-8000-000000000000"},
        },
    }))
    .unwrap()
}

/// A statically created CSI PV of this driver (no provisioned-by annotation) is deleted when it
/// is Released with policy Delete; a PV of another driver is left alone. v1.36.2 only: the
/// v1.20.2 KCM marks a static CSI PV with policy Delete Failed ("no deletable volume plugin")
/// instead of leaving it Released for an external deleter (HonorPVReclaimPolicy came later).
#[tokio::test]
async fn a_static_pv_of_this_driver_is_deleted_and_one_of_another_left_alone() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let volumes = env.volumes();
    let theirs = format!("{}-theirs", env.ns);
    let mine = format!("{}-mine", env.ns);
    volumes
        .create(
            &PostParams::default(),
            &static_pv(&theirs, "other.example.com", "their-volume", &env.ns),
        )
        .await
        .unwrap();
    let _p = env.provisioner(&[]);
    // The other driver's PV reaches Released (KCM) with the provisioner running.
    env.wait_pv(&theirs, "other PV Released", |v| {
        v.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Released")
    })
    .await;
    volumes
        .create(
            &PostParams::default(),
            &static_pv(&mine, &env.name, "my-volume", &env.ns),
        )
        .await
        .unwrap();
    env.wait_pv_gone(&mine).await;
    let deletes = env.calls.delete_requests();
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert_eq!(deletes[0].volume_id, "my-volume");
    let v = volumes.get(&theirs).await.unwrap();
    assert!(
        !v.finalizers().iter().any(|f| f == PV_FINALIZER),
        "{:?}",
        v.finalizers()
    );
    assert_eq!(
        v.status.as_ref().unwrap().phase.as_deref(),
        Some("Released"),
        "left alone"
    );
    volumes
        .delete(&theirs, &DeleteParams::default())
        .await
        .unwrap();
}

/// DeleteVolume failing transiently: VolumeFailedDelete with the gRPC text, then a retry with
/// back-off deletes the volume and the PV.
#[tokio::test]
async fn a_failing_delete_volume_is_reported_and_retried() {
    let env = Env::new(KubeVersion::V1_36_2, |c| {
        c.faults.insert(
            Method::DeleteVolume,
            Fault {
                error: Some(Failure::new(Code::Unavailable, "busy")),
                fail_first: Some(2),
                ..Fault::default()
            },
        );
    })
    .await;
    let class = env.class("", json!({"reclaimPolicy": "Delete"})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim("data", &class, "1Mi", json!({})).await;
    let pv_name = bound_volume(&env, "data").await.name_any();
    env.api::<PersistentVolumeClaim>()
        .delete("data", &DeleteParams::default())
        .await
        .unwrap();
    env.wait_pv_gone(&pv_name).await;
    assert_eq!(env.calls.count(Method::DeleteVolume), 3);
    let msg = env
        .wait_event("default", &pv_name, "VolumeFailedDelete")
        .await;
    assert_eq!(msg, "rpc error: code = Unavailable desc = busy");
}

// --- Claims the provisioner does not provision (§7.1) ---

/// `spec.selector`: final error "claim Selector is not supported".
#[tokio::test]
async fn a_claim_with_a_selector_is_refused() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim(
        "picky",
        &class,
        "1Mi",
        json!({"spec": {"selector": {"matchLabels": {"tier": "gold"}}}}),
    )
    .await;
    let msg = env.wait_event(&env.ns, "picky", "ProvisioningFailed").await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": claim Selector is not supported"
        )
    );
    let c = env
        .api::<PersistentVolumeClaim>()
        .get("picky")
        .await
        .unwrap();
    assert!(!c.annotations().contains_key(INTENT));
    assert_eq!(env.calls.count(Method::CreateVolume), 0);
}

/// A VolumeSnapshot data source with a driver without CREATE_DELETE_SNAPSHOT: upstream's final
/// error, and no CreateVolume.
#[tokio::test]
async fn a_snapshot_source_needs_create_delete_snapshot() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim(
        "restore",
        &class,
        "1Mi",
        json!({"spec": {"dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap"}}}),
    )
    .await;
    let msg = env
        .wait_event(&env.ns, "restore", "ProvisioningFailed")
        .await;
    assert_eq!(
        msg,
        format!(
            "failed to provision volume with StorageClass \"{class}\": CSI driver does not support snapshot restore: controller CREATE_DELETE_SNAPSHOT capability is not reported"
        )
    );
    assert_eq!(env.calls.count(Method::CreateVolume), 0);
}

/// A dataSourceRef of a kind the provisioner does not know: upstream's Normal Provisioning
/// "Assuming an external populator will provision the volume", and no CreateVolume.
#[tokio::test]
async fn an_unknown_data_source_kind_is_left_to_a_populator() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&["--retry-interval-start=100ms"]);
    env.claim(
        "filled",
        &class,
        "1Mi",
        json!({"spec": {"dataSourceRef": {"apiGroup": "populators.example.com", "kind": "Widget", "name": "w"}}}),
    )
    .await;
    let msgs = poll("populator event", || async {
        let m = env.event_messages(&env.ns, "filled", "Provisioning").await;
        (!m.is_empty()).then_some(m)
    })
    .await;
    assert_eq!(
        msgs,
        vec!["Assuming an external populator will provision the volume".to_owned()]
    );
    assert!(
        env.event_messages(&env.ns, "filled", "ProvisioningFailed")
            .await
            .is_empty()
    );
    let c = env
        .api::<PersistentVolumeClaim>()
        .get("filled")
        .await
        .unwrap();
    assert!(!c.annotations().contains_key(INTENT));
    assert_eq!(env.calls.count(Method::CreateVolume), 0);
}

// --- Metrics and health (§3, §17) ---

/// After one provisioned claim `/metrics` counts it, the CreateVolume call and the claims
/// queue; `/healthz/leader-election` answers `ok` under `--leader-election`.
#[tokio::test]
async fn metrics_count_a_provisioned_claim() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env.class("", json!({})).await;
    let addr = free_local_addr();
    let p = env.provisioner(&[
        &format!("--http-endpoint={addr}"),
        "--leader-election",
        &format!("--leader-election-namespace={}", env.ns),
    ]);
    p.wait_http(addr).await;
    env.claim("data", &class, "1Mi", json!({})).await;
    env.wait_bound("data").await;
    let want = format!(
        "controller_persistentvolumeclaim_provision_total{{class=\"{class}\",source=\"\"}} 1"
    );
    let body = poll("provision_total in /metrics", || async {
        let (code, body) = http_get(addr, "/metrics");
        (code == 200 && body.lines().any(|l| l == want)).then_some(body)
    })
    .await;
    let create = format!(
        "csi_sidecar_operations_seconds_count{{driver_name=\"{}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/CreateVolume\"}} 1",
        env.name
    );
    assert!(body.lines().any(|l| l == create), "{create}\n{body}");
    let adds = body
        .lines()
        .find_map(|l| l.strip_prefix("workqueue_adds_total{name=\"claims\"} "))
        .unwrap_or_else(|| panic!("{body}"));
    assert!(adds.parse::<u64>().unwrap() >= 1, "{adds}");
    assert_eq!(
        http_get(addr, "/healthz/leader-election"),
        (200, "ok".to_owned())
    );
}

/// Migration checklist 1: for a CSI-migration target the CSI call metrics carry upstream's
/// `migrated` label, `false` on the CreateVolume of a claim of a CSI class and on the calls
/// that concern no volume (the Probe after the second connection).
#[tokio::test]
async fn a_migration_targets_metrics_carry_migrated() {
    const TARGET: &str = "disk.csi.azure.com";
    let mut env = Env::new(KubeVersion::V1_36_2, |c| c.name = TARGET.into()).await;
    env.name = TARGET.into();
    let class = env.class("", json!({})).await;
    let addr = free_local_addr();
    let p = env.provisioner(&[&format!("--http-endpoint={addr}")]);
    p.wait_http(addr).await;
    env.claim("data", &class, "1Mi", json!({})).await;
    env.wait_bound("data").await;
    let create = format!(
        "csi_sidecar_operations_seconds_count{{driver_name=\"{TARGET}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/CreateVolume\",migrated=\"false\"}} 1"
    );
    let body = poll("CreateVolume in /metrics", || async {
        let (code, body) = http_get(addr, "/metrics");
        (code == 200 && body.lines().any(|l| l == create)).then_some(body)
    })
    .await;
    let probe = format!(
        "csi_sidecar_operations_seconds_count{{driver_name=\"{TARGET}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/Probe\",migrated=\"false\"}}"
    );
    assert!(body.contains(&probe), "{body}");
}

/// Without `--leader-election` there is no leader health check: 404.
#[tokio::test]
async fn leader_health_is_not_served_without_leader_election() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let addr = free_local_addr();
    let p = env.provisioner(&[&format!("--http-endpoint={addr}")]);
    p.wait_http(addr).await;
    assert_eq!(
        http_get(addr, "/healthz/leader-election"),
        (404, "404 page not found\n".to_owned())
    );
    assert_eq!(http_get(addr, "/metrics").0, 200);
}

// --- VolumeAttributesClass at creation (issue 21) ---

/// A VolumeAttributesClass of `driver` named after the test, with `parameters`.
async fn attributes_class(
    env: &Env,
    suffix: &str,
    driver: &str,
    parameters: &[(&str, &str)],
) -> String {
    use plugreg_sidecar_kit::vac::VolumeAttributesClass;
    let name = format!("{}{suffix}", env.name);
    let vac = VolumeAttributesClass {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        driver_name: driver.to_owned(),
        parameters: parameters
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    };
    Api::<VolumeAttributesClass>::all(env.client.clone())
        .create(&PostParams::default(), &vac)
        .await
        .unwrap();
    name
}

/// A claim that names a VolumeAttributesClass of the driver: CreateVolume carries the class's
/// parameters as `mutable_parameters` and the PV names the class; a class of another driver is
/// a ProvisioningFailed with upstream's text, and so is any class with a driver that does not
/// report MODIFY_VOLUME. (v1.36.2: the v1 API is GA since 1.34.)
#[tokio::test]
async fn volume_attributes_class_at_creation_v1_36_2() {
    let env = Env::new(KubeVersion::V1_36_2, |c| c.controller_modify = true).await;
    let gold = attributes_class(&env, "-gold", &env.name, &[("iops", "300")]).await;
    let foreign =
        attributes_class(&env, "-foreign", "other.csi.example.com", &[("iops", "1")]).await;
    let class = env.class("", json!({})).await;
    let _p = env.provisioner(&[]);
    env.claim(
        "c1",
        &class,
        "1Mi",
        json!({"spec": {"volumeAttributesClassName": gold}}),
    )
    .await;
    let pv = bound_volume(&env, "c1").await;
    assert_eq!(
        pv.spec
            .as_ref()
            .unwrap()
            .volume_attributes_class_name
            .as_deref(),
        Some(gold.as_str())
    );
    let request = env
        .calls
        .create_requests()
        .into_iter()
        .find(|r| r.name == pv.name_any())
        .expect("the PV's CreateVolume");
    assert_eq!(
        request.mutable_parameters,
        std::collections::HashMap::from([("iops".to_owned(), "300".to_owned())])
    );

    env.claim(
        "c2",
        &class,
        "1Mi",
        json!({"spec": {"volumeAttributesClassName": foreign}}),
    )
    .await;
    let msg = env.wait_event(&env.ns, "c2", "ProvisioningFailed").await;
    assert!(
        msg.contains(&format!(
            "VAC {foreign} referenced in PVC is for driver other.csi.example.com which does not match driver name {}",
            env.name
        )),
        "{msg}"
    );

    // A driver without MODIFY_VOLUME.
    let plain = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let silver = attributes_class(&plain, "-silver", &plain.name, &[("iops", "1")]).await;
    let class = plain.class("", json!({})).await;
    let _p = plain.provisioner(&[]);
    plain
        .claim(
            "c3",
            &class,
            "1Mi",
            json!({"spec": {"volumeAttributesClassName": silver}}),
        )
        .await;
    let msg = plain
        .wait_event(&plain.ns, "c3", "ProvisioningFailed")
        .await;
    assert!(
        msg.contains(
            "CSI driver does not support VolumeAttributesClass: controller MODIFY_VOLUME capability is not reported"
        ),
        "{msg}"
    );
    assert_eq!(plain.calls.count(Method::CreateVolume), 0);
}

/// On an API server without the v1 API (v1.20.2) the gate switches itself off at start, with
/// upstream's log line, unless it was set explicitly.
#[tokio::test]
async fn volume_attributes_class_gate_follows_discovery_v1_20_2() {
    let env = Env::new(KubeVersion::V1_20_2, |_| {}).await;
    let mut p = env.provisioner(&[]);
    p.wait_log_line(
        "Disabling VolumeAttributesClass feature gate because the VolumeAttributesClass v1 API is not available",
    )
    .await;
    p.kill();
    // Set explicitly: past discovery (the driver detected, a later start-up step) without a word.
    let explicit = env.provisioner(&["--feature-gates=VolumeAttributesClass=true"]);
    explicit
        .wait_log_line(&format!("Detected CSI driver {}", env.name))
        .await;
    assert!(
        !explicit.log().contains("Disabling VolumeAttributesClass"),
        "{}",
        explicit.log()
    );
}
