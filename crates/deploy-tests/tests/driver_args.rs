//! Every row of `tests/data/sidecar-args.tsv` (the args real CSI drivers' manifests pass to the
//! sidecars) given to plugreg's sidecar of that row, against one real kube-apiserver v1.36.2 and
//! a test CSI driver of the row's own: the sidecar must get ready (below), or, for the rows
//! listed in [`VENDOR_FORK_FLAGS`] and [`NOT_IMPLEMENTED`], fail the way those lists say. A
//! failure names the row (its line, driver, manifest and sidecar) and shows the log's end.
//!
//! Ready means: the controller sidecars have logged the line their controller logs once it runs
//! (after the driver answered and, with `--leader-election`, the Lease was won; the health
//! monitor's test driver offers VOLUME_CONDITION and LIST_VOLUMES, without which it exits 1);
//! livenessprobe answers `/healthz` with 200 (its Probe reached the driver);
//! node-driver-registrar serves its registration socket.
//!
//! The row is the manifest's, with what a pod gives it and a test cannot: `$(VAR)` filled as the
//! container's environment would be ([`env_value`]), the driver socket wherever the row puts
//! it, the API server's kubeconfig instead of the in-cluster one, and each address on a free
//! loopback port so that rows run side by side ([`pod_args`]).
//!
//! Needs the peers (`bash interop/build-peers.sh`) and the sidecar binaries of the same profile
//! (`cargo build --bins -p plugreg-csi-provisioner -p plugreg-csi-attacher -p plugreg-csi-resizer
//! -p plugreg-csi-snapshotter -p plugreg-csi-health-monitor -p plugreg-node-driver-registrar
//! -p plugreg-livenessprobe`).
//! `PLUGREG_SIDECAR_ARGS` names another table of the same format (rows held back from this one);
//! `PLUGREG_SIDECAR_ARGS_JOBS` how many rows run at once (default: the number of CPUs).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::PostParams;
use plugreg_csi_test_driver::DriverConfig;
use plugreg_deploy_tests::{repo_root, workspace_bin};
use plugreg_testpeers::sidecar::{LoggedSidecar, command, free_addr};
use plugreg_testpeers::{ApiServer, KubeVersion, install_snapshot_crds};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The table: set to run other rows (the same columns) through this test.
const TABLE_ENV: &str = "PLUGREG_SIDECAR_ARGS";
/// How many rows run at once.
const JOBS_ENV: &str = "PLUGREG_SIDECAR_ARGS_JOBS";
/// How long a row's sidecar may take to get ready (a healthy one takes well under a second).
const READY_WITHIN: Duration = Duration::from_secs(40);

const VSPHERE_FORK: &str = "vSphere's own csi-provisioner build (vmware/csi-provisioner:*_vmware.*, the Supervisor cluster's) defines it for its placement engine; no upstream release of external-provisioner has it, so upstream's sidecar refuses it too";

/// Flags that only a vendor's own build of a sidecar defines: (sidecar, flag, why). A row that
/// passes one must be refused as a flag error (exit 2, the flag named).
const VENDOR_FORK_FLAGS: &[(&str, &str, &str)] = &[
    ("provisioner", "enable-hostlocal-placement", VSPHERE_FORK),
    (
        "provisioner",
        "use-service-for-placement-engine",
        VSPHERE_FORK,
    ),
    ("provisioner", "tkgs-ha", VSPHERE_FORK),
    (
        "provisioner",
        "enable-vdpp-on-stretched-supervisor",
        VSPHERE_FORK,
    ),
];

/// Features plugreg's sidecars do not implement yet: (sidecar, switch, what the refusal says,
/// why). A switch is a boolean flag, or `Gate` for a feature gate. A row that switches one on is
/// refused at start (exit 1, the message naming it): doing nothing instead would leave the
/// cluster waiting for what the flag promises.
const NOT_IMPLEMENTED: &[(&str, &str, &str, &str)] = &[(
    "provisioner",
    "Gate:CrossNamespaceVolumeDataSource",
    "is not supported",
    "cross-namespace data sources are not implemented",
)];

/// Sidecars of the table that plugreg has no binary for: (sidecar, why). Their rows are counted
/// and listed, not run. None today: every sidecar of the table has its drop-in.
const NO_BINARY: &[(&str, &str)] = &[];

/// One row of the table.
#[derive(Debug, Clone)]
struct Row {
    /// Its line in the file (1-based), to name it.
    line: usize,
    driver: String,
    source: String,
    sidecar: String,
    args: Vec<String>,
}

impl Row {
    fn name(&self) -> String {
        format!(
            "row at line {} ({}, {}, {})",
            self.line, self.driver, self.source, self.sidecar
        )
    }
}

/// The rows of a table: tab-separated `driver source_path sidecar image_tag args`, a header
/// line starting with `driver`, `#` comments and blank lines skipped; args split at
/// whitespace, as the manifests list them.
fn parse_table(text: &str) -> Vec<Row> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty() && !l.starts_with('#') && !l.starts_with("driver\t"))
        .map(|(i, l)| {
            let cols: Vec<&str> = l.split('\t').collect();
            assert!(cols.len() >= 3, "line {}: too few columns: {l:?}", i + 1);
            Row {
                line: i + 1,
                driver: cols[0].to_owned(),
                source: cols[1].to_owned(),
                sidecar: cols[2].to_owned(),
                args: cols
                    .get(4)
                    .map(|a| a.split_whitespace().map(str::to_owned).collect())
                    .unwrap_or_default(),
            }
        })
        .collect()
}

/// The binary of a sidecar column, and whether it talks to the API server.
fn binary(sidecar: &str) -> Option<(&'static str, bool)> {
    Some(match sidecar {
        "provisioner" => ("csi-provisioner", true),
        "attacher" => ("csi-attacher", true),
        "resizer" => ("csi-resizer", true),
        "snapshotter" => ("csi-snapshotter", true),
        "health-monitor" => ("csi-external-health-monitor-controller", true),
        "registrar" => ("csi-node-driver-registrar", false),
        "livenessprobe" => ("livenessprobe", false),
        _ => return None,
    })
}

/// A flag argument's name and inline value: `--name=v` / `-name=v` / `--name`.
fn split_flag(arg: &str) -> Option<(&str, Option<&str>)> {
    let body = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-'))?;
    if body.is_empty() {
        return None;
    }
    Some(match body.split_once('=') {
        Some((n, v)) => (n, Some(v)),
        None => (body, None),
    })
}

/// Every value `name` is given in `args` (`--name=v` or `--name v`), in order.
fn values<'a>(args: &'a [String], name: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    for (i, arg) in args.iter().enumerate() {
        match split_flag(arg) {
            Some((n, Some(v))) if n == name => out.push(v),
            Some((n, None)) if n == name => {
                if let Some(v) = args.get(i + 1).filter(|v| !v.starts_with('-')) {
                    out.push(v);
                }
            }
            _ => {}
        }
    }
    out
}

/// Whether `args` give the flag `name` at all.
fn has_flag(args: &[String], name: &str) -> bool {
    args.iter()
        .any(|a| split_flag(a).is_some_and(|(n, _)| n == name))
}

/// Whether the boolean flag `name` (or, as `Gate:<name>`, the feature gate) ends up on.
fn switched_on(args: &[String], switch: &str) -> bool {
    let truthy = |v: &str| matches!(v.trim(), "1" | "t" | "T" | "true" | "TRUE" | "True");
    if let Some(gate) = switch.strip_prefix("Gate:") {
        let mut on = false;
        for list in values(args, "feature-gates") {
            for pair in list.split(',') {
                if let Some((k, v)) = pair.split_once('=')
                    && k.trim() == gate
                {
                    on = truthy(v);
                }
            }
        }
        return on;
    }
    let mut on = false;
    for arg in args {
        match split_flag(arg) {
            Some((n, None)) if n == switch => on = true,
            Some((n, Some(v))) if n == switch => on = truthy(v),
            _ => {}
        }
    }
    on
}

/// What the row must do.
#[derive(Debug, Clone, PartialEq)]
enum Expect {
    Ready,
    /// Exit 2 naming the flag.
    FlagError(String),
    /// Exit 1 with this text in the log.
    Refused(String),
}

fn expectation(row: &Row) -> Expect {
    for (sidecar, flag, _) in VENDOR_FORK_FLAGS {
        if row.sidecar == *sidecar && has_flag(&row.args, flag) {
            return Expect::FlagError((*flag).to_owned());
        }
    }
    for (sidecar, switch, says, _) in NOT_IMPLEMENTED {
        if row.sidecar == *sidecar && switched_on(&row.args, switch) {
            return Expect::Refused((*says).to_owned());
        }
    }
    Expect::Ready
}

/// What the whole test shares.
struct World {
    api: Arc<ApiServer>,
    client: kube::Client,
    dir: tempfile::TempDir,
}

/// The value a pod's environment gives `$(name)` in the row's args, as the drivers' manifests
/// define it (the downward API for the pod's IP, node and namespace; literals for the socket
/// paths); `None` leaves the reference as it is, as the kubelet does with an undefined one.
fn env_value(name: &str, socket: &Path, reg_dir: &Path, driver: &str) -> Option<String> {
    Some(match name {
        "ADDRESS" | "CSI_ENDPOINT" | "CSI_ADDRESS" => socket.display().to_string(),
        "DRIVER_REG_SOCK_PATH" => format!("/var/lib/kubelet/plugins/{driver}/csi.sock"),
        "PLUGIN_REG_DIR" => reg_dir.display().to_string(),
        "POD_IP" => "127.0.0.1".into(),
        "NODE_NAME" | "KUBE_NODE_NAME" | "NODE_ID" => "node-1".into(),
        "POD_NAMESPACE" | "PDCSI_NAMESPACE" | "NAMESPACE" => "kube-system".into(),
        "POD_NAME" => "csi-controller-0".into(),
        _ => return None,
    })
}

/// `arg` with every `$(VAR)` the environment defines filled in; the names filled are added to
/// `used`.
fn expand(
    arg: &str,
    lookup: &impl Fn(&str) -> Option<String>,
    used: &mut BTreeSet<String>,
) -> String {
    let mut out = String::new();
    let mut rest = arg;
    while let Some(start) = rest.find("$(") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find(')') {
            Some(end) => {
                let name = &after[..end];
                match lookup(name) {
                    Some(v) => {
                        used.insert(name.to_owned());
                        out.push_str(&v);
                    }
                    None => out.push_str(&rest[start..start + 3 + end]),
                }
                rest = &after[end + 1..];
            }
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// The command line the row's sidecar gets here, and the readiness address (livenessprobe).
struct PodArgs {
    args: Vec<String>,
    /// The variables the args use, to set in the process's environment as the pod does.
    env: Vec<(String, String)>,
    /// Where livenessprobe serves `/healthz`.
    health: Option<SocketAddr>,
}

/// The row's args as the sidecar gets them in this test.
///
/// Beyond the `$(VAR)` references, the test changes what only holds inside a pod:
/// - `--csi-address` (any value, also a Windows path) is the row's test driver socket, and is
///   added when the row leaves it to the default (`/run/csi/socket` in the pod);
/// - `--plugin-registration-path` (the registrar's; default `/registration`) is the row's own
///   directory;
/// - every listening address (`--http-endpoint`, `--metrics-address`, `--health-port`) is a
///   free loopback port, so that rows run side by side without a port in common: a pod has
///   its own network namespace, this test has one for all rows; livenessprobe, which serves
///   `--health-port` 9808 by default, gets a free one when the row names no address. A value
///   no pod could listen on either (no port) is left as it is;
/// - the controller sidecars get `--kubeconfig` of the test's API server (a pod uses its
///   service account), put first, where Go's `flag` parses it whatever follows.
fn pod_args(row: &Row, socket: &Path, reg_dir: &Path, driver: &str, kubeconfig: &Path) -> PodArgs {
    let lookup = |name: &str| env_value(name, socket, reg_dir, driver);
    let mut used = BTreeSet::new();
    let mut args: Vec<String> = row
        .args
        .iter()
        .map(|a| expand(a, &lookup, &mut used))
        .collect();
    let controller = binary(&row.sidecar).is_some_and(|(_, c)| c);
    let mut health = None;
    let mut i = 0;
    while i < args.len() {
        let Some((name, inline)) = split_flag(&args[i]).map(|(n, v)| (n.to_owned(), v.is_some()))
        else {
            i += 1;
            continue;
        };
        if !matches!(
            name.as_str(),
            "csi-address"
                | "plugin-registration-path"
                | "http-endpoint"
                | "metrics-address"
                | "health-port"
        ) {
            i += 1;
            continue;
        }
        let given = if inline {
            args[i].split_once('=').map(|(_, v)| v.to_owned())
        } else {
            args.get(i + 1).cloned()
        };
        let Some(given) = given else { break };
        // An address or port the sidecar could not listen on in the pod either (no port, a
        // port that is no number) stays as it is: the row then fails here as it would there.
        let port = |v: &str| v.parse::<u16>().ok().filter(|p| *p > 0);
        let replacement = match name.as_str() {
            "csi-address" => Some(socket.display().to_string()),
            "plugin-registration-path" => Some(reg_dir.display().to_string()),
            "http-endpoint" | "metrics-address" => {
                given.rsplit_once(':').and_then(|(_, p)| port(p)).map(|_| {
                    let addr = free_addr();
                    health.get_or_insert(addr);
                    addr.to_string()
                })
            }
            "health-port" => port(&given).map(|_| {
                let addr = free_addr();
                health.get_or_insert(addr);
                addr.port().to_string()
            }),
            _ => None,
        };
        if let Some(value) = replacement {
            let dashes = if args[i].starts_with("--") { "--" } else { "-" };
            if inline {
                args[i] = format!("{dashes}{name}={value}");
            } else {
                args[i + 1] = value;
            }
        }
        i += if inline { 1 } else { 2 };
    }
    let mut front = Vec::new();
    if !has_flag(&args, "csi-address") {
        front.push(format!("--csi-address={}", socket.display()));
    }
    if row.sidecar == "registrar" && !has_flag(&args, "plugin-registration-path") {
        front.push(format!("--plugin-registration-path={}", reg_dir.display()));
    }
    let serves_default_port = !has_flag(&args, "health-port")
        && values(&args, "http-endpoint")
            .last()
            .is_none_or(|v| v.is_empty());
    if row.sidecar == "livenessprobe" && serves_default_port {
        let addr = free_addr();
        health = Some(addr);
        front.push(format!("--health-port={}", addr.port()));
    }
    if controller {
        front.push(format!("--kubeconfig={}", kubeconfig.display()));
    }
    front.extend(args);
    let env = used
        .into_iter()
        .map(|n| {
            let v = lookup(&n).unwrap();
            (n, v)
        })
        .collect();
    PodArgs {
        args: front,
        env,
        health,
    }
}

/// How a row went.
#[derive(Debug)]
enum Outcome {
    Ready(Duration),
    FailedAsListed,
    Skipped(&'static str),
    Failed(String),
}

/// The log's first and last lines, for a failure message (a flag error comes first, then the
/// usage).
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    if lines.len() <= 18 {
        return lines.join("\n");
    }
    format!(
        "{}\n[...]\n{}",
        lines[..3].join("\n"),
        lines[lines.len() - 12..].join("\n")
    )
}

/// The line a controller sidecar logs once its controller runs.
fn ready_line(sidecar: &str) -> &'static str {
    match sidecar {
        "provisioner" => "Informers synced; starting",
        "attacher" => "Starting CSI attacher",
        "resizer" => "Starting external resizer",
        "snapshotter" => "Starting CSI snapshotter",
        "health-monitor" => "Starting CSI External PV Health Monitor Controller",
        other => unreachable!("{other} is no controller sidecar"),
    }
}

/// Whether a GET of `/healthz` at `addr` answers 200 now (any failure: not yet). Async: the
/// answer needs the test driver, which runs on this test's runtime.
async fn healthz_ok(addr: SocketAddr) -> bool {
    let get = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
            .await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        std::io::Result::Ok(response.starts_with(b"HTTP/1.1 200 "))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(5), get).await,
        Ok(Ok(true))
    )
}

/// Creates the namespaces the row's leader election names (a cluster running the manifest
/// has them).
async fn ensure_namespaces(world: &World, args: &[String]) {
    let namespaces: Api<Namespace> = Api::all(world.client.clone());
    for ns in values(args, "leader-election-namespace") {
        if ns.is_empty() || namespaces.get_opt(ns).await.unwrap().is_some() {
            continue;
        }
        let object = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
        if let Err(e) = namespaces.create(&PostParams::default(), &object).await {
            assert!(
                matches!(&e, kube::Error::Api(s) if s.code == 409),
                "creating namespace {ns}: {e}"
            );
        }
    }
}

/// Where the capacity rows' provisioner runs: its namespace and pod.
const CAPACITY_NAMESPACE: &str = "kube-system";
const CAPACITY_POD: &str = "csi-controller-0";

/// The pod a controller Deployment's provisioner runs in, as `--capacity-ownerref-level` walks
/// it: the pod, owned by a ReplicaSet, owned by a Deployment (levels 0, 1 and 2 of the capacity
/// rows). No controller runs here, so the objects only sit there; the Deployment is not read.
async fn capacity_owner(client: &kube::Client) {
    use k8s_openapi::api::apps::v1::ReplicaSet;
    use k8s_openapi::api::core::v1::Pod;
    let created = |r: Result<(), kube::Error>| match r {
        Ok(()) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("creating the capacity rows' pod: {e}"),
    };
    let ns = CAPACITY_NAMESPACE;
    plugreg_testpeers::rbac::default_service_account(client, ns)
        .await
        .unwrap();
    let sets: Api<ReplicaSet> = Api::namespaced(client.clone(), ns);
    let labels = json!({"app": "csi-controller"});
    let rs = serde_json::from_value(json!({
        "metadata": {"name": "csi-controller-5f7c9", "ownerReferences": [{
            "apiVersion": "apps/v1", "kind": "Deployment", "name": "csi-controller",
            "uid": "0b1d4f1e-8c55-4b6a-9b1e-7d7f0c0ffee0", "controller": true}]},
        "spec": {"selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "plugreg/none"}]}}},
    }))
    .unwrap();
    created(sets.create(&PostParams::default(), &rs).await.map(drop));
    let rs = sets.get("csi-controller-5f7c9").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod = serde_json::from_value(json!({
        "metadata": {"name": CAPACITY_POD, "labels": labels, "ownerReferences": [{
            "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "csi-controller-5f7c9",
            "uid": rs.metadata.uid, "controller": true}]},
        "spec": {"containers": [{"name": "c", "image": "plugreg/none"}]},
    }))
    .unwrap();
    created(pods.create(&PostParams::default(), &pod).await.map(drop));
}

/// The test driver of a row: the Controller service with everything the controller sidecars
/// call; for the health monitor also volume conditions and ListVolumes, without which it
/// refuses to start (the ListVolumes path, which a driver with both gets, as
/// csi-driver-host-path's does).
fn driver_config(row: &Row, driver: &str) -> DriverConfig {
    let health = row.sidecar == "health-monitor";
    DriverConfig {
        name: driver.to_owned(),
        controller: true,
        controller_publish: true,
        controller_expand: true,
        controller_modify: true,
        snapshots: true,
        clone_volume: true,
        list_volumes: health,
        volume_condition: health,
        group_snapshots: row.sidecar == "snapshotter",
        ..DriverConfig::default()
    }
}

/// Runs one row to its verdict.
async fn run_row(world: Arc<World>, row: Row, index: usize) -> Outcome {
    let Some((bin, controller)) = binary(&row.sidecar) else {
        let why = NO_BINARY
            .iter()
            .find(|(s, _)| *s == row.sidecar)
            .map(|(_, w)| *w);
        return match why {
            Some(why) => Outcome::Skipped(why),
            None => Outcome::Failed(format!("unknown sidecar {:?}", row.sidecar)),
        };
    };
    let expect = expectation(&row);
    let dir = world.dir.path().join(format!("row-{index}"));
    let reg_dir = dir.join("registration");
    std::fs::create_dir_all(&reg_dir).unwrap();
    let socket = dir.join("csi.sock");
    // Its own driver name: its own Leases and registration socket.
    let driver = format!("r{index}.args.plugreg.test");
    let running = plugreg_csi_test_driver::start(driver_config(&row, &driver), &socket)
        .await
        .unwrap();
    let pod = pod_args(
        &row,
        &socket,
        &reg_dir,
        &driver,
        world.api.kubeconfig_path(),
    );
    if controller {
        ensure_namespaces(&world, &pod.args).await;
    }
    let mut cmd = command(workspace_bin(bin).to_str().unwrap());
    // The node's name, which manifests with node deployment give every sidecar from the
    // downward API (without node deployment no sidecar reads it).
    cmd.env("NODE_NAME", "node-1");
    // The namespace and pod name the capacity drivers' manifests give csi-provisioner from the
    // downward API (read only with --enable-capacity): the pod [`capacity_owner`] made.
    if row.sidecar == "provisioner" {
        cmd.env("NAMESPACE", CAPACITY_NAMESPACE)
            .env("POD_NAME", CAPACITY_POD);
    }
    cmd.args(&pod.args).envs(pod.env.iter().cloned());
    let mut sidecar = LoggedSidecar::spawn(cmd, dir.join("sidecar.log"));
    let started = Instant::now();
    let registration = reg_dir.join(format!("{driver}-reg.sock"));
    let outcome = loop {
        let ready = match row.sidecar.as_str() {
            "registrar" => tokio::net::UnixStream::connect(&registration).await.is_ok(),
            "livenessprobe" => match pod.health {
                Some(addr) => healthz_ok(addr).await,
                None => false,
            },
            other => sidecar.log().contains(ready_line(other)),
        };
        if ready {
            break match &expect {
                Expect::Ready => Outcome::Ready(started.elapsed()),
                other => Outcome::Failed(format!(
                    "got ready, expected {other:?}; args {:?}",
                    pod.args
                )),
            };
        }
        if !sidecar.running() {
            let code = sidecar.exit_code().await;
            let log = sidecar.log();
            let verdict = match &expect {
                Expect::FlagError(flag) if code == 2 && log.contains(flag.as_str()) => None,
                Expect::Refused(says) if code == 1 && log.contains(says.as_str()) => None,
                Expect::Ready => Some(format!("exited {code} before it was ready")),
                other => Some(format!("exited {code}, expected {other:?}")),
            };
            break match verdict {
                None => Outcome::FailedAsListed,
                Some(why) => {
                    Outcome::Failed(format!("{why}; args {:?}; log:\n{}", pod.args, tail(&log)))
                }
            };
        }
        if started.elapsed() > READY_WITHIN {
            break Outcome::Failed(format!(
                "not ready within {READY_WITHIN:?}; args {:?}; log:\n{}",
                pod.args,
                tail(&sidecar.log())
            ));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    sidecar.kill();
    drop(running);
    outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_of_real_drivers_args_starts_its_sidecar() {
    let path = std::env::var_os(TABLE_ENV)
        .filter(|v| !v.is_empty())
        .map_or_else(
            || repo_root().join("crates/deploy-tests/tests/data/sidecar-args.tsv"),
            PathBuf::from,
        );
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let rows = parse_table(&text);
    assert!(!rows.is_empty(), "no rows in {}", path.display());
    // Every binary is there before anything starts (a missing one says how to build it).
    for row in &rows {
        if let Some((bin, _)) = binary(&row.sidecar) {
            workspace_bin(bin);
        }
    }
    let api = ApiServer::shared(KubeVersion::V1_36_2)
        .await
        .expect("kube-apiserver");
    install_snapshot_crds(&api).await.expect("snapshot CRDs");
    let client = api.client().await.unwrap();
    capacity_owner(&client).await;
    let world = Arc::new(World {
        api,
        client,
        dir: tempfile::tempdir().unwrap(),
    });
    let jobs = std::env::var(JOBS_ENV)
        .ok()
        .and_then(|j| j.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, usize::from))
        .max(1);
    let started = Instant::now();
    let permits = Arc::new(tokio::sync::Semaphore::new(jobs));
    let mut tasks = tokio::task::JoinSet::new();
    for (index, row) in rows.iter().cloned().enumerate() {
        let (world, permits) = (world.clone(), permits.clone());
        tasks.spawn(async move {
            let _permit = permits.acquire_owned().await.unwrap();
            let name = row.name();
            let outcome = run_row(world, row, index).await;
            // As it happens: a slow run shows where it is.
            if let Outcome::Failed(why) = &outcome {
                eprintln!("FAILED {name}: {why}\n");
            }
            (index, name, outcome)
        });
    }
    let mut results = Vec::new();
    while let Some(done) = tasks.join_next().await {
        results.push(done.expect("a row's task panicked"));
    }
    results.sort_by_key(|(i, _, _)| *i);
    let mut failures = Vec::new();
    let (mut ready, mut listed, mut skipped) = (0, 0, 0);
    let mut slowest = Duration::ZERO;
    for (_, name, outcome) in &results {
        match outcome {
            Outcome::Ready(t) => {
                ready += 1;
                slowest = slowest.max(*t);
            }
            Outcome::FailedAsListed => listed += 1,
            Outcome::Skipped(why) => {
                skipped += 1;
                eprintln!("skipped {name}: {why}");
            }
            Outcome::Failed(why) => failures.push(format!("{name}: {why}")),
        }
    }
    eprintln!(
        "{} rows in {:.1?} ({jobs} at once): {ready} ready (slowest {slowest:.1?}), {listed} refused as listed, {skipped} skipped, {} failed",
        results.len(),
        started.elapsed(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} rows failed:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn rows_parse_with_their_line_and_args() {
    let rows = parse_table(
        "driver\tsource_path\tsidecar\timage_tag\targs\n# a comment\n\nd\tm.yaml@1\tlivenessprobe\tv2\t\nd\tm.yaml@1\tresizer\tv1\t-csi-address=$(ADDRESS)  -v=2\n",
    );
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].line, 4);
    assert!(rows[0].args.is_empty());
    assert_eq!(rows[1].args, ["-csi-address=$(ADDRESS)", "-v=2"]);
    assert_eq!(rows[1].name(), "row at line 5 (d, m.yaml@1, resizer)");
}

/// A row of `sidecar` with `args`, for the unit tests.
fn row(sidecar: &str, args: &str) -> Row {
    Row {
        line: 1,
        driver: "d".into(),
        source: "s".into(),
        sidecar: sidecar.into(),
        args: args.split_whitespace().map(str::to_owned).collect(),
    }
}

#[test]
fn pod_args_fill_the_environment_and_move_addresses_to_free_ports() {
    let (sock, reg, kc) = (
        Path::new("/t/csi.sock"),
        Path::new("/t/reg"),
        Path::new("/t/kc"),
    );
    let p = pod_args(
        &row(
            "provisioner",
            "--csi-address=unix://C:\\csi\\csi.sock --http-endpoint=$(POD_IP):8090 --leader-election-namespace=$(POD_NAMESPACE) --v=1",
        ),
        sock,
        reg,
        "drv",
        kc,
    );
    assert_eq!(p.args[0], "--kubeconfig=/t/kc");
    assert_eq!(p.args[1], "--csi-address=/t/csi.sock");
    assert!(
        p.args[2].starts_with("--http-endpoint=127.0.0.1:"),
        "{:?}",
        p.args
    );
    assert_ne!(p.args[2], "--http-endpoint=127.0.0.1:8090");
    assert_eq!(p.args[3], "--leader-election-namespace=kube-system");
    assert_eq!(
        p.env,
        [
            ("POD_IP".to_owned(), "127.0.0.1".to_owned()),
            ("POD_NAMESPACE".to_owned(), "kube-system".to_owned())
        ]
    );
    let p = pod_args(&row("livenessprobe", ""), sock, reg, "drv", kc);
    assert_eq!(p.args[0], "--csi-address=/t/csi.sock");
    assert!(p.args[1].starts_with("--health-port="));
    assert!(p.health.is_some());
    let p = pod_args(
        &row(
            "registrar",
            "--kubelet-registration-path=$(DRIVER_REG_SOCK_PATH) -health-port 9809 --x=$(UNKNOWN)",
        ),
        sock,
        reg,
        "drv",
        kc,
    );
    assert_eq!(
        p.args[..2],
        [
            "--csi-address=/t/csi.sock",
            "--plugin-registration-path=/t/reg"
        ]
    );
    assert_eq!(
        p.args[2],
        "--kubelet-registration-path=/var/lib/kubelet/plugins/drv/csi.sock"
    );
    assert_eq!(p.args[3], "-health-port");
    assert_ne!(p.args[4], "9809");
    assert_eq!(p.args[5], "--x=$(UNKNOWN)");
    let p = pod_args(
        &row(
            "livenessprobe",
            "--health-port=localhost:29613 --http-endpoint=",
        ),
        sock,
        reg,
        "drv",
        kc,
    );
    assert_eq!(
        p.args[1..],
        ["--health-port=localhost:29613", "--http-endpoint="]
    );
    assert!(p.health.is_none());
}

#[test]
fn listed_failures_are_recognised() {
    assert_eq!(
        expectation(&row("provisioner", "--tkgs-ha=true --enable-capacity")),
        Expect::FlagError("tkgs-ha".into())
    );
    assert_eq!(
        expectation(&row("provisioner", "--enable-capacity")),
        Expect::Ready
    );
    assert_eq!(
        expectation(&row(
            "provisioner",
            "--enable-capacity=true --enable-capacity=false"
        )),
        Expect::Ready
    );
    // Group snapshots are implemented: v8.0's flag and the gate start.
    assert_eq!(
        expectation(&row("snapshotter", "--enable-volume-group-snapshots=true")),
        Expect::Ready
    );
    assert_eq!(
        expectation(&row("snapshotter", "--enable-volume-group-snapshots=false")),
        Expect::Ready
    );
    assert_eq!(
        expectation(&row(
            "snapshotter",
            "--feature-gates=CSIVolumeGroupSnapshot=true"
        )),
        Expect::Ready
    );
    // The attacher has no such flag: its row must start.
    assert_eq!(expectation(&row("attacher", "--tkgs-ha")), Expect::Ready);
}

#[test]
fn health_monitor_rows_run_against_a_driver_with_volume_conditions() {
    let health = row(
        "health-monitor",
        "--v=5 --csi-address=$(ADDRESS) --leader-election",
    );
    assert_eq!(
        binary(&health.sidecar),
        Some(("csi-external-health-monitor-controller", true))
    );
    assert_eq!(expectation(&health), Expect::Ready);
    let config = driver_config(&health, "drv");
    assert!(config.controller && config.list_volumes && config.volume_condition);
    // The other sidecars' drivers stay as they were: LIST_VOLUMES would have the attacher
    // reconcile its attachments through ListVolumes.
    let config = driver_config(&row("attacher", ""), "drv");
    assert!(!config.list_volumes && !config.volume_condition);
    let p = pod_args(
        &health,
        Path::new("/t/csi.sock"),
        Path::new("/t/reg"),
        "drv",
        Path::new("/t/kc"),
    );
    assert_eq!(
        p.args,
        [
            "--kubeconfig=/t/kc",
            "--v=5",
            "--csi-address=/t/csi.sock",
            "--leader-election"
        ]
    );
}
