//! `plugreg manager`: the kubelet-side plugin manager as a daemon.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use plugreg_handlers::{EXAMPLE_PLUGIN, ExampleHandler, RecordHandler};
use plugreg_manager::{
    DEFAULT_REGISTRY_DIR, HandlerRegistry, LivenessConfig, ManagerConfig, PluginManager,
};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Flags of `plugreg manager`.
#[derive(Debug, Clone, clap::Args)]
pub struct ManagerArgs {
    /// Directory watched for plugin registration sockets (created 0755 when missing).
    #[arg(long, default_value = DEFAULT_REGISTRY_DIR)]
    pub registry_dir: PathBuf,
    /// Address for /healthz, /metrics and /plugins, e.g. 127.0.0.1:9810 (off when empty).
    #[arg(long)]
    pub http_endpoint: Option<SocketAddr>,
    /// Plugin types to accept. ExamplePlugin gets the example handler; CSIPlugin the CSI
    /// handler when a node-info sink is configured; every other type an accept-and-record
    /// handler.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "CSIPlugin,DevicePlugin,DRAPlugin"
    )]
    pub plugin_types: Vec<String>,
    /// Versions the example handler accepts (exactly these, in order).
    #[arg(long, value_delimiter = ',', default_value = "v1beta1,v1beta2")]
    pub example_versions: Vec<String>,
    /// CSI: write node information to this JSON file (standalone use).
    #[arg(long, conflicts_with_all = ["kubeconfig", "node_name"])]
    pub node_info_file: Option<PathBuf>,
    /// CSI: kubeconfig for publishing node information (default: in-cluster config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// CSI: this node's name (publishes to the Kubernetes API).
    #[arg(long)]
    pub node_name: Option<String>,
    /// CSI: limit for NodeGetInfo.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2m")]
    pub csi_node_get_info_timeout: Duration,
    /// Limit for connecting to a registration socket.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub dial_timeout: Duration,
    /// Limit for GetInfo.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s")]
    pub get_info_timeout: Duration,
    /// Limit for NotifyRegistrationStatus.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    pub notify_timeout: Duration,
    /// Period of the safety-net full reconcile.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s")]
    pub resync_period: Duration,
    /// Most registrations running at once.
    #[arg(long, default_value_t = 64)]
    pub max_concurrent_operations: usize,
    /// Dead-plugin probe interval (0 turns detection off).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub liveness_interval: Duration,
    /// Refused probes in a row that make a plugin dead.
    #[arg(long, default_value_t = 3)]
    pub liveness_failures: u32,
}

impl ManagerArgs {
    fn config(&self) -> ManagerConfig {
        let mut c = ManagerConfig::new(&self.registry_dir);
        c.dial_timeout = self.dial_timeout;
        c.get_info_timeout = self.get_info_timeout;
        c.notify_timeout = self.notify_timeout;
        c.resync_period = self.resync_period;
        c.max_concurrent_operations = self.max_concurrent_operations;
        c.liveness = (!self.liveness_interval.is_zero()).then_some(LivenessConfig {
            interval: self.liveness_interval,
            failure_threshold: self.liveness_failures.max(1),
        });
        c
    }

    /// The handlers for the configured plugin types.
    pub async fn handlers(&self) -> anyhow::Result<HandlerRegistry> {
        let mut handlers = HandlerRegistry::new();
        for t in &self.plugin_types {
            let t = t.trim();
            if t.is_empty() {
                continue;
            }
            if t == EXAMPLE_PLUGIN {
                handlers.insert(
                    t,
                    Arc::new(ExampleHandler::new(self.example_versions.clone())),
                );
            } else if t == plugreg_csi::PLUGIN_TYPE
                && let Some(sink) = self.csi_sink()
            {
                let cfg = plugreg_csi::CsiHandlerConfig {
                    node_get_info_timeout: self.csi_node_get_info_timeout,
                    sink,
                };
                let h = plugreg_csi::CsiHandler::from_config(&cfg)
                    .await
                    .context("cannot set up the CSI node-info sink")?;
                handlers.insert(t, Arc::new(h));
            } else {
                if t == plugreg_csi::PLUGIN_TYPE {
                    tracing::warn!(
                        "no --node-info-file or --node-name: CSI drivers are accepted and recorded, not published"
                    );
                }
                handlers.insert(t, Arc::new(RecordHandler::new()));
            }
        }
        Ok(handlers)
    }

    fn csi_sink(&self) -> Option<plugreg_csi::SinkConfig> {
        if let Some(f) = &self.node_info_file {
            return Some(plugreg_csi::SinkConfig::File(f.clone()));
        }
        self.node_name
            .as_ref()
            .map(|n| plugreg_csi::SinkConfig::Kube {
                kubeconfig: self.kubeconfig.clone(),
                node_name: n.clone(),
            })
    }
}

/// Runs the daemon until SIGTERM or SIGINT. SIGHUP rescans the registry directory.
pub async fn run(args: ManagerArgs) -> anyhow::Result<()> {
    let token = CancellationToken::new();
    let handlers = args.handlers().await?;
    let manager = PluginManager::start(args.config(), handlers, token.clone())
        .await
        .context("cannot start the plugin manager")?;

    let http = match args.http_endpoint {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr}"))?;
            tracing::info!(endpoint = %listener.local_addr()?, "Starting HTTP server");
            let app = router(manager.clone());
            let t = token.clone();
            Some(tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app)
                    .with_graceful_shutdown(t.cancelled_owned())
                    .await
                {
                    tracing::error!(error = %e, "HTTP server failed");
                }
            }))
        }
        None => None,
    };

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = term.recv() => { tracing::info!(signal = "SIGTERM", "stopping"); break; }
            _ = int.recv() => { tracing::info!(signal = "SIGINT", "stopping"); break; }
            _ = hup.recv() => { tracing::info!(signal = "SIGHUP", "rescanning the registry directory"); manager.rescan(); }
        }
    }
    token.cancel();
    // Bounded drain: the reconciler abandons operations in flight; plugin sockets stay.
    let drain = async {
        manager.stopped().await;
        if let Some(h) = http {
            let _ = h.await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(5), drain)
        .await
        .is_err()
    {
        tracing::warn!("shutdown took longer than 5s; exiting anyway");
    }
    Ok(())
}

/// The HTTP routes: /healthz, /metrics, /plugins.
pub fn router(manager: PluginManager) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route("/plugins", get(plugins))
        .with_state(manager)
}

async fn metrics(State(m): State<PluginManager>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        m.render_metrics(),
    )
}

async fn plugins(State(m): State<PluginManager>) -> impl IntoResponse {
    let body = serde_json::to_string_pretty(&m.snapshot())
        .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
    ([(header::CONTENT_TYPE, "application/json")], body)
}
