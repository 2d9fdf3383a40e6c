//! `plugreg-example-plugin`: registers an example plugin and prints one JSON line per
//! NotifyRegistrationStatus it receives. SIGTERM or SIGINT removes its socket.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use plugreg_example_plugin::{ExampleConfig, ExamplePlugin, notify_line, now_ns};
use plugreg_runtime::signal::Signals;
use tokio_util::sync::CancellationToken;

/// An example kubelet plugin.
#[derive(Debug, Parser)]
#[command(name = "plugreg-example-plugin", version)]
struct Args {
    /// Registration socket to create.
    #[arg(long)]
    socket: PathBuf,
    /// Plugin type to advertise.
    #[arg(long = "type", default_value = "ExamplePlugin")]
    plugin_type: String,
    /// Plugin name to advertise.
    #[arg(long, default_value = "example-plugin")]
    name: String,
    /// Endpoint to advertise (default: the socket itself).
    #[arg(long)]
    endpoint: Option<String>,
    /// Versions to advertise, comma-separated; v1beta1 and v1beta2 are also served.
    #[arg(long, value_delimiter = ',', default_value = "v1beta1,v1beta2")]
    versions: Vec<String>,
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
    let plugin = ExamplePlugin::new(ExampleConfig {
        socket: args.socket.clone(),
        plugin_type: args.plugin_type,
        name: args.name,
        endpoint: args.endpoint,
        versions: args.versions,
    });
    let token = CancellationToken::new();
    let mut notifications = plugin.registrar().notifications();
    let printer = tokio::spawn(async move {
        while let Ok(status) = notifications.recv().await {
            println!("{}", notify_line(&status));
        }
    });
    let mut signals = Signals::new().context("cannot install the SIGTERM/SIGINT handlers")?;
    let stop = token.clone();
    tokio::spawn(async move {
        signals.shutdown().await;
        stop.cancel();
    });
    let serving = plugin.serve(token.clone());
    tokio::pin!(serving);
    // Report readiness once the socket is in place.
    let listening = async {
        while plugreg_transport::path_kind(&args.socket).ok()
            != Some(plugreg_transport::PathKind::Socket)
        {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        println!(
            "{}",
            serde_json::json!({"event": "listening", "socket": args.socket, "ts_ns": now_ns()})
        );
    };
    tokio::select! {
        r = &mut serving => return r.context("example plugin failed"),
        _ = listening => {}
    }
    serving.await.context("example plugin failed")?;
    printer.abort();
    Ok(())
}
