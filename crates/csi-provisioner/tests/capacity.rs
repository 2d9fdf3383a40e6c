//! Storage capacity tracking (`--enable-capacity`, issue 31) against a real kube-apiserver
//! v1.36.2 and the test driver's storage pools: one CSIStorageCapacity per (topology segment x
//! WaitForFirstConsumer class) with upstream's shape, GetCapacity asked as upstream asks it, a
//! pool's change written within the poll interval and nothing written when nothing changed,
//! objects of a deleted class deleted, an object deleted by hand made again, the gauges, and the
//! start-up checks of `NAMESPACE`, `POD_NAME` and the owner.

mod common;

use std::collections::BTreeMap;

use common::{Env, map, poll};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::storage::v1::{CSIStorageCapacity, StorageClass};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use plugreg_csi_test_driver::{Capacity, Method};
use plugreg_testpeers::KubeVersion;
use serde_json::json;

const GI: i64 = 1 << 30;

/// The test's segment of `zone` (a topology key of its own driver, so tests sharing the API
/// server do not see each other's nodes).
fn segment(env_name: &str, zone: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(format!("{env_name}/zone"), zone.to_owned())])
}

async fn objects(env: &Env) -> Vec<CSIStorageCapacity> {
    let api: Api<CSIStorageCapacity> = Api::namespaced(env.client.clone(), &env.ns);
    api.list(&ListParams::default().labels(&format!(
        "csi.storage.k8s.io/drivername={},csi.storage.k8s.io/managed-by=external-provisioner",
        env.name
    )))
    .await
    .unwrap()
    .items
}

/// The objects once there are `n` of them and `check` holds for the set.
async fn wait_objects(
    env: &Env,
    n: usize,
    what: &str,
    check: impl Fn(&[CSIStorageCapacity]) -> bool,
) -> Vec<CSIStorageCapacity> {
    poll(what, || async {
        let list = objects(env).await;
        (list.len() == n && check(&list)).then_some(list)
    })
    .await
}

fn find<'a>(
    list: &'a [CSIStorageCapacity],
    class: &str,
    segment: &BTreeMap<String, String>,
) -> &'a CSIStorageCapacity {
    list.iter()
        .find(|o| {
            o.storage_class_name == class
                && o.node_topology
                    .as_ref()
                    .and_then(|t| t.match_labels.as_ref())
                    == Some(segment)
        })
        .unwrap_or_else(|| panic!("no object of {class} {segment:?} in {list:#?}"))
}

fn capacity_of(o: &CSIStorageCapacity) -> Option<&str> {
    o.capacity.as_ref().map(|q| q.0.as_str())
}

/// A test's world whose driver lives in zone `a` of its own topology key, with `pools` as its
/// storage pools (the pool of zone `a` is the driver's own); returns it and zone `a`.
async fn zoned_env(pools: &Capacity) -> (Env, BTreeMap<String, String>) {
    let pools = pools.clone();
    let mut zone_a = BTreeMap::new();
    let env = Env::new(KubeVersion::V1_36_2, |d| {
        d.capacity = pools;
        d.accessibility_constraints = true;
        zone_a = segment(&d.name, "a");
        d.topology = zone_a.clone();
    })
    .await;
    (env, zone_a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_objects_follow_segments_classes_and_the_driver() {
    let pools = Capacity::default();
    pools.set_volume_size_limits(None, Some(5 * GI));
    let (env, zone_a) = zoned_env(&pools).await;
    let zone_b = segment(&env.name, "b");
    pools.set(zone_a.clone(), 10 * GI);
    pools.set(zone_b.clone(), 1536 << 20);
    let key = format!("{}/zone", env.name);
    // Two zones; a node without the zone label has no segment.
    let node = |n: &str| format!("{}-{n}", env.ns);
    env.topology_node(&node("a1"), &[(&key, "a")], &[&key])
        .await;
    env.topology_node(&node("a2"), &[(&key, "a")], &[&key])
        .await;
    env.topology_node(&node("b1"), &[(&key, "b")], &[&key])
        .await;
    env.topology_node(&node("x1"), &[], &[&key]).await;
    let wffc = json!({"volumeBindingMode": "WaitForFirstConsumer"});
    let fast = env
        .class(
            "-fast",
            json!({"volumeBindingMode": "WaitForFirstConsumer",
                   "parameters": {"kind": "fast", "csi.storage.k8s.io/fstype": "xfs"}}),
        )
        .await;
    let slow = env.class("-slow", wffc).await;
    let _immediate = env
        .class("-immediate", json!({"volumeBindingMode": "Immediate"}))
        .await;

    let http = common::free_local_addr();
    let p = env.provisioner_env(
        &[
            "--enable-capacity",
            "--capacity-poll-interval=2s",
            "--capacity-ownerref-level=-1",
            &format!("--http-endpoint={http}"),
        ],
        &[("NAMESPACE", &env.ns)],
    );
    p.wait_log_line("using the CSIStorageCapacity v1 API").await;
    p.wait_log_line("Started Capacity Controller").await;

    // 2 segments x 2 WFFC classes; the Immediate class has none.
    let list = wait_objects(&env, 4, "four objects", |l| {
        l.iter().all(|o| o.capacity.is_some())
    })
    .await;
    // Capacity tracking's requests and watches share the provisioner's HTTP/2 connection (no
    // leader election here: it would add one of its own).
    let port = env.cluster.api.port();
    poll("one connection to the API server", || async {
        (p.connections_to(port) == 1).then_some(())
    })
    .await;
    let o = find(&list, &fast, &zone_a);
    assert!(
        o.metadata.name.as_ref().unwrap().starts_with("csisc-"),
        "{o:?}"
    );
    assert_eq!(o.metadata.generate_name.as_deref(), Some("csisc-"));
    assert_eq!(
        o.metadata.labels.clone().unwrap(),
        map(&[
            ("csi.storage.k8s.io/drivername", &env.name),
            ("csi.storage.k8s.io/managed-by", "external-provisioner"),
        ])
    );
    assert!(o.metadata.owner_references.is_none(), "level -1: no owner");
    assert_eq!(capacity_of(o), Some("10Gi"));
    assert_eq!(
        o.maximum_volume_size.as_ref().map(|q| q.0.as_str()),
        Some("5Gi")
    );
    assert_eq!(capacity_of(find(&list, &slow, &zone_b)), Some("1536Mi"));

    // GetCapacity as upstream asks it: the class's parameters unfiltered, no capabilities,
    // the segment as the topology.
    let asked = env.calls.get_capacity_requests();
    let fast_b = asked
        .iter()
        .find(|r| {
            r.parameters.get("kind").map(String::as_str) == Some("fast")
                && r.accessible_topology.as_ref().map(|t| &t.segments)
                    == Some(&zone_b.clone().into_iter().collect())
        })
        .expect("GetCapacity of fast in zone b");
    assert_eq!(
        fast_b
            .parameters
            .get("csi.storage.k8s.io/fstype")
            .map(String::as_str),
        Some("xfs")
    );
    assert!(fast_b.volume_capabilities.is_empty());

    // Nothing changed: polls answer the same, nothing is written.
    let versions: Vec<_> = list
        .iter()
        .map(|o| o.metadata.resource_version.clone())
        .collect();
    let seen = env.calls.count(Method::GetCapacity);
    env.calls.wait_for(Method::GetCapacity, seen + 8).await;
    let again = objects(&env).await;
    let mut now: Vec<_> = again
        .iter()
        .map(|o| o.metadata.resource_version.clone())
        .collect();
    let mut before = versions.clone();
    now.sort();
    before.sort();
    assert_eq!(now, before, "no write without a change");

    // A pool's change is written within the poll interval.
    pools.set(zone_b.clone(), 2 * GI);
    wait_objects(&env, 4, "zone b at 2Gi", |l| {
        capacity_of(find(l, &slow, &zone_b)) == Some("2Gi")
            && capacity_of(find(l, &fast, &zone_b)) == Some("2Gi")
    })
    .await;

    // An object deleted by hand is made again.
    let api: Api<CSIStorageCapacity> = Api::namespaced(env.client.clone(), &env.ns);
    let gone = find(&objects(&env).await, &slow, &zone_a)
        .metadata
        .name
        .clone()
        .unwrap();
    api.delete(&gone, &DeleteParams::default()).await.unwrap();
    wait_objects(&env, 4, "the deleted object made again", |l| {
        l.iter()
            .all(|o| o.metadata.name.as_deref() != Some(gone.as_str()))
            && capacity_of(find(l, &slow, &zone_a)) == Some("10Gi")
    })
    .await;

    // The gauges.
    let (status, body) = common::http_get(http, "/metrics");
    assert_eq!(status, 200);
    for line in [
        "csistoragecapacities_desired_goal 4",
        "csistoragecapacities_desired_current 4",
        "csistoragecapacities_obsolete 0",
        "# HELP csistoragecapacities_desired_goal [ALPHA] ",
        "method_name=\"/csi.v1.Controller/GetCapacity\"",
        "workqueue_adds_total{name=\"csistoragecapacity\"}",
    ] {
        assert!(body.contains(line), "{line} in {body}");
    }

    // A class deleted: its objects go.
    let classes: Api<StorageClass> = Api::all(env.client.clone());
    classes
        .delete(&fast, &DeleteParams::default())
        .await
        .unwrap();
    wait_objects(&env, 2, "only the slow class's objects", |l| {
        l.iter().all(|o| o.storage_class_name == slow)
    })
    .await;
    // A zone's last node gone: its objects go.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(env.client.clone());
    nodes
        .delete(&node("b1"), &DeleteParams::default())
        .await
        .unwrap();
    wait_objects(&env, 1, "only zone a", |l| {
        capacity_of(find(l, &slow, &zone_a)) == Some("10Gi")
    })
    .await;
    assert!(!p.log().contains("panicked"), "{}", p.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_start_up_needs_its_namespace_pod_and_owner() {
    let env = Env::new(KubeVersion::V1_36_2, |d| {
        d.capacity = Capacity::with_pools([(BTreeMap::new(), GI)]);
    })
    .await;
    let exit = |mut p: common::Provisioner| async move {
        poll("the provisioner to exit", || {
            let running = p.running();
            let log = p.log();
            async move { (!running).then_some(log) }
        })
        .await
    };
    // No NAMESPACE.
    let log = exit(env.provisioner_env(&["--enable-capacity"], &[])).await;
    assert!(
        log.contains("need NAMESPACE env variable for CSIStorageCapacity objects"),
        "{log}"
    );
    // The default level 1 needs POD_NAME.
    let log = exit(env.provisioner_env(&["--enable-capacity"], &[("NAMESPACE", &env.ns)])).await;
    assert!(
        log.contains("need POD_NAME env variable to determine CSIStorageCapacity owner"),
        "{log}"
    );
    // A bare pod has no controller to own the objects at level 1.
    plugreg_testpeers::rbac::default_service_account(&env.client, &env.ns)
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.ns);
    let pod = pods
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "csi-controller-0"},
                "spec": {"containers": [{"name": "c", "image": "plugreg/none"}]},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let env_vars = [
        ("NAMESPACE", env.ns.as_str()),
        ("POD_NAME", "csi-controller-0"),
    ];
    let log = exit(env.provisioner_env(&["--enable-capacity"], &env_vars)).await;
    assert!(
        log.contains("look up owner(s) of pod: v1/Pod ")
            && log.contains("has no controlling owner, cannot unwind the ownership further"),
        "{log}"
    );
    // Level 0: the pod owns them.
    let _class = env
        .class(
            "-wffc",
            json!({"volumeBindingMode": "WaitForFirstConsumer"}),
        )
        .await;
    env.topology_node(&format!("{}-n1", env.ns), &[], &[]).await;
    let p = env.provisioner_env(
        &["--enable-capacity", "--capacity-ownerref-level=0"],
        &env_vars,
    );
    p.wait_log_line("using v1/Pod csi-controller-0 as owner of CSIStorageCapacity objects")
        .await;
    let list = wait_objects(&env, 1, "one object for all nodes", |_| true).await;
    let refs = list[0].metadata.owner_references.clone().unwrap();
    assert_eq!(refs.len(), 1);
    assert_eq!(refs[0].kind, "Pod");
    assert_eq!(refs[0].uid, pod.metadata.uid.unwrap());
    assert_eq!(refs[0].controller, Some(true));
    assert_eq!(refs[0].block_owner_deletion, None);
    assert_eq!(
        list[0]
            .node_topology
            .as_ref()
            .and_then(|t| t.match_labels.clone())
            .filter(|m| !m.is_empty()),
        None,
        "a driver without topology keys: one segment for all nodes"
    );
    assert_eq!(capacity_of(&list[0]), Some("1Gi"));
}

/// A volume provisioned, and one deleted, refresh their class's objects at once (§A.9.3), long
/// before the next poll (an hour here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisioning_and_deletion_refresh_the_class_before_the_next_poll() {
    let pools = Capacity::default();
    let (env, zone_a) = zoned_env(&pools).await;
    pools.set(zone_a.clone(), 10 * GI);
    let key = format!("{}/zone", env.name);
    let node = format!("{}-a1", env.ns);
    env.topology_node(&node, &[(&key, "a")], &[&key]).await;
    let class = env
        .class(
            "",
            json!({"volumeBindingMode": "WaitForFirstConsumer", "reclaimPolicy": "Delete"}),
        )
        .await;
    let _p = env.provisioner_env(
        &[
            "--enable-capacity",
            "--capacity-poll-interval=1h",
            "--capacity-ownerref-level=-1",
        ],
        &[("NAMESPACE", &env.ns)],
    );
    wait_objects(&env, 1, "the object at 10Gi", |l| {
        capacity_of(&l[0]) == Some("10Gi")
    })
    .await;
    // The scheduler's choice, written as it writes it.
    env.claim(
        "data",
        &class,
        "3Gi",
        json!({"metadata": {"annotations": {"volume.kubernetes.io/selected-node": node}}}),
    )
    .await;
    let claim = env.wait_bound("data").await;
    wait_objects(&env, 1, "the object at 7Gi", |l| {
        capacity_of(&l[0]) == Some("7Gi")
    })
    .await;
    let pvcs: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::namespaced(env.client.clone(), &env.ns);
    pvcs.delete("data", &DeleteParams::default()).await.unwrap();
    env.wait_pv_gone(claim.spec.unwrap().volume_name.as_deref().unwrap())
        .await;
    wait_objects(&env, 1, "the object back at 10Gi", |l| {
        capacity_of(&l[0]) == Some("10Gi")
    })
    .await;
}

/// Kubernetes 1.20 serves CSIStorageCapacity only as v1alpha1: the probe answers 404, the
/// v1beta1 API is chosen as upstream chooses it, its objects are never listed and nothing is
/// written, and provisioning goes on unaffected (§A.4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_v1_20_capacity_waits_and_provisioning_goes_on() {
    let env = Env::new(KubeVersion::V1_20_2, |d| {
        d.capacity = Capacity::with_pools([(BTreeMap::new(), GI)]);
    })
    .await;
    let class = env.class("", json!({})).await;
    let p = env.provisioner_env(
        &["--enable-capacity", "--capacity-ownerref-level=-1"],
        &[("NAMESPACE", &env.ns)],
    );
    p.wait_log_line("using the CSIStorageCapacity v1beta1 API")
        .await;
    env.claim("data", &class, "1Mi", json!({})).await;
    env.wait_bound("data").await;
    assert_eq!(env.calls.count(Method::GetCapacity), 0);
    assert!(
        !p.log().contains("Started Capacity Controller"),
        "{}",
        p.log()
    );
}
