//! The reconciler: one task that owns the desired state, the actual state and every socket's
//! state machine, and brings the actual state to the desired one.
//!
//! Its parts: [`machine`] decides (pure: desired, actual, machine state, now -> next move),
//! [`runner`] runs the operations (one per socket, a cap in all, panics reaped), [`scheduler`]
//! holds the timers (retries and liveness probes). This module feeds them events and publishes
//! each socket's machine state as its [`PluginRecord`].
//!
//! It is event-driven (D1): a watcher event, a finished operation, a timer or a probe result
//! wakes it at once, and it looks only at the sockets they concern. A periodic resync looks at
//! every divergent socket as a safety net.

mod machine;
mod runner;
mod scheduler;

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::ManagerConfig;
use crate::handler::HandlerRegistry;
use crate::metrics::Metrics;
use crate::operation::{HandlerTimeouts, Timeouts};
use crate::record::{ManagerEvent, PluginRecord};
use crate::state::{ActualEntry, ActualState, DesiredState, FileId};
use crate::watcher::WatchEvent;

use machine::{Decision, Info, Phase, Socket};
use runner::{Event, Lanes, Outcome, Runner};
use scheduler::{Scheduler, Timer};

/// State shared with the [`PluginManager`](crate::PluginManager) handle.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) records: Mutex<HashMap<PathBuf, PluginRecord>>,
    pub(crate) events: broadcast::Sender<ManagerEvent>,
    pub(crate) metrics: Metrics,
}

/// A liveness probe's answer (D5).
struct Probe {
    path: PathBuf,
    instance: u64,
    refused: bool,
}

pub(crate) struct Reconciler {
    config: ManagerConfig,
    policy: plugreg_runtime::Backoff,
    shared: Arc<Shared>,
    desired: DesiredState,
    actual: ActualState,
    sockets: HashMap<PathBuf, Socket>,
    dirty: HashSet<PathBuf>,
    /// Sockets waiting for a free slot. Turns alternate between its ends (see [`Self::reconcile`]).
    queue: VecDeque<PathBuf>,
    /// Whether the next turn goes to the newest waiting socket.
    newest_next: bool,
    runner: Runner,
    scheduler: Scheduler,
    probes: JoinSet<Probe>,
}

impl Reconciler {
    pub(crate) fn new(
        config: ManagerConfig,
        handlers: HandlerRegistry,
        shared: Arc<Shared>,
    ) -> Self {
        let timeouts = Timeouts {
            dial: config.dial_timeout,
            get_info: config.get_info_timeout,
            notify: config.notify_timeout,
            handler: HandlerTimeouts {
                default: config.handler_timeout,
                by_type: Arc::new(config.handler_timeouts.clone()),
            },
        };
        Self {
            policy: config.backoff(),
            runner: Runner::new(
                Lanes {
                    cap: config.max_concurrent_operations,
                    slow_after: config.slow_operation_after,
                    max_slow: config.max_slow_operations,
                },
                handlers,
                timeouts,
            ),
            config,
            shared,
            desired: DesiredState::new(),
            actual: ActualState::new(),
            sockets: HashMap::new(),
            dirty: HashSet::new(),
            queue: VecDeque::new(),
            newest_next: true,
            scheduler: Scheduler::default(),
            probes: JoinSet::new(),
        }
    }

    pub(crate) async fn run(
        mut self,
        mut watch_rx: mpsc::Receiver<WatchEvent>,
        token: CancellationToken,
    ) {
        let mut resync = tokio::time::interval(self.config.resync_period);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut watcher_open = true;
        loop {
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
                event = self.runner.next() => match event {
                    Event::Done(outcome) => self.on_outcome(outcome),
                    // A slot came free: the queue moves on below.
                    Event::SlotFreed => {}
                },
                (path, timer) = self.scheduler.next() => self.on_timer(path, timer),
                Some(Ok(probe)) = self.probes.join_next(), if !self.probes.is_empty() => {
                    self.on_probe(probe);
                }
                _ = resync.tick() => self.mark_divergent(),
            }
            self.reconcile();
        }
        // Bounded shutdown: operations in flight are abandoned, plugin sockets are untouched.
        self.runner.shutdown().await;
        self.probes.shutdown().await;
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

    fn on_watch(&mut self, ev: WatchEvent) {
        let now = Instant::now();
        match ev {
            WatchEvent::Added { path, file } => self.add(path, file, now),
            WatchEvent::Removed { path } => {
                tracing::debug!(path = %path.display(), "Removing socket path from desired state cache");
                self.desired.remove(&path);
                if let Some(s) = self.sockets.get_mut(&path) {
                    s.dead = None;
                }
                self.dirty.insert(path);
            }
            WatchEvent::RemovedUnder { dir } => {
                for path in self.desired.remove_under(&dir) {
                    tracing::debug!(path = %path.display(), "Removing socket path from desired state cache");
                    self.dirty.insert(path);
                }
                for (path, s) in self.sockets.iter_mut() {
                    if path.starts_with(&dir) && s.dead.take().is_some() {
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
                for (path, s) in self.sockets.iter_mut() {
                    if s.dead.is_some() && !present.contains(path) {
                        s.dead = None;
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
        if let Some(s) = self.sockets.get_mut(&path) {
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

    fn on_timer(&mut self, path: PathBuf, timer: Timer) {
        match timer {
            Timer::Retry => {
                self.dirty.insert(path);
            }
            Timer::Probe => {
                let registered = self
                    .sockets
                    .get(&path)
                    .is_some_and(|s| matches!(s.phase, Phase::Registered { .. }));
                let Some(instance) = self.actual.get(&path).map(|a| a.instance) else {
                    return;
                };
                if !registered {
                    return;
                }
                self.probes.spawn(async move {
                    let refused = matches!(
                        tokio::net::UnixStream::connect(&path).await,
                        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
                    );
                    Probe {
                        path,
                        instance,
                        refused,
                    }
                });
            }
        }
    }

    /// A liveness probe answered (D5): a plugin refusing `failure_threshold` probes in a row is
    /// dead; its socket leaves the desired state and stays `failed` until its file changes.
    fn on_probe(&mut self, probe: Probe) {
        let Some(liveness) = self.config.liveness else {
            return;
        };
        if !self.actual.has_instance(&probe.path, probe.instance) {
            return;
        }
        let file = self.desired.get(&probe.path).and_then(|d| d.file);
        let Some(s) = self.sockets.get_mut(&probe.path) else {
            return;
        };
        if !matches!(s.phase, Phase::Registered { .. }) {
            return;
        }
        s.refusals = if probe.refused { s.refusals + 1 } else { 0 };
        if s.refusals < liveness.failure_threshold {
            let next = Instant::now() + liveness.interval;
            self.scheduler.at(&probe.path, Timer::Probe, next);
            return;
        }
        s.refusals = 0;
        s.dead = file;
        tracing::warn!(
            socket = %probe.path.display(),
            refusals = liveness.failure_threshold,
            "plugin socket refuses connections; its plugin is gone, deregistering"
        );
        self.shared.metrics.dead();
        self.desired.remove(&probe.path);
        self.dirty.insert(probe.path);
    }

    fn on_outcome(&mut self, outcome: Outcome) {
        let now = Instant::now();
        match outcome {
            Outcome::Registered {
                path,
                instance,
                result,
            } => {
                let seen_at = self
                    .desired
                    .get(&path)
                    .filter(|d| d.instance == instance)
                    .map(|d| d.seen_at);
                let s = self.sockets.entry(path.clone()).or_default();
                match *result {
                    Err(err) if err.young_refusal => {
                        // D1: bound but not listening yet; not a failure, no warning.
                        tracing::debug!(socket = %path.display(), error = %err.message, "socket refused while young; re-dialling");
                        s.phase = Phase::Pending;
                        s.redial = Some(machine::next_redial(s.redial, instance, now));
                    }
                    Ok(reg) => {
                        // Counted even when the socket is already gone: it was registered (and
                        // will be deregistered, which is counted too).
                        self.shared
                            .metrics
                            .registered(seen_at.map(|seen| seen.elapsed()));
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
                        s.phase = Phase::Registered {
                            since: SystemTime::now(),
                        };
                        s.attempts = None;
                        s.redial = None;
                        s.last_error = None;
                        s.refusals = 0;
                        s.info = Some(Info {
                            plugin_type: reg.plugin_type.clone(),
                            name: reg.name.clone(),
                            endpoint: reg.endpoint.clone(),
                            versions: reg.versions.clone(),
                        });
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
                        if let Some(l) = self.config.liveness {
                            self.scheduler.at(&path, Timer::Probe, now + l.interval);
                        }
                    }
                    Err(err) => {
                        self.shared.metrics.failed(err.step);
                        let _ = self.shared.events.send(ManagerEvent::Failed {
                            socket: path.clone(),
                            step: err.step,
                            error: err.message.clone(),
                        });
                        let attempts =
                            machine::after_failure(s.attempts, instance, now, &self.policy);
                        if let Some(i) = &err.info {
                            s.info = Some(Info {
                                plugin_type: i.r#type.clone(),
                                name: i.name.clone(),
                                endpoint: i.endpoint.clone(),
                                versions: i.supported_versions.clone(),
                            });
                        }
                        let info = s.info.clone().unwrap_or_default();
                        tracing::warn!(
                            socket = %path.display(),
                            plugin_type = %info.plugin_type,
                            name = %info.name,
                            endpoint = %info.endpoint,
                            step = err.step.as_str(),
                            result = "failed",
                            retry_in = ?(attempts.retry_at - now),
                            error = %err.message,
                            "plugin registration failed"
                        );
                        s.phase = Phase::BackingOff;
                        s.attempts = Some(attempts);
                        s.last_error = Some((err.step, err.message));
                    }
                }
                self.dirty.insert(path);
            }
            Outcome::Deregistered { path, entry } => {
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
                self.sockets.entry(path.clone()).or_default().phase = Phase::Pending;
                self.dirty.insert(path);
            }
        }
    }

    /// Moves every socket that may have something to do: the queue first (while slots are
    /// free), then the sockets touched by the latest events.
    ///
    /// The queue is served from both ends in turn: the oldest waiting socket, then the newest.
    /// A burst of sockets (a driver with a thousand of them) fills the queue at once, and in
    /// order a plugin created just after it would wait for every one of them to get through
    /// GetInfo (on two cores, about 180 ms for a thousand). Served from both ends, a socket
    /// that arrives after the burst gets one of the next two turns, while the burst still
    /// drains at half the rate or more and its oldest socket is never passed over for long.
    fn reconcile(&mut self) {
        while self.runner.has_free_slot() {
            let next = if self.newest_next {
                self.queue.pop_back()
            } else {
                self.queue.pop_front()
            };
            let Some(path) = next else {
                break;
            };
            self.newest_next = !self.newest_next;
            if let Some(s) = self.sockets.get_mut(&path) {
                s.queued = false;
            }
            self.step(&path);
        }
        let dirty: Vec<PathBuf> = self.dirty.drain().collect();
        for path in dirty {
            if self.sockets.get(&path).is_some_and(|s| s.queued) {
                // Waits its turn in the queue.
                self.publish(&path);
                continue;
            }
            self.step(&path);
        }
    }

    /// Decides the next move of `path` and makes it.
    fn step(&mut self, path: &Path) {
        let now = Instant::now();
        let free = self.runner.has_free_slot();
        let s = self.sockets.entry(path.to_owned()).or_default();
        let decision = machine::decide(self.desired.get(path), self.actual.get(path), s, now, free);
        match decision {
            Decision::Stay => {}
            Decision::Register(instance) => {
                // The decision saw a free slot and an idle socket, so the runner takes it.
                if self.runner.register(path.to_owned(), instance) {
                    s.phase = Phase::Registering;
                }
            }
            Decision::Deregister => {
                if self.desired.contains(path) {
                    tracing::trace!(path = %path.display(), "An updated version of plugin has been found, unregistering the plugin first before reregistering");
                }
                if let Some(entry) = self.actual.get(path).cloned()
                    && self.runner.deregister(path.to_owned(), entry)
                {
                    self.actual.remove(path);
                    s.phase = Phase::Deregistering;
                    self.scheduler.cancel(path);
                }
            }
            Decision::BackOffUntil(at) => {
                s.phase = Phase::BackingOff;
                self.scheduler.at(path, Timer::Retry, at);
            }
            Decision::RedialAt(at) => {
                s.phase = Phase::Pending;
                self.scheduler.at(path, Timer::Retry, at);
            }
            Decision::Queue => {
                if !matches!(s.phase, Phase::Registered { .. }) {
                    s.phase = Phase::Pending;
                }
                if !s.queued {
                    s.queued = true;
                    self.queue.push_back(path.to_owned());
                }
            }
            Decision::Failed => s.phase = Phase::Failed,
            Decision::Forget => {
                self.sockets.remove(path);
                self.scheduler.cancel(path);
                self.shared
                    .records
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(path);
                return;
            }
        }
        self.publish(path);
    }

    /// Publishes the machine state of `path` as its record.
    fn publish(&self, path: &Path) {
        let Some(s) = self.sockets.get(path) else {
            return;
        };
        let state = s.phase.state();
        let info = match (self.actual.get(path), &s.info) {
            (Some(a), _) => Info {
                plugin_type: a.plugin_type.clone(),
                name: a.name.clone(),
                endpoint: a.endpoint.clone(),
                versions: a.versions.clone(),
            },
            (None, Some(i)) => i.clone(),
            (None, None) => Info::default(),
        };
        let registered_at = match s.phase {
            Phase::Registered { since } => Some(since),
            _ => None,
        };
        let (failed_step, last_error) = match &s.last_error {
            Some((step, e)) if registered_at.is_none() => (Some(*step), Some(e.clone())),
            _ => (None, None),
        };
        let record = PluginRecord {
            socket: path.to_owned(),
            plugin_type: info.plugin_type,
            name: info.name,
            endpoint: info.endpoint,
            versions: info.versions,
            state,
            desired: self.desired.contains(path),
            last_error,
            failed_step,
            failures: s.attempts.map_or(0, |a| a.failures),
            registered_at,
        };
        let mut records = self
            .shared
            .records
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match records.get_mut(path) {
            Some(old) if *old == record => {}
            Some(old) => *old = record,
            None => {
                records.insert(path.to_owned(), record);
            }
        }
    }
}
