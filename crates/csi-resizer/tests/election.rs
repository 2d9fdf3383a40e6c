//! `csi-resizer` under the deployment's own constraints, against a real kube-apiserver and KCM
//! of v1.20.2 and v1.36.2:
//!
//! - with exactly the RBAC `deploy/base` ships for it (upstream external-resizer's sample
//!   RBAC) and a token of its ServiceAccount, an expansion (and on v1.36.2 a
//!   VolumeAttributesClass modification) works and the API server refuses nothing;
//! - a Lease taken over by someone else makes it exit 1 with "Stopped leading", as upstream
//!   (the real binary, the real Lease);
//! - `/healthz/leader-election` is served (200 `ok` while leading) only with leader election
//!   and `--http-endpoint`, as upstream.

mod common;

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, Patch, PatchParams, PostParams};
use plugreg_resizer::kube::VolumeAttributesClass;
use plugreg_testpeers::KubeVersion;
use plugreg_testpeers::bench::free_port;
use serde_json::json;

/// Where `deploy/base` runs the controller sidecars, and its ServiceAccount there.
const NAMESPACE: &str = "kube-system";
const ACCOUNT: &str = "csi-controller";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The kubectl the deploy tests render the manifests with (its kustomize is the oldest the
/// manifests support), else the one on `PATH`.
fn kubectl() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    let pinned = Path::new(&home).join(".cache/plugreg-deploy/kubectl-v1.20.2");
    if pinned.is_file() {
        return pinned;
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("kubectl"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
        .into_iter()
        .find(|p| p.is_file());
    on_path.unwrap_or_else(|| {
        panic!(
            "no kubectl: neither {} nor one on PATH (images/setup.sh installs it)",
            pinned.display()
        )
    })
}

/// `deploy/base` rendered, reduced to the resizer's ServiceAccount and the objects of its
/// RBAC (every document naming the resizer), then applied as the cluster admin.
fn apply_resizer_rbac(env: &Env) {
    let kubectl = kubectl();
    let out = Command::new(&kubectl)
        .arg("kustomize")
        .arg(repo_root().join("deploy/base"))
        .output()
        .expect("running kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/base: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered = String::from_utf8(out.stdout).unwrap();
    let docs: Vec<&str> = rendered
        .split("\n---\n")
        .filter(|d| {
            // Top-level lines only: other bindings name the same ServiceAccount as a subject.
            let top = |line: &str| d.lines().any(|l| l == line);
            let rbac = ["Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"]
                .iter()
                .any(|k| top(&format!("kind: {k}")));
            (rbac && d.contains("resizer"))
                || (top("kind: ServiceAccount") && d.contains(&format!("\n  name: {ACCOUNT}\n")))
        })
        .collect();
    // The ServiceAccount, the ClusterRole and its binding, the Lease Role and its binding.
    assert_eq!(docs.len(), 5, "{rendered}");
    let mut child = Command::new(&kubectl)
        .arg(format!(
            "--kubeconfig={}",
            env.cluster.api.kubeconfig_path().display()
        ))
        .args(["apply", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running kubectl apply");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(docs.join("\n---\n").as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "kubectl apply: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A kubeconfig that authenticates with a fresh token of the ServiceAccount.
async fn service_account_kubeconfig(env: &Env) -> PathBuf {
    let path = env.dir.path().join("service-account.kubeconfig");
    env.cluster
        .api
        .service_account_kubeconfig(NAMESPACE, ACCOUNT, &path)
        .await
        .expect("a ServiceAccount kubeconfig");
    path
}

async fn sample_rbac_is_enough(version: KubeVersion) {
    let modify = version == KubeVersion::V1_36_2;
    let env = Env::new(version, |c| c.controller_modify = modify).await;
    apply_resizer_rbac(&env);
    let kubeconfig = service_account_kubeconfig(&env).await;
    env.bound_claim("data", "1Gi", "vol-0").await;
    let gold = format!("{}-gold", env.ns);
    if modify {
        let vac: VolumeAttributesClass = serde_json::from_value(json!({
            "metadata": {"name": gold},
            "driverName": env.name,
            "parameters": HashMap::from([("iops", "100")]),
        }))
        .unwrap();
        let mut body = serde_json::to_value(&vac).unwrap();
        body["apiVersion"] = json!("storage.k8s.io/v1");
        body["kind"] = json!("VolumeAttributesClass");
        Api::<VolumeAttributesClass>::all(env.client.clone())
            .create(
                &PostParams::default(),
                &serde_json::from_value(body).unwrap(),
            )
            .await
            .unwrap();
    }
    // As deploy/base runs it: leader election in its own namespace, the HTTP endpoint on.
    let port = free_port();
    let resizer = env.resizer_as(
        &kubeconfig,
        &[
            "--leader-election",
            &format!("--leader-election-namespace={NAMESPACE}"),
            &format!("--http-endpoint=127.0.0.1:{port}"),
        ],
    );
    env.request("data", "2Gi").await;
    env.wait_claim("data", "capacity 2Gi", |c| {
        capacity(c).as_deref() == Some("2Gi")
    })
    .await;
    env.wait_event("data", "VolumeResizeSuccessful").await;
    if modify {
        env.claims()
            .patch(
                "data",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"volumeAttributesClassName": gold}})),
            )
            .await
            .unwrap();
        env.wait_claim("data", "current class", |c| {
            c.status
                .as_ref()
                .and_then(|s| s.current_volume_attributes_class_name.as_deref())
                == Some(gold.as_str())
        })
        .await;
        env.wait_event("data", "VolumeModifySuccessful").await;
    }
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), NAMESPACE);
    let lease = format!("external-resizer-{}", env.name.replace('.', "-"));
    let held = leases.get(&lease).await.unwrap();
    assert!(held.spec.unwrap().holder_identity.is_some());
    // A refusal shows as the API server's `... is forbidden: User ...` (reason Forbidden,
    // code 403) in whatever error line reports it.
    let log = resizer.log();
    assert!(
        !log.to_lowercase().contains("forbidden"),
        "{version}: the API server refused something:\n{log}"
    );
}

/// Checklist 20: the sample RBAC (with `deploy/base`'s names) is all the resizer needs.
#[tokio::test]
async fn the_upstream_sample_rbac_is_enough_v1_36() {
    sample_rbac_is_enough(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn the_upstream_sample_rbac_is_enough_v1_20() {
    sample_rbac_is_enough(KubeVersion::V1_20_2).await;
}

/// One `GET path` on the diagnostics endpoint: (status code, body), `None` while it is not up.
async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    let code = out.split(' ').nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((code, body))
}

/// Checklist 3 and 19: a Lease taken over by another holder makes the leader exit 1 with
/// "Stopped leading" (upstream's exit when its renewal fails); `/healthz/leader-election`
/// says `ok` while it leads.
async fn a_lost_lease_exits_1(version: KubeVersion) {
    let env = Env::new(version, |_| {}).await;
    let port = free_port();
    let mut resizer = env.resizer(&[
        "--leader-election",
        &format!("--leader-election-namespace={}", env.ns),
        "--leader-election-lease-duration=3s",
        "--leader-election-renew-deadline=2s",
        "--leader-election-retry-period=500ms",
        &format!("--http-endpoint=127.0.0.1:{port}"),
    ]);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let name = format!("external-resizer-{}", env.name.replace('.', "-"));
    poll("the Lease held", || async {
        let l = leases.get_opt(&name).await.ok().flatten()?;
        l.spec?.holder_identity.filter(|h| !h.is_empty())
    })
    .await;
    // It leads and works: an expansion goes through.
    env.bound_claim("data", "1Gi", "vol-0").await;
    env.request("data", "2Gi").await;
    env.wait_claim("data", "capacity 2Gi", |c| {
        capacity(c).as_deref() == Some("2Gi")
    })
    .await;
    let health = poll("/healthz/leader-election", || {
        get(port, "/healthz/leader-election")
    })
    .await;
    assert_eq!(health, (200, "ok".to_owned()), "{}", resizer.log());
    // Someone else takes the Lease (as a new leader whose clock says the old one expired).
    let now = serde_json::to_value(MicroTime(k8s_openapi::jiff::Timestamp::now())).unwrap();
    leases
        .patch(
            &name,
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
    assert_eq!(resizer.exit_code().await, 1, "{}", resizer.log());
    let log = resizer.log();
    assert!(log.contains("Stopped leading"), "{log}");
    let lease = leases.get(&name).await.unwrap();
    assert_eq!(
        lease.spec.unwrap().holder_identity.as_deref(),
        Some("thief"),
        "the resizer took the Lease back"
    );
}

#[tokio::test]
async fn a_lost_lease_exits_1_v1_36() {
    a_lost_lease_exits_1(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn a_lost_lease_exits_1_v1_20() {
    a_lost_lease_exits_1(KubeVersion::V1_20_2).await;
}

/// Checklist 19: without leader election the HTTP endpoint serves the metrics but no
/// `/healthz/leader-election` (Go's 404), as upstream registers that check only with
/// `--leader-election`.
#[tokio::test]
async fn no_leader_health_without_leader_election_v1_36() {
    let env = Env::new(KubeVersion::V1_36_2, |_| {}).await;
    let port = free_port();
    let resizer = env.resizer(&[&format!("--http-endpoint=127.0.0.1:{port}")]);
    let (code, _) = poll("/metrics", || async {
        get(port, "/metrics").await.filter(|(c, _)| *c == 200)
    })
    .await;
    assert_eq!(code, 200);
    let (code, body) = get(port, "/healthz/leader-election").await.unwrap();
    assert_eq!(
        (code, body.as_str()),
        (404, "404 page not found\n"),
        "{}",
        resizer.log()
    );
}
