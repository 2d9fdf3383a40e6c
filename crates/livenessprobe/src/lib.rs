//! livenessprobe: a drop-in replacement of the Kubernetes CSI `livenessprobe` sidecar v2.19
//! (docs/design.md C3). It serves HTTP `/healthz` for the driver container's `livenessProbe`: each
//! check dials the CSI driver afresh and calls `Probe`, all within `--probe-timeout`, and
//! concurrent callers share the one check in flight, so a burst of probes costs the driver one
//! call. Same flags, defaults, endpoints, log lines and exit codes as upstream
//! (`docs/upstream/upstream-livenessprobe.md`), with these documented differences:
//! - `--version` prints the version (upstream has no such flag);
//! - legacy klog flags and `--automaxprocs` are accepted and ignored with a warning;
//! - a failing HTTP listener exits 1 (upstream logs the error and exits 0);
//! - `--csi-address` must be a Unix socket (`/path` or `unix://path`); a TCP target is refused
//!   at start with exit 1.

pub mod flags;
pub mod metrics;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use plugreg_proto::csi::v1::identity_client::IdentityClient;
use plugreg_proto::csi::v1::{GetPluginInfoRequest, ProbeRequest};
use plugreg_runtime::report;
use plugreg_sidecar_kit::connect::{ConnectWindow, Outcome, Retry};
use plugreg_sidecar_kit::http::{NOT_FOUND_BODY, SharedCheck, text_response};
use plugreg_transport::Connection;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::metrics::{Metrics, UNKNOWN_DRIVER};

/// The version reported by `--version` (the sidecar kit's).
pub use plugreg_sidecar_kit::VERSION;

/// Target for lines upstream logs at V(5).
pub const V5: &str = "plugreg_livenessprobe::v5";

/// The `--health-port` default; another value together with `--http-endpoint` is a conflict.
pub const DEFAULT_HEALTH_PORT: &str = "9808";

/// `/csi.v1.Identity/Probe`, as the metrics name it.
pub const PROBE_METHOD: &str = "/csi.v1.Identity/Probe";
/// `/csi.v1.Identity/GetPluginInfo`, as the metrics name it.
pub const GET_PLUGIN_INFO_METHOD: &str = "/csi.v1.Identity/GetPluginInfo";

/// How long one dial attempt may take, and the pause between attempts at start-up.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(1);
/// Pause between dial attempts within one health check.
const CHECK_RETRY: Duration = Duration::from_millis(100);
/// The text Go gives for an expired context.
const EXPIRED: &str = "context deadline exceeded";

/// What the sidecar does (the flags other than logging).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `--csi-address`.
    pub csi_address: String,
    /// `--probe-timeout`: bounds the dial and the Probe call of one check.
    pub probe_timeout: Duration,
    /// `--health-port` (a string, as upstream: it is only joined into an address).
    pub health_port: String,
    /// `--http-endpoint`.
    pub http_endpoint: String,
    /// `--metrics-address`.
    pub metrics_address: String,
    /// `--metrics-path`.
    pub metrics_path: String,
    /// `--automaxprocs` (no meaning here; a warning when set).
    pub automaxprocs: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            csi_address: "/run/csi/socket".into(),
            probe_timeout: Duration::from_secs(3),
            health_port: DEFAULT_HEALTH_PORT.into(),
            http_endpoint: String::new(),
            metrics_address: String::new(),
            metrics_path: "/metrics".into(),
            automaxprocs: false,
        }
    }
}

/// Why the sidecar stopped; each has upstream's exit code ([`RunError::exit_code`]).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Both `--health-port` (not 9808) and `--http-endpoint`.
    #[error("Only one of `--health-port` and `--http-endpoint` can be explicitly set")]
    HealthPortConflict,
    /// Both `--metrics-address` and `--http-endpoint`.
    #[error("Only one of `--metrics-address` and `--http-endpoint` can be explicitly set")]
    MetricsConflict,
    /// `--csi-address` is not a Unix socket address.
    #[error("{0}")]
    Address(String),
    /// GetPluginInfo failed or gave an empty name.
    #[error("{0}")]
    DriverName(String),
    /// The separate metrics listener failed.
    #[error("metrics endpoint {address}: {source}")]
    MetricsListen {
        /// `--metrics-address`.
        address: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The health listener failed.
    #[error("http server {address}: {source}")]
    HttpListen {
        /// The listen address.
        address: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl RunError {
    /// The process exit code: 1 for all (upstream exits 0 after a failing HTTP server; plugreg
    /// exits 1, see the crate documentation).
    pub fn exit_code(&self) -> i32 {
        1
    }
}

/// Checks the flag combinations upstream refuses (after logging validation, as upstream).
pub fn check_conflicts(config: &Config) -> Result<(), RunError> {
    if config.health_port != DEFAULT_HEALTH_PORT && !config.http_endpoint.is_empty() {
        return Err(RunError::HealthPortConflict);
    }
    if !config.metrics_address.is_empty() && !config.http_endpoint.is_empty() {
        return Err(RunError::MetricsConflict);
    }
    Ok(())
}

/// The address of the health server: `--http-endpoint`, else all IPv4 interfaces on
/// `--health-port`.
pub fn listen_address(config: &Config) -> String {
    if config.http_endpoint.is_empty() {
        format!("0.0.0.0:{}", config.health_port)
    } else {
        config.http_endpoint.clone()
    }
}

/// The socket path of `--csi-address`, or a clear refusal of anything that is not a Unix socket
/// address (upstream would also dial a TCP target).
pub fn socket_path(address: &str) -> Result<PathBuf, RunError> {
    if !address.starts_with('/') && !address.starts_with("unix://") {
        return Err(RunError::Address(format!(
            "--csi-address {address:?}: only Unix socket addresses (/path or unix://path) are supported, not TCP targets"
        )));
    }
    plugreg_transport::parse_address(address).map_err(|e| RunError::Address(report::chain(&e)))
}

/// Everything the handlers need.
#[derive(Debug)]
pub struct Prober {
    socket: PathBuf,
    driver_name: String,
    timeout: Duration,
    metrics: Metrics,
    /// The check in flight, if any.
    in_flight: SharedCheck<Verdict>,
}

/// A finished health check: status code and body.
pub type Verdict = (StatusCode, String);

impl Prober {
    /// Checks `socket` (the driver `driver_name`) with Probe, each check within `timeout`,
    /// recording calls in `metrics`.
    pub fn new(
        socket: PathBuf,
        driver_name: String,
        timeout: Duration,
        metrics: Metrics,
    ) -> Arc<Self> {
        Arc::new(Self {
            socket,
            driver_name,
            timeout,
            metrics,
            in_flight: SharedCheck::default(),
        })
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The verdict of the check in flight, or of a new one if none is.
    pub async fn healthz(self: &Arc<Self>) -> Verdict {
        let this = self.clone();
        self.in_flight
            .run(move || async move { this.check().await })
            .await
            .unwrap_or_else(|| {
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "health check aborted".into(),
                )
            })
    }

    /// One check: dial the driver and call Probe, both within the probe timeout.
    async fn check(&self) -> Verdict {
        let deadline = Instant::now() + self.timeout;
        let fail = |body: String| (StatusCode::INTERNAL_SERVER_ERROR, body);
        let connection = match dial_until(&self.socket, deadline).await {
            Ok(c) => c,
            Err(err) => {
                tracing::error!(err = %err, "Failed to establish connection to CSI driver");
                return fail(err);
            }
        };
        tracing::debug!(target: V5, driver = %self.driver_name, "Sending probe request to CSI driver");
        let mut client = identity_client(connection);
        let started = StdInstant::now();
        let answer = tokio::time::timeout_at(deadline, client.probe(ProbeRequest {})).await;
        let code = match &answer {
            Ok(Ok(_)) => tonic::Code::Ok,
            Ok(Err(status)) => status.code(),
            Err(_) => tonic::Code::DeadlineExceeded,
        };
        self.metrics
            .record(&self.driver_name, PROBE_METHOD, code, started.elapsed());
        match answer {
            Ok(Ok(response)) => {
                if response.into_inner().ready == Some(false) {
                    tracing::error!("Driver responded but is not ready");
                    return fail("driver responded but is not ready".into());
                }
                tracing::debug!(target: V5, "Health check succeeded");
                (StatusCode::OK, "ok".into())
            }
            Ok(Err(status)) => {
                let err = report::grpc(&status);
                tracing::error!(err = %err, "Health check failed");
                fail(err)
            }
            Err(_) => {
                let err = format!("rpc error: code = DeadlineExceeded desc = {EXPIRED}");
                tracing::error!(err = %err, "Health check failed");
                fail(err)
            }
        }
    }
}

fn identity_client(connection: Connection) -> IdentityClient<Connection> {
    plugreg_transport::client!(IdentityClient, connection)
}

/// Dials `socket` until it answers or `deadline` passes (as a blocking gRPC dial does: a driver
/// that is restarting gets the whole probe timeout). The error is Go's text for the expiry.
async fn dial_until(socket: &Path, deadline: Instant) -> Result<Connection, String> {
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(EXPIRED.into());
        }
        match plugreg_transport::connect_direct(socket, remaining).await {
            Ok(c) => return Ok(c),
            Err(e) => tracing::trace!(err = %report::chain(&e), "CSI driver not reachable yet"),
        }
        let retry_at = (Instant::now() + CHECK_RETRY).min(deadline);
        tokio::time::sleep_until(retry_at).await;
    }
}

type BoxedResponse = Pin<Box<dyn Future<Output = Response<String>> + Send>>;

/// The main server's handler: `/healthz` (any method), the metrics path when `with_metrics`,
/// Go's 404 otherwise.
pub fn health_handler(
    prober: Arc<Prober>,
    metrics_path: Option<String>,
) -> impl Fn(Request<Incoming>) -> BoxedResponse + Clone + Send + Sync + 'static {
    move |request: Request<Incoming>| {
        let prober = prober.clone();
        let metrics_path = metrics_path.clone();
        Box::pin(async move {
            let path = request.uri().path();
            if path == "/healthz" {
                let (code, body) = prober.healthz().await;
                text_response(code, body)
            } else if metrics_path.as_deref() == Some(path) {
                text_response(StatusCode::OK, prober.metrics().render())
            } else {
                text_response(StatusCode::NOT_FOUND, NOT_FOUND_BODY.into())
            }
        }) as BoxedResponse
    }
}

/// The separate metrics server's handler: the metrics path, Go's 404 otherwise.
pub fn metrics_handler(
    metrics: Metrics,
    metrics_path: String,
) -> impl Fn(Request<Incoming>) -> BoxedResponse + Clone + Send + Sync + 'static {
    move |request: Request<Incoming>| {
        let answer = if request.uri().path() == metrics_path {
            text_response(StatusCode::OK, metrics.render())
        } else {
            text_response(StatusCode::NOT_FOUND, NOT_FOUND_BODY.into())
        };
        Box::pin(async move { answer }) as BoxedResponse
    }
}

/// Connects to the driver at `socket` with no time limit (upstream's blocking dial): an attempt
/// about every second, "Still connecting" every 10 s. `None` when `token` was cancelled.
async fn connect_forever(socket: &Path, token: &CancellationToken) -> Option<Connection> {
    let shown = format!("unix://{}", socket.display());
    let window = ConnectWindow {
        end: None,
        attempt: CONNECT_ATTEMPT,
        retry: Retry::Every(CONNECT_ATTEMPT),
    };
    let shown_ref = &shown;
    let dial = |timeout| async move {
        let shown = shown_ref;
        let result = plugreg_transport::connect_direct(socket, timeout).await;
        if let Err(e) = &result {
            tracing::debug!(err = %report::chain(e), address = %shown, "CSI driver not reachable yet");
        }
        result
    };
    match window.connect(&shown, token, dial).await {
        Outcome::Connected(c) => Some(c),
        Outcome::Closed(_) | Outcome::Stopped => None,
    }
}

/// Asks the driver its name (no deadline, as upstream); records the call as `unknown-driver`.
async fn driver_name(connection: Connection, metrics: &Metrics) -> Result<String, RunError> {
    tracing::info!("Calling CSI driver to discover driver name");
    let mut client = identity_client(connection);
    let started = StdInstant::now();
    let answer = client.get_plugin_info(GetPluginInfoRequest {}).await;
    let code = answer
        .as_ref()
        .map_or_else(|s| s.code(), |_| tonic::Code::Ok);
    metrics.record(
        UNKNOWN_DRIVER,
        GET_PLUGIN_INFO_METHOD,
        code,
        started.elapsed(),
    );
    let err = match answer {
        Ok(info) => {
            let name = info.into_inner().name;
            if !name.is_empty() {
                return Ok(name);
            }
            "driver name is empty".to_owned()
        }
        Err(status) => report::grpc(&status),
    };
    tracing::error!(err = %err, "Failed to get CSI driver name");
    Err(RunError::DriverName(err))
}

/// Runs the sidecar until `token` is cancelled (or forever): upstream's start-up sequence, then
/// the servers. Logs each failure as upstream does before returning it.
pub async fn run(config: Config, token: CancellationToken) -> Result<(), RunError> {
    if let Err(e) = check_conflicts(&config) {
        tracing::error!("{e}");
        return Err(e);
    }
    let address = listen_address(&config);
    let metrics = Metrics::new();
    let socket = match socket_path(&config.csi_address) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(err = %e, "Failed to establish connection to CSI driver");
            return Err(e);
        }
    };
    let Some(connection) = connect_forever(&socket, &token).await else {
        return Ok(());
    };
    let name = tokio::select! {
        _ = token.cancelled() => return Ok(()),
        name = driver_name(connection, &metrics) => name?,
    };
    tracing::info!(driver = %name, "CSI driver name");

    let mut metrics_task = None;
    if !config.metrics_address.is_empty() {
        let listener = match plugreg_sidecar_kit::http::bind(&config.metrics_address).await {
            Ok(l) => l,
            Err(source) => {
                tracing::error!(
                    err = %source,
                    "Failed to start prometheus metrics endpoint on specified address and path"
                );
                return Err(RunError::MetricsListen {
                    address: config.metrics_address.clone(),
                    source,
                });
            }
        };
        tracing::info!(address = %shown_addr(&listener, &config.metrics_address), metricsPath = %config.metrics_path, "Separate metrics ServeMux listening");
        let handler = metrics_handler(metrics.clone(), config.metrics_path.clone());
        metrics_task = Some(tokio::spawn(plugreg_sidecar_kit::http::serve(
            listener,
            handler,
            Duration::ZERO,
            token.clone(),
        )));
    }
    let with_metrics = (!config.http_endpoint.is_empty() && config.metrics_address.is_empty())
        .then(|| config.metrics_path.clone());
    let prober = Prober::new(socket, name, config.probe_timeout, metrics);
    let listener = match plugreg_sidecar_kit::http::bind(&address).await {
        Ok(l) => l,
        Err(source) => {
            tracing::error!(err = %source, "Failed to start http server");
            return Err(RunError::HttpListen { address, source });
        }
    };
    tracing::info!(address = %shown_addr(&listener, &address), "ServeMux listening");
    let served = plugreg_sidecar_kit::http::serve(
        listener,
        health_handler(prober, with_metrics),
        config.probe_timeout,
        token,
    )
    .await;
    if let Some(task) = metrics_task {
        task.abort();
    }
    served.map_err(|source| {
        tracing::error!(err = %source, "Failed to start http server");
        RunError::HttpListen { address, source }
    })
}

/// The address a listener got (differs from the configured one only for port 0).
fn shown_addr(listener: &TcpListener, configured: &str) -> String {
    plugreg_sidecar_kit::http::local_addr(listener)
        .map_or_else(|| configured.to_owned(), |a| a.to_string())
}
