//! The diagnostics HTTP server: `/healthz` with upstream's codes and bodies, bounded by
//! `--timeout` as a whole (R4), and `/metrics` in the Prometheus text format.

use std::fmt::Write as _;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{any, get};
use plugreg_proto::pluginregistration::InfoRequest;
use plugreg_proto::pluginregistration::registration_client::RegistrationClient;
use plugreg_registrar::Registrar;
use plugreg_transport::{MAX_MESSAGE_SIZE, PathKind};
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::logging::V4;

/// Binds the listener for a Go-style address: `:9809` (all interfaces), `host:port`,
/// `[::1]:9809`.
pub(crate) async fn bind(endpoint: &str) -> io::Result<TcpListener> {
    if endpoint.starts_with(':') {
        // Go's ":port" listens on every interface, IPv6 and IPv4; fall back to IPv4 only on
        // hosts without IPv6.
        match TcpListener::bind(format!("[::]{endpoint}")).await {
            Ok(l) => Ok(l),
            Err(_) => TcpListener::bind(format!("0.0.0.0{endpoint}")).await,
        }
    } else {
        TcpListener::bind(endpoint).await
    }
}

/// What the handlers need.
#[derive(Debug, Clone)]
pub(crate) struct HttpState {
    /// The registration socket.
    pub socket: PathBuf,
    /// The driver name GetInfo must answer.
    pub driver_name: String,
    /// Bound for the whole /healthz check.
    pub timeout: Duration,
    /// The registrar, for its counters.
    pub registrar: Registrar,
}

/// The router: `/healthz` (any method), `/metrics`, Go's 404 for anything else.
pub(crate) fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", any(healthz))
        .route("/metrics", get(metrics))
        .fallback(|| async { (StatusCode::NOT_FOUND, "404 page not found\n") })
        .with_state(Arc::new(state))
}

/// Serves `router` on `listener` until `shutdown` completes.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn healthz(State(state): State<Arc<HttpState>>) -> (StatusCode, String) {
    let (code, body) = check(&state).await;
    if code == StatusCode::OK {
        tracing::trace!("Health check succeeded");
    } else {
        tracing::error!(err = %body, "Health check failed");
    }
    (code, body)
}

/// One health check: the socket must exist and be a socket, and a GetInfo self-call through it
/// must answer this driver's name, all within `state.timeout`.
pub(crate) async fn check(state: &HttpState) -> (StatusCode, String) {
    let deadline = Instant::now() + state.timeout;
    let path = &state.socket;
    match plugreg_transport::path_kind(path) {
        Err(e) => {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "failed to stat the socket {} with error: {e}",
                    path.display()
                ),
            );
        }
        Ok(PathKind::Other) => {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "file exists in socketPath {} but it's not a socket",
                    path.display()
                ),
            );
        }
        Ok(PathKind::Missing) => {
            return (
                StatusCode::NOT_FOUND,
                "registration socket does not exist".into(),
            );
        }
        Ok(PathKind::Socket) => {}
    }
    const EXPIRED: &str = "context deadline exceeded";
    let remaining = deadline.saturating_duration_since(Instant::now());
    tracing::debug!(target: V4, socketPath = %path.display(), "Connecting to node-registrar socket");
    let channel = match plugreg_transport::connect_path(path, remaining).await {
        Ok(c) => c,
        Err(e) => {
            let err = match e {
                plugreg_transport::Error::ConnectTimeout { .. } => EXPIRED.to_owned(),
                other => crate::error_chain(&other),
            };
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "error connecting to node-registrar socket {}: {err}",
                    path.display()
                ),
            );
        }
    };
    let mut client = RegistrationClient::new(channel).max_decoding_message_size(MAX_MESSAGE_SIZE);
    let info = tokio::time::timeout_at(deadline, client.get_info(InfoRequest {})).await;
    let err = match info {
        Ok(Ok(info)) => {
            let name = info.into_inner().name;
            if name == state.driver_name {
                return (StatusCode::OK, "ok".into());
            }
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("invalid driver name {name}"),
            );
        }
        Ok(Err(status)) => crate::grpc_error(&status),
        Err(_) => format!("rpc error: code = DeadlineExceeded desc = {EXPIRED}"),
    };
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("error getting info from node-registrar socket: {err}"),
    )
}

async fn metrics(State(state): State<Arc<HttpState>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render_metrics(&state.driver_name, &state.registrar),
    )
}

/// The Prometheus text exposition of the registrar's state.
pub(crate) fn render_metrics(driver_name: &str, registrar: &Registrar) -> String {
    let status = registrar.status().borrow().clone();
    let label = format!("driver_name=\"{}\"", escape_label(driver_name));
    let last_rejection = status
        .last_rejected_at
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0.0, |d| d.as_secs_f64());
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, samples: &[(String, String)]| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    };
    family(
        "csi_node_driver_registrar_registered",
        "gauge",
        "Whether the kubelet has confirmed the registration: 1 after NotifyRegistrationStatus(true), 0 before it or after a rejection.",
        &[(label.clone(), u8::from(status.is_registered()).to_string())],
    );
    family(
        "csi_node_driver_registrar_notifications_total",
        "counter",
        "NotifyRegistrationStatus calls received from the kubelet, by result.",
        &[
            (
                format!("{label},result=\"accepted\""),
                status.accepted_total.to_string(),
            ),
            (
                format!("{label},result=\"rejected\""),
                status.rejected_total.to_string(),
            ),
        ],
    );
    family(
        "csi_node_driver_registrar_last_rejection_timestamp_seconds",
        "gauge",
        "Unix time of the latest rejection by the kubelet; 0 if there was none.",
        &[(label.clone(), format!("{last_rejection}"))],
    );
    family(
        "csi_node_driver_registrar_get_info_calls_total",
        "counter",
        "GetInfo calls answered on the registration socket, including the /healthz self-checks.",
        &[(label, registrar.get_info_total().to_string())],
    );
    out
}

/// Escapes a Prometheus label value.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The address a listener actually got (for logs and callers using port 0).
pub(crate) fn local_addr(listener: &TcpListener) -> Option<SocketAddr> {
    listener.local_addr().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugreg_registrar::PluginInfo;

    #[test]
    fn metrics_are_prometheus_text_with_the_driver_label() {
        let registrar = Registrar::new(PluginInfo {
            name: "csi.example.com".into(),
            ..PluginInfo::default()
        });
        let text = render_metrics("csi.example.com", &registrar);
        for line in [
            "# TYPE csi_node_driver_registrar_registered gauge",
            "csi_node_driver_registrar_registered{driver_name=\"csi.example.com\"} 0",
            "# TYPE csi_node_driver_registrar_notifications_total counter",
            "csi_node_driver_registrar_notifications_total{driver_name=\"csi.example.com\",result=\"accepted\"} 0",
            "csi_node_driver_registrar_notifications_total{driver_name=\"csi.example.com\",result=\"rejected\"} 0",
            "csi_node_driver_registrar_last_rejection_timestamp_seconds{driver_name=\"csi.example.com\"} 0",
            "csi_node_driver_registrar_get_info_calls_total{driver_name=\"csi.example.com\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let name = l.split('{').next().unwrap();
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "{name} has a HELP line"
            );
        }
        assert_eq!(escape_label("a\"b\\c\n"), "a\\\"b\\\\c\\n");
    }
}
