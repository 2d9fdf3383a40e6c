//! The compact watch cache (`cache::watch_compact`) against real kube-apiservers (v1.20.2 and
//! v1.36.2): ready once the objects that existed are listed, every listed, changed and deleted
//! object reported with the store already showing the change, values found by their own key,
//! and a readiness that fails when the cache stops before its first list.

mod common;

use std::time::Duration;

use common::{Compact, compact, config_map};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use plugreg_sidecar_kit::cache::{self, CompactStore, Keyed};
use plugreg_testpeers::{ApiServer, KubeVersion};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What a callback saw: the value, whether the object was deleted, and what the store held
/// under its key at that moment.
type Seen = (Compact, bool, Option<Compact>);

async fn next(rx: &mut mpsc::UnboundedReceiver<Seen>) -> Seen {
    tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("a callback within 30 s")
        .expect("the cache is running")
}

async fn lists_applies_and_deletes(version: KubeVersion) {
    let api = ApiServer::shared(version).await.unwrap();
    let client = api.client().await.unwrap();
    let label = format!("compact-{}", version.as_str().replace('.', "-"));
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let (a, b) = (format!("{label}-a"), format!("{label}-b"));
    for (name, value) in [(&a, "1"), (&b, "2")] {
        cms.create(&PostParams::default(), &config_map(name, &label, value))
            .await
            .unwrap();
    }

    let shutdown = CancellationToken::new();
    let mut ready = Vec::new();
    let (tx, mut rx) = mpsc::unbounded_channel();
    // The callback reads the store through a second handle of it.
    let slot = std::sync::Arc::new(std::sync::OnceLock::<CompactStore<Compact>>::new());
    let seen_store = std::sync::Arc::clone(&slot);
    let store = cache::watch_compact::<ConfigMap, _>(
        &cache::Watches::own(client.clone()),
        watcher::Config::default().labels(&format!("test={label}")),
        &shutdown,
        &mut ready,
        compact,
        move |v: &Compact, deleted| {
            let held = seen_store
                .get()
                .and_then(|s| s.get(v.key()))
                .map(|h| (*h).clone());
            tx.send((v.clone(), deleted, held)).unwrap();
        },
    );
    slot.set(store.clone()).ok().unwrap();
    for r in ready {
        tokio::time::timeout(Duration::from_secs(30), r)
            .await
            .expect("ready within 30 s")
            .expect("the first list is in");
    }
    // Both listed (in any order), both stored, under `namespace/name`.
    let mut listed = vec![next(&mut rx).await.0, next(&mut rx).await.0];
    listed.sort_by(|x, y| x.key.cmp(&y.key));
    let key_a = format!("default/{a}");
    let key_b = format!("default/{b}");
    assert_eq!(
        listed,
        [
            Compact {
                key: key_a.clone().into(),
                value: "1".into()
            },
            Compact {
                key: key_b.clone().into(),
                value: "2".into()
            },
        ]
    );
    assert_eq!(store.len(), 2);
    assert_eq!(store.get(&key_a).unwrap().value.as_ref(), "1");
    assert_eq!(store.get(&key_b).unwrap().value.as_ref(), "2");
    assert!(store.get(&a).is_none(), "the key is namespace/name");

    // A change: reported with the store already holding it.
    cms.patch(
        &a,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"data": {"v": "3"}})),
    )
    .await
    .unwrap();
    let (v, deleted, held) = next(&mut rx).await;
    assert_eq!(
        (v.key.as_ref(), v.value.as_ref(), deleted),
        (&*key_a, "3", false)
    );
    assert_eq!(held.unwrap().value.as_ref(), "3");
    assert_eq!(store.get(&key_a).unwrap().value.as_ref(), "3");

    // A deletion: reported with its last value, the store no longer holding it.
    cms.delete(&b, &DeleteParams::default()).await.unwrap();
    let (v, deleted, held) = next(&mut rx).await;
    assert_eq!((v.key.as_ref(), deleted), (&*key_b, true));
    assert_eq!(held, None);
    assert!(store.get(&key_b).is_none());
    assert_eq!(store.len(), 1);
    assert!(store.any(|v| v.value.as_ref() == "3"));
    assert_eq!(store.state().len(), 1);

    shutdown.cancel();
    cms.delete(&a, &DeleteParams::default()).await.unwrap();
}

#[tokio::test]
async fn v1_20_lists_applies_and_deletes() {
    lists_applies_and_deletes(KubeVersion::V1_20_2).await;
}

#[tokio::test]
async fn v1_36_lists_applies_and_deletes() {
    lists_applies_and_deletes(KubeVersion::V1_36_2).await;
}

#[tokio::test]
async fn never_ready_fails_when_stopped() {
    // A port nobody listens on: the first list never comes.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let shutdown = CancellationToken::new();
    let mut ready = Vec::new();
    let store = cache::watch_compact::<ConfigMap, _>(
        &cache::Watches::own(client.clone()),
        watcher::Config::default(),
        &shutdown,
        &mut ready,
        compact,
        |_, _| {},
    );
    let mut r = ready.pop().unwrap();
    assert!(
        futures::FutureExt::now_or_never(&mut r).is_none(),
        "not ready before a list"
    );
    shutdown.cancel();
    let res = tokio::time::timeout(Duration::from_secs(30), r)
        .await
        .expect("the readiness ends once the cache stops");
    assert_eq!(res, Err(()));
    assert!(store.is_empty());
}

#[test]
fn keys_are_namespace_and_name_or_the_name_alone() {
    let mut m = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        name: Some("data".into()),
        namespace: Some("ns".into()),
        ..Default::default()
    };
    assert_eq!(&*cache::store_key(&m), "ns/data");
    m.namespace = None;
    assert_eq!(&*cache::store_key(&m), "data");
}
