//! csi-provisioner `--node-deployment` benchmark (issue 31): Immediate claims raced by nodes.
//!
//! ```sh
//! cargo bench -p plugreg-csi-provisioner --bench node_race -- --out BENCHMARKS.md
//! cargo bench -p plugreg-csi-provisioner --bench node_race -- --base-delay 20s --runs 5
//! ```
//!
//! A fresh real kube-apiserver and kube-controller-manager v1.36.2 (its PV controller binds; its
//! own client limit raised so that binding is not what is measured) and 10 fake nodes, each with
//! its own in-process test driver (its node ID, its topology segment, a 1 TiB pool, its data
//! directory) and its own release `csi-provisioner` process (`--node-deployment`, `NODE_NAME`,
//! the default 100 workers and QPS). One Immediate StorageClass; 100 claims created at once.
//! Every node waits `max(0, min(base·2^n, max) − U·base)` before it tries to take a claim,
//! checks its capacity and writes its name into the claim's `selected-node` annotation; the
//! first writer provisions it.
//!
//! Reported per run: the makespan (first create until the API server says all 100 are Bound)
//! beside upstream's formula (with 100 workers per node every claim waits at once, so the last
//! claim is taken after E[max over the 100 claims of the min over the 10 nodes of U·base],
//! computed exactly here), when the last claim was taken, the waits the nodes drew (from their
//! logs), whether every claim was provisioned exactly once (distinct CreateVolume names over the
//! 10 drivers) by the node that won it, whether each claim's annotation still names its PV's
//! node `base` + 5 s after the first create (no loser rewrote it), whether any volume was left
//! once every claim was deleted and every PV gone, and the highest peak RSS (VmHWM) of the 10
//! provisioners.
//!
//! Default: 3 runs at `--base-delay 20s` (upstream's default; max delay 60 s) and 3 at 2 s (max
//! 6 s), which shows what follows the waits; `--base-delay D` (repeatable; max delay 3·D) and
//! `--runs N` change them, `--qps Q` raises every provisioner's `--kube-api-qps` and
//! `--kube-api-burst` to Q (upstream's 5 and 10 otherwise; the block says which). `PLUGREG_PROVISIONER_BIN` measures another build;
//! `PLUGREG_BENCH_LOGS=<dir>` keeps every provisioner's log (a run that misses the goal keeps
//! them under the target directory's `tmp/node_race/` anyway).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, watcher};
use plugreg_csi_test_driver::{Calls, Capacity, DriverConfig, Method, MountMode, RunningDriver};
use plugreg_testpeers::bench::{commit, create_all, date, load, write_block};
use plugreg_testpeers::{ApiServer, ControllerManager, KubeVersion};
use serde_json::json;

const START: &str = "<!-- bench:csi-provisioner-node-race:start -->";
const END: &str = "<!-- bench:csi-provisioner-node-race:end -->";
const KEY: &str = "topology.node-race.plugreg.test/node";
const SELECTED: &str = "volume.kubernetes.io/selected-node";
const NODES: usize = 10;
const CLAIMS: usize = 100;
/// Each node's pool: room for every claim (1 GiB each) many times over.
const POOL: i64 = 1 << 40;
/// How long after `start + base` (every node's first wait over) the claims are looked at.
const SETTLE: Duration = Duration::from_secs(5);
/// The command of a run, before its own arguments.
const COMMAND: &str = "cargo bench -p plugreg-csi-provisioner --bench node_race --";

fn bin() -> String {
    std::env::var("PLUGREG_PROVISIONER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_csi-provisioner").to_owned())
}

struct Args {
    out: Option<String>,
    bases: Vec<Duration>,
    runs: usize,
    /// `--kube-api-qps` and `--kube-api-burst` of every provisioner, when raised.
    qps: Option<u32>,
}

fn args() -> Args {
    let mut a = Args {
        out: None,
        bases: Vec::new(),
        runs: 3,
        qps: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--out" => a.out = it.next(),
            "--qps" => a.qps = it.next().and_then(|v| v.parse().ok()),
            "--runs" => a.runs = it.next().and_then(|v| v.parse().ok()).unwrap_or(a.runs),
            "--base-delay" => {
                let v = it.next().unwrap_or_default();
                match plugreg_sidecar_kit::gosyntax::parse_duration(&v) {
                    Ok(d) if !d.is_zero() => a.bases.push(d),
                    _ => panic!("--base-delay {v:?}: a Go duration above zero, e.g. 20s"),
                }
            }
            _ => {} // cargo bench passes --bench
        }
    }
    if a.bases.is_empty() {
        a.bases = vec![Duration::from_secs(20), Duration::from_secs(2)];
    }
    a
}

/// E[max over `claims` claims of the min over `nodes` nodes of U], U uniform in [0, 1), each
/// node's and claim's draw independent: the time the last claim is taken, in units of the base
/// delay. The min of one claim has the CDF `1 − (1 − x)^nodes`, the max of the claims' mins
/// `(1 − (1 − x)^nodes)^claims`; the expectation is the integral of one minus that over [0, 1]
/// (midpoint rule, 10^5 steps: exact to far below a millisecond of a 20 s base).
fn expected_last_taken(nodes: i32, claims: i32) -> f64 {
    let steps = 100_000;
    (0..steps)
        .map(|i| {
            let x = (f64::from(i) + 0.5) / f64::from(steps);
            1.0 - (1.0 - (1.0 - x).powi(nodes)).powi(claims)
        })
        .sum::<f64>()
        / f64::from(steps)
}

/// The same expectation by simulation (`trials` races with the provisioner's own random
/// source), as a check of the integral.
fn simulated_last_taken(nodes: usize, claims: usize, trials: usize) -> f64 {
    let mut sum = 0.0;
    for _ in 0..trials {
        let mut last: f64 = 0.0;
        for _ in 0..claims {
            let least = (0..nodes)
                .map(|_| plugreg_runtime::backoff::unit_random())
                .fold(1.0, f64::min);
            last = last.max(least);
        }
        sum += last;
    }
    sum / trials as f64
}

/// The `q` quantile of the same distribution, in units of the base delay.
fn quantile_last_taken(q: f64, nodes: i32, claims: i32) -> f64 {
    1.0 - (1.0 - q.powf(1.0 / f64::from(claims))).powf(1.0 / f64::from(nodes))
}

/// A Go duration for a flag.
fn go_duration(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

/// Seconds, for the report.
fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 10.0 {
        format!("{s:.1} s")
    } else {
        format!("{s:.2} s")
    }
}

fn opt_secs(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_owned(), secs)
}

/// A Rust `Duration`'s `Debug` text (`7.5s`, `512.3ms`, `12µs`, `0ns`).
fn parse_debug_duration(s: &str) -> Option<Duration> {
    let (num, scale) = if let Some(n) = s.strip_suffix("ns") {
        (n, 1e-9)
    } else if let Some(n) = s.strip_suffix("µs") {
        (n, 1e-6)
    } else if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else {
        (s.strip_suffix('s')?, 1.0)
    };
    num.parse::<f64>()
        .ok()
        .map(|v| Duration::from_secs_f64(v * scale))
}

/// The waits a node's log says it drew: (claim name, attempt, wait), from the provisioner's
/// "will try to become owner of PVC <ns>/<name> with resource version <rv> in <wait> (attempt
/// #<n>)" debug lines.
fn drawn_waits(log: &str, ns: &str) -> Vec<(String, u32, Duration)> {
    let prefix = format!("will try to become owner of PVC {ns}/");
    log.lines()
        .filter_map(|l| {
            let rest = &l[l.find(&prefix)? + prefix.len()..];
            let (claim, rest) = rest.split_once(' ')?;
            let rest = &rest[rest.find(" in ")? + 4..];
            let (wait, rest) = rest.split_once(" (attempt #")?;
            let attempt = rest.split(')').next()?.parse().ok()?;
            Some((claim.to_owned(), attempt, parse_debug_duration(wait)?))
        })
        .collect()
}

/// One fake node: its driver instance and its provisioner.
struct Node {
    name: String,
    calls: Calls,
    data: PathBuf,
    log: PathBuf,
    child: Child,
    _driver: RunningDriver,
}

impl Node {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// What the bench's watch saw of one claim.
#[derive(Debug, Clone, Default)]
struct Seen {
    /// Every value its `selected-node` annotation took, and when the watch saw it: the first
    /// is the node that won the race; any later one is a rewrite.
    annotated: Vec<(Instant, String)>,
    /// When it was first Bound, and to which PV.
    bound: Option<(Instant, String)>,
}

impl Seen {
    /// When it was first taken, and by which node.
    fn taken(&self) -> Option<&(Instant, String)> {
        self.annotated.first()
    }
}

/// What one run measured and found.
#[derive(Debug)]
struct Run {
    base: Duration,
    load: String,
    /// Until the bench had created every claim.
    created: Duration,
    bound: usize,
    makespan: Option<Duration>,
    /// When the last claim was taken (its annotation written), from the first create.
    last_taken: Option<Duration>,
    /// The max over the claims of the least attempt-0 wait any node drew for it (from the logs).
    drawn: Option<Duration>,
    /// Claims for which some node logged a wait.
    drawn_claims: usize,
    /// Waits of a second or later attempt (after a lost Update), over all nodes.
    retries: usize,
    /// CreateVolume calls over the drivers.
    creates: u64,
    /// Distinct CreateVolume names over the drivers, and names some two drivers were asked for.
    distinct: usize,
    on_two_nodes: Vec<String>,
    /// Claims whose PV or CreateVolume is not on the node the annotation names (or missing).
    misplaced: Vec<String>,
    /// Claims whose annotation some node rewrote after the race was won (each with its values
    /// in order), the rewrites in all, and claims whose annotation names another node than the
    /// PV's when looked at (`base` + [`SETTLE`] after the first create).
    rewritten: Vec<String>,
    rewrites: usize,
    /// Rewrites the watch saw after it had seen the claim Bound.
    rewrites_after_bound: usize,
    final_elsewhere: usize,
    /// Claims taken per node, fewest and most.
    per_node: (usize, usize),
    /// "became the owner" lines and lost Updates (409) over the nodes' logs.
    owners: usize,
    conflicts: usize,
    failed_events: usize,
    /// From the delete of every claim until every PV was gone.
    deleted: Option<Duration>,
    pvs_left: usize,
    /// Volume directories left in the drivers' data directories after every PV was gone.
    dirs_left: usize,
    /// Volumes never given to DeleteVolume on their node; DeleteVolume calls of a node for a
    /// volume it does not have.
    undeleted: Vec<String>,
    foreign_deletes: usize,
    /// The highest VmHWM of the 10 provisioners, in MiB.
    hwm_mib: f64,
    /// Provisioners that exited during the run.
    exited: usize,
}

impl Run {
    fn exactly_once(&self) -> bool {
        self.bound == CLAIMS
            && self.distinct == CLAIMS
            && self.creates == CLAIMS as u64
            && self.on_two_nodes.is_empty()
            && self.misplaced.is_empty()
    }

    fn no_leak(&self) -> bool {
        self.deleted.is_some()
            && self.pvs_left == 0
            && self.dirs_left == 0
            && self.undeleted.is_empty()
    }

    /// Whether every claim's annotation still names the node that won it (and holds its PV).
    fn annotations_kept(&self) -> bool {
        self.rewritten.is_empty() && self.final_elsewhere == 0
    }

    fn held(&self) -> bool {
        self.exactly_once() && self.no_leak() && self.annotations_kept() && self.exited == 0
    }
}

fn affinity_nodes(pv: &PersistentVolume) -> Vec<String> {
    pv.spec
        .as_ref()
        .and_then(|s| s.node_affinity.as_ref())
        .and_then(|a| a.required.as_ref())
        .map(|r| {
            r.node_selector_terms
                .iter()
                .flat_map(|t| t.match_expressions.iter().flatten())
                .filter(|e| e.key == KEY && e.operator == "In")
                .flat_map(|e| e.values.clone().unwrap_or_default())
                .collect()
        })
        .unwrap_or_default()
}

async fn wait_log(node: &Node, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while !node.log().contains(needle) {
        assert!(
            Instant::now() < deadline,
            "{}: no {needle:?} in its log:\n{}",
            node.name,
            node.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The PVs of `driver`.
async fn pvs_of(api: &Api<PersistentVolume>, driver: &str) -> Option<Vec<PersistentVolume>> {
    let list = api.list(&ListParams::default()).await.ok()?;
    Some(
        list.items
            .into_iter()
            .filter(|p| {
                p.spec
                    .as_ref()
                    .and_then(|s| s.csi.as_ref())
                    .is_some_and(|c| c.driver == driver)
            })
            .collect(),
    )
}

async fn run(
    api: &ApiServer,
    client: &kube::Client,
    k: usize,
    base: Duration,
    qps: Option<u32>,
) -> Run {
    let load_start = load();
    let driver = format!("r{k}.node-race.plugreg.test");
    let ns = format!("race-{k}");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap(),
        )
        .await
        .unwrap();
    let classes: Api<StorageClass> = Api::all(client.clone());
    classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": driver},
                "provisioner": driver,
                "reclaimPolicy": "Delete",
                "volumeBindingMode": "Immediate",
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let max = base * 3;
    let mut nodes = Vec::new();
    for i in 0..NODES {
        let name = format!("node-{i}");
        let segment = BTreeMap::from([(KEY.to_owned(), name.clone())]);
        let ndir = dir.path().join(&name);
        std::fs::create_dir_all(&ndir).unwrap();
        let cfg = DriverConfig {
            name: driver.clone(),
            controller: true,
            accessibility_constraints: true,
            node_id: name.clone(),
            topology: segment.clone(),
            data_dir: Some(ndir.join("volumes")),
            mount: MountMode::Directory,
            capacity: Capacity::with_pools([(segment, POOL)]),
            ..DriverConfig::default()
        };
        let calls = cfg.calls.clone();
        let socket = ndir.join("csi.sock");
        let running = plugreg_csi_test_driver::start(cfg, &socket).await.unwrap();
        let log = ndir.join("provisioner.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(bin())
            .arg(format!("--csi-address={}", socket.display()))
            .arg(format!("--kubeconfig={}", api.kubeconfig_path().display()))
            // Debug lines: the waits each node drew and its lost Updates.
            .arg("--v=2")
            .args([
                "--node-deployment",
                "--feature-gates=Topology=true",
                "--strict-topology",
                "--immediate-topology=false",
            ])
            .arg(format!(
                "--node-deployment-base-delay={}",
                go_duration(base)
            ))
            .arg(format!("--node-deployment-max-delay={}", go_duration(max)))
            .args(qps.iter().flat_map(|q| {
                [
                    format!("--kube-api-qps={q}"),
                    format!("--kube-api-burst={q}"),
                ]
            }))
            .env_remove("KUBECONFIG")
            .env("NODE_NAME", &name)
            .env("NAMESPACE", &ns)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        nodes.push(Node {
            name,
            calls,
            data: ndir.join("volumes"),
            log,
            child,
            _driver: running,
        });
    }
    for n in &nodes {
        wait_log(n, "Informers synced; starting").await;
    }

    // The claims as the API server has them, watched.
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    let seen = Arc::new(Mutex::new(BTreeMap::<String, Seen>::new()));
    let (bound_tx, mut bound_rx) = tokio::sync::watch::channel(0usize);
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<()>();
    let watch = tokio::spawn({
        let (pvcs, seen) = (pvcs.clone(), Arc::clone(&seen));
        async move {
            let mut ready = Some(ready_tx);
            let mut s = std::pin::pin!(watcher(pvcs, watcher::Config::default()).default_backoff());
            while let Some(ev) = s.next().await {
                let c = match ev {
                    Ok(watcher::Event::InitDone) => {
                        if let Some(r) = ready.take() {
                            let _ = r.send(());
                        }
                        continue;
                    }
                    Ok(watcher::Event::Apply(c) | watcher::Event::InitApply(c)) => c,
                    _ => continue,
                };
                let now = Instant::now();
                let name = c.metadata.name.clone().unwrap_or_default();
                let mut seen = seen.lock().unwrap();
                let e = seen.entry(name).or_default();
                if let Some(node) = c
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(SELECTED))
                    .filter(|n| !n.is_empty())
                    && e.annotated.last().map(|a| &a.1) != Some(node)
                {
                    e.annotated.push((now, node.clone()));
                }
                if e.bound.is_none()
                    && c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
                {
                    let pv = c
                        .spec
                        .as_ref()
                        .and_then(|s| s.volume_name.clone())
                        .unwrap_or_default();
                    e.bound = Some((now, pv));
                }
                let n = seen.values().filter(|s| s.bound.is_some()).count();
                drop(seen);
                bound_tx.send_replace(n);
            }
        }
    });
    ready_rx.await.unwrap();

    let start = Instant::now();
    create_all(CLAIMS, |i| {
        let (pvcs, class) = (pvcs.clone(), driver.clone());
        async move {
            let pvc = serde_json::from_value(json!({
                "metadata": {"name": format!("c{i}")},
                "spec": {"storageClassName": class, "accessModes": ["ReadWriteOnce"],
                         "resources": {"requests": {"storage": "1Gi"}}}
            }))
            .unwrap();
            pvcs.create(&PostParams::default(), &pvc).await.unwrap();
        }
    })
    .await;
    let created = start.elapsed();
    // Several attempts' worth of waits, and time to provision, before a run counts as stuck.
    let limit = max * 2 + Duration::from_secs(60);
    let all_bound = tokio::time::timeout(limit, bound_rx.wait_for(|n| *n >= CLAIMS))
        .await
        .is_ok();
    // Every node's first wait over (and its Update sent), then the claims as they are.
    tokio::time::sleep_until(tokio::time::Instant::from_std(start + base + SETTLE)).await;
    watch.abort();
    let seen = seen.lock().unwrap().clone();
    let bound = seen.values().filter(|s| s.bound.is_some()).count();
    let since = |t: Instant| t.saturating_duration_since(start);
    let makespan = all_bound
        .then(|| {
            seen.values()
                .filter_map(|s| s.bound.as_ref())
                .map(|b| since(b.0))
                .max()
        })
        .flatten();
    let last_taken = (seen.values().filter(|s| s.taken().is_some()).count() == CLAIMS)
        .then(|| {
            seen.values()
                .filter_map(Seen::taken)
                .map(|t| since(t.0))
                .max()
        })
        .flatten();
    eprintln!(
        "run {k} (base {base:?}): {bound} of {CLAIMS} Bound, makespan {makespan:?}, last taken {last_taken:?}"
    );

    // Every claim once, on the node its annotation names.
    let created_on: Vec<BTreeSet<String>> = nodes
        .iter()
        .map(|n| {
            n.calls
                .create_requests()
                .into_iter()
                .map(|r| r.name)
                .collect()
        })
        .collect();
    let creates: u64 = nodes
        .iter()
        .map(|n| n.calls.count(Method::CreateVolume))
        .sum();
    let mut where_created = BTreeMap::<String, Vec<usize>>::new();
    for (i, names) in created_on.iter().enumerate() {
        for name in names {
            where_created.entry(name.clone()).or_default().push(i);
        }
    }
    let on_two_nodes: Vec<String> = where_created
        .iter()
        .filter(|(_, on)| on.len() > 1)
        .map(|(n, on)| format!("{n} on {on:?}"))
        .collect();
    let pv_api: Api<PersistentVolume> = Api::all(client.clone());
    let pvs: BTreeMap<String, PersistentVolume> = pvs_of(&pv_api, &driver)
        .await
        .unwrap_or_default()
        .into_iter()
        .map(|p| (p.metadata.name.clone().unwrap_or_default(), p))
        .collect();
    let node_index = |name: &str| nodes.iter().position(|n| n.name == name);
    let mut misplaced = Vec::new();
    let (mut rewritten, mut rewrites, mut final_elsewhere) = (Vec::new(), 0, 0);
    let mut rewrites_after_bound = 0;
    let mut per_node = [0usize; NODES];
    // Each node's volumes by volume handle: what DeleteVolume must be given there.
    let mut handles: Vec<BTreeSet<String>> = vec![BTreeSet::new(); NODES];
    for (claim, s) in &seen {
        let owner = s.taken().map(|t| t.1.clone()).unwrap_or_default();
        let Some(i) = node_index(&owner) else {
            misplaced.push(format!("{claim}: taken by {owner:?}"));
            continue;
        };
        per_node[i] += 1;
        let Some((_, pv)) = &s.bound else {
            misplaced.push(format!("{claim}: not Bound"));
            continue;
        };
        let Some(p) = pvs.get(pv) else {
            misplaced.push(format!("{claim}: PV {pv} not found"));
            continue;
        };
        let affinity = affinity_nodes(p);
        if s.annotated.len() > 1 {
            rewrites += s.annotated.len() - 1;
            rewrites_after_bound += s.annotated[1..]
                .iter()
                .filter(|(t, _)| s.bound.as_ref().is_some_and(|b| *t >= b.0))
                .count();
            let seq: Vec<String> = s
                .annotated
                .iter()
                .map(|(t, n)| format!("{n} at {:.1} s", since(*t).as_secs_f64()))
                .collect();
            rewritten.push(format!(
                "{claim} (PV {pv} on {}): {}",
                affinity.join(","),
                seq.join(" → ")
            ));
        }
        if s.annotated.last().map(|a| vec![a.1.clone()]) != Some(affinity.clone()) {
            final_elsewhere += 1;
        }
        if affinity != [owner.clone()] {
            misplaced.push(format!(
                "{claim}: taken by {owner}, PV affinity {affinity:?}"
            ));
        }
        if where_created.get(pv).map(Vec::as_slice) != Some(&[i]) {
            misplaced.push(format!(
                "{claim}: taken by {owner}, CreateVolume {pv} on nodes {:?}",
                where_created.get(pv)
            ));
        }
        if let Some(h) = p
            .spec
            .as_ref()
            .and_then(|s| s.csi.as_ref())
            .map(|c| c.volume_handle.clone())
        {
            handles[i].insert(h);
        }
    }
    let per_node = (
        per_node.iter().copied().min().unwrap_or(0),
        per_node.iter().copied().max().unwrap_or(0),
    );
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let failed_events = events
        .list(&ListParams::default())
        .await
        .map(|l| {
            l.items
                .iter()
                .filter(|e| e.reason.as_deref() == Some("ProvisioningFailed"))
                .count()
        })
        .unwrap_or(0);
    let logs: Vec<String> = nodes.iter().map(Node::log).collect();
    let mut least = BTreeMap::<String, Duration>::new();
    let mut retries = 0;
    for log in &logs {
        for (claim, attempt, wait) in drawn_waits(log, &ns) {
            if attempt == 0 {
                let w = least.entry(claim).or_insert(wait);
                *w = (*w).min(wait);
            } else {
                retries += 1;
            }
        }
    }
    let drawn = least.values().copied().max();
    let owners = logs
        .iter()
        .map(|l| l.matches("became the owner of the claim").count())
        .sum();
    let conflicts = logs
        .iter()
        .map(|l| l.matches("conflict during PVC").count())
        .sum();

    // Every claim deleted: every PV gone, every volume deleted on its own node.
    let del_start = Instant::now();
    pvcs.delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
    let mut deleted = None;
    let mut pvs_left = bound;
    while del_start.elapsed() < Duration::from_secs(120) {
        if let Some(left) = pvs_of(&pv_api, &driver).await {
            pvs_left = left.len();
            if pvs_left == 0 {
                deleted = Some(del_start.elapsed());
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let dirs_left = nodes
        .iter()
        .map(|n| {
            std::fs::read_dir(&n.data)
                .map(|d| {
                    d.filter_map(Result::ok)
                        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
                        .count()
                })
                .unwrap_or(0)
        })
        .sum();
    let mut undeleted = Vec::new();
    let mut foreign_deletes = 0;
    for (i, n) in nodes.iter().enumerate() {
        let asked: BTreeSet<String> = n
            .calls
            .delete_requests()
            .into_iter()
            .map(|r| r.volume_id)
            .collect();
        undeleted.extend(
            handles[i]
                .difference(&asked)
                .map(|h| format!("{}:{h}", n.name)),
        );
        foreign_deletes += asked.difference(&handles[i]).count();
    }
    let mut hwm_kib = 0;
    let mut exited = 0;
    for n in &mut nodes {
        if !matches!(n.child.try_wait(), Ok(None)) {
            exited += 1;
        }
        let pid = n.child.id().to_string();
        hwm_kib = hwm_kib.max(plugreg_runtime::procfs::status_kib(&pid, "VmHWM").unwrap_or(0));
        let _ = n.child.kill();
        let _ = n.child.wait();
    }
    let r = Run {
        base,
        load: load_start,
        created,
        bound,
        makespan,
        last_taken,
        drawn,
        drawn_claims: least.len(),
        retries,
        creates,
        distinct: where_created.len(),
        on_two_nodes,
        misplaced,
        rewritten,
        rewrites,
        rewrites_after_bound,
        final_elsewhere,
        per_node,
        owners,
        conflicts,
        failed_events,
        deleted,
        pvs_left,
        dirs_left,
        undeleted,
        foreign_deletes,
        hwm_mib: hwm_kib as f64 / 1024.0,
        exited,
    };
    eprintln!("run {k}: {r:?}");
    let keep = std::env::var("PLUGREG_BENCH_LOGS")
        .ok()
        .map(PathBuf::from)
        .or_else(|| (!r.held()).then(|| Path::new(env!("CARGO_TARGET_TMPDIR")).join("node_race")));
    if let Some(keep) = keep {
        let to = keep.join(format!("run-{k}"));
        let _ = std::fs::create_dir_all(&to);
        for n in &nodes {
            let _ = std::fs::copy(&n.log, to.join(format!("{}.log", n.name)));
        }
        eprintln!("run {k}: logs kept in {}", to.display());
    }
    drop(nodes);
    r
}

fn held_in(k: usize, n: usize) -> String {
    if k == n {
        format!("held in all {n} runs")
    } else {
        format!("**not held** in {} of {n} runs", n - k)
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

#[tokio::main]
async fn main() {
    let a = args();
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
    let mut runs = Vec::new();
    for base in &a.bases {
        for _ in 0..a.runs {
            let k = runs.len();
            runs.push(run(&api, &client, k, *base, a.qps).await);
        }
    }
    let load_end = load();
    drop(kcm);

    let e = expected_last_taken(NODES as i32, CLAIMS as i32);
    let sim = simulated_last_taken(NODES, CLAIMS, 20_000);
    let (q05, q95) = (
        quantile_last_taken(0.05, NODES as i32, CLAIMS as i32),
        quantile_last_taken(0.95, NODES as i32, CLAIMS as i32),
    );
    let mut t = String::from(
        "| base delay | run | claims created | last claim taken | least wait drawn, max over claims (logs) | \
         all Bound (makespan) | CreateVolume calls / distinct names | claims per node | lost Updates (409) | \
         claims whose annotation was rewritten (rewrites) | all PVs gone after deletion | volumes left | peak RSS, \
         highest of 10 | exactly once / no leak / annotation kept |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut by_base = String::from(
        "| base delay (max) | formula: last claim taken, E (5%–95%) | last claim taken, median | makespan, median | \
         makespan − last taken, median | lost Updates (409), median | peak RSS, highest | runs held |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    let yes = |b: bool| if b { "yes" } else { "**no**" };
    for base in &a.bases {
        let of: Vec<&Run> = runs.iter().filter(|r| r.base == *base).collect();
        for (i, r) in of.iter().enumerate() {
            t.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} / {} | {}–{} | {} | {} ({}) | {} | {} | {:.1} MiB | {} / {} / {} |\n",
                secs(*base),
                i + 1,
                secs(r.created),
                opt_secs(r.last_taken),
                opt_secs(r.drawn),
                r.makespan
                    .map_or_else(|| format!("{} of {CLAIMS} Bound", r.bound), secs),
                r.creates,
                r.distinct,
                r.per_node.0,
                r.per_node.1,
                r.conflicts,
                r.rewritten.len(),
                r.rewrites,
                opt_secs(r.deleted),
                r.dirs_left,
                r.hwm_mib,
                yes(r.exactly_once()),
                yes(r.no_leak()),
                yes(r.annotations_kept()),
            ));
        }
        let b = base.as_secs_f64();
        let med = |f: &dyn Fn(&Run) -> Option<Duration>| {
            median(
                of.iter()
                    .filter_map(|r| f(r))
                    .map(|d| d.as_secs_f64())
                    .collect(),
            )
            .map_or_else(|| "-".to_owned(), |s| format!("{s:.2} s"))
        };
        by_base.push_str(&format!(
            "| {} ({}) | {:.2} s ({:.2}–{:.2} s) | {} | {} | {} | {} | {:.1} MiB | {} of {} |\n",
            secs(*base),
            secs(*base * 3),
            e * b,
            q05 * b,
            q95 * b,
            med(&|r| r.last_taken),
            med(&|r| r.makespan),
            med(&|r| {
                r.makespan
                    .zip(r.last_taken)
                    .map(|(m, l)| m.saturating_sub(l))
            }),
            median(of.iter().map(|r| r.conflicts as f64).collect())
                .map_or_else(|| "-".to_owned(), |m| format!("{m:.0}")),
            of.iter().map(|r| r.hwm_mib).fold(0.0, f64::max),
            of.iter().filter(|r| r.held()).count(),
            of.len(),
        ));
    }
    let n = runs.len();
    let count = |f: fn(&Run) -> bool| runs.iter().filter(|r| f(r)).count();
    let (once, no_leak, kept, alive) = (
        count(Run::exactly_once),
        count(Run::no_leak),
        count(Run::annotations_kept),
        count(|r| r.exited == 0),
    );
    let mut verdict = format!(
        "{}\n\n\
         - Every claim provisioned exactly once, by the node that won it ({CLAIMS} CreateVolume calls, {CLAIMS} \
         distinct names, none on two drivers; the PV's affinity and the driver that got the CreateVolume name the \
         node of the claim's first annotation): {}.\n\
         - No volume leaked (every PV gone after every claim was deleted, every volume given to DeleteVolume on its \
         own node, no volume directory left in any driver's data directory): {}.\n\
         - Every claim's `selected-node` annotation still names the node of its PV {} s after `base` (never \
         rewritten once the race was won): {}.\n\
         - No provisioner exited: {}.\n",
        if once == n && no_leak == n && kept == n && alive == n {
            format!("**Goal held in all {n} runs.**")
        } else if once == n && no_leak == n {
            format!(
                "**Goal held for provisioning and deletion (exactly once, no leak) in all {n} runs, but not for the \
                 claims' annotation: a bug.**"
            )
        } else {
            "**Goal not held.**".to_owned()
        },
        held_in(once, n),
        held_in(no_leak, n),
        SETTLE.as_secs(),
        held_in(kept, n),
        held_in(alive, n),
    );
    for (k, r) in runs.iter().enumerate() {
        if !(r.exactly_once() && r.no_leak() && r.exited == 0) {
            verdict.push_str(&format!(
                "- Run {k} (base {}): {} of {CLAIMS} Bound; {} CreateVolume calls, {} distinct names; on two drivers: \
                 {:?}; misplaced: {:?}; PVs left {}; volume directories left {}; not deleted: {:?}; provisioners \
                 exited {}.\n",
                secs(r.base),
                r.bound,
                r.creates,
                r.distinct,
                r.on_two_nodes,
                r.misplaced,
                r.pvs_left,
                r.dirs_left,
                r.undeleted,
                r.exited,
            ));
        }
    }
    if kept < n {
        let rewritten: usize = runs.iter().map(|r| r.rewritten.len()).sum();
        let rewrites: usize = runs.iter().map(|r| r.rewrites).sum();
        let after: usize = runs.iter().map(|r| r.rewrites_after_bound).sum();
        let elsewhere: usize = runs.iter().map(|r| r.final_elsewhere).sum();
        let examples: Vec<&String> = runs.iter().flat_map(|r| &r.rewritten).take(3).collect();
        verdict.push_str(&format!(
            "\nThe annotation bug: over all runs {rewritten} claims had their `selected-node` annotation rewritten \
             ({rewrites} rewrites) by nodes that had lost the race, {after} of the rewrites after the bench's watch \
             had seen the claim Bound to the winner's volume; {elsewhere} claims ended up naming another node than \
             their PV's. Examples (times from the first create): {}. Each rewriting node logs \"became the owner of \
             the claim\" for it. Why, from the code: the claim cache trims a Bound claim's annotations to the beta \
             storage-class one (`crates/provisioner/src/cached.rs`, `trim_claim`), and `become_owner` \
             (`crates/provisioner/src/controller.rs`) polls that cache during its wait (every base/100) and once at \
             the end: a loser that has not seen the winner's annotation before the claim is Bound never sees it, \
             finds no `selected-node` when its wait ends, and writes its own with the claim's current \
             resourceVersion, which passes the precondition. Upstream polls an informer that keeps every \
             annotation, so there the loser sees the winner's and stops (the spec's §B.4: \"losers see the \
             annotation in their cache\"). No second volume is made (the claim is Bound; the rewriting node's next \
             sync does nothing), but the annotation no longer names the volume's node.\n",
            examples
                .iter()
                .map(|e| format!("`{e}`"))
                .collect::<Vec<_>>()
                .join("; "),
        ));
    }
    let others: String = {
        let retries: usize = runs.iter().map(|r| r.retries).sum();
        let owners: usize = runs.iter().map(|r| r.owners).sum();
        let failed: usize = runs.iter().map(|r| r.failed_events).sum();
        let foreign: usize = runs.iter().map(|r| r.foreign_deletes).sum();
        let drawn_all = runs.iter().all(|r| r.drawn_claims == CLAIMS);
        format!(
            "Over all runs: {owners} \"became the owner of the claim\" lines for {} claims, {retries} second-attempt \
             waits (after a lost Update), {failed} ProvisioningFailed events before the deletion, {foreign} \
             DeleteVolume calls on a node for a volume it does not have; the drawn waits were logged for {} claim.",
            n * CLAIMS,
            if drawn_all { "every" } else { "not every" },
        )
    };
    let loads: Vec<&str> = runs.iter().map(|r| r.load.as_str()).collect();
    let block = format!(
        "{START}\n## csi-provisioner: node deployment, Immediate claims raced by 10 nodes (issue 31)\n\n\
         {date}, commit {commit}, `{command}`; this machine: 2 CPUs (shared), load average {load_start} at the \
         start, {load_end} at the end (at each run's start: {loads}). Real kube-apiserver and kube-controller-manager \
         v1.36.2, one for all runs (KCM's own client limit raised to 1000 QPS so that its binding is not what is \
         measured); each run has its own namespace, driver name and Immediate StorageClass, and {NODES} fake nodes, \
         each its own in-process test driver (its node ID, topology segment `{KEY}=node-i`, 1 TiB pool, data \
         directory) and its own release `csi-provisioner` process with `NODE_NAME=node-i --node-deployment \
         --feature-gates=Topology=true --strict-topology --immediate-topology=false \
         --node-deployment-base-delay=B --node-deployment-max-delay=3B` and upstream's defaults otherwise (100 \
         workers{limits}). {CLAIMS} claims of 1Gi created at once \
         (32 at a time); the makespan runs from the first create until the API server says all {CLAIMS} are \
         Bound. \"Last claim taken\" is when the bench's watch saw the last `selected-node` annotation; \"least \
         wait drawn\" is, from the provisioners' own debug lines, the max over the claims of the shortest first \
         wait any node drew for it; a lost Update is a node's annotation write (sent through that node's own \
         client limit) refused with 409 because another node's write had changed the claim first; claims per node \
         are the fewest and most claims one node won. No Go external-provisioner ran beside: none is reachable \
         here.\n\n\
         Upstream's formula: before its attempt n to take a claim a node waits `max(0, min(base·2^n, max) − \
         U·base)`, U uniform in [0, 1): (0, base] on the first attempt. With 100 workers per node every claim waits \
         at once, so the last claim is taken after the max over the {CLAIMS} claims of the min over the {NODES} \
         nodes' waits, whose CDF is `(1 − (1 − t/base)^{NODES})^{CLAIMS}`: its expectation is {e:.4}·base \
         ({e20:.2} s at upstream's default 20 s; a simulation of 20,000 races gives {sim:.4}·base), 5%–95% \
         {q05:.3}–{q95:.3}·base; the expected makespan is that plus \
         the provisioning after it.\n\n{by_base}\n{t}\n{verdict}\n{others}\n{END}",
        date = date(),
        commit = commit(),
        loads = loads.join("; "),
        command = std::env::var("PLUGREG_PROVISIONER_BIN")
            .ok()
            .map(|b| format!("PLUGREG_PROVISIONER_BIN={b}"))
            .into_iter()
            .chain(std::iter::once(COMMAND.to_owned()))
            .chain(std::env::args().skip(1).filter(|x| x != "--bench"))
            .collect::<Vec<_>>()
            .join(" "),
        limits = a.qps.map_or_else(
            || ", `--kube-api-qps 5 --kube-api-burst 10`; no limit raised".to_owned(),
            |q| format!("; client limit raised: `--kube-api-qps {q} --kube-api-burst {q}`")
        ),
        e20 = e * 20.0,
    );
    println!("{block}");
    if let Some(out) = a.out {
        write_block(&out, START, END, &block);
    }
}
