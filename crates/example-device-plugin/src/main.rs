//! `plugreg-example-device-plugin`: serves `--devices N` widgets of `--resource`, registers
//! through `--registry-dir` or `--kubelet-socket`, flips the next widget's health on SIGUSR1 and
//! prints one JSON line per event. SIGTERM or SIGINT removes its sockets.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use plugreg_deviceplugin::{DevicePlugin, Event, PluginConfig};
use plugreg_example_device_plugin::{Widgets, now_ns};
use plugreg_runtime::signal::Signals;
use serde_json::json;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// An example kubelet device plugin.
#[derive(Debug, Parser)]
#[command(name = "plugreg-example-device-plugin", version)]
#[command(group(clap::ArgGroup::new("registration").required(true).args(["registry_dir", "kubelet_socket"])))]
struct Args {
    /// The extended resource served.
    #[arg(long, default_value = "example.com/widget")]
    resource: String,
    /// How many widgets.
    #[arg(long, default_value_t = 2)]
    devices: usize,
    /// Spread the widgets over this many NUMA nodes (0: no topology).
    #[arg(long, default_value_t = 1)]
    numa_nodes: u32,
    /// Ask the kubelet to call PreStartContainer.
    #[arg(long)]
    pre_start: bool,
    /// Register through this plugins_registry directory.
    #[arg(long)]
    registry_dir: Option<PathBuf>,
    /// Register through this kubelet.sock (the classic way).
    #[arg(long)]
    kubelet_socket: Option<PathBuf>,
    /// The plugin's own socket. Default: `<resource>.sock` beside kubelet.sock, or in
    /// `plugins/` beside the registry directory.
    #[arg(long)]
    socket: Option<PathBuf>,
}

fn line(v: serde_json::Value) {
    println!("{v}");
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
    let file = format!("{}.sock", args.resource.replace('/', "_"));
    let config = match (&args.kubelet_socket, &args.registry_dir) {
        (Some(k), _) => {
            let mut c = PluginConfig::kubelet_socket(&args.resource, k, &file);
            if let Some(s) = &args.socket {
                c.socket = s.clone();
            }
            c
        }
        (None, Some(dir)) => {
            let socket = match &args.socket {
                Some(s) => s.clone(),
                None => {
                    let plugins = dir.parent().unwrap_or(dir).join("plugins");
                    std::fs::create_dir_all(&plugins)
                        .with_context(|| format!("cannot create {plugins:?}"))?;
                    plugins.join(&file)
                }
            };
            PluginConfig::plugins_registry(&args.resource, dir, socket)
        }
        (None, None) => unreachable!("clap requires one of them"),
    };
    let widgets = Arc::new(Widgets::new(args.devices, args.numa_nodes, args.pre_start));
    let plugin = DevicePlugin::new(config, widgets.clone());

    let mut events = plugin.events();
    let resource = args.resource.clone();
    tokio::spawn(async move {
        while let Ok(e) = events.recv().await {
            let ts = now_ns().to_string();
            line(match e {
                Event::Serving { socket } => {
                    json!({"event": "serving", "resource": resource, "socket": socket, "ts_ns": ts})
                }
                Event::Registered { via } => {
                    json!({"event": "registered", "via": via, "ts_ns": ts})
                }
                Event::RegistrationFailed { error } => {
                    json!({"event": "registration_failed", "error": error, "ts_ns": ts})
                }
                Event::KubeletRestarted => json!({"event": "kubelet_restarted", "ts_ns": ts}),
            });
        }
    });
    let mut calls = widgets.events();
    tokio::spawn(async move {
        while let Ok(v) = calls.recv().await {
            line(v);
        }
    });

    let token = CancellationToken::new();
    let mut signals = Signals::new().context("cannot install the SIGTERM/SIGINT handlers")?;
    let mut usr1 = signal(SignalKind::user_defined1()).context("cannot install SIGUSR1")?;
    let stop = token.clone();
    let flipper = widgets.clone();
    tokio::spawn(async move {
        let mut next = 0usize;
        loop {
            tokio::select! {
                _ = signals.shutdown() => break,
                Some(()) = usr1.recv() => {
                    flipper.flip(next);
                    next = next.wrapping_add(1);
                }
            }
        }
        stop.cancel();
    });
    plugin.run(token).await.context("device plugin failed")?;
    Ok(())
}
