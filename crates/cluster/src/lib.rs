//! A real one-node Kubernetes cluster, Kubernetes v1.20.2 or v1.36.2, built from real parts
//! only and torn down without a trace: etcd, kube-apiserver, kube-controller-manager (its
//! default controllers), kube-scheduler, and a node running containerd (1.6 for v1.20.2,
//! 2.3.4 for v1.36.2), runc and the whole kubelet. Images come from files, never from a
//! registry; nothing sends a packet beyond 127.0.0.0/8.
//!
//! plugreg's tests run the flow plugreg exists for on it (`tests/flow.rs`): the real kubelet
//! registers a CSI driver through plugreg's `csi-node-driver-registrar`, plugreg's
//! `csi-provisioner` creates a pod's volume, plugreg's `csi-attacher` attaches it, the kubelet
//! stages and publishes it into the pod, and a claim grown in use is expanded by plugreg's
//! `csi-resizer` and then on the node by the kubelet.
//! Driver authors get the same cluster with their own images from `plugreg-cluster up`
//! (`scripts/cluster.sh`).
//!
//! * [`Cluster::start`] brings it up (the peers come from `interop/build-peers.sh`);
//! * [`ImageSet::build`] builds the images (pause, busybox, plugreg's sidecars, the test
//!   driver) and [`Cluster::import`] loads them into the node;
//! * [`Cluster::deploy`] applies a kustomization (an overlay of `deploy/`, e.g. `deploy/test`)
//!   with the loopback rules of [`deploy`];
//! * [`Node`] is the node itself: its logs, mounts, processes, the kubelet's restart;
//! * [`Cluster::shutdown`] (or dropping the cluster) deletes the pods, stops the kubelet and
//!   containerd and removes what the node left.
//!
//! Everything runs as root on the host: the node in its own mount and PID namespaces (see
//! [`node`]), the control plane on free ports of 127.0.0.1. Two clusters at once never share a
//! directory, socket, port or cgroup.

pub mod bench;
pub mod deploy;
mod error;
pub mod host;
pub mod images;
pub mod node;
pub mod trace;
pub mod workload;

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node as NodeObject, Pod, ServiceAccount};
use k8s_openapi::api::storage::v1::CSINode;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use plugreg_testpeers::{ApiServer, ControllerManager, KubeVersion, Scheduler};
use serde_json::Value;
use tokio::time::Instant;

pub use deploy::Changes;
pub use error::Error;
pub use images::{ImageFile, ImageSet};
pub use node::{Node, NodeConfig};

/// The Node's name in every cluster (each cluster has its own API server).
pub const NODE_NAME: &str = "plugreg-node";
/// How long [`Cluster::start`] waits for the Node to be Ready.
const NODE_READY: Duration = Duration::from_secs(120);
/// How long tearing down waits for the pods to go, per phase.
const PODS_GONE: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(200);

/// How to build a cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// The Kubernetes release of every component.
    pub version: KubeVersion,
    /// The images to import into the node before the kubelet starts.
    pub images: Vec<ImageFile>,
    /// The kubelet's `-v`.
    pub kubelet_verbosity: u8,
    /// The API server writes an audit log of every request (`ApiServer::audit_log_path` of
    /// [`Cluster::api_server`]).
    pub audit: bool,
}

impl ClusterOptions {
    /// A cluster of `version` importing `images`, kubelet at `-v=2`, no audit log.
    pub fn new(version: KubeVersion, images: Vec<ImageFile>) -> Self {
        Self {
            version,
            images,
            kubelet_verbosity: 2,
            audit: false,
        }
    }
}

/// Checks, before anything starts, that this host can run a cluster of `version`: what
/// [`host::check`] checks, every peer of the release (`interop/build-peers.sh`) and kubectl
/// (`images/setup.sh`). The error names the first missing piece and the command that
/// provides it.
pub fn check(version: KubeVersion) -> Result<(), Error> {
    host::check()?;
    for name in [
        plugreg_testpeers::ETCD,
        version.apiserver_peer(),
        version.controller_manager_peer(),
        version.scheduler_peer(),
    ] {
        plugreg_testpeers::peer(name)?;
    }
    node::check_peers(version)?;
    host::kubectl().map(drop)
}

/// How long each part of [`Cluster::start`] took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StartTimes {
    /// etcd, kube-apiserver, kube-controller-manager and kube-scheduler, each until healthy.
    pub control_plane: Duration,
    /// The node's namespaces and containerd, until it answers.
    pub containerd: Duration,
    /// Importing the images.
    pub images: Duration,
    /// The kubelet, from its start until the Node is Ready and its CSINode exists.
    pub kubelet: Duration,
    /// All of it.
    pub total: Duration,
}

/// A running cluster. Dropping it tears it down (see [`shutdown`](Self::shutdown)); a test
/// that panics leaves nothing behind either.
#[derive(Debug)]
pub struct Cluster {
    inner: Option<Inner>,
    start_times: StartTimes,
}

struct Inner {
    // Torn down in this order: the node (after its pods), then the control plane.
    node: Node,
    scheduler: Option<Scheduler>,
    controller_manager: Option<ControllerManager>,
    api: ApiServer,
    client: kube::Client,
}

impl Cluster {
    /// Starts the control plane, the node (containerd in the node's namespaces), imports the
    /// images, starts the kubelet and waits until the Node is Ready.
    ///
    /// Fails with [`Error::Missing`] (naming what and the set-up command) when the host lacks
    /// something: root, a peer, a tool.
    pub async fn start(options: ClusterOptions) -> Result<Cluster, Error> {
        let t0 = Instant::now();
        let mut times = StartTimes::default();
        check(options.version)?;
        let version = options.version;
        let api = ApiServer::start_with(
            version,
            &plugreg_testpeers::ApiServerOptions {
                audit: options.audit,
                ..Default::default()
            },
        )
        .await?;
        let client = api.client().await?;
        let ca = api.ca_cert_path().display().to_string();
        let sa_key = api.service_account_key_path().display().to_string();
        // Every default controller (the PV binder, attach-detach, the DaemonSet and
        // Deployment controllers, service accounts and their tokens, the namespace and node
        // lifecycle controllers, ...).
        let controller_manager = ControllerManager::start_with_args(
            &api,
            &["*"],
            &[
                &format!("--service-account-private-key-file={sa_key}"),
                &format!("--root-ca-file={ca}"),
            ],
        )
        .await?;
        let scheduler = Scheduler::start(&api).await?;
        times.control_plane = t0.elapsed();
        let node = Node::start(NodeConfig {
            version,
            name: NODE_NAME.to_owned(),
            kubeconfig: api.kubeconfig_path().to_owned(),
            kubelet_verbosity: options.kubelet_verbosity,
        })
        .await?;
        let mut cluster = Cluster {
            inner: Some(Inner {
                node,
                scheduler: Some(scheduler),
                controller_manager: Some(controller_manager),
                api,
                client,
            }),
            start_times: StartTimes::default(),
        };
        times.containerd = t0.elapsed() - times.control_plane;
        let t1 = Instant::now();
        cluster.import(&options.images)?;
        times.images = t1.elapsed();
        let t2 = Instant::now();
        let mut attempts = 0;
        loop {
            cluster.node_mut().start_kubelet()?;
            match cluster.wait_node_ready().await {
                Ok(()) => break,
                Err(e) => {
                    attempts += 1;
                    if attempts >= 3 || !cluster.node_mut().repick_kubelet_ports()? {
                        return Err(e);
                    }
                }
            }
        }
        times.kubelet = t2.elapsed();
        times.total = t0.elapsed();
        cluster.start_times = times;
        Ok(cluster)
    }

    fn inner(&self) -> &Inner {
        self.inner
            .as_ref()
            .expect("a cluster is torn down only by shutdown or drop")
    }

    fn inner_mut(&mut self) -> &mut Inner {
        self.inner
            .as_mut()
            .expect("a cluster is torn down only by shutdown or drop")
    }

    /// The release of every component.
    pub fn version(&self) -> KubeVersion {
        self.inner().node.version()
    }

    /// How long [`start`](Self::start) took (control plane, node, images, Node Ready).
    pub fn started_in(&self) -> Duration {
        self.start_times.total
    }

    /// How long each part of [`start`](Self::start) took.
    pub fn start_times(&self) -> StartTimes {
        self.start_times
    }

    /// A kubeconfig for the cluster's admin (`kubectl --kubeconfig`, `KUBECONFIG=`).
    pub fn kubeconfig(&self) -> &Path {
        self.inner().api.kubeconfig_path()
    }

    /// The API server (its URL, port, CA, logs).
    pub fn api_server(&self) -> &ApiServer {
        &self.inner().api
    }

    /// An admin client.
    pub fn client(&self) -> kube::Client {
        self.inner().client.clone()
    }

    /// The node.
    pub fn node(&self) -> &Node {
        &self.inner().node
    }

    /// The node, to restart its kubelet.
    pub fn node_mut(&mut self) -> &mut Node {
        &mut self.inner_mut().node
    }

    /// The end of kube-controller-manager's and kube-scheduler's logs (for failure messages).
    pub fn control_plane_logs(&self) -> String {
        let inner = self.inner();
        format!(
            "--- kube-controller-manager ---\n{}\n--- kube-scheduler ---\n{}",
            inner
                .controller_manager
                .as_ref()
                .map(ControllerManager::log_tail)
                .unwrap_or_default(),
            inner
                .scheduler
                .as_ref()
                .map(Scheduler::log_tail)
                .unwrap_or_default()
        )
    }

    /// The host PIDs of every process of the cluster: the control plane's and the node's
    /// (containerd, the kubelet, shims, containers).
    pub fn processes(&self) -> Vec<u32> {
        let inner = self.inner();
        let mut pids = inner.node.processes();
        pids.extend(inner.controller_manager.as_ref().and_then(|c| c.pid()));
        pids.extend(inner.scheduler.as_ref().and_then(|s| s.pid()));
        pids.extend(inner.api.pids());
        pids
    }

    /// Imports image archives into the node.
    pub fn import(&self, images: &[ImageFile]) -> Result<(), Error> {
        for image in images {
            self.node()
                .import_image(&image.archive, image.base_name.as_deref())?;
        }
        Ok(())
    }

    /// Renders `kustomization` (a directory), applies the loopback rules and applies the
    /// result. Returns the applied objects and what the rules changed.
    pub async fn deploy(&self, kustomization: &Path) -> Result<(Vec<Value>, Changes), Error> {
        let mut objects = deploy::render(kustomization, self.kubeconfig())?;
        let changes =
            deploy::loopback_rules(&mut objects, self.api_server().port(), host::free_port)?;
        deploy::apply(&self.client(), &objects).await?;
        Ok((objects, changes))
    }

    /// Applies one object (e.g. a test's pod, as JSON with `apiVersion` and `kind`) with the
    /// loopback rules, as [`deploy`](Self::deploy) does; returns it as the API server has it.
    pub async fn apply(&self, mut object: Value) -> Result<Value, Error> {
        deploy::loopback_rules(
            std::slice::from_mut(&mut object),
            self.api_server().port(),
            host::free_port,
        )?;
        deploy::apply_one(&self.client(), &object).await
    }

    /// Creates namespace `name` and waits until pods can be created in it: its `default`
    /// service account exists (and, on v1.20.2, the token secret pods mount).
    pub async fn create_namespace(&self, name: &str) -> Result<(), Error> {
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Namespace>::all(self.client())
            .create(&PostParams::default(), &ns)
            .await?;
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client(), name);
        let v1_20 = self.version() == KubeVersion::V1_20_2;
        self.wait_for(&format!("the default service account of {name}"), || {
            let accounts = accounts.clone();
            async move {
                match accounts.get_opt("default").await {
                    Ok(Some(sa))
                        if !v1_20 || sa.secrets.as_ref().is_some_and(|s| !s.is_empty()) =>
                    {
                        Ok(Some(()))
                    }
                    Ok(_) => Ok(None),
                    Err(e) => Err(e.into()),
                }
            }
        })
        .await
    }

    /// Polls `probe` every 200 ms until it yields a value, for at most 120 s; the timeout
    /// error names `what`.
    pub async fn wait_for<T, F, Fut>(&self, what: &str, mut probe: F) -> Result<T, Error>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Option<T>, Error>>,
    {
        let deadline = Instant::now() + NODE_READY;
        let mut last = String::from("(nothing yet)");
        loop {
            match probe().await {
                Ok(Some(v)) => return Ok(v),
                Ok(None) => {}
                Err(e) => last = e.to_string(),
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: what.to_owned(),
                    waited: NODE_READY,
                    last,
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until the Node reports Ready (and the kubelet has made its CSINode).
    pub async fn wait_node_ready(&mut self) -> Result<(), Error> {
        let nodes: Api<NodeObject> = Api::all(self.client());
        let csinodes: Api<CSINode> = Api::all(self.client());
        let deadline = Instant::now() + NODE_READY;
        loop {
            if !self.node_mut().kubelet_running() {
                return Err(self.node().kubelet_error("exited"));
            }
            let ready = nodes
                .get_opt(NODE_NAME)
                .await
                .ok()
                .flatten()
                .is_some_and(|n| {
                    n.status
                        .and_then(|s| s.conditions)
                        .into_iter()
                        .flatten()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
                });
            if ready && csinodes.get_opt(NODE_NAME).await.ok().flatten().is_some() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(self
                    .node()
                    .kubelet_error(format!("did not get the Node Ready within {NODE_READY:?}")));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Stops the kubelet and starts it again (pods keep running meanwhile), then waits for
    /// the Node to be Ready.
    pub async fn restart_kubelet(&mut self) -> Result<(), Error> {
        self.node_mut().stop_kubelet().await?;
        self.node_mut().start_kubelet()?;
        self.wait_node_ready().await
    }

    /// The log lines of a container of a pod, read from the node's pod log directory (the
    /// Node has no address, so `kubectl logs` cannot reach the kubelet), every restart in
    /// order, without the CRI prefix (`<time> stdout F `).
    pub fn container_log(&self, pod: &Pod, container: &str) -> String {
        let meta = &pod.metadata;
        let dir = self.node().host_path(format!(
            "/var/log/pods/{}_{}_{}/{container}",
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default(),
            meta.uid.as_deref().unwrap_or_default()
        ));
        let mut files: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .filter_map(|e| {
                let path = e.ok()?.path();
                let n = path.file_stem()?.to_str()?.parse().ok()?;
                Some((n, path))
            })
            .collect();
        files.sort();
        let mut out = String::new();
        for (_, path) in files {
            for line in std::fs::read_to_string(path).unwrap_or_default().lines() {
                let text = line.splitn(4, ' ').nth(3).unwrap_or(line);
                out.push_str(text);
                out.push('\n');
            }
        }
        out
    }

    /// Tears the cluster down: the controller manager stops (nothing recreates pods), the
    /// pods are deleted (the workloads first, then the DaemonSets' pods, such as CSI node
    /// plugins, which the workloads' volumes need to be unmounted), the kubelet and containerd
    /// stop, the node's namespaces go (with every process and mount in them) and its cgroups,
    /// then the scheduler, the API server and etcd.
    pub async fn shutdown(mut self) -> Result<(), Error> {
        match self.inner.take() {
            Some(inner) => inner.teardown().await,
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("node", &self.node)
            .field("api", &self.api)
            .finish_non_exhaustive()
    }
}

impl Inner {
    /// Deletes the pods (see [`Cluster::shutdown`]) and tears the rest down.
    async fn teardown(mut self) -> Result<(), Error> {
        drop(self.controller_manager.take());
        // A client of its own: this may run on another runtime than the one the cluster's
        // client made its connections on.
        let client = self
            .api
            .client()
            .await
            .unwrap_or_else(|_| self.client.clone());
        for daemon_pods in [false, true] {
            self.delete_pods(&client, daemon_pods).await;
        }
        let result = self.node.shutdown().await;
        drop(self.scheduler.take());
        drop(self.api);
        result
    }

    /// Deletes the pods that are (or are not) a DaemonSet's and waits, at most 60 s, until
    /// they are gone, or their containers have stopped and (for the workloads) no CSI volume
    /// is mounted any more: what matters before the node goes is that the drivers have
    /// unmounted the volumes. (v1.20's kubelet confirms a deletion up to 10 s later.)
    async fn delete_pods(&self, client: &kube::Client, daemon_pods: bool) {
        let pods: Api<Pod> = Api::all(client.clone());
        let deadline = Instant::now() + PODS_GONE;
        let params = DeleteParams {
            grace_period_seconds: Some(2),
            ..Default::default()
        };
        loop {
            let Ok(list) = pods.list(&ListParams::default()).await else {
                return;
            };
            let left: Vec<Pod> = list
                .items
                .into_iter()
                .filter(|p| owned_by_daemonset(p) == daemon_pods)
                .collect();
            if left.is_empty() || Instant::now() >= deadline {
                return;
            }
            let stopped = left
                .iter()
                .all(|p| p.metadata.deletion_timestamp.is_some() && !running(p));
            let unmounted =
                daemon_pods
                    || !self.node.mounts().unwrap_or_default().iter().any(|m| {
                        m.contains("kubernetes.io~csi") || m.contains("kubernetes.io/csi")
                    });
            if stopped && unmounted {
                return;
            }
            for p in &left {
                if p.metadata.deletion_timestamp.is_none() {
                    let api: Api<Pod> = Api::namespaced(
                        client.clone(),
                        p.metadata.namespace.as_deref().unwrap_or("default"),
                    );
                    let _ = api
                        .delete(p.metadata.name.as_deref().unwrap_or_default(), &params)
                        .await;
                }
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

/// Whether any container of the pod runs (or is about to: no status yet).
fn running(pod: &Pod) -> bool {
    let Some(status) = &pod.status else {
        return true;
    };
    let statuses = status.container_statuses.as_deref().unwrap_or_default();
    statuses.is_empty() && status.phase.as_deref() == Some("Running")
        || statuses
            .iter()
            .any(|c| c.state.as_ref().is_none_or(|s| s.running.is_some()))
}

fn owned_by_daemonset(pod: &Pod) -> bool {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "DaemonSet")
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        // The same teardown as `shutdown`, on a thread of its own (this may run inside a
        // runtime, which must not be blocked on).
        let done = std::thread::spawn(move || {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => {
                    let _ = rt.block_on(inner.teardown());
                }
                // Dropping the parts kills their processes all the same.
                Err(_) => drop(inner),
            }
        });
        let _ = done.join();
    }
}
