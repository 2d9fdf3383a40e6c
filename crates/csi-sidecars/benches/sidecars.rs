//! `csi-sidecars` beside the four separate plugreg sidecars, in the same run (issue 29):
//!
//! ```sh
//! cargo bench -p plugreg-csi-sidecars --bench sidecars -- --quick             # 100 claims
//! cargo bench -p plugreg-csi-sidecars --bench sidecars -- --out BENCHMARKS.md  # 1,000 claims
//! ```
//!
//! The two sides run at the same time, so that both see the same machine load; each gets a
//! fresh real kube-apiserver v1.36.2 with kube-controller-manager v1.36.2 (its
//! PV controller binds; `--kube-api-qps 1000 --kube-api-burst 1000`, so that it is not what is
//! measured), the snapshot CRDs and the real Go snapshot-controller v8.6.0 (likewise), and the
//! test CSI driver in-process (answers at once; create, publish, expand, snapshots). Then either
//! `csi-provisioner`, `csi-attacher`, `csi-resizer` and `csi-snapshotter` as four
//! processes, or `csi-sidecars --controllers=provisioner,attacher,resizer,snapshotter` as one;
//! every controller at its upstream defaults (`--kube-api-qps 5 --kube-api-burst 10`, its
//! worker counts) with `--leader-election`.
//!
//! N claims go through their whole life, one phase after the other, each timed from its first
//! write to the last object done (seen by a watch of the bench's own): provisioned (all Bound),
//! attached (N VolumeAttachments, all attached), expanded (all claims to 2Gi, every PV 2Gi),
//! snapshotted (N VolumeSnapshots, all ready), deleted (snapshots, attachments and claims at
//! once; no PV, VolumeAttachment or content left). Reported: each phase's makespan on each
//! side; the peak RSS of `csi-sidecars` (VmHWM or the highest sample, whichever is higher; with
//! the highest sample's anonymous and file-backed parts and phase) against the four processes'
//! (the sum of their VmHWM, and the highest sum sampled every 100 ms); the watches the API
//! server holds open for
//! the sidecars (`apiserver_longrunning_requests`, WATCH, with the peers' subtracted) by
//! resource; the sidecars' API requests by verb. All five binaries are the images' builds: the
//! `sidecar` profile (release with panics that abort, `images/images.conf`), built from this
//! checkout first into `target/sidecar`; `PLUGREG_<NAME>_BIN` (`PLUGREG_PROVISIONER_BIN`,
//! `PLUGREG_SIDECARS_BIN`, ...) picks others.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::Peers;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::{StorageClass, VolumeAttachment};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, watcher};
use plugreg_csi_test_driver::{DriverConfig, MountMode};
use plugreg_sidecar_kit::snapshot::{VolumeSnapshot, VolumeSnapshotClass, VolumeSnapshotContent};
use plugreg_testpeers::bench::{
    BenchArgs, commit, create_all, date, free_port, goals_table, load, requests, write_block,
};
use plugreg_testpeers::sidecar::{self, LoggedSidecar, create_object};
use serde_json::json;

const START: &str = "<!-- bench:csi-sidecars:start -->";
const END: &str = "<!-- bench:csi-sidecars:end -->";
const DRIVER: &str = "bench.csi.plugreg.test";
const NODE: &str = "bench-node";
const NS: &str = "bench";
/// How long a phase may take before the run is called stuck.
const PHASE_LIMIT: Duration = Duration::from_secs(3600);

/// The phases of a claim's life, in order.
const PHASES: [&str; 5] = [
    "provisioned",
    "attached",
    "expanded",
    "snapshotted",
    "deleted",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Separate,
    Combined,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Separate => "four sidecars",
            Side::Combined => "csi-sidecars",
        }
    }
}

/// The highest sum of a side's RSS sampled: anonymous and file-backed, and the phase.
#[derive(Debug, Default, Clone, Copy)]
struct Peak {
    sum_kib: u64,
    anon_kib: u64,
    file_kib: u64,
    /// An index of [`PHASES`].
    phase: usize,
}

impl Peak {
    /// "N MiB (A MiB anonymous, F MiB file-backed, in the P phase)".
    fn describe(&self) -> String {
        format!(
            "{:.1} MiB ({:.1} MiB anonymous, {:.1} MiB file-backed, in the {} phase)",
            mib(self.sum_kib),
            mib(self.anon_kib),
            mib(self.file_kib),
            PHASES.get(self.phase).copied().unwrap_or("stopping"),
        )
    }
}

struct Run {
    makespans: Vec<Duration>,
    /// VmHWM of each process, KiB.
    hwm_kib: Vec<u64>,
    /// The highest sum of the processes' RSS sampled (and its split and phase).
    peak: Peak,
    /// The sum of the processes' RSS once the caches are filled, KiB.
    idle_kib: u64,
    /// Watches the API server held open for the sidecars, by resource.
    watches: BTreeMap<String, u64>,
    /// The sidecars' requests by `verb resource`.
    requests: BTreeMap<String, u64>,
    load: String,
}

/// The variable that names another build of sidecar `name`: `PLUGREG_<NAME>_BIN`.
fn variable(name: &str) -> String {
    format!(
        "PLUGREG_{}_BIN",
        name.trim_start_matches("csi-")
            .to_uppercase()
            .replace('-', "_")
    )
}

/// The profile the images build the controller sidecars with (`images/images.conf`).
const SHIPPED_PROFILE: &str = "sidecar";

/// Where cargo puts the [`SHIPPED_PROFILE`]'s binaries: beside this bench's profile directory.
fn shipped_dir() -> PathBuf {
    let profile_dir = common::binaries();
    profile_dir
        .parent()
        .expect("target/<profile>")
        .join(SHIPPED_PROFILE)
}

/// A sidecar binary: `PLUGREG_<NAME>_BIN`, or the images' build of this checkout.
fn binary(name: &str) -> PathBuf {
    match std::env::var(variable(name)) {
        Ok(p) => PathBuf::from(p),
        Err(_) => shipped_dir().join(name),
    }
}

/// Which binaries ran, for the report.
fn binaries_note() -> String {
    let named: Vec<String> = SIDECARS
        .iter()
        .filter(|n| std::env::var_os(variable(n)).is_some())
        .map(|n| format!("`{}`", variable(n)))
        .collect();
    if named.is_empty() {
        format!("all five binaries built with the `{SHIPPED_PROFILE}` profile, as the images")
    } else {
        format!(
            "binaries named by {} (the others built with the `{SHIPPED_PROFILE}` profile)",
            named.join(", ")
        )
    }
}

/// The five binaries this bench runs.
const SIDECARS: [&str; 5] = [
    "csi-provisioner",
    "csi-attacher",
    "csi-resizer",
    "csi-snapshotter",
    "csi-sidecars",
];

/// Builds the five binaries with the images' profile from this checkout (cargo's no-op when
/// they are up to date), unless `PLUGREG_<NAME>_BIN` names every one.
fn ensure_binaries() {
    if SIDECARS
        .iter()
        .all(|n| std::env::var_os(variable(n)).is_some())
    {
        return;
    }
    println!("building the sidecars (profile {SHIPPED_PROFILE}, as the images)...");
    let mut cargo = std::process::Command::new(env!("CARGO"));
    cargo.args(["build", "--locked", "--bins", "--profile", SHIPPED_PROFILE]);
    for n in SIDECARS {
        cargo.args(["-p", &format!("plugreg-{n}")]);
    }
    let status = cargo
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("cargo");
    assert!(status.success(), "building the sidecars");
}

/// Ends a phase that started at `t`: its makespan recorded, the next phase's index (the
/// number of phases done) shown to the sampler.
fn phase_done(makespans: &mut Vec<Duration>, phase: &AtomicUsize, t: Instant) {
    makespans.push(t.elapsed());
    phase.store(makespans.len(), Ordering::Relaxed);
}

/// Watches the API server holds open, by resource (`apiserver_longrunning_requests`).
async fn open_watches(client: &kube::Client) -> BTreeMap<String, u64> {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .expect("request");
    let text = client.request_text(req).await.unwrap_or_default();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_longrunning_requests{") else {
            continue;
        };
        if !rest.contains("verb=\"WATCH\"") {
            continue;
        }
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let resource = labels
            .split(',')
            .find_map(|kv| kv.strip_prefix("resource=\""))
            .map(|v| v.trim_end_matches('"').to_owned())
            .unwrap_or_default();
        let n = value.trim().parse::<f64>().unwrap_or(0.0) as u64;
        *out.entry(resource).or_default() += n;
    }
    out
}

/// `after - before` per key, without the ones that did not grow.
fn grown(after: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v.saturating_sub(before.get(k).copied().unwrap_or(0));
            (d > 0).then(|| (k.clone(), d))
        })
        .collect()
}

/// Watches `K` and resolves once `n` objects have satisfied `done` (each counted once).
fn count_done<K>(
    client: &kube::Client,
    n: usize,
    done: impl Fn(&K) -> Option<String> + Send + 'static,
) -> tokio::task::JoinHandle<HashMap<String, String>>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let api: Api<K> = Api::all(client.clone());
    tokio::spawn(async move {
        let mut seen = HashMap::new();
        let mut s = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
        while let Some(ev) = s.next().await {
            if let Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) = ev {
                let name = o.meta().name.clone().unwrap_or_default();
                if let Some(v) = done(&o) {
                    seen.insert(name, v);
                    if seen.len() >= n {
                        break;
                    }
                }
            }
        }
        seen
    })
}

/// Polls until no object of `K` is left.
async fn until_none<K>(client: &kube::Client)
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let api: Api<K> = Api::all(client.clone());
    let deadline = Instant::now() + PHASE_LIMIT;
    loop {
        let left = api
            .list_metadata(&ListParams::default().limit(1))
            .await
            .map(|l| l.items.len())
            .unwrap_or(1);
        if left == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "objects left at the end");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `bin` with `args`, its output in `log` (killed when dropped).
fn spawn(bin: &Path, args: &[String], log: &Path) -> LoggedSidecar {
    let mut cmd = sidecar::command(&bin.to_string_lossy());
    cmd.args(args);
    LoggedSidecar::spawn(cmd, log.to_owned())
}

fn status_kib(pid: u32, field: &str) -> u64 {
    plugreg_runtime::procfs::status_kib(&pid.to_string(), field).unwrap_or(0)
}

async fn run(side: Side, n: usize) -> Run {
    let load_start = load();
    let peers = Peers::start(
        // Raised so that they are not what is measured.
        &["--kube-api-qps=1000", "--kube-api-burst=1000"],
        Some(&[
            "--kube-api-qps=1000",
            "--kube-api-burst=2000",
            "--worker-threads=50",
        ]),
        NS,
        DRIVER,
        NODE,
    )
    .await;
    let (api, client) = (&peers.api, peers.client.clone());
    create_object::<StorageClass>(
        &client,
        json!({"metadata": {"name": "bench"}, "provisioner": DRIVER, "allowVolumeExpansion": true}),
    )
    .await;
    create_object::<VolumeSnapshotClass>(
        &client,
        json!({"metadata": {"name": "bench"}, "driver": DRIVER, "deletionPolicy": "Delete"}),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let _driver = plugreg_csi_test_driver::start(
        DriverConfig {
            name: DRIVER.into(),
            node_id: NODE.into(),
            controller: true,
            controller_publish: true,
            controller_expand: true,
            snapshots: true,
            max_capacity: 1 << 50,
            data_dir: Some(dir.path().join("volumes")),
            mount: MountMode::Directory,
            ..DriverConfig::default()
        },
        &socket,
    )
    .await
    .unwrap();

    // The peers' own watches, before any sidecar.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let peers_watches = open_watches(&client).await;

    let common = |port: u16| {
        vec![
            format!("--csi-address={}", socket.display()),
            format!("--kubeconfig={}", api.kubeconfig_path().display()),
            "--leader-election".to_owned(),
            format!("--leader-election-namespace={NS}"),
            format!("--http-endpoint=127.0.0.1:{port}"),
        ]
    };
    let mut children = Vec::new();
    let mut ports = Vec::new();
    match side {
        Side::Separate => {
            for name in [
                "csi-provisioner",
                "csi-attacher",
                "csi-resizer",
                "csi-snapshotter",
            ] {
                let port = free_port();
                let log = dir.path().join(format!("{name}.log"));
                children.push(spawn(&binary(name), &common(port), &log));
                ports.push(port);
            }
        }
        Side::Combined => {
            let port = free_port();
            let mut args = common(port);
            args.push("--controllers=provisioner,attacher,resizer,snapshotter".to_owned());
            let log = dir.path().join("csi-sidecars.log");
            children.push(spawn(&binary("csi-sidecars"), &args, &log));
            ports.push(port);
        }
    }
    let pids: Vec<u32> = children.iter().map(|c| c.child.id()).collect();

    // Idle: every controller leads (four Leases held), its caches filled.
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), NS);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let held = leases
            .list(&ListParams::default())
            .await
            .map(|l| {
                l.items
                    .iter()
                    .filter(|l| {
                        l.spec
                            .as_ref()
                            .and_then(|s| s.holder_identity.as_deref())
                            .is_some_and(|h| !h.is_empty())
                    })
                    .count()
            })
            .unwrap_or(0);
        if held >= 4 {
            break;
        }
        assert!(Instant::now() < deadline, "the sidecars never led");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_kib: u64 = pids.iter().map(|p| status_kib(*p, "VmRSS")).sum();
    let watches = grown(&open_watches(&client).await, &peers_watches);

    let stop = Arc::new(AtomicBool::new(false));
    // The phase running (an index of PHASES), for the sampler.
    let phase = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (stop, pids, phase) = (stop.clone(), pids.clone(), phase.clone());
        std::thread::spawn(move || {
            let mut peak = Peak::default();
            while !stop.load(Ordering::Relaxed) {
                let sum = |field| pids.iter().map(|p| status_kib(*p, field)).sum::<u64>();
                let rss = sum("VmRSS");
                if rss > peak.sum_kib {
                    peak = Peak {
                        sum_kib: rss,
                        anon_kib: sum("RssAnon"),
                        file_kib: sum("RssFile"),
                        phase: phase.load(Ordering::Relaxed),
                    };
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            peak
        })
    };

    let mut makespans = Vec::new();
    // Provisioned.
    let claims_api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let bound = count_done::<PersistentVolumeClaim>(&client, n, |c| {
        let s = c.status.as_ref()?;
        (s.phase.as_deref() == Some("Bound")).then(|| c.spec.as_ref()?.volume_name.clone())?
    });
    let t = Instant::now();
    create_all(n, |i| {
        let client = client.clone();
        async move {
            create_object::<PersistentVolumeClaim>(
                &client,
                json!({"metadata": {"name": format!("c-{i}"), "namespace": NS},
                       "spec": {"storageClassName": "bench", "accessModes": ["ReadWriteOnce"],
                                "resources": {"requests": {"storage": "1Gi"}}}}),
            )
            .await;
        }
    })
    .await;
    let volumes = tokio::time::timeout(PHASE_LIMIT, bound)
        .await
        .expect("all claims Bound in time")
        .unwrap();
    phase_done(&mut makespans, &phase, t);
    println!("{}: {n} claims Bound in {:?}", side.label(), t.elapsed());

    // Attached.
    let attached = count_done::<VolumeAttachment>(&client, n, |va| {
        va.status
            .as_ref()
            .is_some_and(|s| s.attached)
            .then(String::new)
    });
    let t = Instant::now();
    create_all(n, |i| {
        let client = client.clone();
        let pv = volumes[&format!("c-{i}")].clone();
        async move {
            create_object::<VolumeAttachment>(
                &client,
                json!({"metadata": {"name": format!("va-{i}")},
                       "spec": {"attacher": DRIVER, "nodeName": NODE,
                                "source": {"persistentVolumeName": pv}}}),
            )
            .await;
        }
    })
    .await;
    tokio::time::timeout(PHASE_LIMIT, attached)
        .await
        .expect("all attached in time")
        .unwrap();
    phase_done(&mut makespans, &phase, t);
    println!("{}: {n} attached in {:?}", side.label(), t.elapsed());

    // Expanded.
    let expanded = count_done::<PersistentVolume>(&client, n, |pv| {
        let size = &pv.spec.as_ref()?.capacity.as_ref()?.get("storage")?.0;
        (size == "2Gi").then(String::new)
    });
    let t = Instant::now();
    create_all(n, |i| {
        let claims = claims_api.clone();
        async move {
            claims
                .patch(
                    &format!("c-{i}"),
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"resources": {"requests": {"storage": "2Gi"}}}})),
                )
                .await
                .unwrap();
        }
    })
    .await;
    tokio::time::timeout(PHASE_LIMIT, expanded)
        .await
        .expect("all expanded in time")
        .unwrap();
    phase_done(&mut makespans, &phase, t);
    println!("{}: {n} expanded in {:?}", side.label(), t.elapsed());

    // Snapshotted.
    let ready = count_done::<VolumeSnapshot>(&client, n, |s| {
        (s.status.as_ref()?.ready_to_use == Some(true)).then(String::new)
    });
    let t = Instant::now();
    create_all(n, |i| {
        let client = client.clone();
        async move {
            create_object::<VolumeSnapshot>(
                &client,
                json!({"metadata": {"name": format!("s-{i}"), "namespace": NS},
                       "spec": {"source": {"persistentVolumeClaimName": format!("c-{i}")},
                                "volumeSnapshotClassName": "bench"}}),
            )
            .await;
        }
    })
    .await;
    tokio::time::timeout(PHASE_LIMIT, ready)
        .await
        .expect("all snapshots ready in time")
        .unwrap();
    phase_done(&mut makespans, &phase, t);
    println!("{}: {n} snapshots ready in {:?}", side.label(), t.elapsed());

    // Deleted.
    let t = Instant::now();
    let snaps: Api<VolumeSnapshot> = Api::namespaced(client.clone(), NS);
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    create_all(n, |i| {
        let (snaps, vas, claims) = (snaps.clone(), vas.clone(), claims_api.clone());
        async move {
            let dp = DeleteParams::default();
            let _ = snaps.delete(&format!("s-{i}"), &dp).await;
            let _ = vas.delete(&format!("va-{i}"), &dp).await;
            let _ = claims.delete(&format!("c-{i}"), &dp).await;
        }
    })
    .await;
    until_none::<VolumeAttachment>(&client).await;
    until_none::<VolumeSnapshotContent>(&client).await;
    until_none::<PersistentVolume>(&client).await;
    phase_done(&mut makespans, &phase, t);
    println!("{}: everything deleted in {:?}", side.label(), t.elapsed());

    stop.store(true, Ordering::Relaxed);
    let peak = sampler.join().unwrap_or_default();
    let hwm_kib = pids.iter().map(|p| status_kib(*p, "VmHWM")).collect();
    let mut all_requests = BTreeMap::new();
    for port in &ports {
        for (k, v) in requests(*port) {
            *all_requests.entry(k).or_default() += v;
        }
    }
    let alive = children.iter_mut().all(LoggedSidecar::running);
    if !alive {
        for c in &children {
            println!("--- {}\n{}", c.log.display(), c.log());
        }
        panic!("a sidecar exited during the run");
    }
    // Killed as they are dropped.
    drop(children);
    Run {
        makespans,
        hwm_kib,
        peak,
        idle_kib,
        watches,
        requests: all_requests,
        load: format!("{load_start} -> {}", load()),
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// `built`: the commit the binaries were built from (read before the run: the checkout may
/// move on during an hour's run).
fn report(n: usize, built: &str, separate: &Run, combined: &Run) -> String {
    let mut out = format!(
        "{START}\n### csi-sidecars beside the four separate sidecars ({} {}, {n} claims)\n\n\
         `cargo bench -p plugreg-csi-sidecars --bench sidecars{}`. The two sides run at the same time, each on a fresh kube-apiserver and \
         kube-controller-manager v1.36.2 and the Go snapshot-controller v8.6.0 (all raised to QPS 1000), the test \
         driver in-process; every controller at its upstream defaults (QPS 5, burst 10) with `--leader-election`; {}. \
         Load {} (at the start and end of the four sidecars' run) and {} (csi-sidecars'), 2 cores shared by both sides and their peers.\n\n\
         | phase | four sidecars | csi-sidecars | ratio |\n|---|---|---|---|\n",
        date(),
        built,
        if n == 100 { " -- --quick" } else { "" },
        binaries_note(),
        separate.load,
        combined.load,
    );
    for (i, phase) in PHASES.iter().enumerate() {
        let (a, b) = (separate.makespans[i], combined.makespans[i]);
        out.push_str(&format!(
            "| {n} {phase} | {:.1} s | {:.1} s | {:.2}x |\n",
            a.as_secs_f64(),
            b.as_secs_f64(),
            b.as_secs_f64() / a.as_secs_f64()
        ));
    }
    let sep_hwm: u64 = separate.hwm_kib.iter().sum();
    let comb_hwm: u64 = combined.hwm_kib.iter().sum();
    // The kernel raises VmHWM to the current RSS only at some events (an unmap, the exit), so
    // a sample can be higher: the peak is the higher of the two.
    let comb_peak = comb_hwm.max(combined.peak.sum_kib);
    out.push_str(&format!(
        "\nMemory: csi-sidecars peak RSS **{:.1} MiB** (the higher of VmHWM, {:.1} MiB, and the highest sampled every 100 ms, {}), idle {:.1} MiB. \
         The four sidecars: VmHWM {} (sum {:.1} MiB), the highest sum sampled {}, idle {:.1} MiB together.\n\n",
        mib(comb_peak),
        mib(comb_hwm),
        combined.peak.describe(),
        mib(combined.idle_kib),
        separate
            .hwm_kib
            .iter()
            .map(|k| format!("{:.1}", mib(*k)))
            .collect::<Vec<_>>()
            .join(" + "),
        mib(sep_hwm),
        separate.peak.describe(),
        mib(separate.idle_kib),
    ));
    let resources: HashSet<&String> = separate
        .watches
        .keys()
        .chain(combined.watches.keys())
        .collect();
    let mut resources: Vec<&String> = resources.into_iter().collect();
    resources.sort();
    out.push_str("Watches open at the API server for the sidecars (peers' subtracted):\n\n| resource | four sidecars | csi-sidecars |\n|---|---|---|\n");
    for r in &resources {
        out.push_str(&format!(
            "| {r} | {} | {} |\n",
            separate.watches.get(*r).copied().unwrap_or(0),
            combined.watches.get(*r).copied().unwrap_or(0)
        ));
    }
    let total = |w: &BTreeMap<String, u64>| w.values().sum::<u64>();
    out.push_str(&format!(
        "| all | {} | {} |\n\n",
        total(&separate.watches),
        total(&combined.watches)
    ));
    let writes = |r: &BTreeMap<String, u64>| plugreg_testpeers::bench::writes(r);
    out.push_str(&format!(
        "API writes of the whole life: four sidecars {}, csi-sidecars {}.\n\n",
        writes(&separate.requests),
        writes(&combined.requests)
    ));
    let within = |i: usize| {
        combined.makespans[i].as_secs_f64() <= separate.makespans[i].as_secs_f64() * 1.05
    };
    let rows = vec![
        (
            "csi-sidecars peak RSS under 24 MiB".to_owned(),
            format!("{:.1} MiB", mib(comb_peak)),
            mib(comb_peak) < 24.0,
        ),
        (
            "at most half the four sidecars' (sum of VmHWM)".to_owned(),
            format!("{:.1} of {:.1} MiB", mib(comb_peak), mib(sep_hwm)),
            comb_peak * 2 <= sep_hwm,
        ),
        (
            "every phase within 1.05x of the separate sidecars".to_owned(),
            PHASES
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    format!(
                        "{p} {:.2}x",
                        combined.makespans[i].as_secs_f64() / separate.makespans[i].as_secs_f64()
                    )
                })
                .collect::<Vec<_>>()
                .join(", "),
            (0..PHASES.len()).all(within),
        ),
        (
            "one WATCH per resource kind".to_owned(),
            format!(
                "{} watches over {} kinds",
                total(&combined.watches),
                combined.watches.len()
            ),
            combined.watches.values().all(|v| *v <= 1),
        ),
    ];
    out.push_str(&goals_table(&rows));
    out.push_str(&format!("{END}\n"));
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = BenchArgs::parse(1000);
    let built = commit();
    ensure_binaries();
    // Both sides at once, each on peers of its own: the same machine load for both.
    let (separate, combined) =
        tokio::join!(run(Side::Separate, args.n), run(Side::Combined, args.n));
    let block = report(args.n, &built, &separate, &combined);
    println!("{block}");
    println!("requests, four sidecars: {:?}", separate.requests);
    println!("requests, csi-sidecars: {:?}", combined.requests);
    if let Some(out) = &args.out {
        write_block(out, START, END, &block);
    }
}
