//! The health monitor as a controller of `csi-sidecars` (`--controllers=...,health-monitor`)
//! against a real kube-apiserver v1.36.2 and the test driver reporting volume conditions: its
//! prefixed flags, its own Lease beside the attacher's, its events on the claim.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Namespace, PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, ListParams, Patch, PatchParams};
use plugreg_csi_test_driver::{DriverConfig, Method};
use plugreg_testpeers::sidecar::{self, LoggedSidecar, controller_command, create_object};
use plugreg_testpeers::{ApiServer, KubeVersion};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);
const NS: &str = "health";
const DRIVER: &str = "health.csi.plugreg.test";

async fn poll<T, F, Fut>(what: &str, sidecar: &LoggedSidecar, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; csi-sidecars' log:\n{}",
            sidecar.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The health monitor joins the attacher in one process: each holds its upstream Lease, the
/// prefixed `--health-monitor-list-volumes-interval` paces its passes, and an abnormal volume
/// gets upstream's event on its claim, from upstream's component.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_monitor_runs_beside_the_attacher_under_its_own_lease() {
    let api = ApiServer::start_version(KubeVersion::V1_36_2)
        .await
        .expect("kube-apiserver v1.36.2");
    let client = api.client().await.unwrap();
    create_object::<Namespace>(&client, json!({"metadata": {"name": NS}})).await;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let cfg = DriverConfig {
        name: DRIVER.to_owned(),
        controller: true,
        controller_publish: true,
        list_volumes: true,
        volume_condition: true,
        volumes: vec!["vol-a".to_owned()],
        ..DriverConfig::default()
    };
    let calls = cfg.calls.clone();
    let driver = plugreg_csi_test_driver::start(cfg, &socket).await.unwrap();
    driver.set_condition("vol-a", Some("disk gone"));

    let claim = create_object::<PersistentVolumeClaim>(
        &client,
        json!({"metadata": {"name": "a", "namespace": NS},
               "spec": {"accessModes": ["ReadWriteOnce"], "volumeName": "pv-a",
                        "storageClassName": "",
                        "resources": {"requests": {"storage": "1Gi"}}}}),
    )
    .await;
    create_object::<PersistentVolume>(
        &client,
        json!({"metadata": {"name": "pv-a"},
               "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                        "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                        "claimRef": {"namespace": NS, "name": "a", "uid": claim.metadata.uid},
                        "csi": {"driver": DRIVER, "volumeHandle": "vol-a"}}}),
    )
    .await;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    pvs.patch_status(
        "pv-a",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Bound"}})),
    )
    .await
    .unwrap();

    let http = sidecar::free_addr();
    let cmd = controller_command(
        env!("CARGO_BIN_EXE_csi-sidecars"),
        &socket,
        api.kubeconfig_path(),
        &[
            "--controllers=attacher,health-monitor",
            "--leader-election",
            &format!("--leader-election-namespace={NS}"),
            &format!("--http-endpoint={http}"),
            "--health-monitor-list-volumes-interval=300ms",
        ],
    );
    let process = LoggedSidecar::spawn(cmd, dir.path().join("csi-sidecars.log"));

    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let ev = poll("the abnormal volume's event", &process, || async {
        events
            .list(&ListParams::default().fields("involvedObject.name=a"))
            .await
            .ok()?
            .items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("VolumeConditionAbnormal"))
    })
    .await;
    assert_eq!(ev.message.as_deref(), Some("disk gone"));
    assert_eq!(
        ev.source.and_then(|s| s.component).as_deref(),
        Some("csi-pv-monitor-controller-health.csi.plugreg.test")
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    for lease in [
        "external-attacher-leader-health-csi-plugreg-test",
        "external-health-monitor-leader-health-csi-plugreg-test",
    ] {
        poll(&format!("the Lease {lease} held"), &process, || async {
            leases
                .get_opt(lease)
                .await
                .ok()
                .flatten()
                .filter(|l| l.spec.as_ref().is_some_and(|s| s.holder_identity.is_some()))
        })
        .await;
    }
    // The interval is the prefixed flag's: several passes within seconds.
    let from = calls.count(Method::ListVolumes);
    poll("three more passes", &process, || async {
        (calls.count(Method::ListVolumes) >= from + 3).then_some(())
    })
    .await;
    assert_eq!(calls.count(Method::GetPluginInfo), 1);
    let (code, body) = sidecar::http_get(http, "/healthz/leader-election");
    assert_eq!((code, body.as_str()), (200, "ok"));
}
