//! The hidden `manager` subcommand: the plugin manager library in a process of its own, with an
//! accept-all `BenchPlugin` handler and no HTTP server, so that its memory can be read from
//! `/proc` like the daemon's. It says `ready` once started, answers `metrics` on stdin with the
//! Prometheus text followed by a line `# end`, and stops on `stop` or end of input.

use std::io::{BufRead, Write};
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use plugreg_manager::{HandlerRegistry, ManagerConfig, PluginManager};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::handler::{self, AcceptAll};

/// Marks the end of a `metrics` answer.
pub const END_OF_METRICS: &str = "# end";

/// Runs the manager on `dir` until told to stop.
pub fn run(dir: &Path, max_concurrent_operations: Option<usize>) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("manager")
        .enable_all()
        .build()?;
    let mut config = ManagerConfig::new(dir);
    // As the daemon runs in the benchmark (`--liveness-interval 0`).
    config.liveness = None;
    if let Some(n) = max_concurrent_operations {
        config.max_concurrent_operations = n;
    }
    let handlers =
        HandlerRegistry::new().with(handler::PLUGIN_TYPE, Arc::new(AcceptAll::default()));
    rt.block_on(async {
        let token = CancellationToken::new();
        let manager = PluginManager::start(config, handlers, token)
            .await
            .context("starting the plugin manager")?;
        say("ready");
        let mut commands = stdin_lines();
        while let Some(line) = commands.recv().await {
            match line.trim() {
                "metrics" => say(&format!("{}{END_OF_METRICS}", manager.render_metrics())),
                "stop" => break,
                _ => {}
            }
        }
        manager.stop();
        manager.stopped().await;
        Ok(())
    })
}

fn say(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
}

/// Lines of stdin, read on a thread of their own; the channel closes at end of input.
fn stdin_lines() -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel(16);
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    rx
}
