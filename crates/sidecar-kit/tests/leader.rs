//! Leader election against a real kube-apiserver (v1.20.2 and v1.36.2): one of two candidates
//! leads and labels the Lease and records its event; when the leader dies the standby takes
//! over, never before the lease expired; a leader whose lease was taken stops leading; a
//! released lease is taken at once; bad timings are refused before any API call.
//!
//! Timings are short (lease 2 s, renew deadline 1.5 s, retry 0.5 s) so that a take-over
//! happens within seconds; the deadlines below are generous bounds for a busy machine, not
//! measurements.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use plugreg_sidecar_kit::leader::{LeaderElection, LeaderError, LeaderHealth};
use plugreg_testpeers::{ApiServer, KubeVersion};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);
const NS: &str = "default";

/// A unique Lease name per test and release (tests share one API server per release).
fn lease_name(test: &str, version: KubeVersion) -> String {
    format!("{test}-{}", version.as_str().replace('.', "-"))
}

fn election(lease: &str, identity: &str) -> LeaderElection {
    let mut e = LeaderElection::new(NS, lease, identity);
    e.lease_duration = Duration::from_secs(2);
    e.renew_deadline = Duration::from_millis(1500);
    e.retry_period = Duration::from_millis(500);
    e.labels = BTreeMap::from([("plugreg.io/test".to_owned(), "leader".to_owned())]);
    e
}

/// A running candidate: its task, its health, and the identity it sends when it leads.
struct Candidate {
    task: JoinHandle<Result<(), LeaderError>>,
    health: LeaderHealth,
    shutdown: CancellationToken,
}

/// Starts `e` in its own task; when it leads it sends its identity on `leading` and works until
/// told to stop.
fn spawn(
    e: LeaderElection,
    client: kube::Client,
    leading: mpsc::UnboundedSender<String>,
) -> Candidate {
    let health = LeaderHealth::new();
    let shutdown = CancellationToken::new();
    let id = e.identity.clone();
    let task = tokio::spawn(e.run(
        client,
        health.clone(),
        shutdown.clone(),
        move |stop| async move {
            let _ = leading.send(id);
            stop.cancelled().await;
        },
    ));
    Candidate {
        task,
        health,
        shutdown,
    }
}

async fn next_leader(rx: &mut mpsc::UnboundedReceiver<String>, what: &str) -> String {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .unwrap_or_else(|_| panic!("{what}: nobody led within {WAIT:?}"))
        .expect("candidates alive")
}

async fn get_lease(leases: &Api<Lease>, name: &str) -> Lease {
    leases.get(name).await.expect("get lease")
}

fn holder(l: &Lease) -> String {
    l.spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .unwrap_or_default()
}

fn renew_micros(l: &Lease) -> i64 {
    l.spec
        .as_ref()
        .and_then(|s| s.renew_time.as_ref())
        .map(|t| t.0.as_microsecond())
        .expect("renewTime")
}

/// Waits until the Lease has been renewed `n` more times (its renewTime moved).
async fn wait_renewals(leases: &Api<Lease>, name: &str, n: usize) -> Lease {
    let deadline = Instant::now() + WAIT;
    let mut last = renew_micros(&get_lease(leases, name).await);
    let mut seen = 0;
    loop {
        let l = get_lease(leases, name).await;
        let r = renew_micros(&l);
        if r != last {
            seen += 1;
            last = r;
            if seen >= n {
                return l;
            }
        }
        assert!(
            Instant::now() < deadline,
            "lease {name} not renewed {n} times"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn one_leads_and_the_standby_takes_over(version: KubeVersion) {
    let server = ApiServer::shared(version).await.expect("apiserver");
    let client = server.client().await.expect("client");
    let name = lease_name("takeover", version);
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let a = spawn(election(&name, "cand-a"), client.clone(), tx.clone());
    let b = spawn(election(&name, "cand-b"), client.clone(), tx);
    let mut candidates = BTreeMap::from([("cand-a".to_owned(), a), ("cand-b".to_owned(), b)]);

    let first = next_leader(&mut rx, "first").await;
    let leader = candidates.remove(&first).expect("a candidate");
    let (standby_id, standby) = candidates.pop_first().expect("the other");
    assert!(leader.health.is_leader());

    // The leader renews while the standby waits: three renewals and still one leader.
    let lease = wait_renewals(&leases, &name, 3).await;
    assert!(rx.try_recv().is_err(), "two leaders at once");
    assert!(!standby.health.is_leader());
    assert_eq!(holder(&lease), first);
    let spec = lease.spec.clone().expect("spec");
    assert_eq!(spec.lease_duration_seconds, Some(2));
    assert_eq!(spec.lease_transitions, Some(0));
    assert!(spec.acquire_time.is_some());
    assert_eq!(
        lease
            .metadata
            .labels
            .unwrap_or_default()
            .get("plugreg.io/test")
            .map(String::as_str),
        Some("leader")
    );

    // Its event on the Lease.
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let want = format!("{first} became leader");
    let deadline = Instant::now() + WAIT;
    loop {
        let list = events
            .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
            .await
            .expect("list events");
        if let Some(ev) = list
            .items
            .iter()
            .find(|e| e.message.as_deref() == Some(&want))
        {
            assert_eq!(ev.reason.as_deref(), Some("LeaderElection"));
            assert_eq!(ev.type_.as_deref(), Some("Normal"));
            assert_eq!(ev.involved_object.kind.as_deref(), Some("Lease"));
            assert_eq!(
                ev.source.as_ref().and_then(|s| s.component.clone()),
                Some(format!("{name}/{first}"))
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no LeaderElection event: {:?}",
            list.items
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The leader dies without a word (as a killed process): the standby takes over once the
    // lease has expired.
    leader.task.abort();
    let _ = leader.task.await;
    let killed_at = Instant::now();
    let last = get_lease(&leases, &name).await;
    assert_eq!(holder(&last), first);
    let second = next_leader(&mut rx, "after the leader died").await;
    eprintln!(
        "{version}: take-over {:?} after the kill",
        killed_at.elapsed()
    );
    assert_eq!(second, standby_id);
    assert!(standby.health.is_leader());
    assert_eq!(standby.health.check(), Ok(()));
    let now = get_lease(&leases, &name).await;
    assert_eq!(holder(&now), second);
    let spec = now.spec.clone().expect("spec");
    assert_eq!(spec.lease_transitions, Some(1));
    // Never before the old lease expired: the new acquireTime is at least one lease duration
    // after the old holder's last renewal.
    let acquired = spec.acquire_time.expect("acquireTime").0.as_microsecond();
    assert!(
        acquired - renew_micros(&last) >= 2_000_000,
        "acquired {} µs after the last renewal",
        acquired - renew_micros(&last)
    );
    standby.task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leads_and_the_standby_takes_over_v1_20_2() {
    one_leads_and_the_standby_takes_over(KubeVersion::V1_20_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leads_and_the_standby_takes_over_v1_36_2() {
    one_leads_and_the_standby_takes_over(KubeVersion::V1_36_2).await;
}

async fn a_leader_whose_lease_was_taken_stops_leading(version: KubeVersion) {
    let server = ApiServer::shared(version).await.expect("apiserver");
    let client = server.client().await.expect("client");
    let name = lease_name("taken", version);
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let a = spawn(election(&name, "cand-a"), client.clone(), tx);
    assert_eq!(next_leader(&mut rx, "a").await, "cand-a");

    // Another holder writes itself into the Lease with a long lease (again if the leader's
    // renewal got in between our read and our write).
    loop {
        let mut lease = get_lease(&leases, &name).await;
        let spec = lease.spec.as_mut().expect("spec");
        spec.holder_identity = Some("intruder".to_owned());
        spec.lease_duration_seconds = Some(3600);
        spec.renew_time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
            k8s_openapi::jiff::Timestamp::now(),
        ));
        match leases.replace(&name, &PostParams::default(), &lease).await {
            Ok(_) => break,
            Err(kube::Error::Api(s)) if s.is_conflict() => continue,
            Err(e) => panic!("take the lease: {e}"),
        }
    }

    let ended = tokio::time::timeout(WAIT, a.task)
        .await
        .expect("the leader stops within the deadline")
        .expect("no panic");
    match ended {
        Err(LeaderError::Lost { name: n, .. }) => assert_eq!(n, name),
        other => panic!("expected Lost, got {other:?}"),
    }
    assert!(!a.health.is_leader());
    assert_eq!(holder(&get_lease(&leases, &name).await), "intruder");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_lease_was_taken_stops_leading_v1_20_2() {
    a_leader_whose_lease_was_taken_stops_leading(KubeVersion::V1_20_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_lease_was_taken_stops_leading_v1_36_2() {
    a_leader_whose_lease_was_taken_stops_leading(KubeVersion::V1_36_2).await;
}

async fn a_released_lease_is_taken_at_once(version: KubeVersion) {
    let server = ApiServer::shared(version).await.expect("apiserver");
    let client = server.client().await.expect("client");
    let name = lease_name("released", version);
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut e = election(&name, "cand-a");
    // A long lease: only a release lets the next candidate in quickly.
    e.lease_duration = Duration::from_secs(3600);
    e.release_on_cancel = true;
    let a = spawn(e, client.clone(), tx.clone());
    assert_eq!(next_leader(&mut rx, "a").await, "cand-a");

    a.shutdown.cancel();
    let ended = tokio::time::timeout(WAIT, a.task)
        .await
        .expect("a clean shutdown ends the election")
        .expect("no panic");
    assert!(ended.is_ok(), "{ended:?}");
    let released = get_lease(&leases, &name).await;
    assert_eq!(holder(&released), "");
    let spec = released.spec.expect("spec");
    assert_eq!(spec.lease_duration_seconds, Some(1));
    assert_eq!(spec.lease_transitions, Some(0));

    let mut e = election(&name, "cand-b");
    e.lease_duration = Duration::from_secs(3600);
    let b = spawn(e, client, tx);
    assert_eq!(next_leader(&mut rx, "b").await, "cand-b");
    let taken = get_lease(&leases, &name).await;
    assert_eq!(taken.spec.and_then(|s| s.lease_transitions), Some(1));
    b.task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_lease_is_taken_at_once_v1_20_2() {
    a_released_lease_is_taken_at_once(KubeVersion::V1_20_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_lease_is_taken_at_once_v1_36_2() {
    a_released_lease_is_taken_at_once(KubeVersion::V1_36_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_timings_are_refused_before_any_call() {
    let server = ApiServer::shared(KubeVersion::V1_20_2)
        .await
        .expect("apiserver");
    let client = server.client().await.expect("client");
    let name = "refused";
    let mut e = election(name, "cand-a");
    e.renew_deadline = Duration::from_millis(600); // = 1.2 × retry period: not enough
    let ended = e
        .run(
            client.clone(),
            LeaderHealth::new(),
            CancellationToken::new(),
            |_| async { panic!("must not lead") },
        )
        .await;
    match ended {
        Err(LeaderError::Invalid(m)) => {
            assert!(
                m.contains("renewDeadline must be greater than retryPeriod*JitterFactor"),
                "{m}"
            )
        }
        other => panic!("expected Invalid, got {other:?}"),
    }
    let leases: Api<Lease> = Api::namespaced(client, NS);
    assert!(leases.get_opt(name).await.expect("get").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_before_leading_returns_without_taking_the_lease() {
    let server = ApiServer::shared(KubeVersion::V1_36_2)
        .await
        .expect("apiserver");
    let client = server.client().await.expect("client");
    let name = "held-elsewhere";
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut e = election(name, "holder");
    e.lease_duration = Duration::from_secs(3600);
    let holder_task = spawn(e, client.clone(), tx.clone());
    assert_eq!(next_leader(&mut rx, "holder").await, "holder");

    let mut e = election(name, "waiter");
    e.lease_duration = Duration::from_secs(3600);
    let waiter = spawn(e, client, tx);
    // The waiter has seen the lease held (its first attempts are done) before it is stopped.
    wait_renewals(&leases, name, 2).await;
    waiter.shutdown.cancel();
    let ended = tokio::time::timeout(WAIT, waiter.task)
        .await
        .expect("ends")
        .expect("no panic");
    assert!(ended.is_ok(), "{ended:?}");
    assert!(rx.try_recv().is_err(), "the waiter never led");
    assert_eq!(holder(&get_lease(&leases, name).await), "holder");
    holder_task.task.abort();
}
