//! The event recorder against real kube-apiservers (v1.20.2 and v1.36.2): the Event's fields
//! as client-go writes them, a repeated event as a higher count on one object, cluster-scoped
//! objects' events in `default`, the spam filter, and the queue's bound when the server is
//! unreachable.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, ObjectReference};
use kube::api::{Api, ListParams};
use plugreg_sidecar_kit::events::{EventType, QUEUE_BOUND, Recorder};
use plugreg_testpeers::{ApiServer, KubeVersion};
use tokio_util::sync::CancellationToken;

const COMPONENT: &str = "test.csi.plugreg.io_host-1_7f3a";

fn claim(name: &str) -> ObjectReference {
    ObjectReference {
        kind: Some("PersistentVolumeClaim".into()),
        namespace: Some("default".into()),
        name: Some(name.into()),
        uid: Some(format!("uid-{name}")),
        api_version: Some("v1".into()),
        resource_version: Some("42".into()),
        ..ObjectReference::default()
    }
}

/// The events about the object named `name` in `namespace`.
async fn events_of(client: &kube::Client, namespace: &str, name: &str) -> Vec<Event> {
    Api::<Event>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
        .await
        .unwrap()
        .items
}

/// Polls the events of `name` until `done` holds for them (fails after 30 s).
async fn wait_events(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    done: impl Fn(&[Event]) -> bool,
) -> Vec<Event> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let events = events_of(client, namespace, name).await;
        if done(&events) {
            return events;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out; events of {name}: {events:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn fields_as_client_go_writes_them(version: KubeVersion) {
    let api = ApiServer::shared(version).await.unwrap();
    let client = api.client().await.unwrap();
    let shutdown = CancellationToken::new();
    let recorder = Recorder::start(client.clone(), COMPONENT, "node-1", shutdown.clone());
    let name = format!("fields-{}", version.as_str());
    let object = claim(&name);
    let long = "x".repeat(2000);
    recorder.event(&object, EventType::Warning, "ProvisioningFailed", &long);
    let events = wait_events(&client, "default", &name, |e| !e.is_empty()).await;
    assert_eq!(events.len(), 1);
    let e = &events[0];
    let ev_name = e.metadata.name.as_deref().unwrap();
    let (prefix, hex) = ev_name.rsplit_once('.').unwrap();
    assert_eq!(prefix, name);
    assert_eq!(hex.len(), 16, "{ev_name}");
    assert!(
        hex.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    );
    assert_eq!(e.involved_object, object);
    assert_eq!(e.type_.as_deref(), Some("Warning"));
    assert_eq!(e.reason.as_deref(), Some("ProvisioningFailed"));
    assert_eq!(e.message.as_deref(), Some(&long[..1024]));
    assert_eq!(e.count, Some(1));
    let source = e.source.as_ref().unwrap();
    assert_eq!(source.component.as_deref(), Some(COMPONENT));
    assert_eq!(source.host.as_deref(), Some("node-1"));
    assert_eq!(e.reporting_component.as_deref(), Some(COMPONENT));
    assert_eq!(e.reporting_instance.as_deref(), Some("node-1"));
    assert!(e.first_timestamp.is_some());
    assert_eq!(e.first_timestamp, e.last_timestamp);
    // The hex is the creation time in nanoseconds: the same second as firstTimestamp.
    let nanos = i128::from_str_radix(hex, 16).unwrap();
    assert_eq!(
        nanos / 1_000_000_000,
        i128::from(e.first_timestamp.as_ref().unwrap().0.as_second())
    );
    shutdown.cancel();
}

async fn a_repeated_event_raises_the_count(version: KubeVersion) {
    let api = ApiServer::shared(version).await.unwrap();
    let client = api.client().await.unwrap();
    let shutdown = CancellationToken::new();
    let recorder = Recorder::start(client.clone(), COMPONENT, "", shutdown.clone());
    let name = format!("repeated-{}", version.as_str());
    let object = claim(&name);
    let msg = format!("External provisioner is provisioning volume for claim \"default/{name}\"");
    recorder.event(&object, EventType::Normal, "Provisioning", &msg);
    let first = wait_events(&client, "default", &name, |e| !e.is_empty()).await;
    for _ in 0..2 {
        recorder.event(&object, EventType::Normal, "Provisioning", &msg);
    }
    let events = wait_events(&client, "default", &name, |e| {
        e.iter().any(|e| e.count == Some(3))
    })
    .await;
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0].metadata.name, first[0].metadata.name);
    assert_eq!(events[0].first_timestamp, first[0].first_timestamp);
    assert_eq!(events[0].source.as_ref().unwrap().host, None);
    // Go's field has no omitempty: the server shows "".
    assert_eq!(events[0].reporting_instance.as_deref().unwrap_or(""), "");

    // Another reason is another event.
    recorder.event(&object, EventType::Normal, "ProvisioningSucceeded", "ok");
    let events = wait_events(&client, "default", &name, |e| e.len() == 2).await;
    assert!(events.iter().any(|e| e.count == Some(3)));
    shutdown.cancel();
}

async fn a_cluster_scoped_objects_events_go_to_default(version: KubeVersion) {
    let api = ApiServer::shared(version).await.unwrap();
    let client = api.client().await.unwrap();
    let shutdown = CancellationToken::new();
    let recorder = Recorder::start(client.clone(), COMPONENT, "", shutdown.clone());
    let name = format!("pv-{}", version.as_str());
    let pv = ObjectReference {
        kind: Some("PersistentVolume".into()),
        name: Some(name.clone()),
        uid: Some("uid-pv".into()),
        api_version: Some("v1".into()),
        ..ObjectReference::default()
    };
    recorder.event(&pv, EventType::Warning, "VolumeFailedDelete", "rpc error");
    let events = wait_events(&client, "default", &name, |e| !e.is_empty()).await;
    assert_eq!(events[0].metadata.namespace.as_deref(), Some("default"));
    assert_eq!(events[0].involved_object.namespace, None);
    shutdown.cancel();
}

async fn the_spam_filter_stops_at_25_per_object(version: KubeVersion) {
    let api = ApiServer::shared(version).await.unwrap();
    let client = api.client().await.unwrap();
    let shutdown = CancellationToken::new();
    let recorder = Recorder::start(client.clone(), COMPONENT, "", shutdown.clone());
    let name = format!("spam-{}", version.as_str());
    let object = claim(&name);
    for _ in 0..30 {
        recorder.event(&object, EventType::Warning, "ProvisioningFailed", "same");
    }
    // Events are written in order: once this one is there, the 30 have been handled.
    let sentinel = format!("spam-sentinel-{}", version.as_str());
    recorder.event(&claim(&sentinel), EventType::Normal, "Done", "done");
    wait_events(&client, "default", &sentinel, |e| !e.is_empty()).await;
    let events = events_of(&client, "default", &name).await;
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0].count, Some(25));
    shutdown.cancel();
}

#[tokio::test]
async fn v1_20_fields_as_client_go_writes_them() {
    fields_as_client_go_writes_them(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn v1_36_fields_as_client_go_writes_them() {
    fields_as_client_go_writes_them(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn v1_20_a_repeated_event_raises_the_count() {
    a_repeated_event_raises_the_count(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn v1_36_a_repeated_event_raises_the_count() {
    a_repeated_event_raises_the_count(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn v1_20_a_cluster_scoped_objects_events_go_to_default() {
    a_cluster_scoped_objects_events_go_to_default(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn v1_36_a_cluster_scoped_objects_events_go_to_default() {
    a_cluster_scoped_objects_events_go_to_default(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn v1_20_the_spam_filter_stops_at_25_per_object() {
    the_spam_filter_stops_at_25_per_object(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn v1_36_the_spam_filter_stops_at_25_per_object() {
    the_spam_filter_stops_at_25_per_object(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn the_queue_stays_bounded_while_the_server_is_unreachable() {
    // A port nobody listens on: every write fails to connect, the writer retries its first
    // event and the queue fills.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let shutdown = CancellationToken::new();
    let recorder = Recorder::start(client, COMPONENT, "", shutdown.clone());
    const PUSHED: usize = 5 * QUEUE_BOUND;
    let mut max_queued = 0;
    for i in 0..PUSHED {
        // Distinct objects, so that the spam filter drops none of them.
        recorder.event(
            &claim(&format!("unreachable-{i}")),
            EventType::Warning,
            "ProvisioningFailed",
            "x",
        );
        max_queued = max_queued.max(recorder.queued());
    }
    assert!(max_queued <= QUEUE_BOUND, "{max_queued}");
    assert!(
        recorder.queued() >= QUEUE_BOUND - 1,
        "{}",
        recorder.queued()
    );
    let dropped = recorder.dropped();
    assert!(
        dropped >= (PUSHED - QUEUE_BOUND - 1) as u64 && dropped <= (PUSHED - QUEUE_BOUND) as u64,
        "{dropped}"
    );
    shutdown.cancel();
}
