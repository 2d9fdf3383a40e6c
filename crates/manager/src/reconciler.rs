//! The reconciler: one task that owns the desired state, the actual state and every socket's
//! operation and back-off, and brings the actual state to the desired one.
//!
//! It is event-driven (D1): a watcher event, a finished operation, a back-off expiry or a
//! liveness probe result wakes it at once, and it looks only at the sockets they concern. A
//! periodic resync looks at everything as a safety net. At most one operation runs per socket
//! (register and deregister share it), and at most `max_concurrent_operations` in all (D7).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::backoff::Backoff;
use crate::config::ManagerConfig;
use crate::handler::HandlerRegistry;
use crate::metrics::Metrics;
use crate::operation::{self, RegisterError, Registered, Step, Timeouts};
use crate::record::{ManagerEvent, PluginRecord, PluginState};
use crate::state::{ActualEntry, ActualState, DesiredState, FileId};
use crate::watcher::WatchEvent;

/// State shared with the [`PluginManager`](crate::PluginManager) handle.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) records: Mutex<HashMap<PathBuf, PluginRecord>>,
    pub(crate) events: broadcast::Sender<ManagerEvent>,
    pub(crate) metrics: Metrics,
}

/// The kind of operation running on a socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Register,
    Deregister,
}

/// Everything about one socket besides the two states.
#[derive(Debug, Default)]
struct Slot {
    op: Option<OpKind>,
    backoff: Option<Backoff>,
    last_error: Option<(Step, String)>,
    last_info: Option<(String, String, String, Vec<String>)>,
    registered_at: Option<SystemTime>,
    /// The file of a socket found dead (D5); the same file is not registered again.
    dead: Option<FileId>,
    refusals: u32,
    queued: bool,
    /// The back-off wake-up already in the timer heap, so it is pushed once.
    wake_at: Option<Instant>,
    /// Quiet re-dials of a young socket that refused (D1): the instance, how many so far, and
    /// when the next may start.
    redial: Option<(u64, u32, Instant)>,
}

/// The wait before the `n`-th quiet re-dial of a young socket (D1): 1 ms doubling to 8 ms.
fn redial_delay(n: u32) -> std::time::Duration {
    std::time::Duration::from_millis(1 << n.min(3))
}

/// What a finished operation reports.
enum Done {
    Registered {
        path: PathBuf,
        instance: u64,
        result: Box<Result<Registered, RegisterError>>,
    },
    Deregistered {
        path: PathBuf,
        entry: ActualEntry,
    },
}

/// A liveness probe result (D5).
pub(crate) struct Probe {
    pub(crate) path: PathBuf,
    pub(crate) refused: bool,
}

pub(crate) struct Reconciler {
    config: ManagerConfig,
    handlers: Arc<HandlerRegistry>,
    shared: Arc<Shared>,
    desired: DesiredState,
    actual: ActualState,
    slots: HashMap<PathBuf, Slot>,
    dirty: HashSet<PathBuf>,
    waiting: VecDeque<PathBuf>,
    timers: BinaryHeap<Reverse<(Instant, PathBuf)>>,
    running: usize,
    done_tx: mpsc::UnboundedSender<Done>,
    done_rx: mpsc::UnboundedReceiver<Done>,
    tasks: tokio::task::JoinSet<()>,
}

impl Reconciler {
    pub(crate) fn new(
        config: ManagerConfig,
        handlers: HandlerRegistry,
        shared: Arc<Shared>,
    ) -> Self {
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        Self {
            config,
            handlers: Arc::new(handlers),
            shared,
            desired: DesiredState::new(),
            actual: ActualState::new(),
            slots: HashMap::new(),
            dirty: HashSet::new(),
            waiting: VecDeque::new(),
            timers: BinaryHeap::new(),
            running: 0,
            done_tx,
            done_rx,
            tasks: tokio::task::JoinSet::new(),
        }
    }

    pub(crate) async fn run(
        mut self,
        mut watch_rx: mpsc::Receiver<WatchEvent>,
        mut probe_rx: mpsc::Receiver<Probe>,
        token: CancellationToken,
    ) {
        let mut resync = tokio::time::interval(self.config.resync_period);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut watcher_open = true;
        loop {
            let next_timer = self.timers.peek().map(|Reverse((at, _))| *at);
            tokio::select! {
                biased;
                _ = token.cancelled() => break,
                ev = watch_rx.recv(), if watcher_open => match ev {
                    Some(ev) => {
                        self.on_watch(ev);
                        while let Ok(ev) = watch_rx.try_recv() {
                            self.on_watch(ev);
                        }
                    }
                    None => watcher_open = false,
                },
                Some(done) = self.done_rx.recv() => {
                    self.on_done(done);
                    while let Ok(done) = self.done_rx.try_recv() {
                        self.on_done(done);
                    }
                }
                Some(probe) = probe_rx.recv() => self.on_probe(probe),
                _ = sleep_until(next_timer), if next_timer.is_some() => {
                    let now = Instant::now();
                    while let Some(Reverse((at, _))) = self.timers.peek() {
                        if *at > now {
                            break;
                        }
                        if let Some(Reverse((at, path))) = self.timers.pop() {
                            if let Some(s) = self.slots.get_mut(&path)
                                && s.wake_at == Some(at)
                            {
                                s.wake_at = None;
                            }
                            self.dirty.insert(path);
                        }
                    }
                }
                _ = resync.tick() => self.mark_divergent(),
            }
            self.reconcile();
        }
        // Bounded shutdown: operations in flight are abandoned, plugin sockets are untouched.
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
    }

    /// Marks every socket whose desired and actual state differ (the periodic safety net);
    /// sockets already registered as desired cost one lookup and nothing else.
    fn mark_divergent(&mut self) {
        let actual = &self.actual;
        let mut dirty: Vec<PathBuf> = self
            .desired
            .iter()
            .filter(|(p, d)| !actual.has_instance(p, d.instance))
            .map(|(p, _)| p.clone())
            .collect();
        dirty.extend(
            self.actual
                .iter()
                .filter(|(p, _)| !self.desired.contains(p))
                .map(|(p, _)| p.clone()),
        );
        self.dirty.extend(dirty);
    }

    /// Wakes the reconciler for `path` at `at`, once.
    fn schedule(&mut self, path: &Path, at: Instant) {
        let slot = self.slot(path);
        if slot.wake_at == Some(at) {
            return;
        }
        slot.wake_at = Some(at);
        self.timers.push(Reverse((at, path.to_owned())));
    }

    fn slot(&mut self, path: &Path) -> &mut Slot {
        if !self.slots.contains_key(path) {
            self.slots.insert(path.to_owned(), Slot::default());
        }
        self.slots.get_mut(path).expect("inserted above")
    }

    fn on_watch(&mut self, ev: WatchEvent) {
        let now = Instant::now();
        match ev {
            WatchEvent::Added { path, file } => self.add(path, file, now),
            WatchEvent::Removed { path } => {
                tracing::debug!(path = %path.display(), "Removing socket path from desired state cache");
                self.desired.remove(&path);
                if let Some(s) = self.slots.get_mut(&path) {
                    s.dead = None;
                }
                self.dirty.insert(path);
            }
            WatchEvent::RemovedUnder { dir } => {
                for path in self.desired.remove_under(&dir) {
                    tracing::debug!(path = %path.display(), "Removing socket path from desired state cache");
                    self.dirty.insert(path);
                }
                for (path, slot) in self.slots.iter_mut() {
                    if path.starts_with(&dir) && slot.dead.take().is_some() {
                        self.dirty.insert(path.clone());
                    }
                }
            }
            WatchEvent::Rescanned { sockets } => {
                self.shared.metrics.rescanned();
                let present: HashSet<&PathBuf> = sockets.iter().map(|(p, _)| p).collect();
                let gone: Vec<PathBuf> = self
                    .desired
                    .iter()
                    .filter(|(p, _)| !present.contains(p))
                    .map(|(p, _)| p.clone())
                    .collect();
                for path in gone {
                    self.desired.remove(&path);
                    self.dirty.insert(path);
                }
                for (path, slot) in self.slots.iter_mut() {
                    if slot.dead.is_some() && !present.contains(path) {
                        slot.dead = None;
                        self.dirty.insert(path.clone());
                    }
                }
                for (path, file) in sockets {
                    self.add(path, file, now);
                }
            }
        }
    }

    fn add(&mut self, path: PathBuf, file: FileId, now: Instant) {
        if let Some(s) = self.slots.get_mut(&path) {
            if s.dead == Some(file) {
                return;
            }
            s.dead = None;
        }
        match self.desired.ensure(&path, file, now) {
            Ok(true) => {
                tracing::debug!(path = %path.display(), "Adding socket path or updating timestamp to desired state cache");
                self.dirty.insert(path);
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot add socket"),
        }
    }

    fn on_probe(&mut self, probe: Probe) {
        let Some(liveness) = self.config.liveness else {
            return;
        };
        if self.actual.get(&probe.path).is_none() {
            return;
        }
        let file = self.desired.get(&probe.path).and_then(|d| d.file);
        let slot = self.slot(&probe.path);
        if !probe.refused {
            slot.refusals = 0;
            return;
        }
        slot.refusals += 1;
        if slot.refusals < liveness.failure_threshold {
            return;
        }
        slot.refusals = 0;
        slot.dead = file;
        tracing::warn!(
            socket = %probe.path.display(),
            refusals = liveness.failure_threshold,
            "plugin socket refuses connections; its plugin is gone, deregistering"
        );
        self.shared.metrics.dead();
        self.desired.remove(&probe.path);
        self.dirty.insert(probe.path);
    }

    fn on_done(&mut self, done: Done) {
        // Finished tasks keep their memory until joined: reap them as they end.
        while self.tasks.try_join_next().is_some() {}
        self.running -= 1;
        match done {
            Done::Registered {
                path,
                instance,
                result,
            } => {
                let seen_at = self
                    .desired
                    .get(&path)
                    .filter(|d| d.instance == instance)
                    .map(|d| d.seen_at);
                let (initial, max) = (self.config.backoff_initial, self.config.backoff_max);
                match *result {
                    Err(err) if err.young_refusal => {
                        // D1: bound but not listening yet; not a failure, no warning.
                        tracing::debug!(socket = %path.display(), error = %err.message, "socket refused while young; re-dialling");
                        let now = Instant::now();
                        let slot = self.slot(&path);
                        slot.op = None;
                        let n = match slot.redial {
                            Some((i, n, _)) if i == instance => n + 1,
                            _ => 0,
                        };
                        let at = now + redial_delay(n);
                        slot.redial = Some((instance, n, at));
                        self.schedule(&path, at);
                    }
                    Ok(reg) => {
                        if let Some(seen) = seen_at {
                            self.shared.metrics.registered(seen.elapsed());
                        }
                        tracing::info!(
                            socket = %path.display(),
                            plugin_type = %reg.plugin_type,
                            name = %reg.name,
                            endpoint = %reg.endpoint,
                            versions = ?reg.versions,
                            result = "registered",
                            "plugin registered"
                        );
                        let _ = self.shared.events.send(ManagerEvent::Registered {
                            socket: path.clone(),
                            plugin_type: reg.plugin_type.clone(),
                            name: reg.name.clone(),
                            endpoint: reg.endpoint.clone(),
                        });
                        let slot = self.slot(&path);
                        slot.op = None;
                        slot.backoff = None;
                        slot.last_error = None;
                        slot.refusals = 0;
                        slot.registered_at = Some(SystemTime::now());
                        slot.last_info = Some((
                            reg.plugin_type.clone(),
                            reg.name.clone(),
                            reg.endpoint.clone(),
                            reg.versions.clone(),
                        ));
                        let entry = ActualEntry {
                            instance,
                            plugin_type: reg.plugin_type,
                            name: reg.name,
                            endpoint: reg.endpoint,
                            versions: reg.versions,
                        };
                        if let Err(e) = self.actual.add(&path, entry) {
                            tracing::error!(socket = %path.display(), error = %e, "cannot record plugin");
                        }
                    }
                    Err(err) => {
                        self.shared.metrics.failed(err.step);
                        let _ = self.shared.events.send(ManagerEvent::Failed {
                            socket: path.clone(),
                            step: err.step,
                            error: err.message.clone(),
                        });
                        let slot = self.slot(&path);
                        slot.op = None;
                        let backoff = Backoff::after_failure(
                            slot.backoff.as_ref(),
                            instance,
                            Instant::now(),
                            initial,
                            max,
                        );
                        let (t, n, e, v) = match &err.info {
                            Some(i) => (
                                i.r#type.clone(),
                                i.name.clone(),
                                i.endpoint.clone(),
                                i.supported_versions.clone(),
                            ),
                            None => Default::default(),
                        };
                        tracing::warn!(
                            socket = %path.display(),
                            plugin_type = %t,
                            name = %n,
                            endpoint = %e,
                            step = err.step.as_str(),
                            result = "failed",
                            retry_in = ?backoff.delay,
                            error = %err.message,
                            "plugin registration failed"
                        );
                        if err.info.is_some() {
                            slot.last_info = Some((t, n, e, v));
                        }
                        slot.last_error = Some((err.step, err.message));
                        let retry_at = backoff.retry_at;
                        slot.backoff = Some(backoff);
                        self.schedule(&path, retry_at);
                    }
                }
                self.dirty.insert(path);
            }
            Done::Deregistered { path, entry } => {
                self.shared.metrics.deregistered();
                tracing::info!(
                    socket = %path.display(),
                    plugin_type = %entry.plugin_type,
                    name = %entry.name,
                    endpoint = %entry.endpoint,
                    result = "deregistered",
                    "plugin deregistered"
                );
                let _ = self.shared.events.send(ManagerEvent::Deregistered {
                    socket: path.clone(),
                    plugin_type: entry.plugin_type,
                    name: entry.name,
                    endpoint: entry.endpoint,
                });
                let slot = self.slot(&path);
                slot.op = None;
                slot.registered_at = None;
                self.dirty.insert(path);
            }
        }
    }

    fn reconcile(&mut self) {
        let cap = self.config.max_concurrent_operations.max(1);
        while self.running < cap {
            let Some(path) = self.waiting.pop_front() else {
                break;
            };
            if let Some(s) = self.slots.get_mut(&path) {
                s.queued = false;
            }
            self.examine(&path);
            self.publish(&path);
        }
        let dirty: Vec<PathBuf> = self.dirty.drain().collect();
        for path in dirty {
            self.examine(&path);
            self.publish(&path);
        }
    }

    /// Starts whatever `path` needs now: deregistration first, then registration.
    fn examine(&mut self, path: &Path) {
        if self
            .slots
            .get(path)
            .is_some_and(|s| s.op.is_some() || s.queued)
        {
            return;
        }
        let want = self.desired.get(path).map(|d| d.instance);
        if let Some(current) = self.actual.get(path) {
            if want != Some(current.instance) {
                if want.is_some() {
                    tracing::trace!(path = %path.display(), "An updated version of plugin has been found, unregistering the plugin first before reregistering");
                }
                self.start_deregister(path);
            }
            return;
        }
        let Some(instance) = want else { return };
        let now = Instant::now();
        if let Some((i, _, at)) = self.slots.get(path).and_then(|s| s.redial)
            && i == instance
            && now < at
        {
            self.schedule(path, at);
            return;
        }
        if let Some(b) = self.slots.get(path).and_then(|s| s.backoff.as_ref())
            && b.blocks(instance, now)
        {
            let at = b.retry_at;
            self.schedule(path, at);
            return;
        }
        if self.running >= self.config.max_concurrent_operations.max(1) {
            self.slot(path).queued = true;
            self.waiting.push_back(path.to_owned());
            return;
        }
        self.start_register(path, instance);
    }

    fn start_register(&mut self, path: &Path, instance: u64) {
        self.running += 1;
        self.slot(path).op = Some(OpKind::Register);
        let handlers = self.handlers.clone();
        let done = self.done_tx.clone();
        let timeouts = Timeouts {
            dial: self.config.dial_timeout,
            get_info: self.config.get_info_timeout,
            notify: self.config.notify_timeout,
        };
        let path = path.to_owned();
        let span = tracing::info_span!("register", socket = %path.display());
        self.tasks.spawn(
            async move {
                let result = operation::register(&path, &handlers, timeouts).await;
                let _ = done.send(Done::Registered {
                    path,
                    instance,
                    result: Box::new(result),
                });
            }
            .instrument(span),
        );
    }

    fn start_deregister(&mut self, path: &Path) {
        let Some(entry) = self.actual.remove(path) else {
            return;
        };
        self.running += 1;
        self.slot(path).op = Some(OpKind::Deregister);
        let handlers = self.handlers.clone();
        let done = self.done_tx.clone();
        let path = path.to_owned();
        let span = tracing::info_span!("deregister", socket = %path.display());
        self.tasks.spawn(
            async move {
                operation::deregister(&handlers, &entry.plugin_type, &entry.name, &entry.endpoint)
                    .await;
                let _ = done.send(Done::Deregistered { path, entry });
            }
            .instrument(span),
        );
    }

    /// Brings the published record of `path` up to date (or drops it).
    fn publish(&mut self, path: &Path) {
        let desired = self.desired.contains(path);
        let actual = self.actual.get(path);
        let slot = self.slots.get(path);
        let keep =
            desired || actual.is_some() || slot.is_some_and(|s| s.op.is_some() || s.dead.is_some());
        let mut records = self
            .shared
            .records
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if !keep {
            records.remove(path);
            drop(records);
            self.slots.remove(path);
            return;
        }
        let now = Instant::now();
        let state = match (slot.and_then(|s| s.op), actual) {
            (Some(OpKind::Register), _) => PluginState::Registering,
            (Some(OpKind::Deregister), _) => PluginState::Deregistering,
            (None, Some(_)) => PluginState::Registered,
            (None, None) if slot.is_some_and(|s| s.dead.is_some()) => PluginState::Failed,
            (None, None) => match slot.and_then(|s| s.backoff.as_ref()) {
                Some(b) if b.retry_at > now => PluginState::BackingOff,
                _ => PluginState::Pending,
            },
        };
        let (plugin_type, name, endpoint, versions) =
            match (actual, slot.and_then(|s| s.last_info.as_ref())) {
                (Some(a), _) => (
                    a.plugin_type.clone(),
                    a.name.clone(),
                    a.endpoint.clone(),
                    a.versions.clone(),
                ),
                (None, Some(i)) => i.clone(),
                (None, None) => Default::default(),
            };
        let (failed_step, last_error) = match slot.and_then(|s| s.last_error.as_ref()) {
            Some((step, e)) if state != PluginState::Registered => (Some(*step), Some(e.clone())),
            _ => (None, None),
        };
        let record = PluginRecord {
            socket: path.to_owned(),
            plugin_type,
            name,
            endpoint,
            versions,
            state,
            desired,
            last_error,
            failed_step,
            failures: slot
                .and_then(|s| s.backoff.as_ref())
                .map_or(0, |b| b.failures),
            registered_at: if state == PluginState::Registered {
                slot.and_then(|s| s.registered_at)
            } else {
                None
            },
        };
        match records.get_mut(path) {
            Some(old) if *old == record => {}
            Some(old) => *old = record,
            None => {
                records.insert(path.to_owned(), record);
            }
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Probes registered sockets every `interval` (D5): a connect that is refused means nobody
/// listens on the socket any more.
pub(crate) async fn probe_loop(
    shared: Arc<Shared>,
    interval: std::time::Duration,
    probes: mpsc::Sender<Probe>,
    token: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tick.tick() => {}
        }
        let targets: Vec<PathBuf> = shared
            .records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|r| r.state == PluginState::Registered)
            .map(|r| r.socket.clone())
            .collect();
        for path in targets {
            let refused = matches!(
                tokio::net::UnixStream::connect(&path).await,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
            );
            if probes.send(Probe { path, refused }).await.is_err() {
                return;
            }
        }
    }
}
