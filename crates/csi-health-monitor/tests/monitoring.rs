//! The two check paths against a real kube-apiserver and the test driver (checklist items
//! 6-13 and 24 of `upstream-external-health-monitor.md` §17, with this drop-in's decisions:
//! each change reported once, a recovery once, PVs bound late checked, failed checks back
//! off).

mod common;

use common::{DRIVER, Env, NS, driver_config};
use plugreg_csi_test_driver::{Fault, Method};
use plugreg_testpeers::KubeVersion;

const ABNORMAL: &str = "VolumeConditionAbnormal";
const NORMAL: &str = "VolumeConditionNormal";
const HEALTHY_AGAIN: &str = "The Volume returns to the healthy state";

/// Waits until the driver has answered `n` more calls of `method` than `from`.
async fn more_calls(env: &Env, method: Method, from: u64, n: u64) {
    env.poll(&format!("{n} more {method:?} calls"), || async {
        (env.calls.count(method) >= from + n).then_some(())
    })
    .await;
}

/// Checklist 6, 8, 9: an abnormal volume gets one Warning event on its claim with the driver's
/// message, in upstream's shape; it is not repeated while nothing changes (upstream repeats it
/// every pass); its recovery gets one Normal event, and nothing more; a new abnormal message is
/// a new event. The healthy claim beside it never gets one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_volumes_reports_each_change_once_on_the_claim() {
    let env = Env::new(
        KubeVersion::V1_36_2,
        driver_config(&["vol-a", "vol-b"], true),
    )
    .await;
    env.driver.set_condition("vol-a", Some("disk gone"));
    let uid = env.bound_claim("a", "vol-a").await;
    env.bound_claim("b", "vol-b").await;
    let _m = env.monitor(&["--list-volumes-interval=300ms"]);

    let ev = env.wait_event("a", ABNORMAL, "disk gone", 1).await;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    let obj = &ev.involved_object;
    assert_eq!(obj.kind.as_deref(), Some("PersistentVolumeClaim"));
    assert_eq!(obj.api_version.as_deref(), Some("v1"));
    assert_eq!(obj.namespace.as_deref(), Some(NS));
    assert_eq!(obj.uid.as_deref(), Some(uid.as_str()));
    let component = format!("csi-pv-monitor-controller-{DRIVER}");
    assert_eq!(
        ev.source.as_ref().and_then(|s| s.component.as_deref()),
        Some(component.as_str())
    );
    assert_eq!(ev.reporting_component.as_deref(), Some(component.as_str()));
    assert!(ev.metadata.name.unwrap().starts_with("a."));

    // Several passes with nothing new: still one event, written once.
    let from = env.calls.count(Method::ListVolumes);
    more_calls(&env, Method::ListVolumes, from, 4).await;
    assert_eq!(
        env.said("a").await,
        [(ABNORMAL.into(), "disk gone".into(), 1)]
    );
    assert!(env.said("b").await.is_empty());

    env.driver.set_condition("vol-a", None);
    env.wait_event("a", NORMAL, HEALTHY_AGAIN, 1).await;
    let from = env.calls.count(Method::ListVolumes);
    more_calls(&env, Method::ListVolumes, from, 4).await;
    let said = env.said("a").await;
    assert_eq!(
        said,
        [
            (ABNORMAL.into(), "disk gone".into(), 1),
            (NORMAL.into(), HEALTHY_AGAIN.into(), 1)
        ]
    );

    env.driver
        .set_condition("vol-a", Some("disk back, read-only"));
    env.wait_event("a", ABNORMAL, "disk back, read-only", 1)
        .await;
    assert!(env.said("b").await.is_empty());
}

/// Checklist 7 and the "page by page": a driver that answers two volumes a page is
/// followed to its last page; a second page that fails drops the pass, and no event is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_volumes_follows_every_page_and_a_failed_page_drops_the_pass() {
    let mut cfg = driver_config(&["vol-a", "vol-b", "vol-c", "vol-d", "vol-e"], true);
    cfg.list_volumes_page = Some(2);
    let env = Env::new(KubeVersion::V1_36_2, cfg).await;
    env.driver.set_condition("vol-e", Some("last page"));
    env.bound_claim("e", "vol-e").await;
    let _m = env.monitor(&["--list-volumes-interval=300ms"]);
    env.wait_event("e", ABNORMAL, "last page", 1).await;
    assert!(env.calls.count(Method::ListVolumes) >= 3);

    let mut cfg = driver_config(&["vol-a", "vol-b", "vol-c"], true);
    cfg.list_volumes_page = Some(2);
    cfg.faults.insert(
        Method::ListVolumes,
        Fault {
            fail_after: Some(1),
            ..Fault::default()
        },
    );
    let env = Env::new(KubeVersion::V1_36_2, cfg).await;
    env.driver.set_condition("vol-a", Some("first page"));
    env.bound_claim("a", "vol-a").await;
    let m = env.monitor(&["--list-volumes-interval=300ms"]);
    more_calls(&env, Method::ListVolumes, 0, 3).await;
    env.poll("the failed pass logged", || async {
        m.log()
            .contains("Check controller volume status error")
            .then_some(())
    })
    .await;
    assert!(
        m.log().contains(
            "failed to list volumes: rpc error: code = Unavailable desc = injected failure"
        ),
        "{}",
        m.log()
    );
    assert!(env.said("a").await.is_empty());
}

/// Checklist 11, 12, 24 on the ControllerGetVolume path: an abnormal Bound volume gets its
/// event; a PV bound after start is picked up (upstream never checks a PV it once found
/// unbound); a volume the driver does not know (NOT_FOUND) gets no event and is checked again;
/// another driver's PV is never asked about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_volume_checks_bound_pvs_and_picks_up_late_binders() {
    let env = Env::new(
        KubeVersion::V1_36_2,
        driver_config(&["vol-a", "vol-b"], false),
    )
    .await;
    env.driver.set_condition("vol-a", Some("slow disk"));
    env.driver.set_condition("vol-b", Some("late"));
    env.bound_claim("a", "vol-a").await;
    env.bound_claim("gone", "vol-unknown").await;
    env.bound_claim_of("foreign", "another.csi.test", "vol-b")
        .await;
    env.bound_claim("late", "vol-b").await;
    env.set_phase("late", "Available").await;
    let m = env.monitor(&["--monitor-interval=200ms", "--worker-threads=2"]);

    env.wait_event("a", ABNORMAL, "slow disk", 1).await;
    env.poll("vol-unknown asked twice", || async {
        let asked = env
            .calls
            .get_volume_requests()
            .iter()
            .filter(|id| id.as_str() == "vol-unknown")
            .count();
        (asked >= 2).then_some(())
    })
    .await;
    assert!(env.said("gone").await.is_empty());
    assert!(m.log().contains("Check controller volume status error"));

    env.set_phase("late", "Bound").await;
    env.wait_event("late", ABNORMAL, "late", 1).await;
    assert!(env.said("foreign").await.is_empty());
    // Only this driver's handles were asked about (vol-b only once "late" was Bound).
    for id in env.calls.get_volume_requests() {
        assert!(
            ["vol-a", "vol-b", "vol-unknown"].contains(&id.as_str()),
            "{id}"
        );
    }
    assert_eq!(env.said("a").await.len(), 1);
}

/// A restarted monitor remembers what the claims' live events say: an abnormal volume it
/// already reported is not reported again, and its recovery is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_monitor_neither_repeats_a_report_nor_misses_a_recovery() {
    let env = Env::new(KubeVersion::V1_36_2, driver_config(&["vol-a"], true)).await;
    env.driver.set_condition("vol-a", Some("disk gone"));
    env.bound_claim("a", "vol-a").await;
    let mut first = env.monitor(&["--list-volumes-interval=300ms"]);
    env.wait_event("a", ABNORMAL, "disk gone", 1).await;
    first.kill();

    let m = env.monitor(&["--list-volumes-interval=300ms"]);
    env.poll("the second monitor's passes", || async {
        (m.log().matches("ListVolumes pass done").count() >= 3).then_some(())
    })
    .await;
    assert_eq!(
        env.said("a").await,
        [(ABNORMAL.into(), "disk gone".into(), 1)]
    );
    env.driver.set_condition("vol-a", None);
    env.wait_event("a", NORMAL, HEALTHY_AGAIN, 1).await;
}

/// The v1.20.2 API server: the same events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_20_reports_abnormal_volumes_and_their_recovery() {
    let env = Env::new(KubeVersion::V1_20_2, driver_config(&["vol-a"], true)).await;
    env.driver.set_condition("vol-a", Some("disk gone"));
    env.bound_claim("a", "vol-a").await;
    let _m = env.monitor(&["--list-volumes-interval=300ms"]);
    env.wait_event("a", ABNORMAL, "disk gone", 1).await;
    env.driver.set_condition("vol-a", None);
    env.wait_event("a", NORMAL, HEALTHY_AGAIN, 1).await;
}

/// Checklist 19: a volume whose message keeps changing gets its first nine messages as events
/// of their own, and from the tenth different one within ten minutes on one combined event
/// (client-go's aggregation: "(combined from similar events): " and the latest message, its
/// count growing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_keeps_changing_is_combined_as_client_go_combines_it() {
    let env = Env::new(KubeVersion::V1_36_2, driver_config(&["vol-a"], true)).await;
    env.bound_claim("a", "vol-a").await;
    let _m = env.monitor(&["--list-volumes-interval=200ms"]);
    for i in 0..12 {
        env.driver
            .set_condition("vol-a", Some(&format!("error {i}")));
        env.wait_event_containing("a", ABNORMAL, &format!("error {i}"))
            .await;
    }
    let said = env.said("a").await;
    let own: Vec<_> = said
        .iter()
        .filter(|(_, m, _)| !m.starts_with("(combined"))
        .map(|(_, m, _)| m.clone())
        .collect();
    assert_eq!(
        own,
        (0..9).map(|i| format!("error {i}")).collect::<Vec<_>>()
    );
    let combined: Vec<_> = said
        .iter()
        .filter(|(_, m, _)| m.starts_with("(combined from similar events): "))
        .collect();
    assert_eq!(combined.len(), 1, "{said:?}");
    assert_eq!(
        combined[0].1, "(combined from similar events): error 11",
        "{said:?}"
    );
    assert_eq!(combined[0].2, 3);
}
