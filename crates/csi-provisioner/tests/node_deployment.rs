//! Distributed provisioning (`--node-deployment`, issue 31) against a real kube-apiserver and
//! kube-controller-manager v1.36.2: one `csi-provisioner` per fake node, each beside its own
//! instance of the test driver (its node ID, its topology segment, its storage pool), as a
//! driver's DaemonSet runs them. There is no kubelet or scheduler here: a test writes the
//! `selected-node` annotation where the scheduler would.
//!
//! What holds: a claim selected for a node is provisioned by that node's provisioner only and
//! its volume deleted by that node only; an Immediate claim is taken by exactly one node, never
//! by one without room, after a GetCapacity with the claim's filtered parameters and
//! capabilities; with `--node-deployment-immediate-binding=false` nobody takes one until the
//! annotation is set from outside; each node publishes the capacity of its own segment under its
//! own manager id; a RESOURCE_EXHAUSTED owner gives the claim back to the race; NodeGetInfo's
//! failure stops the start. The race runs on v1.20.2 too.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::{Env, Provisioner, poll};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::CSIStorageCapacity;
use kube::api::{Api, DeleteParams, ListParams};
use plugreg_csi_test_driver::{
    Calls, Capacity, DriverConfig, Failure, Fault, Method, MountMode, RunningDriver,
};
use plugreg_testpeers::KubeVersion;
use serde_json::json;
use tonic::Code;

const GI: i64 = 1 << 30;
const SELECTED: &str = "volume.kubernetes.io/selected-node";

/// One fake node: its driver instance and its provisioner.
struct Node {
    name: String,
    calls: Calls,
    _driver: RunningDriver,
    provisioner: Provisioner,
}

/// The topology key of this test's driver.
fn key(env: &Env) -> String {
    format!("{}/node", env.name)
}

/// Starts `n` nodes with `pools[i]` bytes each; every provisioner gets `args` besides the node
/// deployment's.
async fn nodes(env: &Env, pools: &[i64], args: &[&str]) -> Vec<Node> {
    nodes_with(env, pools, args, |_, _| {}).await
}

/// [`nodes`], with `tweak` applied to node `i`'s driver.
async fn nodes_with(
    env: &Env,
    pools: &[i64],
    args: &[&str],
    tweak: impl Fn(usize, &mut DriverConfig),
) -> Vec<Node> {
    let mut out = Vec::new();
    for (i, bytes) in pools.iter().enumerate() {
        let name = format!("{}-n{i}", env.ns);
        let segment = BTreeMap::from([(key(env), name.clone())]);
        let dir: PathBuf = env.dir.path().join(&name);
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = DriverConfig {
            name: env.name.clone(),
            controller: true,
            accessibility_constraints: true,
            node_id: name.clone(),
            topology: segment.clone(),
            data_dir: Some(dir.join("volumes")),
            mount: MountMode::Directory,
            capacity: Capacity::with_pools([(segment, *bytes)]),
            ..DriverConfig::default()
        };
        let mut cfg = cfg;
        tweak(i, &mut cfg);
        let calls = cfg.calls.clone();
        let socket = dir.join("csi.sock");
        let driver = plugreg_csi_test_driver::start(cfg, &socket).await.unwrap();
        let mut all = vec![
            "--node-deployment",
            "--feature-gates=Topology=true",
            "--strict-topology",
            "--immediate-topology=false",
        ];
        all.extend_from_slice(args);
        let provisioner = env.provisioner_at(
            &socket,
            &all,
            &[("NODE_NAME", name.as_str()), ("NAMESPACE", env.ns.as_str())],
        );
        out.push(Node {
            name,
            calls,
            _driver: driver,
            provisioner,
        });
    }
    for n in &out {
        n.provisioner
            .wait_log_line("Informers synced; starting")
            .await;
    }
    out
}

fn selected(c: &PersistentVolumeClaim) -> Option<&str> {
    c.metadata
        .annotations
        .as_ref()?
        .get(SELECTED)
        .map(String::as_str)
}

/// The node names the PV's affinity requires.
fn affinity_nodes(pv: &PersistentVolume, key: &str) -> Vec<String> {
    pv.spec
        .as_ref()
        .and_then(|s| s.node_affinity.as_ref())
        .and_then(|a| a.required.as_ref())
        .map(|r| {
            r.node_selector_terms
                .iter()
                .flat_map(|t| t.match_expressions.iter().flatten())
                .filter(|e| e.key == key && e.operator == "In")
                .flat_map(|e| e.values.clone().unwrap_or_default())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_node_provisions_and_deletes_only_its_own_volumes() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env
        .class("", json!({"volumeBindingMode": "WaitForFirstConsumer"}))
        .await;
    let nodes = nodes(
        &env,
        &[10 * GI, 10 * GI, 10 * GI],
        &[
            "--enable-capacity",
            "--capacity-ownerref-level=-1",
            "--capacity-poll-interval=2s",
        ],
    )
    .await;
    for n in &nodes {
        let line = n.provisioner.wait_log_line("using local topology").await;
        assert!(line.contains(&n.name), "{line}");
        n.provisioner
            .wait_log_line("producing CSIStorageCapacity objects with fixed topology segment")
            .await;
    }
    // Each node publishes its own segment's capacity, under its own manager id.
    let capacities: Api<CSIStorageCapacity> = Api::namespaced(env.client.clone(), &env.ns);
    for n in &nodes {
        let selector = format!(
            "csi.storage.k8s.io/drivername={},csi.storage.k8s.io/managed-by=external-provisioner-{}",
            env.name, n.name
        );
        let list = poll(&format!("the capacity of {}", n.name), || async {
            let l = capacities
                .list(&ListParams::default().labels(&selector))
                .await
                .unwrap()
                .items;
            (l.len() == 1 && l[0].capacity.is_some()).then_some(l)
        })
        .await;
        assert_eq!(list[0].storage_class_name, class);
        assert_eq!(
            list[0].capacity.as_ref().unwrap().0,
            "10Gi",
            "{:?}",
            list[0]
        );
        assert_eq!(
            list[0]
                .node_topology
                .as_ref()
                .and_then(|t| t.match_labels.clone()),
            Some(BTreeMap::from([(key(&env), n.name.clone())]))
        );
    }

    // A claim the scheduler put on node 1: node 1 provisions it, nobody else calls the driver.
    env.claim(
        "data",
        &class,
        "1Gi",
        json!({"metadata": {"annotations": {SELECTED: nodes[1].name}}}),
    )
    .await;
    let claim = env.wait_bound("data").await;
    let pv_name = claim.spec.unwrap().volume_name.unwrap();
    let pv = env.volumes().get(&pv_name).await.unwrap();
    assert_eq!(affinity_nodes(&pv, &key(&env)), vec![nodes[1].name.clone()]);
    let identity = pv
        .spec
        .as_ref()
        .and_then(|s| s.csi.as_ref())
        .and_then(|c| c.volume_attributes.as_ref())
        .and_then(|a| a.get("storage.kubernetes.io/csiProvisionerIdentity"))
        .cloned()
        .unwrap_or_default();
    assert!(
        identity.ends_with(&format!("-{}-{}", env.name, nodes[1].name)),
        "{identity}"
    );
    let creates: Vec<u64> = nodes
        .iter()
        .map(|n| n.calls.count(Method::CreateVolume))
        .collect();
    assert_eq!(creates, vec![0, 1, 0]);
    // The volume came out of node 1's pool: its capacity object follows.
    let selector = format!(
        "csi.storage.k8s.io/drivername={},csi.storage.k8s.io/managed-by=external-provisioner-{}",
        env.name, nodes[1].name
    );
    poll("node 1's capacity shrunk", || async {
        let l = capacities
            .list(&ListParams::default().labels(&selector))
            .await
            .unwrap()
            .items;
        (l.len() == 1 && l[0].capacity.as_ref().map(|q| q.0.as_str()) == Some("9Gi")).then_some(())
    })
    .await;

    // Deleted: only node 1 calls DeleteVolume; the others see the Released PV and leave it.
    env.api::<PersistentVolumeClaim>()
        .delete("data", &DeleteParams::default())
        .await
        .unwrap();
    env.wait_pv_gone(&pv_name).await;
    for (i, n) in nodes.iter().enumerate() {
        if i != 1 {
            n.provisioner
                .wait_log_line("PV was not provisioned on this node")
                .await;
        }
    }
    let deletes: Vec<u64> = nodes
        .iter()
        .map(|n| n.calls.count(Method::DeleteVolume))
        .collect();
    assert_eq!(deletes, vec![0, 1, 0]);
    for n in &nodes {
        assert!(
            !n.provisioner.log().contains("ProvisioningFailed"),
            "{}",
            n.provisioner.log()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_immediate_claim_is_taken_once_by_a_node_with_room() {
    immediate_claims_race(KubeVersion::V1_36_2).await;
}

/// The same on Kubernetes 1.20, whose claims and annotations are the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_immediate_claim_is_taken_once_by_a_node_with_room_on_v1_20() {
    immediate_claims_race(KubeVersion::V1_20_2).await;
}

async fn immediate_claims_race(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    let class = env
        .class(
            "",
            json!({"volumeBindingMode": "Immediate",
                   "parameters": {"kind": "fast", "csi.storage.k8s.io/fstype": "xfs"}}),
        )
        .await;
    // Node 0 has no room; nodes 1 and 2 compete.
    let nodes = nodes(
        &env,
        &[0, 10 * GI, 10 * GI],
        &[
            "--node-deployment-base-delay=500ms",
            "--node-deployment-max-delay=1s",
        ],
    )
    .await;
    let names: Vec<String> = (0..6).map(|i| format!("data-{i}")).collect();
    for n in &names {
        env.claim(n, &class, "1Gi", json!({})).await;
    }
    let mut taken = BTreeMap::<String, usize>::new();
    for n in &names {
        let claim = env.wait_bound(n).await;
        let owner = selected(&claim).unwrap_or_default().to_owned();
        assert!(
            owner == nodes[1].name || owner == nodes[2].name,
            "{n} went to {owner:?}"
        );
        let pv = env
            .volumes()
            .get(claim.spec.as_ref().unwrap().volume_name.as_ref().unwrap())
            .await
            .unwrap();
        assert_eq!(affinity_nodes(&pv, &key(&env)), vec![owner.clone()]);
        *taken.entry(owner).or_default() += 1;
    }
    // Exactly one CreateVolume per claim, each on the node that took it.
    let creates: Vec<u64> = nodes
        .iter()
        .map(|n| n.calls.count(Method::CreateVolume))
        .collect();
    assert_eq!(creates[0], 0, "{creates:?}");
    for i in [1, 2] {
        assert_eq!(
            creates[i] as usize,
            taken.get(&nodes[i].name).copied().unwrap_or(0),
            "{creates:?} {taken:?}"
        );
    }
    // Node 0 asked about its room as upstream asks: the claim's capabilities, the parameters
    // without the reserved keys, its own segment.
    let asked = nodes[0].calls.get_capacity_requests();
    assert!(!asked.is_empty(), "node 0 never checked its capacity");
    for r in &asked {
        assert_eq!(r.volume_capabilities.len(), 1, "{r:?}");
        assert_eq!(
            r.parameters,
            std::collections::HashMap::from([("kind".to_owned(), "fast".to_owned())]),
            "{r:?}"
        );
        let t = r.accessible_topology.as_ref().unwrap();
        assert_eq!(t.segments.get(&key(&env)), Some(&nodes[0].name), "{r:?}");
    }
    // Losing nodes never wrote the annotation: no ProvisioningFailed anywhere.
    for n in &names {
        assert!(
            env.event_messages(&env.ns, n, "ProvisioningFailed")
                .await
                .is_empty(),
            "{n}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_immediate_binding_a_claim_waits_for_its_annotation() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env
        .class("", json!({"volumeBindingMode": "Immediate"}))
        .await;
    let nodes = nodes(
        &env,
        &[10 * GI, 10 * GI],
        &["--node-deployment-immediate-binding=false"],
    )
    .await;
    env.claim("data", &class, "1Gi", json!({})).await;
    let key = format!("{}/data", env.ns);
    for n in &nodes {
        n.provisioner
            .wait_log_lines(&["claim synced", key.as_str()], 1)
            .await;
    }
    let claim = env
        .api::<PersistentVolumeClaim>()
        .get("data")
        .await
        .unwrap();
    assert_eq!(selected(&claim), None, "nobody competes for it");
    assert!(claim.spec.unwrap().volume_name.is_none());
    env.patch_claim(
        "data",
        json!({"metadata": {"annotations": {SELECTED: nodes[0].name}}}),
    )
    .await;
    env.wait_bound("data").await;
    assert_eq!(nodes[0].calls.count(Method::CreateVolume), 1);
    assert_eq!(nodes[1].calls.count(Method::CreateVolume), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_node_get_info_stops_the_start() {
    let env = Env::new(KubeVersion::V1_36_2, |d| {
        d.node_get_info = Fault {
            error: Some(Failure::new(Code::Internal, "no node here")),
            ..Fault::default()
        };
    })
    .await;
    let mut p = env.provisioner_env(&["--node-deployment"], &[("NODE_NAME", "n1")]);
    let log = p
        .wait_log_line("Failed to get node info from CSI driver")
        .await;
    let deadline = std::time::Instant::now() + common::WAIT;
    while p.running() {
        assert!(std::time::Instant::now() < deadline, "still running");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        log.contains("Failed to get node info from CSI driver") && log.contains("no node here"),
        "{log}"
    );
    assert_eq!(env.calls.node_get_info(), 1);
}

/// §B.5: the owner's driver answers RESOURCE_EXHAUSTED: the claim's annotation is removed and
/// the nodes compete again; the claim ends Bound all the same, provisioned once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_owner_gives_the_claim_back_to_the_race() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let class = env
        .class("", json!({"volumeBindingMode": "Immediate"}))
        .await;
    let nodes = nodes_with(
        &env,
        &[10 * GI, 10 * GI],
        &[
            "--node-deployment-base-delay=300ms",
            "--node-deployment-max-delay=600ms",
        ],
        |i, d| {
            if i == 0 {
                // Node 0's driver refuses its first CreateVolume as out of room.
                d.faults.insert(
                    Method::CreateVolume,
                    Fault {
                        error: Some(Failure::new(Code::ResourceExhausted, "no room after all")),
                        fail_first: Some(1),
                        ..Fault::default()
                    },
                );
            }
        },
    )
    .await;
    // The scheduler's word for an Immediate claim: node 0 first.
    env.claim(
        "data",
        &class,
        "1Gi",
        json!({"metadata": {"annotations": {SELECTED: nodes[0].name}}}),
    )
    .await;
    let claim = env.wait_bound("data").await;
    let failed = env.wait_event(&env.ns, "data", "ProvisioningFailed").await;
    assert!(failed.contains("no room after all"), "{failed}");
    // Provisioned once, by the node its annotation names after the new round: node 0 again
    // (its second CreateVolume) or node 1 (node 0's refused call made nothing).
    let owner = selected(&claim).unwrap_or_default().to_owned();
    let creates: Vec<u64> = nodes
        .iter()
        .map(|n| n.calls.count(Method::CreateVolume))
        .collect();
    if owner == nodes[0].name {
        assert_eq!(creates, vec![2, 0]);
    } else {
        assert_eq!(owner, nodes[1].name);
        assert_eq!(creates, vec![1, 1]);
    }
    let pv = env
        .volumes()
        .get(claim.spec.as_ref().unwrap().volume_name.as_ref().unwrap())
        .await
        .unwrap();
    assert_eq!(affinity_nodes(&pv, &key(&env)), vec![owner]);
}

/// §B.4 step 3: a GetCapacity that fails does not stop a node from taking the claim (upstream
/// proceeds), and §B.3: a class whose allowed topologies exclude a node is never taken by it
/// (no capacity check, no CreateVolume there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_capacity_check_proceeds_and_allowed_topologies_exclude() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let nodes = nodes_with(
        &env,
        &[10 * GI, 10 * GI],
        &[
            "--node-deployment-base-delay=300ms",
            "--node-deployment-max-delay=600ms",
        ],
        |i, d| {
            if i == 1 {
                d.faults.insert(
                    Method::GetCapacity,
                    Fault {
                        error: Some(Failure::new(Code::Unavailable, "pool offline")),
                        ..Fault::default()
                    },
                );
            }
        },
    )
    .await;
    // Only node 1 is allowed: node 0 never competes, node 1's check fails and it goes on.
    let class = env
        .class(
            "",
            json!({"volumeBindingMode": "Immediate",
                   "allowedTopologies": [{"matchLabelExpressions": [
                       {"key": key(&env), "values": [nodes[1].name]}]}]}),
        )
        .await;
    env.claim("data", &class, "1Gi", json!({})).await;
    let claim = env.wait_bound("data").await;
    assert_eq!(selected(&claim), Some(nodes[1].name.as_str()));
    assert!(
        nodes[1].calls.count(Method::GetCapacity) >= 1,
        "node 1 checked its room"
    );
    assert_eq!(nodes[1].calls.count(Method::CreateVolume), 1);
    assert_eq!(nodes[0].calls.count(Method::GetCapacity), 0);
    assert_eq!(nodes[0].calls.count(Method::CreateVolume), 0);
    nodes[0]
        .provisioner
        .wait_log_line("are not compatible with node")
        .await;
}
