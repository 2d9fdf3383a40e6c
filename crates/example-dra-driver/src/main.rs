//! `plugreg-example-dra-driver`: an example DRA driver. Serves DRAPlugin v1 and v1beta1 and the
//! health service, registers with the kubelet (or `plugreg manager`), and prints one JSON line per
//! event on stdout: `listening`, `notify`, `NodePrepareResources`, `NodeUnprepareResources`.
//! SIGTERM or SIGINT removes its sockets.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use plugreg_example_dra_driver::{ExampleDriver, now_ns};
use plugreg_runtime::signal::Signals;
use tokio_util::sync::CancellationToken;

/// An example DRA driver.
#[derive(Debug, Parser)]
#[command(name = "plugreg-example-dra-driver", version)]
struct Args {
    /// Driver name (a DNS subdomain).
    #[arg(long)]
    driver_name: String,
    /// The kubelet's registry directory.
    #[arg(long, default_value = plugreg_dra::DEFAULT_REGISTRY_DIR)]
    registry_dir: PathBuf,
    /// The driver's own directory (default /var/lib/kubelet/plugins/<driver>); created if missing.
    #[arg(long)]
    plugin_dir: Option<PathBuf>,
    /// Pod UID: rolling-update socket names, so an old and a new instance can run together.
    #[arg(long)]
    rolling_update: Option<String>,
    /// Number of devices.
    #[arg(long, default_value_t = 4)]
    devices: usize,
    /// Pool name (default: the node name, else "pool").
    #[arg(long)]
    pool: Option<String>,
    /// Node name (pool name default).
    #[arg(long)]
    node_name: Option<String>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    let mut config = plugreg_dra::Config::new(&args.driver_name);
    config.registry_dir = args.registry_dir;
    if let Some(d) = args.plugin_dir {
        config.plugin_dir = d;
    }
    config.rolling_update = args.rolling_update;
    std::fs::create_dir_all(&config.plugin_dir)
        .with_context(|| format!("cannot create {:?}", config.plugin_dir))?;
    let pool = args
        .pool
        .or(args.node_name)
        .unwrap_or_else(|| "pool".into());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let driver = Arc::new(ExampleDriver::new(
        &args.driver_name,
        pool,
        args.devices,
        Some(tx.clone()),
    ));
    let mut signals = Signals::new().context("cannot install the SIGTERM/SIGINT handlers")?;
    let token = CancellationToken::new();
    let plugin = plugreg_dra::start(driver, config, token.clone())
        .await
        .context("cannot start the DRA driver")?;
    let mut notes = plugin.registrar().notifications();
    tokio::spawn(async move {
        while let Ok(s) = notes.recv().await {
            let line = serde_json::json!({
                "event": "notify", "registered": s.plugin_registered, "error": s.error,
                "ts_ns": now_ns()
            });
            let _ = tx.send(line.to_string());
        }
    });
    // Report readiness once the registration socket is in place (the DRA socket is up first).
    while plugreg_transport_path_missing(plugin.registrar_socket()) {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    println!(
        "{}",
        serde_json::json!({
            "event": "listening",
            "registration_socket": plugin.registrar_socket(),
            "endpoint": plugin.plugin_socket(),
            "supported_versions": plugin.registrar().info().supported_versions,
            "ts_ns": now_ns(),
        })
    );
    loop {
        tokio::select! {
            line = rx.recv() => match line {
                Some(l) => println!("{l}"),
                None => break,
            },
            _ = signals.shutdown() => break,
        }
    }
    token.cancel();
    plugin.stopped().await;
    Ok(())
}

fn plugreg_transport_path_missing(p: &std::path::Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    !std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket())
}
