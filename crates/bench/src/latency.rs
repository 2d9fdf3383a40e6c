//! Registration and deregistration latency, one plugin at a time, with the plugin manager in
//! this process (its handler timestamps the deregistration).
//!
//! The manager runs on a multi-thread runtime with two workers, as the daemon does; the plugins
//! run on a current-thread runtime on the calling thread, as a separate small process would.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use plugreg_manager::{HandlerRegistry, ManagerConfig, PluginManager};
use plugreg_registrar::{Registrar, ServeOptions};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::handler::{self, AcceptAll, Call, CallKind};
use crate::plugin::{self, Style};
use crate::stats::Summary;

/// Longest wait for any one step before the run is abandoned.
const STEP_LIMIT: Duration = Duration::from_secs(10);

/// What the latency run measured.
#[derive(Debug, Clone)]
pub struct LatencyResult {
    /// The file system of the registry directory.
    pub fs: String,
    /// How the plugins created their sockets.
    pub style: Style,
    /// Measured registrations slower than the D1 goal (5 ms).
    pub over_goal: usize,
    /// Non-zero `plugreg_registration_failures_total` by step at the end of the run (warm-up
    /// included): every failed attempt is one back-off.
    pub failed_attempts: Vec<(String, u64)>,
    /// Unmeasured registrations run first.
    pub warmup: usize,
    /// Socket created -> the plugin received Notify(true).
    pub registration: Summary,
    /// Socket created -> the handler's register called (watcher, dial, GetInfo, validate).
    pub to_handler: Summary,
    /// Handler's register called -> the plugin received Notify(true).
    pub handler_to_notify: Summary,
    /// Socket removed -> the handler's deregister called.
    pub deregistration: Summary,
}

/// Registers and deregisters `count` plugins of `style` one after another (after `warmup`
/// unmeasured ones) in `dir`.
pub fn run(dir: &Path, count: usize, warmup: usize, style: Style) -> anyhow::Result<LatencyResult> {
    let manager_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("manager")
        .enable_all()
        .build()?;
    let (handler, calls) = AcceptAll::reporting();
    let handlers = HandlerRegistry::new().with(handler::PLUGIN_TYPE, Arc::new(handler));
    let token = CancellationToken::new();
    let manager = manager_rt
        .block_on(PluginManager::start(
            ManagerConfig::new(dir),
            handlers,
            token.clone(),
        ))
        .context("starting the plugin manager")?;

    let plugin_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let result = plugin_rt.block_on(measure(dir, count, warmup, style, calls));
    let metrics = manager.render_metrics();
    manager.stop();
    manager_rt.block_on(manager.stopped());
    let mut result = result?;
    result.failed_attempts = crate::burst::failures_by_step(&metrics);
    Ok(result)
}

async fn measure(
    dir: &Path,
    count: usize,
    warmup: usize,
    style: Style,
    mut calls: mpsc::UnboundedReceiver<Call>,
) -> anyhow::Result<LatencyResult> {
    let mut registration = Vec::with_capacity(count);
    let mut to_handler = Vec::with_capacity(count);
    let mut handler_to_notify = Vec::with_capacity(count);
    let mut deregistration = Vec::with_capacity(count);
    for n in 0..warmup + count {
        let one = once(dir, n, style, &mut calls)
            .await
            .with_context(|| format!("plugin {n}"))?;
        if n >= warmup {
            registration.push(one.notified - one.created);
            to_handler.push(one.registered - one.created);
            handler_to_notify.push(one.notified.saturating_duration_since(one.registered));
            deregistration.push(one.deregistered - one.removed);
        }
    }
    let summary = |v: &[Duration]| Summary::of(v).context("no samples");
    Ok(LatencyResult {
        fs: crate::procfs::fs_type(dir),
        style,
        over_goal: registration
            .iter()
            .filter(|d| **d >= crate::report::GOAL_LATENCY_P99)
            .count(),
        failed_attempts: Vec::new(),
        warmup,
        registration: summary(&registration)?,
        to_handler: summary(&to_handler)?,
        handler_to_notify: summary(&handler_to_notify)?,
        deregistration: summary(&deregistration)?,
    })
}

/// Timestamps of one plugin's life.
struct Once {
    created: Instant,
    registered: Instant,
    notified: Instant,
    removed: Instant,
    deregistered: Instant,
}

async fn once(
    dir: &Path,
    n: usize,
    style: Style,
    calls: &mut mpsc::UnboundedReceiver<Call>,
) -> anyhow::Result<Once> {
    let info = handler::plugin_info(n);
    let name = info.name.clone();
    let socket = dir.join(handler::socket_name(n));
    let registrar = Registrar::new(info);
    let mut status = registrar.status();
    let token = CancellationToken::new();
    let created;
    let serve: std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + '_>> =
        match style {
            Style::Registrar => {
                // No re-creation watchdog: the benchmark removes the socket itself and must not
                // see it come back.
                let options = ServeOptions {
                    recreate_check: None,
                };
                let serve = registrar.serve(&socket, options, token.clone());
                // `serve` binds on its first poll, which the biased select below makes the
                // very next thing.
                created = Instant::now();
                Box::pin(async move { serve.await.map_err(anyhow::Error::from) })
            }
            Style::BindThenListen { gap } => {
                // The socket exists from `bind()`, so that is when the clock starts.
                created = Instant::now();
                let listener = plugin::bind_then_listen(&socket, gap)?;
                Box::pin(plugin::serve_listener(
                    &registrar,
                    listener,
                    token.clone().cancelled_owned(),
                ))
            }
        };
    let mut serve = serve;

    tokio::select! {
        biased;
        r = &mut serve => bail!("plugin stopped before registration: {r:?}"),
        r = tokio::time::timeout(STEP_LIMIT, status.wait_for(|s| s.is_registered())) => {
            r.context("no Notify(true)")?.context("registrar gone")?;
        }
    }
    let notified = Instant::now();
    let registered = next_call(calls, CallKind::Register, &name).await?;

    let removed = Instant::now();
    std::fs::remove_file(&socket).context("removing the socket")?;
    let deregistered = tokio::select! {
        biased;
        r = &mut serve => bail!("plugin stopped before deregistration: {r:?}"),
        d = next_call(calls, CallKind::Deregister, &name) => d?,
    };
    token.cancel();
    serve.await.context("plugin")?;
    Ok(Once {
        created,
        registered,
        notified,
        removed,
        deregistered,
    })
}

/// Waits for the handler's `kind` call for `name`; any other call is a fault of the run.
async fn next_call(
    calls: &mut mpsc::UnboundedReceiver<Call>,
    kind: CallKind,
    name: &str,
) -> anyhow::Result<Instant> {
    let call = tokio::time::timeout(STEP_LIMIT, calls.recv())
        .await
        .with_context(|| format!("no {kind:?} call for {name}"))?
        .context("handler gone")?;
    if call.kind != kind || call.name != name {
        bail!("expected {kind:?} of {name}, got {call:?}");
    }
    Ok(call.at)
}
