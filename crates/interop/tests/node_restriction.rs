//! Node labels on a plugin's word, against real kube-apiservers (v1.20.2 and v1.36.2):
//! `<test>::v1_20_2` and `<test>::v1_36_2`.
//!
//! The kubelet publishes a CSI driver's topology as labels of its Node, and the API server's
//! NodeRestriction admission refuses the labels a kubelet may not set. `plugreg manager` writes
//! with its own credentials, which NodeRestriction does not restrict, so it must apply the same
//! rule itself (`plugreg_handler_csi::noderestriction`):
//! * the rule is compared key by key with the real NodeRestriction of each release;
//! * a driver reporting `node-role.kubernetes.io/control-plane` and
//!   `node-restriction.kubernetes.io/pwn`, registered through our sidecar with `plugreg manager
//!   --node-name`, gets Notify(false) with the API server's wording, and nothing is written;
//! * the daemon also works with the kubelet's own identity (`system:node:<name>` under the Node
//!   authorizer and NodeRestriction), the deployment that limits it to its own Node.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::CSINode;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use plugreg_handler_csi::nodeinfo::MergeError;
use plugreg_handler_csi::noderestriction::kubelet_may_set;
use plugreg_interop::{for_each_kube_version, workspace_bin};
use plugreg_testpeers::{ApiServer, ApiServerOptions, LinesFrom, PeerProcess};

const WAIT: Duration = Duration::from_secs(60);

/// Label keys to compare: the kubelet's own, the reserved, the look-alikes.
const KEYS: &[&str] = &[
    "kubernetes.io/hostname",
    "kubernetes.io/os",
    "kubernetes.io/arch",
    "beta.kubernetes.io/os",
    "beta.kubernetes.io/arch",
    "beta.kubernetes.io/instance-type",
    "node.kubernetes.io/instance-type",
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/region",
    "failure-domain.kubernetes.io/zone",
    "kubernetes.io/role",
    "kubernetes.io/instance-type",
    "node-role.kubernetes.io/control-plane",
    "node-role.kubernetes.io/worker",
    "node-restriction.kubernetes.io/pwn",
    "a.node-restriction.kubernetes.io/pwn",
    "node-restriction.kubernetes.io.example.com/x",
    "node.kubernetes.io/exclude-from-external-load-balancers",
    "node.kubernetes.io/windows-build",
    "extra.node.kubernetes.io/x",
    "kubelet.kubernetes.io/x",
    "a.kubelet.kubernetes.io/x",
    "topology.kubernetes.io/rack",
    "storage.kubernetes.io/csi",
    "k8s.io/x",
    "example.k8s.io/x",
    "csi.storage.k8s.io/x",
    "notkubernetes.io/x",
    "xk8s.io/x",
    "topology.hostpath.csi/node",
    "topology.example.com/zone",
    "example.com/kubernetes.io",
    "zone",
];

async fn create_node(client: &kube::Client, name: &str, labels: &[(&str, &str)]) {
    let node = Node {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
        .expect("create Node");
}

async fn labels(client: &kube::Client, node: &str) -> BTreeMap<String, String> {
    Api::<Node>::all(client.clone())
        .get(node)
        .await
        .expect("get Node")
        .metadata
        .labels
        .unwrap_or_default()
}

async fn annotations(client: &kube::Client, node: &str) -> BTreeMap<String, String> {
    Api::<Node>::all(client.clone())
        .get(node)
        .await
        .expect("get Node")
        .metadata
        .annotations
        .unwrap_or_default()
}

/// `plugreg manager` publishing to the Node `node` with `kubeconfig`, its JSON log lines read.
fn manager(dir: &Path, node: &str, kubeconfig: &Path) -> PeerProcess {
    let mut cmd = std::process::Command::new(workspace_bin("plugreg"));
    cmd.args(["manager", "--registry-dir"])
        .arg(dir)
        .args(["--plugin-types", "CSIPlugin", "--node-name", node])
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["--log-format", "json"]);
    PeerProcess::spawn_command("plugreg manager", cmd, LinesFrom::Stderr).unwrap()
}

/// Our `csi-node-driver-registrar` for the driver on `csi` (which the manager dials where it
/// is: no container paths here), its JSON log lines read.
fn sidecar(csi: &Path, registry: &Path) -> PeerProcess {
    let mut cmd = std::process::Command::new(workspace_bin("csi-node-driver-registrar"));
    cmd.args([
        format!("--csi-address={}", csi.display()),
        format!("--kubelet-registration-path={}", csi.display()),
        format!("--plugin-registration-path={}", registry.display()),
        "--logging-format=json".into(),
    ]);
    PeerProcess::spawn_command("csi-node-driver-registrar", cmd, LinesFrom::Stderr).unwrap()
}

async fn csi_driver(
    socket: &Path,
    name: &str,
    topology: &[(&str, &str)],
) -> plugreg_csi_test_driver::RunningDriver {
    plugreg_csi_test_driver::start(
        plugreg_csi_test_driver::DriverConfig {
            name: name.into(),
            node_id: format!("{name}-node-id"),
            topology: topology
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Default::default()
        },
        socket,
    )
    .await
    .unwrap()
}

/// What NodeRestriction answers a kubelet that sets `keys` on `node`, as the message of its
/// 403 (without the request's context the client adds).
fn node_restriction_message(node: &str, keys: &[&str]) -> String {
    let refused = MergeError::ForbiddenLabels {
        keys: keys.iter().map(|k| (*k).to_owned()).collect(),
    };
    format!("nodes {node:?} is forbidden: {refused}")
}

const PWN: &[(&str, &str)] = &[
    ("node-role.kubernetes.io/control-plane", "x"),
    ("node-restriction.kubernetes.io/pwn", "y"),
];

for_each_kube_version! {
    /// Every key of [`KEYS`], set by a kubelet identity on its own Node through the status
    /// subresource (as the kubelet does): the real NodeRestriction and our rule agree, and a
    /// refusal reads as we word ours.
    async fn our_label_rule_is_the_real_node_restriction(k: KubeVersion) {
        let node = "rule-node";
        let server = ApiServer::start_with(k, &ApiServerOptions { nodes: vec![node.into()], ..Default::default() })
            .await
            .unwrap_or_else(|e| panic!("kube-apiserver {k}: {e}"));
        let admin = server.client().await.unwrap();
        create_node(&admin, node, &[]).await;
        let kubelet = Api::<Node>::all(server.node_client(node).await.unwrap());
        let mut disagreements = Vec::new();
        for key in KEYS {
            let patch = serde_json::json!({"metadata": {"labels": {*key: "v"}}});
            let answer = kubelet
                .patch_status(node, &PatchParams::default(), &Patch::Strategic(patch))
                .await;
            let allowed = match answer {
                Ok(_) => true,
                Err(kube::Error::Api(s)) if s.code == 403 => {
                    assert_eq!(s.message, node_restriction_message(node, &[key]), "{k}: {key}");
                    false
                }
                Err(e) => panic!("{k}: {key}: {e}"),
            };
            if allowed != kubelet_may_set(key) {
                disagreements.push(format!("{key}: NodeRestriction {allowed}, plugreg {}", !allowed));
            }
        }
        assert!(disagreements.is_empty(), "{k}: {disagreements:#?}");
    }

    /// The attack of issue 17: a driver whose NodeGetInfo reports labels the kubelet may not
    /// set, registered through our sidecar with a `plugreg manager` whose credentials could
    /// write them. Nothing is written; the plugin hears why, in the API server's words.
    async fn the_manager_refuses_labels_the_kubelet_may_not_set(k: KubeVersion) {
        let node = "pwn-node";
        let driver = "pwn.csi.plugreg.io";
        let server = ApiServer::shared(k).await.unwrap_or_else(|e| panic!("kube-apiserver {k}: {e}"));
        let admin = server.client().await.unwrap();
        create_node(&admin, node, &[("kubernetes.io/hostname", node)]).await;
        let before = labels(&admin, node).await;
        let tmp = tempfile::tempdir().unwrap();
        let registry = tmp.path().join("plugins_registry");
        std::fs::create_dir_all(&registry).unwrap();
        let csi = tmp.path().join("csi.sock");
        let _driver = csi_driver(&csi, driver, PWN).await;
        // The daemon with the admin's credentials: the API server would let it write anything.
        let _manager = manager(&registry, node, server.kubeconfig_path());
        let mut sidecar = sidecar(&csi, &registry);

        let told = sidecar
            .next_matching(|v| v["msg"] == "Received NotifyRegistrationStatus call", WAIT)
            .await
            .unwrap();
        assert_eq!(labels(&admin, node).await, before, "{k}: labels were written: {told}");
        assert!(
            !annotations(&admin, node).await.contains_key(plugreg_handler_csi::NODE_ID_ANNOTATION),
            "{k}"
        );
        let csinode = Api::<CSINode>::all(admin.clone()).get_opt(node).await.unwrap();
        assert!(
            csinode.is_none_or(|c| c.spec.drivers.iter().all(|d| d.name != driver)),
            "{k}: a CSINode entry was written"
        );
        let failed = sidecar
            .next_matching(
                |v| v["msg"] == "Registration process failed with error, restarting registration container",
                WAIT,
            )
            .await
            .unwrap();
        let reason = format!(
            "RegisterPlugin error -- plugin registration failed with err: \
             error updating Node object with CSI driver node info: {}",
            node_restriction_message(
                node,
                &["node-restriction.kubernetes.io/pwn", "node-role.kubernetes.io/control-plane"],
            )
        );
        assert_eq!(failed["err"], reason.as_str(), "{k}: {failed}");
        assert_eq!(sidecar.wait_exit(WAIT).await.unwrap().code(), Some(1));
        assert_eq!(labels(&admin, node).await, before, "{k}");
    }

    /// `plugreg manager` with the kubelet's own identity (`system:node:<name>`, the Node
    /// authorizer and NodeRestriction on): a driver with allowed topology registers (Node
    /// labels and annotation, CSINode owned by the Node), and the forbidden one is refused
    /// before the API server would refuse it, in the same words.
    async fn the_manager_works_with_the_kubelets_own_identity(k: KubeVersion) {
        let node = "own-node";
        let server = ApiServer::start_with(k, &ApiServerOptions { nodes: vec![node.into()], ..Default::default() })
            .await
            .unwrap_or_else(|e| panic!("kube-apiserver {k}: {e}"));
        let admin = server.client().await.unwrap();
        create_node(&admin, node, &[]).await;
        let tmp = tempfile::tempdir().unwrap();
        let registry = tmp.path().join("plugins_registry");
        std::fs::create_dir_all(&registry).unwrap();
        let _manager = manager(&registry, node, server.node_kubeconfig(node).unwrap());

        let good = "good.csi.plugreg.io";
        let good_csi = tmp.path().join("good.sock");
        let _good = csi_driver(
            &good_csi,
            good,
            &[("topology.kubernetes.io/zone", "z1"), ("topology.example.com/rack", "r1")],
        )
        .await;
        let mut good_sidecar = sidecar(&good_csi, &registry);
        let told = good_sidecar
            .next_matching(|v| v["msg"] == "Received NotifyRegistrationStatus call", WAIT)
            .await
            .unwrap();
        let got = labels(&admin, node).await;
        assert_eq!(got.get("topology.kubernetes.io/zone").map(String::as_str), Some("z1"), "{k}: {told}");
        assert_eq!(got.get("topology.example.com/rack").map(String::as_str), Some("r1"), "{k}");
        assert!(annotations(&admin, node).await[plugreg_handler_csi::NODE_ID_ANNOTATION].contains(good));
        let csinode = Api::<CSINode>::all(admin.clone()).get(node).await.unwrap();
        assert!(csinode.spec.drivers.iter().any(|d| d.name == good), "{k}");
        assert_eq!(csinode.metadata.owner_references.unwrap()[0].name, node);

        let bad = "pwn.csi.plugreg.io";
        let bad_csi = tmp.path().join("bad.sock");
        let _bad = csi_driver(&bad_csi, bad, PWN).await;
        let mut bad_sidecar = sidecar(&bad_csi, &registry);
        let failed = bad_sidecar
            .next_matching(
                |v| v["msg"] == "Registration process failed with error, restarting registration container",
                WAIT,
            )
            .await
            .unwrap();
        assert!(
            failed["err"].as_str().unwrap().ends_with(&node_restriction_message(
                node,
                &["node-restriction.kubernetes.io/pwn", "node-role.kubernetes.io/control-plane"],
            )),
            "{k}: {failed}"
        );
        let after = labels(&admin, node).await;
        assert_eq!(after, got, "{k}");
        good_sidecar.terminate().unwrap();
        assert!(good_sidecar.wait_exit(WAIT).await.unwrap().success());
    }
}
