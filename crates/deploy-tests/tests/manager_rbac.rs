//! `deploy/manager` (plugreg manager's DaemonSet and RBAC) and `deploy/manager-own-node` (the
//! admission policy that limits it to its own Node) against real kube-apiservers:
//! * both pass server-side dry-run with every kubectl (`manager-own-node` on v1.36.2 only: it
//!   needs Kubernetes 1.30);
//! * the ClusterRole is enough for the CSI handler's writes: the sink of `plugreg manager`
//!   (`plugreg_handler_csi::KubeSink`) publishes and withdraws a driver with a token of the
//!   ServiceAccount, on v1.20.2 and v1.36.2;
//! * with the policy (v1.36.2), a token of a pod on node `own` may write Node `own` and its
//!   CSINode and nothing else, and no label NodeRestriction refuses a kubelet; a token not
//!   bound to a pod may write nothing.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use plugreg_deploy_tests::{kubectl_version, kubectls, repo_root};
use plugreg_handler_csi::{DriverNodeInfo, KubeSink, NodeInfoSink};
use plugreg_testpeers::{ApiServer, KubeVersion};
use serde_json::json;

const NAMESPACE: &str = "plugreg-system";
const ACCOUNT: &str = "plugreg-manager";

fn kubectl(server: &ApiServer, kubectl: &Path, args: &[&str], dir: &str) -> Output {
    Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(server.kubeconfig_path())
        .args(args)
        .arg("-k")
        .arg(repo_root().join(dir))
        .stdin(Stdio::null())
        .output()
        .expect("running kubectl")
}

fn ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("Warning:"))
        .collect();
    assert!(warnings.is_empty(), "{what}: {warnings:?}");
}

/// `dir` passes server-side dry run with every kubectl, then is applied for real.
fn dry_run_then_apply(server: &ApiServer, dir: &str, k: KubeVersion) {
    for bin in kubectls() {
        let label = kubectl_version(&bin);
        let out = kubectl(server, &bin, &["apply", "--dry-run=server"], dir);
        ok(&out, &format!("{k}: dry run of {dir} with {label}"));
    }
    let newest = kubectls().pop().unwrap();
    ok(
        &kubectl(server, &newest, &["apply"], dir),
        &format!("{k}: apply {dir}"),
    );
}

async fn create_namespace(client: &kube::Client) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}})).unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("create namespace");
}

async fn create_node(client: &kube::Client, name: &str) {
    let node = Node {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
        .expect("create Node");
}

/// A token of the manager's ServiceAccount, bound to `pod` (name, uid) when given.
async fn token(client: &kube::Client, pod: Option<(&str, &str)>) -> String {
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![],
            expiration_seconds: Some(3600),
            bound_object_ref: pod.map(|(name, uid)| BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(name.into()),
                uid: Some(uid.into()),
            }),
        },
        ..Default::default()
    };
    Api::<ServiceAccount>::namespaced(client.clone(), NAMESPACE)
        .create_token_request(ACCOUNT, &PostParams::default(), &request)
        .await
        .expect("TokenRequest")
        .status
        .expect("a token")
        .token
}

/// A client that authenticates with `token`.
async fn client_with(server: &ApiServer, token: &str, dir: &Path) -> kube::Client {
    let path = dir.join(format!("kubeconfig-{}", token.len()));
    let kc = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {
            "server": server.url(),
            "certificate-authority": server.ca_cert_path(),
        }}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    });
    std::fs::write(&path, kc.to_string()).unwrap();
    let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap();
    kube::Client::try_from(config).unwrap()
}

fn driver(topology: &[(&str, &str)]) -> DriverNodeInfo {
    DriverNodeInfo {
        driver: "rbac.csi.plugreg.io".into(),
        node_id: "rbac-node-id".into(),
        topology: topology
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<BTreeMap<_, _>>(),
        max_volumes: 0,
    }
}

/// Applies `deploy/manager` for real (after a dry run with every kubectl) and checks that the
/// ServiceAccount can do what the CSI handler does.
async fn rbac_is_enough(k: KubeVersion) -> (ApiServer, kube::Client) {
    let server = ApiServer::start_version(k)
        .await
        .unwrap_or_else(|e| panic!("kube-apiserver {k}: {e}"));
    let admin = server.client().await.unwrap();
    create_namespace(&admin).await;
    dry_run_then_apply(&server, "deploy/manager", k);
    create_node(&admin, "own").await;
    let tmp = tempfile::tempdir().unwrap();
    let sa = client_with(&server, &token(&admin, None).await, tmp.path()).await;
    let sink = KubeSink::new(sa, "own");
    sink.publish(&driver(&[("topology.example.com/zone", "z1")]))
        .await
        .unwrap_or_else(|e| panic!("{k}: the ClusterRole is not enough to publish: {e:?}"));
    sink.remove("rbac.csi.plugreg.io")
        .await
        .unwrap_or_else(|e| panic!("{k}: the ClusterRole is not enough to withdraw: {e:?}"));
    (server, admin)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_managers_rbac_is_enough_on_v1_20() {
    rbac_is_enough(KubeVersion::V1_20_2).await;
}

fn forbidden_message(e: &kube::Error) -> Option<&str> {
    match e {
        kube::Error::Api(s) if s.code == 403 => Some(&s.message),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_own_node_policy_limits_the_manager_to_its_node_on_v1_36() {
    let k = KubeVersion::V1_36_2;
    let (server, admin) = rbac_is_enough(k).await;
    dry_run_then_apply(&server, "deploy/manager-own-node", k);
    create_node(&admin, "other").await;
    // The DaemonSet's pod on node `own` (never started: there is no kubelet, only its token).
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "plugreg-manager-own"},
        "spec": {
            "nodeName": "own",
            "serviceAccountName": ACCOUNT,
            "containers": [{"name": "m", "image": "plugreg/plugreg:v0.1.0"}],
        },
    }))
    .unwrap();
    let pod = Api::<Pod>::namespaced(admin.clone(), NAMESPACE)
        .create(&PostParams::default(), &pod)
        .await
        .expect("create Pod");
    let uid = pod.metadata.uid.clone().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let on_own = client_with(
        &server,
        &token(&admin, Some(("plugreg-manager-own", &uid))).await,
        tmp.path(),
    )
    .await;
    let nodes = Api::<Node>::all(on_own.clone());
    let label = |key: &str| Patch::Strategic(json!({"metadata": {"labels": {key: "x"}}}));
    // The policy is loaded a moment after it is created: wait until a dry run is refused.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let refused = loop {
        let r = nodes
            .patch_status(
                "other",
                &PatchParams::default().dry_run(),
                &label("topology.example.com/zone"),
            )
            .await;
        match r {
            Err(e) if forbidden_message(&e).is_some() => break e,
            _ => {}
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the policy was never enforced: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        forbidden_message(&refused)
            .unwrap()
            .contains("plugreg-manager on node own may not modify nodes other"),
        "{refused:?}"
    );

    // Its own Node: through plugreg's sink, as the daemon writes it.
    let sink = KubeSink::new(on_own.clone(), "own");
    sink.publish(&driver(&[("topology.kubernetes.io/zone", "z1")]))
        .await
        .unwrap_or_else(|e| panic!("own node: {e:?}"));
    let other = KubeSink::new(on_own.clone(), "other");
    let err = other
        .publish(&driver(&[("topology.kubernetes.io/zone", "z1")]))
        .await
        .unwrap_err();
    assert!(
        format!("{err:?}").contains("may not modify nodes other"),
        "{err:?}"
    );
    // Labels a kubelet may not set, straight through the API (plugreg's own check bypassed).
    for key in [
        "node-restriction.kubernetes.io/pwn",
        "node-role.kubernetes.io/control-plane",
    ] {
        let e = nodes
            .patch_status("own", &PatchParams::default(), &label(key))
            .await
            .unwrap_err();
        assert!(
            forbidden_message(&e).is_some_and(
                |m| m.contains("is not allowed to modify labels a kubelet may not set")
            ),
            "{key}: {e:?}"
        );
    }
    nodes
        .patch_status(
            "own",
            &PatchParams::default(),
            &label("node.kubernetes.io/exclude-from-external-load-balancers"),
        )
        .await
        .expect("a label the kubelet may set");
    // A CSINode of another node cannot be created.
    let csinode: k8s_openapi::api::storage::v1::CSINode =
        serde_json::from_value(json!({"metadata": {"name": "other"}, "spec": {"drivers": []}}))
            .unwrap();
    let e = Api::<k8s_openapi::api::storage::v1::CSINode>::all(on_own.clone())
        .create(&PostParams::default(), &csinode)
        .await
        .unwrap_err();
    assert!(forbidden_message(&e).is_some(), "{e:?}");

    // A token that names no pod (so no node) may write nothing.
    let unbound = client_with(&server, &token(&admin, None).await, tmp.path()).await;
    let e = Api::<Node>::all(unbound)
        .patch_status(
            "own",
            &PatchParams::default(),
            &label("topology.example.com/zone"),
        )
        .await
        .unwrap_err();
    assert!(
        forbidden_message(&e).is_some_and(|m| m.contains("must use the token of a pod")),
        "{e:?}"
    );
}
