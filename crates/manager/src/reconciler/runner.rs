//! Runs the operations: at most one per socket (the machine's `busy` phases see to that) and
//! at most `cap` in all, registrations and deregistrations alike (D7). A task that panics is
//! reaped and reported as a failed operation, so its socket and its slot are never lost.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::task::{Id, JoinSet};
use tracing::Instrument;

use crate::handler::HandlerRegistry;
use crate::operation::{self, Progress, RegisterError, Registered, Timeouts};
use crate::state::ActualEntry;

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

pub(crate) struct Runner {
    cap: usize,
    handlers: Arc<HandlerRegistry>,
    timeouts: Timeouts,
    tasks: JoinSet<Outcome>,
    running: HashMap<Id, Running>,
    /// Sockets with an operation running: upstream's per-socket mutual exclusion.
    busy: HashSet<PathBuf>,
}

impl Runner {
    pub(crate) fn new(cap: usize, handlers: HandlerRegistry, timeouts: Timeouts) -> Self {
        Runner {
            cap: cap.max(1),
            handlers: Arc::new(handlers),
            timeouts,
            tasks: JoinSet::new(),
            running: HashMap::new(),
            busy: HashSet::new(),
        }
    }

    /// Whether another operation may start now.
    pub(crate) fn has_free_slot(&self) -> bool {
        self.running.len() < self.cap
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
        let progress = Arc::new(Progress::default());
        let span = tracing::info_span!("register", socket = %path.display());
        let task = {
            let (path, progress) = (path.clone(), progress.clone());
            async move {
                let result = operation::register(&path, &handlers, &timeouts, &progress).await;
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
        self.spawn(running, task.instrument(span));
        true
    }

    fn can_start(&self, path: &Path) -> bool {
        self.has_free_slot() && !self.is_busy(path)
    }

    fn spawn(
        &mut self,
        running: Running,
        task: impl std::future::Future<Output = Outcome> + Send + 'static,
    ) {
        let path = match &running {
            Running::Register { path, .. } | Running::Deregister { path, .. } => path.clone(),
        };
        let id = self.tasks.spawn(task).id();
        self.running.insert(id, running);
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
        self.spawn(Running::Deregister { path, entry }, task.instrument(span));
        true
    }

    /// The next finished operation; pending forever while none runs.
    pub(crate) async fn next(&mut self) -> Outcome {
        loop {
            let Some(joined) = self.tasks.join_next_with_id().await else {
                return std::future::pending().await;
            };
            let (id, outcome) = match joined {
                Ok((id, outcome)) => (id, Ok(outcome)),
                Err(e) => (e.id(), Err(e)),
            };
            let Some(running) = self.running.remove(&id) else {
                continue;
            };
            match &running {
                Running::Register { path, .. } | Running::Deregister { path, .. } => {
                    self.busy.remove(path);
                }
            }
            match outcome {
                Ok(outcome) => return outcome,
                Err(e) => return reaped(running, &e),
            }
        }
    }

    /// Abandons every operation (shutdown); plugin sockets are untouched.
    pub(crate) async fn shutdown(&mut self) {
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
        self.running.clear();
        self.busy.clear();
    }
}

/// The outcome of a task that panicked (or was cancelled): a failure of the step it was in.
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
        let timeouts = Timeouts {
            dial: Duration::from_secs(1),
            get_info: Duration::from_secs(1),
            notify: Duration::from_secs(1),
            handler: HandlerTimeouts {
                default: Duration::from_secs(1),
                by_type: Default::default(),
            },
        };
        Runner::new(cap, HandlerRegistry::new(), timeouts)
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
        r.spawn(running, async { panic!("operation bug") });
        assert!(!r.has_free_slot());
        let Outcome::Registered {
            path,
            instance,
            result,
        } = r.next().await
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
            let Outcome::Registered { result, .. } = r.next().await else {
                panic!("not a registration");
            };
            assert_eq!(result.unwrap_err().step, Step::Dial);
        }
        assert!(!r.is_busy(&a) && !r.is_busy(&b));
        assert!(r.deregister(a.clone(), entry()));
        assert!(!r.deregister(a.clone(), entry()));
        assert!(matches!(r.next().await, Outcome::Deregistered { .. }));
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
        r.spawn(running, async { panic!("handler bug") });
        match r.next().await {
            Outcome::Deregistered { path, entry: e } => {
                assert_eq!((path.to_str(), e), (Some("/r/b.sock"), entry));
            }
            Outcome::Registered { .. } => panic!("wrong outcome"),
        }
    }
}
