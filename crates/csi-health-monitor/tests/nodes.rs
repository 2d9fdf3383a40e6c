//! The node watcher against a real kube-apiserver (checklist items 14-18 of
//! `upstream-external-health-monitor.md` §17): Nodes and Pods written by the test as the
//! kubelet and the scheduler would (Ready conditions patched, a pod bound through
//! `pods/binding`), with this drop-in's decisions: a failure told once, not every five
//! minutes; a deleted node does not crash the process; a pod bound after it was first seen
//! counts on its node.

mod common;

use std::time::Duration;

use common::{Env, NS, driver_config};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use plugreg_csi_test_driver::Method;
use plugreg_testpeers::{ApiServerOptions, KubeVersion};
use serde_json::json;

const FAILED: &str = "NodeFailed";
const RECOVERED: &str = "NodeRecovered";

async fn node(env: &Env, name: &str) {
    let nodes: Api<Node> = Api::all(env.client.clone());
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}})).unwrap(),
        )
        .await
        .unwrap();
    set_ready(env, name, "True").await;
}

async fn set_ready(env: &Env, name: &str, status: &str) {
    let nodes: Api<Node> = Api::all(env.client.clone());
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    nodes
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"conditions": [{
                "type": "Ready", "status": status, "reason": "Test",
                "lastHeartbeatTime": now, "lastTransitionTime": now,
            }]}})),
        )
        .await
        .unwrap();
}

/// A pod using `claim`, on `node` (`None`: not scheduled).
async fn pod(env: &Env, name: &str, claim: &str, node: Option<&str>) {
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), NS);
    let mut spec = json!({
        "containers": [{"name": "c", "image": "busybox"}],
        "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": claim}}],
    });
    if let Some(n) = node {
        spec["nodeName"] = json!(n);
    }
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap(),
    )
    .await
    .unwrap();
}

/// Binds the pod `name` to `node` as the scheduler does.
async fn bind(env: &Env, name: &str, node: &str) {
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), NS);
    let binding = json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {"name": name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    });
    pods.create_subresource::<serde_json::Value, serde_json::Value>(
        "binding",
        name,
        &PostParams::default(),
        &binding,
    )
    .await
    .unwrap();
}

async fn env_with_claims() -> Env {
    let env = Env::new(
        KubeVersion::V1_36_2,
        driver_config(&["vol-a", "vol-b"], true),
    )
    .await;
    plugreg_testpeers::rbac::default_service_account(&env.client, NS)
        .await
        .unwrap();
    env.bound_claim("a", "vol-a").await;
    env.bound_claim("b", "vol-b").await;
    env
}

/// Checklist 15, 16, 18: a node not Ready for longer than its grace gets `NodeFailed` on the
/// claims its pods use, naming every pod, the one bound after the monitor first saw it
/// included (upstream leaves it out); while it stays down nothing more is written (upstream
/// repeats it every five minutes); Ready again, one `NodeRecovered` (a Warning, as upstream).
/// A claim whose pods are elsewhere gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_node_is_told_once_to_its_claims_and_its_recovery_once() {
    let env = env_with_claims().await;
    node(&env, "n1").await;
    node(&env, "n2").await;
    pod(&env, "p1", "a", Some("n1")).await;
    pod(&env, "p2", "a", None).await;
    pod(&env, "p3", "b", Some("n2")).await;
    let m = env.monitor(&[
        "--enable-node-watcher",
        "--node-failure-grace=2s",
        "--list-volumes-interval=1h",
    ]);
    env.poll("the monitor's first pass", || async {
        (env.calls.count(Method::ListVolumes) >= 1).then_some(())
    })
    .await;
    bind(&env, "p2", "n1").await;
    set_ready(&env, "n1", "False").await;

    let message =
        format!("Pods: [ p1 p2 ] consuming PVC: a in namespace: {NS} are now on a failed node: n1");
    let ev = env.wait_event("a", FAILED, &message, 1).await;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    // Three more graces down, and the node's Ready condition written again meanwhile.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        set_ready(&env, "n1", "Unknown").await;
    }
    assert_eq!(env.said("a").await, [(FAILED.into(), message.clone(), 1)]);
    assert!(env.said("b").await.is_empty());

    set_ready(&env, "n1", "True").await;
    let ev = env
        .wait_event("a", RECOVERED, "Node: n1 recovered", 1)
        .await;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    assert!(m.log().contains("Node is broken"));
}

/// Checklist 15 (the grace) and 17: a node that is not Ready for less than its grace is not
/// reported; a deleted node does not end the process (upstream panics, exit 2) and its
/// claims are told it failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_outage_is_not_reported_and_a_deleted_node_does_not_crash() {
    let env = env_with_claims().await;
    node(&env, "n1").await;
    pod(&env, "p1", "a", Some("n1")).await;
    let mut m = env.monitor(&["--enable-node-watcher", "--node-failure-grace=1h"]);
    env.poll("the monitor's first pass", || async {
        (env.calls.count(Method::ListVolumes) >= 1).then_some(())
    })
    .await;
    set_ready(&env, "n1", "False").await;
    env.poll("the not-ready node seen", || async {
        m.log()
            .contains("Node is not ready, but less than 5 minutes")
            .then_some(())
    })
    .await;
    assert!(env.said("a").await.is_empty());

    let nodes: Api<Node> = Api::all(env.client.clone());
    nodes.delete("n1", &DeleteParams::default()).await.unwrap();
    let message =
        format!("Pods: [ p1 ] consuming PVC: a in namespace: {NS} are now on a failed node: n1");
    env.wait_event("a", FAILED, &message, 1).await;
    assert!(m.running(), "{}", m.log());
    assert!(
        m.log()
            .contains("Node is deleted, so mark the PVs on the node")
    );
}

/// Checklist 14: without `--enable-node-watcher` the monitor lists (and so watches) no Pods or
/// Nodes (the API server's audit log); it lists the claims' abnormal and recovery events once
/// at start and then neither lists nor watches Events (upstream watches every Event in the
/// cluster); it never reads a claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_node_watcher_no_pod_node_or_event_watch_is_made() {
    let env = Env::with_options(
        KubeVersion::V1_36_2,
        &ApiServerOptions {
            audit: true,
            ..ApiServerOptions::default()
        },
        driver_config(&["vol-a"], true),
    )
    .await;
    env.driver.set_condition("vol-a", Some("disk gone"));
    env.bound_claim("a", "vol-a").await;
    let _m = env.monitor(&["--list-volumes-interval=300ms"]);
    env.wait_event("a", "VolumeConditionAbnormal", "disk gone", 1)
        .await;
    let from = env.calls.count(Method::ListVolumes);
    env.poll("two more passes", || async {
        (env.calls.count(Method::ListVolumes) >= from + 2).then_some(())
    })
    .await;
    let audited = env.audited();
    let of = |resource: &str, verb: &str| {
        audited
            .iter()
            .filter(|e| {
                e["objectRef"]["resource"] == resource
                    && e["verb"] == verb
                    && e["userAgent"]
                        .as_str()
                        .is_some_and(|a| a.contains("csi-external-health-monitor-controller"))
            })
            .count()
    };
    // The audit log has completed requests only: a watch shows when it ends, its list at once.
    assert!(
        of("persistentvolumes", "list") >= 1,
        "the monitor's requests are not found in the audit log by user agent"
    );
    for resource in ["pods", "nodes"] {
        assert_eq!(
            of(resource, "list") + of(resource, "watch"),
            0,
            "{resource}"
        );
    }
    assert_eq!(of("events", "watch"), 0);
    assert_eq!(of("events", "list"), 2);
    assert_eq!(of("persistentvolumeclaims", "list"), 0);
    assert_eq!(of("persistentvolumeclaims", "get"), 0);
}
