//! What the cluster tests share: the images (built once per test process), a cluster with
//! `deploy/test` applied, and waits on the API server with the cluster's logs in every failure.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::CSINode;
use kube::api::Api;
use plugreg_cluster::{Cluster, ClusterOptions, Error, ImageSet, workload};
use plugreg_testpeers::KubeVersion;

/// The driver `deploy/test` installs.
pub const DRIVER: &str = "csi.plugreg.test";
/// Its namespace.
pub const DRIVER_NS: &str = "plugreg-csi-test";
/// The node plugin's DaemonSet.
pub const NODE_DS: &str = "csi-node";
/// The topology key the test driver reports (its value is the node's name).
pub const TOPOLOGY_KEY: &str = "topology.plugreg.test/node";
/// Where the test driver keeps its volumes, as the node sees it.
pub const BACKING_STORE: &str = "/var/lib/plugreg-csi-test-driver/csi.plugreg.test";

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The images, built once per test process from this profile's binaries.
pub fn images() -> &'static ImageSet {
    static IMAGES: OnceLock<ImageSet> = OnceLock::new();
    IMAGES.get_or_init(|| {
        let bin = plugreg_cluster::host::workspace_bin_dir().expect("the binaries' directory");
        ImageSet::build(&repo(), &bin, &bin.join("cluster-images")).expect("building the images")
    })
}

/// A cluster of `version` with `deploy/test` (or `overlay`) applied, and the driver
/// registered by the kubelet (the CSINode lists it).
pub async fn cluster_with_driver(version: KubeVersion, overlay: Option<&Path>) -> Cluster {
    let cluster = start_cluster(version).await;
    deploy_driver(&cluster, overlay).await;
    cluster
}

/// A cluster of v1.36.2 with the snapshot CRDs of external-snapshotter v8.6.0 and the real Go
/// snapshot-controller (a process of the host, as the control plane's are) before
/// `deploy/test` is applied, as a cluster that offers snapshots has them. The controller ends
/// when the returned handle is dropped.
pub async fn cluster_with_snapshots() -> (Cluster, plugreg_testpeers::SnapshotController) {
    cluster_with_snapshots_and(None).await
}

/// [`cluster_with_snapshots`] with `overlay` applied instead of `deploy/test`.
pub async fn cluster_with_snapshots_and(
    overlay: Option<&Path>,
) -> (Cluster, plugreg_testpeers::SnapshotController) {
    let cluster = start_cluster(KubeVersion::V1_36_2).await;
    plugreg_testpeers::install_snapshot_crds(cluster.api_server())
        .await
        .expect("installing the snapshot CRDs");
    let controller = plugreg_testpeers::SnapshotController::start(cluster.api_server())
        .await
        .expect("starting the snapshot-controller");
    deploy_driver(&cluster, overlay).await;
    (cluster, controller)
}

/// A started cluster of `version` with this build's images, nothing deployed (the test
/// prepares the node, then [`deploy_overlay`]).
pub async fn start_cluster_only(version: KubeVersion) -> Cluster {
    start_cluster(version).await
}

/// Applies `overlay` and waits until the kubelet registered the driver.
pub async fn deploy_overlay(cluster: &Cluster, overlay: &Path) {
    deploy_driver(cluster, Some(overlay)).await;
}

/// A started cluster of `version` with this build's images, nothing deployed.
async fn start_cluster(version: KubeVersion) -> Cluster {
    let images = images();
    let kustomization = std::fs::read_to_string(repo().join("deploy/test/kustomization.yaml"))
        .expect("deploy/test/kustomization.yaml");
    assert!(
        kustomization.contains(&format!("newTag: {}", images.version)),
        "deploy/test names another tag than the images carry ({}): update its images",
        images.version
    );
    Cluster::start(ClusterOptions::new(version, images.files.clone()))
        .await
        .expect("starting the cluster")
}

/// Applies `deploy/test` (or `overlay`) and waits until the kubelet registered the driver.
async fn deploy_driver(cluster: &Cluster, overlay: Option<&Path>) {
    let overlay = overlay.map_or_else(|| repo().join("deploy/test"), Path::to_owned);
    cluster
        .deploy(&overlay)
        .await
        .expect("applying the overlay");
    wait_registered(cluster).await;
}

/// Waits until the CSINode lists the driver (the kubelet registered it).
pub async fn wait_registered(cluster: &Cluster) {
    let csinodes: Api<CSINode> = Api::all(cluster.client());
    wait(cluster, "the CSINode to list the driver", || {
        let csinodes = csinodes.clone();
        async move {
            let n = csinodes.get_opt(plugreg_cluster::NODE_NAME).await?;
            Ok(n.and_then(|n| n.spec.drivers.iter().find(|d| d.name == DRIVER).map(|_| ())))
        }
    })
    .await;
}

/// Polls `probe` until it yields a value ([`Cluster::wait_for`]); on timeout fails with the
/// cluster's logs.
pub async fn wait<T, F, Fut>(cluster: &Cluster, what: &str, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, Error>>,
{
    match cluster.wait_for(what, probe).await {
        Ok(v) => v,
        Err(e) => panic!("{e}\n{}", diagnostics(cluster).await),
    }
}

/// Everything that helps to understand a failure: the pods, the kubelet's log, the control
/// plane's, and the driver pods' container logs.
pub async fn diagnostics(cluster: &Cluster) -> String {
    let mut out = String::new();
    let pods: Api<Pod> = Api::all(cluster.client());
    if let Ok(list) = pods.list(&Default::default()).await {
        for p in list.items {
            out.push_str(&format!(
                "--- pod {}/{}: {:?}\n",
                p.metadata.namespace.as_deref().unwrap_or_default(),
                p.metadata.name.as_deref().unwrap_or_default(),
                p.status
                    .as_ref()
                    .map(|s| (&s.phase, &s.conditions, &s.container_statuses))
            ));
            for c in p.spec.iter().flat_map(|s| &s.containers) {
                let log = cluster.container_log(&p, &c.name);
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                out.push_str(&format!("    [{}] last lines:\n", c.name));
                for l in tail.into_iter().rev() {
                    out.push_str(&format!("      {l}\n"));
                }
            }
        }
    }
    let kubelet = cluster.node().kubelet_log_text();
    let start = kubelet.len().saturating_sub(8000);
    let start = (start..kubelet.len())
        .find(|i| kubelet.is_char_boundary(*i))
        .unwrap_or(0);
    out.push_str(&format!(
        "--- kubelet log tail ---\n{}\n",
        &kubelet[start..]
    ));
    out.push_str(&cluster.control_plane_logs());
    out
}

/// A StorageClass of the test driver with `WaitForFirstConsumer`.
pub async fn storage_class(cluster: &Cluster, name: &str) {
    workload::storage_class(cluster, name, DRIVER)
        .await
        .expect("create the StorageClass");
}

/// A claim of 1 MiB of class `class`.
pub async fn claim(cluster: &Cluster, ns: &str, name: &str, class: &str) {
    workload::claim(cluster, ns, name, class)
        .await
        .expect("create the claim");
}

/// A host-network busybox pod that mounts claim `claim` at /data, writes `text` to
/// /data/<file> and then waits (ending at once on SIGTERM).
pub async fn pod_with_claim(
    cluster: &Cluster,
    ns: &str,
    name: &str,
    claim: &str,
    file: &str,
    text: &str,
) -> Pod {
    workload::pod_with_claim(cluster, ns, name, &images().busybox, claim, file, text)
        .await
        .expect("create the pod")
}

/// A host-network busybox pod that mounts claim `claim` at /data and prints /data/<file> to
/// its log, then waits.
pub async fn pod_reading_claim(
    cluster: &Cluster,
    ns: &str,
    name: &str,
    claim: &str,
    file: &str,
) -> Pod {
    workload::pod_reading_claim(cluster, ns, name, &images().busybox, claim, file)
        .await
        .expect("create the pod")
}

/// Waits until pod `name` runs, and returns it.
pub async fn wait_running(cluster: &Cluster, ns: &str, name: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), ns);
    wait(cluster, &format!("pod {ns}/{name} Running"), || {
        let pods = pods.clone();
        let name = name.to_owned();
        async move {
            let p = pods.get(&name).await?;
            let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            Ok(running.then_some(p))
        }
    })
    .await
}

/// The driver's pod labelled `app.kubernetes.io/name=<app>` that is not being deleted.
async fn driver_pod(cluster: &Cluster, app: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), DRIVER_NS);
    let selector = format!("app.kubernetes.io/name={app}");
    wait(cluster, &format!("the {app} pod"), || {
        let pods = pods.clone();
        let selector = selector.clone();
        async move {
            let list = pods
                .list(&kube::api::ListParams::default().labels(&selector))
                .await?;
            Ok(list
                .items
                .into_iter()
                .find(|p| p.metadata.deletion_timestamp.is_none()))
        }
    })
    .await
}

/// The node plugin's pod.
pub async fn node_plugin_pod(cluster: &Cluster) -> Pod {
    driver_pod(cluster, "csi-node").await
}

/// The node plugin's DaemonSet.
pub async fn node_daemonset(cluster: &Cluster) -> DaemonSet {
    Api::<DaemonSet>::namespaced(cluster.client(), DRIVER_NS)
        .get(NODE_DS)
        .await
        .expect("get the DaemonSet")
}

/// The controller plugin's pod.
pub async fn controller_pod(cluster: &Cluster) -> Pod {
    driver_pod(cluster, "csi-controller").await
}

/// The CSI calls a driver container made, in order: the `method` of each
/// `{"event":"call",...}` line csi-test-driver printed (its own record of what it was asked).
pub fn driver_calls(cluster: &Cluster, pod: &Pod) -> Vec<String> {
    cluster
        .container_log(pod, "csi-driver")
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "call")
        .filter_map(|v| v["method"].as_str().map(str::to_owned))
        .collect()
}

/// A running pod in namespace `ns` with a new volume of a `WaitForFirstConsumer` class (both
/// made here, named after `ns`), which wrote `text` to `hello` on it; returns the pod (as
/// Running) and its PersistentVolume.
pub async fn running_pod_with_volume(
    cluster: &Cluster,
    ns: &str,
    text: &str,
) -> (Pod, k8s_openapi::api::core::v1::PersistentVolume) {
    cluster.create_namespace(ns).await.expect("namespace");
    let class = format!("{ns}-wffc");
    storage_class(cluster, &class).await;
    claim(cluster, ns, "data", &class).await;
    pod_with_claim(cluster, ns, "app", "data", "hello", text).await;
    let pod = wait_running(cluster, ns, "app").await;
    let pv = bound_volume(cluster, ns, "data").await;
    (pod, pv)
}

/// The PersistentVolume claim `name` is bound to.
pub async fn bound_volume(
    cluster: &Cluster,
    ns: &str,
    name: &str,
) -> k8s_openapi::api::core::v1::PersistentVolume {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.client(), ns);
    let volume = wait(cluster, &format!("claim {ns}/{name} Bound"), || {
        let claims = claims.clone();
        let name = name.to_owned();
        async move {
            let c = claims.get(&name).await?;
            let bound = c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
            Ok(bound.then(|| c.spec.and_then(|s| s.volume_name)).flatten())
        }
    })
    .await;
    Api::<k8s_openapi::api::core::v1::PersistentVolume>::all(cluster.client())
        .get(&volume)
        .await
        .expect("get the PersistentVolume")
}

/// Where a pod's CSI volume is published, as the node sees it.
pub fn target_path(pod: &Pod, pv: &str) -> String {
    format!(
        "/var/lib/kubelet/pods/{}/volumes/kubernetes.io~csi/{pv}/mount",
        pod.metadata.uid.as_deref().unwrap_or_default()
    )
}

/// The mounts of the node that belong to CSI volumes (published targets, staging paths).
pub fn csi_mounts(cluster: &Cluster) -> Vec<String> {
    cluster
        .node()
        .mounts()
        .expect("the node's mounts")
        .into_iter()
        .filter(|m| m.contains("kubernetes.io~csi") || m.contains("kubernetes.io/csi"))
        .collect()
}

/// The kubelet's log from byte `from` on.
pub fn kubelet_log_since(cluster: &Cluster, from: usize) -> String {
    let log = cluster.node().kubelet_log_text();
    log.get(from..).unwrap_or_default().to_owned()
}

/// What the kubelet's CSI handler logs when it deregisters the test driver (both releases).
pub const DEREGISTER: &str = "DeRegisterPlugin request for plugin csi.plugreg.test";
/// What it logs when it registers it.
pub const REGISTER: &str = "Register new plugin with name: csi.plugreg.test";

/// Waits until pod `ns/name` is gone from the API server.
pub async fn wait_pod_gone(cluster: &Cluster, ns: &str, name: &str) {
    let pods: Api<Pod> = Api::namespaced(cluster.client(), ns);
    wait(cluster, &format!("pod {ns}/{name} gone"), || {
        let pods = pods.clone();
        let name = name.to_owned();
        async move { Ok(pods.get_opt(&name).await?.is_none().then_some(())) }
    })
    .await;
}

/// Deletes pod `ns/name` (grace 5 s) and waits until it is gone.
pub async fn delete_pod(cluster: &Cluster, ns: &str, name: &str) {
    Api::<Pod>::namespaced(cluster.client(), ns)
        .delete(name, &Default::default())
        .await
        .expect("delete the pod");
    wait_pod_gone(cluster, ns, name).await;
}

/// The HTTP status of `GET http://127.0.0.1:<port><path>` (HTTP/1.0, 5 s timeouts), or
/// `None` when nothing answers.
pub fn http_status(port: u16, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let addr = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port));
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .ok()?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// The port a container's `--http-endpoint=127.0.0.1:<port>` argument names in the applied
/// DaemonSet (where the loopback rules put it).
pub fn http_endpoint_port(ds: &DaemonSet, container: &str) -> u16 {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .into_iter()
        .flat_map(|s| &s.containers)
        .filter(|c| c.name == container)
        .flat_map(|c| c.args.iter().flatten())
        .find_map(|a| a.strip_prefix("--http-endpoint=127.0.0.1:"))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no --http-endpoint=127.0.0.1:<port> for {container}"))
}

/// The status of container `name` in a pod.
pub fn container_status(
    pod: &Pod,
    name: &str,
) -> Option<k8s_openapi::api::core::v1::ContainerStatus> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == name)
        .cloned()
}

/// A kustomization in a new temporary directory: `deploy/test` plus `patches`.
pub fn test_overlay(patches: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("plugreg-overlay-")
        .tempdir()
        .expect("temp dir");
    plugreg_cluster::deploy::write_overlay(dir.path(), &repo().join("deploy/test"), patches)
        .expect("write the overlay");
    dir
}
