//! A work queue with client-go's semantics: a key is queued at most once, never processed by two
//! workers at the same time (a key added while it is being processed is queued again when its
//! worker is done), and failed keys come back after a per-key exponential back-off
//! (`--retry-interval-start` doubling to `--retry-interval-max`, reset by [`WorkQueue::forget`]).
//! A key waits out at most one delay at a time: a delayed add while it already waits keeps the
//! earlier of the two times (client-go's delaying queue), so failures that pile up while a key
//! waits do not start a second chain of retries beside the first.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

struct State<K> {
    queue: VecDeque<(K, Instant)>,
    /// Keys in `queue` or waiting to go back in after their worker finishes.
    dirty: HashSet<K>,
    processing: HashSet<K>,
    failures: HashMap<K, u32>,
    /// Keys waiting out a delay before they are added, with when it ends.
    waiting: HashMap<K, Instant>,
}

/// A named work queue (the name is the `name` label of the `workqueue_*` metrics).
pub struct WorkQueue<K> {
    name: &'static str,
    state: Mutex<State<K>>,
    ready: Notify,
    start: Duration,
    max: Duration,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
}

/// A key handed to a worker; hand it back with [`WorkQueue::done`].
pub struct Item<K> {
    /// The key.
    pub key: K,
    /// When it was queued (the start of `workqueue_queue_duration_seconds`).
    pub queued_at: Instant,
    /// When the worker took it (the start of `workqueue_work_duration_seconds`).
    pub started: Instant,
}

impl<K: Clone + Eq + Hash + Send + 'static> WorkQueue<K> {
    /// An empty queue named `name` whose failed keys come back after `start`, doubling up to
    /// `max`; its metrics go to `metrics`, and delayed adds end with `shutdown`.
    pub fn new(
        name: &'static str,
        start: Duration,
        max: Duration,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        Arc::new(Self {
            name,
            state: Mutex::new(State {
                queue: VecDeque::new(),
                dirty: HashSet::new(),
                processing: HashSet::new(),
                failures: HashMap::new(),
                waiting: HashMap::new(),
            }),
            ready: Notify::new(),
            start,
            max,
            metrics,
            shutdown,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<K>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `key` now (no-op if it is already queued).
    pub fn add(&self, key: K) {
        let mut s = self.lock();
        if !s.dirty.insert(key.clone()) {
            return;
        }
        self.metrics.queue_add(self.name);
        if s.processing.contains(&key) {
            // Re-queued by `done`.
            return;
        }
        s.queue.push_back((key, Instant::now()));
        self.metrics.queue_depth(self.name, s.queue.len());
        drop(s);
        self.ready.notify_one();
    }

    /// Queues `key` after `delay`; if it already waits for a shorter time, that one stands.
    pub fn add_after(self: &Arc<Self>, key: K, delay: Duration) {
        if delay.is_zero() {
            self.add(key);
            return;
        }
        let at = Instant::now() + delay;
        {
            let mut s = self.lock();
            if s.waiting.get(&key).is_some_and(|&t| t <= at) {
                return;
            }
            s.waiting.insert(key.clone(), at);
        }
        let q = Arc::clone(self);
        tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep_until(at) => {
                    let mut s = q.lock();
                    // A shorter delay that replaced this one has added the key already.
                    if s.waiting.get(&key) != Some(&at) {
                        return;
                    }
                    s.waiting.remove(&key);
                    drop(s);
                    q.add(key);
                }
                () = q.shutdown.cancelled() => {}
            }
        });
    }

    /// Whether `key` waits out a delay (its back-off, after a failure) before it is added
    /// again: a sync of it now was asked for by something else.
    pub fn is_waiting<Q>(&self, key: &Q) -> bool
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.lock().waiting.contains_key(key)
    }

    /// Queues `key` after its next back-off and counts the failure.
    pub fn add_rate_limited(self: &Arc<Self>, key: K) -> u32 {
        let failures = {
            let mut s = self.lock();
            let n = s.failures.entry(key.clone()).or_insert(0);
            *n = n.saturating_add(1);
            *n
        };
        self.metrics.queue_retry(self.name);
        self.add_after(key, self.backoff(failures));
        failures
    }

    /// The delay after the `failures`-th failure: start * 2^(failures-1), at most max.
    fn backoff(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(40);
        self.start
            .checked_mul(1u32 << exp.min(31))
            .map_or(self.max, |d| d.min(self.max))
    }

    /// How many times in a row `key` has failed (its back-off step; 0 after [`forget`]).
    ///
    /// [`forget`]: Self::forget
    pub fn failures<Q>(&self, key: &Q) -> u32
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.lock().failures.get(key).copied().unwrap_or(0)
    }

    /// Resets `key`'s back-off.
    pub fn forget(&self, key: &K) {
        self.lock().failures.remove(key);
    }

    /// The next key, waiting for one; `None` once the queue shuts down.
    pub async fn next(&self) -> Option<Item<K>> {
        loop {
            let notified = self.ready.notified();
            {
                let mut s = self.lock();
                if let Some((key, queued_at)) = s.queue.pop_front() {
                    s.dirty.remove(&key);
                    s.processing.insert(key.clone());
                    self.metrics.queue_depth(self.name, s.queue.len());
                    if !s.queue.is_empty() {
                        // Wake another worker for the rest.
                        self.ready.notify_one();
                    }
                    return Some(Item {
                        key,
                        queued_at,
                        started: Instant::now(),
                    });
                }
            }
            tokio::select! {
                () = notified => {}
                () = self.shutdown.cancelled() => return None,
            }
        }
    }

    /// Marks `item` processed; re-queues its key if it was added meanwhile.
    pub fn done(&self, item: Item<K>) {
        let now = Instant::now();
        self.metrics.queue_done(
            self.name,
            item.started.saturating_duration_since(item.queued_at),
            now.saturating_duration_since(item.started),
        );
        let mut s = self.lock();
        s.processing.remove(&item.key);
        if s.dirty.contains(&item.key) {
            s.queue.push_back((item.key, now));
            self.metrics.queue_depth(self.name, s.queue.len());
            drop(s);
            self.ready.notify_one();
        }
    }

    /// How many keys wait (not counting those being processed).
    pub fn len(&self) -> usize {
        self.lock().queue.len()
    }

    /// Whether no key waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How long the oldest waiting key has waited (`None` when none waits); with [`len`] the
    /// backlog a sidecar can show. Keys in back-off count from when their delay ended.
    ///
    /// [`len`]: Self::len
    pub fn oldest_wait(&self) -> Option<Duration> {
        let s = self.lock();
        s.queue
            .front()
            .map(|(_, at)| Instant::now().saturating_duration_since(*at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> Arc<WorkQueue<String>> {
        WorkQueue::new(
            "test",
            Duration::from_secs(1),
            Duration::from_secs(300),
            Arc::new(Metrics::new("d")),
            CancellationToken::new(),
        )
    }

    #[tokio::test]
    async fn a_key_is_queued_once_and_requeued_if_added_while_processing() {
        let q = queue();
        q.add("a".into());
        q.add("a".into());
        assert_eq!(q.len(), 1);
        let item = q.next().await.unwrap();
        assert_eq!(item.key, "a");
        q.add("a".into());
        // Not handed to a second worker while the first has it.
        assert_eq!(q.len(), 0);
        q.done(item);
        assert_eq!(q.len(), 1);
        let item = q.next().await.unwrap();
        q.done(item);
        assert_eq!(q.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_exponentially_up_to_the_cap_and_forget_resets() {
        let q = queue();
        assert_eq!(q.backoff(1), Duration::from_secs(1));
        assert_eq!(q.backoff(2), Duration::from_secs(2));
        assert_eq!(q.backoff(9), Duration::from_secs(256));
        assert_eq!(q.backoff(10), Duration::from_secs(300));
        assert_eq!(q.backoff(u32::MAX), Duration::from_secs(300));
        let t0 = Instant::now();
        assert_eq!(q.failures("a"), 0);
        q.add_rate_limited("a".into());
        q.add_rate_limited("a".into());
        assert_eq!(q.failures("a"), 2);
        let item = q.next().await.unwrap();
        // The first retry (1 s) comes first; the second (2 s) finds it queued or processing.
        assert_eq!(Instant::now() - t0, Duration::from_secs(1));
        q.forget(&item.key);
        q.done(item);
        assert_eq!(q.add_rate_limited("a".into()), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_while_a_key_waits_do_not_start_a_second_chain_of_retries() {
        let q = queue();
        let t0 = Instant::now();
        // A failure (1 s back-off), then, before that ends, a second one (2 s): the key comes
        // back once, after 1 s, and not again after 2 s.
        q.add_rate_limited("a".into());
        assert!(q.is_waiting("a"));
        q.add_rate_limited("a".into());
        let item = q.next().await.unwrap();
        assert_eq!(Instant::now() - t0, Duration::from_secs(1));
        assert!(!q.is_waiting(&item.key));
        // It fails a third time: back in 4 s, at t0 + 5 s; nothing comes at t0 + 2 s.
        q.add_rate_limited(item.key.clone());
        q.done(item);
        let item = q.next().await.unwrap();
        assert_eq!(Instant::now() - t0, Duration::from_secs(5));
        q.done(item);
        // A shorter delay replaces a longer one.
        q.add_after("b".into(), Duration::from_secs(10));
        q.add_after("b".into(), Duration::from_secs(3));
        let t1 = Instant::now();
        let item = q.next().await.unwrap();
        assert_eq!(Instant::now() - t1, Duration::from_secs(3));
        q.done(item);
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(q.is_empty(), "the replaced delay adds nothing");
    }

    #[tokio::test(start_paused = true)]
    async fn oldest_wait_is_the_age_of_the_first_waiting_key() {
        let q = queue();
        assert_eq!(q.oldest_wait(), None);
        q.add("a".into());
        tokio::time::advance(Duration::from_secs(3)).await;
        q.add("b".into());
        assert_eq!(q.oldest_wait(), Some(Duration::from_secs(3)));
        let item = q.next().await.unwrap();
        assert_eq!(q.oldest_wait(), Some(Duration::ZERO));
        q.done(item);
    }

    #[tokio::test]
    async fn next_returns_none_after_shutdown() {
        let token = CancellationToken::new();
        let q: Arc<WorkQueue<String>> = WorkQueue::new(
            "t",
            Duration::from_secs(1),
            Duration::from_secs(2),
            Arc::new(Metrics::new("d")),
            token.clone(),
        );
        token.cancel();
        assert!(q.next().await.is_none());
    }
}
