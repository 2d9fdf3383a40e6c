//! `plugreg manager`: the kubelet-side plugin manager as a daemon.

pub mod device;
#[cfg(feature = "panicking-handler")]
mod fault;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use plugreg_handler_api::RecordHandler;
use plugreg_handler_example::{EXAMPLE_PLUGIN, ExampleHandler};
use plugreg_manager::{
    DEFAULT_REGISTRY_DIR, HandlerRegistry, LivenessConfig, ManagerConfig, PluginManager,
};
use plugreg_runtime::signal::{Received, Signals};
use plugreg_sidecar_kit::http::{
    Incoming, Limits, Method, NOT_FOUND_BODY, Request, Response, StatusCode, header, text_response,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Time a CSI handler call may take beyond its NodeGetInfo limit.
const CSI_HANDLER_MARGIN: Duration = Duration::from_secs(10);

/// Flags of `plugreg manager`.
#[derive(Debug, Clone, clap::Args)]
pub struct ManagerArgs {
    /// Directory watched for plugin registration sockets (created 0755 when missing).
    #[arg(long, default_value = DEFAULT_REGISTRY_DIR)]
    pub registry_dir: PathBuf,
    /// Address for /healthz, /metrics and /plugins, e.g. 127.0.0.1:9810 (off when empty).
    #[arg(long)]
    pub http_endpoint: Option<SocketAddr>,
    /// Plugin types to accept. ExamplePlugin gets the example handler; DRAPlugin the DRA
    /// handler; CSIPlugin the CSI handler when a node-info sink is configured; every other type
    /// an accept-and-record handler.
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
    /// Most registrations and deregistrations running at once in the shared slots.
    #[arg(long, default_value_t = 64)]
    pub max_concurrent_operations: usize,
    /// An operation running this long leaves the shared slots (so a slow plugin does not
    /// hold up the others) for the slow lane.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "250ms")]
    pub slow_operation_after: Duration,
    /// Most operations in the slow lane; when it is full, the plugin with the most slow
    /// registrations has its oldest cancelled and retried with back-off.
    #[arg(long, default_value_t = 256)]
    pub max_slow_operations: usize,
    /// Limit for each handler call (validate, register, deregister); CSIPlugin gets
    /// --csi-node-get-info-timeout plus 10s.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    pub handler_timeout: Duration,
    /// Most HTTP connections open at once (D7); when all are taken, a new client closes the
    /// oldest one that is idle or only being answered.
    #[arg(long, default_value_t = plugreg_sidecar_kit::http::MAX_CONNECTIONS)]
    pub http_max_connections: usize,
    /// Dead-plugin probe interval (0 turns detection off).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub liveness_interval: Duration,
    /// Refused probes in a row that make a plugin dead.
    #[arg(long, default_value_t = 3)]
    pub liveness_failures: u32,
    /// Device plugins.
    #[command(flatten)]
    pub device: device::DeviceArgs,
}

impl ManagerArgs {
    fn config(&self) -> ManagerConfig {
        let mut c = ManagerConfig::new(&self.registry_dir);
        c.dial_timeout = self.dial_timeout;
        c.get_info_timeout = self.get_info_timeout;
        c.notify_timeout = self.notify_timeout;
        c.resync_period = self.resync_period;
        c.max_concurrent_operations = self.max_concurrent_operations;
        c.slow_operation_after = self.slow_operation_after;
        c.max_slow_operations = self.max_slow_operations;
        c.handler_timeout = self.handler_timeout;
        // CSI's register waits for NodeGetInfo (2 min by default): give it that and a margin.
        c.handler_timeouts.insert(
            plugreg_handler_csi::PLUGIN_TYPE.to_owned(),
            self.csi_node_get_info_timeout
                .saturating_add(CSI_HANDLER_MARGIN),
        );
        c.liveness = (!self.liveness_interval.is_zero()).then_some(LivenessConfig {
            interval: self.liveness_interval,
            failure_threshold: self.liveness_failures.max(1),
        });
        c
    }

    /// The handlers for the configured plugin types.
    pub async fn handlers(&self, devices: &device::Devices) -> anyhow::Result<HandlerRegistry> {
        let mut handlers = HandlerRegistry::new();
        for t in &self.plugin_types {
            let t = t.trim();
            if t.is_empty() {
                continue;
            }
            #[cfg(feature = "panicking-handler")]
            if t == fault::PLUGIN_TYPE {
                handlers.insert(t, Arc::new(fault::PanickingHandler));
                continue;
            }
            if t == plugreg_proto::pluginregistration::DRA_PLUGIN {
                handlers.insert(t, Arc::new(plugreg_handler_dra::DraHandler::new()));
            } else if t == EXAMPLE_PLUGIN {
                handlers.insert(
                    t,
                    Arc::new(ExampleHandler::new(self.example_versions.clone())),
                );
            } else if t == plugreg_handler_device::PLUGIN_TYPE {
                handlers.insert(t, devices.handler());
            } else if t == plugreg_handler_csi::PLUGIN_TYPE
                && let Some(sink) = self.csi_sink()
            {
                let cfg = plugreg_handler_csi::CsiHandlerConfig {
                    node_get_info_timeout: self.csi_node_get_info_timeout,
                    sink,
                };
                let h = plugreg_handler_csi::CsiHandler::from_config(&cfg)
                    .await
                    .context("cannot set up the CSI node-info sink")?;
                handlers.insert(t, Arc::new(h));
            } else {
                if t == plugreg_handler_csi::PLUGIN_TYPE {
                    tracing::warn!(
                        "no --node-info-file or --node-name: CSI drivers are accepted and recorded, not published"
                    );
                }
                handlers.insert(t, Arc::new(RecordHandler::new()));
            }
        }
        Ok(handlers)
    }

    /// With `--device-plugin-dir` but without the `DevicePlugin` type, the device handler
    /// still keeps (and reports) the plugins registered through `kubelet.sock`: it joins the
    /// registry as a reporter only, taking no registrations from the registry directory.
    fn add_classic_device_reporter(
        &self,
        handlers: &mut HandlerRegistry,
        devices: &device::Devices,
    ) {
        if self.device.device_plugin_dir.is_some()
            && handlers.get(plugreg_handler_device::PLUGIN_TYPE).is_none()
        {
            handlers.add_reporter(devices.handler());
        }
    }

    fn csi_sink(&self) -> Option<plugreg_handler_csi::SinkConfig> {
        if let Some(f) = &self.node_info_file {
            return Some(plugreg_handler_csi::SinkConfig::File(f.clone()));
        }
        self.node_name
            .as_ref()
            .map(|n| plugreg_handler_csi::SinkConfig::Kube {
                kubeconfig: self.kubeconfig.clone(),
                node_name: n.clone(),
            })
    }
}

/// Runs the daemon until SIGTERM or SIGINT. SIGHUP rescans the registry directory.
pub async fn run(args: ManagerArgs) -> anyhow::Result<()> {
    // Installed first: a SIGHUP that arrives once the daemon says it is up must rescan, not kill.
    let mut signals = Signals::with_hangup()?;
    let token = CancellationToken::new();
    let devices = device::Devices::new(&args.device);
    let mut handlers = args.handlers(&devices).await?;
    args.add_classic_device_reporter(&mut handlers, &devices);
    let manager = PluginManager::start(args.config(), handlers.clone(), token.clone())
        .await
        .context("cannot start the plugin manager")?;
    let classic = devices.start_classic(&args.device, &token)?;
    // RSS follows the live heap, not the highest peak of work so far (issue 17, finding 12).
    let trim = tokio::spawn(plugreg_runtime::memory::trim_every(
        std::time::Duration::from_secs(10),
    ));

    let http = match args.http_endpoint {
        Some(addr) => {
            let listener = plugreg_sidecar_kit::http::listen(addr)
                .with_context(|| format!("cannot listen on {addr}"))?;
            tracing::info!(endpoint = %listener.local_addr()?, "Starting HTTP server");
            let state = AppState {
                manager: manager.clone(),
                handlers,
            };
            let served = serve_http(listener, state, args.http_max_connections, token.clone());
            Some(tokio::spawn(
                async move {
                    if let Err(e) = served.await {
                        tracing::error!(error = %e, "HTTP server failed");
                    }
                }
                .instrument(tracing::info_span!("http")),
            ))
        }
        None => None,
    };

    loop {
        match signals.recv().await {
            Received::Hangup => {
                tracing::info!(signal = "SIGHUP", "rescanning the registry directory");
                manager.rescan();
            }
            s => {
                tracing::info!(signal = s.name(), "stopping");
                break;
            }
        }
    }
    token.cancel();
    trim.abort();
    // Bounded drain: the reconciler abandons operations in flight; plugin sockets stay.
    devices.stop();
    let drain = async {
        manager.stopped().await;
        if let Some(h) = classic {
            let _ = h.await;
        }
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

/// What the HTTP routes read: the manager's records and metrics, and what each type's handler
/// reports of its plugins.
#[derive(Clone)]
pub struct AppState {
    manager: PluginManager,
    handlers: HandlerRegistry,
}

/// The longest an HTTP handler may take (they read memory only; a `/plugins` of 10,000 sockets
/// takes milliseconds).
const HTTP_HANDLER_LIMIT: Duration = Duration::from_secs(10);

/// Serves /healthz, /metrics and /plugins on `listener` until `token` is cancelled, with the
/// sidecars' HTTP server: connections beyond `max_connections` evict idle ones, request heads
/// must come within 5 s, answers must be taken within 5 s.
pub async fn serve_http(
    listener: TcpListener,
    state: AppState,
    max_connections: usize,
    token: CancellationToken,
) -> std::io::Result<()> {
    let state = Arc::new(state);
    let handler = move |request: Request<Incoming>| {
        let state = state.clone();
        async move { respond(&state, request.method(), request.uri().path()) }
    };
    let limits = Limits {
        max_connections,
        handler_limit: HTTP_HANDLER_LIMIT,
    };
    plugreg_sidecar_kit::http::serve_with(listener, handler, limits, token).await
}

/// The answer to one request: GET or HEAD of /healthz, /metrics, /plugins; 405 for another
/// method there; 404 elsewhere.
fn respond(state: &AppState, method: &Method, path: &str) -> Response<String> {
    let route: fn(&AppState) -> Response<String> = match path {
        "/healthz" => healthz,
        "/metrics" => metrics,
        "/plugins" => plugins,
        _ => return text_response(StatusCode::NOT_FOUND, NOT_FOUND_BODY.into()),
    };
    if method != Method::GET && method != Method::HEAD {
        let mut refused = text_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "Method Not Allowed\n".into(),
        );
        refused
            .headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        return refused;
    }
    route(state)
}

/// 200 "ok" while the watcher and the reconciler run; 503 with the reason when not.
fn healthz(state: &AppState) -> Response<String> {
    match state.manager.health() {
        Ok(()) => text_response(StatusCode::OK, "ok".to_owned()),
        Err(why) => text_response(StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

/// The manager's Prometheus text, then each handler's.
fn metrics(state: &AppState) -> Response<String> {
    let mut text = state.manager.render_metrics();
    text.push_str(&state.handlers.render_metrics());
    text_response(StatusCode::OK, text)
}

/// The manager's records, each with the `details` its type's handler gives it (DevicePlugin:
/// devices; DRAPlugin: instances), then the plugins handlers took in another way.
fn plugins(state: &AppState) -> Response<String> {
    let mut entries: Vec<serde_json::Value> = state
        .manager
        .snapshot()
        .iter()
        .map(|r| {
            let mut v = serde_json::to_value(r).unwrap_or_default();
            if let Some(d) = state
                .handlers
                .plugin_details(&r.plugin_type, &r.name, &r.endpoint)
                && let Some(obj) = v.as_object_mut()
            {
                obj.insert("details".into(), d);
            }
            v
        })
        .collect();
    entries.extend(state.handlers.unlisted_plugins());
    let body =
        serde_json::to_string_pretty(&entries).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
    let mut response = Response::new(body);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    async fn serve(manager: PluginManager, max: usize) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = AppState {
            manager,
            handlers: HandlerRegistry::new(),
        };
        tokio::spawn(serve_http(listener, state, max, CancellationToken::new()));
        addr
    }

    /// One blocking HTTP/1.1 GET on a fresh connection (run on a blocking thread).
    fn get(addr: SocketAddr, path: &str, read_timeout: Duration) -> std::io::Result<String> {
        let mut s = std::net::TcpStream::connect(addr)?;
        s.set_read_timeout(Some(read_timeout))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )?;
        let mut resp = String::new();
        s.read_to_string(&mut resp)?;
        Ok(resp)
    }

    async fn start_manager(dir: &std::path::Path) -> PluginManager {
        let mut c = ManagerConfig::new(dir.join("plugins_registry"));
        c.liveness = None;
        PluginManager::start(c, HandlerRegistry::new(), CancellationToken::new())
            .await
            .unwrap()
    }

    #[test]
    fn csi_handler_calls_get_the_node_get_info_timeout_plus_a_margin() {
        let parse = |a: &[&str]| parse_args(a).config();
        let c = parse(&[]);
        assert_eq!(c.handler_timeout, Duration::from_secs(30));
        assert_eq!(c.handler_timeouts["CSIPlugin"], Duration::from_secs(130));
        let c = parse(&[
            "--csi-node-get-info-timeout",
            "5s",
            "--handler-timeout",
            "3s",
        ]);
        assert_eq!(c.handler_timeout, Duration::from_secs(3));
        assert_eq!(c.handler_timeouts["CSIPlugin"], Duration::from_secs(15));
    }

    #[tokio::test]
    async fn the_classic_device_plugin_socket_works_without_the_device_plugin_type() {
        // As before the handlers reported through the registry: `--device-plugin-dir` with
        // other types only still serves and reports the classic registrations.
        let args = parse_args(&["--plugin-types", "CSIPlugin", "--device-plugin-dir", "/d"]);
        let devices = device::Devices::new(&args.device);
        let mut handlers = args.handlers(&devices).await.unwrap();
        assert!(handlers.get("DevicePlugin").is_none());
        args.add_classic_device_reporter(&mut handlers, &devices);
        assert!(
            handlers.get("DevicePlugin").is_none(),
            "no registry type added"
        );
        assert!(
            handlers.render_metrics().contains("plugreg_devices"),
            "{}",
            handlers.render_metrics()
        );
    }

    #[tokio::test]
    async fn healthz_is_503_with_the_reason_once_the_watcher_died() {
        let dir = tempfile::tempdir().unwrap();
        let manager = start_manager(dir.path()).await;
        let addr = serve(manager.clone(), 8).await;
        let long = Duration::from_secs(10);
        let ok = tokio::task::spawn_blocking(move || get(addr, "/healthz", long))
            .await
            .unwrap()
            .unwrap();
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        manager.abort_task_for_tests("plugin watcher");
        let deadline = tokio::time::Instant::now() + long;
        loop {
            let resp = tokio::task::spawn_blocking(move || get(addr, "/healthz", long))
                .await
                .unwrap()
                .unwrap();
            if resp.starts_with("HTTP/1.1 503") {
                assert!(resp.ends_with("the plugin watcher stopped"), "{resp}");
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "{resp}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        manager.stop();
    }

    #[tokio::test]
    async fn a_new_client_evicts_an_idle_one_at_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let manager = start_manager(dir.path()).await;
        let addr = serve(manager.clone(), 1).await;
        // An idle client holds the only place; a request coming after it takes that place.
        let mut idle = std::net::TcpStream::connect(addr).unwrap();
        let resp =
            tokio::task::spawn_blocking(move || get(addr, "/healthz", Duration::from_secs(10)))
                .await
                .unwrap()
                .unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        idle.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut rest = Vec::new();
        let closed = tokio::task::spawn_blocking(move || idle.read_to_end(&mut rest))
            .await
            .unwrap();
        assert!(
            matches!(closed, Ok(0))
                || closed
                    .as_ref()
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
            "the idle client was not closed: {closed:?}"
        );
        manager.stop();
    }

    /// Issue 17, finding 2: clients that connect and send nothing, far more than the old cap of
    /// 64, do not keep the routes from answering.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_clients_do_not_starve_the_routes() {
        let dir = tempfile::tempdir().unwrap();
        let manager = start_manager(dir.path()).await;
        let addr = serve(manager.clone(), parse_args(&[]).http_max_connections).await;
        let idle: Vec<_> = (0..200)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        for path in ["/healthz", "/metrics", "/plugins"] {
            let resp =
                tokio::task::spawn_blocking(move || get(addr, path, Duration::from_secs(10)))
                    .await
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{path}: no answer behind 200 idle clients: {e}"));
            assert!(resp.starts_with("HTTP/1.1 200"), "{path}: {resp}");
        }
        let resp = tokio::task::spawn_blocking(move || get(addr, "/nope", Duration::from_secs(10)))
            .await
            .unwrap()
            .unwrap();
        assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
        drop(idle);
        manager.stop();
    }

    /// The flags of `plugreg manager` with `args`.
    fn parse_args(args: &[&str]) -> ManagerArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: ManagerArgs,
        }
        let cli: Cli =
            clap::Parser::try_parse_from(std::iter::once("x").chain(args.iter().copied())).unwrap();
        cli.args
    }
}
