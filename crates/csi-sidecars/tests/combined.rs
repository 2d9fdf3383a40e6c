//! `csi-sidecars` against the real peers: its own kube-apiserver v1.36.2 with
//! kube-controller-manager (its PV controller binds claims) and the Go snapshot-controller
//! v8.6.0 with the snapshot CRDs, the test CSI driver on a Unix socket, and the binary as a
//! child process running all four controllers.
//!
//! One test walks a claim's life through the four controllers of one process (a group snapshot
//! of it too, behind the snapshotter's gate), then takes the
//! attacher's Lease away from it: the attacher stops and campaigns again while the others go
//! on, and takes the Lease back once it is free.

mod common;

use std::time::Duration;

use common::Peers;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::{StorageClass, VolumeAttachment};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use plugreg_csi_test_driver::{DriverConfig, Method, MountMode};
use plugreg_sidecar_kit::groupsnapshot::VolumeGroupSnapshotClass;
use plugreg_sidecar_kit::snapshot::{VolumeSnapshot, VolumeSnapshotClass};
use plugreg_testpeers::sidecar::{
    self, LoggedSidecar, controller_command, create_object, http_get,
};
use plugreg_testpeers::{ApiServer, KubeVersion};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(90);
const NS: &str = "flow";
const DRIVER: &str = "all.csi.plugreg.test";
const NODE: &str = "node-1";

async fn poll<T, F, Fut>(what: &str, process: &LoggedSidecar, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    common::poll(what, WAIT, process, f).await
}

fn bound(c: &PersistentVolumeClaim) -> Option<String> {
    let bound = c.status.as_ref()?.phase.as_deref() == Some("Bound");
    bound.then(|| c.spec.as_ref()?.volume_name.clone())?
}

fn attached(va: &VolumeAttachment) -> bool {
    va.status.as_ref().is_some_and(|s| s.attached)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_controllers_in_one_process_each_under_its_own_lease() {
    let gate = "--feature-gates=CSIVolumeGroupSnapshot=true";
    let peers = Peers::start(&[], Some(&[gate]), NS, DRIVER, NODE).await;
    let (api, client) = (&peers.api, peers.client.clone());
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let cfg = DriverConfig {
        name: DRIVER.to_owned(),
        node_id: NODE.to_owned(),
        controller: true,
        controller_publish: true,
        controller_expand: true,
        snapshots: true,
        group_snapshots: true,
        data_dir: Some(dir.path().join("volumes")),
        mount: MountMode::Directory,
        ..DriverConfig::default()
    };
    let calls = cfg.calls.clone();
    let _driver = plugreg_csi_test_driver::start(cfg, &socket).await.unwrap();

    let http = sidecar::free_addr();
    let cmd = controller_command(
        env!("CARGO_BIN_EXE_csi-sidecars"),
        &socket,
        api.kubeconfig_path(),
        &[
            "--controllers=provisioner,attacher,resizer,snapshotter",
            "--leader-election",
            &format!("--leader-election-namespace={NS}"),
            "--leader-election-lease-duration=4s",
            "--leader-election-renew-deadline=3s",
            "--leader-election-retry-period=1s",
            &format!("--http-endpoint={http}"),
            "--provisioner-kube-api-qps=50",
            "--snapshotter-feature-gates=CSIVolumeGroupSnapshot=true",
        ],
    );
    let mut process = LoggedSidecar::spawn(cmd, dir.path().join("csi-sidecars.log"));

    // Provisioned and bound.
    create_object::<StorageClass>(
        &client,
        json!({"metadata": {"name": "all"}, "provisioner": DRIVER, "allowVolumeExpansion": true}),
    )
    .await;
    let claim = |name: &str| {
        json!({
            "metadata": {"name": name, "namespace": NS},
            "spec": {"storageClassName": "all", "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "1Gi"}}},
        })
    };
    create_object::<PersistentVolumeClaim>(&client, claim("data")).await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), NS);
    let pv = poll("claim data Bound", &process, || async {
        claims
            .get_opt("data")
            .await
            .ok()
            .flatten()
            .as_ref()
            .and_then(bound)
    })
    .await;

    // One identification for the four: one GetPluginInfo, one read of each capability set
    // (the resizer reads the controller's again before each expansion, as upstream's does).
    assert_eq!(calls.count(Method::GetPluginInfo), 1);
    assert_eq!(calls.count(Method::GetPluginCapabilities), 1);
    assert_eq!(calls.count(Method::ControllerGetCapabilities), 1);

    // Attached.
    let vas: Api<VolumeAttachment> = Api::all(client.clone());
    let va = |name: &str, pv: &str| {
        json!({"metadata": {"name": name},
               "spec": {"attacher": DRIVER, "nodeName": NODE,
                        "source": {"persistentVolumeName": pv}}})
    };
    create_object::<VolumeAttachment>(&client, va("va-data", &pv)).await;
    poll("va-data attached", &process, || async {
        vas.get_opt("va-data").await.ok().flatten().filter(attached)
    })
    .await;

    // Expanded.
    claims
        .patch(
            "data",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"resources": {"requests": {"storage": "2Gi"}}}})),
        )
        .await
        .unwrap();
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    poll("PV expanded to 2Gi", &process, || async {
        let v = pvs.get_opt(&pv).await.ok().flatten()?;
        let size = v.spec?.capacity?.get("storage")?.0.clone();
        (size == "2Gi").then_some(())
    })
    .await;

    // Snapshotted.
    create_object::<VolumeSnapshotClass>(
        &client,
        json!({"metadata": {"name": "all"}, "driver": DRIVER, "deletionPolicy": "Delete"}),
    )
    .await;
    create_object::<VolumeSnapshot>(
        &client,
        json!({"metadata": {"name": "snap", "namespace": NS},
               "spec": {"source": {"persistentVolumeClaimName": "data"},
                        "volumeSnapshotClassName": "all"}}),
    )
    .await;
    let snaps: Api<VolumeSnapshot> = Api::namespaced(client.clone(), NS);
    poll("snapshot ready", &process, || async {
        let s = snaps.get_opt("snap").await.ok().flatten()?;
        (s.status?.ready_to_use == Some(true)).then_some(())
    })
    .await;

    // Group-snapshotted, behind the snapshotter's gate.
    claims
        .patch(
            "data",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"group": "g"}}})),
        )
        .await
        .unwrap();
    create_object::<VolumeGroupSnapshotClass>(
        &client,
        json!({"metadata": {"name": "all"}, "driver": DRIVER, "deletionPolicy": "Delete"}),
    )
    .await;
    let group = ApiResource {
        group: "groupsnapshot.storage.k8s.io".into(),
        version: "v1".into(),
        api_version: "groupsnapshot.storage.k8s.io/v1".into(),
        kind: "VolumeGroupSnapshot".into(),
        plural: "volumegroupsnapshots".into(),
    };
    let groups: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &group);
    groups
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "groupsnapshot.storage.k8s.io/v1", "kind": "VolumeGroupSnapshot",
                "metadata": {"name": "g", "namespace": NS},
                "spec": {"source": {"selector": {"matchLabels": {"group": "g"}}},
                         "volumeGroupSnapshotClassName": "all"},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    poll("group snapshot ready", &process, || async {
        let g = groups.get_opt("g").await.ok().flatten()?;
        (g.data["status"]["readyToUse"] == json!(true)).then_some(())
    })
    .await;
    assert_eq!(calls.count(Method::CreateVolumeGroupSnapshot), 1);

    // Each controller holds its sidecar's upstream Lease.
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    let names = [
        plugreg_provisioner::flags::lease_name(DRIVER),
        plugreg_attacher::decide::lease_name(DRIVER),
        plugreg_resizer::flags::lease_name(DRIVER),
        plugreg_snapshotter::decide::lease_name(DRIVER),
    ];
    assert_eq!(
        names,
        [
            "all-csi-plugreg-test",
            "external-attacher-leader-all-csi-plugreg-test",
            "external-resizer-all-csi-plugreg-test",
            "external-snapshotter-leader-all-csi-plugreg-test",
        ]
    );
    let holder = |l: &Lease| l.spec.as_ref().and_then(|s| s.holder_identity.clone());
    let mut identity = None;
    for name in &names {
        let lease = leases.get(name).await.unwrap();
        let h = holder(&lease).unwrap_or_default();
        assert!(!h.is_empty(), "{name} has a holder");
        assert_eq!(identity.get_or_insert(h.clone()), &h, "one identity");
    }

    // Each Lease's `LeaderElection` event comes from csi-lib-utils' component: the sidecar's
    // lock name as upstream gives it (not sanitised, except the resizer's driver part), then
    // the host name.
    let locks = [
        plugreg_provisioner::flags::lock_name(DRIVER),
        plugreg_attacher::decide::lock_name(DRIVER),
        plugreg_resizer::flags::lock_name(DRIVER),
        plugreg_snapshotter::decide::lock_name(DRIVER),
    ];
    assert_eq!(
        locks,
        [
            "all.csi.plugreg.test",
            "external-attacher-leader-all.csi.plugreg.test",
            "external-resizer-all-csi-plugreg-test",
            "external-snapshotter-leader-all.csi.plugreg.test",
        ]
    );
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let host = plugreg_sidecar_kit::leader::hostname();
    for (name, lock) in names.iter().zip(&locks) {
        let component = poll(
            &format!("{name}'s LeaderElection event"),
            &process,
            || async {
                let list = events
                    .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
                    .await
                    .ok()?;
                list.items
                    .into_iter()
                    .find(|e| e.reason.as_deref() == Some("LeaderElection"))?
                    .source?
                    .component
            },
        )
        .await;
        assert_eq!(component, format!("{lock}/{host}"), "{name}");
    }

    // One /metrics for all, one header per family, one leader series per Lease.
    let (status, metrics) = http_get(http, "/metrics");
    assert_eq!(status, 200);
    for name in &names {
        assert!(
            metrics.contains(&format!(
                "leader_election_master_status{{name=\"{name}\"}} 1"
            )),
            "{name} in\n{metrics}"
        );
    }
    for method in [
        "CreateVolume",
        "ControllerPublishVolume",
        "ControllerExpandVolume",
        "CreateSnapshot",
    ] {
        assert!(
            metrics.contains(&format!("/csi.v1.Controller/{method}")),
            "{method}"
        );
    }
    for c in ["provisioner", "attacher", "resizer", "snapshotter"] {
        assert!(
            metrics.contains(&format!("plugreg_kube_requests_total{{controller=\"{c}\"")),
            "{c}'s bucket in\n{metrics}"
        );
    }
    // One watch per kind for the four (each controller's cache decodes and trims its own copy).
    let shared: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("plugreg_shared_watches{"))
        .collect();
    for resource in [
        "v1/persistentvolumes",
        "v1/persistentvolumeclaims",
        "storage.k8s.io/v1/volumeattachments",
        "storage.k8s.io/v1/csinodes",
        "storage.k8s.io/v1/storageclasses",
        "snapshot.storage.k8s.io/v1/volumesnapshotcontents",
        "snapshot.storage.k8s.io/v1/volumesnapshotclasses",
    ] {
        assert!(
            shared
                .contains(&format!("plugreg_shared_watches{{resource=\"{resource}\"}} 1").as_str()),
            "one watch of {resource} in {shared:?}"
        );
    }
    assert!(shared.iter().all(|l| l.ends_with(" 1")), "{shared:?}");
    // Every request and watch of the four on one HTTP/2 connection, the Leases on one of their
    // own (HTTP/1.1 took one per watch and one per request in flight: 23 at 300 claims).
    poll("two connections to the API server", &process, || async {
        (process.connections_to(api.port()) == 2).then_some(())
    })
    .await;
    for line in metrics.lines().filter(|l| l.starts_with("# TYPE ")) {
        assert_eq!(metrics.matches(&format!("{line}\n")).count(), 1, "{line}");
    }
    assert_eq!(
        http_get(http, "/healthz/leader-election"),
        (200, "ok".into())
    );

    // The attacher's Lease taken away: the attacher stops and campaigns; the process and the
    // other controllers go on.
    let steal = |holder: &str, seconds: i32| {
        json!({"spec": {"holderIdentity": holder, "leaseDurationSeconds": seconds,
                        "renewTime": Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()}})
    };
    leases
        .patch(
            &names[1],
            &PatchParams::default(),
            &Patch::Merge(steal("someone-else", 3600)),
        )
        .await
        .unwrap();
    poll("the attacher stops leading", &process, || async {
        process
            .log()
            .lines()
            .find(|l| l.contains("Stopped leading") && l.contains("controller=\"attacher\""))
            .map(drop)
    })
    .await;
    assert!(process.running(), "the process goes on:\n{}", process.log());
    create_object::<PersistentVolumeClaim>(&client, claim("more")).await;
    let more = poll(
        "claim more Bound without the attacher",
        &process,
        || async {
            claims
                .get_opt("more")
                .await
                .ok()
                .flatten()
                .as_ref()
                .and_then(bound)
        },
    )
    .await;
    create_object::<VolumeAttachment>(&client, va("va-more", &more)).await;
    let (_, metrics) = http_get(http, "/metrics");
    assert!(
        metrics.contains(&format!(
            "leader_election_master_status{{name=\"{}\"}} 0",
            names[1]
        )),
        "{metrics}"
    );
    assert!(
        !vas.get("va-more").await.map(|v| attached(&v)).unwrap(),
        "nobody attaches while another holds the Lease"
    );

    // The Lease free again: the attacher takes it back and attaches.
    leases
        .patch(
            &names[1],
            &PatchParams::default(),
            &Patch::Merge(steal("", 1)),
        )
        .await
        .unwrap();
    poll(
        "va-more attached after the Lease came back",
        &process,
        || async { vas.get_opt("va-more").await.ok().flatten().filter(attached) },
    )
    .await;
    let lease = leases.get(&names[1]).await.unwrap();
    assert_eq!(holder(&lease), identity);
    // The attacher's caches joined the shared watches again: still one per kind.
    let (_, metrics) = http_get(http, "/metrics");
    let shared: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("plugreg_shared_watches{"))
        .collect();
    assert!(
        !shared.is_empty() && shared.iter().all(|l| l.ends_with(" 1")),
        "{shared:?}"
    );

    // A clean stop.
    process.signal("TERM");
    assert_eq!(process.exit_code().await, 0, "{}", process.log());
}

#[test]
fn command_line_refusals_exit_2_and_help_exits_0() {
    let bin = env!("CARGO_BIN_EXE_csi-sidecars");
    let (code, _, err) = sidecar::run_to_end(bin, &["--csi-address=/x"]);
    assert_eq!(code, 2);
    assert!(err.starts_with("--controllers is required"), "{err}");
    let (code, _, err) =
        sidecar::run_to_end(bin, &["--controllers=attacher", "--attacher-timeout=x"]);
    assert_eq!(code, 2);
    assert!(err.contains("--attacher-timeout"), "{err}");
    let (code, _, err) = sidecar::run_to_end(bin, &["--help"]);
    assert_eq!(code, 0);
    assert!(err.contains("--provisioner-worker-threads"), "{err}");
    let (code, out, _) = sidecar::run_to_end(bin, &["--version"]);
    assert_eq!(code, 0);
    assert!(out.contains(plugreg_sidecar_kit::VERSION), "{out}");
}

#[test]
fn a_start_up_refusal_names_its_controller_and_exits_1() {
    let bin = env!("CARGO_BIN_EXE_csi-sidecars");
    let (code, out, err) = sidecar::run_to_end(
        bin,
        &[
            "--controllers=resizer,snapshotter",
            "--snapshotter-feature-gates=NoSuchGate=true",
            sidecar::MASTER,
        ],
    );
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        format!("{out}{err}").contains("snapshotter: "),
        "{out}{err}"
    );
}

/// A controller the driver cannot serve is left out (as a separate sidecar would exit and
/// restart beside the others); the others run. A lost driver connection ends the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_the_driver_cannot_serve_is_left_out_and_a_lost_driver_ends_all() {
    let api = ApiServer::shared(KubeVersion::V1_36_2)
        .await
        .expect("kube-apiserver v1.36.2");
    let client = api.client().await.unwrap();
    let driver = format!("plain{}.csi.plugreg.test", std::process::id());
    let ns = format!("plain{}", std::process::id());
    create_object::<Namespace>(&client, json!({"metadata": {"name": ns}})).await;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let running = plugreg_csi_test_driver::start(
        DriverConfig {
            name: driver.clone(),
            controller: true,
            data_dir: Some(dir.path().join("volumes")),
            mount: MountMode::Directory,
            ..DriverConfig::default()
        },
        &socket,
    )
    .await
    .unwrap();
    let cmd = controller_command(
        env!("CARGO_BIN_EXE_csi-sidecars"),
        &socket,
        api.kubeconfig_path(),
        &["--controllers=provisioner,resizer,snapshotter"],
    );
    let mut process = LoggedSidecar::spawn(cmd, dir.path().join("csi-sidecars.log"));
    let class = format!("{ns}-class");
    create_object::<StorageClass>(
        &client,
        json!({"metadata": {"name": class}, "provisioner": driver}),
    )
    .await;
    create_object::<PersistentVolumeClaim>(
        &client,
        // Annotated as kube-controller-manager's PV controller would (none runs here).
        json!({"metadata": {"name": "data", "namespace": ns,
                            "annotations": {"volume.kubernetes.io/storage-provisioner": driver}},
               "spec": {"storageClassName": class, "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "1Gi"}}}}),
    )
    .await;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    poll("the provisioner's PV", &process, || async {
        pvs.list(&Default::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|pv| {
                pv.spec
                    .as_ref()
                    .and_then(|s| s.csi.as_ref())
                    .is_some_and(|c| c.driver == driver)
            })
    })
    .await;
    let log = process.log();
    for (controller, why) in [
        ("resizer", "CSI driver does not support resize nor modify"),
        ("snapshotter", "does not support ControllerCreateSnapshot"),
    ] {
        assert!(
            log.lines().any(|l| l.contains(why)
                && l.contains(&format!("controller=\"{controller}\""))
                && l.contains("this controller does not run")),
            "{controller} left out:\n{log}"
        );
    }
    assert!(process.running(), "{log}");
    // The driver gone: the whole process ends, as every sidecar does.
    running.stop().await.unwrap();
    assert_eq!(process.exit_code().await, 1, "{}", process.log());
}
