//! csi-attacher benchmark (issue 20):
//!
//! ```sh
//! cargo bench -p plugreg-csi-attacher --bench attacher -- --out BENCHMARKS.md
//! cargo bench -p plugreg-csi-attacher --bench attacher -- --quick   # 100 VolumeAttachments
//! cargo bench -p plugreg-csi-attacher --bench attacher -- --qps 200  # memory only, never written
//! ```
//!
//! A fresh real kube-apiserver v1.36.2, the test CSI driver in-process (answers at once,
//! PUBLISH_UNPUBLISH_VOLUME), and the release `csi-attacher` as a process with upstream's
//! defaults (`--kube-api-qps 5 --kube-api-burst 10`, 10 workers) and `--leader-election` (the
//! Lease has its own client and bucket, as upstream). The bench writes what kube-controller-
//! manager's attach/detach controller and the kubelet would: a CSINode, N CSI PVs, then N
//! VolumeAttachments at once (its own unlimited client, 32 at a time). The run ends when a watch
//! of its own has seen every VolumeAttachment `attached: true`; then all are deleted and the run
//! ends when every one is gone.
//!
//! Reported: the time to all attached (and detached), the attacher's API writes per attachment
//! (its own `plugreg_kube_requests_total`, every verb but get, list and watch) against
//! upstream's count (a JSON patch of the PV's finalizer, a merge patch of the VolumeAttachment's
//! finalizer and node-ID annotation, a status patch: 3 per attach; a finalizer patch and a
//! status patch: 2 per detach), the time against the write floor (upstream's writes / QPS), and
//! the peak RSS (VmHWM) with the highest anonymous and file-backed parts sampled, and the idle RSS. `PLUGREG_ATTACHER_BIN` measures another build with the same flags.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume};
use k8s_openapi::api::storage::v1::{CSINode, VolumeAttachment};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, watcher};
use plugreg_csi_test_driver::{DriverConfig, MountMode};
use plugreg_testpeers::bench::{
    BenchArgs, Memory, commit, create_all, date, delta, free_port, goals_table, load,
    print_file_mappings, requests, rss, sample_peaks, write_block, writes,
};
use plugreg_testpeers::{ApiServer, KubeVersion};
use serde_json::json;

const START: &str = "<!-- bench:csi-attacher:start -->";
const END: &str = "<!-- bench:csi-attacher:end -->";
const DRIVER: &str = "bench.csi.plugreg.test";
const NODE: &str = "bench-node";
const QPS: f64 = 5.0;
const BURST: f64 = 10.0;
/// Upstream's API writes per attach and per detach (the spec of external-attacher v4.12.0).
const UPSTREAM_ATTACH_WRITES: f64 = 3.0;
const UPSTREAM_DETACH_WRITES: f64 = 2.0;

fn bin() -> String {
    std::env::var("PLUGREG_ATTACHER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_csi-attacher").to_owned())
}

struct Run {
    n: usize,
    attached: Duration,
    attach_requests: BTreeMap<String, u64>,
    detached: Duration,
    detach_requests: BTreeMap<String, u64>,
    /// The sidecar's memory: at the end, the sampled peaks (every 100 ms), and idle once the
    /// caches are filled, before the first object.
    mem: Memory,
    /// `--kube-api-qps` given to the attacher (upstream's default unless `--qps`).
    qps: f64,
    load_start: String,
    exited: bool,
}

/// Counts the VolumeAttachments a watch has seen attached, and those deleted.
fn count_watch(
    client: kube::Client,
) -> (
    tokio::sync::watch::Receiver<usize>,
    tokio::sync::watch::Receiver<usize>,
) {
    let (att_tx, att_rx) = tokio::sync::watch::channel(0usize);
    let (gone_tx, gone_rx) = tokio::sync::watch::channel(0usize);
    tokio::spawn(async move {
        let api: Api<VolumeAttachment> = Api::all(client);
        let mut attached = std::collections::HashSet::new();
        let mut gone = std::collections::HashSet::new();
        let mut s = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
        while let Some(ev) = s.next().await {
            match ev {
                Ok(watcher::Event::Apply(v) | watcher::Event::InitApply(v))
                    if v.status.as_ref().is_some_and(|s| s.attached)
                        && attached.insert(v.metadata.name.clone().unwrap_or_default()) =>
                {
                    att_tx.send_replace(attached.len());
                }
                Ok(watcher::Event::Delete(v))
                    if gone.insert(v.metadata.name.clone().unwrap_or_default()) =>
                {
                    gone_tx.send_replace(gone.len());
                }
                _ => {}
            }
        }
    });
    (att_rx, gone_rx)
}

async fn run(n: usize, qps: f64) -> Run {
    let load_start = load();
    let api = ApiServer::start_version(KubeVersion::V1_36_2)
        .await
        .unwrap();
    let client = api.client().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let volumes: Vec<String> = (0..n).map(|i| format!("vol-{i}")).collect();
    let _driver = plugreg_csi_test_driver::start(
        DriverConfig {
            name: DRIVER.into(),
            node_id: "node-1".into(),
            controller: true,
            controller_publish: true,
            volumes,
            data_dir: Some(dir.path().join("volumes")),
            mount: MountMode::Directory,
            ..DriverConfig::default()
        },
        &socket,
    )
    .await
    .unwrap();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "bench"}})).unwrap(),
        )
        .await
        .unwrap();
    let csinodes: Api<CSINode> = Api::all(client.clone());
    csinodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NODE}, "spec": {"drivers": [{"name": DRIVER, "nodeID": "node-1"}]}}))
                .unwrap(),
        )
        .await
        .unwrap();
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    create_all(n, |i| {
        let pvs = pvs.clone();
        async move {
            pvs.create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": format!("pv-{i}")},
                    "spec": {
                        "capacity": {"storage": "1Gi"},
                        "accessModes": ["ReadWriteOnce"],
                        "persistentVolumeReclaimPolicy": "Retain",
                        "csi": {"driver": DRIVER, "volumeHandle": format!("vol-{i}")},
                    }
                }))
                .unwrap(),
            )
            .await
            .unwrap();
        }
    })
    .await;

    let port = free_port();
    let log = std::fs::File::create(dir.path().join("attacher.log")).unwrap();
    let mut child = Command::new(bin())
        .arg(format!("--csi-address={}", socket.display()))
        .arg(format!("--kubeconfig={}", api.kubeconfig_path().display()))
        .arg(format!("--http-endpoint=127.0.0.1:{port}"))
        .arg("--v=1")
        .arg(format!("--kube-api-qps={qps}"))
        .arg(format!("--kube-api-burst={}", (qps * BURST / QPS).round()))
        .arg("--leader-election")
        .arg("--leader-election-namespace=bench")
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let pid = child.id();
    let t = Instant::now();
    while requests(port).is_empty() && t.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Let the caches fill before the clock starts (its LISTs are not the work measured).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = requests(port);
    let idle_kib = rss(pid);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = sample_peaks(pid, std::sync::Arc::clone(&stop));

    let (mut attached_rx, mut gone_rx) = count_watch(client.clone());
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    let start = Instant::now();
    create_all(n, |i| {
        let vas = vas.clone();
        async move {
            vas.create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": format!("va-{i}")},
                    "spec": {
                        "attacher": DRIVER,
                        "nodeName": NODE,
                        "source": {"persistentVolumeName": format!("pv-{i}")},
                    }
                }))
                .unwrap(),
            )
            .await
            .unwrap();
        }
    })
    .await;
    let _ = attached_rx.wait_for(|c| *c >= n).await;
    let attached = start.elapsed();
    let after_attach = requests(port);

    let start = Instant::now();
    create_all(n, |i| {
        let vas = vas.clone();
        async move {
            vas.delete(&format!("va-{i}"), &DeleteParams::default())
                .await
                .unwrap();
        }
    })
    .await;
    let _ = gone_rx.wait_for(|c| *c >= n).await;
    let detached = start.elapsed();
    let after_detach = requests(port);
    print_file_mappings(pid);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mem = Memory::measure(pid, idle_kib, sampler.join().unwrap_or_default());
    let exited = child.try_wait().ok().flatten().is_some();
    let _ = child.kill();
    let _ = child.wait();
    if let Ok(keep) = std::env::var("PLUGREG_BENCH_LOGS") {
        let _ = std::fs::copy(
            dir.path().join("attacher.log"),
            Path::new(&keep).join(format!("attacher-{n}.log")),
        );
    }
    Run {
        n,
        attached,
        attach_requests: delta(&after_attach, &before),
        detached,
        detach_requests: delta(&after_detach, &after_attach),
        mem,
        qps,
        load_start,
        exited,
    }
}

fn block(r: &Run, commit: &str) -> String {
    let n = r.n as f64;
    let attach_writes = writes(&r.attach_requests) as f64;
    let detach_writes = writes(&r.detach_requests) as f64;
    // The floor: upstream's writes through the token bucket (the burst comes free).
    let attach_floor = (UPSTREAM_ATTACH_WRITES * n - BURST).max(0.0) / QPS;
    let detach_floor = (UPSTREAM_DETACH_WRITES * n - BURST).max(0.0) / QPS;
    let mib = r.mem.hwm_mib();
    let fmt = |m: &BTreeMap<String, u64>| {
        m.iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut t = format!(
        "{START}\n## csi-attacher: VolumeAttachments attached and detached (issue 20)\n\n{}, commit {}, load average {} at the \
         start and {} at the end (2 cores, shared). Real kube-apiserver v1.36.2 (fresh), the test CSI driver in-process \
         (answers at once), the release `csi-attacher` with upstream's defaults (`--kube-api-qps 5 --kube-api-burst 10`, \
         10 workers per queue) and `--leader-election`. {} CSI PVs and a CSINode exist; {} VolumeAttachments are then \
         created at once (as the attach/detach controller would), and deleted at once once all are attached. The write \
         floor is upstream's writes through the token bucket: (writes x N - burst) / QPS, with upstream's 3 writes per \
         attach (PV finalizer, VolumeAttachment finalizer and annotation, status) and 2 per detach (finalizer, status).\n\n\
         ```sh\ncargo bench -p plugreg-csi-attacher --bench attacher -- --out BENCHMARKS.md\n```\n\n\
         | phase | time | write floor | time / floor | API writes per VolumeAttachment (upstream) | requests |\n\
         |---|---|---|---|---|---|\n",
        date(),
        commit,
        r.load_start,
        load(),
        r.n,
        r.n,
    );
    t.push_str(&format!(
        "| attach {} | {:.1} s | {:.1} s | {:.3} | {:.2} ({UPSTREAM_ATTACH_WRITES}) | {} |\n",
        r.n,
        r.attached.as_secs_f64(),
        attach_floor,
        r.attached.as_secs_f64() / attach_floor,
        attach_writes / n,
        fmt(&r.attach_requests)
    ));
    t.push_str(&format!(
        "| detach {} | {:.1} s | {:.1} s | {:.3} | {:.2} ({UPSTREAM_DETACH_WRITES}) | {} |\n\n",
        r.n,
        r.detached.as_secs_f64(),
        detach_floor,
        r.detached.as_secs_f64() / detach_floor,
        detach_writes / n,
        fmt(&r.detach_requests)
    ));
    t.push_str(&r.mem.paragraph("the first VolumeAttachment"));
    t.push_str(&goals_table(&[
        (
            format!(
                "attach: at most upstream's {UPSTREAM_ATTACH_WRITES} writes per VolumeAttachment"
            ),
            format!("{:.2}", attach_writes / n),
            attach_writes / n <= UPSTREAM_ATTACH_WRITES,
        ),
        (
            "attach: within 1.1x the write floor".to_owned(),
            format!("{:.3}x", r.attached.as_secs_f64() / attach_floor),
            r.attached.as_secs_f64() <= 1.1 * attach_floor,
        ),
        (
            format!(
                "detach: at most upstream's {UPSTREAM_DETACH_WRITES} writes per VolumeAttachment"
            ),
            format!("{:.2}", detach_writes / n),
            detach_writes / n <= UPSTREAM_DETACH_WRITES,
        ),
        (
            format!("peak RSS under 16 MiB at {} VolumeAttachments", r.n),
            format!("{mib:.1} MiB"),
            mib < 16.0,
        ),
        (
            "the attacher kept running (Lease kept)".to_owned(),
            if r.exited { "exited" } else { "running" }.to_owned(),
            !r.exited,
        ),
    ]));
    t.push_str(
        "\nNo Go external-attacher runs on this machine (neither its source nor a binary is reachable), so upstream's \
         figures are its write count from the spec, not a side-by-side run.\n",
    );
    t.push_str(&format!("{END}\n"));
    t
}

#[tokio::main]
async fn main() {
    // `--qps`: memory studies only; the write figures assume upstream's QPS.
    let args = BenchArgs::parse(1000);
    let commit = commit();
    let r = run(args.n, args.qps.unwrap_or(QPS)).await;
    let t = block(&r, &commit);
    println!("{t}");
    if r.qps != QPS {
        println!(
            "(--qps {}: not written; the write floor assumes upstream's QPS {QPS})",
            r.qps
        );
        return;
    }
    if let Some(out) = args.out {
        write_block(&out, START, END, &t);
    }
}
