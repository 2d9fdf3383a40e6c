//! `plugreg-example-dra-driver`: an example DRA driver. Serves DRAPlugin v1 and v1beta1 and the
//! health service, registers with the kubelet (or `plugreg manager`), and prints one JSON line per
//! event on stdout: `listening`, `notify`, `NodePrepareResources`, `NodeUnprepareResources`,
//! and with `--kubeconfig` `ResourceSlicesPublished` (or `ResourceSlicesFailed`).
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
    /// Node name (pool name default); with --kubeconfig, publish a ResourceSlice for this node.
    #[arg(long)]
    node_name: Option<String>,
    /// Kubeconfig: publish the devices as a ResourceSlice (needs --node-name).
    #[arg(long, requires = "node_name")]
    kubeconfig: Option<PathBuf>,
}

/// Publishes the driver's devices as one pool of one slice.
async fn publish(
    kubeconfig: &std::path::Path,
    driver: &str,
    node: &str,
    pool: &str,
    devices: Vec<String>,
) -> anyhow::Result<plugreg_dra::slices::Stats> {
    use plugreg_dra::slices::{Pool, Slice, SliceDevice};
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("cannot read {}", kubeconfig.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .context("bad kubeconfig")?;
    let client = kube::Client::try_from(config).context("cannot build a Kubernetes client")?;
    let pool = Pool {
        name: pool.into(),
        generation: 0,
        slices: vec![Slice {
            devices: devices
                .into_iter()
                .map(|name| SliceDevice {
                    name,
                    attributes: Default::default(),
                })
                .collect(),
        }],
    };
    Ok(plugreg_dra::slices::publish(&client, driver, node, &[pool]).await?)
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
        .or(args.node_name.clone())
        .unwrap_or_else(|| "pool".into());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let driver = Arc::new(ExampleDriver::new(
        &args.driver_name,
        pool.clone(),
        args.devices,
        Some(tx.clone()),
    ));
    let devices = driver.device_names();
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
    if let (Some(kc), Some(node)) = (&args.kubeconfig, &args.node_name) {
        let line = match publish(kc, &args.driver_name, node, &pool, devices).await {
            Ok(st) => serde_json::json!({
                "event": "ResourceSlicesPublished", "created": st.created, "deleted": st.deleted,
                "ts_ns": now_ns()
            }),
            Err(e) => serde_json::json!({
                "event": "ResourceSlicesFailed", "error": format!("{e:#}"), "ts_ns": now_ns()
            }),
        };
        println!("{line}");
    }
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
