//! A rolling update under load, both ways, as a Deployment with `maxSurge: 1` does it: the
//! separate `csi-provisioner` and `csi-attacher` of replica `old-1` lead; `csi-sidecars` of
//! replica `new-1` starts beside them (the surge), then `old-1` is terminated; then the separate
//! sidecars of `old-2` start beside `csi-sidecars`, and `new-1` is terminated. Claims are
//! created and attached all along, against a real kube-apiserver and kube-controller-manager
//! v1.36.2 and the test CSI driver.
//!
//! What must hold: each Lease passes from one replica to the next only after the one before
//! is gone (the provisioner's and the attacher's Leases keep their upstream names in both
//! shapes), every claim is provisioned once (one volume in the driver per claim, no volume
//! left over), every attachment is attached, nothing is lost.
//!
//! Each replica runs in a UTS namespace of its own with its own host name (the Lease holder
//! identity is the host name, as in a pod): the test needs root, as the provisioner's leader
//! tests do.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Peers;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::{StorageClass, VolumeAttachment};
use kube::api::{Api, ListParams};
use plugreg_csi_test_driver::{DriverConfig, Method, MountMode};
use plugreg_testpeers::sidecar::{self, LoggedSidecar, create_object};
use serde_json::json;
use tokio::time::Instant;

const DRIVER: &str = "roll.csi.plugreg.test";
const NS: &str = "roll";
const NODE: &str = "node-1";
const CLAIMS: usize = 48;
const WAIT: Duration = Duration::from_secs(120);

/// The processes of a replica, in the replica's UTS namespace (killed when dropped).
struct Replica {
    children: Vec<LoggedSidecar>,
}

impl Replica {
    fn start(host: &'static str, programs: &[(&Path, Vec<String>)], dir: &Path) -> Self {
        let children = programs
            .iter()
            .enumerate()
            .map(|(i, (bin, args))| {
                let mut cmd = sidecar::command("unshare");
                cmd.args([
                    "--uts",
                    "--",
                    "sh",
                    "-c",
                    "hostname \"$0\" && exec \"$@\"",
                    host,
                ])
                .arg(bin)
                .args(args);
                LoggedSidecar::spawn(cmd, dir.join(format!("{host}-{i}.log")))
            })
            .collect();
        Self { children }
    }

    fn logs(&self) -> String {
        self.children
            .iter()
            .map(LoggedSidecar::log)
            .collect::<Vec<_>>()
            .join("\n----\n")
    }

    /// SIGTERM, as the kubelet stops a terminated pod's containers; waits for every process.
    async fn terminate(&mut self) -> Instant {
        for c in &self.children {
            c.signal("TERM");
        }
        for c in &mut self.children {
            c.exit_code_within(Duration::from_secs(30)).await;
        }
        Instant::now()
    }
}

/// The holder of each Lease, sampled every 50 ms: (lease, holder, first seen).
type Timeline = Arc<Mutex<Vec<(String, String, Instant)>>>;

fn sample_leases(client: kube::Client, timeline: Timeline) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let leases: Api<Lease> = Api::namespaced(client, NS);
        let mut last: BTreeMap<String, String> = BTreeMap::new();
        loop {
            if let Ok(list) = leases.list(&ListParams::default()).await {
                for l in list.items {
                    let name = l.metadata.name.clone().unwrap_or_default();
                    let holder = l.spec.and_then(|s| s.holder_identity).unwrap_or_default();
                    if last.get(&name) != Some(&holder) {
                        last.insert(name.clone(), holder.clone());
                        timeline
                            .lock()
                            .unwrap()
                            .push((name, holder, Instant::now()));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

async fn until(what: &str, logs: impl Fn() -> String, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done().await {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}:\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether both Leases are held by `host`.
async fn both_held_by(leases: &Api<Lease>, host: &str) -> bool {
    let Ok(list) = leases.list(&ListParams::default()).await else {
        return false;
    };
    let held: Vec<_> = list
        .items
        .iter()
        .filter(|l| l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) == Some(host))
        .collect();
    held.len() >= 2
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_to_csi_sidecars_and_back_under_load() {
    // The separate sidecars are other packages' binaries.
    common::build_workspace_binaries();
    let provisioner = common::binaries().join("csi-provisioner");
    let attacher = common::binaries().join("csi-attacher");
    let sidecars = PathBuf::from(env!("CARGO_BIN_EXE_csi-sidecars"));

    let peers = Peers::start(&[], None, NS, DRIVER, NODE).await;
    let (api, client) = (&peers.api, peers.client.clone());
    create_object::<StorageClass>(
        &client,
        json!({"metadata": {"name": "roll"}, "provisioner": DRIVER}),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let volumes_dir = dir.path().join("volumes");
    let cfg = DriverConfig {
        name: DRIVER.to_owned(),
        node_id: NODE.to_owned(),
        controller: true,
        controller_publish: true,
        data_dir: Some(volumes_dir.clone()),
        mount: MountMode::Directory,
        ..DriverConfig::default()
    };
    let calls = cfg.calls.clone();
    let _driver = plugreg_csi_test_driver::start(cfg, &socket).await.unwrap();

    let common: Vec<String> = vec![
        format!("--csi-address={}", socket.display()),
        format!("--kubeconfig={}", api.kubeconfig_path().display()),
        "--v=5".into(),
        "--leader-election".into(),
        format!("--leader-election-namespace={NS}"),
        "--leader-election-lease-duration=4s".into(),
        "--leader-election-renew-deadline=3s".into(),
        "--leader-election-retry-period=1s".into(),
    ];
    let separate = |host: &'static str| {
        Replica::start(
            host,
            &[
                (provisioner.as_path(), common.clone()),
                (attacher.as_path(), common.clone()),
            ],
            dir.path(),
        )
    };
    let combined = |host: &'static str| {
        let mut args = common.clone();
        args.push("--controllers=provisioner,attacher".into());
        Replica::start(host, &[(sidecars.as_path(), args)], dir.path())
    };
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    let timeline: Timeline = Arc::default();
    let sampler = sample_leases(client.clone(), Arc::clone(&timeline));

    let mut old = separate("old-1");
    until(
        "old-1 leads",
        || old.logs(),
        async || both_held_by(&leases, "old-1").await,
    )
    .await;

    // The load: a claim every 150 ms, and an attachment for each claim once it is bound.
    let load = {
        let client = client.clone();
        tokio::spawn(async move {
            let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
            for i in 0..CLAIMS {
                create_object::<PersistentVolumeClaim>(
                    &client,
                    json!({"metadata": {"name": format!("c-{i}"), "namespace": NS},
                           "spec": {"storageClassName": "roll", "accessModes": ["ReadWriteOnce"],
                                    "resources": {"requests": {"storage": "1Gi"}}}}),
                )
                .await;
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            // Attach each claim's volume as it binds.
            let mut attached = HashSet::new();
            let deadline = Instant::now() + WAIT;
            while attached.len() < CLAIMS && Instant::now() < deadline {
                for c in claims.list(&ListParams::default()).await.unwrap().items {
                    let name = c.metadata.name.clone().unwrap_or_default();
                    let Some(pv) = c.spec.and_then(|s| s.volume_name) else {
                        continue;
                    };
                    if c.status.and_then(|s| s.phase).as_deref() == Some("Bound")
                        && attached.insert(name.clone())
                    {
                        create_object::<VolumeAttachment>(
                            &client,
                            json!({"metadata": {"name": format!("va-{name}")},
                                   "spec": {"attacher": DRIVER, "nodeName": NODE,
                                            "source": {"persistentVolumeName": pv}}}),
                        )
                        .await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };

    // Roll to csi-sidecars: the new replica surges, then the old one is terminated.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut new = combined("new-1");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let old_gone = old.terminate().await;
    until(
        "new-1 leads",
        || new.logs(),
        async || both_held_by(&leases, "new-1").await,
    )
    .await;

    // And back.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let back = separate("old-2");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let new_gone = new.terminate().await;
    until(
        "old-2 leads",
        || back.logs(),
        async || both_held_by(&leases, "old-2").await,
    )
    .await;
    load.await.unwrap();

    // Everything done by the last replica.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    until(
        "every claim bound and attached",
        || back.logs(),
        async || {
            let bound = claims
                .list(&ListParams::default())
                .await
                .map(|l| {
                    l.items
                        .iter()
                        .filter(|c| {
                            c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
                        })
                        .count()
                })
                .unwrap_or(0);
            let attached = vas
                .list(&ListParams::default())
                .await
                .map(|l| {
                    l.items
                        .iter()
                        .filter(|v| v.status.as_ref().is_some_and(|s| s.attached))
                        .count()
                })
                .unwrap_or(0);
            bound == CLAIMS && attached == CLAIMS
        },
    )
    .await;
    sampler.abort();
    let (old_logs, new_logs) = (old.logs(), new.logs());

    // Each Lease went old-1 -> new-1 -> old-2, each hand-over after the previous holder was
    // gone: never two leaders of one controller.
    let timeline = timeline.lock().unwrap().clone();
    // (The provisioner's in-flight record is kept in Leases too, without a holder.)
    let names: HashSet<&String> = timeline
        .iter()
        .filter(|(_, h, _)| !h.is_empty())
        .map(|(l, _, _)| l)
        .collect();
    assert_eq!(
        names,
        HashSet::from([
            &"roll-csi-plugreg-test".to_owned(),
            &"external-attacher-leader-roll-csi-plugreg-test".to_owned()
        ]),
        "the upstream Lease names in both shapes"
    );
    for lease in names {
        let holders: Vec<&(String, String, Instant)> = timeline
            .iter()
            .filter(|(l, h, _)| l == lease && !h.is_empty())
            .collect();
        let order: Vec<&str> = holders.iter().map(|(_, h, _)| h.as_str()).collect();
        assert_eq!(order, ["old-1", "new-1", "old-2"], "{lease}: {timeline:?}");
        // Handed over once the previous replica was gone, or once it gave the Lease up: a
        // controller releases its Lease (ReleaseLeaderElectionOnExit) only after its work ended.
        let released = |logs: &str| {
            logs.lines()
                .any(|l| l.contains("released lease") && l.contains(&format!("/{lease}\"")))
        };
        assert!(
            holders[1].2 >= old_gone || released(&old_logs),
            "{lease} taken by new-1 while old-1 still led"
        );
        assert!(
            holders[2].2 >= new_gone || released(&new_logs),
            "{lease} taken by old-2 while new-1 still led:\n{new_logs}"
        );
    }

    // Every claim provisioned once: one volume name per claim, one volume in the driver per PV.
    let names: HashSet<String> = calls
        .create_requests()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(names.len(), CLAIMS, "one CreateVolume name per claim");
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pvs = pvs.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(pvs.len(), CLAIMS, "one PV per claim");
    let in_driver = std::fs::read_dir(&volumes_dir).unwrap().count();
    assert_eq!(in_driver, CLAIMS, "no volume left over in the driver");
    assert!(calls.count(Method::ControllerPublishVolume) >= CLAIMS as u64);
    assert_eq!(calls.count(Method::DeleteVolume), 0);
}
