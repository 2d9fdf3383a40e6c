//! `csi-test-driver`: the fake CSI driver of `plugreg-csi-test-driver` as a process.
//!
//! Prints one JSON line per event on stdout: `{"event":"listening","socket":...}` once the
//! socket accepts connections, `{"event":"call","method":...}` per call. SIGTERM or SIGINT
//! removes the socket and exits 0.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use plugreg_csi_test_driver::{Code, DriverConfig, Failure, Fault, parse_topology};
use plugreg_runtime::signal::Signals;
use tokio_util::sync::CancellationToken;

/// A fake CSI driver (Identity + Node) on a Unix socket, for tests and demos.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Socket path to serve on.
    #[arg(long, conflicts_with = "endpoint")]
    socket: Option<PathBuf>,
    /// Socket address to serve on: `unix://PATH` or an absolute path.
    #[arg(long)]
    endpoint: Option<String>,
    /// Driver name returned by GetPluginInfo (may be empty).
    #[arg(long, default_value = "csi.plugreg.test")]
    name: String,
    /// vendor_version returned by GetPluginInfo.
    #[arg(long, default_value = "0.1.0")]
    vendor_version: String,
    /// List VOLUME_ACCESSIBILITY_CONSTRAINTS in GetPluginCapabilities.
    #[arg(long)]
    accessibility_constraints: bool,
    /// node_id returned by NodeGetInfo (may be empty).
    #[arg(long, default_value = "node-1")]
    node_id: String,
    /// Topology segments returned by NodeGetInfo: `k=v,k2=v2`.
    #[arg(long, default_value = "")]
    topology: String,
    /// max_volumes_per_node returned by NodeGetInfo.
    #[arg(long, default_value_t = 0)]
    max_volumes: i64,
    /// Delay GetPluginInfo answers by this long (e.g. `2s`).
    #[arg(long, value_parser = humantime::parse_duration)]
    get_plugin_info_delay: Option<Duration>,
    /// Delay only the first N GetPluginInfo calls.
    #[arg(long)]
    get_plugin_info_delay_first: Option<u64>,
    /// Fail the first N GetPluginInfo calls.
    #[arg(long)]
    get_plugin_info_fail_first: Option<u64>,
    /// Fail GetPluginInfo with this message (every call, or the first N with --get-plugin-info-fail-first).
    #[arg(long)]
    get_plugin_info_error: Option<String>,
    /// gRPC status code of the GetPluginInfo failure.
    #[arg(long, default_value_t = Code::Unavailable as i32)]
    get_plugin_info_error_code: i32,
    /// Delay NodeGetInfo answers by this long.
    #[arg(long, value_parser = humantime::parse_duration)]
    node_get_info_delay: Option<Duration>,
    /// Fail NodeGetInfo with this message.
    #[arg(long)]
    node_get_info_error: Option<String>,
    /// gRPC status code of the NodeGetInfo failure.
    #[arg(long, default_value_t = Code::Internal as i32)]
    node_get_info_error_code: i32,
    /// Never answer NodeGetInfo.
    #[arg(long)]
    node_get_info_hang: bool,
    /// Wait this long before creating the socket.
    #[arg(long, value_parser = humantime::parse_duration)]
    start_delay: Option<Duration>,
}

impl Args {
    fn socket(&self) -> anyhow::Result<PathBuf> {
        match (&self.socket, &self.endpoint) {
            (Some(path), None) => Ok(path.clone()),
            (None, Some(address)) => Ok(plugreg_transport::parse_address(address)?),
            _ => bail!("one of --socket or --endpoint is required"),
        }
    }

    fn config(&self) -> anyhow::Result<DriverConfig> {
        let failure = |msg: &Option<String>, code| {
            msg.as_ref()
                .map(|m| Failure::new(Code::from_i32(code), m.clone()))
        };
        Ok(DriverConfig {
            name: self.name.clone(),
            vendor_version: self.vendor_version.clone(),
            accessibility_constraints: self.accessibility_constraints,
            node_id: self.node_id.clone(),
            topology: parse_topology(&self.topology)?,
            max_volumes_per_node: self.max_volumes,
            get_plugin_info: Fault {
                delay: self.get_plugin_info_delay,
                delay_first: self.get_plugin_info_delay_first,
                error: failure(&self.get_plugin_info_error, self.get_plugin_info_error_code),
                fail_first: self.get_plugin_info_fail_first,
                hang: false,
            },
            node_get_info: Fault {
                delay: self.node_get_info_delay,
                error: failure(&self.node_get_info_error, self.node_get_info_error_code),
                hang: self.node_get_info_hang,
                ..Fault::default()
            },
            ..DriverConfig::default()
        })
    }
}

/// Prints one JSON line; a closed stdout is not an error (the reader may be gone).
fn emit(value: serde_json::Value) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}").and_then(|()| out.flush());
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let socket = args.socket()?;
    let config = args.config()?;
    let token = CancellationToken::new();

    let mut signals = Signals::new().context("SIGTERM/SIGINT handlers")?;
    tokio::spawn({
        let token = token.clone();
        async move {
            signals.shutdown().await;
            token.cancel();
        }
    });

    if let Some(delay) = args.start_delay {
        tokio::select! {
            _ = token.cancelled() => return Ok(()),
            _ = tokio::time::sleep(delay) => {}
        }
    }

    let mut calls = config.calls.subscribe();
    tokio::spawn(async move {
        while let Ok(call) = calls.recv().await {
            emit(serde_json::json!({
                "event": "call",
                "method": call.method.as_str(),
                "number": call.number,
                "delay_ms": call.delay.map(|d| d.as_millis() as u64),
                "error": call.error.map(|e| e.message),
                "hang": call.hang,
            }));
        }
    });

    let bound = plugreg_transport::bind(&socket)
        .with_context(|| format!("creating {}", socket.display()))?;
    emit(serde_json::json!({"event": "listening", "socket": socket}));
    plugreg_csi_test_driver::serve_bound(config, bound, token).await?;
    emit(serde_json::json!({"event": "stopped", "socket": socket}));
    Ok(())
}
