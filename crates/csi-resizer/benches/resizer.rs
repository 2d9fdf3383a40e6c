//! csi-resizer benchmark (issue 20):
//!
//! ```sh
//! cargo bench -p plugreg-csi-resizer --bench resizer -- --out BENCHMARKS.md
//! cargo bench -p plugreg-csi-resizer --bench resizer -- --quick    # 100 claims
//! ```
//!
//! A fresh real kube-apiserver v1.36.2 and kube-controller-manager v1.36.2 (its PV controller
//! binds; its own client limit raised so that binding is not what is measured), the test CSI
//! driver in-process (ControllerExpandVolume answers at once, no node expansion), and the release
//! `csi-resizer` as a process with upstream's defaults (`--kube-api-qps 5`, `--kube-api-burst 10`,
//! `--workers 10`) and `--leader-election`. N claims of 1Gi are bound to N pre-provisioned PVs
//! first; once the resizer's caches are filled, every claim's request is raised to 2Gi at once
//! (by the bench's own, unlimited client), and the run ends when the API server says every claim
//! has `status.capacity` 2Gi. Reported: the makespan, the resizer's API writes per expansion (its
//! own `plugreg_kube_requests_total` counter, by verb and resource, until the counters settle)
//! against upstream's count, the makespan against the write floor (writes / QPS), and the
//! resizer's peak RSS (VmHWM). `PLUGREG_RESIZER_BIN` measures another build.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use plugreg_csi_test_driver::{DriverConfig, MountMode};
use plugreg_testpeers::bench::{free_port, requests};
use plugreg_testpeers::{ApiServer, ControllerManager, KubeVersion};
use serde_json::json;

const START: &str = "<!-- bench:csi-resizer:start -->";
const END: &str = "<!-- bench:csi-resizer:end -->";
const DRIVER: &str = "bench.resizer.plugreg.test";
const NS: &str = "bench";
/// Upstream's API writes for one controller-only expansion (external-resizer v2.2.1 with
/// RecoverVolumeExpansionFailure): the claim's status marked as resizing, the PV's capacity,
/// the claim's status finished; plus two events (Resizing, VolumeResizeSuccessful), which go
/// through the same client and its rate limit.
const UPSTREAM_WRITES: u64 = 3;
const UPSTREAM_EVENTS: u64 = 2;
const QPS: f64 = 5.0;
const BURST: f64 = 10.0;
/// The RSS goal of issue 20.
const RSS_GOAL_MIB: f64 = 16.0;

struct Args {
    out: Option<String>,
    claims: usize,
}

fn args() -> Args {
    let mut a = Args {
        out: None,
        claims: 1000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--out" => a.out = it.next(),
            "--claims" => a.claims = it.next().and_then(|v| v.parse().ok()).unwrap_or(a.claims),
            "--quick" => a.claims = 100,
            _ => {} // cargo bench passes --bench
        }
    }
    a
}

fn bin() -> String {
    std::env::var("PLUGREG_RESIZER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_csi-resizer").to_owned())
}

fn is_write(key: &str) -> bool {
    !(key.starts_with("GET ") || key.starts_with("LIST ") || key.starts_with("WATCH "))
}

fn capacity(c: &PersistentVolumeClaim) -> Option<&str> {
    Some(
        c.status
            .as_ref()?
            .capacity
            .as_ref()?
            .get("storage")?
            .0
            .as_str(),
    )
}

struct Run {
    claims: usize,
    makespan: Duration,
    settled: Duration,
    requests: BTreeMap<String, u64>,
    writes_at_done: u64,
    hwm_kib: u64,
    /// VmHWM once the caches were filled, before the first expansion.
    rss_ready_kib: u64,
    /// `RssAnon` and `RssFile` when the caches were filled and at the end.
    split_ready: (u64, u64),
    split_end: (u64, u64),
    lease_lost: bool,
}

async fn run(claims: usize) -> Run {
    let api = ApiServer::start_version(KubeVersion::V1_36_2)
        .await
        .expect("kube-apiserver v1.36.2");
    let kcm = ControllerManager::start_volume_controllers(
        &api,
        &["--kube-api-qps=1000", "--kube-api-burst=1000"],
    )
    .await
    .expect("kube-controller-manager");
    let client = api.client().await.unwrap();
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap(),
        )
        .await
        .unwrap();
    Api::<StorageClass>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "bench"},
                "provisioner": DRIVER,
                "allowVolumeExpansion": true,
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let driver = plugreg_csi_test_driver::start(
        DriverConfig {
            name: DRIVER.into(),
            controller: true,
            controller_expand: true,
            volumes: (0..claims).map(|i| format!("vol-{i}")).collect(),
            data_dir: Some(dir.path().join("volumes")),
            mount: MountMode::Directory,
            ..DriverConfig::default()
        },
        &socket,
    )
    .await
    .unwrap();
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    futures::stream::iter(0..claims)
        .map(|i| {
            let (pvs, pvcs) = (pvs.clone(), pvcs.clone());
            async move {
                let pv = json!({
                    "metadata": {"name": format!("pv-{i}")},
                    "spec": {
                        "capacity": {"storage": "1Gi"},
                        "accessModes": ["ReadWriteOnce"],
                        "persistentVolumeReclaimPolicy": "Retain",
                        "storageClassName": "bench",
                        "claimRef": {"namespace": NS, "name": format!("claim-{i}")},
                        "csi": {"driver": DRIVER, "volumeHandle": format!("vol-{i}")},
                    }
                });
                pvs.create(&PostParams::default(), &serde_json::from_value(pv).unwrap())
                    .await
                    .unwrap();
                let pvc = json!({
                    "metadata": {"name": format!("claim-{i}")},
                    "spec": {
                        "storageClassName": "bench",
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "1Gi"}},
                        "volumeName": format!("pv-{i}"),
                    }
                });
                pvcs.create(
                    &PostParams::default(),
                    &serde_json::from_value(pvc).unwrap(),
                )
                .await
                .unwrap();
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
    let count = |want: &'static str| {
        let pvcs = pvcs.clone();
        async move {
            pvcs.list(&ListParams::default())
                .await
                .map(|l| l.items.iter().filter(|c| capacity(c) == Some(want)).count())
                .unwrap_or(0)
        }
    };
    let deadline = Instant::now() + Duration::from_secs(600);
    while count("1Gi").await < claims {
        assert!(Instant::now() < deadline, "claims not bound");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("{claims} claims bound; starting csi-resizer");

    let port = free_port();
    let log = std::fs::File::create(dir.path().join("resizer.log")).unwrap();
    let mut child = Command::new(bin())
        .arg(format!("--csi-address={}", socket.display()))
        .arg(format!("--kubeconfig={}", api.kubeconfig_path().display()))
        .arg(format!("--http-endpoint=127.0.0.1:{port}"))
        .arg("--leader-election")
        .arg(format!("--leader-election-namespace={NS}"))
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let pid = child.id();
    // The caches are filled once every watch has started.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let r = requests(port);
        let watching = ["persistentvolumeclaims", "persistentvolumes", "pods"]
            .iter()
            .all(|res| r.contains_key(&format!("WATCH {res}")));
        if watching {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "csi-resizer did not start its watches"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rss_ready_kib =
        plugreg_runtime::procfs::status_kib(&pid.to_string(), "VmHWM:").unwrap_or(0);
    let split = || {
        let get = |f| plugreg_runtime::procfs::status_kib(&pid.to_string(), f).unwrap_or(0);
        (get("RssAnon:"), get("RssFile:"))
    };
    let split_ready = split();
    let before = requests(port);
    let start = Instant::now();
    futures::stream::iter(0..claims)
        .map(|i| {
            let pvcs = pvcs.clone();
            async move {
                pvcs.patch(
                    &format!("claim-{i}"),
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"resources": {"requests": {"storage": "2Gi"}}}})),
                )
                .await
                .unwrap();
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
    let deadline = start + Duration::from_secs(3600);
    loop {
        if count("2Gi").await >= claims {
            break;
        }
        assert!(Instant::now() < deadline, "claims not expanded");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let makespan = start.elapsed();
    let at_done = requests(port);
    let writes_at_done: u64 = at_done
        .iter()
        .filter(|(k, _)| is_write(k))
        .map(|(k, v)| v.saturating_sub(before.get(k).copied().unwrap_or(0)))
        .sum();
    eprintln!("{claims} claims expanded in {makespan:?}; waiting for the events to drain");
    let mut last = at_done;
    loop {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let now = requests(port);
        if now == last {
            break;
        }
        last = now;
    }
    let settled = start.elapsed();
    let mut diff = BTreeMap::new();
    for (k, v) in last {
        let n = v.saturating_sub(before.get(&k).copied().unwrap_or(0));
        if n > 0 {
            diff.insert(k, n);
        }
    }
    let hwm_kib = plugreg_runtime::procfs::status_kib(&pid.to_string(), "VmHWM:").unwrap_or(0);
    let split_end = split();
    let exited = !matches!(child.try_wait(), Ok(None));
    let text = std::fs::read_to_string(dir.path().join("resizer.log")).unwrap_or_default();
    let lease_lost = exited || text.contains("Stopped leading");
    let _ = child.kill();
    let _ = child.wait();
    drop(driver);
    drop(kcm);
    Run {
        claims,
        makespan,
        settled,
        requests: diff,
        writes_at_done,
        hwm_kib,
        rss_ready_kib,
        split_ready,
        split_end,
        lease_lost,
    }
}

fn report(r: &Run) -> String {
    let n = r.claims as f64;
    let writes: u64 = r
        .requests
        .iter()
        .filter(|(k, _)| is_write(k))
        .map(|(_, v)| v)
        .sum();
    let events: u64 = r
        .requests
        .iter()
        .filter(|(k, _)| is_write(k) && k.ends_with(" events"))
        .map(|(_, v)| v)
        .sum();
    let object_writes = writes - events;
    let floor = |w: f64| ((w - BURST) / QPS).max(0.0);
    let object_floor = floor(object_writes as f64);
    let all_floor = floor(writes as f64);
    let upstream_floor = floor((UPSTREAM_WRITES + UPSTREAM_EVENTS) as f64 * n);
    let rss_mib = r.hwm_kib as f64 / 1024.0;
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    let mut t = format!(
        "{START}\n## csi-resizer: claims expanded at once (issue 20)\n\n\
         Commit {commit}, load average {} at the end. Real kube-apiserver and kube-controller-manager v1.36.2 \
         (fresh; KCM's client limit raised so that binding is not what is measured), the test CSI driver in-process \
         (ControllerExpandVolume answers at once, no node expansion), the release `csi-resizer` with upstream's defaults \
         (`--kube-api-qps 5`, `--kube-api-burst 10`, `--workers 10`) and `--leader-election`. {} bound claims of 1Gi get \
         2Gi at once; the run ends when the API server says every claim has `status.capacity` 2Gi.\n\n\
         ```sh\ncargo bench -p plugreg-csi-resizer --bench resizer -- --out BENCHMARKS.md\n```\n\n",
        load.join(" "),
        r.claims
    );
    t.push_str("| request | in all | per expansion |\n|---|---|---|\n");
    for (k, v) in &r.requests {
        t.push_str(&format!("| {k} | {v} | {:.3} |\n", *v as f64 / n));
    }
    t.push_str(&format!(
        "\nEvery claim expanded after {:.1} s ({:.2} expansions/s); the event writes, which wait behind the \
         claim and PV writes, were all sent after {:.1} s. Writes before the last claim was expanded: {}.\n",
        r.makespan.as_secs_f64(),
        n / r.makespan.as_secs_f64(),
        r.settled.as_secs_f64(),
        r.writes_at_done
    ));
    t.push_str(&format!(
        "\nPeak RSS (VmHWM) once the watches had started (before the first expansion): {:.1} MiB ({:.1} MiB \
         anonymous: heap, caches, stacks; {:.1} MiB file-backed: the binary's and the C libraries' pages); over the \
         whole run: {:.1} MiB; at the end {:.1} MiB anonymous and {:.1} MiB file-backed.\n",
        r.rss_ready_kib as f64 / 1024.0,
        r.split_ready.0 as f64 / 1024.0,
        r.split_ready.1 as f64 / 1024.0,
        r.hwm_kib as f64 / 1024.0,
        r.split_end.0 as f64 / 1024.0,
        r.split_end.1 as f64 / 1024.0,
    ));
    let goals = [
        (
            format!(
                "API writes per expansion <= upstream's ({UPSTREAM_WRITES} object writes + {UPSTREAM_EVENTS} events)"
            ),
            format!(
                "{:.3} object writes + {:.3} events",
                object_writes as f64 / n,
                events as f64 / n
            ),
            object_writes as f64 / n <= UPSTREAM_WRITES as f64 + 1e-9
                && events as f64 / n <= UPSTREAM_EVENTS as f64 + 1e-9,
        ),
        (
            format!(
                "every claim expanded within 1.1x the write floor of its object writes ({object_floor:.0} s; \
                 events come after, at lower priority)"
            ),
            format!("{:.1} s", r.makespan.as_secs_f64()),
            r.makespan.as_secs_f64() <= 1.1 * object_floor,
        ),
        (
            format!(
                "every write (events too) sent within 1.1x the floor of all writes ({all_floor:.0} s; upstream's \
                 floor at its count: {upstream_floor:.0} s)"
            ),
            format!("{:.1} s", r.settled.as_secs_f64()),
            // The settle check polls every 3 s.
            r.settled.as_secs_f64() <= 1.1 * all_floor + 3.0,
        ),
        (
            format!("peak RSS < {RSS_GOAL_MIB} MiB at {} claims", r.claims),
            format!("{rss_mib:.1} MiB"),
            rss_mib < RSS_GOAL_MIB,
        ),
        (
            "the Lease was never lost".to_owned(),
            if r.lease_lost {
                "lost".into()
            } else {
                "kept".into()
            },
            !r.lease_lost,
        ),
    ];
    t.push_str("\n| goal | measured | |\n|---|---|---|\n");
    for (goal, measured, met) in goals {
        t.push_str(&format!(
            "| {goal} | {measured} | {} |\n",
            if met { "met" } else { "**missed**" }
        ));
    }
    t.push_str(
        "\nNo Go external-resizer runs on this machine (neither its source nor a binary is reachable), so upstream's \
         figures are its write count read from its source, not a side-by-side run.\n",
    );
    t.push_str(END);
    t
}

fn splice(path: &str, block: &str) {
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let new = match (old.find(START), old.find(END)) {
        (Some(s), Some(e)) if e > s => format!("{}{block}{}", &old[..s], &old[e + END.len()..]),
        _ => format!("{}\n{block}\n", old.trim_end()),
    };
    std::fs::write(path, new).unwrap();
}

fn main() {
    let a = args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let r = rt.block_on(run(a.claims));
    let block = report(&r);
    println!("{block}");
    if let Some(out) = a.out {
        // Relative to the repository root (cargo runs benches in the package's directory).
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        splice(&root.join(out).to_string_lossy(), &block);
    }
}
