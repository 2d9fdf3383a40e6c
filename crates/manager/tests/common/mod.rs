//! Test harness: a real plugin manager on a temp dir, real plugins (the registrar library) on
//! real sockets, and a handler that records every call.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use plugreg_manager::{
    HandlerError, HandlerRegistry, ManagerConfig, PluginHandler, PluginManager, PluginRecord,
    async_trait,
};
use plugreg_registrar::{PluginInfo, Registrar, ServeOptions, Status};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// Generous limit for anything that should happen "soon".
pub const SOON: Duration = Duration::from_secs(10);

/// One call the manager made on a handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Validate(String, String),
    Register(String, String),
    Deregister(String, String),
}

/// A handler that records calls and can be told to refuse.
#[derive(Default)]
pub struct Recorder {
    pub calls: Mutex<Vec<Call>>,
    tx: Mutex<Option<mpsc::UnboundedSender<Call>>>,
    /// Names whose validate fails.
    pub reject: Mutex<Vec<String>>,
    /// Register fails this many more times.
    pub fail_register: AtomicUsize,
    /// Validate waits this long.
    pub validate_delay: Mutex<Duration>,
    running: AtomicUsize,
    /// Most validate calls seen running at once.
    pub max_running: AtomicUsize,
    /// Register panics this many more times.
    pub panic_register: AtomicUsize,
    /// Deregister waits this long.
    pub deregister_delay: Mutex<Duration>,
    deregistering: AtomicUsize,
    /// Most deregister calls seen running at once.
    pub max_deregistering: AtomicUsize,
}

impl Recorder {
    pub fn new() -> (Arc<Self>, mpsc::UnboundedReceiver<Call>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let r = Self::default();
        *r.tx.lock().unwrap() = Some(tx);
        (Arc::new(r), rx)
    }

    fn record(&self, c: Call) {
        self.calls.lock().unwrap().push(c.clone());
        if let Some(tx) = &*self.tx.lock().unwrap() {
            let _ = tx.send(c);
        }
    }
}

#[async_trait]
impl PluginHandler for Recorder {
    async fn validate(
        &self,
        name: &str,
        endpoint: &str,
        _v: &[String],
    ) -> Result<(), HandlerError> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_running.fetch_max(now, Ordering::SeqCst);
        let delay = *self.validate_delay.lock().unwrap();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        self.running.fetch_sub(1, Ordering::SeqCst);
        self.record(Call::Validate(name.into(), endpoint.into()));
        if self.reject.lock().unwrap().iter().any(|n| n == name) {
            return Err(format!("{name} is not welcome").into());
        }
        Ok(())
    }

    async fn register(
        &self,
        name: &str,
        endpoint: &str,
        _v: &[String],
    ) -> Result<(), HandlerError> {
        self.record(Call::Register(name.into(), endpoint.into()));
        if self
            .panic_register
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            panic!("handler bug");
        }
        let left = self.fail_register.load(Ordering::SeqCst);
        if left > 0 {
            self.fail_register.store(left - 1, Ordering::SeqCst);
            return Err("backend not ready".into());
        }
        Ok(())
    }

    async fn deregister(&self, name: &str, endpoint: &str) {
        let now = self.deregistering.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_deregistering.fetch_max(now, Ordering::SeqCst);
        let delay = *self.deregister_delay.lock().unwrap();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        self.deregistering.fetch_sub(1, Ordering::SeqCst);
        self.record(Call::Deregister(name.into(), endpoint.into()));
    }
}

/// Fast settings for tests.
pub fn config(dir: &Path) -> ManagerConfig {
    let mut c = ManagerConfig::new(dir);
    c.get_info_timeout = Duration::from_millis(500);
    c.notify_timeout = Duration::from_secs(2);
    c.dial_timeout = Duration::from_secs(2);
    c.backoff_initial = Duration::from_millis(50);
    c.backoff_max = Duration::from_millis(400);
    c.liveness = None;
    c
}

/// A running manager with a recorder for `DevicePlugin` and `CSIPlugin`.
pub struct Harness {
    pub dir: tempfile::TempDir,
    pub root: PathBuf,
    pub manager: PluginManager,
    pub recorder: Arc<Recorder>,
    pub calls: mpsc::UnboundedReceiver<Call>,
    token: CancellationToken,
}

impl Harness {
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    pub async fn start_with(tweak: impl FnOnce(&mut ManagerConfig)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("plugins_registry");
        Self::start_in(dir, root, tweak).await
    }

    pub async fn start_in(
        dir: tempfile::TempDir,
        root: PathBuf,
        tweak: impl FnOnce(&mut ManagerConfig),
    ) -> Self {
        let (recorder, calls) = Recorder::new();
        let handlers = HandlerRegistry::new()
            .with("DevicePlugin", recorder.clone())
            .with("CSIPlugin", recorder.clone());
        let mut cfg = config(&root);
        tweak(&mut cfg);
        let token = CancellationToken::new();
        let manager = PluginManager::start(cfg, handlers, token.clone())
            .await
            .unwrap();
        Self {
            dir,
            root,
            manager,
            recorder,
            calls,
            token,
        }
    }

    /// The next handler call, within [`SOON`].
    pub async fn next_call(&mut self) -> Call {
        tokio::time::timeout(SOON, self.calls.recv())
            .await
            .expect("no handler call in time")
            .expect("recorder gone")
    }

    /// Asserts no handler call arrives within `d`.
    pub async fn no_call_within(&mut self, d: Duration) {
        if let Ok(Some(c)) = tokio::time::timeout(d, self.calls.recv()).await {
            panic!("unexpected handler call {c:?}");
        }
    }

    /// Waits until exactly `n` sockets are registered.
    pub async fn wait_registered_count(&self, n: usize) {
        let registered = || {
            let snap = self.manager.snapshot();
            snap.iter()
                .filter(|r| r.state == plugreg_manager::PluginState::Registered)
                .count()
        };
        wait_for(|| registered() == n).await;
    }

    /// Waits until the record of `socket` satisfies `pred`.
    pub async fn wait_record(
        &self,
        socket: &Path,
        pred: impl Fn(Option<&PluginRecord>) -> bool,
    ) -> Option<PluginRecord> {
        let deadline = tokio::time::Instant::now() + SOON;
        loop {
            let snap = self.manager.snapshot();
            let r = snap.iter().find(|r| r.socket == socket);
            if pred(r) {
                return r.cloned();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "record of {socket:?} never matched; last: {r:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

/// A plugin served by the registrar library.
pub struct Plugin {
    pub registrar: Registrar,
    pub socket: PathBuf,
    token: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

pub fn info(plugin_type: &str, name: &str, endpoint: &str, versions: &[&str]) -> PluginInfo {
    PluginInfo {
        r#type: plugin_type.into(),
        name: name.into(),
        endpoint: endpoint.into(),
        supported_versions: versions.iter().map(|v| v.to_string()).collect(),
    }
}

impl Plugin {
    /// Serves `info` on `socket` and returns once the socket exists.
    pub async fn start(socket: &Path, info: PluginInfo) -> Self {
        if let Some(parent) = socket.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        let registrar = Registrar::new(info);
        let token = CancellationToken::new();
        let task = tokio::spawn({
            let (r, s, t) = (registrar.clone(), socket.to_owned(), token.clone());
            async move {
                let opts = ServeOptions {
                    recreate_check: None,
                };
                r.serve(&s, opts, t).await.unwrap();
            }
        });
        wait_for(|| socket.exists()).await;
        Self {
            registrar,
            socket: socket.to_owned(),
            token,
            task: Some(task),
        }
    }

    pub fn device(socket: &Path, name: &str) -> impl std::future::Future<Output = Self> {
        Self::start(socket, info("DevicePlugin", name, "", &["v1beta1"]))
    }

    pub fn status(&self) -> watch::Receiver<Status> {
        self.registrar.status()
    }

    /// Waits until the plugin has been told it is registered.
    pub async fn wait_registered(&self) -> Status {
        self.wait_status(|s| s.is_registered()).await
    }

    /// Waits until the plugin's status satisfies `pred`.
    pub async fn wait_status(&self, pred: impl Fn(&Status) -> bool) -> Status {
        let mut rx = self.status();
        let status = tokio::time::timeout(SOON, rx.wait_for(|s| pred(s)))
            .await
            .expect("plugin status never matched")
            .unwrap();
        status.clone()
    }

    /// Stops serving and removes the socket.
    pub async fn stop(mut self) {
        self.token.cancel();
        if let Some(t) = self.task.take() {
            t.await.unwrap();
        }
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

/// Polls `cond` every few ms until it holds, failing after [`SOON`].
pub async fn wait_for(cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + SOON;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition never held"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
