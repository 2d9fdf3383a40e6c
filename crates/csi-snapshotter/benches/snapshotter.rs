//! csi-snapshotter benchmark (issue 21):
//!
//! ```sh
//! cargo bench -p plugreg-csi-snapshotter --bench snapshotter -- --out BENCHMARKS.md
//! cargo bench -p plugreg-csi-snapshotter --bench snapshotter -- --quick   # 100 VolumeSnapshots
//! ```
//!
//! A fresh real kube-apiserver v1.36.2 with the snapshot CRDs, the real Go snapshot-controller
//! v8.6.0 (given `--kube-api-qps 1000 --kube-api-burst 2000 --worker-threads 50` so that it is
//! not what is measured), the test CSI driver in-process (snapshots ready at the first
//! CreateSnapshot), and the release `csi-snapshotter` as a process with upstream's defaults
//! (`--kube-api-qps 5 --kube-api-burst 10`, 10 workers) and `--leader-election` (the Lease has
//! its own client and bucket, as upstream). One CSI PV and its bound claim exist; N
//! VolumeSnapshots of that claim are created at once (the bench's own unlimited client, 32 at a
//! time). The run ends when a watch of its own has seen every VolumeSnapshot `readyToUse: true`.
//!
//! Reported: the time to all ready, the snapshotter's API writes per snapshot (its own
//! `plugreg_kube_requests_total`, every verb but get, list and watch) against upstream's count
//! (the being-created annotation, the status, the annotation's removal: 3 per snapshot ready at
//! the first call), the time against the write floor (upstream's writes / QPS), and the peak
//! RSS (VmHWM) with the highest anonymous and file-backed parts sampled, and the idle RSS.
//! `PLUGREG_SNAPSHOTTER_BIN` measures another build with the same flags.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, watcher};
use plugreg_csi_test_driver::{DriverConfig, MountMode};
use plugreg_sidecar_kit::snapshot::{VolumeSnapshot, VolumeSnapshotClass};
use plugreg_testpeers::bench::{
    BenchArgs, Memory, commit, create_all, date, delta, free_port, goals_table, load,
    print_file_mappings, requests, rss, sample_peaks, write_block, writes,
};
use plugreg_testpeers::sidecar;
use plugreg_testpeers::{ApiServer, KubeVersion, SnapshotController};
use serde_json::json;

const START: &str = "<!-- bench:csi-snapshotter:start -->";
const END: &str = "<!-- bench:csi-snapshotter:end -->";
const DRIVER: &str = "bench.csi.plugreg.test";
const NS: &str = "bench";
const QPS: f64 = 5.0;
const BURST: f64 = 10.0;
/// Upstream's API writes per snapshot ready at the first CreateSnapshot (the spec of
/// external-snapshotter v8.6.0: annotation, status, annotation removal).
const UPSTREAM_WRITES: f64 = 3.0;

fn bin() -> String {
    std::env::var("PLUGREG_SNAPSHOTTER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_csi-snapshotter").to_owned())
}

struct Run {
    n: usize,
    ready: Duration,
    /// When the snapshotter's last write of the run was seen.
    settled: Duration,
    requests: BTreeMap<String, u64>,
    /// The sidecar's memory: at the end, the sampled peaks (every 100 ms), and idle once the
    /// caches are filled, before the first object.
    mem: Memory,
    load_start: String,
    exited: bool,
}

/// Counts the VolumeSnapshots a watch has seen ready.
fn count_ready(client: kube::Client) -> tokio::sync::watch::Receiver<usize> {
    let (tx, rx) = tokio::sync::watch::channel(0usize);
    tokio::spawn(async move {
        let api: Api<VolumeSnapshot> = Api::namespaced(client, NS);
        let mut ready = std::collections::HashSet::new();
        let mut s = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
        while let Some(ev) = s.next().await {
            if let Ok(watcher::Event::Apply(v) | watcher::Event::InitApply(v)) = ev
                && v.status.as_ref().and_then(|s| s.ready_to_use) == Some(true)
                && ready.insert(v.metadata.name.clone().unwrap_or_default())
            {
                tx.send_replace(ready.len());
            }
        }
    });
    rx
}

/// Creates a snapshot API object (the kit's types do not write `apiVersion` and `kind`).
async fn create<K: kube::Resource<DynamicType = ()>>(
    client: &kube::Client,
    mut object: serde_json::Value,
) {
    let ar = ApiResource::erase::<K>(&());
    object["apiVersion"] = json!(ar.api_version);
    object["kind"] = json!(ar.kind);
    let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    api.create(
        &PostParams::default(),
        &serde_json::from_value(object).unwrap(),
    )
    .await
    .unwrap();
}

async fn run(n: usize) -> Run {
    let load_start = load();
    let api = ApiServer::start_version(KubeVersion::V1_36_2)
        .await
        .unwrap();
    let _controller = SnapshotController::start_with(
        &api,
        &[
            "--kube-api-qps=1000",
            "--kube-api-burst=2000",
            "--worker-threads=50",
        ],
    )
    .await
    .unwrap();
    let client = api.client().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    std::fs::create_dir_all(dir.path().join("volumes").join("vol-0")).unwrap();
    let _driver = plugreg_csi_test_driver::start(
        DriverConfig {
            name: DRIVER.into(),
            controller: true,
            snapshots: true,
            volumes: vec!["vol-0".into()],
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
            &serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap(),
        )
        .await
        .unwrap();
    sidecar::bound_claim(&client, NS, "data", "pv-0", DRIVER, "vol-0", true).await;
    create::<VolumeSnapshotClass>(
        &client,
        json!({"metadata": {"name": "cls"}, "driver": DRIVER, "deletionPolicy": "Delete"}),
    )
    .await;

    let port = free_port();
    let log = std::fs::File::create(dir.path().join("snapshotter.log")).unwrap();
    let mut child = Command::new(bin())
        .arg(format!("--csi-address={}", socket.display()))
        .arg(format!("--kubeconfig={}", api.kubeconfig_path().display()))
        .arg(format!("--http-endpoint=127.0.0.1:{port}"))
        .arg("--v=1")
        .arg("--leader-election")
        .arg(format!("--leader-election-namespace={NS}"))
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

    let mut ready_rx = count_ready(client.clone());
    let start = Instant::now();
    create_all(n, |i| {
        let client = client.clone();
        async move {
            create::<VolumeSnapshot>(
                &client,
                json!({
                    "metadata": {"name": format!("snap-{i}"), "namespace": NS},
                    "spec": {"source": {"persistentVolumeClaimName": "data"},
                             "volumeSnapshotClassName": "cls"},
                }),
            )
            .await;
        }
    })
    .await;
    let _ = ready_rx.wait_for(|c| *c >= n).await;
    let ready = start.elapsed();
    // The last snapshots' annotation removals may still wait in the token bucket: the run
    // settles when the writes stop (3 s without one, or upstream's count reached).
    let mut after = requests(port);
    let mut settled = start.elapsed();
    let mut quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(3)
        && (writes(&delta(&after, &before)) as f64) < UPSTREAM_WRITES * n as f64
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = requests(port);
        if writes(&now) != writes(&after) {
            settled = start.elapsed();
            quiet = Instant::now();
        }
        after = now;
    }
    print_file_mappings(pid);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mem = Memory::measure(pid, idle_kib, sampler.join().unwrap_or_default());
    let exited = child.try_wait().ok().flatten().is_some();
    let _ = child.kill();
    let _ = child.wait();
    if let Ok(keep) = std::env::var("PLUGREG_BENCH_LOGS") {
        let _ = std::fs::copy(
            dir.path().join("snapshotter.log"),
            Path::new(&keep).join(format!("snapshotter-{n}.log")),
        );
    }
    Run {
        n,
        ready,
        settled,
        requests: delta(&after, &before),
        mem,
        load_start,
        exited,
    }
}

fn block(r: &Run, commit: &str) -> String {
    let n = r.n as f64;
    let writes = writes(&r.requests) as f64;
    // The floor: upstream's writes through the token bucket (the burst comes free).
    let floor = (UPSTREAM_WRITES * n - BURST).max(0.0) / QPS;
    let mib = r.mem.hwm_mib();
    let fmt = |m: &BTreeMap<String, u64>| {
        m.iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut t = format!(
        "{START}\n## csi-snapshotter: VolumeSnapshots made ready (issue 21)\n\n{}, commit {}, load average {} at the \
         start and {} at the end (2 cores, shared). Real kube-apiserver v1.36.2 (fresh) with the snapshot CRDs, the real \
         Go snapshot-controller v8.6.0 (`--kube-api-qps 1000 --kube-api-burst 2000 --worker-threads 50`, so that it is \
         not what is measured), the test CSI driver in-process (snapshots ready at the first CreateSnapshot), the release \
         `csi-snapshotter` with upstream's defaults (`--kube-api-qps 5 --kube-api-burst 10`, 10 workers) and \
         `--leader-election`. One CSI PV and its bound claim exist; {} VolumeSnapshots of it are then created at once. \
         The clock stops when every VolumeSnapshot shows `readyToUse: true` (ready); the run settles when the \
         snapshotter's last write (an annotation's removal, after the status) is done. The write floor is upstream's writes \
         through the token bucket: (writes x N - burst) / QPS, with upstream's 3 writes per snapshot (the being-created \
         annotation, the status, the annotation's removal).\n\n\
         ```sh\ncargo bench -p plugreg-csi-snapshotter --bench snapshotter -- --out BENCHMARKS.md\n```\n\n\
         | phase | time | write floor | time / floor | API writes per snapshot (upstream) | requests |\n\
         |---|---|---|---|---|---|\n",
        date(),
        commit,
        r.load_start,
        load(),
        r.n,
    );
    t.push_str(&format!(
        "| {} ready | {:.1} s | {:.1} s | {:.3} | | |\n",
        r.n,
        r.ready.as_secs_f64(),
        floor,
        r.ready.as_secs_f64() / floor,
    ));
    t.push_str(&format!(
        "| {} settled | {:.1} s | {:.1} s | {:.3} | {:.2} ({UPSTREAM_WRITES}) | {} |\n\n",
        r.n,
        r.settled.as_secs_f64(),
        floor,
        r.settled.as_secs_f64() / floor,
        writes / n,
        fmt(&r.requests)
    ));
    t.push_str(&r.mem.paragraph("the first VolumeSnapshot"));
    t.push_str(&goals_table(&[
        (
            format!("at most upstream's {UPSTREAM_WRITES} writes per snapshot"),
            format!("{:.2}", writes / n),
            writes / n <= UPSTREAM_WRITES,
        ),
        (
            "all ready within 1.1x the write floor".to_owned(),
            format!("{:.3}x", r.ready.as_secs_f64() / floor),
            r.ready.as_secs_f64() <= 1.1 * floor,
        ),
        (
            format!("peak RSS under 16 MiB at {} VolumeSnapshots", r.n),
            format!("{mib:.1} MiB"),
            mib < 16.0,
        ),
        (
            "the snapshotter kept running (Lease kept)".to_owned(),
            if r.exited { "exited" } else { "running" }.to_owned(),
            !r.exited,
        ),
    ]));
    t.push_str(
        "\nNo Go csi-snapshotter runs on this machine (only the snapshot-controller is among the prebuilt peers), so \
         upstream's figures are its write count from the spec, not a side-by-side run.\n",
    );
    t.push_str(&format!("{END}\n"));
    t
}

#[tokio::main]
async fn main() {
    let args = BenchArgs::parse(1000);
    let commit = commit();
    let r = run(args.n).await;
    let t = block(&r, &commit);
    println!("{t}");
    if let Some(out) = args.out {
        write_block(&out, START, END, &t);
    }
}
