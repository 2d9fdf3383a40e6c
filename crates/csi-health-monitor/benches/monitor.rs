//! csi-external-health-monitor-controller benchmark (issue 30):
//!
//! ```sh
//! cargo bench -p plugreg-csi-health-monitor --bench monitor -- --out BENCHMARKS.md
//! cargo bench -p plugreg-csi-health-monitor --bench monitor -- --quick   # 100 PVs
//! ```
//!
//! A fresh real kube-apiserver v1.36.2, the test CSI driver in-process with N volumes (LIST_VOLUMES,
//! VOLUME_CONDITION; 100 volumes a ListVolumes page, as a driver with many volumes answers),
//! N CSI PVs bound to N claims, one in ten volumes abnormal, and the release binary with
//! `--list-volumes-interval=30s` and `--http-endpoint`, once at upstream's default rate limit
//! (`--kube-api-qps 5 --kube-api-burst 10`) and once at 50/100. Measured, by the bench's own
//! watch of the Events:
//!
//! - **start**: from the process's start to the last abnormal claim's event;
//! - **change**: the abnormal tenth turns healthy and another tenth abnormal at once, right
//!   after a pass listed its last page (the worst moment); from then to the last new abnormal
//!   event and to the last recovery event. The goal: every abnormal
//!   claim's event within one `--list-volumes-interval` plus 5 s;
//! - **steady**: the monitor's own API requests (`plugreg_kube_requests_total`) during two
//!   passes with nothing new;
//! - the peak RSS (VmHWM), with the highest anonymous and file-backed parts sampled.
//!
//! `PLUGREG_HEALTH_MONITOR_BIN` measures another build with the same flags.

use std::collections::{BTreeMap, HashMap};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, Namespace};
use kube::api::{Api, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, watcher};
use plugreg_csi_test_driver::{DriverConfig, Method, RunningDriver};
use plugreg_testpeers::bench::{
    BenchArgs, Memory, commit, create_all, date, delta, free_port, goals_table, load, requests,
    rss, sample_peaks, write_block, writes,
};
use plugreg_testpeers::sidecar;
use plugreg_testpeers::{ApiServer, KubeVersion};
use serde_json::json;

const START: &str = "<!-- bench:csi-external-health-monitor-controller:start -->";
const END: &str = "<!-- bench:csi-external-health-monitor-controller:end -->";
const DRIVER: &str = "bench.csi.plugreg.test";
const NS: &str = "bench";
const INTERVAL: Duration = Duration::from_secs(30);
const PAGE: usize = 100;
const WAIT: Duration = Duration::from_secs(300);

fn bin() -> String {
    std::env::var("PLUGREG_HEALTH_MONITOR_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_csi-external-health-monitor-controller").to_owned())
}

fn volume(i: usize) -> String {
    format!("vol-{i:05}")
}

fn claim(i: usize) -> String {
    format!("claim-{i:05}")
}

/// The first time the bench's watch saw each (claim, reason).
type Seen = std::sync::Arc<std::sync::Mutex<HashMap<(String, String), Instant>>>;

fn watch_events(client: kube::Client) -> Seen {
    let seen: Seen = Seen::default();
    let s = seen.clone();
    tokio::spawn(async move {
        let api: Api<Event> = Api::namespaced(client, NS);
        let mut w = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
        while let Some(ev) = w.next().await {
            if let Ok(watcher::Event::Apply(e) | watcher::Event::InitApply(e)) = ev {
                let key = (
                    e.involved_object.name.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                );
                s.lock().unwrap().entry(key).or_insert_with(Instant::now);
            }
        }
    });
    seen
}

/// Waits until every claim of `claims` has an event of `reason`; when the last was first seen.
async fn all_seen(seen: &Seen, claims: &[String], reason: &str) -> Option<Instant> {
    let deadline = Instant::now() + WAIT;
    loop {
        {
            let s = seen.lock().unwrap();
            let times: Option<Vec<Instant>> = claims
                .iter()
                .map(|c| s.get(&(c.clone(), reason.to_owned())).copied())
                .collect();
            if let Some(t) = times {
                return t.into_iter().max();
            }
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Run {
    n: usize,
    qps: f64,
    burst: u32,
    /// Process start to the last first abnormal event.
    start: Option<Duration>,
    /// The change to the last new abnormal event, and to the last recovery event.
    change_abnormal: Option<Duration>,
    change_normal: Option<Duration>,
    /// The monitor's requests during the start phase, the change, and two steady passes.
    start_requests: BTreeMap<String, u64>,
    change_requests: BTreeMap<String, u64>,
    steady_requests: BTreeMap<String, u64>,
    mem: Memory,
    load_start: String,
}

async fn setup(n: usize) -> (ApiServer, kube::Client, RunningDriver, tempfile::TempDir) {
    let api = ApiServer::start_version(KubeVersion::V1_36_2)
        .await
        .unwrap();
    let client = api.client().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let driver = plugreg_csi_test_driver::start(
        DriverConfig {
            name: DRIVER.into(),
            controller: true,
            list_volumes: true,
            list_volumes_page: Some(PAGE),
            volume_condition: true,
            volumes: (0..n).map(volume).collect(),
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
    create_all(n, |i| {
        let client = client.clone();
        async move {
            let pv = format!("pv-{i:05}");
            // The claim stays Pending: the monitor reads only the PV.
            sidecar::bound_claim(&client, NS, &claim(i), &pv, DRIVER, &volume(i), false).await;
        }
    })
    .await;
    (api, client, driver, dir)
}

async fn run(n: usize, qps: f64, burst: u32) -> Run {
    let load_start = load();
    let (api, client, driver, dir) = setup(n).await;
    let first: Vec<usize> = (0..n).step_by(10).collect();
    let second: Vec<usize> = (5..n).step_by(10).collect();
    for &i in &first {
        driver.set_condition(&volume(i), Some(&format!("bench: volume {i} is abnormal")));
    }
    let seen = watch_events(client.clone());

    let port = free_port();
    let log = std::fs::File::create(dir.path().join("monitor.log")).unwrap();
    let started = Instant::now();
    let mut child = Command::new(bin())
        .arg(format!(
            "--csi-address={}",
            dir.path().join("csi.sock").display()
        ))
        .arg(format!("--kubeconfig={}", api.kubeconfig_path().display()))
        .arg(format!("--http-endpoint=127.0.0.1:{port}"))
        .arg(format!("--list-volumes-interval={}s", INTERVAL.as_secs()))
        .arg(format!("--kube-api-qps={qps}"))
        .arg(format!("--kube-api-burst={burst}"))
        .arg("--v=1")
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let pid = child.id();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = sample_peaks(pid, std::sync::Arc::clone(&stop));
    let t = Instant::now();
    while requests(port).is_empty() && t.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let idle_kib = rss(pid);
    // Every request since the start counts.
    let r0 = BTreeMap::new();

    let first_claims: Vec<String> = first.iter().map(|&i| claim(i)).collect();
    let second_claims: Vec<String> = second.iter().map(|&i| claim(i)).collect();
    let start = all_seen(&seen, &first_claims, "VolumeConditionAbnormal")
        .await
        .map(|t| t - started);
    // The worst moment for a change: right after a pass has listed the last page, so that it
    // waits a whole interval for the next pass. A fifth of the volumes change at once.
    let pages = n.div_ceil(PAGE) as u64;
    let listed = driver.calls().count(Method::ListVolumes);
    while driver.calls().count(Method::ListVolumes) < listed + pages {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r1 = requests(port);
    let changed = Instant::now();
    for &i in &first {
        driver.set_condition(&volume(i), None);
    }
    for &i in &second {
        driver.set_condition(
            &volume(i),
            Some(&format!("bench: volume {i} went abnormal")),
        );
    }
    let change_abnormal = all_seen(&seen, &second_claims, "VolumeConditionAbnormal")
        .await
        .map(|t| t - changed);
    let change_normal = all_seen(&seen, &first_claims, "VolumeConditionNormal")
        .await
        .map(|t| t - changed);
    // Two passes with nothing new (each pass lists n / PAGE pages).
    let settle = driver.calls().count(Method::ListVolumes);
    while driver.calls().count(Method::ListVolumes) < settle + pages {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r2 = requests(port);
    let from = driver.calls().count(Method::ListVolumes);
    while driver.calls().count(Method::ListVolumes) < from + 2 * pages {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r3 = requests(port);

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mem = Memory::measure(pid, idle_kib, sampler.join().unwrap_or_default());
    let _ = child.kill();
    let _ = child.wait();
    if let Ok(keep) = std::env::var("PLUGREG_BENCH_LOGS") {
        let _ = std::fs::copy(
            dir.path().join("monitor.log"),
            std::path::Path::new(&keep).join(format!("health-monitor-{n}-{qps}.log")),
        );
    }
    Run {
        n,
        qps,
        burst,
        start,
        change_abnormal,
        change_normal,
        start_requests: delta(&r1, &r0),
        change_requests: delta(&r2, &r1),
        steady_requests: delta(&r3, &r2),
        mem,
        load_start,
    }
}

fn secs(d: Option<Duration>) -> String {
    d.map_or("not seen in 5 min".to_owned(), |d| {
        format!("{:.1} s", d.as_secs_f64())
    })
}

fn fmt(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "none".to_owned();
    }
    m.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn block(runs: &[Run], commit: &str) -> String {
    let n = runs[0].n;
    let mut t = format!(
        "{START}\n## csi-external-health-monitor-controller: volume conditions through ListVolumes (issue 30)\n\n\
         {}, commit {commit}, load average {} at the start and {} at the end (2 cores, shared). Real \
         kube-apiserver v1.36.2 (fresh for each run), the test CSI driver in-process with {n} volumes \
         (LIST_VOLUMES, VOLUME_CONDITION, {PAGE} volumes a ListVolumes page), {n} CSI PVs bound to {n} claims, one \
         volume in ten abnormal from the start. The release binary runs with `--list-volumes-interval={}s` and \
         `--http-endpoint`. **start**: from the process's start to the last abnormal claim's event. **change**: the \
         abnormal tenth turns healthy and another tenth abnormal at once, right after a pass has listed its last page \
         (the worst moment: the change waits a whole interval for the next pass); from then to the last new abnormal \
         event and to the last recovery event. **steady**: the monitor's own API requests \
         (`plugreg_kube_requests_total`) during two passes with nothing new. Events are timed by the bench's own watch.\n\n\
         ```sh\ncargo bench -p plugreg-csi-health-monitor --bench monitor -- --out BENCHMARKS.md\n```\n\n\
         | rate limit | start: last abnormal event | change: last new abnormal event | change: last recovery event | peak RSS (VmHWM) |\n\
         |---|---|---|---|---|\n",
        date(),
        runs[0].load_start,
        load(),
        INTERVAL.as_secs(),
    );
    for r in runs {
        t.push_str(&format!(
            "| qps {} burst {} | {} | {} | {} | {:.1} MiB |\n",
            r.qps,
            r.burst,
            secs(r.start),
            secs(r.change_abnormal),
            secs(r.change_normal),
            r.mem.hwm_mib()
        ));
    }
    t.push_str("\nThe monitor's API requests, by verb and resource:\n\n| rate limit | start phase | change | two steady passes |\n|---|---|---|---|\n");
    for r in runs {
        t.push_str(&format!(
            "| qps {} burst {} | {} | {} | {} |\n",
            r.qps,
            r.burst,
            fmt(&r.start_requests),
            fmt(&r.change_requests),
            fmt(&r.steady_requests)
        ));
    }
    t.push('\n');
    t.push_str(&runs[0].mem.paragraph("the first pass"));
    let bound = INTERVAL + Duration::from_secs(5);
    let mut rows = Vec::new();
    for r in runs {
        rows.push((
            format!(
                "every abnormal claim's event within the interval + 5 s ({} s) of the start, qps {}",
                bound.as_secs(),
                r.qps
            ),
            secs(r.start),
            r.start.is_some_and(|d| d <= bound),
        ));
    }
    for r in runs {
        rows.push((
            format!(
                "every abnormal claim's event within the interval + 5 s ({} s) of a change at the worst moment, qps {}",
                bound.as_secs(),
                r.qps
            ),
            secs(r.change_abnormal),
            r.change_abnormal.is_some_and(|d| d <= bound),
        ));
    }
    for r in runs {
        let mib = r.mem.hwm_mib();
        rows.push((
            format!("peak RSS under 16 MiB at {n} PVs, qps {}", r.qps),
            format!("{mib:.1} MiB"),
            mib < 16.0,
        ));
    }
    let steady_writes: u64 = runs.iter().map(|r| writes(&r.steady_requests)).sum();
    rows.push((
        "no API request in a pass with nothing new".to_owned(),
        format!(
            "{} requests ({} writes)",
            runs.iter()
                .map(|r| r.steady_requests.values().sum::<u64>())
                .sum::<u64>(),
            steady_writes
        ),
        runs.iter().all(|r| r.steady_requests.is_empty()),
    ));
    t.push_str(&goals_table(&rows));
    t.push_str(&format!(
        "\nUpstream's design, from its spec (no Go health monitor runs on this machine): three cluster-wide \
         watches (PersistentVolumes, PersistentVolumeClaims, and every Event in the cluster, cached whole); each pass \
         writes one event per abnormal claim again ({} a pass here, a POST then PATCHes of its count) and one \
         recovery event per healthy claim whose abnormal event still lives, until the API server's event TTL; at \
         qps 5 the {} abnormal claims' writes alone take at least {:.0} s of every pass. This monitor watches PersistentVolumes \
         only, lists the claims' abnormal and recovery events once per leadership (two paged LISTs with field \
         selectors), and writes an event per change.\n",
        n / 10,
        n / 10,
        (n as f64 / 10.0 - 10.0).max(0.0) / 5.0
    ));
    t.push_str(&format!("{END}\n"));
    t
}

#[tokio::main]
async fn main() {
    let args = BenchArgs::parse(1000);
    let commit = commit();
    let mut runs = Vec::new();
    for (qps, burst) in [(5.0, 10), (50.0, 100)] {
        let r = run(args.n, qps, burst).await;
        println!(
            "qps {qps}: start {}, change {} / {}, peak {:.1} MiB",
            secs(r.start),
            secs(r.change_abnormal),
            secs(r.change_normal),
            r.mem.hwm_mib()
        );
        runs.push(r);
    }
    let t = block(&runs, &commit);
    println!("{t}");
    if let Some(out) = args.out {
        write_block(&out, START, END, &t);
    }
}
