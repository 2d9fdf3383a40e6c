//! The health monitor as a controller of `csi-sidecars` (`--controllers=...,health-monitor`)
//! against a real kube-apiserver v1.36.2 and the test driver reporting volume conditions: its
//! prefixed flags, its own Lease beside the attacher's, its events on the claim.

mod common;

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Namespace};
use kube::api::{Api, ListParams};
use plugreg_csi_test_driver::{DriverConfig, Method};
use plugreg_testpeers::sidecar::{self, LoggedSidecar, controller_command, create_object};
use plugreg_testpeers::{ApiServer, KubeVersion};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);
const NS: &str = "health";
const DRIVER: &str = "health.csi.plugreg.test";

async fn poll<T, F, Fut>(what: &str, process: &LoggedSidecar, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    common::poll(what, WAIT, process, f).await
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

    sidecar::bound_claim(&client, NS, "a", "pv-a", DRIVER, "vol-a", false).await;

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
