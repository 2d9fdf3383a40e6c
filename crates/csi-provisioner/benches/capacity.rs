//! csi-provisioner storage capacity tracking benchmark (issue 31):
//!
//! ```sh
//! cargo bench -p plugreg-csi-provisioner --bench capacity -- --out BENCHMARKS.md
//! cargo bench -p plugreg-csi-provisioner --bench capacity -- --qps 1   # upstream's default QPS
//! ```
//!
//! A fresh real kube-apiserver v1.36.2, 100 Nodes with their CSINodes (each node its own
//! topology segment), 10 WaitForFirstConsumer classes, the test CSI driver in-process with a
//! pool per segment, and the release `csi-provisioner` with `--enable-capacity` (capacity client
//! at `--qps`, default 10, burst 5). Reported: how long until all 1,000 CSIStorageCapacity
//! objects existed, beside the write floor `(1000 - burst) / qps`; how long a change of one
//! segment's pool took to show in its 10 objects (the goal: within one
//! `--capacity-poll-interval`, 10 s here); the provisioner's peak RSS (VmHWM). `PLUGREG_PROVISIONER_BIN`
//! measures another build.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::api::storage::v1::{CSINode, CSIStorageCapacity, StorageClass};
use kube::api::{Api, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, watcher};
use plugreg_csi_test_driver::{Capacity, DriverConfig, MountMode};
use plugreg_testpeers::bench::{commit, create_all, date, load, write_block};
use plugreg_testpeers::{ApiServer, KubeVersion};
use serde_json::json;

const START: &str = "<!-- bench:csi-provisioner-capacity:start -->";
const END: &str = "<!-- bench:csi-provisioner-capacity:end -->";
const DRIVER: &str = "capacity.csi.plugreg.test";
const KEY: &str = "topology.capacity.plugreg.test/node";
const NODES: usize = 100;
const CLASSES: usize = 10;
const BURST: usize = 5;
const POLL: Duration = Duration::from_secs(10);
const GOAL_RSS_MIB: f64 = 24.0;

fn bin() -> String {
    std::env::var("PLUGREG_PROVISIONER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_csi-provisioner").to_owned())
}

fn segment(i: usize) -> BTreeMap<String, String> {
    BTreeMap::from([(KEY.to_owned(), format!("n-{i}"))])
}

#[tokio::main]
async fn main() {
    let mut out = None;
    let mut qps = 10.0_f64;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = it.next(),
            "--qps" => qps = it.next().and_then(|v| v.parse().ok()).unwrap_or(qps),
            _ => {}
        }
    }
    let load_start = load();
    let api = ApiServer::start_version(KubeVersion::V1_36_2)
        .await
        .unwrap();
    let client = api.client().await.unwrap();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "bench"}})).unwrap(),
        )
        .await
        .unwrap();
    let nodes: Api<Node> = Api::all(client.clone());
    let csinodes: Api<CSINode> = Api::all(client.clone());
    create_all(NODES, |i| {
        let (nodes, csinodes) = (nodes.clone(), csinodes.clone());
        async move {
            let name = format!("n-{i}");
            nodes
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(
                        json!({"metadata": {"name": name, "labels": {KEY: name}}}),
                    )
                    .unwrap(),
                )
                .await
                .unwrap();
            csinodes
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "metadata": {"name": name},
                        "spec": {"drivers": [{"name": DRIVER, "nodeID": name, "topologyKeys": [KEY]}]},
                    }))
                    .unwrap(),
                )
                .await
                .unwrap();
        }
    })
    .await;
    let classes: Api<StorageClass> = Api::all(client.clone());
    for c in 0..CLASSES {
        classes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": format!("class-{c}")},
                    "provisioner": DRIVER,
                    "volumeBindingMode": "WaitForFirstConsumer",
                    "parameters": {"kind": format!("k{c}")},
                }))
                .unwrap(),
            )
            .await
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let pools = Capacity::with_pools((0..NODES).map(|i| (segment(i), (i as i64 + 1) << 30)));
    let _driver = plugreg_csi_test_driver::start(
        DriverConfig {
            name: DRIVER.into(),
            controller: true,
            accessibility_constraints: true,
            capacity: pools.clone(),
            data_dir: Some(dir.path().join("volumes")),
            mount: MountMode::Directory,
            ..DriverConfig::default()
        },
        &socket,
    )
    .await
    .unwrap();

    // Every object as it comes, by name, with its capacity.
    let (tx, mut rx) = tokio::sync::watch::channel(BTreeMap::<String, (String, String)>::new());
    let objects: Api<CSIStorageCapacity> = Api::namespaced(client.clone(), "bench");
    tokio::spawn(async move {
        let mut s = std::pin::pin!(watcher(objects, watcher::Config::default()).default_backoff());
        while let Some(ev) = s.next().await {
            if let Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) = ev {
                let node = o
                    .node_topology
                    .as_ref()
                    .and_then(|t| t.match_labels.as_ref())
                    .and_then(|m| m.get(KEY).cloned())
                    .unwrap_or_default();
                let cap = o.capacity.map(|q| q.0).unwrap_or_default();
                let name = o.metadata.name.unwrap_or_default();
                tx.send_modify(|m| {
                    m.insert(name, (node, cap));
                });
            }
        }
    });

    let log = std::fs::File::create(dir.path().join("provisioner.log")).unwrap();
    let start = Instant::now();
    let mut child = Command::new(bin())
        .arg(format!("--csi-address={}", socket.display()))
        .arg(format!("--kubeconfig={}", api.kubeconfig_path().display()))
        .arg("--v=1")
        .arg("--enable-capacity")
        .arg("--capacity-ownerref-level=-1")
        .arg(format!("--capacity-poll-interval={}s", POLL.as_secs()))
        .arg(format!("--kube-api-capacity-qps={qps}"))
        .arg(format!("--kube-api-capacity-burst={BURST}"))
        .env("NAMESPACE", "bench")
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let pid = child.id();
    let total = NODES * CLASSES;
    rx.wait_for(|m| m.len() >= total).await.unwrap();
    let all = start.elapsed();
    let floor = (total - BURST) as f64 / qps;

    // One segment's pool changes: its 10 objects show it.
    let changed_at = Instant::now();
    pools.set(segment(7), 123 << 30);
    rx.wait_for(|m| {
        m.values()
            .filter(|(n, c)| n == "n-7" && c == "123Gi")
            .count()
            == CLASSES
    })
    .await
    .unwrap();
    let change = changed_at.elapsed();
    let hwm_kib = plugreg_runtime::procfs::status_kib(&pid.to_string(), "VmHWM").unwrap_or(0);
    let _ = child.kill();
    let _ = child.wait();
    let hwm_mib = hwm_kib as f64 / 1024.0;
    let ratio = all.as_secs_f64() / floor;

    let block = format!(
        "{START}\n## csi-provisioner: storage capacity tracking (issue 31)\n\n\
         {date}, commit {commit}, `cargo bench -p plugreg-csi-provisioner --bench capacity -- --out BENCHMARKS.md` \
         (load at start {load_start}): real kube-apiserver v1.36.2, {NODES} Nodes with CSINodes (one segment each), \
         {CLASSES} WaitForFirstConsumer classes, the test driver in-process, release csi-provisioner with \
         `--enable-capacity --kube-api-capacity-qps={qps} --kube-api-capacity-burst={BURST} --capacity-poll-interval={poll}s` \
         (upstream's default capacity QPS is 1: `--qps 1` takes about 1,000 s). No Go external-provisioner ran beside: no \
         registry or module proxy is reachable here, so there is no same-run comparison.\n\n\
         | figure | measured | goal | met |\n|---|---|---|---|\n\
         | all {total} CSIStorageCapacity objects created | {all:.1} s (write floor {floor:.1} s: {ratio:.3}x) | within 1.1x of the floor | {m1} |\n\
         | one segment's change in its {CLASSES} objects | {change:.1} s | within one poll ({poll} s) | {m2} |\n\
         | peak RSS (VmHWM) | {hwm_mib:.1} MiB | under {GOAL_RSS_MIB} MiB | {m3} |\n{END}",
        date = date(),
        commit = commit(),
        poll = POLL.as_secs(),
        all = all.as_secs_f64(),
        change = change.as_secs_f64(),
        m1 = if ratio <= 1.1 { "yes" } else { "no" },
        m2 = if change <= POLL { "yes" } else { "no" },
        m3 = if hwm_mib < GOAL_RSS_MIB { "yes" } else { "no" },
    );
    println!("{block}");
    if let Some(out) = out {
        write_block(&out, START, END, &block);
    }
}
