//! The kubelet side of plugin registration.
//!
//! Data flows one way: file-system event ([`watcher`]) -> desired state ([`state`]) ->
//! reconciler -> per-socket operation ([`operation`]) -> [`handler`] -> notify. Start it with
//! [`PluginManager::start`]; read it with [`PluginManager::snapshot`],
//! [`PluginManager::subscribe`] and [`PluginManager::render_metrics`].

pub mod config;
pub mod handler;
pub mod info_check;
pub mod metrics;
pub mod operation;
mod reconciler;
pub mod record;
pub mod state;
pub mod watcher;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use config::{DEFAULT_REGISTRY_DIR, LivenessConfig, ManagerConfig};
pub use handler::{HandlerError, HandlerRegistry, PluginHandler, async_trait};
pub use operation::Step;
pub use record::{ManagerEvent, PluginRecord, PluginState};

use reconciler::{Reconciler, Shared};

/// The manager's long-running tasks, by name.
type Tasks = Vec<(&'static str, tokio::task::JoinHandle<()>)>;

/// The watcher task's name in [`PluginManager::health`].
const WATCHER: &str = "plugin watcher";
/// The reconciler task's name in [`PluginManager::health`].
const RECONCILER: &str = "reconciler";

/// Why the plugin manager could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The watcher could not start (the registry directory could not be created or watched).
    #[error("The desired_state_of_world populator (plugin watcher) starts failed!")]
    Watcher(#[from] watcher::WatchError),
}

/// A running plugin manager. Cheap to clone; every clone sees the same manager.
#[derive(Debug, Clone)]
pub struct PluginManager {
    shared: Arc<Shared>,
    /// The watcher and the reconciler, by name; taken by [`stopped`](Self::stopped).
    tasks: Arc<Mutex<Tasks>>,
    /// Why the watcher stopped, when it stopped with an error.
    watcher_error: Arc<Mutex<Option<String>>>,
    rescan: mpsc::Sender<()>,
    token: CancellationToken,
}

impl PluginManager {
    /// Creates the registry directory when missing, starts the watcher and the reconciler (which
    /// also runs the liveness probes, when configured), and returns at once. Everything stops
    /// when `token` is cancelled; [`stopped`](Self::stopped) waits for that.
    pub async fn start(
        config: ManagerConfig,
        handlers: HandlerRegistry,
        token: CancellationToken,
    ) -> Result<Self, Error> {
        tracing::info!(
            registry_dir = %config.registry_dir.display(),
            plugin_types = ?handlers.types(),
            "Starting Kubelet Plugin Manager"
        );
        let watcher = watcher::Watcher::new(config.registry_dir.clone())?;
        let shared = Arc::new(Shared {
            records: Mutex::new(HashMap::new()),
            events: broadcast::channel(4096).0,
            metrics: metrics::Metrics::default(),
        });
        let (watch_tx, watch_rx) = mpsc::channel(4096);
        let (rescan_tx, rescan_rx) = mpsc::channel(1);
        let watcher_error = Arc::new(Mutex::new(None));
        let mut tasks = Vec::new();

        let t = token.clone();
        let retry = config.resync_period;
        let error = watcher_error.clone();
        tasks.push((
            WATCHER,
            tokio::spawn(
                async move {
                    if let Err(e) = watcher.run(watch_tx, rescan_rx, retry, t).await {
                        let e = plugreg_runtime::report::chain(&e);
                        tracing::error!(error = %e, "plugin watcher stopped");
                        *error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    }
                }
                .instrument(tracing::info_span!("watcher")),
            ),
        ));
        let reconciler = Reconciler::new(config, handlers, shared.clone());
        tasks.push((
            RECONCILER,
            tokio::spawn(
                reconciler
                    .run(watch_rx, token.clone())
                    .instrument(tracing::info_span!("reconciler")),
            ),
        ));
        Ok(Self {
            shared,
            tasks: Arc::new(Mutex::new(tasks)),
            watcher_error,
            rescan: rescan_tx,
            token,
        })
    }

    /// Every known socket, sorted by path.
    pub fn snapshot(&self) -> Vec<PluginRecord> {
        let mut all: Vec<PluginRecord> = self
            .shared
            .records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        all.sort_unstable_by(|a, b| a.socket.cmp(&b.socket));
        all
    }

    /// Events from now on (a slow receiver may miss some: see `broadcast`).
    pub fn subscribe(&self) -> broadcast::Receiver<ManagerEvent> {
        self.shared.events.subscribe()
    }

    /// Prometheus text exposition of the manager's metrics.
    pub fn render_metrics(&self) -> String {
        self.shared.metrics.render(&self.snapshot())
    }

    /// Asks the watcher to rescan the whole registry tree, as it does itself when the inotify
    /// queue overflows. Sockets that did not change keep their registration.
    pub fn rescan(&self) {
        // A full queue means a rescan is already due.
        let _ = self.rescan.try_send(());
    }

    /// Stops the manager (as cancelling its token does).
    pub fn stop(&self) {
        self.token.cancel();
    }

    /// Whether the manager works: `Err` with the reason when it was stopped or when its
    /// watcher or reconciler ended (an error, a panic) while it should be running.
    pub fn health(&self) -> Result<(), String> {
        if self.token.is_cancelled() {
            return Err("the plugin manager is stopping".into());
        }
        let tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        if tasks.is_empty() {
            return Err("the plugin manager has stopped".into());
        }
        for (name, task) in tasks.iter() {
            if task.is_finished() {
                let why = match (
                    *name,
                    &*self.watcher_error.lock().unwrap_or_else(|e| e.into_inner()),
                ) {
                    (WATCHER, Some(e)) => format!("the {name} stopped: {e}"),
                    _ => format!("the {name} stopped"),
                };
                return Err(why);
            }
        }
        Ok(())
    }

    /// Aborts one of the manager's tasks ("plugin watcher" or "reconciler"), as a crash would
    /// end it: for tests of [`health`](Self::health) and of whoever reports it.
    #[doc(hidden)]
    pub fn abort_task_for_tests(&self, name: &str) {
        for (n, task) in self.tasks.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            if *n == name {
                task.abort();
            }
        }
    }

    /// Waits until every task of the manager has finished (after the token was cancelled).
    pub async fn stopped(&self) {
        let tasks: Vec<_> =
            std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        for (_, t) in tasks {
            let _ = t.await;
        }
        tracing::info!("Shutting down Kubelet Plugin Manager");
    }
}
