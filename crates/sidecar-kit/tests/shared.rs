//! The shared watches (`shared::Hub`, as `csi-sidecars` runs them) against a real
//! kube-apiserver v1.36.2: one list-and-watch per kind and selection serves caches of
//! different shapes; a cache that joins late gets the whole list (and the others a re-list they
//! take in their stride); caches that join together share one list; changes and deletions
//! reach every cache; a cache that stops leaves the others served.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{Compact, compact, config_map};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use plugreg_sidecar_kit::cache::{self, CompactStore, Keyed, Watches};
use plugreg_sidecar_kit::shared::Hub;
use plugreg_testpeers::{ApiServer, KubeVersion};
use tokio_util::sync::CancellationToken;

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn ready(ready: Vec<futures::future::BoxFuture<'static, Result<(), ()>>>) {
    for r in ready {
        tokio::time::timeout(Duration::from_secs(30), r)
            .await
            .expect("ready within 30 s")
            .expect("the first list is in");
    }
}

fn stored(store: &CompactStore<Compact>, name: &str) -> Option<String> {
    store
        .get(&format!("default/{name}"))
        .map(|v| v.value.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_watch_serves_every_cache_and_a_late_one_gets_the_whole_list() {
    let api = ApiServer::shared(KubeVersion::V1_36_2).await.unwrap();
    let client = api.client().await.unwrap();
    let label = format!("hub-{}", std::process::id());
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let (a, b) = (format!("{label}-a"), format!("{label}-b"));
    for (name, v) in [(&a, "1"), (&b, "2")] {
        cms.create(&PostParams::default(), &config_map(name, &label, v))
            .await
            .unwrap();
    }
    let hub = Hub::new(client.clone());
    let watches = Watches::shared(Arc::clone(&hub));
    let selected = watcher::Config::default().labels(&format!("test={label}"));

    // A compact cache first; its handler records what the store held at each event.
    let stop_first = CancellationToken::new();
    let mut r = Vec::new();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Compact, bool, Option<Compact>)>();
    let slot = Arc::new(std::sync::OnceLock::<CompactStore<Compact>>::new());
    let held_by = Arc::clone(&slot);
    let first = cache::watch_compact::<ConfigMap, _>(
        &watches,
        selected.clone(),
        &stop_first,
        &mut r,
        compact,
        move |v: &Compact, deleted| {
            let held = held_by
                .get()
                .and_then(|s| s.get(v.key()))
                .map(|h| (*h).clone());
            let _ = tx.send((v.clone(), deleted, held));
        },
    );
    slot.set(first.clone()).ok().unwrap();
    ready(r).await;
    assert_eq!(first.len(), 2);
    let set = |v: &str| Patch::Merge(serde_json::json!({"data": {"v": v}}));
    cms.patch(&a, &PatchParams::default(), &set("10"))
        .await
        .unwrap();
    until("the first cache sees the change", || {
        stored(&first, &a).as_deref() == Some("10")
    })
    .await;

    // A reflector cache of another shape joins late: it gets the whole list, the change in it.
    let stop_second = CancellationToken::new();
    let mut r = Vec::new();
    let second = cache::watch_selected::<ConfigMap>(
        &watches,
        selected.clone(),
        &stop_second,
        &mut r,
        |cm| cm.metadata.labels = None,
        |_, _| {},
    );
    ready(r).await;
    assert_eq!(second.state().len(), 2);
    let of = |name: &str| {
        second
            .state()
            .iter()
            .find(|cm| cm.metadata.name.as_deref() == Some(name))
            .and_then(|cm| cm.data.as_ref()?.get("v").cloned())
    };
    assert_eq!(of(&a).as_deref(), Some("10"));
    assert!(
        second.state().iter().all(|cm| cm.metadata.labels.is_none()),
        "each cache trims its own copy"
    );
    assert_eq!(hub.watches_started(), 1, "one watch for both");
    assert_eq!(hub.lists_started(), 2, "the late cache's join listed again");
    // The first cache took the re-list the second one's joining caused: every object handed
    // over with the store already holding it as listed.
    let mut relisted = BTreeMap::new();
    while let Ok((v, deleted, held)) = rx.try_recv() {
        assert!(!deleted, "{v:?}");
        assert_eq!(
            held.as_ref(),
            Some(&v),
            "the store holds what the handler is given"
        );
        relisted.insert(v.key.to_string(), v.value.to_string());
    }
    assert_eq!(
        relisted.get(&format!("default/{a}")).map(String::as_str),
        Some("10")
    );

    // A deletion and a change reach both.
    cms.delete(&b, &DeleteParams::default()).await.unwrap();
    cms.patch(&a, &PatchParams::default(), &set("11"))
        .await
        .unwrap();
    until("both see the deletion and the change", || {
        first.len() == 1
            && second.state().len() == 1
            && stored(&first, &a).as_deref() == Some("11")
            && of(&a).as_deref() == Some("11")
    })
    .await;

    // Another selection is another watch.
    let mut r = Vec::new();
    let _other = cache::watch_selected::<ConfigMap>(
        &watches,
        watcher::Config::default().labels("test=nothing-here"),
        &stop_second,
        &mut r,
        |_| {},
        |_, _| {},
    );
    ready(r).await;
    assert_eq!(hub.watches_started(), 2);

    // The first cache stops; the second is still served.
    stop_first.cancel();
    cms.patch(&a, &PatchParams::default(), &set("12"))
        .await
        .unwrap();
    until("the second cache still sees changes", || {
        of(&a).as_deref() == Some("12")
    })
    .await;
    stop_second.cancel();
}

/// Controllers of one process start within milliseconds of each other: caches that join a
/// watch before its list has started (within `shared::QUIET` of each other) share one list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caches_that_join_together_share_one_list() {
    let api = ApiServer::shared(KubeVersion::V1_36_2).await.unwrap();
    let client = api.client().await.unwrap();
    let label = format!("hub-together-{}", std::process::id());
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    for (i, v) in ["1", "2", "3"].iter().enumerate() {
        cms.create(
            &PostParams::default(),
            &config_map(&format!("{label}-{i}"), &label, v),
        )
        .await
        .unwrap();
    }
    let hub = Hub::new(client.clone());
    let watches = Watches::shared(Arc::clone(&hub));
    let selected = watcher::Config::default().labels(&format!("test={label}"));
    let stop = CancellationToken::new();
    let mut r = Vec::new();
    let caches: Vec<CompactStore<Compact>> = (0..3)
        .map(|_| {
            cache::watch_compact::<ConfigMap, _>(
                &watches,
                selected.clone(),
                &stop,
                &mut r,
                compact,
                |_: &Compact, _| {},
            )
        })
        .collect();
    ready(r).await;
    for c in &caches {
        assert_eq!(c.len(), 3, "every cache has the whole list");
    }
    assert_eq!(hub.watches_started(), 1);
    assert_eq!(hub.lists_started(), 1, "one list for the three");
    stop.cancel();
}
