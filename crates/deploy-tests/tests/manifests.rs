//! `deploy/`'s kustomizations, rendered by real kubectl binaries (Debian's v1.20.2 with
//! kustomize v2.0.3, and the `kubectl` on PATH when it is another one) and applied with
//! `kubectl apply --dry-run=server -k` to a real kube-apiserver: every object passes the
//! server's validation and admission, comes back with the images and driver name the overlay
//! chose, and nothing is stored. A broken overlay is refused, so the check has teeth.
//!
//! One test per API server version; add a version by adding a test that passes its
//! `ApiServer` to [`check_all`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::PostParams;
use plugreg_deploy_tests::{json_stream, kubectl_version, kubectls, repo_root};
use plugreg_testpeers::ApiServer;
use serde_json::{Value, json};

/// One kustomization and what it must produce.
struct Case {
    dir: &'static str,
    namespace: &'static str,
    driver: &'static str,
    /// Container name -> image, in the DaemonSet and the Deployment.
    images: &'static [(&'static str, &'static str)],
    /// Where the controller sidecars run.
    layout: Layout,
}

/// Where a case runs the controller sidecars.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// `deploy/base`: csi-provisioner, csi-attacher, csi-resizer, csi-snapshotter and
    /// csi-external-health-monitor-controller in the controller Deployment, each with leader
    /// election and a port of its own.
    Separate,
    /// `deploy/distributed`: csi-provisioner and csi-snapshotter in the node DaemonSet with
    /// `--node-deployment`, the node's account bound to their roles, capacity published; the
    /// attacher and the resizer stay in the Deployment, and there is no health monitor (as in
    /// csi-driver-host-path's distributed deployment).
    Distributed,
    /// `deploy/sidecars`: the four in one `csi-sidecars` container of the Deployment, with
    /// one port, the health monitor beside it as in deploy/base, and deploy/base's RBAC
    /// unchanged.
    OneProcess,
}

/// The health monitor's container (csi-driver-host-path's and upstream's name).
const HEALTH_MONITOR: &str = "csi-external-health-monitor-controller";

/// deploy/base's images.
const BASE_IMAGES: &[(&str, &str)] = &[
    ("csi-driver", "csi-driver"),
    (
        "node-driver-registrar",
        "plugreg/csi-node-driver-registrar:v0.1.0",
    ),
    ("liveness-probe", "plugreg/livenessprobe:v0.1.0"),
    ("csi-provisioner", "plugreg/csi-provisioner:v0.1.0"),
    ("csi-attacher", "plugreg/csi-attacher:v0.1.0"),
    ("csi-resizer", "plugreg/csi-resizer:v0.1.0"),
    ("csi-snapshotter", "plugreg/csi-snapshotter:v0.1.0"),
    (
        HEALTH_MONITOR,
        "plugreg/csi-external-health-monitor-controller:v0.1.0",
    ),
];

/// deploy/distributed's images: deploy/base's without the health monitor.
const DISTRIBUTED_IMAGES: &[(&str, &str)] = &[
    ("csi-driver", "csi-driver"),
    (
        "node-driver-registrar",
        "plugreg/csi-node-driver-registrar:v0.1.0",
    ),
    ("liveness-probe", "plugreg/livenessprobe:v0.1.0"),
    ("csi-provisioner", "plugreg/csi-provisioner:v0.1.0"),
    ("csi-attacher", "plugreg/csi-attacher:v0.1.0"),
    ("csi-resizer", "plugreg/csi-resizer:v0.1.0"),
    ("csi-snapshotter", "plugreg/csi-snapshotter:v0.1.0"),
];

const CASES: &[Case] = &[
    Case {
        dir: "deploy/base",
        namespace: "kube-system",
        driver: "csi.example.com",
        images: BASE_IMAGES,
        layout: Layout::Separate,
    },
    Case {
        dir: "deploy/distributed",
        namespace: "kube-system",
        driver: "csi.example.com",
        images: DISTRIBUTED_IMAGES,
        layout: Layout::Distributed,
    },
    Case {
        dir: "deploy/sidecars",
        namespace: "kube-system",
        driver: "csi.example.com",
        images: &[
            ("csi-driver", "csi-driver"),
            (
                "node-driver-registrar",
                "plugreg/csi-node-driver-registrar:v0.1.0",
            ),
            ("liveness-probe", "plugreg/livenessprobe:v0.1.0"),
            ("csi-sidecars", "plugreg/csi-sidecars:v0.1.0"),
            (
                HEALTH_MONITOR,
                "plugreg/csi-external-health-monitor-controller:v0.1.0",
            ),
        ],
        layout: Layout::OneProcess,
    },
    Case {
        dir: "deploy/example",
        namespace: "csi-example",
        driver: "csi.example.org",
        images: &[
            (
                "csi-driver",
                "registry.example.com/example/csi-driver:v1.0.0",
            ),
            (
                "node-driver-registrar",
                "registry.example.com/plugreg/csi-node-driver-registrar:v0.1.0",
            ),
            (
                "liveness-probe",
                "registry.example.com/plugreg/livenessprobe:v0.1.0",
            ),
            (
                "csi-provisioner",
                "registry.example.com/plugreg/csi-provisioner:v0.1.0",
            ),
            (
                "csi-attacher",
                "registry.example.com/plugreg/csi-attacher:v0.1.0",
            ),
            (
                "csi-resizer",
                "registry.example.com/plugreg/csi-resizer:v0.1.0",
            ),
            (
                "csi-snapshotter",
                "registry.example.com/plugreg/csi-snapshotter:v0.1.0",
            ),
            (
                HEALTH_MONITOR,
                "registry.example.com/plugreg/csi-external-health-monitor-controller:v0.1.0",
            ),
        ],
        layout: Layout::Separate,
    },
];

/// Environment references Kubernetes itself expands in args, from the container's env.
const RUNTIME_VARS: &[&str] = &["ADDRESS", "CSI_ENDPOINT", "NODE_NAME", "POD_NAMESPACE"];

#[tokio::test(flavor = "multi_thread")]
async fn manifests_pass_server_side_dry_run_on_v1_20() {
    let server = ApiServer::start().await.expect("kube-apiserver v1.20.2");
    check_all(&server).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn manifests_pass_server_side_dry_run_on_v1_36() {
    let server = ApiServer::start_version(plugreg_testpeers::KubeVersion::V1_36_2)
        .await
        .expect("v1.36.2");
    check_all(&server).await;
}

/// Every case with every kubectl against `server`, then the broken overlay.
async fn check_all(server: &ApiServer) {
    let client = server.client().await.expect("client");
    for case in CASES {
        ensure_namespace(&client, case.namespace).await;
    }
    for kubectl in kubectls() {
        let label = kubectl_version(&kubectl);
        let mut rbac_of = BTreeMap::new();
        for case in CASES {
            let objects = check_case(server, &client, &kubectl, &label, case).await;
            rbac_of.insert(case.dir, rbac(&objects));
        }
        // One process runs what the four sidecars ran, with their Leases, and the health
        // monitor runs as in deploy/base: the union of their RBAC, which deploy/base already
        // binds to the one account, and nothing more.
        for case in CASES.iter().filter(|c| c.layout == Layout::OneProcess) {
            assert_eq!(
                rbac_of[case.dir], rbac_of["deploy/base"],
                "{} with {label}: RBAC differs from deploy/base's",
                case.dir
            );
        }
        check_broken_overlay_is_refused(server, &kubectl, &label);
    }
}

/// The RBAC objects by kind and name: their rules, subjects and role references.
fn rbac(objects: &[Value]) -> BTreeMap<(String, String), Value> {
    objects
        .iter()
        .filter(|o| {
            ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
                .iter()
                .any(|k| o["kind"] == *k)
        })
        .map(|o| {
            let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            (
                (s(&o["kind"]), s(&o["metadata"]["name"])),
                json!({
                    "namespace": o["metadata"]["namespace"],
                    "rules": o["rules"],
                    "subjects": o["subjects"],
                    "roleRef": o["roleRef"],
                }),
            )
        })
        .collect()
}

/// Namespaced objects are dry-run into an existing namespace: create it for real.
async fn ensure_namespace(client: &kube::Client, name: &str) {
    let api: Api<Namespace> = Api::all(client.clone());
    if api.get_opt(name).await.expect("get namespace").is_none() {
        let ns: Namespace =
            serde_json::from_value(json!({"metadata": {"name": name}})).expect("namespace object");
        api.create(&PostParams::default(), &ns)
            .await
            .expect("create namespace");
    }
}

fn apply_dry_run(server: &ApiServer, kubectl: &Path, dir: &Path) -> Output {
    Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(server.kubeconfig_path())
        .args(["apply", "--dry-run=server", "-o", "json", "-k"])
        .arg(dir)
        .stdin(Stdio::null())
        .output()
        .expect("running kubectl")
}

/// One case with one kubectl; returns the objects the server sent back.
async fn check_case(
    server: &ApiServer,
    client: &kube::Client,
    kubectl: &Path,
    label: &str,
    case: &Case,
) -> Vec<Value> {
    let ctx = format!("{} with {label}", case.dir);
    let out = apply_dry_run(server, kubectl, &repo_root().join(case.dir));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{ctx}: kubectl apply --dry-run=server failed ({}):\n{stderr}\nAPI server log:\n{}",
        out.status,
        server.log_tail()
    );
    // Server warnings (unknown fields, deprecated APIs) are printed as "Warning: ..." lines;
    // kustomize's own deprecation notes start with "# Warning".
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("Warning:"))
        .collect();
    assert!(
        warnings.is_empty(),
        "{ctx}: server warnings:\n{}",
        warnings.join("\n")
    );

    let objects: Vec<Value> = json_stream(&out.stdout)
        .into_iter()
        .flat_map(|v| match v["items"].as_array() {
            Some(items) if v["kind"] == "List" => items.clone(),
            _ => vec![v],
        })
        .collect();
    let ns = case.namespace;
    let mut want: BTreeSet<(String, String, String)> = [
        ("ServiceAccount", ns, "csi-node"),
        ("ServiceAccount", ns, "csi-controller"),
        ("ConfigMap", ns, "csi-driver"),
        ("DaemonSet", ns, "csi-node"),
        ("Deployment", ns, "csi-controller"),
        ("CSIDriver", "", case.driver),
    ]
    .iter()
    .map(|(k, n, m)| (k.to_string(), n.to_string(), m.to_string()))
    .collect();
    // Each controller sidecar's RBAC: upstream's sample names, the cluster-wide ones with the
    // driver name in front.
    for sidecar in [
        "provisioner",
        "attacher",
        "resizer",
        "health-monitor-controller",
    ] {
        let runner = format!("{}-external-{sidecar}-runner", case.driver);
        let cfg = format!("external-{sidecar}-cfg");
        for (kind, namespace, name) in [
            ("ClusterRole", "", &runner),
            ("ClusterRoleBinding", "", &runner),
            ("Role", ns, &cfg),
            ("RoleBinding", ns, &cfg),
        ] {
            want.insert((kind.to_owned(), namespace.to_owned(), name.clone()));
        }
    }
    // csi-snapshotter's leader-election Role keeps upstream's name.
    let runner = format!("{}-external-snapshotter-runner", case.driver);
    let cfg = "external-snapshotter-leaderelection".to_owned();
    for (kind, namespace, name) in [
        ("ClusterRole", "", &runner),
        ("ClusterRoleBinding", "", &runner),
        ("Role", ns, &cfg),
        ("RoleBinding", ns, &cfg),
    ] {
        want.insert((kind.to_owned(), namespace.to_owned(), name.clone()));
    }
    if case.layout == Layout::Distributed {
        for (kind, namespace, name) in [
            (
                "ClusterRoleBinding",
                "",
                format!("{}-node-provisioner", case.driver),
            ),
            (
                "ClusterRoleBinding",
                "",
                format!("{}-node-snapshotter", case.driver),
            ),
            ("RoleBinding", ns, "node-provisioner-cfg".to_owned()),
        ] {
            want.insert((kind.to_owned(), namespace.to_owned(), name));
        }
    }
    let got: BTreeSet<(String, String, String)> = objects
        .iter()
        .map(|o| {
            let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            (
                s(&o["kind"]),
                s(&o["metadata"]["namespace"]),
                s(&o["metadata"]["name"]),
            )
        })
        .collect();
    assert_eq!(got, want, "{ctx}: objects");
    for o in &objects {
        // What the server would have stored: it assigned a uid.
        assert!(
            o["metadata"]["uid"].as_str().is_some_and(|u| !u.is_empty()),
            "{ctx}: {} {} came back without a uid",
            o["kind"],
            o["metadata"]["name"]
        );
    }

    let find = |kind: &str| {
        objects
            .iter()
            .find(|o| o["kind"] == kind)
            .unwrap_or_else(|| panic!("{ctx}: no {kind}"))
    };
    let daemonset = find("DaemonSet");
    let deployment = find("Deployment");
    let mut seen = BTreeSet::new();
    for workload in [daemonset, deployment] {
        for c in workload["spec"]["template"]["spec"]["containers"]
            .as_array()
            .expect("containers")
        {
            let name = c["name"].as_str().unwrap_or_default();
            let want = case
                .images
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, i)| *i);
            assert_eq!(
                c["image"].as_str(),
                want,
                "{ctx}: image of container {name}"
            );
            seen.insert(name.to_owned());
            check_runtime_vars(&ctx, c);
        }
    }
    assert_eq!(seen.len(), case.images.len(), "{ctx}: containers {seen:?}");

    // The driver name reached the kubelet-facing places.
    let node_spec = &daemonset["spec"]["template"]["spec"];
    let registrar = node_spec["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "node-driver-registrar"))
        .expect("registrar container");
    let reg_path = format!(
        "--kubelet-registration-path=/var/lib/kubelet/plugins/{}/csi.sock",
        case.driver
    );
    assert!(
        registrar["args"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == &reg_path)),
        "{ctx}: registrar args {}",
        registrar["args"]
    );
    let plugin_dir = node_spec["volumes"]
        .as_array()
        .and_then(|vs| vs.iter().find(|v| v["name"] == "plugin-dir"))
        .expect("plugin-dir volume");
    assert_eq!(
        plugin_dir["hostPath"]["path"],
        format!("/var/lib/kubelet/plugins/{}/", case.driver),
        "{ctx}: plugin-dir"
    );
    // The controller sidecars as upstream's samples run them: leader election with its
    // liveness probe, each on a port of its own (the pod's containers share one network).
    // Distributed, the provisioner and the snapshotter run on the nodes instead, and there is
    // no health monitor. In one process, the four take the same args once, unprefixed, and
    // share one port; the health monitor keeps its own container.
    let central: &[(&str, u16, &str)] = match case.layout {
        Layout::Separate => &[
            ("csi-provisioner", 8080, "http-endpoint"),
            ("csi-attacher", 8081, "attacher-http"),
            ("csi-resizer", 8082, "resizer-http"),
            ("csi-snapshotter", 8083, "snapshot-http"),
            (HEALTH_MONITOR, 8084, "monitor-http"),
        ],
        Layout::Distributed => {
            check_node_sidecars(&ctx, node_spec);
            &[
                ("csi-attacher", 8081, "attacher-http"),
                ("csi-resizer", 8082, "resizer-http"),
            ]
        }
        Layout::OneProcess => &[
            ("csi-sidecars", 8080, "http-endpoint"),
            (HEALTH_MONITOR, 8084, "monitor-http"),
        ],
    };
    for &(sidecar, port, port_name) in central {
        let container = deployment["spec"]["template"]["spec"]["containers"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == sidecar))
            .unwrap_or_else(|| panic!("{ctx}: no {sidecar} container"));
        let args = controller_args(sidecar, port);
        assert_eq!(container["args"], json!(args), "{ctx}: {sidecar} args");
        assert_eq!(
            container["volumeMounts"],
            json!([{"name": "socket-dir", "mountPath": "/csi"}]),
            "{ctx}: {sidecar} mounts the driver's socket directory"
        );
        assert_eq!(
            container["ports"].as_array().map(Vec::len),
            Some(1),
            "{ctx}: {sidecar} ports"
        );
        let probe = &container["livenessProbe"];
        assert_eq!(
            probe["httpGet"]["path"], "/healthz/leader-election",
            "{ctx}: {sidecar}"
        );
        assert_eq!(probe["httpGet"]["port"], port_name, "{ctx}: {sidecar}");
        assert_eq!(container["ports"][0]["name"], port_name, "{ctx}: {sidecar}");
        assert_eq!(
            container["ports"][0]["containerPort"], port,
            "{ctx}: {sidecar}"
        );
        for (field, want) in [
            ("failureThreshold", 1),
            ("periodSeconds", 20),
            ("timeoutSeconds", 10),
            ("initialDelaySeconds", 10),
        ] {
            assert_eq!(probe[field], want, "{ctx}: {sidecar} livenessProbe.{field}");
        }
    }
    for binding in objects
        .iter()
        .filter(|o| o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding")
    {
        let name = binding["metadata"]["name"].as_str().unwrap_or_default();
        let account = if name.contains("node-") {
            "csi-node"
        } else {
            "csi-controller"
        };
        assert_eq!(
            binding["subjects"],
            json!([{"kind": "ServiceAccount", "name": account, "namespace": ns}]),
            "{ctx}: {} {name}: the account bound",
            binding["kind"],
        );
    }
    if case.layout == Layout::Distributed {
        // The node pod gets a token; the scheduler reads the capacity (a field v1.20 drops:
        // CSIStorageCapacity is alpha and off there).
        let account = objects
            .iter()
            .find(|o| o["kind"] == "ServiceAccount" && o["metadata"]["name"] == "csi-node")
            .expect("the node's account");
        assert_eq!(account["automountServiceAccountToken"], true, "{ctx}");
        let capacity = &find("CSIDriver")["spec"]["storageCapacity"];
        if server.version() == plugreg_testpeers::KubeVersion::V1_20_2 {
            assert!(capacity.is_null() || *capacity == true, "{ctx}: {capacity}");
        } else {
            assert_eq!(*capacity, true, "{ctx}: CSIDriver storageCapacity");
        }
    }
    // Volumes are attached by csi-attacher: the kubelet waits for its VolumeAttachment.
    assert_eq!(
        find("CSIDriver")["spec"]["attachRequired"],
        true,
        "{ctx}: CSIDriver attachRequired"
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !text.contains("$(DRIVER_NAME)"),
        "{ctx}: an unresolved $(DRIVER_NAME)"
    );

    // Dry run: nothing was stored.
    let stored = Api::<DaemonSet>::namespaced(client.clone(), ns)
        .get_opt("csi-node")
        .await
        .expect("get daemonset");
    assert!(stored.is_none(), "{ctx}: the dry run stored the DaemonSet");
    eprintln!("ok: {ctx}: {} objects", objects.len());
    objects
}

/// The args deploy/ gives the controller container `sidecar` serving on `port`: the
/// sidecars' samples' with the Lease in the pod's namespace (csi-sidecars: the same, once, for
/// the four controllers), and csi-driver-host-path's for the health monitor (upstream's
/// sample: `--v=5`, the Lease in the service account's namespace, which is the pod's).
fn controller_args(sidecar: &str, port: u16) -> Vec<String> {
    let endpoint = format!("--http-endpoint=:{port}");
    if sidecar == HEALTH_MONITOR {
        return [
            "--v=5",
            "--csi-address=$(ADDRESS)",
            "--leader-election",
            &endpoint,
        ]
        .map(str::to_owned)
        .to_vec();
    }
    let mut args = Vec::new();
    if sidecar == "csi-sidecars" {
        args.push("--controllers=provisioner,attacher,resizer,snapshotter");
    }
    args.extend([
        "--csi-address=$(ADDRESS)",
        "--leader-election",
        "--leader-election-namespace=$(POD_NAMESPACE)",
        &endpoint,
        "--v=2",
    ]);
    args.into_iter().map(str::to_owned).collect()
}

/// deploy/distributed's node sidecars: csi-provisioner with csi-driver-host-path's distributed
/// flags and the three variables they read; csi-snapshotter with `--node-deployment` and
/// `NODE_NAME`; neither with leader election (every node works).
fn check_node_sidecars(ctx: &str, node_spec: &Value) {
    let container = |name: &str| {
        node_spec["containers"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == name))
            .unwrap_or_else(|| panic!("{ctx}: no {name} in the DaemonSet"))
            .clone()
    };
    let env_names = |c: &Value| -> Vec<String> {
        c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["name"].as_str().map(str::to_owned))
            .collect()
    };
    let provisioner = container("csi-provisioner");
    for flag in [
        "--node-deployment=true",
        "--strict-topology=true",
        "--immediate-topology=false",
        "--enable-capacity",
        "--capacity-ownerref-level=0",
        "--feature-gates=Topology=true",
    ] {
        assert!(
            provisioner["args"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == flag)),
            "{ctx}: csi-provisioner lacks {flag}: {}",
            provisioner["args"]
        );
    }
    assert_eq!(
        env_names(&provisioner),
        ["NODE_NAME", "NAMESPACE", "POD_NAME"],
        "{ctx}"
    );
    let snapshotter = container("csi-snapshotter");
    assert!(
        snapshotter["args"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == "--node-deployment=true")),
        "{ctx}: {}",
        snapshotter["args"]
    );
    assert_eq!(env_names(&snapshotter), ["NODE_NAME"], "{ctx}");
    for c in [&provisioner, &snapshotter] {
        assert!(
            !c["args"].to_string().contains("leader-election"),
            "{ctx}: {}",
            c["args"]
        );
    }
}

/// Every `$(VAR)` left in a container's args must be one Kubernetes expands from that
/// container's env; anything else is a kustomize var that was not resolved.
fn check_runtime_vars(ctx: &str, container: &Value) {
    let env: BTreeSet<&str> = container["env"]
        .as_array()
        .map(|e| e.iter().filter_map(|v| v["name"].as_str()).collect())
        .unwrap_or_default();
    for arg in container["args"].as_array().into_iter().flatten() {
        let arg = arg.as_str().unwrap_or_default();
        let mut rest = arg;
        while let Some(start) = rest.find("$(") {
            let after = &rest[start + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let var = &after[..end];
            assert!(
                RUNTIME_VARS.contains(&var) && env.contains(var),
                "{ctx}: container {} arg {arg:?} uses $({var}), which its env does not define",
                container["name"]
            );
            rest = &after[end..];
        }
    }
}

/// An overlay with a driver name Kubernetes refuses (not a DNS subdomain): the server's
/// validation, not kubectl's, rejects the CSIDriver.
fn check_broken_overlay_is_refused(server: &ApiServer, kubectl: &Path, label: &str) {
    let tmp = tempfile::tempdir().expect("temp dir");
    // kustomize v2 takes bases only as relative paths.
    let base = std::fs::canonicalize(repo_root().join("deploy/base")).expect("deploy/base");
    let up = "../".repeat(tmp.path().components().count() - 1);
    let relative: PathBuf = Path::new(&up).join(base.strip_prefix("/").expect("absolute"));
    std::fs::write(
        tmp.path().join("kustomization.yaml"),
        format!(
            "namespace: kube-system\nbases:\n- {}\nconfigMapGenerator:\n- name: csi-driver\n  \
             behavior: merge\n  literals:\n  - name=Not_A_Driver_Name\n",
            relative.display()
        ),
    )
    .expect("write overlay");
    let out = apply_dry_run(server, kubectl, tmp.path());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "{label}: the broken overlay was accepted"
    );
    assert!(
        stderr.contains("Not_A_Driver_Name") && stderr.contains("Invalid"),
        "{label}: unexpected refusal:\n{stderr}"
    );
}
