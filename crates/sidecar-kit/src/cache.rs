//! Watch caches for the controller sidecars: a cluster-wide reflector of one kind that keeps of
//! each object only what the sidecar's decisions read, tells the sidecar of every change, and
//! says when its first list is in.
//!
//! [`watch`] keeps the trimmed object in kube-runtime's reflector store; [`watch_compact`] keeps
//! a sidecar's own compact form of it, keyed by itself, for the kinds a cluster has as many of
//! as it has volumes. Their events come from [`Watches`]: a watch of the cache's own, or the
//! one watch of that kind that the controllers of `csi-sidecars` share ([`crate::shared`]).

use std::borrow::Borrow;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, PoisonError, RwLock};

use futures::StreamExt as _;
use futures::future::BoxFuture;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;

pub use crate::shared::Watches;
use tokio_util::sync::CancellationToken;

/// Futures that end when a cache has its first full list (`Err` if its writer went away first).
pub type Readiness = Vec<BoxFuture<'static, Result<(), ()>>>;

/// Starts a reflector of `K` (cluster-wide) until `shutdown`, keeping of each object only what
/// `trim` leaves (managed fields are always dropped), calling `on_event` for every object
/// listed or changed (`false`) and deleted (`true`), and pushes its readiness to `ready`.
/// Watch failures are retried with kube-runtime's default back-off and logged.
///
/// A full list (the first, or a re-list after the watch expired) reaches the store only when
/// it is complete, so its objects reach `on_event` then, the store already holding them; the
/// objects the store held and the list no longer has follow, as deleted. A handler that queues
/// a key for a worker that reads the store never has it read an older copy.
pub fn watch<K>(
    source: &Watches,
    shutdown: &CancellationToken,
    ready: &mut Readiness,
    trim: impl Fn(&mut K) + Send + 'static,
    on_event: impl FnMut(&K, bool) + Send + 'static,
) -> Store<K>
where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    watch_selected(
        source,
        watcher::Config::default(),
        shutdown,
        ready,
        trim,
        on_event,
    )
}

/// [`watch`] of only the objects `config` selects (a label selector, as csi-snapshotter's
/// `--node-deployment` watches only its node's contents).
pub fn watch_selected<K>(
    source: &Watches,
    config: watcher::Config,
    shutdown: &CancellationToken,
    ready: &mut Readiness,
    trim: impl Fn(&mut K) + Send + 'static,
    mut on_event: impl FnMut(&K, bool) + Send + 'static,
) -> Store<K>
where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store();
    let stream = source
        .events::<K>(config)
        .modify(move |o: &mut K| {
            o.meta_mut().managed_fields = None;
            trim(o);
        })
        .reflect(writer);
    let stop = shutdown.clone();
    let kind = K::kind(&()).into_owned();
    let store = reader.clone();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        // A full list in progress: the store before it, and the objects listed so far. The
        // reflector applies a list only when it is complete, so its objects are handed over
        // then, when a handler that reads the store finds them there.
        let mut listing: Option<Listing<K>> = None;
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev,
                () = stop.cancelled() => return,
            };
            match ev {
                None => return,
                Some(Ok(watcher::Event::Init)) => listing = Some((store.state(), Vec::new())),
                Some(Ok(watcher::Event::InitApply(o))) => {
                    if let Some((_, listed)) = &mut listing {
                        listed.push(ObjectRef::from_obj(&o));
                    }
                }
                Some(Ok(watcher::Event::InitDone)) => {
                    let (before, listed) = listing.take().unwrap_or_default();
                    relisted(&store, before, &listed, &mut on_event);
                }
                Some(Ok(watcher::Event::Apply(o))) => on_event(&o, false),
                Some(Ok(watcher::Event::Delete(o))) => on_event(&o, true),
                Some(Err(e)) => tracing::warn!(kind = %kind, "watch failed (retrying): {e}"),
            }
        }
    });
    let r = reader.clone();
    ready.push(Box::pin(async move {
        r.wait_until_ready().await.map_err(|_| ())
    }));
    reader
}

/// A full list in progress: the store's objects before it, and the objects listed so far.
type Listing<K> = (Vec<Arc<K>>, Vec<ObjectRef<K>>);

/// A full list's objects, once the reflector store holds them: each listed one to `on_event`
/// as changed (as it is now in the store), then each one the store held `before` and the list
/// no longer has as deleted (client-go's informer does the same on a re-list).
fn relisted<K>(
    store: &Store<K>,
    before: Vec<Arc<K>>,
    listed: &[ObjectRef<K>],
    on_event: &mut impl FnMut(&K, bool),
) where
    K: Resource<DynamicType = ()> + Clone,
{
    for r in listed {
        if let Some(o) = store.get(r) {
            on_event(&o, false);
        }
    }
    let kept: HashSet<&ObjectRef<K>> = listed.iter().collect();
    for o in before {
        if !kept.contains(&ObjectRef::from_obj(&*o)) {
            on_event(&o, true);
        }
    }
}

/// A value kept in a [`CompactStore`]: a sidecar's compact form of an object, which carries
/// its own key (see [`store_key`]).
pub trait Keyed {
    /// The object's key in the store: `namespace/name`, or the name of a cluster-scoped
    /// object.
    fn key(&self) -> &str;
}

/// The key of the object `meta` describes in a [`CompactStore`]: `namespace/name`, or the name
/// alone of a cluster-scoped object (a namespace's name has no `/`).
pub fn store_key(meta: &ObjectMeta) -> Box<str> {
    let name = meta.name.as_deref().unwrap_or_default();
    match meta.namespace.as_deref() {
        Some(ns) => format!("{ns}/{name}").into_boxed_str(),
        None => name.into(),
    }
}

/// A stored value, hashed and compared by its key, so that the set needs no key beside it.
struct Entry<V>(Arc<V>);

impl<V: Keyed> PartialEq for Entry<V> {
    fn eq(&self, other: &Self) -> bool {
        self.0.key() == other.0.key()
    }
}

impl<V: Keyed> Eq for Entry<V> {}

impl<V: Keyed> Hash for Entry<V> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // As `str` hashes: a lookup by `&str` finds it (`Borrow`'s contract).
        self.0.key().hash(state);
    }
}

impl<V: Keyed> Borrow<str> for Entry<V> {
    fn borrow(&self) -> &str {
        self.0.key()
    }
}

/// The read side of a watch cache of compact values ([`watch_compact`]): of each object one
/// value that holds its own key, and nothing else (kube-runtime's reflector `Store` keeps,
/// beside a clone of the whole object, a key of four `String`s: name, namespace, UID and
/// resourceVersion).
pub struct CompactStore<V> {
    objects: Arc<RwLock<HashSet<Entry<V>>>>,
}

impl<V> Clone for CompactStore<V> {
    fn clone(&self) -> Self {
        Self {
            objects: Arc::clone(&self.objects),
        }
    }
}

impl<V: Keyed> CompactStore<V> {
    /// An empty store, filled by [`watch_compact`] (or by hand, in tests).
    pub fn new() -> Self {
        Self {
            objects: Arc::new(RwLock::new(HashSet::new())),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashSet<Entry<V>>> {
        // A panic while the lock is held leaves the set whole (each change is one call).
        self.objects.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashSet<Entry<V>>> {
        self.objects.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// The value stored under `key` ([`store_key`]).
    pub fn get(&self, key: &str) -> Option<Arc<V>> {
        self.read().get(key).map(|e| Arc::clone(&e.0))
    }

    /// Every stored value.
    pub fn state(&self) -> Vec<Arc<V>> {
        self.read().iter().map(|e| Arc::clone(&e.0)).collect()
    }

    /// Whether any stored value satisfies `pred` (without collecting them first).
    pub fn any(&self, mut pred: impl FnMut(&V) -> bool) -> bool {
        self.read().iter().any(|e| pred(&e.0))
    }

    /// A stored value that satisfies `pred`, if any (without collecting them first).
    pub fn find(&self, mut pred: impl FnMut(&V) -> bool) -> Option<Arc<V>> {
        self.read()
            .iter()
            .find(|e| pred(&e.0))
            .map(|e| Arc::clone(&e.0))
    }

    /// How many values are stored.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether the store is empty.
    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }

    /// Stores `value`, replacing the value of the same key.
    pub fn insert(&self, value: Arc<V>) {
        self.write().replace(Entry(value));
    }

    /// Removes the value stored under `key`.
    pub fn remove(&self, key: &str) -> Option<Arc<V>> {
        self.write().take(key).map(|e| e.0)
    }

    /// Replaces every stored value with `set` (a full list's result).
    fn replace_all(&self, set: HashSet<Entry<V>>) {
        *self.write() = set;
    }
}

impl<V: Keyed> Default for CompactStore<V> {
    fn default() -> Self {
        Self::new()
    }
}

/// A watch cache that keeps of each object `K` only `compact(object)`: [`watch_selected`]'s
/// callbacks and readiness, with a [`CompactStore`] instead of a reflector's. Each decoded
/// object is turned into its compact value once and stored without a copy (`on_event` sees the
/// stored value). A full list (the first, or after the watch failed) is gathered apart and
/// replaces the stored values when complete, as the reflector does; its values go to
/// `on_event` then, followed by the values it no longer has, as deleted.
pub fn watch_compact<K, V>(
    source: &Watches,
    config: watcher::Config,
    shutdown: &CancellationToken,
    ready: &mut Readiness,
    compact: impl Fn(K) -> V + Send + 'static,
    mut on_event: impl FnMut(&V, bool) + Send + 'static,
) -> CompactStore<V>
where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    V: Keyed + Send + Sync + 'static,
{
    let store = CompactStore::new();
    let (synced, mut synced_rx) = tokio::sync::watch::channel(false);
    let stream = source.events::<K>(config);
    let stop = shutdown.clone();
    let kind = K::kind(&()).into_owned();
    let writer = store.clone();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        // A full list in progress.
        let mut listing: Option<HashSet<Entry<V>>> = None;
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev,
                () = stop.cancelled() => return,
            };
            match ev {
                None => return,
                Some(Ok(watcher::Event::Init)) => listing = Some(HashSet::new()),
                Some(Ok(watcher::Event::InitApply(o))) => {
                    let v = Arc::new(compact(o));
                    listing.get_or_insert_default().replace(Entry(v));
                }
                Some(Ok(watcher::Event::InitDone)) => {
                    // The list's values go to the handler once stored (a handler reads the
                    // store), then those the list no longer has, as deleted.
                    let listed = listing.take().unwrap_or_default();
                    let values: Vec<Arc<V>> = listed.iter().map(|e| Arc::clone(&e.0)).collect();
                    let before = writer.state();
                    writer.replace_all(listed);
                    for v in &values {
                        on_event(v, false);
                    }
                    for old in before {
                        if writer.get(old.key()).is_none() {
                            on_event(&old, true);
                        }
                    }
                    synced.send_replace(true);
                }
                Some(Ok(watcher::Event::Apply(o))) => {
                    let v = Arc::new(compact(o));
                    writer.insert(Arc::clone(&v));
                    on_event(&v, false);
                }
                Some(Ok(watcher::Event::Delete(o))) => {
                    let v = compact(o);
                    writer.remove(v.key());
                    on_event(&v, true);
                }
                Some(Err(e)) => tracing::warn!(kind = %kind, "watch failed (retrying): {e}"),
            }
        }
    });
    ready.push(Box::pin(async move {
        synced_rx
            .wait_for(|synced| *synced)
            .await
            .map(|_| ())
            .map_err(|_| ())
    }));
    store
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;

    use super::*;

    fn cm(name: &str) -> ConfigMap {
        let mut c = ConfigMap::default();
        c.metadata.name = Some(name.into());
        c.metadata.namespace = Some("ns".into());
        c
    }

    /// A re-list hands each listed object over as the store now holds it, then each object
    /// the list no longer has as deleted.
    #[test]
    fn a_relist_reports_what_it_found_and_what_went() {
        let (store, mut writer) = reflector::store::<ConfigMap>();
        for ev in [
            watcher::Event::Init,
            watcher::Event::InitApply(cm("a")),
            watcher::Event::InitApply(cm("b")),
            watcher::Event::InitDone,
        ] {
            writer.apply_watcher_event(&ev);
        }
        let before = store.state();
        let mut changed = cm("a");
        changed.data = Some([("v".to_owned(), "2".to_owned())].into());
        for ev in [
            watcher::Event::Init,
            watcher::Event::InitApply(changed.clone()),
            watcher::Event::InitApply(cm("c")),
            watcher::Event::InitDone,
        ] {
            writer.apply_watcher_event(&ev);
        }
        let listed = [ObjectRef::from_obj(&changed), ObjectRef::from_obj(&cm("c"))];
        let mut seen = Vec::new();
        relisted(&store, before, &listed, &mut |o: &ConfigMap, deleted| {
            seen.push((o.metadata.name.clone().unwrap(), o.data.is_some(), deleted));
        });
        assert_eq!(
            seen,
            [
                ("a".to_owned(), true, false),
                ("c".to_owned(), false, false),
                ("b".to_owned(), false, true),
            ]
        );
    }
}
