//! One watch per resource kind for the controllers of one process (`csi-sidecars`): a [`Hub`]
//! runs one list-and-watch of each kind (and selection) that any controller asks for, and hands
//! every event to each controller's cache, which decodes and trims it into its own compact form.
//!
//! The hub keeps no copy of the objects: each event carries the object's JSON as the API server
//! sent it ([`Raw`]), held only until every subscriber has decoded it. A subscriber that joins a
//! running watch needs the whole list, so the hub lists again for everyone (each cache sees a
//! re-list, as after a watch that expired: its store is replaced, its handler sees every object
//! once more, as at a resync). Subscribers join when their controller starts (or starts again
//! after losing its Lease), so this happens a few times in a process's life. A list starts
//! once no subscriber has joined for [`QUIET`]: the controllers of a process start within
//! milliseconds of each other, and a kind three of them read is then listed once, not three
//! times (a list of 10,000 PVs is tens of megabytes for the API server to send and for every
//! cache to decode).
//!
//! [`Watches`] is what a controller's caches are given: its own watches on its client (a
//! sidecar of its own), or the hub's.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use futures::stream::BoxStream;
use futures::{StreamExt as _, future};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::ApiResource;
use kube::core::DynamicResourceScope;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, watcher};
use kube::{Api, Client, Resource};
use serde::de::{Deserialize, Deserializer, Error as _};
use serde_json::value::RawValue;
use tokio::sync::{Notify, mpsc};

/// How long a watch waits, before each list, for no more subscribers to join.
pub const QUIET: std::time::Duration = std::time::Duration::from_millis(100);

/// An object as the API server sent it: its JSON, and the metadata the watch itself needs
/// (name, namespace, uid, resourceVersion). Of any kind: the feed's `ApiResource` names it.
pub struct Raw {
    meta: ObjectMeta,
    json: Box<RawValue>,
}

impl Raw {
    /// The object's JSON.
    pub fn json(&self) -> &str {
        self.json.get()
    }
}

impl Clone for Raw {
    fn clone(&self) -> Self {
        Self {
            meta: self.meta.clone(),
            json: self.json.clone(),
        }
    }
}

impl fmt::Debug for Raw {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Raw")
            .field("name", &self.meta.name)
            .field("namespace", &self.meta.namespace)
            .field("bytes", &self.json.get().len())
            .finish()
    }
}

impl<'de> Deserialize<'de> for Raw {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize, Default)]
        #[serde(rename_all = "camelCase", default)]
        struct Meta {
            name: Option<String>,
            namespace: Option<String>,
            uid: Option<String>,
            resource_version: Option<String>,
        }
        #[derive(serde::Deserialize)]
        struct Head {
            #[serde(default)]
            metadata: Meta,
        }
        let json = Box::<RawValue>::deserialize(d)?;
        let head: Head = serde_json::from_str(json.get()).map_err(D::Error::custom)?;
        let m = head.metadata;
        Ok(Self {
            meta: ObjectMeta {
                name: m.name,
                namespace: m.namespace,
                uid: m.uid,
                resource_version: m.resource_version,
                ..ObjectMeta::default()
            },
            json,
        })
    }
}

impl Resource for Raw {
    type DynamicType = ApiResource;
    type Scope = DynamicResourceScope;

    fn kind(ar: &ApiResource) -> Cow<'_, str> {
        Cow::Borrowed(&ar.kind)
    }

    fn group(ar: &ApiResource) -> Cow<'_, str> {
        Cow::Borrowed(&ar.group)
    }

    fn version(ar: &ApiResource) -> Cow<'_, str> {
        Cow::Borrowed(&ar.version)
    }

    fn api_version(ar: &ApiResource) -> Cow<'_, str> {
        Cow::Borrowed(&ar.api_version)
    }

    fn plural(ar: &ApiResource) -> Cow<'_, str> {
        Cow::Borrowed(&ar.plural)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.meta
    }
}

/// One event of a shared watch, as each subscriber gets it.
type RawEvent = watcher::Event<Arc<Raw>>;

/// The subscribers of one watch (of one kind and selection, whatever type each decodes it as).
struct Feed {
    subscribers: Mutex<Vec<mpsc::UnboundedSender<RawEvent>>>,
    /// A subscriber joined: list again for everyone.
    relist: Notify,
}

type Feeds = Arc<Mutex<HashMap<String, Arc<Feed>>>>;

/// The process's shared watches: one per kind and selection, started by its first subscriber
/// and ended when its last one is gone.
pub struct Hub {
    client: Client,
    feeds: Feeds,
    /// Watches started so far (each list-and-watch, not counting re-lists), for tests.
    started: Arc<std::sync::atomic::AtomicUsize>,
    /// Lists started so far (first lists and re-lists), for tests.
    lists: Arc<std::sync::atomic::AtomicUsize>,
}

impl fmt::Debug for Hub {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hub")
            .field("feeds", &lock(&self.feeds).len())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `plugreg_shared_watches{resource}`: the watches the hub holds open, by resource (the
/// plural, with the group for a named group), for the registry.
impl crate::metrics::Collector for Hub {
    fn collect(&self, families: &mut crate::metrics::Families) {
        let mut by_resource: BTreeMap<String, u64> = BTreeMap::new();
        for key in lock(&self.feeds).keys() {
            let resource = key.split('?').next().unwrap_or_default();
            *by_resource.entry(resource.to_owned()).or_default() += 1;
        }
        families.samples(
            "plugreg_shared_watches",
            "Watches the controllers of this process share, by API version and resource.",
            "gauge",
            by_resource.into_iter().map(|(r, n)| {
                (
                    plugreg_runtime::prom::labels(&[("resource", r.as_str())]),
                    n as f64,
                )
            }),
        );
    }
}

/// The feed key of a kind and selection.
fn key<K: Resource<DynamicType = ()>>(config: &watcher::Config) -> String {
    format!(
        "{}/{}?l={}&f={}",
        K::api_version(&()),
        K::plural(&()),
        config.label_selector.as_deref().unwrap_or(""),
        config.field_selector.as_deref().unwrap_or("")
    )
}

impl Hub {
    /// A hub whose watches run on `client` (a client of their own: a controller's bulk work
    /// never delays a re-list).
    pub fn new(client: Client) -> Arc<Self> {
        Arc::new(Self {
            client,
            feeds: Arc::default(),
            started: Arc::default(),
            lists: Arc::default(),
        })
    }

    /// How many list-and-watches were started so far (re-lists of a running one not counted).
    pub fn watches_started(&self) -> usize {
        self.started.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many lists the watches have started so far: each watch's first, and each re-list
    /// for subscribers that joined it (not kube-runtime's own after an expired watch).
    pub fn lists_started(&self) -> usize {
        self.lists.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The events of the objects `config` selects of kind `K`, decoded, from the one watch of
    /// that kind and selection: a full list first (the watch lists again for everyone when a
    /// subscriber joins a running one), then every change. The stream ends when the watch
    /// does (never while the process runs).
    pub fn subscribe<K>(
        &self,
        config: watcher::Config,
    ) -> BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>
    where
        K: Resource<DynamicType = ()> + serde::de::DeserializeOwned + Send + 'static,
    {
        let key = key::<K>(&config);
        let (tx, rx) = mpsc::unbounded_channel();
        let mut feeds = lock(&self.feeds);
        match feeds.get(&key).cloned() {
            Some(feed) => {
                lock(&feed.subscribers).push(tx);
                feed.relist.notify_one();
            }
            None => {
                let feed = Arc::new(Feed {
                    subscribers: Mutex::new(vec![tx]),
                    relist: Notify::new(),
                });
                feeds.insert(key.clone(), feed.clone());
                self.started
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tokio::spawn(run_feed(
                    self.client.clone(),
                    ApiResource::erase::<K>(&()),
                    config,
                    key,
                    feed,
                    Arc::clone(&self.feeds),
                    Arc::clone(&self.lists),
                ));
            }
        }
        drop(feeds);
        let kind = K::kind(&()).into_owned();
        futures::stream::unfold(
            rx,
            |mut rx| async move { rx.recv().await.map(|ev| (ev, rx)) },
        )
        .filter_map(move |ev| future::ready(decode::<K>(ev, &kind).map(Ok)))
        .boxed()
    }
}

/// A subscriber's event: the raw objects decoded as `K` (one that does not decode is logged
/// and left out, as a watch leaves out what it cannot read).
fn decode<K: serde::de::DeserializeOwned>(ev: RawEvent, kind: &str) -> Option<watcher::Event<K>> {
    let one = |raw: Arc<Raw>| match serde_json::from_str::<K>(raw.json()) {
        Ok(k) => Some(k),
        Err(e) => {
            tracing::warn!(kind = %kind, name = ?raw.meta.name, "cannot decode a watched object: {e}");
            None
        }
    };
    Some(match ev {
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
        watcher::Event::InitApply(o) => watcher::Event::InitApply(one(o)?),
        watcher::Event::Apply(o) => watcher::Event::Apply(one(o)?),
        watcher::Event::Delete(o) => watcher::Event::Delete(one(o)?),
    })
}

/// One watch: listed, then watched, its events handed to every subscriber; listed again when
/// one joins; ended when none is left. Each list waits for [`QUIET`] without a joining
/// subscriber first.
async fn run_feed(
    client: Client,
    resource: ApiResource,
    config: watcher::Config,
    key: String,
    feed: Arc<Feed>,
    feeds: Feeds,
    lists: Arc<std::sync::atomic::AtomicUsize>,
) {
    let kind = resource.kind.clone();
    loop {
        // Quiet for a while (the wait starts again with each subscriber that joins meanwhile).
        while tokio::time::timeout(QUIET, feed.relist.notified())
            .await
            .is_ok()
        {}
        lists.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let api: Api<Raw> = Api::all_with(client.clone(), &resource);
        let mut stream = std::pin::pin!(watcher(api, config.clone()).default_backoff());
        loop {
            let ev = tokio::select! {
                biased;
                () = feed.relist.notified() => break,
                ev = stream.next() => ev,
            };
            let ev = match ev {
                None => {
                    // Not with kube-runtime's back-off, which retries for ever; should the
                    // stream end, the next subscriber starts a new watch instead of joining
                    // this one.
                    lock(&feeds).remove(&key);
                    return;
                }
                Some(Err(e)) => {
                    tracing::warn!(kind = %kind, "watch failed (retrying): {e}");
                    continue;
                }
                Some(Ok(ev)) => ev,
            };
            let ev: RawEvent = match ev {
                watcher::Event::Init => watcher::Event::Init,
                watcher::Event::InitDone => watcher::Event::InitDone,
                watcher::Event::InitApply(o) => watcher::Event::InitApply(Arc::new(o)),
                watcher::Event::Apply(o) => watcher::Event::Apply(Arc::new(o)),
                watcher::Event::Delete(o) => watcher::Event::Delete(Arc::new(o)),
            };
            let mut subscribers = lock(&feed.subscribers);
            subscribers.retain(|s| s.send(ev.clone()).is_ok());
            if subscribers.is_empty() {
                drop(subscribers);
                // Ended under the hub's lock, so that a subscriber never joins a feed that is
                // going away.
                let mut all = lock(&feeds);
                if lock(&feed.subscribers).is_empty() {
                    all.remove(&key);
                    return;
                }
            }
        }
    }
}

/// Where a controller's watch caches get their events: watches of their own on the
/// controller's client, or the process's [`Hub`].
#[derive(Clone)]
pub struct Watches {
    client: Client,
    hub: Option<Arc<Hub>>,
}

impl fmt::Debug for Watches {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watches")
            .field("shared", &self.hub.is_some())
            .finish()
    }
}

impl Watches {
    /// Watches of their own, on `client`.
    pub fn own(client: Client) -> Self {
        Self { client, hub: None }
    }

    /// The hub's shared watches.
    pub fn shared(hub: Arc<Hub>) -> Self {
        Self {
            client: hub.client.clone(),
            hub: Some(hub),
        }
    }

    /// Whether the watches are the hub's.
    pub fn is_shared(&self) -> bool {
        self.hub.is_some()
    }

    /// The events of the objects of kind `K` that `config` selects, with kube-runtime's default
    /// back-off on failures.
    pub fn events<K>(
        &self,
        config: watcher::Config,
    ) -> BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>
    where
        K: Resource<DynamicType = ()>
            + Clone
            + serde::de::DeserializeOwned
            + fmt::Debug
            + Send
            + 'static,
    {
        match &self.hub {
            Some(hub) => hub.subscribe(config),
            None => watcher(Api::<K>::all(self.client.clone()), config)
                .default_backoff()
                .boxed(),
        }
    }
}
