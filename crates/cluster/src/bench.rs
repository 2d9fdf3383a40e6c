//! The one-node cluster's benchmark (`plugreg-cluster bench`, `scripts/cluster.sh bench`):
//! per release, cluster start-up and the driver's registration (several clusters), then on
//! one cluster a volume's life, repeated: pod created -> Running with a new volume
//! (WaitForFirstConsumer: scheduling, provisioning, staging, publishing, container start),
//! pod deleted -> volume unmounted on the node, claim deleted -> PV gone; and on v1.36.2 a
//! claim's whole life (issue 33): snapshot (split into csi-snapshotter's part and the
//! snapshot-controller's), restore, clone, expansion in use, clean-up. The figures go into
//! `BENCHMARKS.md` between `<!-- bench:cluster:start -->` and `<!-- bench:cluster:end -->`.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::CSINode;
use kube::api::Api;
use plugreg_testpeers::KubeVersion;
use tokio::time::Instant;

use crate::trace::Window;
use crate::{Cluster, ClusterOptions, Error, ImageSet, NODE_NAME, StartTimes, workload};

/// The block of `BENCHMARKS.md` this benchmark owns.
pub const START: &str = "<!-- bench:cluster:start -->";
/// Its end.
pub const END: &str = "<!-- bench:cluster:end -->";

/// The driver `deploy/test` installs.
const DRIVER: &str = "csi.plugreg.test";
/// How often a state is polled while a duration is measured.
const POLL: Duration = Duration::from_millis(10);
/// How long one measured step may take.
const STEP: Duration = Duration::from_secs(120);

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The releases.
    pub versions: Vec<KubeVersion>,
    /// Clusters started per release (start-up figures).
    pub starts: usize,
    /// Volume lives per release.
    pub runs: usize,
    /// Whole claim lives (snapshot, restore, clone, expansion; v1.36.2).
    pub lives: usize,
    /// The images (from the binaries under test).
    pub images: ImageSet,
    /// The kustomization that installs the driver (`deploy/test`).
    pub overlay: PathBuf,
    /// Trace the last claim life's steps through the API server's audit log
    /// ([`crate::trace`]): the first cluster of v1.36.2 writes one.
    pub trace: bool,
}

/// The figures of one release.
#[derive(Debug, Clone, Default)]
pub struct ReleaseFigures {
    /// The release.
    pub version: Option<KubeVersion>,
    /// Each cluster's start-up.
    pub starts: Vec<StartTimes>,
    /// Overlay applied -> the kubelet has registered the driver (CSINode lists it).
    pub registered: Vec<Duration>,
    /// Tear-down of each cluster.
    pub teardown: Vec<Duration>,
    /// Pod created -> Running, with a new volume.
    pub pod_running: Vec<Duration>,
    /// Pod deleted -> its volume unmounted (target and staging path) on the node.
    pub unmounted: Vec<Duration>,
    /// Claim deleted -> PV gone.
    pub pv_gone: Vec<Duration>,
    /// A claim's whole life (issue 33; v1.36.2, with the snapshot CRDs and controller):
    /// VolumeSnapshot created -> its content has a snapshot handle (csi-snapshotter's part).
    pub snapshot_cut: Vec<Duration>,
    /// VolumeSnapshot created -> readyToUse (the snapshot-controller's part after it too).
    pub snapshot_ready: Vec<Duration>,
    /// Restored claim and a pod on it created -> Running.
    pub restored_running: Vec<Duration>,
    /// Cloned claim (Immediate class) created -> Bound.
    pub clone_bound: Vec<Duration>,
    /// Claim in use grown 1 MiB -> 2 MiB -> its status capacity 2 MiB (controller and node
    /// expansion).
    pub expanded: Vec<Duration>,
    /// Everything of a life deleted -> no PV, VolumeAttachment or snapshot content left.
    pub all_gone: Vec<Duration>,
    /// The last claim life's steps, traced ([`BenchOptions::trace`]), as Markdown.
    pub trace: Option<String>,
}

/// Runs the benchmark.
pub async fn run(options: &BenchOptions) -> Result<Vec<ReleaseFigures>, Error> {
    let mut all = Vec::new();
    for version in &options.versions {
        let mut figures = ReleaseFigures {
            version: Some(*version),
            ..Default::default()
        };
        for i in 0..options.starts.max(1) {
            let lives_here = i == 0 && *version == KubeVersion::V1_36_2 && options.lives > 0;
            let mut cluster_options = ClusterOptions::new(*version, options.images.files.clone());
            cluster_options.audit = options.trace && lives_here;
            let cluster = Cluster::start(cluster_options).await?;
            figures.starts.push(cluster.start_times());
            // Snapshots need the CRDs and the Go snapshot-controller (v1.36.2 only: the CRDs
            // need a recent API server), before the driver, as a cluster that offers them has.
            let snapshots = if lives_here {
                plugreg_testpeers::install_snapshot_crds(cluster.api_server()).await?;
                Some(plugreg_testpeers::SnapshotController::start(cluster.api_server()).await?)
            } else {
                None
            };
            let t = Instant::now();
            cluster.deploy(&options.overlay).await?;
            wait_registered(&cluster).await?;
            figures.registered.push(t.elapsed());
            if i == 0 {
                volume_lives(&cluster, options, &mut figures).await?;
                if snapshots.is_some() {
                    let windows = claim_lives(&cluster, options, &mut figures).await?;
                    if let Some(log) = cluster.api_server().audit_log_path() {
                        let mut requests = crate::trace::read(log)?;
                        // The driver's own calls (deploy/test's --call-log), beside them.
                        let calls = cluster.node().host_path(format!(
                            "/var/lib/plugreg-csi-test-driver/{DRIVER}.calls.log"
                        ));
                        requests.extend(crate::trace::read_calls(&calls)?);
                        figures.trace = Some(format!(
                            "{}{}",
                            crate::trace::summary(&requests, &windows),
                            crate::trace::markdown(&requests, &windows)
                        ));
                    }
                }
            }
            drop(snapshots);
            let t = Instant::now();
            cluster.shutdown().await?;
            figures.teardown.push(t.elapsed());
        }
        all.push(figures);
    }
    Ok(all)
}

async fn wait_registered(cluster: &Cluster) -> Result<(), Error> {
    let csinodes: Api<CSINode> = Api::all(cluster.client());
    until(STEP, "the driver registered", || {
        let csinodes = csinodes.clone();
        async move {
            Ok(csinodes
                .get_opt(NODE_NAME)
                .await?
                .is_some_and(|n| n.spec.drivers.iter().any(|d| d.name == DRIVER)))
        }
    })
    .await
}

/// `runs` times: a claim and a pod (measured until Running), the pod deleted (until its
/// volume is unmounted), the claim deleted (until the PV is gone).
async fn volume_lives(
    cluster: &Cluster,
    options: &BenchOptions,
    figures: &mut ReleaseFigures,
) -> Result<(), Error> {
    let ns = "bench";
    cluster.create_namespace(ns).await?;
    workload::storage_class(cluster, "bench-wffc", DRIVER).await?;
    let pods: Api<Pod> = Api::namespaced(cluster.client(), ns);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.client(), ns);
    let pvs: Api<PersistentVolume> = Api::all(cluster.client());
    for i in 0..options.runs {
        let (claim, pod) = (format!("data-{i}"), format!("app-{i}"));
        workload::claim(cluster, ns, &claim, "bench-wffc").await?;
        let t = Instant::now();
        let created = workload::pod_with_claim(
            cluster,
            ns,
            &pod,
            &options.images.busybox,
            &claim,
            "hello",
            "bench",
        )
        .await?;
        until(STEP, "the pod Running", || {
            let pods = pods.clone();
            let pod = pod.clone();
            async move {
                let p = pods.get(&pod).await?;
                Ok(p.status.and_then(|s| s.phase).as_deref() == Some("Running"))
            }
        })
        .await?;
        figures.pod_running.push(t.elapsed());

        let pv = claims
            .get(&claim)
            .await?
            .spec
            .and_then(|s| s.volume_name)
            .unwrap_or_default();
        let target = format!(
            "/var/lib/kubelet/pods/{}/volumes/kubernetes.io~csi/{pv}/mount",
            created.metadata.uid.unwrap_or_default()
        );
        let t = Instant::now();
        pods.delete(&pod, &Default::default()).await?;
        // One volume at a time: none of the node's mounts is a CSI volume's any more (the
        // target under the pod's directory, the staging path under the CSI plugin's).
        until(STEP, "the volume unmounted", || {
            let mounts = cluster.node().mounts();
            let target = target.clone();
            async move {
                let mounts = mounts?;
                Ok(!mounts.iter().any(|m| {
                    *m == target
                        || m.contains("kubernetes.io~csi")
                        || m.contains("kubernetes.io/csi")
                }))
            }
        })
        .await?;
        figures.unmounted.push(t.elapsed());
        // The claim is protected until the pod object is gone.
        until(STEP, "the pod gone", || {
            let pods = pods.clone();
            let pod = pod.clone();
            async move { Ok(pods.get_opt(&pod).await?.is_none()) }
        })
        .await?;
        let t = Instant::now();
        claims.delete(&claim, &Default::default()).await?;
        until(STEP, "the PV gone", || {
            let pvs = pvs.clone();
            let pv = pv.clone();
            async move { Ok(pvs.get_opt(&pv).await?.is_none()) }
        })
        .await?;
        figures.pv_gone.push(t.elapsed());
    }
    Ok(())
}

/// `lives` times, one claim's whole life as a user lives it (issue 33): a claim and a pod on it
/// (Running), a VolumeSnapshot of it (until its content has a handle, csi-snapshotter's part,
/// and until readyToUse, the snapshot-controller's after it), a claim restored from it with a
/// pod (Running), a clone of the claim in an Immediate class (Bound), the first claim grown in
/// use (its status capacity), and everything deleted (no PV, VolumeAttachment or content
/// left).
async fn claim_lives(
    cluster: &Cluster,
    options: &BenchOptions,
    figures: &mut ReleaseFigures,
) -> Result<Vec<Window>, Error> {
    // Every life's steps, for the trace: the last life's in full, every life's in sum.
    let mut windows = Vec::new();
    let mut mark = |life: usize, step: &str, start: SystemTime| {
        windows.push(Window {
            step: step.to_owned(),
            life,
            start,
            end: SystemTime::now(),
        });
    };
    use k8s_openapi::api::storage::v1::VolumeAttachment;
    use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
    let snapshot_kind = |kind: &str, plural: &str| ApiResource {
        group: "snapshot.storage.k8s.io".into(),
        version: "v1".into(),
        api_version: "snapshot.storage.k8s.io/v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    };
    let ns = "lives";
    cluster.create_namespace(ns).await?;
    // The cluster's WaitForFirstConsumer class exists (volume_lives); an Immediate one too.
    cluster
        .apply(serde_json::json!({
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": "bench-immediate"}, "provisioner": DRIVER,
            "volumeBindingMode": "Immediate", "reclaimPolicy": "Delete",
            "allowVolumeExpansion": true,
        }))
        .await?;
    cluster
        .apply(serde_json::json!({
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
            "metadata": {"name": "bench-snapshots"}, "driver": DRIVER, "deletionPolicy": "Delete",
        }))
        .await?;
    let pods: Api<Pod> = Api::namespaced(cluster.client(), ns);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.client(), ns);
    let snapshots: Api<DynamicObject> = Api::namespaced_with(
        cluster.client(),
        ns,
        &snapshot_kind("VolumeSnapshot", "volumesnapshots"),
    );
    let contents: Api<DynamicObject> = Api::all_with(
        cluster.client(),
        &snapshot_kind("VolumeSnapshotContent", "volumesnapshotcontents"),
    );
    let pvs: Api<PersistentVolume> = Api::all(cluster.client());
    let attachments: Api<VolumeAttachment> = Api::all(cluster.client());
    let running = |pod: String| {
        let pods = pods.clone();
        move || {
            let pods = pods.clone();
            let pod = pod.clone();
            async move {
                let p = pods.get(&pod).await?;
                Ok(p.status.and_then(|s| s.phase).as_deref() == Some("Running"))
            }
        }
    };
    let bound = |claim: String| {
        let claims = claims.clone();
        move || {
            let claims = claims.clone();
            let claim = claim.clone();
            async move {
                let c = claims.get(&claim).await?;
                Ok(c.status.and_then(|s| s.phase).as_deref() == Some("Bound"))
            }
        }
    };
    for i in 0..options.lives {
        let (data, app) = (format!("data-{i}"), format!("app-{i}"));
        let wall = SystemTime::now();
        workload::claim(cluster, ns, &data, "bench-wffc").await?;
        workload::pod_with_claim(cluster, ns, &app, &options.images.busybox, &data, "f", "x")
            .await?;
        until(STEP, "the pod Running", running(app.clone())).await?;
        mark(i, "claim + pod created -> Running", wall);

        let snap = format!("snap-{i}");
        let t = Instant::now();
        let wall = SystemTime::now();
        cluster
            .apply(serde_json::json!({
                "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
                "metadata": {"name": snap, "namespace": ns},
                "spec": {"volumeSnapshotClassName": "bench-snapshots",
                    "source": {"persistentVolumeClaimName": data}},
            }))
            .await?;
        let cut = std::sync::Arc::new(std::sync::Mutex::new(None));
        until(STEP, "the snapshot readyToUse", || {
            let (snapshots, contents, snap) = (snapshots.clone(), contents.clone(), snap.clone());
            let cut = std::sync::Arc::clone(&cut);
            async move {
                let s = snapshots.get(&snap).await?;
                let seen = cut.lock().unwrap_or_else(|e| e.into_inner()).is_some();
                if !seen
                    && let Some(uid) = s.metadata.uid.as_deref()
                    && let Some(c) = contents.get_opt(&format!("snapcontent-{uid}")).await?
                    && c.data["status"]["snapshotHandle"].is_string()
                {
                    *cut.lock().unwrap_or_else(|e| e.into_inner()) = Some(t.elapsed());
                }
                Ok(s.data["status"]["readyToUse"] == serde_json::json!(true))
            }
        })
        .await?;
        let ready = t.elapsed();
        let cut = *cut.lock().unwrap_or_else(|e| e.into_inner());
        figures.snapshot_cut.push(cut.unwrap_or(ready));
        figures.snapshot_ready.push(ready);
        mark(i, "VolumeSnapshot created -> readyToUse", wall);

        let (restored, reader) = (format!("restored-{i}"), format!("reader-{i}"));
        let t = Instant::now();
        let wall = SystemTime::now();
        cluster
            .apply(serde_json::json!({
                "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": restored, "namespace": ns},
                "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "bench-wffc",
                    "resources": {"requests": {"storage": "1Mi"}},
                    "dataSource": {"apiGroup": "snapshot.storage.k8s.io",
                        "kind": "VolumeSnapshot", "name": snap}},
            }))
            .await?;
        workload::pod_reading_claim(
            cluster,
            ns,
            &reader,
            &options.images.busybox,
            &restored,
            "f",
        )
        .await?;
        until(STEP, "the restored pod Running", running(reader.clone())).await?;
        figures.restored_running.push(t.elapsed());
        mark(i, "restored claim + pod created -> Running", wall);

        let clone = format!("clone-{i}");
        let t = Instant::now();
        let wall = SystemTime::now();
        cluster
            .apply(serde_json::json!({
                "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": clone, "namespace": ns},
                "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "bench-immediate",
                    "resources": {"requests": {"storage": "1Mi"}},
                    "dataSource": {"kind": "PersistentVolumeClaim", "name": data}},
            }))
            .await?;
        until(STEP, "the clone Bound", bound(clone.clone())).await?;
        figures.clone_bound.push(t.elapsed());
        mark(i, "cloned claim created -> Bound", wall);

        let t = Instant::now();
        let wall = SystemTime::now();
        claims
            .patch(
                &data,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({
                    "spec": {"resources": {"requests": {"storage": "2Mi"}}}})),
            )
            .await?;
        until(STEP, "the claim expanded", || {
            let (claims, data) = (claims.clone(), data.clone());
            async move {
                let c = claims.get(&data).await?;
                Ok(c.status
                    .and_then(|s| s.capacity)
                    .and_then(|c| c.get("storage").cloned())
                    .is_some_and(|q| q.0 == "2Mi"))
            }
        })
        .await?;
        figures.expanded.push(t.elapsed());
        mark(i, "claim in use grown -> status capacity", wall);

        let t = Instant::now();
        let wall = SystemTime::now();
        for p in [&app, &reader] {
            pods.delete(p, &Default::default()).await?;
        }
        snapshots.delete(&snap, &Default::default()).await?;
        for c in [&data, &restored, &clone] {
            claims.delete(c, &Default::default()).await?;
        }
        until(STEP, "no PV, attachment or content left", || {
            let (pvs, attachments, contents) = (pvs.clone(), attachments.clone(), contents.clone());
            async move {
                Ok(pvs.list(&Default::default()).await?.items.is_empty()
                    && attachments
                        .list(&Default::default())
                        .await?
                        .items
                        .is_empty()
                    && contents.list(&Default::default()).await?.items.is_empty())
            }
        })
        .await?;
        figures.all_gone.push(t.elapsed());
        mark(
            i,
            "everything deleted -> no PV, VolumeAttachment or content",
            wall,
        );
    }
    Ok(windows)
}

async fn until<F, Fut>(limit: Duration, what: &str, mut probe: F) -> Result<(), Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool, Error>>,
{
    let deadline = Instant::now() + limit;
    let mut last = String::new();
    loop {
        match probe().await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last = e.to_string(),
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: what.to_owned(),
                waited: limit,
                last,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Median, 90th percentile, minimum and maximum.
pub fn summary(samples: &[Duration]) -> Option<(Duration, Duration, Duration, Duration)> {
    if samples.is_empty() {
        return None;
    }
    let mut s = samples.to_vec();
    s.sort();
    let at = |q: f64| s[((s.len() - 1) as f64 * q).round() as usize];
    Some((at(0.5), at(0.9), s[0], s[s.len() - 1]))
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

fn row(o: &mut String, what: &str, samples: &[Duration]) {
    match summary(samples) {
        Some((median, p90, min, max)) => o.push_str(&format!(
            "| {what} | {} | {} | {} | {} | {} | {} |\n",
            samples.len(),
            secs(median),
            secs(p90),
            secs(min),
            secs(max),
            samples
                .iter()
                .map(|d| format!("{:.2}", d.as_secs_f64()))
                .collect::<Vec<_>>()
                .join(" ")
        )),
        None => o.push_str(&format!("| {what} | 0 | | | | | |\n")),
    }
}

/// Where and when the figures were taken.
#[derive(Debug, Clone)]
pub struct RunInfo {
    /// UTC date and time.
    pub date: String,
    /// The commit under test.
    pub commit: String,
    /// CPUs, model, kernel, memory.
    pub machine: String,
    /// /proc/loadavg at the start.
    pub load: String,
    /// The command that took them.
    pub command: String,
}

/// The section for `BENCHMARKS.md` (with its markers).
pub fn markdown(info: &RunInfo, figures: &[ReleaseFigures]) -> String {
    let mut o = String::new();
    o.push_str(START);
    o.push_str("\n## One-node cluster: start-up and a volume's life (issue 19)\n\n");
    o.push_str(
        "Written by `plugreg-cluster bench` (crates/cluster/src/bench.rs). A real cluster per \
         release (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd, \
         runc, the kubelet; see crates/cluster), `deploy/test` applied (plugreg's \
         csi-node-driver-registrar, livenessprobe, csi-provisioner, csi-attacher and csi-resizer \
         images with csi-test-driver, built from the binaries beside the command), then one \
         volume's life after another: a WaitForFirstConsumer claim and a busybox pod that mounts \
         it (pod created -> Running: scheduling, the selected-node annotation, CreateVolume \
         through csi-provisioner, binding, the VolumeAttachment attached by csi-attacher, \
         NodeStageVolume and NodePublishVolume by the kubelet, the container's start), the pod \
         deleted (-> target and staging path unmounted on the node), the claim deleted (-> \
         DeleteVolume, PV gone). On v1.36.2, with the snapshot CRDs and the Go \
         snapshot-controller v8.6.0, also a claim's whole life (issue 33): a VolumeSnapshot \
         (until its content has a handle, csi-snapshotter's part; until readyToUse, the \
         snapshot-controller's after it), a restored claim with a pod, a clone (Immediate \
         class), the claim grown in use (the kubelet's node expansion comes with its pod \
         resync, about a minute), everything deleted. States polled every 10 ms. No Go \
         sidecar ran beside: there is no registry to pull upstream's images from, so there is \
         no same-run comparison.\n\n",
    );
    o.push_str(&format!("    {}\n\n", info.command));
    o.push_str("| | |\n|---|---|\n");
    o.push_str(&format!("| date | {} |\n", info.date));
    o.push_str(&format!("| machine | {} |\n", info.machine));
    o.push_str(&format!("| load average at start | {} |\n", info.load));
    o.push_str(&format!("| commit | `{}` |\n\n", info.commit));
    for f in figures {
        let version = f.version.map_or("?", KubeVersion::as_str);
        o.push_str(&format!("### Kubernetes {version}\n\n"));
        o.push_str("| | runs | median | p90 | min | max | every run (s) |\n|---|---|---|---|---|---|---|\n");
        let part = |get: fn(&StartTimes) -> Duration| f.starts.iter().map(get).collect::<Vec<_>>();
        row(
            &mut o,
            "cluster start-up (control plane, node, images, Node Ready)",
            &part(|s| s.total),
        );
        row(
            &mut o,
            "... control plane (etcd, API server, controller manager, scheduler healthy)",
            &part(|s| s.control_plane),
        );
        row(
            &mut o,
            "... node namespaces + containerd answering",
            &part(|s| s.containerd),
        );
        row(
            &mut o,
            "... images imported (pause, busybox, 5 sidecars, test driver)",
            &part(|s| s.images),
        );
        row(
            &mut o,
            "... kubelet started -> Node Ready",
            &part(|s| s.kubelet),
        );
        row(
            &mut o,
            "deploy/test applied -> driver registered (CSINode lists it)",
            &f.registered,
        );
        row(
            &mut o,
            "pod created -> Running with a new volume",
            &f.pod_running,
        );
        row(&mut o, "pod deleted -> volume unmounted", &f.unmounted);
        row(&mut o, "claim deleted -> PV gone", &f.pv_gone);
        if !f.snapshot_ready.is_empty() {
            row(
                &mut o,
                "a claim's life: VolumeSnapshot created -> content cut (csi-snapshotter's status)",
                &f.snapshot_cut,
            );
            row(
                &mut o,
                "... VolumeSnapshot created -> readyToUse (snapshot-controller after it)",
                &f.snapshot_ready,
            );
            row(
                &mut o,
                "... restored claim + pod created -> Running",
                &f.restored_running,
            );
            row(
                &mut o,
                "... cloned claim (Immediate) created -> Bound",
                &f.clone_bound,
            );
            row(
                &mut o,
                "... claim in use grown 1 -> 2 MiB -> status capacity 2 MiB",
                &f.expanded,
            );
            row(
                &mut o,
                "... pods, snapshot and claims deleted -> no PV, VolumeAttachment or content",
                &f.all_gone,
            );
        }
        row(
            &mut o,
            "tear-down (pods deleted, node and control plane stopped)",
            &f.teardown,
        );
        o.push('\n');
        if let Some(trace) = &f.trace {
            o.push_str(
                "### Where each claim life's time went (audit log of the API server, the driver's call log)\n\n\
                 The API server's audit log (level Metadata, written in blocking mode: each \
                 request waits for its line) and csi-test-driver's `--call-log` read back for \
                 each step of every life (`crates/cluster/src/trace.rs`): every request but \
                 watches, lists, Events, the benchmark's own and Leases other than \
                 csi-provisioner's volume record, and every driver call but those made on a \
                 timer (Probe, ControllerGetVolume, ListVolumes), in the order received, with \
                 who made it, the API server's (the driver's) time, and how long after the \
                 previous answer it came (its maker's reaction: the watch event, its queue, \
                 its own work). First each step summed over the lives, then the last life's \
                 timeline.\n\n",
            );
            o.push_str(trace);
        }
    }
    o.push_str(END);
    o.push('\n');
    o
}

/// `existing` with its block between [`START`] and [`END`] replaced by `section` (appended
/// when there is none).
pub fn splice(existing: &str, section: &str) -> String {
    match (existing.find(START), existing.find(END)) {
        (Some(a), Some(b)) if a < b => {
            let mut end = b + END.len();
            if existing[end..].starts_with('\n') {
                end += 1;
            }
            format!("{}{section}{}", &existing[..a], &existing[end..])
        }
        _ if existing.is_empty() => section.to_owned(),
        _ => format!(
            "{}\n{section}",
            existing.trim_end_matches('\n').to_owned() + "\n"
        ),
    }
}

/// Writes `section` into the file at `path` (see [`splice`]).
pub fn write_into(path: &Path, section: &str) -> Result<(), Error> {
    let existing = std::fs::read_to_string(path).unwrap_or_default();
    std::fs::write(path, splice(&existing, section))
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summarises_samples() {
        let ms = |v: &[u64]| {
            v.iter()
                .map(|m| Duration::from_millis(*m))
                .collect::<Vec<_>>()
        };
        let (median, p90, min, max) = summary(&ms(&[5, 1, 4, 2, 3])).unwrap();
        assert_eq!(
            (median, p90, min, max),
            (
                Duration::from_millis(3),
                Duration::from_millis(5),
                Duration::from_millis(1),
                Duration::from_millis(5)
            )
        );
        assert!(summary(&[]).is_none());
    }

    #[test]
    fn replaces_only_its_block() {
        let section = format!("{START}\nnew\n{END}\n");
        let doc = format!("a\n{START}\nold\n{END}\nb\n");
        assert_eq!(
            splice(&doc, &section),
            format!("a\n{START}\nnew\n{END}\nb\n")
        );
        assert_eq!(splice("a\n", &section), format!("a\n\n{section}"));
        assert_eq!(splice("", &section), section);
    }

    #[test]
    fn every_row_has_as_many_cells_as_its_header() {
        let info = RunInfo {
            date: "d".into(),
            commit: "c".into(),
            machine: "m".into(),
            load: "l".into(),
            command: "x".into(),
        };
        let f = ReleaseFigures {
            version: Some(KubeVersion::V1_36_2),
            starts: vec![StartTimes::default()],
            pod_running: vec![Duration::from_secs(2); 3],
            ..Default::default()
        };
        let text = markdown(&info, &[f]);
        let table: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.starts_with("| | runs"))
            .take_while(|l| l.starts_with('|'))
            .collect();
        assert_eq!(table.len(), 12, "{text}");
        for line in table {
            assert_eq!(line.matches('|').count(), 8, "{line}");
        }
        assert!(text.starts_with(START) && text.ends_with(&format!("{END}\n")));
    }
}
