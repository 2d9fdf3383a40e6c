//! csi-provisioner benchmark (issue 12):
//!
//! ```sh
//! cargo bench -p plugreg-csi-provisioner --bench provisioner -- --out BENCHMARKS.md
//! cargo bench -p plugreg-csi-provisioner --bench provisioner -- --quick   # 100 claims, no 10k run
//! cargo bench -p plugreg-csi-provisioner --bench provisioner -- --raised-only
//!     # 100 claims at the raised limit only, never written (runs in turn against another build)
//! cargo bench -p plugreg-csi-provisioner --bench provisioner -- --big-only [--out BENCHMARKS.md]
//!     # only the 10k run (its own block of BENCHMARKS.md)
//! cargo bench -p plugreg-csi-provisioner --bench provisioner -- --big-only --with-sidecars [--out BENCHMARKS.md]
//!     # the 10k run with csi-provisioner, then with `csi-sidecars --controllers=provisioner` (issue 29)
//! ```
//!
//! Each run starts a fresh real kube-apiserver v1.36.2 and kube-controller-manager v1.36.2 (its
//! PV controller binds; its own client limit raised so that binding is not what is measured),
//! the test CSI driver in-process (answers at once), and the release `csi-provisioner` as a
//! process. Then N claims are created at once (by the bench's own, unlimited client) and the run
//! ends when the API server says all are Bound; optionally all are deleted and the run ends when
//! every PV is gone. Reported: makespan, volumes per second, the provisioner's API requests per
//! volume (its own `plugreg_kube_requests_total` counter, by verb and resource), and its peak RSS
//! (VmHWM). `PLUGREG_PROVISIONER_BIN` measures another build with the same flags;
//! `--with-sidecars` repeats the 10,000-claim run with the release `csi-sidecars` (built from
//! this checkout first, or `PLUGREG_SIDECARS_BIN`) running only its provisioner, the same flags
//! given their `--provisioner-` prefix where csi-sidecars wants one;
//! `PLUGREG_BENCH_LOGS=<dir>` keeps the provisioner's and KCM's log of each run there.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, ListParams, PartialObjectMeta, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, watcher};
use plugreg_csi_test_driver::{DriverConfig, MountMode};
use plugreg_testpeers::bench::{commit, date, free_port, load, requests};
use plugreg_testpeers::{ApiServer, ControllerManager, KubeVersion};
use serde_json::json;

const START: &str = "<!-- bench:csi-provisioner:start -->";
const END: &str = "<!-- bench:csi-provisioner:end -->";
const BIG_START: &str = "<!-- bench:csi-provisioner-big:start -->";
const BIG_END: &str = "<!-- bench:csi-provisioner-big:end -->";
const DRIVER: &str = "bench.csi.plugreg.test";
/// Upstream's published figure at `--kube-api-qps 5` (external-provisioner PR #447).
const UPSTREAM_VOLUMES_PER_S: f64 = 2.4;

struct Args {
    out: Option<String>,
    claims: usize,
    big: Option<usize>,
    raised_qps: String,
    /// Whether the big run is repeated with `csi-sidecars --controllers=provisioner`.
    with_sidecars: bool,
    /// Only the small run at the raised limit (`--raised-only`: for runs in turn against
    /// another build; never written).
    raised_only: bool,
}

fn args() -> Args {
    let mut a = Args {
        out: None,
        claims: 1000,
        big: Some(10_000),
        raised_qps: "1000".into(),
        with_sidecars: false,
        raised_only: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--out" => a.out = it.next(),
            "--claims" => a.claims = it.next().and_then(|v| v.parse().ok()).unwrap_or(a.claims),
            "--big" => a.big = it.next().and_then(|v| v.parse().ok()),
            "--no-big" => a.big = None,
            "--raised-qps" => a.raised_qps = it.next().unwrap_or(a.raised_qps),
            "--big-only" => a.claims = 0,
            "--with-sidecars" => a.with_sidecars = true,
            "--quick" => {
                a.claims = 100;
                a.big = None;
            }
            "--raised-only" => {
                a.claims = 100;
                a.big = None;
                a.raised_only = true;
            }
            _ => {} // cargo bench passes --bench
        }
    }
    if a.raised_only {
        a.out = None;
    }
    a
}

/// Which binary runs the provisioner.
#[derive(Clone, Copy, PartialEq)]
enum Binary {
    /// `csi-provisioner` (`PLUGREG_PROVISIONER_BIN`, or this package's release build).
    Provisioner,
    /// `csi-sidecars --controllers=provisioner` (`PLUGREG_SIDECARS_BIN`, or the release build
    /// next to this bench's).
    Sidecars,
}

impl Binary {
    fn path(self) -> String {
        match self {
            Binary::Provisioner => std::env::var("PLUGREG_PROVISIONER_BIN")
                .unwrap_or_else(|_| env!("CARGO_BIN_EXE_csi-provisioner").to_owned()),
            Binary::Sidecars => std::env::var("PLUGREG_SIDECARS_BIN").unwrap_or_else(|_| {
                // target/release/deps/<bench> -> target/release/csi-sidecars
                let exe = std::env::current_exe().unwrap();
                let release = exe.parent().and_then(Path::parent).unwrap();
                release.join("csi-sidecars").display().to_string()
            }),
        }
    }

    /// The process's arguments for the provisioner's `flags` (`--kube-api-qps=...`).
    fn args(self, flags: &[&str]) -> Vec<String> {
        match self {
            Binary::Provisioner => flags.iter().map(|f| (*f).to_owned()).collect(),
            Binary::Sidecars => std::iter::once("--controllers=provisioner".to_owned())
                .chain(flags.iter().map(|f| f.replacen("--", "--provisioner-", 1)))
                .collect(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Binary::Provisioner => "csi-provisioner",
            Binary::Sidecars => "csi-sidecars --controllers=provisioner",
        }
    }
}

/// Builds `csi-sidecars` (release) from this checkout unless `PLUGREG_SIDECARS_BIN` names one.
fn ensure_sidecars() {
    if std::env::var_os("PLUGREG_SIDECARS_BIN").is_some() {
        return;
    }
    let status = Command::new(env!("CARGO"))
        .args(["build", "--release", "-p", "plugreg-csi-sidecars"])
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
        .status()
        .expect("cargo runs");
    assert!(status.success(), "csi-sidecars builds");
}

/// A kB field of `/proc/<pid>/status` (0 once the process is gone).
fn status_kib(pid: u32, field: &str) -> u64 {
    plugreg_runtime::procfs::status_kib(&pid.to_string(), field).unwrap_or(0)
}

/// The pids of processes whose command line names `dir` (a peer's temp dir), with their names.
fn pids_under(dir: &Path) -> Vec<(u32, String)> {
    let needle = dir.to_string_lossy().into_owned();
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmd).contains(&needle) {
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            out.push((pid, name.trim().to_owned()));
        }
    }
    out
}

/// CPU seconds (user and system) `pid` has used so far; 0 once it is gone.
fn cpu_seconds(pid: u32) -> f64 {
    plugreg_runtime::procfs::cpu_time(&pid.to_string()).map_or(0.0, |d| d.as_secs_f64())
}

fn cpu_of(pids: &[u32]) -> f64 {
    pids.iter().map(|p| cpu_seconds(*p)).sum()
}

/// When the count on `rx` reached a tenth, half, nine tenths and all of `n`, from `start`.
async fn marks(
    rx: &mut tokio::sync::watch::Receiver<usize>,
    n: usize,
    start: Instant,
) -> [Duration; 4] {
    let mut out = [Duration::ZERO; 4];
    for (i, tenths) in [1, 5, 9, 10].into_iter().enumerate() {
        let _ = rx.wait_for(|c| *c * 10 >= n * tenths).await;
        out[i] = start.elapsed();
    }
    out
}

fn secs(d: &[Duration]) -> String {
    d.iter()
        .map(|d| format!("{:.1}", d.as_secs_f64()))
        .collect::<Vec<_>>()
        .join("/")
}

struct Run {
    label: String,
    /// Which binary ran the provisioner.
    binary: Binary,
    claims: usize,
    makespan: Duration,
    /// Until every PV existed (the provisioner's part; binding is KCM's).
    pvs_done: Duration,
    requests: BTreeMap<String, u64>,
    /// Rate-limited writes (every verb but GET, LIST and WATCH) when the last claim was Bound.
    writes_at_bound: u64,
    hwm_kib: u64,
    /// Whether the provisioner lost its Lease (or exited) during the run.
    lease_lost: bool,
    delete_makespan: Option<Duration>,
    delete_requests: BTreeMap<String, u64>,
    /// `/proc/loadavg` when the run started (the machine is shared: other work distorts times).
    load_start: String,
    /// Until the bench had created every claim (its own client, 32 at a time).
    claims_created: Duration,
    /// Until kube-controller-manager had handed a tenth, half, nine tenths and all of the claims
    /// to the provisioner (its storage-provisioner annotation).
    handed_marks: [Duration; 4],
    /// Until a tenth, half, nine tenths and all of the PVs existed.
    pv_marks: [Duration; 4],
    /// CPU seconds from the first claim to the last PV: (provisioner, API server and etcd, KCM).
    cpu_to_pvs: (f64, f64, f64),
    /// When the provisioner's resident memory was highest (sampled), from the first claim.
    peak_at: Duration,
    /// How much of it was file-backed (the binary's pages) then.
    peak_file_kib: u64,
}

async fn run(label: &str, binary: Binary, claims: usize, qps: &[&str], delete: bool) -> Run {
    let load_start = load();
    let api = ApiServer::start_version(KubeVersion::V1_36_2)
        .await
        .unwrap();
    let kcm = ControllerManager::start_volume_controllers(
        &api,
        &["--kube-api-qps=1000", "--kube-api-burst=1000"],
    )
    .await
    .unwrap();
    let client = api.client().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let driver = plugreg_csi_test_driver::start(
        DriverConfig {
            name: DRIVER.into(),
            controller: true,
            data_dir: Some(dir.path().join("volumes")),
            mount: MountMode::Directory,
            ..DriverConfig::default()
        },
        &socket,
    )
    .await
    .unwrap();
    let classes: Api<StorageClass> = Api::all(client.clone());
    classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "bench"}, "provisioner": DRIVER, "reclaimPolicy": "Delete"}))
                .unwrap(),
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
    let port = free_port();
    let log = std::fs::File::create(dir.path().join("provisioner.log")).unwrap();
    let mut child: Child = Command::new(binary.path())
        .arg(format!("--csi-address={}", socket.display()))
        .arg(format!("--kubeconfig={}", api.kubeconfig_path().display()))
        .arg(format!("--http-endpoint=127.0.0.1:{port}"))
        .arg("--v=1")
        .arg("--leader-election")
        .arg("--leader-election-namespace=bench")
        .args(binary.args(qps))
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let pid = child.id();
    // Wait until it serves metrics (caches synced or not: the clock starts at the first claim).
    let t = Instant::now();
    while requests(port).is_empty() && t.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = requests(port);

    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "bench");
    let peers: Vec<(u32, String)> = pids_under(api.dir())
        .into_iter()
        .chain(pids_under(kcm.dir()))
        .collect();
    let of = |names: &[&str]| -> Vec<u32> {
        peers
            .iter()
            .filter(|(_, n)| names.iter().any(|x| n.starts_with(x)))
            .map(|(p, _)| *p)
            .collect()
    };
    let (api_pids, kcm_pids) = (of(&["kube-apiserver", "etcd"]), of(&["kube-controller"]));
    let cpu_before = (cpu_seconds(pid), cpu_of(&api_pids), cpu_of(&kcm_pids));
    // Watches (not repeated lists, which would load the API server) count the PVs and the
    // Bound claims as they come.
    let (pv_tx, mut pv_rx) = tokio::sync::watch::channel(0usize);
    let pv_watch = tokio::spawn({
        let pvs: Api<PartialObjectMeta<PersistentVolume>> = Api::all(client.clone());
        async move {
            let mut seen = std::collections::HashSet::new();
            let mut s = std::pin::pin!(watcher(pvs, watcher::Config::default()).default_backoff());
            while let Some(ev) = s.next().await {
                if let Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) = ev {
                    seen.insert(o.metadata.name.unwrap_or_default());
                    pv_tx.send_replace(seen.len());
                }
            }
        }
    });
    // Bound claims, and claims kube-controller-manager has handed to the provisioner (its
    // storage-provisioner annotation, which the provisioner waits for, as upstream).
    let (bound_tx, mut bound_rx) = tokio::sync::watch::channel(0usize);
    let (handed_tx, mut handed_rx) = tokio::sync::watch::channel(0usize);
    let bound_watch = tokio::spawn({
        let pvcs = pvcs.clone();
        async move {
            let mut bound = std::collections::HashSet::new();
            let mut handed = std::collections::HashSet::new();
            let mut s = std::pin::pin!(watcher(pvcs, watcher::Config::default()).default_backoff());
            while let Some(ev) = s.next().await {
                let Ok(watcher::Event::Apply(c) | watcher::Event::InitApply(c)) = ev else {
                    continue;
                };
                let name = c.metadata.name.clone().unwrap_or_default();
                if c.metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key("volume.kubernetes.io/storage-provisioner"))
                    && handed.insert(name.clone())
                {
                    handed_tx.send_replace(handed.len());
                }
                if c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
                    && bound.insert(name)
                {
                    bound_tx.send_replace(bound.len());
                }
            }
        }
    });
    // The provisioner's resident memory, sampled, to tell when its peak came.
    let peak = std::sync::Arc::new(std::sync::Mutex::new((0u64, Duration::ZERO, 0u64)));
    let start = Instant::now();
    // The marks are taken while the claims are still being created.
    let handed = tokio::spawn(async move { marks(&mut handed_rx, claims, start).await });
    let pv_marks = tokio::spawn(async move { marks(&mut pv_rx, claims, start).await });
    let sampler = tokio::spawn({
        let peak = std::sync::Arc::clone(&peak);
        async move {
            loop {
                let rss = status_kib(pid, "VmRSS:");
                {
                    let mut p = peak.lock().unwrap();
                    if rss > p.0 {
                        *p = (rss, start.elapsed(), status_kib(pid, "RssFile:"));
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    futures::stream::iter(0..claims)
        .map(|i| {
            let pvcs = pvcs.clone();
            async move {
                let pvc = serde_json::from_value(json!({
                    "metadata": {"name": format!("c{i}")},
                    "spec": {"storageClassName": "bench", "accessModes": ["ReadWriteOnce"],
                             "resources": {"requests": {"storage": "1Mi"}}}
                }))
                .unwrap();
                pvcs.create(&PostParams::default(), &pvc).await.unwrap();
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
    let claims_created = start.elapsed();
    let pv_marks = pv_marks.await.unwrap_or([claims_created; 4]);
    let pvs_done = pv_marks[3];
    let cpu_to_pvs = (
        cpu_seconds(pid) - cpu_before.0,
        cpu_of(&api_pids) - cpu_before.1,
        cpu_of(&kcm_pids) - cpu_before.2,
    );
    let _ = bound_rx.wait_for(|n| *n >= claims).await;
    let makespan = start.elapsed();
    let handed_marks = handed.await.unwrap_or([makespan; 4]);
    pv_watch.abort();
    bound_watch.abort();
    let writes_at_bound: u64 = requests(port)
        .iter()
        .filter(|(k, _)| {
            !(k.starts_with("GET ") || k.starts_with("LIST ") || k.starts_with("WATCH "))
        })
        .map(|(k, v)| v - before.get(k).copied().unwrap_or(0))
        .sum();
    // Events and bookkeeping trail the binding (low priority): let them finish before counting.
    let mut last = requests(port);
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = requests(port);
        if now == last {
            break;
        }
        last = now;
    }
    let mut counted = last.clone();
    for (k, v) in &before {
        if let Some(c) = counted.get_mut(k) {
            *c = c.saturating_sub(*v);
        }
    }
    counted.retain(|_, v| *v > 0);

    let mut delete_makespan = None;
    let mut delete_requests = BTreeMap::new();
    if delete {
        let before = requests(port);
        let pvs: Api<PersistentVolume> = Api::all(client.clone());
        let start = Instant::now();
        pvcs.delete_collection(&DeleteParams::default(), &ListParams::default())
            .await
            .unwrap();
        loop {
            let left = pvs
                .list(&ListParams::default())
                .await
                .map(|l| l.items.len())
                .unwrap_or(1);
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        delete_makespan = Some(start.elapsed());
        let mut last = requests(port);
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let now = requests(port);
            if now == last {
                break;
            }
            last = now;
        }
        for (k, v) in last {
            let n = v.saturating_sub(before.get(&k).copied().unwrap_or(0));
            if n > 0 {
                delete_requests.insert(k, n);
            }
        }
    }
    let hwm_kib = status_kib(pid, "VmHWM:");
    sampler.abort();
    let (peak_sampled_kib, peak_at, peak_file_kib) = *peak.lock().unwrap();
    eprintln!(
        "{label}: peak RSS {:.1} MiB (VmHWM); sampled peak {:.1} MiB at {:.1} s, of it {:.1} MiB \
         file-backed (binary and libraries) and {:.1} MiB anonymous",
        hwm_kib as f64 / 1024.0,
        peak_sampled_kib as f64 / 1024.0,
        peak_at.as_secs_f64(),
        peak_file_kib as f64 / 1024.0,
        peak_sampled_kib.saturating_sub(peak_file_kib) as f64 / 1024.0,
    );
    let exited = !matches!(child.try_wait(), Ok(None));
    let log = std::fs::read_to_string(dir.path().join("provisioner.log")).unwrap_or_default();
    if let Ok(keep) = std::env::var("PLUGREG_BENCH_LOGS") {
        let _ = std::fs::create_dir_all(&keep);
        let name = label.replace(|c: char| !c.is_ascii_alphanumeric(), "_");
        let _ = std::fs::write(
            Path::new(&keep).join(format!("{name}.provisioner.log")),
            &log,
        );
        let _ = std::fs::copy(
            kcm.dir().join("kube-controller-manager.log"),
            Path::new(&keep).join(format!("{name}.kcm.log")),
        );
    }
    let lease_lost = exited
        || log.contains("Stopped leading")
        || log.matches("successfully acquired lease").count() != 1;
    let _ = child.kill();
    let _ = child.wait();
    drop(driver);
    drop(kcm);
    eprintln!("{label}: {claims} claims Bound in {makespan:?}");
    Run {
        label: label.into(),
        binary,
        claims,
        makespan,
        pvs_done,
        requests: counted,
        writes_at_bound,
        hwm_kib,
        lease_lost,
        delete_makespan,
        delete_requests,
        load_start,
        claims_created,
        handed_marks,
        pv_marks,
        cpu_to_pvs,
        peak_at,
        peak_file_kib,
    }
}

#[tokio::main]
async fn main() {
    let a = args();
    let raised = format!("--kube-api-qps={}", a.raised_qps);
    let raised_burst = format!("--kube-api-burst={}", a.raised_qps);
    let mut small = Vec::new();
    if a.claims > 0 {
        let p = Binary::Provisioner;
        if !a.raised_only {
            small.push(run("`--kube-api-qps 5` (default)", p, a.claims, &[], true).await);
        }
        small.push(
            run(
                &format!("`--kube-api-qps {}`", a.raised_qps),
                p,
                a.claims,
                &[&raised, &raised_burst],
                true,
            )
            .await,
        );
    }
    let mut big_runs = Vec::new();
    if let Some(big) = a.big {
        let mut binaries = vec![Binary::Provisioner];
        if a.with_sidecars {
            ensure_sidecars();
            binaries.push(Binary::Sidecars);
        }
        for binary in binaries {
            big_runs.push(
                run(
                    &format!("`--kube-api-qps {}`, {big} claims", a.raised_qps),
                    binary,
                    big,
                    &[&raised, &raised_burst],
                    false,
                )
                .await,
            );
        }
    }

    let mut blocks = Vec::new();
    if !big_runs.is_empty() {
        blocks.push((BIG_START, BIG_END, big_block(&big_runs)));
    }
    if a.raised_only {
        for r in &small {
            println!(
                "raised-only: all PVs created {:.2} s, all Bound {:.2} s, peak RSS {:.1} MiB, Lease lost {}",
                r.pvs_done.as_secs_f64(),
                r.makespan.as_secs_f64(),
                r.hwm_kib as f64 / 1024.0,
                r.lease_lost
            );
        }
    } else if !small.is_empty() {
        blocks.push((START, END, small_block(&small)));
    }
    for (_, _, t) in &blocks {
        println!("{t}");
    }
    if let Some(out) = a.out {
        // cargo runs benches in the package's directory: a relative path is the workspace's.
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let p = &root.join(&out);
        let mut text = std::fs::read_to_string(p).unwrap_or_default();
        for (start, end, t) in blocks {
            text = match (text.find(start), text.find(end)) {
                (Some(s), Some(e)) if s < e => {
                    format!("{}{t}{}", &text[..s], &text[e + end.len()..])
                }
                _ => format!("{text}\n{t}\n"),
            };
        }
        std::fs::write(p, text).unwrap();
    }
}

/// The 10,000-claim runs' block (csi-provisioner, and `csi-sidecars` when it ran too): when
/// the work got where, and who used the CPU.
fn big_block(runs: &[Run]) -> String {
    let r = &runs[0];
    let mut t = format!(
        "{BIG_START}\n### csi-provisioner at raised limits, {} claims (issues 16, 29)\n\n{}, commit {}, load average {} at \
         the start and {} at the end (2 cores, shared). As above, with `--kube-api-qps {q} --kube-api-burst {q}` \
         and {} claims, not deleted; {}. The bench counts claims and PVs with watches of its own. Times are from the \
         first claim created; \"handed over\" is kube-controller-manager's storage-provisioner annotation on the \
         claim, which the provisioner waits for (as upstream), and \"after the last hand-over\" is from KCM's last \
         one to the last PV; CPU seconds are each process's own, from the first claim to the last PV.\n\n```sh\n\
         cargo bench -p plugreg-csi-provisioner --bench provisioner -- --big-only{} --out BENCHMARKS.md\n```\n\n",
        r.claims,
        date(),
        commit(),
        r.load_start,
        load(),
        r.claims,
        if runs.len() > 1 {
            "first the release `csi-provisioner`, then the release `csi-sidecars --controllers=provisioner` \
             (the same flags, prefixed `--provisioner-` where it wants them), each on fresh peers"
        } else {
            "the release `csi-provisioner`"
        },
        if runs.len() > 1 {
            " --with-sidecars"
        } else {
            ""
        },
        q = r
            .label
            .split_whitespace()
            .nth(1)
            .unwrap_or("")
            .trim_end_matches(['`', ',']),
    );
    t.push_str(
        "| binary | claims created | 10%/50%/90%/all handed over | 10%/50%/90%/all PVs created | last PV after the last hand-over | \
         all claims Bound | CPU s to the last PV: provisioner / API server and etcd / KCM | peak RSS (when) | Lease lost |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        t.push_str(&format!(
            "| {} | {:.1} s | {} s | {} s | {:.1} s | {:.1} s | {:.1} / {:.1} / {:.1} | {:.1} MiB ({:.0} s; {:.1} MiB of it the binary's pages) | {} |\n",
            r.binary.name(),
            r.claims_created.as_secs_f64(),
            secs(&r.handed_marks),
            secs(&r.pv_marks),
            after_handover(r).as_secs_f64(),
            r.makespan.as_secs_f64(),
            r.cpu_to_pvs.0,
            r.cpu_to_pvs.1,
            r.cpu_to_pvs.2,
            r.hwm_kib as f64 / 1024.0,
            r.peak_at.as_secs_f64(),
            r.peak_file_kib as f64 / 1024.0,
            if r.lease_lost { "**yes**" } else { "no" }
        ));
    }
    let mut goals = Vec::new();
    for r in runs {
        let who = r.binary.name();
        goals.extend([
            (
                format!(
                    "{who}, raised limits, {} claims: every PV created in under 20 s (issue 16)",
                    r.claims
                ),
                format!("{:.1} s", r.pvs_done.as_secs_f64()),
                r.pvs_done.as_secs_f64() < 20.0,
            ),
            (
                format!(
                    "{who}, raised limits, {} claims: every PV within 2 s of KCM's last hand-over (issue 29)",
                    r.claims
                ),
                format!("{:.1} s", after_handover(r).as_secs_f64()),
                after_handover(r) < Duration::from_secs(2),
            ),
            (
                format!(
                    "{who}, raised limits, {} claims: peak RSS under 48 MiB (issue 16)",
                    r.claims
                ),
                format!("{:.1} MiB", r.hwm_kib as f64 / 1024.0),
                (r.hwm_kib as f64 / 1024.0) < 48.0,
            ),
            (
                format!("{who}: no Lease lost"),
                if r.lease_lost { "lost" } else { "kept" }.to_owned(),
                !r.lease_lost,
            ),
        ]);
    }
    t.push_str("\nGoals:\n\n| goal | measured | |\n|---|---|---|\n");
    for (goal, measured, met) in goals {
        t.push_str(&format!(
            "| {goal} | {measured} | {} |\n",
            if met { "met" } else { "**missed**" }
        ));
    }
    t.push_str(BIG_END);
    t
}

/// From kube-controller-manager's last hand-over to the last PV (zero when the last PV came
/// first, which a watch's ordering allows).
fn after_handover(r: &Run) -> Duration {
    r.pv_marks[3].saturating_sub(r.handed_marks[3])
}

/// The block of the runs of `--claims` claims (upstream's defaults, then raised limits).
fn small_block(runs: &[Run]) -> String {
    let mut t = String::new();
    t.push_str(&format!(
        "{START}\n## csi-provisioner: claims to Bound volumes (issues 12, 16)\n\n{}, commit {}, load average {} at the end. \
         Real kube-apiserver and kube-controller-manager v1.36.2 (fresh per run; KCM's own client limit raised to \
         1000 qps so that binding is not what is measured), the test CSI driver in-process (answers at once), the \
         release `csi-provisioner` with `--worker-threads 100` (default) and `--leader-election`. Claims \
         (Immediate binding) are created at once by the bench's own client; a run ends when the API server says \
         every claim is Bound. The API-write floor is one write per volume to Bound (the PV) and two per deleted \
         volume (the PV's DELETE and its finalizer's removal).\n\n```sh\n\
         cargo bench -p plugreg-csi-provisioner --bench provisioner -- --out BENCHMARKS.md\n```\n\n",
        date(),
        commit(),
        load()
    ));
    t.push_str("| run | claims | all PVs created | all claims Bound (makespan) | write floor | volumes/s (Bound) | rate-limited writes per volume when all Bound | API requests per volume (all, events included) | peak RSS | Lease lost |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for (i, r) in runs.iter().enumerate() {
        let total: u64 = r.requests.values().sum();
        let floor = if i == 0 {
            format!("{:.0} s", r.claims as f64 / 5.0)
        } else {
            "-".into()
        };
        t.push_str(&format!(
            "| {} | {} | {:.1} s | {:.1} s | {} | {:.2} | {:.3} | {:.2} | {:.1} MiB | {} |\n",
            r.label,
            r.claims,
            r.pvs_done.as_secs_f64(),
            r.makespan.as_secs_f64(),
            floor,
            r.claims as f64 / r.makespan.as_secs_f64(),
            r.writes_at_bound as f64 / r.claims as f64,
            total as f64 / r.claims as f64,
            r.hwm_kib as f64 / 1024.0,
            if r.lease_lost { "**yes**" } else { "no" }
        ));
    }
    t.push_str("\nRequests by verb and resource (first run, until the counters settle after the last Bound):\n\n| request | in all | per volume |\n|---|---|---|\n");
    for (k, v) in &runs[0].requests {
        t.push_str(&format!(
            "| {k} | {v} | {:.3} |\n",
            *v as f64 / runs[0].claims as f64
        ));
    }
    for r in &runs[..2] {
        let Some(d) = r.delete_makespan else { continue };
        let floor = if r.label.contains("qps 5`") {
            format!(" (write floor {:.0} s)", r.claims as f64 * 2.0 / 5.0)
        } else {
            String::new()
        };
        t.push_str(&format!(
            "\nDeletion, {}: {} claims deleted at once, every PV gone after {:.1} s{floor} ({:.2} volumes/s).\n",
            r.label,
            r.claims,
            d.as_secs_f64(),
            r.claims as f64 / d.as_secs_f64()
        ));
        t.push_str("\n| deletion request | in all | per volume |\n|---|---|---|\n");
        for (k, v) in &r.delete_requests {
            t.push_str(&format!(
                "| {k} | {v} | {:.3} |\n",
                *v as f64 / r.claims as f64
            ));
        }
    }
    // Issue 16's goals, judged from the runs above.
    let q5 = &runs[0];
    let floor = q5.claims as f64 / 5.0;
    let mut goals = vec![
        (
            format!(
                "QPS 5, {} claims: rate-limited writes per volume before the last claim is Bound <= 1.05",
                q5.claims
            ),
            format!("{:.3}", q5.writes_at_bound as f64 / q5.claims as f64),
            q5.writes_at_bound as f64 / q5.claims as f64 <= 1.05,
        ),
        (
            format!(
                "QPS 5, {} claims: every claim Bound within 1.1x the write floor ({:.0} s)",
                q5.claims,
                1.1 * floor
            ),
            format!("{:.1} s", q5.makespan.as_secs_f64()),
            q5.makespan.as_secs_f64() <= 1.1 * floor,
        ),
    ];
    if let Some(d) = q5.delete_makespan {
        let floor = 2.0 * q5.claims as f64 / 5.0;
        goals.push((
            format!(
                "QPS 5, {} deletions: every PV gone within 1.1x the write floor of two writes per volume ({:.0} s)",
                q5.claims,
                1.1 * floor
            ),
            format!("{:.1} s", d.as_secs_f64()),
            d.as_secs_f64() <= 1.1 * floor,
        ));
    }
    goals.push((
        "no Lease lost in any run".to_owned(),
        format!(
            "{} of {} runs lost it",
            runs.iter().filter(|r| r.lease_lost).count(),
            runs.len()
        ),
        runs.iter().all(|r| !r.lease_lost),
    ));
    t.push_str("\nIssue 16's goals:\n\n| goal | measured | |\n|---|---|---|\n");
    for (goal, measured, met) in goals {
        t.push_str(&format!(
            "| {goal} | {measured} | {} |\n",
            if met { "met" } else { "**missed**" }
        ));
    }
    t.push_str(&format!(
        "\nUpstream's published figure at `--kube-api-qps 5`: {UPSTREAM_VOLUMES_PER_S} volumes/s (external-provisioner \
         PR #447); no Go provisioner runs on this machine (neither its source nor a binary is reachable), so there is no side-by-side run.\n{END}"
    ));
    t
}
