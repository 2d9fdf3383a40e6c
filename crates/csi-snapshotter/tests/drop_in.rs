//! What makes `csi-snapshotter` a drop-in beyond snapshotting, against a real kube-apiserver
//! v1.36.2 with the Go snapshot-controller v8.6.0 (the snapshot CRDs need 1.25 or later):
//! * it runs with exactly upstream's sample RBAC (`deploy/base`'s snapshotter part) under a
//!   token of its ServiceAccount, with leader election on its Lease
//!   `external-snapshotter-leader-<driver>`: a snapshot is taken and deleted, nothing is
//!   refused;
//! * `/metrics` shows `csi_sidecar_operations_seconds` per method and the workqueue
//!   `csi-snapshotter-content`, `/healthz/leader-election` answers `ok`;
//! * a Lease taken by another holder makes it exit 1 with "Stopped leading", as upstream.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Env, NS};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams};
use plugreg_testpeers::rbac::{self, rule, rules};
use serde_json::json;

/// `deploy/`'s controller RBAC, upstream's samples.
fn rbac_yaml() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/base/controller/rbac.yaml")
}

const ACCOUNT: &str = "csi-controller";
const LEASE: &str = "external-snapshotter-leader-snap-csi-plugreg-test";

/// Creates the snapshotter's RBAC of `deploy/` and its ServiceAccount in [`NS`]; returns a
/// kubeconfig with a token of that account.
async fn service_account_kubeconfig(env: &Env) -> PathBuf {
    let docs = rbac::sample(&rbac_yaml(), "external-snapshotter", &env.name, NS).unwrap();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
    );
    // Exactly upstream's sample (external-snapshotter v8.6.0).
    let g = "groupsnapshot.storage.k8s.io";
    let s = "snapshot.storage.k8s.io";
    let mut want = vec![
        rule(
            "",
            "events",
            &["list", "watch", "create", "update", "patch"],
        ),
        rule(s, "volumesnapshotclasses", &["get", "list", "watch"]),
        rule(
            s,
            "volumesnapshotcontents",
            &["get", "list", "watch", "update", "patch"],
        ),
        rule(s, "volumesnapshotcontents/status", &["update", "patch"]),
        rule(g, "volumegroupsnapshotclasses", &["get", "list", "watch"]),
        rule(
            g,
            "volumegroupsnapshotcontents",
            &["get", "list", "watch", "update", "patch"],
        ),
        rule(
            g,
            "volumegroupsnapshotcontents/status",
            &["update", "patch"],
        ),
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
    rbac::create(&env.client, NS, ACCOUNT, &docs).await.unwrap();
    let path = env.dir.path().join("sa.kubeconfig");
    env.api
        .service_account_kubeconfig(NS, ACCOUNT, &path)
        .await
        .unwrap();
    path
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let code = response.split(' ').nth(1).unwrap().parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_with_the_sample_rbac_and_serves_its_metrics() {
    let env = Env::new(|_| {}).await;
    let kubeconfig = service_account_kubeconfig(&env).await;
    env.class("cls", "Delete", json!({})).await;
    env.bound_claim("data", "vol-a").await;
    let addr = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let sidecar = common::start_snapshotter(
        &env.socket,
        &kubeconfig,
        &[
            "--leader-election",
            &format!("--leader-election-namespace={NS}"),
            &format!("--http-endpoint={addr}"),
        ],
        env.dir.path(),
    );
    env.logs.lock().unwrap().push(sidecar.log.clone());
    let uid = env.snapshot("snap1", "data", "cls").await;
    let name = format!("snapcontent-{uid}");
    env.wait_snapshot("snap1", "snap1 ready", |s| {
        s.status.as_ref().and_then(|s| s.ready_to_use) == Some(true)
    })
    .await;
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), NS);
    let lease = leases.get(LEASE).await.unwrap();
    assert!(lease.spec.unwrap().holder_identity.is_some());

    let (code, body) = get(addr, "/metrics");
    assert_eq!(code, 200);
    for want in [
        "csi_sidecar_operations_seconds_count{driver_name=\"snap.csi.plugreg.test\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/CreateSnapshot\"} 1",
        "csi_sidecar_operations_seconds_count{driver_name=\"snap.csi.plugreg.test\",grpc_status_code=\"OK\",method_name=\"/csi.v1.Controller/ControllerGetCapabilities\"} 1",
        "workqueue_adds_total{name=\"csi-snapshotter-content\"}",
    ] {
        assert!(body.contains(want), "{want} missing:\n{body}");
    }
    assert_eq!(get(addr, "/healthz/leader-election"), (200, "ok".into()));

    env.delete_snapshot_once("snap1", &name).await;
    let log = sidecar.log();
    let refused: Vec<&str> = log
        .lines()
        .filter(|l| l.to_lowercase().contains("forbidden") || l.contains(" 403"))
        .collect();
    assert!(refused.is_empty(), "refused:\n{}", refused.join("\n"));
}

/// Another holder takes the Lease; the snapshotter cannot renew within
/// `--leader-election-renew-deadline`, logs "Stopped leading" and exits 1, as upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_exit_1() {
    let env = Env::new(|_| {}).await;
    let mut sidecar = env.snapshotter(&[
        "--leader-election",
        &format!("--leader-election-namespace={NS}"),
        "--leader-election-lease-duration=4s",
        "--leader-election-renew-deadline=2s",
        "--leader-election-retry-period=500ms",
    ]);
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), NS);
    env.poll("the Lease held", || async {
        let l = leases.get_opt(LEASE).await.ok().flatten()?;
        l.spec?.holder_identity.filter(|h| !h.is_empty())
    })
    .await;
    let now = k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.000000Z")
        .to_string();
    leases
        .patch(
            LEASE,
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
    let child = std::sync::Mutex::new(&mut sidecar.child);
    let status = env
        .poll("the sidecar's exit", || async {
            child.lock().unwrap().try_wait().unwrap()
        })
        .await;
    let log = sidecar.log();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("Stopped leading"), "{log}");
}
