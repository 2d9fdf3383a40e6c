//! The controller runtime every controller sidecar runs on, shaped like kube-runtime's: a
//! sidecar supplies a `reconcile(ctx, lane, key) -> Result<Action, E>` and an error policy;
//! the [`Runner`] owns the rest.
//!
//! - **Workers**: each [`Lane`] (a [`WorkQueue`] and its worker count) gets its own workers, so
//!   a sidecar with an attach and a detach queue keeps their `--worker-threads` apart.
//! - **Per-key serialisation**: a queue never hands one key to two workers; across the lanes of
//!   one runner a key is reconciled by one worker at a time too (the attach and detach queues
//!   of one VolumeAttachment), so no reconcile needs a lock of its own.
//! - **Back-off**: [`Action::Retry`] (and the error policy's) re-queues the key after its next
//!   rate-limited back-off (client-go's per-key exponential limiter, the queue's);
//!   [`Action::Done`] resets it; [`Action::After`] and [`Action::Wait`] leave it as it is.
//! - **Resync**: [`Runner::resync`] runs the sidecar's re-queue every period, upstream's
//!   informer resync.
//! - **Our own writes** ([`Writes`]): the one memory of "the cache is behind what we wrote",
//!   keyed by resourceVersion. A reconcile that finds its cached object older than its own last
//!   write of it returns [`Action::Wait`] (or [`Action::After`] a short catch-up): acting on the
//!   older copy would repeat what the write already did; the watch event of the write queues
//!   the key again.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::queue::WorkQueue;

/// What a reconcile asks of the runner next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Done until something changes: the key's back-off is reset.
    Done,
    /// Failed or not ready yet: again after the key's next back-off.
    Retry,
    /// Again after this long (the back-off is kept).
    After(Duration),
    /// Nothing until an event queues the key again (the back-off is kept): a write's watch
    /// echo, a change of another object the key waits for.
    Wait,
}

/// One work queue of a runner and how many workers take from it.
pub struct Lane<K> {
    /// The queue.
    pub queue: Arc<WorkQueue<K>>,
    /// Its workers (at least one runs).
    pub workers: usize,
}

impl<K> Lane<K> {
    /// The lane of `queue` with `workers` workers.
    pub fn new(queue: Arc<WorkQueue<K>>, workers: usize) -> Self {
        Self { queue, workers }
    }
}

/// The index of a lane in its runner, in the order the lanes were given.
pub type LaneId = usize;

type Resync = (Duration, Box<dyn Fn() + Send + Sync>);

/// A controller's workers over its lanes, with resync; see the module docs.
pub struct Runner<K> {
    lanes: Vec<Lane<K>>,
    resync: Vec<Resync>,
}

impl<K: Clone + Eq + Hash + Send + Sync + 'static> Runner<K> {
    /// A runner of `lanes`.
    pub fn new(lanes: Vec<Lane<K>>) -> Self {
        Self {
            lanes,
            resync: Vec::new(),
        }
    }

    /// Runs `requeue` every `period` (not at all when `period` is zero); the first time one
    /// period after the start.
    #[must_use]
    pub fn resync(mut self, period: Duration, requeue: impl Fn() + Send + Sync + 'static) -> Self {
        if !period.is_zero() {
            self.resync.push((period, Box::new(requeue)));
        }
        self
    }

    /// Runs the workers until `shutdown` and the queues' own shutdown end them: each takes a
    /// key, calls `reconcile(ctx, lane, key)` (its error through `on_error`) and acts on the
    /// [`Action`]. Returns when every worker has finished its key.
    pub async fn run<C, E, R, Fut, P>(
        self,
        ctx: Arc<C>,
        shutdown: CancellationToken,
        reconcile: R,
        on_error: P,
    ) where
        C: Send + Sync + 'static,
        E: Send + 'static,
        R: Fn(Arc<C>, LaneId, K) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        P: Fn(&C, LaneId, &K, E) -> Action + Send + Sync + 'static,
    {
        let reconcile = Arc::new(reconcile);
        let on_error = Arc::new(on_error);
        let busy = Arc::new(Busy::default());
        let serialise = self.lanes.len() > 1;
        let mut workers = tokio::task::JoinSet::new();
        for (id, lane) in self.lanes.iter().enumerate() {
            for _ in 0..lane.workers.max(1) {
                let queue = Arc::clone(&lane.queue);
                let ctx = Arc::clone(&ctx);
                let reconcile = Arc::clone(&reconcile);
                let on_error = Arc::clone(&on_error);
                let busy = Arc::clone(&busy);
                workers.spawn(async move {
                    while let Some(item) = queue.next().await {
                        let key = item.key.clone();
                        let turn = if serialise {
                            Some(busy.enter(&key).await)
                        } else {
                            None
                        };
                        // Boxed: a worker's task is as large as the largest future it
                        // awaits inline, and a worker waits on its queue most of its life
                        // (design S8).
                        let sync = Box::pin(reconcile(Arc::clone(&ctx), id, key.clone()));
                        let action = match sync.await {
                            Ok(action) => action,
                            Err(e) => on_error(&ctx, id, &key, e),
                        };
                        drop(turn);
                        match action {
                            Action::Done => queue.forget(&key),
                            Action::Retry => {
                                queue.add_rate_limited(key);
                            }
                            Action::After(delay) => queue.add_after(key, delay),
                            Action::Wait => {}
                        }
                        queue.done(item);
                    }
                });
            }
        }
        for (period, requeue) in self.resync {
            let stop = shutdown.clone();
            workers.spawn(async move {
                let mut tick = tokio::time::interval_at(Instant::now() + period, period);
                loop {
                    tokio::select! {
                        _ = tick.tick() => requeue(),
                        () = stop.cancelled() => return,
                    }
                }
            });
        }
        shutdown.cancelled().await;
        while workers.join_next().await.is_some() {}
    }
}

/// The keys being reconciled across a runner's lanes, each with a turn to wait for.
struct Busy<K>(Mutex<HashMap<K, Arc<tokio::sync::Mutex<()>>>>);

impl<K> Default for Busy<K> {
    fn default() -> Self {
        Self(Mutex::new(HashMap::new()))
    }
}

impl<K: Clone + Eq + Hash> Busy<K> {
    async fn enter(self: &Arc<Self>, key: &K) -> Turn<K> {
        let m = {
            let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
            Arc::clone(map.entry(key.clone()).or_default())
        };
        let guard = Arc::clone(&m).lock_owned().await;
        Turn {
            busy: Arc::clone(self),
            key: key.clone(),
            _guard: guard,
        }
    }
}

/// One worker's turn at a key; the next waiting worker goes when it drops.
struct Turn<K: Eq + Hash> {
    busy: Arc<Busy<K>>,
    key: K,
    _guard: tokio::sync::OwnedMutexGuard<()>,
}

impl<K: Eq + Hash> Drop for Turn<K> {
    fn drop(&mut self) {
        let mut map = self.busy.0.lock().unwrap_or_else(|e| e.into_inner());
        // Two references, the map's and this turn's mutex: nobody else waits for it.
        if map
            .get(&self.key)
            .is_some_and(|m| Arc::strong_count(m) <= 2)
        {
            map.remove(&self.key);
        }
    }
}

/// The resourceVersion of this process's last write of each object (see the module docs).
/// resourceVersions are compared as numbers, which every API server this supports issues
/// (etcd revisions); one that is not a number is never "behind".
pub struct Writes<K>(Mutex<HashMap<K, u64>>);

impl<K> Default for Writes<K> {
    fn default() -> Self {
        Self(Mutex::new(HashMap::new()))
    }
}

impl<K: Eq + Hash> Writes<K> {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<K, u64>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remembers a write of `key` whose answer carried `resource_version`.
    pub fn record(&self, key: K, resource_version: Option<&str>) {
        if let Some(rv) = resource_version.and_then(|v| v.parse().ok()) {
            self.map().insert(key, rv);
        }
    }

    /// Forgets `key` (the object is gone).
    pub fn forget<Q>(&self, key: &Q)
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.map().remove(key);
    }

    /// Whether the cached copy of `key`, at `cached`, is older than our last write of it. A
    /// cache that has caught up ends the memory of the write (a cache never goes back), so
    /// the memory holds only writes whose echo is still to come.
    pub fn behind<Q>(&self, key: &Q, cached: Option<&str>) -> bool
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let mut map = self.map();
        let Some(&mine) = map.get(key) else {
            return false;
        };
        match cached.and_then(|v| v.parse::<u64>().ok()) {
            Some(cached) if cached < mine => true,
            Some(_) => {
                map.remove(key);
                false
            }
            None => false,
        }
    }

    /// The cache has `key` at `cached` (a watch event, or a read after a write's answer): a
    /// write it covers is forgotten. Without it, a write whose echo reaches the cache before
    /// its answer is recorded stays until the object's next change or deletion.
    pub fn seen<Q>(&self, key: &Q, cached: Option<&str>)
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if cached.is_some() {
            self.behind(key, cached);
        }
    }

    /// How many objects are remembered.
    pub fn len(&self) -> usize {
        self.map().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<K> std::fmt::Debug for Writes<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |m| m.len());
        write!(f, "Writes({n})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn queue(token: &CancellationToken) -> Arc<WorkQueue<String>> {
        WorkQueue::new(
            "test",
            Duration::from_secs(1),
            Duration::from_secs(8),
            Arc::new(Metrics::new("d")),
            token.clone(),
        )
    }

    #[derive(Default)]
    struct Seen {
        calls: Mutex<Vec<(LaneId, String, Instant)>>,
        inside: AtomicUsize,
        most_inside: AtomicUsize,
    }

    #[tokio::test(start_paused = true)]
    async fn actions_drive_the_queue() {
        let token = CancellationToken::new();
        let q = queue(&token);
        let ctx = Arc::new(Seen::default());
        let t0 = Instant::now();
        let run = tokio::spawn(Runner::new(vec![Lane::new(Arc::clone(&q), 2)]).run(
            Arc::clone(&ctx),
            token.clone(),
            |ctx: Arc<Seen>, lane, key: String| async move {
                let n = {
                    let mut calls = ctx.calls.lock().unwrap();
                    calls.push((lane, key.clone(), Instant::now()));
                    calls.iter().filter(|c| c.1 == key).count()
                };
                match (key.as_str(), n) {
                    // Fails twice (1 s, then 2 s of back-off), then is done.
                    ("retry", 1 | 2) => Err(format!("not yet {n}")),
                    ("after", 1) => Ok(Action::After(Duration::from_millis(300))),
                    ("wait", _) => Ok(Action::Wait),
                    _ => Ok(Action::Done),
                }
            },
            |_: &Seen, _, _: &String, _e: String| Action::Retry,
        ));
        q.add("retry".into());
        q.add("after".into());
        q.add("wait".into());
        tokio::time::sleep(Duration::from_secs(10)).await;
        token.cancel();
        run.await.unwrap();
        let calls = ctx.calls.lock().unwrap();
        let at = |key: &str| -> Vec<Duration> {
            calls
                .iter()
                .filter(|c| c.1 == key)
                .map(|c| c.2 - t0)
                .collect()
        };
        assert_eq!(
            at("retry"),
            [
                Duration::ZERO,
                Duration::from_secs(1),
                Duration::from_secs(3)
            ]
        );
        assert_eq!(at("after"), [Duration::ZERO, Duration::from_millis(300)]);
        assert_eq!(at("wait"), [Duration::ZERO]);
        // Done reset the back-off: the next failure waits the first step again.
        assert_eq!(q.add_rate_limited("retry".into()), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn one_key_is_reconciled_by_one_worker_across_lanes() {
        let token = CancellationToken::new();
        let (a, b) = (queue(&token), queue(&token));
        let ctx = Arc::new(Seen::default());
        let run = tokio::spawn(
            Runner::new(vec![
                Lane::new(Arc::clone(&a), 3),
                Lane::new(Arc::clone(&b), 3),
            ])
            .run(
                Arc::clone(&ctx),
                token.clone(),
                |ctx: Arc<Seen>, lane, key: String| async move {
                    let now = ctx.inside.fetch_add(1, Ordering::SeqCst) + 1;
                    ctx.most_inside.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    ctx.calls.lock().unwrap().push((lane, key, Instant::now()));
                    ctx.inside.fetch_sub(1, Ordering::SeqCst);
                    Ok::<_, ()>(Action::Done)
                },
                |_: &Seen, _, _: &String, ()| Action::Retry,
            ),
        );
        a.add("x".into());
        b.add("x".into());
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Different keys go side by side.
        a.add("y".into());
        b.add("z".into());
        tokio::time::sleep(Duration::from_secs(1)).await;
        token.cancel();
        run.await.unwrap();
        let calls = ctx.calls.lock().unwrap();
        let xs: Vec<_> = calls.iter().filter(|c| c.1 == "x").collect();
        assert_eq!(xs.len(), 2, "both lanes reconciled x");
        assert_eq!(
            xs[1].2 - xs[0].2,
            Duration::from_millis(100),
            "one after the other"
        );
        assert_eq!(
            ctx.most_inside.load(Ordering::SeqCst),
            2,
            "y and z together"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn resync_requeues_every_period() {
        let token = CancellationToken::new();
        let q = queue(&token);
        let ctx = Arc::new(Seen::default());
        let rq = Arc::clone(&q);
        let t0 = Instant::now();
        let run = tokio::spawn(
            Runner::new(vec![Lane::new(Arc::clone(&q), 1)])
                .resync(Duration::from_secs(5), move || rq.add("all".into()))
                .resync(Duration::ZERO, || {
                    unreachable!("a zero period never resyncs")
                })
                .run(
                    Arc::clone(&ctx),
                    token.clone(),
                    |ctx: Arc<Seen>, lane, key: String| async move {
                        ctx.calls.lock().unwrap().push((lane, key, Instant::now()));
                        Ok::<_, ()>(Action::Done)
                    },
                    |_: &Seen, _, _: &String, ()| Action::Retry,
                ),
        );
        tokio::time::sleep(Duration::from_secs(11)).await;
        token.cancel();
        run.await.unwrap();
        let calls = ctx.calls.lock().unwrap();
        let at: Vec<_> = calls.iter().map(|c| c.2 - t0).collect();
        assert_eq!(at, [Duration::from_secs(5), Duration::from_secs(10)]);
    }

    #[test]
    fn writes_know_when_the_cache_is_behind() {
        let w: Writes<String> = Writes::default();
        assert!(!w.behind("a", Some("5")));
        w.record("a".into(), Some("10"));
        w.record("b".into(), Some("not a number"));
        w.record("c".into(), None);
        assert_eq!(w.len(), 1);
        assert!(w.behind("a", Some("9")));
        assert!(!w.behind("a", None));
        assert!(w.behind("a", Some("9")));
        // Caught up: the write is forgotten.
        assert!(!w.behind("a", Some("10")));
        assert!(w.is_empty());
        assert!(!w.behind("a", Some("9")));
        w.record("a".into(), Some("12"));
        w.seen("a", Some("11"));
        assert_eq!(w.len(), 1, "an older copy keeps the write");
        w.seen("a", Some("12"));
        assert!(w.is_empty(), "the echo ends it");
        w.record("a".into(), Some("12"));
        w.forget("a");
        assert!(!w.behind("a", Some("11")));
        assert!(w.is_empty());
    }
}
