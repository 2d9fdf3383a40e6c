//! Runs the operations: at most one per socket (the machine's `busy` phases see to that) and
//! at most `cap` in all, registrations and deregistrations alike (D7). A task that panics is
//! reaped and reported as a failed operation, so its socket and its slot are never lost.
//!
//! A slow plugin must not hold up the others. A registration may legitimately take minutes (a
//! CSI driver's NodeGetInfo is allowed 2 min), and a driver with many sockets whose NodeGetInfo
//! hangs would otherwise fill every slot. So an operation that has run for
//! [`Lanes::slow_after`] leaves the shared slots for the slow lane, where at most
//! [`Lanes::max_slow`] run. When the slow lane is full and another operation turns slow, the
//! plugin (type and name) holding the most slow registrations gives one up: its oldest is
//! cancelled (rolled back and retried with back-off), so one plugin's many sockets only crowd
//! out that plugin. Deregistrations are never cancelled (the handler must hear of them); one
//! that finds the slow lane full of them keeps its slot.
//!
//! A registration whose plugin (named by GetInfo, a few milliseconds in) already has another
//! operation running does not wait the 250 ms: it leaves the shared slots at once. Such a
//! registration mostly waits for its sibling (the CSI handler calls one driver's NodeGetInfo at
//! a time), and a driver with a thousand sockets would otherwise hold every shared slot for
//! 250 ms each, turn after turn, while other plugins queue behind it for seconds.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::task::{Id, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::time::DelayQueue;
use tokio_util::time::delay_queue::Key;
use tracing::Instrument;

use crate::handler::HandlerRegistry;
use crate::operation::{self, Progress, RegisterError, Registered, Timeouts};
use crate::state::ActualEntry;

/// What the runner tells the reconciler.
pub(crate) enum Event {
    /// An operation ended.
    Done(Outcome),
    /// An operation turned slow and left the shared slots: another may start.
    SlotFreed,
}

/// The shared slots and the slow lane.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lanes {
    /// Operations in the shared slots at once.
    pub(crate) cap: usize,
    /// After this long an operation leaves the shared slots.
    pub(crate) slow_after: Duration,
    /// Operations in the slow lane at once.
    pub(crate) max_slow: usize,
}

/// A finished operation.
pub(crate) enum Outcome {
    /// A registration attempt ended.
    Registered {
        path: PathBuf,
        instance: u64,
        result: Box<Result<Registered, RegisterError>>,
    },
    /// A deregistration ended (the handler was told, or its call failed: the plugin is out of
    /// the actual state either way).
    Deregistered { path: PathBuf, entry: ActualEntry },
}

/// What is needed to report a task that did not return.
#[derive(Debug)]
enum Running {
    Register {
        path: PathBuf,
        instance: u64,
        progress: Arc<Progress>,
    },
    Deregister {
        path: PathBuf,
        entry: ActualEntry,
    },
}

/// One operation in flight.
#[derive(Debug)]
struct Op {
    running: Running,
    started: Instant,
    /// In the shared slots: its timer for turning slow.
    slow_timer: Option<Key>,
    /// In the slow lane (and not cancelled).
    slow: bool,
    cancel: CancellationToken,
}

impl Op {
    /// The plugin a slow registration counts against (type and name; unknown before GetInfo
    /// answered); `None` for a deregistration, which is never cancelled.
    fn cancellable_as(&self) -> Option<Option<&(String, String)>> {
        match &self.running {
            Running::Register { progress, .. } => Some(progress.plugin()),
            Running::Deregister { .. } => None,
        }
    }
}

pub(crate) struct Runner {
    lanes: Lanes,
    handlers: Arc<HandlerRegistry>,
    timeouts: Timeouts,
    tasks: JoinSet<Outcome>,
    running: HashMap<Id, Op>,
    /// Operations in the shared slots.
    shared: usize,
    /// Operations in the slow lane (cancelled ones no longer count).
    slow: usize,
    /// When each operation in the shared slots turns slow.
    slow_timers: DelayQueue<Id>,
    /// Sockets with an operation running: upstream's per-socket mutual exclusion.
    busy: HashSet<PathBuf>,
    /// Registrations tell their task id here once GetInfo named their plugin.
    identified_tx: tokio::sync::mpsc::UnboundedSender<Id>,
    identified_rx: tokio::sync::mpsc::UnboundedReceiver<Id>,
}

impl Runner {
    pub(crate) fn new(lanes: Lanes, handlers: HandlerRegistry, timeouts: Timeouts) -> Self {
        let (identified_tx, identified_rx) = tokio::sync::mpsc::unbounded_channel();
        Runner {
            lanes: Lanes {
                cap: lanes.cap.max(1),
                ..lanes
            },
            handlers: Arc::new(handlers),
            timeouts,
            tasks: JoinSet::new(),
            running: HashMap::new(),
            shared: 0,
            slow: 0,
            slow_timers: DelayQueue::new(),
            busy: HashSet::new(),
            identified_tx,
            identified_rx,
        }
    }

    /// Whether another operation may start now.
    pub(crate) fn has_free_slot(&self) -> bool {
        self.shared < self.lanes.cap
    }

    /// Whether an operation of `path` runs.
    pub(crate) fn is_busy(&self, path: &Path) -> bool {
        self.busy.contains(path)
    }

    /// Starts a registration attempt of `instance` at `path`; refused (false) while `path` has
    /// an operation running or no slot is free.
    pub(crate) fn register(&mut self, path: PathBuf, instance: u64) -> bool {
        if !self.can_start(&path) {
            return false;
        }
        let handlers = self.handlers.clone();
        let timeouts = self.timeouts.clone();
        let progress = Arc::new(Progress::telling(self.identified_tx.clone()));
        let cancel = CancellationToken::new();
        let span = tracing::info_span!("register", socket = %path.display());
        let task = {
            let (path, progress, cancel) = (path.clone(), progress.clone(), cancel.clone());
            async move {
                let result =
                    operation::register(&path, &handlers, &timeouts, &progress, &cancel).await;
                Outcome::Registered {
                    path,
                    instance,
                    result: Box::new(result),
                }
            }
        };
        let running = Running::Register {
            path,
            instance,
            progress,
        };
        self.spawn(running, cancel, task.instrument(span));
        true
    }

    fn can_start(&self, path: &Path) -> bool {
        self.has_free_slot() && !self.is_busy(path)
    }

    fn spawn(
        &mut self,
        running: Running,
        cancel: CancellationToken,
        task: impl std::future::Future<Output = Outcome> + Send + 'static,
    ) {
        let path = match &running {
            Running::Register { path, .. } | Running::Deregister { path, .. } => path.clone(),
        };
        let id = self.tasks.spawn(task).id();
        let slow_timer = Some(self.slow_timers.insert(id, self.lanes.slow_after));
        self.running.insert(
            id,
            Op {
                running,
                started: Instant::now(),
                slow_timer,
                slow: false,
                cancel,
            },
        );
        self.shared += 1;
        self.busy.insert(path);
    }

    /// Starts the deregistration of `entry` (already taken out of the actual state); refused
    /// (false) while `path` has an operation running or no slot is free.
    pub(crate) fn deregister(&mut self, path: PathBuf, entry: ActualEntry) -> bool {
        if !self.can_start(&path) {
            return false;
        }
        let handlers = self.handlers.clone();
        let limit = self.timeouts.handler.for_type(&entry.plugin_type);
        let span = tracing::info_span!("deregister", socket = %path.display());
        let task = {
            let (path, entry) = (path.clone(), entry.clone());
            async move {
                operation::deregister(
                    &handlers,
                    &entry.plugin_type,
                    &entry.name,
                    &entry.endpoint,
                    limit,
                )
                .await;
                Outcome::Deregistered { path, entry }
            }
        };
        // Never cancelled (see the module's comment): its token is never fired.
        let never = CancellationToken::new();
        self.spawn(
            Running::Deregister { path, entry },
            never,
            task.instrument(span),
        );
        true
    }

    /// The next finished operation, or a slot freed by an operation turning slow; pending
    /// forever while none runs.
    pub(crate) async fn next(&mut self) -> Event {
        loop {
            tokio::select! {
                Some(joined) = self.tasks.join_next_with_id() => {
                    if let Some(outcome) = self.finished(joined) {
                        return Event::Done(outcome);
                    }
                }
                Some(expired) = self.slow_timers.next() => {
                    if self.turn_slow(expired.into_inner()) {
                        return Event::SlotFreed;
                    }
                }
                Some(id) = self.identified_rx.recv() => {
                    if self.identified(id) {
                        return Event::SlotFreed;
                    }
                }
                else => return std::future::pending().await,
            }
        }
    }

    fn finished(
        &mut self,
        joined: Result<(Id, Outcome), tokio::task::JoinError>,
    ) -> Option<Outcome> {
        let (id, outcome) = match joined {
            Ok((id, outcome)) => (id, Ok(outcome)),
            Err(e) => (e.id(), Err(e)),
        };
        let op = self.running.remove(&id)?;
        match op.slow_timer {
            Some(key) => {
                self.slow_timers.remove(&key);
                self.shared -= 1;
            }
            None if op.slow => self.slow -= 1,
            None => {}
        }
        match &op.running {
            Running::Register { path, .. } | Running::Deregister { path, .. } => {
                self.busy.remove(path);
            }
        }
        Some(match outcome {
            Ok(outcome) => outcome,
            Err(e) => reaped(op.running, &e),
        })
    }

    /// Registration `id` learnt its plugin: it leaves the shared slots at once when another
    /// operation of the same plugin runs. True when a shared slot was freed.
    fn identified(&mut self, id: Id) -> bool {
        let Some(op) = self.running.get(&id) else {
            return false;
        };
        let (Some(key), Some(Some(plugin))) = (op.slow_timer, op.cancellable_as()) else {
            return false;
        };
        let sibling = self.running.iter().any(|(other, o)| {
            *other != id && o.cancellable_as().flatten().is_some_and(|p| p == plugin)
        });
        if !sibling {
            return false;
        }
        self.slow_timers.remove(&key);
        if let Some(op) = self.running.get(&id) {
            let (Running::Register { path, .. } | Running::Deregister { path, .. }) = &op.running;
            tracing::debug!(socket = %path.display(), "another operation of this plugin runs; this one leaves the shared slots");
        }
        if self.turn_slow(id) {
            return true;
        }
        // The slow lane is full of operations that cannot give way: keep the slot, and turn
        // slow later as any operation does.
        let key = self.slow_timers.insert(id, self.lanes.slow_after);
        if let Some(op) = self.running.get_mut(&id) {
            op.slow_timer = Some(key);
        }
        false
    }

    /// Moves operation `id` from the shared slots to the slow lane, cancelling another slow
    /// registration when the lane is full. False when it must stay (the lane is full of
    /// operations that cannot be cancelled).
    fn turn_slow(&mut self, id: Id) -> bool {
        let Some(op) = self.running.get_mut(&id) else {
            return false;
        };
        op.slow_timer = None;
        if self.slow >= self.lanes.max_slow {
            let Some(victim) = self.victim(id) else {
                return false;
            };
            let v = self.running.get_mut(&victim).expect("a running operation");
            v.slow = false;
            v.cancel.cancel();
            self.slow -= 1;
            if let Running::Register { path, progress, .. } = &v.running {
                let plugin = progress.plugin().map(|(t, n)| format!("{t}/{n}"));
                tracing::warn!(
                    socket = %path.display(),
                    plugin = plugin.as_deref().unwrap_or("(unknown)"),
                    running_for = ?v.started.elapsed(),
                    max_slow = self.lanes.max_slow,
                    "cancelling the slow registration of the plugin with the most slow operations"
                );
            }
        }
        let op = self.running.get_mut(&id).expect("a running operation");
        op.slow = true;
        self.shared -= 1;
        self.slow += 1;
        let (Running::Register { path, .. } | Running::Deregister { path, .. }) = &op.running;
        tracing::debug!(socket = %path.display(), after = ?self.lanes.slow_after, "operation is slow; it leaves the shared slots");
        true
    }

    /// The registration to cancel for `newcomer` (about to enter the full slow lane): the oldest
    /// of the plugin that holds the most slow registrations, counting the newcomer.
    fn victim(&self, newcomer: Id) -> Option<Id> {
        type Plugin<'a> = Option<&'a (String, String)>;
        let mut groups: HashMap<Plugin<'_>, (usize, Option<(Instant, Id)>)> = HashMap::new();
        for (id, op) in &self.running {
            if !(op.slow || *id == newcomer) {
                continue;
            }
            let Some(plugin) = op.cancellable_as() else {
                continue;
            };
            let group = groups.entry(plugin).or_default();
            group.0 += 1;
            if op.slow && group.1.is_none_or(|(t, _)| op.started < t) {
                group.1 = Some((op.started, *id));
            }
        }
        groups
            .into_values()
            .filter_map(|(count, oldest)| Some((count, oldest?)))
            .max_by(|a, b| a.0.cmp(&b.0).then(b.1.0.cmp(&a.1.0)))
            .map(|(_, (_, id))| id)
    }

    /// Abandons every operation (shutdown); plugin sockets are untouched.
    pub(crate) async fn shutdown(&mut self) {
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
        self.running.clear();
        self.busy.clear();
        self.slow_timers.clear();
        self.shared = 0;
        self.slow = 0;
    }
}

/// The outcome of a task that panicked (or was aborted): a failure of the step it was in.
fn reaped(running: Running, e: &tokio::task::JoinError) -> Outcome {
    let why = if e.is_panic() {
        "operation panicked"
    } else {
        "operation cancelled"
    };
    match running {
        Running::Register {
            path,
            instance,
            progress,
        } => {
            let step = progress.step();
            tracing::error!(socket = %path.display(), step = step.as_str(), "{why}");
            Outcome::Registered {
                result: Box::new(Err(RegisterError {
                    step,
                    message: format!("RegisterPlugin error -- {why} at socket {}", path.display()),
                    info: None,
                    young_refusal: false,
                })),
                path,
                instance,
            }
        }
        Running::Deregister { path, entry } => {
            tracing::error!(socket = %path.display(), "deregistration: {why}");
            Outcome::Deregistered { path, entry }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operation::{HandlerTimeouts, Step};
    use std::time::Duration;

    fn runner(cap: usize) -> Runner {
        lanes_runner(Lanes {
            cap,
            slow_after: Duration::from_secs(3600),
            max_slow: 16,
        })
    }

    fn lanes_runner(lanes: Lanes) -> Runner {
        let timeouts = Timeouts {
            dial: Duration::from_secs(1),
            get_info: Duration::from_secs(1),
            notify: Duration::from_secs(1),
            handler: HandlerTimeouts {
                default: Duration::from_secs(1),
                by_type: Default::default(),
            },
        };
        Runner::new(lanes, HandlerRegistry::new(), timeouts)
    }

    #[tokio::test]
    async fn a_panicking_operation_is_reaped_as_a_failure_of_its_step_and_frees_its_slot() {
        let mut r = runner(1);
        let progress = Arc::new(Progress::default());
        progress.set(Step::Validate);
        let running = Running::Register {
            path: "/r/a.sock".into(),
            instance: 4,
            progress,
        };
        r.spawn(running, CancellationToken::new(), async {
            panic!("operation bug")
        });
        assert!(!r.has_free_slot());
        let Event::Done(Outcome::Registered {
            path,
            instance,
            result,
        }) = r.next().await
        else {
            panic!("not a registration outcome");
        };
        assert_eq!((path.to_str(), instance), (Some("/r/a.sock"), 4));
        let err = result.unwrap_err();
        assert_eq!(err.step, Step::Validate);
        assert!(
            err.message.contains("operation panicked"),
            "{}",
            err.message
        );
        assert!(r.has_free_slot(), "the slot is back");
    }

    fn entry() -> ActualEntry {
        ActualEntry {
            instance: 1,
            plugin_type: "DevicePlugin".into(),
            name: "n".into(),
            endpoint: "/e".into(),
            versions: vec![],
        }
    }

    #[tokio::test]
    async fn operations_on_two_sockets_run_at_once_and_one_socket_runs_one() {
        // upstream operation executor tests 20-23: two keys run concurrently; a second register
        // or deregister of the same key is refused while the first runs.
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
        let mut r = runner(4);
        assert!(r.register(a.clone(), 1));
        assert!(r.register(b.clone(), 2), "another socket runs concurrently");
        assert!(
            !r.register(a.clone(), 3),
            "same socket: refused while pending"
        );
        assert!(
            !r.deregister(a.clone(), entry()),
            "register and deregister share the key"
        );
        assert!(r.is_busy(&a) && r.is_busy(&b));
        // Nothing listens there: both attempts fail at the dial and free their keys.
        for _ in 0..2 {
            let Event::Done(Outcome::Registered { result, .. }) = r.next().await else {
                panic!("not a registration");
            };
            assert_eq!(result.unwrap_err().step, Step::Dial);
        }
        assert!(!r.is_busy(&a) && !r.is_busy(&b));
        assert!(r.deregister(a.clone(), entry()));
        assert!(!r.deregister(a.clone(), entry()));
        assert!(matches!(
            r.next().await,
            Event::Done(Outcome::Deregistered { .. })
        ));
        assert!(r.register(a, 4), "free again");
    }

    #[tokio::test]
    async fn the_cap_counts_both_kinds() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = runner(2);
        assert!(r.register(dir.path().join("a.sock"), 1));
        assert!(r.deregister(dir.path().join("b.sock"), entry()));
        assert!(!r.has_free_slot());
        assert!(!r.register(dir.path().join("c.sock"), 2));
        assert!(!r.deregister(dir.path().join("d.sock"), entry()));
    }

    #[tokio::test]
    async fn a_panicking_deregistration_still_reports_the_plugin_gone() {
        let mut r = runner(2);
        let entry = ActualEntry {
            instance: 1,
            plugin_type: "DevicePlugin".into(),
            name: "n".into(),
            endpoint: "/e".into(),
            versions: vec![],
        };
        let running = Running::Deregister {
            path: "/r/b.sock".into(),
            entry: entry.clone(),
        };
        r.spawn(running, CancellationToken::new(), async {
            panic!("handler bug")
        });
        match r.next().await {
            Event::Done(Outcome::Deregistered { path, entry: e }) => {
                assert_eq!((path.to_str(), e), (Some("/r/b.sock"), entry));
            }
            _ => panic!("wrong outcome"),
        }
    }

    /// A registration of `plugin` (type, name) at `path` that runs until it is cancelled.
    fn hanging(r: &mut Runner, path: &str, plugin: Option<(&str, &str)>) -> CancellationToken {
        let progress = Arc::new(Progress::default());
        if let Some((t, n)) = plugin {
            progress.set_plugin(t, n);
        }
        let cancel = CancellationToken::new();
        let running = Running::Register {
            path: path.into(),
            instance: 1,
            progress,
        };
        let (p, c) = (PathBuf::from(path), cancel.clone());
        r.spawn(running, cancel.clone(), async move {
            c.cancelled().await;
            Outcome::Registered {
                path: p.clone(),
                instance: 1,
                result: Box::new(Err(RegisterError {
                    step: Step::Register,
                    message: format!("cancelled at {}", p.display()),
                    info: None,
                    young_refusal: false,
                })),
            }
        });
        cancel
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_operation_leaves_the_shared_slots() {
        let mut r = lanes_runner(Lanes {
            cap: 1,
            slow_after: Duration::from_millis(250),
            max_slow: 4,
        });
        let t0 = Instant::now();
        let _a = hanging(&mut r, "/r/a.sock", Some(("CSIPlugin", "hang.csi")));
        assert!(!r.has_free_slot());
        assert!(matches!(r.next().await, Event::SlotFreed));
        assert_eq!(t0.elapsed(), Duration::from_millis(250));
        assert!(r.has_free_slot(), "the slot is free for the next plugin");
        assert!(r.is_busy(Path::new("/r/a.sock")), "the slow one still runs");
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_slow_lane_cancels_the_oldest_of_the_plugin_with_the_most() {
        let mut r = lanes_runner(Lanes {
            cap: 8,
            slow_after: Duration::from_millis(100),
            max_slow: 3,
        });
        // Two of plugin A (the oldest first), then one of B: the lane is full.
        let a1 = hanging(&mut r, "/r/a1.sock", Some(("CSIPlugin", "a.csi")));
        tokio::time::advance(Duration::from_millis(10)).await;
        let b1 = hanging(&mut r, "/r/b1.sock", Some(("CSIPlugin", "b.csi")));
        tokio::time::advance(Duration::from_millis(10)).await;
        let a2 = hanging(&mut r, "/r/a2.sock", Some(("CSIPlugin", "a.csi")));
        for _ in 0..3 {
            assert!(matches!(r.next().await, Event::SlotFreed));
        }
        // B's second turns slow: A holds the most, so A's oldest (not B's older one) goes.
        let b2 = hanging(&mut r, "/r/b2.sock", Some(("CSIPlugin", "b.csi")));
        assert!(matches!(r.next().await, Event::SlotFreed));
        assert!(a1.is_cancelled(), "A's oldest was cancelled");
        assert!(!b1.is_cancelled() && !a2.is_cancelled() && !b2.is_cancelled());
        let Event::Done(Outcome::Registered { path, .. }) = r.next().await else {
            panic!("the cancelled registration ends");
        };
        assert_eq!(path, PathBuf::from("/r/a1.sock"));
    }

    #[tokio::test(start_paused = true)]
    async fn deregistrations_are_never_cancelled_and_keep_their_slot_when_the_lane_is_full() {
        let mut r = lanes_runner(Lanes {
            cap: 2,
            slow_after: Duration::from_millis(100),
            max_slow: 1,
        });
        let hang = |entry: ActualEntry| async move {
            std::future::pending::<()>().await;
            Outcome::Deregistered {
                path: "/r/x.sock".into(),
                entry,
            }
        };
        let first = Running::Deregister {
            path: "/r/d1.sock".into(),
            entry: entry(),
        };
        r.spawn(first, CancellationToken::new(), hang(entry()));
        assert!(matches!(r.next().await, Event::SlotFreed));
        let second = Running::Deregister {
            path: "/r/d2.sock".into(),
            entry: entry(),
        };
        r.spawn(second, CancellationToken::new(), hang(entry()));
        // The lane is full of a deregistration: the second stays in the shared slots.
        let next = tokio::time::timeout(Duration::from_secs(3600), r.next()).await;
        assert!(next.is_err(), "nothing more happens");
        assert!(r.has_free_slot(), "one of the two slots is taken");
        let third = Running::Deregister {
            path: "/r/d3.sock".into(),
            entry: entry(),
        };
        r.spawn(third, CancellationToken::new(), hang(entry()));
        assert!(!r.has_free_slot());
    }
}
