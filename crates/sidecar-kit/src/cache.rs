//! Watch caches for the controller sidecars: a cluster-wide reflector of one kind that keeps of
//! each object only what the sidecar's decisions read, tells the sidecar of every change, and
//! says when its first list is in.

use futures::StreamExt as _;
use futures::future::BoxFuture;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, watcher};
use kube::{Api, Client, Resource};
use tokio_util::sync::CancellationToken;

/// Futures that end when a cache has its first full list (`Err` if its writer went away first).
pub type Readiness = Vec<BoxFuture<'static, Result<(), ()>>>;

/// Starts a reflector of `K` (cluster-wide) until `shutdown`, keeping of each object only what
/// `trim` leaves (managed fields are always dropped), calling `on_event` for every object
/// listed or changed (`false`) and deleted (`true`), and pushes its readiness to `ready`.
/// Watch failures are retried with kube-runtime's default back-off and logged.
pub fn watch<K>(
    client: &Client,
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
        client,
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
    client: &Client,
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
    let api: Api<K> = Api::all(client.clone());
    let (reader, writer) = reflector::store();
    let stream = watcher(api, config)
        .default_backoff()
        .modify(move |o: &mut K| {
            o.meta_mut().managed_fields = None;
            trim(o);
        })
        .reflect(writer);
    let stop = shutdown.clone();
    let kind = K::kind(&()).into_owned();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev,
                () = stop.cancelled() => return,
            };
            match ev {
                None => return,
                Some(Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o))) => {
                    on_event(&o, false)
                }
                Some(Ok(watcher::Event::Delete(o))) => on_event(&o, true),
                Some(Ok(_)) => {}
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
