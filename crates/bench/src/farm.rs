//! The hidden `farm` subcommand: one process serving many plugins at once, each with its own
//! registrar on its own socket, reporting on stdout (one JSON object a line) when all are
//! bound, when all heard Notify(true), and when they stopped after `stop` (or end of input) on
//! stdin.

use std::io::{BufRead, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use plugreg_registrar::Registrar;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::handler;
use crate::plugin::{self, Style};
use crate::procfs;
use crate::stats::Summary;

/// Open files the farm needs besides one listening socket per plugin.
const SPARE_FILES: u64 = 1024;

/// Serves `count` plugins in `dir` until told to stop.
pub fn run(
    dir: &Path,
    count: usize,
    workers: usize,
    timeout: Duration,
    style: Style,
) -> anyhow::Result<()> {
    procfs::raise_nofile(count as u64 + SPARE_FILES).context("raising the open-file limit")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("farm")
        .enable_all()
        .build()?;
    rt.block_on(serve_all(dir, count, timeout, style))
}

async fn serve_all(
    dir: &Path,
    count: usize,
    timeout: Duration,
    style: Style,
) -> anyhow::Result<()> {
    let stop = stop_on_stdin();
    let token = CancellationToken::new();
    let (notified_tx, mut notified_rx) = mpsc::unbounded_channel::<Instant>();
    let mut servers = tokio::task::JoinSet::new();

    let start = Instant::now();
    for n in 0..count {
        let registrar = Registrar::new(handler::plugin_info(n));
        let socket = dir.join(handler::socket_name(n));
        match style {
            Style::Registrar => {
                // Bind here rather than inside the task so that the binds are timed and a
                // failure stops the run at once.
                let bound = plugreg_transport::bind(&socket)
                    .with_context(|| format!("binding {}", socket.display()))?;
                let router = plugreg_transport::server().add_service(registrar.service());
                let shutdown = token.clone().cancelled_owned();
                servers.spawn(async move {
                    plugreg_transport::serve(router, bound, shutdown)
                        .await
                        .map_err(anyhow::Error::from)
                });
            }
            Style::BindThenListen { gap } if gap.is_zero() => {
                // As Go's net.Listen: bind() and listen() back to back.
                let listener = plugin::bind_then_listen(&socket, gap)?;
                let registrar = registrar.clone();
                let shutdown = token.clone().cancelled_owned();
                servers.spawn(async move {
                    let r = plugin::serve_listener(&registrar, listener, shutdown).await;
                    remove_quietly(&socket);
                    r
                });
            }
            Style::BindThenListen { gap } => {
                let bound = plugreg_testpeers::goplugin::bind_only(&socket)
                    .with_context(|| format!("binding {}", socket.display()))?;
                let registrar = registrar.clone();
                let shutdown = token.clone().cancelled_owned();
                servers.spawn(async move {
                    tokio::time::sleep(gap).await;
                    let listener = bound.listen().context("listening")?;
                    let r = plugin::serve_listener(&registrar, listener, shutdown).await;
                    remove_quietly(&socket);
                    r
                });
            }
        }
        let mut status = registrar.status();
        let tx = notified_tx.clone();
        tokio::spawn(async move {
            if status.wait_for(|s| s.is_registered()).await.is_ok() {
                let _ = tx.send(Instant::now());
            }
        });
    }
    drop(notified_tx);
    let bound = start.elapsed();
    emit(serde_json::json!({
        "event": "bound",
        "count": count,
        "bind_all_us": bound.as_micros() as u64,
    }));

    let mut since_start = Vec::with_capacity(count);
    let deadline = tokio::time::Instant::now() + timeout;
    while since_start.len() < count {
        match tokio::time::timeout_at(deadline, notified_rx.recv()).await {
            Ok(Some(at)) => since_start.push(at - start),
            Ok(None) | Err(_) => break,
        }
    }
    let memory = procfs::memory("self").unwrap_or_default();
    match Summary::of(&since_start) {
        Some(s) if since_start.len() == count => emit(serde_json::json!({
            "event": "registered",
            "count": count,
            "last_us": s.max.as_micros() as u64,
            "p50_us": s.p50.as_micros() as u64,
            "p99_us": s.p99.as_micros() as u64,
            "hwm_kib": memory.hwm_kib,
        })),
        _ => emit(serde_json::json!({
            "event": "timeout",
            "count": count,
            "registered": since_start.len(),
        })),
    }

    let _ = stop.await;
    let stopping = Instant::now();
    token.cancel();
    while let Some(r) = servers.join_next().await {
        r.context("server task")??;
    }
    emit(serde_json::json!({
        "event": "stopped",
        "stop_us": stopping.elapsed().as_micros() as u64,
    }));
    Ok(())
}

/// Removes a Go-style plugin's socket when it stops (a plugreg socket removes itself), so that
/// the manager sees every plugin go.
fn remove_quietly(path: &Path) {
    let _ = std::fs::remove_file(path);
}

/// Completes when stdin says `stop` or ends.
fn stop_on_stdin() -> oneshot::Receiver<()> {
    let (tx, rx) = oneshot::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            match line {
                Ok(l) if l.trim() == "stop" => break,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let _ = tx.send(());
    });
    rx
}

/// Writes one JSON line to stdout.
pub fn emit(value: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}");
    let _ = out.flush();
}
