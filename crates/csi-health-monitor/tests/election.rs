//! `csi-external-health-monitor-controller` as a Deployment runs it, against a real
//! kube-apiserver v1.36.2 and the test driver (checklist items 20-23 of
//! `upstream-external-health-monitor.md` §17):
//!
//! - two replicas, each in a UTS namespace of its own with its own host name (the Lease
//!   holder identity is the host name, as in a pod) and its own driver: only the leader calls
//!   its driver after start-up; the Lease is `external-health-monitor-leader-<driver>` with
//!   the `--leader-election-labels`; each new leader records a `LeaderElection` event;
//!   `/healthz/leader-election` answers `ok`; `/metrics` counts the leader's ListVolumes under
//!   the driver's name; the standby takes over when the leader dies, and exits 1 when the Lease
//!   is taken from it (the test needs root for the UTS namespaces);
//! - with exactly the sample RBAC (`deploy/`'s copy of upstream's, else upstream's written
//!   here) under a token of its ServiceAccount it reports an abnormal volume, node watcher and
//!   leader election on, and nothing is refused; without the pods and nodes rights it still
//!   works when the node watcher is off.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use common::{BIN, DRIVER, Env, NS, driver_config};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams};
use plugreg_csi_test_driver::{Calls, Method};
use plugreg_testpeers::KubeVersion;
use plugreg_testpeers::rbac::{self, rule, rules};
use plugreg_testpeers::sidecar::{self, LoggedSidecar};
use serde_json::{Value, json};

/// The Lease of [`DRIVER`]: `external-health-monitor-leader-` and the sanitised name.
const LEASE: &str = "external-health-monitor-leader-health-csi-plugreg-test";
const ABNORMAL: &str = "VolumeConditionAbnormal";

/// A replica's health monitor: the binary in a UTS namespace whose host name is `host`,
/// against the driver at `socket` and the test's API server (`--v=5`), then `args`.
fn replica(env: &Env, host: &str, socket: &Path, args: &[String]) -> LoggedSidecar {
    let mut cmd = sidecar::command("unshare");
    cmd.args([
        "--uts",
        "--",
        "sh",
        "-c",
        "hostname \"$0\" && exec \"$@\"",
        host,
        BIN,
    ])
    .arg(format!("--csi-address={}", socket.display()))
    .arg(format!(
        "--kubeconfig={}",
        env.api.kubeconfig_path().display()
    ))
    .arg("--v=5")
    .args(args);
    let log = env.dir.path().join(format!("{host}.log"));
    env.logs.lock().unwrap().push(log.clone());
    LoggedSidecar::spawn(cmd, log)
}

/// The holder of [`LEASE`] in [`NS`], once it is `want`.
async fn wait_holder(env: &Env, want: &str) -> Lease {
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), NS);
    env.poll(&format!("the Lease held by {want}"), || async {
        let l = leases.get_opt(LEASE).await.ok().flatten()?;
        let holder = l.spec.as_ref()?.holder_identity.as_deref()?;
        (holder == want).then_some(l)
    })
    .await
}

/// The `LeaderElection` event on [`LEASE`] saying `<identity> became leader`.
async fn wait_became_leader(env: &Env, identity: &str) -> Event {
    let events: Api<Event> = Api::namespaced(env.client.clone(), NS);
    let message = format!("{identity} became leader");
    env.poll(&format!("the event {message:?}"), || async {
        let list = events
            .list(&ListParams::default().fields(&format!("involvedObject.name={LEASE}")))
            .await
            .ok()?;
        list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some("LeaderElection")
                && e.message.as_deref() == Some(message.as_str())
        })
    })
    .await
}

/// Waits until `calls` has answered `n` more ListVolumes than `from`.
async fn more_passes(env: &Env, calls: &Calls, from: u64, n: u64) {
    env.poll(&format!("{n} more ListVolumes"), || async {
        (calls.count(Method::ListVolumes) >= from + n).then_some(())
    })
    .await;
}

/// The lines of `log` that report a refusal by the API server.
fn refused(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.to_lowercase().contains("forbidden") || l.contains("code: 403"))
        .collect()
}

/// Checklist 20, 21, 23 and 5 (ListVolumes preferred): two replicas, each with its own
/// driver. The first to start leads: the Lease `external-health-monitor-leader-<driver>`
/// (sanitised) holds its host name and the `--leader-election-labels`, a `LeaderElection`
/// event says it became leader, its driver is asked ListVolumes again and again (never
/// ControllerGetVolume, although the driver has GET_VOLUME), the abnormal volume gets its
/// event; `/metrics` counts those calls under the driver's name; the standby made its
/// start-up calls only. Both answer `ok` on `/healthz/leader-election`. `--kube-api-qps` and
/// `--kube-api-burst` are taken. The leader killed, the standby takes over (its own event, its
/// driver asked); the Lease taken from it by another holder, it exits 1 ("Stopped leading").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_monitors_and_a_lost_lease_is_exit_1() {
    let env = Env::new(KubeVersion::V1_36_2, driver_config(&["vol-a"], true)).await;
    env.driver.set_condition("vol-a", Some("disk gone"));
    env.bound_claim("a", "vol-a").await;
    let socket_b = env.dir.path().join("csi-b.sock");
    let config_b = driver_config(&["vol-a"], true);
    let calls_b = config_b.calls.clone();
    let driver_b = plugreg_csi_test_driver::start(config_b, &socket_b)
        .await
        .unwrap();
    driver_b.set_condition("vol-a", Some("disk gone"));

    let args = |http: SocketAddr| -> Vec<String> {
        [
            "--leader-election",
            &format!("--leader-election-namespace={NS}"),
            "--leader-election-lease-duration=3s",
            "--leader-election-renew-deadline=2s",
            "--leader-election-retry-period=500ms",
            "--leader-election-labels=app:health-monitor,tier:storage",
            "--kube-api-qps=50",
            "--kube-api-burst=100",
            "--list-volumes-interval=300ms",
            &format!("--http-endpoint={http}"),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
    };
    let (http_a, http_b) = (sidecar::free_addr(), sidecar::free_addr());
    let mut a = replica(&env, "replica-a", &env.socket, &args(http_a));
    let lease = wait_holder(&env, "replica-a").await;
    let labels = lease.metadata.labels.unwrap_or_default();
    assert_eq!(
        labels.get("app").map(String::as_str),
        Some("health-monitor")
    );
    assert_eq!(labels.get("tier").map(String::as_str), Some("storage"));
    let spec = lease.spec.unwrap();
    assert_eq!(spec.lease_duration_seconds, Some(3));

    let event = wait_became_leader(&env, "replica-a").await;
    assert_eq!(event.type_.as_deref(), Some("Normal"));
    let obj = &event.involved_object;
    assert_eq!(obj.kind.as_deref(), Some("Lease"));
    assert_eq!(obj.api_version.as_deref(), Some("coordination.k8s.io/v1"));
    assert_eq!(obj.namespace.as_deref(), Some(NS));
    // csi-lib-utils' recorder: the lock name with the driver as it is, then the host name.
    assert_eq!(
        event.source.and_then(|s| s.component).as_deref(),
        Some(format!("external-health-monitor-leader-{DRIVER}/replica-a").as_str())
    );

    let mut b = replica(&env, "replica-b", &socket_b, &args(http_b));
    env.poll("the standby trying for the Lease", || async {
        b.log()
            .to_lowercase()
            .contains("attempting to acquire leader lease")
            .then_some(())
    })
    .await;
    env.wait_event("a", ABNORMAL, "disk gone", 1).await;
    // The leader keeps listing; the standby asks its driver nothing after start-up.
    let from = env.calls.count(Method::ListVolumes);
    more_passes(&env, &env.calls, from, 3).await;
    assert_eq!(calls_b.count(Method::ListVolumes), 0, "{}", b.log());
    assert_eq!(calls_b.count(Method::ControllerGetVolume), 0);
    assert_eq!(calls_b.count(Method::Probe), 1);
    assert_eq!(calls_b.count(Method::GetPluginInfo), 1);
    // ListVolumes is preferred over ControllerGetVolume.
    assert_eq!(env.calls.count(Method::ControllerGetVolume), 0);
    assert_eq!(
        env.said("a").await,
        [(ABNORMAL.into(), "disk gone".into(), 1)]
    );

    for http in [http_a, http_b] {
        assert_eq!(
            sidecar::http_get(http, "/healthz/leader-election"),
            (200, "ok".to_owned())
        );
    }
    let list_volumes = format!(
        "csi_sidecar_operations_seconds_count{{driver_name=\"{DRIVER}\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/ListVolumes\"}}"
    );
    let body = sidecar::wait_for_body(http_a, "/metrics", &list_volumes);
    for want in [
        "csi_sidecar_operations_seconds_count{driver_name=\"unknown-driver\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/Probe\"} 1",
        "csi_sidecar_operations_seconds_count{driver_name=\"unknown-driver\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Identity/GetPluginInfo\"} 1",
        "process_start_time_seconds ",
    ] {
        assert!(body.contains(want), "{want} missing:\n{body}");
    }
    assert!(!body.contains("ControllerGetVolume"), "{body}");
    let (code, standby) = sidecar::http_get(http_b, "/metrics");
    assert_eq!(code, 200);
    assert!(
        !standby.contains("/csi.v1.Controller/ListVolumes"),
        "{standby}"
    );

    // The leader dies without giving the Lease up: the standby takes over once it expires.
    a.kill();
    wait_holder(&env, "replica-b").await;
    wait_became_leader(&env, "replica-b").await;
    more_passes(&env, &calls_b, 0, 2).await;

    // Another holder takes the Lease (as a replica whose clock says ours expired would).
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), NS);
    let now = serde_json::to_value(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
        k8s_openapi::jiff::Timestamp::now(),
    ))
    .unwrap();
    leases
        .patch(
            LEASE,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {
                "holderIdentity": "thief",
                "leaseDurationSeconds": 3600,
                "acquireTime": now,
                "renewTime": now,
            }})),
        )
        .await
        .unwrap();
    assert_eq!(b.exit_code().await, 1, "{}", b.log());
    assert!(b.log().contains("\"Stopped leading\""), "{}", b.log());
    let holder = leases
        .get(LEASE)
        .await
        .unwrap()
        .spec
        .unwrap()
        .holder_identity;
    assert_eq!(holder.as_deref(), Some("thief"), "the replica took it back");
    driver_b.stop().await.unwrap();
}

/// `deploy/`'s controller RBAC.
fn rbac_yaml() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/base/controller/rbac.yaml")
}

/// The sample RBAC and the ServiceAccount it binds: `deploy/`'s copy of upstream's (the
/// driver in its cluster-wide names, bound to `csi-controller`) when `deploy/` has one, else
/// upstream's own (`deploy/kubernetes/external-health-monitor-controller/rbac.yaml` of v0.18.0,
/// §13), written here. Documents in the order ClusterRole, its binding, Role, its binding.
fn sample_rbac() -> (Vec<Value>, &'static str) {
    let deployed = rbac::sample(
        &rbac_yaml(),
        "external-health-monitor-controller",
        DRIVER,
        NS,
    )
    .unwrap_or_default();
    if !deployed.is_empty() {
        return (deployed, "csi-controller");
    }
    let account = "csi-external-health-monitor-controller";
    let read = json!(["get", "list", "watch"]);
    let subjects = json!([{"kind": "ServiceAccount", "name": account, "namespace": NS}]);
    let upstream = vec![
        json!({
            "kind": "ClusterRole",
            "metadata": {"name": "external-health-monitor-controller-runner"},
            "rules": [
                {"apiGroups": [""], "resources": ["persistentvolumes"], "verbs": read},
                {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": read},
                {"apiGroups": [""], "resources": ["nodes"], "verbs": read},
                {"apiGroups": [""], "resources": ["pods"], "verbs": read},
                {"apiGroups": [""], "resources": ["events"],
                 "verbs": ["get", "list", "watch", "create", "patch"]},
            ],
        }),
        json!({
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "csi-external-health-monitor-controller-role"},
            "subjects": subjects,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "external-health-monitor-controller-runner"},
        }),
        json!({
            "kind": "Role",
            "metadata": {"name": "external-health-monitor-controller-cfg"},
            "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                       "verbs": ["get", "watch", "list", "delete", "update", "create"]}],
        }),
        json!({
            "kind": "RoleBinding",
            "metadata": {"name": "csi-external-health-monitor-controller-role-cfg"},
            "subjects": subjects,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": "external-health-monitor-controller-cfg"},
        }),
    ];
    (upstream, account)
}

/// A kubeconfig with a fresh token of ServiceAccount [`NS`]/`account`.
async fn token_of(env: &Env, account: &str) -> PathBuf {
    let path = env.dir.path().join(format!("{account}.kubeconfig"));
    env.api
        .service_account_kubeconfig(NS, account, &path)
        .await
        .unwrap();
    path
}

/// The health monitor started with the kubeconfig `kubeconfig` (`--v=5`), then `args`.
fn monitor_as(env: &Env, name: &str, kubeconfig: &Path, args: &[&str]) -> LoggedSidecar {
    let cmd = sidecar::controller_command(BIN, &env.socket, kubeconfig, args);
    let log = env.dir.path().join(format!("{name}.log"));
    env.logs.lock().unwrap().push(log.clone());
    LoggedSidecar::spawn(cmd, log)
}

/// Checklist 22: the sample RBAC is exactly upstream's (§13: PVs, PVCs, nodes and pods get,
/// list and watch; events get, list, watch, create and patch; the Lease Role), and with only
/// those rights, node watcher and leader election on, an abnormal volume is reported and the
/// API server refuses nothing (the node watcher's caches sync: the checks start only then).
/// Without the pods and nodes rights the node watcher cannot work (refused), but with it off
/// the monitor reports as before and nothing is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_with_exactly_the_sample_rbac_and_without_node_rights_when_the_watcher_is_off() {
    let env = Env::new(
        KubeVersion::V1_36_2,
        driver_config(&["vol-a", "vol-b"], true),
    )
    .await;
    let (docs, account) = sample_rbac();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
    );
    let read = ["get", "list", "watch"];
    let mut want = vec![
        rule("", "persistentvolumes", &read),
        rule("", "persistentvolumeclaims", &read),
        rule("", "nodes", &read),
        rule("", "pods", &read),
        rule("", "events", &["get", "list", "watch", "create", "patch"]),
    ];
    want.sort();
    assert_eq!(rules(&docs[0]), want);
    assert_eq!(
        rules(&docs[2]),
        vec![rule(
            "coordination.k8s.io",
            "leases",
            &["get", "watch", "list", "delete", "update", "create"]
        )]
    );
    rbac::create(&env.client, NS, account, &docs).await.unwrap();
    let kubeconfig = token_of(&env, account).await;

    env.driver.set_condition("vol-a", Some("disk gone"));
    env.bound_claim("a", "vol-a").await;
    env.bound_claim("b", "vol-b").await;
    let http = sidecar::free_addr();
    let mut full = monitor_as(
        &env,
        "sample-rbac",
        &kubeconfig,
        &[
            "--leader-election",
            &format!("--leader-election-namespace={NS}"),
            &format!("--http-endpoint={http}"),
            "--enable-node-watcher",
            "--list-volumes-interval=300ms",
        ],
    );
    env.wait_event("a", ABNORMAL, "disk gone", 1).await;
    let identity = wait_holder_any(&env).await;
    wait_became_leader(&env, &identity).await;
    let log = full.log();
    assert!(refused(&log).is_empty(), "refused:\n{log}");
    full.kill();

    // The same rights less pods and nodes, for another account; no Lease needed.
    let less = "csi-controller-no-nodes";
    let mut role = docs[0].clone();
    role["metadata"]["name"] = json!(format!("{DRIVER}-{less}"));
    role["rules"]
        .as_array_mut()
        .unwrap()
        .retain(|r| !["nodes", "pods"].contains(&r["resources"][0].as_str().unwrap()));
    let mut binding = docs[1].clone();
    binding["metadata"]["name"] = json!(format!("{DRIVER}-{less}"));
    binding["roleRef"]["name"] = role["metadata"]["name"].clone();
    binding["subjects"][0]["name"] = json!(less);
    assert_eq!(
        rules(&role)
            .iter()
            .map(|r| r.1.as_str())
            .collect::<Vec<_>>(),
        ["events", "persistentvolumeclaims", "persistentvolumes"]
    );
    rbac::create(&env.client, NS, less, &[role, binding])
        .await
        .unwrap();
    let kubeconfig = token_of(&env, less).await;
    let watching = monitor_as(
        &env,
        "no-node-rights-watching",
        &kubeconfig,
        &["--enable-node-watcher"],
    );
    env.poll("the node watcher refused", || async {
        (!refused(&watching.log()).is_empty()).then_some(())
    })
    .await;
    drop(watching);

    env.driver.set_condition("vol-b", Some("slow disk"));
    let off = monitor_as(
        &env,
        "no-node-rights",
        &kubeconfig,
        &["--list-volumes-interval=300ms"],
    );
    env.wait_event("b", ABNORMAL, "slow disk", 1).await;
    let from = env.calls.count(Method::ListVolumes);
    more_passes(&env, &env.calls, from, 2).await;
    let log = off.log();
    assert!(refused(&log).is_empty(), "refused:\n{log}");
}

/// The holder of [`LEASE`] once there is one.
async fn wait_holder_any(env: &Env) -> String {
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), NS);
    env.poll("the Lease held", || async {
        let l = leases.get_opt(LEASE).await.ok().flatten()?;
        l.spec?.holder_identity.filter(|h| !h.is_empty())
    })
    .await
}
