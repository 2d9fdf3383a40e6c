//! What makes `csi-attacher` a drop-in beyond attaching, each against a real kube-apiserver
//! (v1.20.2 and v1.36.2):
//! * it runs with exactly upstream's sample RBAC (`deploy/base`'s attacher part) under a token
//!   of its ServiceAccount: attach, detach and the PV finalizer work, and nothing is refused;
//! * a Lease taken by another holder makes it exit 1 with "Stopped leading", as upstream, its
//!   `/healthz/leader-election` answering 200 until then; so does a leader cut off from the API
//!   server (its renewals time out);
//! * `--max-grpc-log-length` caps each logged gRPC response as csi-lib-utils does (-1: whole).

mod common;

use std::path::{Path, PathBuf};

use common::{Env, NODE_ID, free_local_addr, http_get, poll};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use plugreg_testpeers::KubeVersion;
use plugreg_testpeers::rbac::{self, rule, rules};
use serde_json::json;

/// `deploy/`'s controller RBAC, upstream's samples.
fn rbac_yaml() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/base/controller/rbac.yaml")
}

const ACCOUNT: &str = "csi-controller";

/// Creates the attacher's RBAC of `deploy/` and its ServiceAccount; returns a kubeconfig with a
/// token of that account.
async fn service_account_kubeconfig(env: &Env) -> PathBuf {
    let docs = rbac::sample(&rbac_yaml(), "external-attacher", &env.name, &env.ns).unwrap();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
    );
    // Exactly upstream's sample (external-attacher v4.12.0 deploy/kubernetes/rbac.yaml).
    assert_eq!(
        rules(&docs[0]),
        vec![
            rule("", "persistentvolumes", &["get", "list", "watch", "patch"]),
            rule("storage.k8s.io", "csinodes", &["get", "list", "watch"]),
            rule(
                "storage.k8s.io",
                "volumeattachments",
                &["get", "list", "watch", "patch"]
            ),
            rule("storage.k8s.io", "volumeattachments/status", &["patch"]),
        ]
    );
    assert_eq!(
        rules(&docs[2]),
        vec![rule(
            "coordination.k8s.io",
            "leases",
            &["get", "watch", "list", "delete", "update", "create"]
        )]
    );
    rbac::create(&env.client, &env.ns, ACCOUNT, &docs)
        .await
        .unwrap();
    let path = env.dir.path().join("sa.kubeconfig");
    env.api
        .service_account_kubeconfig(&env.ns, ACCOUNT, &path)
        .await
        .unwrap();
    path
}

/// Checklist 19: with exactly the sample RBAC, plus `get` on the one Secret a PV names for
/// ControllerPublish (what upstream's README asks of a driver that uses secrets), an attach
/// with that secret, a detach and the PV finalizer's removal work, under leader election, and
/// the API server refuses nothing.
async fn runs_with_the_sample_rbac(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    let kubeconfig = service_account_kubeconfig(&env).await;
    env.secret("publish", &[("user", "admin")]).await;
    let pp = PostParams::default();
    let get_secret: Role = serde_json::from_value(json!({
        "metadata": {"name": "publish-secret-reader"},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["publish"],
            "verbs": ["get"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(env.client.clone(), &env.ns)
        .create(&pp, &get_secret)
        .await
        .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "publish-secret-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
            "name": "publish-secret-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": env.ns}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(env.client.clone(), &env.ns)
        .create(&pp, &binding)
        .await
        .unwrap();
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    let pv = env.unique("pv");
    env.pv(
        &pv,
        "vol-a",
        json!({"spec": {"csi": {
            "controllerPublishSecretRef": {"name": "publish", "namespace": env.ns}}}}),
    )
    .await;
    let mut a = env.attacher_as(
        &kubeconfig,
        &[
            "--leader-election",
            &format!("--leader-election-namespace={}", env.ns),
        ],
    );
    let va = env.unique("va");
    env.va(&va, &pv, &node).await;
    env.wait_attached(&va).await;
    let fin = env.finalizer();
    env.wait_pv(&pv, "the PV's finalizer", |p| {
        p.metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.contains(&fin))
    })
    .await;
    env.delete_va(&va).await;
    env.wait_va_gone(&va).await;
    env.pvs()
        .delete(&pv, &DeleteParams::default())
        .await
        .unwrap();
    // (The PV stays: kubernetes.io/pv-protection is kube-controller-manager's to remove.)
    env.wait_pv(&pv, "the PV's finalizer removed", |p| {
        !p.metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.contains(&fin))
    })
    .await;
    assert!(a.running(), "{}", a.log());
    let log = a.log();
    // Only the Lease's event is refused, as upstream's (the sample grants no events; client-go
    // logs the failure and goes on).
    let refused: Vec<&str> = log
        .lines()
        // (The status code as kube prints it: a bare "403" also matches time stamps and pids.)
        .filter(|l| l.to_lowercase().contains("forbidden") || l.contains("code: 403"))
        .collect();
    assert!(
        refused
            .iter()
            .all(|l| l.contains("could not record the LeaderElection event")
                && l.contains("cannot create resource \\\"events\\\"")),
        "{version}: something else was refused:\n{}",
        refused.join("\n")
    );
    let publish = env.calls.publish_requests();
    assert_eq!(publish.len(), 1, "{log}");
    assert_eq!(
        publish[0].secrets.get("user").map(String::as_str),
        Some("admin")
    );
    assert_eq!(env.calls.unpublish_requests().len(), 1, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_with_the_sample_rbac_v1_36() {
    runs_with_the_sample_rbac(KubeVersion::V1_36_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_with_the_sample_rbac_v1_20() {
    runs_with_the_sample_rbac(KubeVersion::V1_20_2).await;
}

/// Checklist 17: another holder takes the Lease (as a replica whose clock says ours expired
/// would); the attacher cannot renew within `--leader-election-renew-deadline`, logs "Stopped
/// leading" and exits 1, as upstream (client-go's OnStoppedLeading).
///
/// `/healthz/leader-election` answers 200 all along: it fails only for a process that still
/// believes it leads and has not renewed for the lease duration + 20 s (a renew loop that
/// hangs instead of giving up), and a renewal here gives up at the renew deadline, well before
/// that: the process exits instead. (That rule itself is the kit's unit test
/// `health_fails_only_for_a_leader_past_lease_plus_tolerance`, on a paused clock; the binary
/// cannot be brought into that window without a fault of its own runtime.)
async fn a_lost_lease_is_exit_1(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    let addr = free_local_addr();
    let mut a = env.attacher(&[
        "--leader-election",
        &format!("--leader-election-namespace={}", env.ns),
        "--leader-election-lease-duration=4s",
        "--leader-election-renew-deadline=2s",
        "--leader-election-retry-period=500ms",
        &format!("--http-endpoint={addr}"),
    ]);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let name = format!("external-attacher-leader-{}", env.name.replace('.', "-"));
    let ours = poll("the Lease held", || async {
        let l = leases.get_opt(&name).await.ok().flatten()?;
        l.spec?.holder_identity.filter(|h| !h.is_empty())
    })
    .await;
    let health = poll("leader health", || async {
        http_get(addr, "/healthz/leader-election")
    })
    .await;
    assert_eq!(health, (200, "ok".to_owned()));
    // A MicroTime: the API server wants exactly six digits of fraction.
    let now = k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.000000Z")
        .to_string();
    leases
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {
                "holderIdentity": "another-replica",
                "leaseDurationSeconds": 3600,
                "acquireTime": now,
                "renewTime": now,
            }})),
        )
        .await
        .unwrap();
    // Until it exits, the leader that lost its Lease is not reported unhealthy.
    let mut answers = 0;
    while a.running() {
        if let Some(answer) = http_get(addr, "/healthz/leader-election") {
            assert_eq!(answer, (200, "ok".to_owned()), "{}", a.log());
            answers += 1;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        answers > 0,
        "no health answer between the takeover and the exit"
    );
    assert_eq!(a.exit_code().await, 1, "{}", a.log());
    let log = a.log();
    assert!(log.contains("\"Stopped leading\""), "{log}");
    // It did not take the Lease back on its way out.
    let holder = leases
        .get(&name)
        .await
        .unwrap()
        .spec
        .unwrap()
        .holder_identity;
    assert_eq!(holder.as_deref(), Some("another-replica"), "was {ours}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_exit_1_v1_36() {
    a_lost_lease_is_exit_1(KubeVersion::V1_36_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_exit_1_v1_20() {
    a_lost_lease_is_exit_1(KubeVersion::V1_20_2).await;
}

/// A TCP relay from a port of 127.0.0.1 to the API server, which a test can cut: from then
/// on every connection through it, open or new, stays open and silent (a network partition:
/// requests neither fail nor get an answer).
struct Relay {
    addr: std::net::SocketAddr,
    cut: tokio_util::sync::CancellationToken,
}

impl Relay {
    async fn start(target: &str) -> Relay {
        let target = target.strip_prefix("https://").unwrap_or(target).to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = tokio_util::sync::CancellationToken::new();
        let c = cut.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let (c, target) = (c.clone(), target.clone());
                tokio::spawn(async move {
                    if !c.is_cancelled()
                        && let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await
                    {
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => return,
                            () = c.cancelled() => {}
                        }
                    }
                    // Cut: the connection (`inbound`, owned here) stays open and silent until
                    // the test ends.
                    std::future::pending::<()>().await;
                });
            }
        });
        Relay { addr, cut }
    }

    /// A copy of `kubeconfig` (the test API server's, JSON) that goes through the relay, in
    /// `dir`.
    fn kubeconfig(&self, kubeconfig: &Path, dir: &Path) -> PathBuf {
        let mut kc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(kubeconfig).unwrap()).unwrap();
        kc["clusters"][0]["cluster"]["server"] = json!(format!("https://{}", self.addr));
        let path = dir.join("relayed.kubeconfig");
        std::fs::write(&path, kc.to_string()).unwrap();
        path
    }
}

/// Checklist 17: a leader cut off from the API server (upstream's "leader election lost"
/// path) cannot renew within `--leader-election-renew-deadline`: it logs "Stopped leading"
/// and exits 1. Until then it still believes it leads, and `/healthz/leader-election`
/// answers 200: it would fail only once the lease duration + 20 s had passed without a
/// renewal, and the renew deadline ends the process long before.
async fn a_leader_cut_off_from_the_api_server_exits_1(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    let relay = Relay::start(env.api.url()).await;
    let kubeconfig = relay.kubeconfig(env.api.kubeconfig_path(), env.dir.path());
    let addr = free_local_addr();
    let mut a = env.attacher_as(
        &kubeconfig,
        &[
            "--leader-election",
            &format!("--leader-election-namespace={}", env.ns),
            "--leader-election-lease-duration=4s",
            "--leader-election-renew-deadline=2s",
            "--leader-election-retry-period=500ms",
            &format!("--http-endpoint={addr}"),
        ],
    );
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let name = format!("external-attacher-leader-{}", env.name.replace('.', "-"));
    poll("the Lease held", || async {
        let l = leases.get_opt(&name).await.ok().flatten()?;
        l.spec?.holder_identity.filter(|h| !h.is_empty())
    })
    .await;
    let health = poll("leader health", || async {
        http_get(addr, "/healthz/leader-election")
    })
    .await;
    assert_eq!(health, (200, "ok".to_owned()));
    relay.cut.cancel();
    let mut answers = 0;
    while a.running() {
        if let Some(answer) = http_get(addr, "/healthz/leader-election") {
            assert_eq!(answer, (200, "ok".to_owned()), "{}", a.log());
            answers += 1;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(answers > 0, "no health answer between the cut and the exit");
    assert_eq!(a.exit_code().await, 1, "{}", a.log());
    let log = a.log();
    assert!(log.contains("\"Stopped leading\""), "{log}");
    assert!(log.contains("timed out waiting for the condition"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_api_server_exits_1_v1_36() {
    a_leader_cut_off_from_the_api_server_exits_1(KubeVersion::V1_36_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_api_server_exits_1_v1_20() {
    a_leader_cut_off_from_the_api_server_exits_1(KubeVersion::V1_20_2).await;
}

fn is_response(line: &str, method: &str) -> bool {
    line.contains("\"GRPC response\"") && line.contains(&format!("method=\"{method}\""))
}

fn has_response(log: &str, method: &str) -> bool {
    log.lines().any(|l| is_response(l, method))
}

/// The `-v=5` "GRPC response" line of `method` in `log`.
fn response_line<'a>(log: &'a str, method: &str) -> &'a str {
    log.lines()
        .find(|l| is_response(l, method))
        .unwrap_or_else(|| panic!("no GRPC response of {method}:\n{log}"))
}

/// `--max-grpc-log-length`: at `-v=5` each call is logged ("GRPC call" with the request, its
/// secrets stripped; "GRPC response"), the response capped at that many characters with
/// csi-lib-utils' note; the default -1 logs it whole.
async fn max_grpc_log_length_caps_responses(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    let node = env.unique("node");
    env.csinode(&node, &[(&env.name, NODE_ID)]).await;
    env.secret("publish", &[("password", "hunter2")]).await;
    let secret = json!({"spec": {"csi": {"controllerPublishSecretRef": {"name": "publish", "namespace": env.ns}}}});
    let (pv1, pv2) = (env.unique("pv-1"), env.unique("pv-2"));
    env.pv(&pv1, "vol-a", secret.clone()).await;
    env.pv(&pv2, "vol-b", secret).await;
    const PUBLISH: &str = "/csi.v1.Controller/ControllerPublishVolume";

    let mut capped = env.attacher(&["--max-grpc-log-length=40"]);
    let va1 = env.unique("va-1");
    env.va(&va1, &pv1, &node).await;
    env.wait_attached(&va1).await;
    let log = poll("the capped publish response logged", || async {
        let log = capped.log();
        has_response(&log, PUBLISH).then_some(log)
    })
    .await;
    capped.kill();
    let line = response_line(&log, PUBLISH);
    assert!(
        line.contains(
            "response=\"ControllerPublishVolumeResponse { publis [response body too large, log capped to 40 chars]\""
        ),
        "{line}"
    );
    assert!(!line.contains("/dev/plugreg-test"), "{line}");
    // Every call is capped, the start-up ones too.
    let info = response_line(&log, "/csi.v1.Identity/GetPluginInfo");
    assert!(info.contains("log capped to 40 chars]"), "{info}");
    // The request is logged whole, but its secrets.
    let call = log
        .lines()
        .find(|l| l.contains("\"GRPC call\"") && l.contains(PUBLISH))
        .unwrap_or_else(|| panic!("no GRPC call line:\n{log}"));
    assert!(call.contains("***stripped***"), "{call}");
    assert!(call.contains("vol-a"), "{call}");
    assert!(!log.contains("hunter2"), "{log}");

    let whole = env.attacher(&[]);
    let va2 = env.unique("va-2");
    env.va(&va2, &pv2, &node).await;
    env.wait_attached(&va2).await;
    let log = poll("the whole publish response logged", || async {
        let log = whole.log();
        has_response(&log, PUBLISH).then_some(log)
    })
    .await;
    let line = response_line(&log, PUBLISH);
    assert!(line.contains("/dev/plugreg-test"), "{line}");
    assert!(!log.contains("log capped"), "{log}");
    assert!(!log.contains("hunter2"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_grpc_log_length_caps_responses_v1_36() {
    max_grpc_log_length_caps_responses(KubeVersion::V1_36_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_grpc_log_length_caps_responses_v1_20() {
    max_grpc_log_length_caps_responses(KubeVersion::V1_20_2).await;
}
