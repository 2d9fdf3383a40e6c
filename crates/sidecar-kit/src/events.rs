//! Kubernetes `core/v1` Events as client-go's event recorder and broadcaster write them.
//!
//! - [`Recorder::event`] never blocks: it makes the Event and puts it in a queue of
//!   [`QUEUE_BOUND`] events (client-go keeps 1000, see there); when the queue is full the event is
//!   dropped with a warning, as client-go drops it.
//! - One background task writes the queued events in order, each as client-go's
//!   `recordToSink`: the correlator first, then a POST, or a strategic-merge PATCH of `count`,
//!   `lastTimestamp` and `message` when an identical event (same source, involved object,
//!   type, reason and message) was written before and is still in the cache of
//!   [`CACHE_ENTRIES`] keys (LRU). A PATCH that finds the event gone (the API server's event
//!   TTL) creates it again. Transport errors are retried [`MAX_TRIES`] times, [`RETRY_SLEEP`]
//!   apart (the first wait a random part of it); an answer of the API server (rejected,
//!   already exists) ends the attempt.
//! - client-go's spam filter: per source and involved object, a token bucket of
//!   [`SPAM_BURST`] refilled once every [`SPAM_REFILL`]; an event without a token is dropped.
//!   As in client-go the identical-event count is taken before the filter, so a dropped
//!   repetition still shows in the next written count.
//! - client-go's aggregation of *similar* events: per source, involved object, type and reason,
//!   the [`AGGREGATE_MAX_MESSAGES`]th different message within [`AGGREGATE_WINDOW`] of the last
//!   one (and every one after it) is written as one event with the message prefixed by
//!   [`AGGREGATE_PREFIX`], whose count grows and whose message is the latest.
//! - The three caches hold at most [`CACHE_ENTRIES`] keys each, least recently used out, as
//!   client-go's; a similar-event record older than the window and a spam bucket full again
//!   are forgotten before that, since a key without them behaves the same.
//! - Names: `<object name>.<unix nanoseconds in hex>`; namespace: the object's, `default` for
//!   cluster-scoped objects (PersistentVolumes); message cut to [`MAX_MESSAGE_BYTES`].
//! - On shutdown the task stops; events still queued are lost (as client-go's broadcaster).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Events waiting to be written at most; more are dropped. client-go keeps 1000; events here
/// wait behind the writes that bind claims (they share one rate limit at lower priority), so a
/// burst of claims at `--kube-api-qps 5` queues two events per claim: 8192 (about 2.5 MiB when
/// full, packed) keeps a burst of 4,000 claims without a drop.
pub const QUEUE_BOUND: usize = 8192;
/// Observed events (and spam buckets) remembered, least recently used first out (client-go's
/// `maxLruCacheEntries`).
pub const CACHE_ENTRIES: usize = 4096;
/// Messages are cut to this many bytes (at a character boundary).
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// Writes of one event before it is given up (client-go's `maxTriesPerEvent`).
pub const MAX_TRIES: u32 = 12;
/// The wait between tries (client-go's `defaultSleepDuration`).
pub const RETRY_SLEEP: Duration = Duration::from_secs(10);
/// Events one source may write about one object at once (client-go's `defaultSpamBurst`).
pub const SPAM_BURST: f64 = 25.0;
/// One more event per source and object every this long (client-go's `defaultSpamQPS` 1/300).
pub const SPAM_REFILL: Duration = Duration::from_secs(300);
/// Different messages of similar events (same source, object, type and reason) from which on
/// they are combined into one event (client-go's `defaultAggregateMaxEvents`).
pub const AGGREGATE_MAX_MESSAGES: usize = 10;
/// Similar events this far apart start counting their messages again (client-go's
/// `defaultAggregateIntervalInSeconds`).
pub const AGGREGATE_WINDOW: Duration = Duration::from_secs(600);
/// The message prefix of combined similar events (client-go's
/// `EventAggregatorByReasonMessageFunc`).
pub const AGGREGATE_PREFIX: &str = "(combined from similar events): ";

/// The two event types Kubernetes knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Information.
    Normal,
    /// Something went wrong.
    Warning,
}

impl EventType {
    /// The API's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// An event waiting in the queue: what [`make_event`] needs, its strings packed into one
/// allocation. The queue holds thousands when the writes wait behind a rate limit (or behind
/// the API server); packed, an event of a claim takes about 300 bytes with its slot, where an
/// `ObjectReference` and two `String`s take about 600, so a full queue stays near 2.5 MiB.
#[derive(Debug)]
struct Queued {
    /// The involved object's kind, apiVersion, namespace, name, uid, resourceVersion and
    /// fieldPath, then the reason and the message, back to back.
    text: Box<str>,
    /// Where each of the nine parts of `text` ends.
    ends: [u32; PARTS],
    /// Which of the object's seven fields are set (bit `i` for part `i`).
    set: u8,
    type_: EventType,
    at: SystemTime,
}

/// The parts of [`Queued::text`].
const PARTS: usize = 9;

impl Queued {
    fn new(
        object: &ObjectReference,
        type_: EventType,
        reason: &str,
        message: &str,
        at: SystemTime,
    ) -> Self {
        let fields = [
            &object.kind,
            &object.api_version,
            &object.namespace,
            &object.name,
            &object.uid,
            &object.resource_version,
            &object.field_path,
        ];
        let parts = fields
            .iter()
            .map(|f| f.as_deref().unwrap_or(""))
            .chain([reason, message]);
        let mut text = String::with_capacity(parts.clone().map(str::len).sum());
        let mut ends = [0; PARTS];
        for (end, part) in ends.iter_mut().zip(parts) {
            text.push_str(part);
            // A part longer than 4 GiB is cut short rather than panicking.
            *end = u32::try_from(text.len()).unwrap_or(u32::MAX);
        }
        let set = fields
            .iter()
            .enumerate()
            .filter(|(_, f)| f.is_some())
            .fold(0, |bits, (i, _)| bits | (1 << i));
        Queued {
            text: text.into_boxed_str(),
            ends,
            set,
            type_,
            at,
        }
    }

    fn part(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        self.text
            .get(start..self.ends[i] as usize)
            .unwrap_or_default()
    }

    fn field(&self, i: usize) -> Option<String> {
        (self.set & (1 << i) != 0).then(|| self.part(i).to_owned())
    }

    fn object(&self) -> ObjectReference {
        ObjectReference {
            kind: self.field(0),
            api_version: self.field(1),
            namespace: self.field(2),
            name: self.field(3),
            uid: self.field(4),
            resource_version: self.field(5),
            field_path: self.field(6),
        }
    }

    fn reason(&self) -> &str {
        self.part(7)
    }

    fn message(&self) -> &str {
        self.part(8)
    }
}

/// Records events; clones share the queue and the background task.
#[derive(Debug, Clone)]
pub struct Recorder {
    tx: mpsc::Sender<Queued>,
    dropped: Arc<AtomicU64>,
}

impl Recorder {
    /// Starts the background task that writes events with `client` (the low-priority client)
    /// as `component` on `host` (`source.host` and `reportingInstance`; empty: not set, as
    /// upstream's provisioner, which names its host in the component) until `shutdown`. Must
    /// be called within a Tokio runtime.
    pub fn start(
        client: kube::Client,
        component: &str,
        host: &str,
        shutdown: CancellationToken,
    ) -> Recorder {
        let (tx, rx) = mpsc::channel(QUEUE_BOUND);
        let source = Arc::new(EventSource {
            component: Some(component.to_owned()).filter(|c| !c.is_empty()),
            host: Some(host.to_owned()).filter(|h| !h.is_empty()),
        });
        tokio::spawn(write_events(client, source, rx, shutdown));
        Recorder {
            tx,
            dropped: Arc::default(),
        }
    }

    /// Records an event about `object`; returns at once (the event is queued, or dropped with
    /// a warning when [`QUEUE_BOUND`] events wait already or the recorder has shut down).
    pub fn event(&self, object: &ObjectReference, type_: EventType, reason: &str, message: &str) {
        let queued = Queued::new(
            object,
            type_,
            reason,
            cut(message, MAX_MESSAGE_BYTES),
            SystemTime::now(),
        );
        match self.tx.try_send(queued) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(e)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    object = e.part(3),
                    reason,
                    message = e.message(),
                    "unable to record event: too many queued events, dropped event"
                );
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(reason, "event recorder shut down, dropped event");
            }
        }
    }

    /// Events queued and not yet taken by the writer (at most [`QUEUE_BOUND`]).
    pub fn queued(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    /// Events dropped because the queue was full or the recorder had shut down.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// The Event client-go's `makeEvent` makes, at `now`.
pub fn make_event(
    source: &EventSource,
    object: &ObjectReference,
    type_: EventType,
    reason: &str,
    message: &str,
    now: SystemTime,
) -> Event {
    let ts = Timestamp::try_from(now).unwrap_or(Timestamp::UNIX_EPOCH);
    let namespace = match object.namespace.as_deref() {
        Some(ns) if !ns.is_empty() => ns.to_owned(),
        _ => "default".to_owned(),
    };
    let name = format!(
        "{}.{:x}",
        object.name.as_deref().unwrap_or(""),
        ts.as_nanosecond().max(0)
    );
    Event {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(namespace),
            ..ObjectMeta::default()
        },
        involved_object: object.clone(),
        reason: Some(reason.to_owned()),
        message: Some(cut(message, MAX_MESSAGE_BYTES).to_owned()),
        first_timestamp: Some(Time(ts)),
        last_timestamp: Some(Time(ts)),
        count: Some(1),
        type_: Some(type_.as_str().to_owned()),
        source: Some(source.clone()),
        reporting_component: source.component.clone(),
        reporting_instance: source.host.clone(),
        ..Event::default()
    }
}

/// `s` cut to at most `max` bytes at a character boundary.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A small least-recently-used map (client-go's `lru.Cache`): `get` and `put` make a key the
/// most recent; `put` beyond the capacity removes the least recent.
///
/// The entries live in one dense `Vec`, linked from most to least recent by index; the table
/// maps a key to its entry's index. A burst of claims fills each of a recorder's three caches
/// to thousands of keys, so the layout counts: a table of `(key, value)` beside an ordered map
/// of ticks would hold each key twice and a tick twice, in two structures with their own slack.
#[derive(Debug)]
struct Lru<K, V> {
    capacity: usize,
    map: HashMap<K, u32>,
    nodes: Vec<Node<K, V>>,
    /// The most recent entry ([`NIL`] when empty).
    head: u32,
    /// The least recent entry ([`NIL`] when empty).
    tail: u32,
}

/// An entry of [`Lru`] with its neighbours: `prev` more recent, `next` less.
#[derive(Debug)]
struct Node<K, V> {
    key: K,
    value: V,
    prev: u32,
    next: u32,
}

/// No entry.
const NIL: u32 = u32::MAX;

impl<K: Hash + Eq + Clone, V> Lru<K, V> {
    /// An empty cache of at most `capacity` keys (fewer than `u32::MAX`).
    fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.min(NIL as usize - 1),
            map: HashMap::new(),
            nodes: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    /// Points the entry `prev` (the head when [`NIL`]) forward at `forward`, and the entry
    /// `next` (the tail when [`NIL`]) back at `back`.
    fn relink(&mut self, prev: u32, next: u32, forward: u32, back: u32) {
        match prev {
            NIL => self.head = forward,
            p => self.nodes[p as usize].next = forward,
        }
        match next {
            NIL => self.tail = back,
            n => self.nodes[n as usize].prev = back,
        }
    }

    /// Takes entry `i` out of the recency list.
    fn unlink(&mut self, i: u32) {
        let (prev, next) = {
            let n = &self.nodes[i as usize];
            (n.prev, n.next)
        };
        self.relink(prev, next, next, prev);
    }

    /// Makes entry `i` (out of the list) the most recent.
    fn push_front(&mut self, i: u32) {
        let old = self.head;
        let n = &mut self.nodes[i as usize];
        n.prev = NIL;
        n.next = old;
        self.relink(NIL, old, i, i);
    }

    /// Makes entry `i` (in the list) the most recent; its value.
    fn promote(&mut self, i: u32) -> &mut V {
        self.unlink(i);
        self.push_front(i);
        &mut self.nodes[i as usize].value
    }

    /// Removes entry `i`; the last entry moves into its place.
    fn remove(&mut self, i: u32) {
        self.unlink(i);
        let gone = self.nodes.swap_remove(i as usize);
        self.map.remove(&gone.key);
        if let Some(moved) = self.nodes.get(i as usize) {
            let (prev, next) = (moved.prev, moved.next);
            if let Some(slot) = self.map.get_mut(&moved.key) {
                *slot = i;
            }
            self.relink(prev, next, i, i);
        }
    }

    /// Adds `key` (not present) as the most recent, evicting the least recent when full.
    fn insert_new(&mut self, key: K, value: V) -> &mut V {
        if self.nodes.len() >= self.capacity && self.tail != NIL {
            self.remove(self.tail);
        }
        let i = self.nodes.len() as u32;
        self.map.insert(key.clone(), i);
        self.nodes.push(Node {
            key,
            value,
            prev: NIL,
            next: NIL,
        });
        self.push_front(i);
        &mut self.nodes[i as usize].value
    }

    fn touch(&mut self, key: &K) -> Option<&mut V> {
        let i = *self.map.get(key)?;
        Some(self.promote(i))
    }

    /// The value of `key`, made the most recent; one made by `make` (evicting the least recent
    /// when full) if there is none.
    fn entry(&mut self, key: K, make: impl FnOnce() -> V) -> &mut V {
        match self.map.get(&key).copied() {
            Some(i) => self.promote(i),
            None => self.insert_new(key, make()),
        }
    }

    fn put(&mut self, key: K, value: V) {
        if let Some(v) = self.touch(&key) {
            *v = value;
            return;
        }
        self.insert_new(key, value);
    }

    /// Removes the least recently used entries for as long as `dead` says of the oldest that
    /// it is as good as absent: for a cache whose values are touched with their time, those
    /// that have aged out. Amortised O(1) per entry.
    ///
    /// The table and the entries shrink to twice their number once they fill less than a
    /// quarter (a map or `Vec` keeps its largest size otherwise).
    fn forget_oldest_while(&mut self, mut dead: impl FnMut(&V) -> bool) {
        let before = self.nodes.len();
        while self.tail != NIL && dead(&self.nodes[self.tail as usize].value) {
            self.remove(self.tail);
        }
        let len = self.nodes.len();
        if len < before && len < self.map.capacity() / 4 {
            self.map.shrink_to(len * 2);
            self.nodes.shrink_to(len * 2);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.nodes.len()
    }
}

/// What was last written for an identical event (client-go's `eventLog`), less its
/// resourceVersion: client-go keeps that too, but neither its PATCH (by name, of count,
/// lastTimestamp and message) nor a POST after it sends it, so here it would only be one more
/// heap block per key, thousands of keys in a burst.
#[derive(Debug, Clone)]
struct Observation {
    count: i32,
    first_timestamp: Option<Time>,
    name: Option<Box<str>>,
}

/// client-go's passive token bucket for the spam filter.
#[derive(Debug)]
struct SpamBucket {
    tokens: f64,
    last: Instant,
}

/// What to write for one event.
#[derive(Debug)]
pub(crate) struct Correlated {
    event: Event,
    /// `Some(patch)` when an identical event exists: PATCH instead of POST.
    patch: Option<serde_json::Value>,
}

/// The different messages seen of similar events (client-go's `aggregateRecord`), as digests:
/// fewer than [`AGGREGATE_MAX_MESSAGES`], so a list (one allocation of 8 bytes a message, where
/// a set's table took 64 for the usual one).
#[derive(Debug, Default)]
struct Similar {
    messages: Vec<u64>,
    last: Option<Instant>,
}

/// client-go's `EventCorrelator`: aggregation of similar events, the log of identical ones,
/// the spam filter.
#[derive(Debug)]
pub(crate) struct Correlator {
    similar: Lru<Key, Similar>,
    observed: Lru<Key, Observation>,
    spam: Lru<Key, SpamBucket>,
}

impl Default for Correlator {
    fn default() -> Self {
        Self {
            similar: Lru::new(CACHE_ENTRIES),
            observed: Lru::new(CACHE_ENTRIES),
            spam: Lru::new(CACHE_ENTRIES),
        }
    }
}

/// A correlation key: what client-go joins into one string (source, involved object and, for
/// identical events, type, reason and message), kept as 128 bits of two keyed SipHash digests
/// of the parts instead of the string. The caches hold thousands of keys when a burst of
/// claims queues two events each (the message alone is often 100 bytes, and an LRU keeps its
/// key twice); two different events share a key with a chance of about n^2 / 2^129 for n keys
/// held, nil for 4,096. Two `u64`s, not a `u128`: a `u128`'s 16-byte alignment would pad every
/// entry of the caches' tables to a multiple of 16 bytes.
type Key = [u64; 2];

/// The key of similar events (client-go's `EventAggregatorByReasonFunc`): source, involved
/// object, type, reason and the reporting controller and instance; tagged apart from
/// [`join_key`]'s.
fn similar_key(e: &Event) -> Key {
    let src = e.source.as_ref();
    let o = &e.involved_object;
    let parts = [
        "similar",
        src.and_then(|s| s.component.as_deref()).unwrap_or(""),
        src.and_then(|s| s.host.as_deref()).unwrap_or(""),
        o.kind.as_deref().unwrap_or(""),
        o.namespace.as_deref().unwrap_or(""),
        o.name.as_deref().unwrap_or(""),
        o.uid.as_deref().unwrap_or(""),
        o.api_version.as_deref().unwrap_or(""),
        e.type_.as_deref().unwrap_or(""),
        e.reason.as_deref().unwrap_or(""),
        e.reporting_component.as_deref().unwrap_or(""),
        e.reporting_instance.as_deref().unwrap_or(""),
    ];
    digest(&parts)
}

fn digest(parts: &[&str]) -> Key {
    use std::hash::{DefaultHasher, Hash as _, Hasher as _};
    // Two digests of the same parts under different prefixes; a `str` hashes with a
    // terminator, so different splits of the same characters differ (client-go joins with "",
    // where they collide).
    let (mut a, mut b) = (DefaultHasher::new(), DefaultHasher::new());
    b.write_u8(0x5a);
    parts.len().hash(&mut a);
    parts.len().hash(&mut b);
    for p in parts {
        p.hash(&mut a);
        p.hash(&mut b);
    }
    [a.finish(), b.finish()]
}

fn join_key(e: &Event, with_event: bool) -> Key {
    let src = e.source.as_ref();
    let o = &e.involved_object;
    let mut parts = vec![
        src.and_then(|s| s.component.as_deref()).unwrap_or(""),
        src.and_then(|s| s.host.as_deref()).unwrap_or(""),
        o.kind.as_deref().unwrap_or(""),
        o.namespace.as_deref().unwrap_or(""),
        o.name.as_deref().unwrap_or(""),
    ];
    if with_event {
        parts.push(o.field_path.as_deref().unwrap_or(""));
    }
    parts.push(o.uid.as_deref().unwrap_or(""));
    parts.push(o.api_version.as_deref().unwrap_or(""));
    if with_event {
        parts.push(e.type_.as_deref().unwrap_or(""));
        parts.push(e.reason.as_deref().unwrap_or(""));
        parts.push(e.message.as_deref().unwrap_or(""));
    }
    digest(&parts)
}

impl Correlator {
    /// client-go's `EventCorrelate`: the event to write (a PATCH of the earlier identical
    /// one, or a POST), or `None` when the spam filter drops it.
    pub(crate) fn correlate(&mut self, event: Event, now: Instant) -> Option<Correlated> {
        self.forget_aged(now);
        let (mut event, key) = self.aggregate(event, now);
        let mut patch = None;
        if let Some(last) = self.observed.touch(&key).cloned() {
            event.metadata.name = last.name.map(String::from);
            event.first_timestamp = last.first_timestamp;
            event.count = Some(last.count.saturating_add(1));
            // What client-go's two-way strategic merge patch of (count 0, lastTimestamp 0,
            // message "") against the event amounts to.
            let mut p = serde_json::Map::new();
            p.insert("count".into(), serde_json::json!(event.count));
            p.insert(
                "lastTimestamp".into(),
                serde_json::to_value(&event.last_timestamp).unwrap_or_default(),
            );
            if event.message.as_deref().is_some_and(|m| !m.is_empty()) {
                p.insert("message".into(), serde_json::json!(event.message));
            }
            patch = Some(serde_json::Value::Object(p));
        }
        self.observed.put(key, observation(&event));
        if !self.spam_accept(&event, now) {
            return None;
        }
        Some(Correlated { event, patch })
    }

    /// Forgets the similar-event records and spam buckets that have aged into what an absent
    /// key gives: a record whose last event is more than [`AGGREGATE_WINDOW`] ago starts again
    /// empty, and a bucket refilled to [`SPAM_BURST`] is a new bucket. client-go keeps both
    /// until its LRU evicts them, which changes nothing but the memory: every object's
    /// records would stay for the process's life, up to [`CACHE_ENTRIES`] keys a cache.
    /// Each cache's entries are touched with their time, so its oldest entries are the ones
    /// to look at; a bucket behind an older one that is still refilling waits for it, at
    /// most `SPAM_BURST * SPAM_REFILL`.
    fn forget_aged(&mut self, now: Instant) {
        self.similar.forget_oldest_while(|r| {
            r.last
                .is_none_or(|last| now.saturating_duration_since(last) > AGGREGATE_WINDOW)
        });
        self.spam
            .forget_oldest_while(|b| refilled(b, now) >= SPAM_BURST);
    }

    /// client-go's `EventAggregate`: `event` and its key, or from the
    /// [`AGGREGATE_MAX_MESSAGES`]th different message of similar events on, a new event with
    /// the combined message under the similar events' key (so that it is written once and then
    /// counted).
    fn aggregate(&mut self, mut event: Event, now: Instant) -> (Event, Key) {
        use std::hash::{DefaultHasher, Hash as _, Hasher as _};
        let key = similar_key(&event);
        let full = join_key(&event, true);
        let mut h = DefaultHasher::new();
        event.message.as_deref().unwrap_or("").hash(&mut h);
        let message = h.finish();
        let record = self.similar.entry(key, Similar::default);
        if record
            .last
            .is_some_and(|last| now.saturating_duration_since(last) > AGGREGATE_WINDOW)
        {
            record.messages.clear();
        }
        if !record.messages.contains(&message) {
            record.messages.push(message);
        }
        record.last = Some(now);
        if record.messages.len() < AGGREGATE_MAX_MESSAGES {
            return (event, full);
        }
        // client-go keeps the set at its size by dropping any one message.
        record.messages.swap_remove(0);
        let combined = format!(
            "{AGGREGATE_PREFIX}{}",
            event.message.as_deref().unwrap_or("")
        );
        event.message = Some(cut(&combined, MAX_MESSAGE_BYTES).to_owned());
        (event, key)
    }

    /// client-go's `UpdateState`: remember what the API server has.
    pub(crate) fn written(&mut self, event: &Event) {
        self.observed.put(join_key(event, true), observation(event));
    }

    fn spam_accept(&mut self, event: &Event, now: Instant) -> bool {
        let key = join_key(event, false);
        let bucket = self.spam.entry(key, || SpamBucket {
            tokens: SPAM_BURST,
            last: now,
        });
        bucket.tokens = refilled(bucket, now).min(SPAM_BURST);
        bucket.last = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// The tokens `b` holds at `now`, before the cap at [`SPAM_BURST`].
fn refilled(b: &SpamBucket, now: Instant) -> f64 {
    let elapsed = now.saturating_duration_since(b.last).as_secs_f64();
    b.tokens + elapsed / SPAM_REFILL.as_secs_f64()
}

fn observation(e: &Event) -> Observation {
    Observation {
        count: e.count.unwrap_or(0),
        first_timestamp: e.first_timestamp.clone(),
        name: e.metadata.name.as_deref().map(Box::from),
    }
}

/// The background task: writes the queued events one after the other until `shutdown`.
async fn write_events(
    client: kube::Client,
    source: Arc<EventSource>,
    mut rx: mpsc::Receiver<Queued>,
    shutdown: CancellationToken,
) {
    let mut correlator = Correlator::default();
    loop {
        let q = tokio::select! {
            _ = shutdown.cancelled() => return,
            e = rx.recv() => match e {
                Some(e) => e,
                None => return,
            },
        };
        let event = make_event(&source, &q.object(), q.type_, q.reason(), q.message(), q.at);
        let Some(c) = correlator.correlate(event, Instant::now()) else {
            continue;
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            () = record_to_sink(&client, &mut correlator, c) => {}
        }
    }
}

/// Tries to write one event, as client-go's `recordToSink`.
async fn record_to_sink(client: &kube::Client, correlator: &mut Correlator, c: Correlated) {
    let Correlated { mut event, patch } = c;
    let ns = event.metadata.namespace.clone().unwrap_or_default();
    let api: Api<Event> = Api::namespaced(client.clone(), &ns);
    let mut tries = 0;
    loop {
        match record_once(&api, &mut event, patch.as_ref()).await {
            Ok(written) => {
                correlator.written(&written);
                return;
            }
            Err(kube::Error::Api(status)) => {
                // The API server answered: trying again would get the same answer.
                let level_debug = status.code == 409;
                if level_debug {
                    tracing::debug!(event = ?event.metadata.name, %status, "server rejected event (will not retry)");
                } else {
                    tracing::error!(event = ?event.metadata.name, %status, "server rejected event (will not retry)");
                }
                return;
            }
            Err(e) => {
                tries += 1;
                if tries >= MAX_TRIES {
                    tracing::error!(event = ?event.metadata.name, error = %e, "unable to write event (retry limit exceeded)");
                    return;
                }
                tracing::warn!(event = ?event.metadata.name, error = %e, "unable to write event (may retry after sleeping)");
                let delay = if tries == 1 {
                    RETRY_SLEEP.mul_f64(plugreg_runtime::backoff::unit_random())
                } else {
                    RETRY_SLEEP
                };
                tokio::time::sleep(delay).await;
            }
        }
    }
}

async fn record_once(
    api: &Api<Event>,
    event: &mut Event,
    patch: Option<&serde_json::Value>,
) -> Result<Event, kube::Error> {
    if let (Some(p), Some(name)) = (patch, event.metadata.name.as_deref()) {
        match api
            .patch(name, &PatchParams::default(), &Patch::Strategic(p))
            .await
        {
            Err(kube::Error::Api(s)) if s.code == 404 => {} // gone (TTL): create it again
            r => return r,
        }
    }
    api.create(&PostParams::default(), event).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pvc(name: &str) -> ObjectReference {
        ObjectReference {
            kind: Some("PersistentVolumeClaim".into()),
            namespace: Some("ns".into()),
            name: Some(name.into()),
            uid: Some("uid-1".into()),
            api_version: Some("v1".into()),
            ..ObjectReference::default()
        }
    }

    #[test]
    fn a_queued_event_gives_back_what_was_queued() {
        let mut object = pvc("data");
        object.resource_version = Some(String::new());
        let q = Queued::new(
            &object,
            EventType::Warning,
            "ProvisioningFailed",
            "bad ünicode",
            SystemTime::UNIX_EPOCH,
        );
        // Set-but-empty and unset fields stay apart.
        assert_eq!(q.object(), object);
        assert_eq!(q.reason(), "ProvisioningFailed");
        assert_eq!(q.message(), "bad ünicode");
        let empty = Queued::new(
            &ObjectReference::default(),
            EventType::Normal,
            "",
            "",
            SystemTime::UNIX_EPOCH,
        );
        assert_eq!(empty.object(), ObjectReference::default());
        assert_eq!((empty.reason(), empty.message()), ("", ""));
        assert!(std::mem::size_of::<Queued>() <= 80);
    }

    #[test]
    fn a_cache_entry_is_not_padded_to_sixteen_bytes() {
        // An observed event's entry and its table slot, at 8-byte alignment (a `u128` key made
        // the entry 96 bytes, beside a tick in an ordered map).
        assert_eq!(std::mem::align_of::<Key>(), 8);
        assert!(std::mem::size_of::<Node<Key, Observation>>() <= 72);
        assert_eq!(std::mem::size_of::<(Key, u32)>(), 24);
    }

    fn source() -> EventSource {
        EventSource {
            component: Some("c".into()),
            host: None,
        }
    }

    #[test]
    fn events_are_named_after_the_object_and_the_time_in_hex_nanoseconds() {
        let at = SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 123);
        let e = make_event(&source(), &pvc("claim"), EventType::Warning, "R", "m", at);
        assert_eq!(
            e.metadata.name.as_deref(),
            Some(format!("claim.{:x}", 1_700_000_000_000_000_123u64).as_str())
        );
        assert_eq!(e.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert_eq!(e.count, Some(1));
        assert_eq!(e.reporting_component.as_deref(), Some("c"));
        assert_eq!(e.reporting_instance, None);
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["firstTimestamp"], "2023-11-14T22:13:20Z");
        assert_eq!(json["lastTimestamp"], "2023-11-14T22:13:20Z");
    }

    #[test]
    fn messages_are_cut_at_a_character_boundary() {
        let long = "é".repeat(600); // 1200 bytes
        let e = make_event(
            &source(),
            &pvc("c"),
            EventType::Normal,
            "R",
            &long,
            SystemTime::now(),
        );
        let m = e.message.unwrap();
        assert_eq!(m.len(), 1024);
        assert!(m.chars().all(|c| c == 'é'));
        assert_eq!(cut("abc", 2), "ab");
        assert_eq!(cut("aé", 2), "a");
    }

    #[test]
    fn an_identical_event_becomes_a_patch_of_the_first() {
        let mut c = Correlator::default();
        let now = Instant::now();
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let first = make_event(&source(), &pvc("a"), EventType::Normal, "R", "m", t0);
        let first_name = first.metadata.name.clone();
        let r = c.correlate(first, now).unwrap();
        assert!(r.patch.is_none());
        let mut written = r.event;
        written.metadata.resource_version = Some("7".into());
        c.written(&written);

        let t1 = t0 + Duration::from_secs(30);
        let again = make_event(&source(), &pvc("a"), EventType::Normal, "R", "m", t1);
        let r = c.correlate(again, now).unwrap();
        assert_eq!(r.event.metadata.name, first_name);
        assert_eq!(r.event.count, Some(2));
        assert_eq!(
            r.patch.unwrap(),
            serde_json::json!({"count": 2, "lastTimestamp": "2023-11-14T22:13:50Z", "message": "m"})
        );
        let json = serde_json::to_value(&r.event).unwrap();
        assert_eq!(json["firstTimestamp"], "2023-11-14T22:13:20Z");

        // Another message, reason, type or object is another event.
        for e in [
            make_event(&source(), &pvc("a"), EventType::Normal, "R", "m2", t1),
            make_event(&source(), &pvc("a"), EventType::Normal, "R2", "m", t1),
            make_event(&source(), &pvc("a"), EventType::Warning, "R", "m", t1),
            make_event(&source(), &pvc("b"), EventType::Normal, "R", "m", t1),
        ] {
            assert!(c.correlate(e, now).unwrap().patch.is_none());
        }
    }

    /// client-go's aggregation: the 10th different message of similar events (same object,
    /// type and reason) within ten minutes is written as a new combined event, and the ones
    /// after it patch that event (its count, its latest message); ten minutes of quiet start
    /// the count again.
    #[test]
    fn similar_events_are_combined_from_the_tenth_message_on() {
        let mut c = Correlator::default();
        let now = Instant::now();
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let ev = |i: u32| {
            make_event(
                &source(),
                &pvc("a"),
                EventType::Warning,
                "VolumeConditionAbnormal",
                &format!("message {i}"),
                t0 + Duration::from_secs(u64::from(i)),
            )
        };
        for i in 0..9 {
            let r = c.correlate(ev(i), now).unwrap();
            assert!(r.patch.is_none());
            assert_eq!(r.event.message, Some(format!("message {i}")));
        }
        let tenth = c.correlate(ev(9), now).unwrap();
        assert!(tenth.patch.is_none());
        assert_eq!(
            tenth.event.message.as_deref(),
            Some("(combined from similar events): message 9")
        );
        let combined = tenth.event.metadata.name.clone();
        let eleventh = c.correlate(ev(10), now).unwrap();
        assert_eq!(eleventh.event.metadata.name, combined);
        assert_eq!(eleventh.event.count, Some(2));
        assert_eq!(
            eleventh.patch.unwrap()["message"],
            "(combined from similar events): message 10"
        );
        // Another reason is not similar.
        let other = make_event(&source(), &pvc("a"), EventType::Warning, "R", "x", t0);
        assert_eq!(
            c.correlate(other, now).unwrap().event.message.as_deref(),
            Some("x")
        );
        // Ten quiet minutes later the messages count from one again.
        let later = now + AGGREGATE_WINDOW + Duration::from_secs(1);
        let r = c.correlate(ev(11), later).unwrap();
        assert_eq!(r.event.message.as_deref(), Some("message 11"));
    }

    #[test]
    fn the_spam_filter_lets_25_through_then_one_per_five_minutes() {
        let mut c = Correlator::default();
        let now = Instant::now();
        let mut passed = 0;
        for i in 0..40 {
            // Different messages: the filter is per source and object.
            let e = make_event(
                &source(),
                &pvc("a"),
                EventType::Normal,
                "R",
                &format!("m{i}"),
                SystemTime::now(),
            );
            passed += usize::from(c.correlate(e, now).is_some());
        }
        assert_eq!(passed, 25);
        let other = make_event(
            &source(),
            &pvc("b"),
            EventType::Normal,
            "R",
            "m",
            SystemTime::now(),
        );
        assert!(c.correlate(other, now).is_some());
        let e = || {
            make_event(
                &source(),
                &pvc("a"),
                EventType::Normal,
                "R",
                "x",
                SystemTime::now(),
            )
        };
        assert!(c.correlate(e(), now + Duration::from_secs(299)).is_none());
        // Two tokens have grown back after ten minutes, no more.
        let later = now + Duration::from_secs(600);
        assert!(c.correlate(e(), later).is_some());
        assert!(c.correlate(e(), later).is_some());
        assert!(c.correlate(e(), later).is_none());
    }

    #[test]
    fn the_caches_forget_the_least_recently_used_key_first() {
        let mut l = Lru::new(3);
        l.put("a", 1);
        l.put("b", 2);
        l.put("c", 3);
        assert_eq!(l.touch(&"a").copied(), Some(1));
        l.put("d", 4);
        assert_eq!(l.len(), 3);
        assert!(l.touch(&"b").is_none());
        assert!(l.touch(&"a").is_some());
        assert!(l.touch(&"c").is_some());
        assert!(l.touch(&"d").is_some());
        // `entry` keeps an existing value (now the most recent) and makes a missing one,
        // evicting the least recent: order now a, c, d.
        assert_eq!(*l.entry("a", || 9), 1);
        *l.entry("e", || 5) += 1;
        assert_eq!(l.len(), 3);
        assert!(l.touch(&"c").is_none());
        assert_eq!(l.touch(&"e").copied(), Some(6));
        let mut c = Correlator::default();
        for i in 0..CACHE_ENTRIES + 100 {
            let e = make_event(
                &source(),
                &pvc(&format!("o{i}")),
                EventType::Normal,
                "R",
                "m",
                SystemTime::now(),
            );
            c.correlate(e, Instant::now());
        }
        assert_eq!(c.observed.len(), CACHE_ENTRIES);
        assert_eq!(c.spam.len(), CACHE_ENTRIES);
    }

    /// The linked entries against the plainest model of an LRU (a list, most recent first),
    /// over a long run of every operation on few keys, so that evictions, moves of the last
    /// entry into a removed one's place and forgetting at the tail all happen often.
    #[test]
    fn the_cache_agrees_with_a_list_model_over_random_operations() {
        let mut l: Lru<u32, u64> = Lru::new(16);
        let mut model: Vec<(u32, u64)> = Vec::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = (x % 40) as u32;
            let pos = model.iter().position(|(k, _)| *k == key);
            match (x >> 8) % 4 {
                0 => {
                    let got = l.touch(&key).copied();
                    assert_eq!(got, pos.map(|p| model[p].1), "touch {key} at {step}");
                    if let Some(p) = pos {
                        let e = model.remove(p);
                        model.insert(0, e);
                    }
                }
                1 => {
                    l.put(key, step);
                    if let Some(p) = pos {
                        model.remove(p);
                    } else if model.len() >= 16 {
                        model.pop();
                    }
                    model.insert(0, (key, step));
                }
                2 => {
                    let v = *l.entry(key, || step);
                    let e = match pos {
                        Some(p) => model.remove(p),
                        None => {
                            if model.len() >= 16 {
                                model.pop();
                            }
                            (key, step)
                        }
                    };
                    assert_eq!(v, e.1, "entry {key} at {step}");
                    model.insert(0, e);
                }
                _ => {
                    let cut = step.saturating_sub(30);
                    l.forget_oldest_while(|&v| v < cut);
                    while model.last().is_some_and(|&(_, v)| v < cut) {
                        model.pop();
                    }
                }
            }
            assert_eq!(l.len(), model.len(), "length at {step}");
            // The recency order, most recent first, is the model's.
            let mut order = Vec::new();
            let mut i = l.head;
            while i != NIL {
                let n = &l.nodes[i as usize];
                order.push((n.key, n.value));
                i = n.next;
            }
            assert_eq!(order, model, "order at {step}");
        }
    }

    /// A similar-event record older than the window and a spam bucket full again are
    /// forgotten (the next event finds what a new key gives); the identical-event log stays.
    #[test]
    fn aged_records_and_refilled_buckets_are_forgotten() {
        let mut c = Correlator::default();
        let t0 = Instant::now();
        let e = |obj: &str, msg: &str| {
            make_event(
                &source(),
                &pvc(obj),
                EventType::Normal,
                "R",
                msg,
                SystemTime::now(),
            )
        };
        assert!(c.correlate(e("a", "m"), t0).is_some());
        assert_eq!((c.similar.len(), c.spam.len(), c.observed.len()), (1, 1, 1));
        // One token spent: "a"'s bucket is full again after five minutes.
        assert!(
            c.correlate(e("b", "m"), t0 + Duration::from_secs(299))
                .is_some()
        );
        assert_eq!((c.similar.len(), c.spam.len()), (2, 2));
        assert!(
            c.correlate(e("b", "n"), t0 + Duration::from_secs(301))
                .is_some()
        );
        assert_eq!((c.similar.len(), c.spam.len()), (2, 1));
        // "a"'s record is more than ten minutes old, "b"'s is not; "b"'s bucket (two spent)
        // is still refilling.
        assert!(
            c.correlate(e("c", "m"), t0 + Duration::from_secs(601))
                .is_some()
        );
        assert_eq!((c.similar.len(), c.spam.len(), c.observed.len()), (2, 2, 4));
        // The tables shrink with what they hold.
        let mut l = Lru::new(CACHE_ENTRIES);
        for i in 0..1000 {
            l.put(i, i);
        }
        let grown = l.map.capacity();
        l.forget_oldest_while(|&v| v < 990);
        assert_eq!(l.len(), 10);
        assert!(
            l.map.capacity() < grown / 4,
            "{} of {grown}",
            l.map.capacity()
        );
        assert_eq!(l.touch(&995).copied(), Some(995));
        // The identical event is still counted on.
        let again = c.correlate(e("a", "m"), t0 + Duration::from_secs(602));
        assert_eq!(again.and_then(|c| c.event.count), Some(2));
        // "a" starts again as a new object: 25 events pass (the one above was the first).
        let later = t0 + Duration::from_secs(603);
        let passed = (0..30)
            .filter(|i| c.correlate(e("a", &format!("x{i}")), later).is_some())
            .count();
        assert_eq!(passed, 24);
    }

    /// The keys tell what client-go's joined strings tell: the same event is the same key, a
    /// different message or object another; the object key ignores the event's own fields.
    #[test]
    fn keys_tell_events_apart_as_the_joined_strings_do() {
        let t = SystemTime::now();
        let e = |obj: &str, reason: &str, msg: &str| {
            make_event(&source(), &pvc(obj), EventType::Normal, reason, msg, t)
        };
        assert_eq!(
            join_key(&e("a", "R", "m"), true),
            join_key(&e("a", "R", "m"), true)
        );
        assert_ne!(
            join_key(&e("a", "R", "m"), true),
            join_key(&e("a", "R", "n"), true)
        );
        assert_ne!(
            join_key(&e("a", "R", "m"), true),
            join_key(&e("b", "R", "m"), true)
        );
        // The same characters split differently between reason and message.
        assert_ne!(
            join_key(&e("a", "Rm", ""), true),
            join_key(&e("a", "R", "m"), true)
        );
        assert_eq!(
            join_key(&e("a", "R", "m"), false),
            join_key(&e("a", "S", "n"), false)
        );
    }
}
