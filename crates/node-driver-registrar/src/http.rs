//! The diagnostics HTTP server: `/healthz` with upstream's codes and bodies, bounded by
//! `--timeout` as a whole (R4), and `/metrics` in the Prometheus text format.
//!
//! A deliberately tiny HTTP/1.1 server (one request per connection, `Connection: close`):
//! probes and scrapers need nothing more, and it keeps the sidecar's code, and so its
//! resident memory, small (R5).

use std::fmt::Write as _;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use plugreg_proto::pluginregistration::InfoRequest;
use plugreg_proto::pluginregistration::registration_client::RegistrationClient;
use plugreg_registrar::Registrar;
use plugreg_transport::{MAX_MESSAGE_SIZE, PathKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::logging::V4;

/// Longest request head (request line and headers) accepted.
const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take to send its request head.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// An HTTP status code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StatusCode(pub u16);

impl StatusCode {
    pub(crate) const OK: StatusCode = StatusCode(200);
    pub(crate) const BAD_REQUEST: StatusCode = StatusCode(400);
    pub(crate) const NOT_FOUND: StatusCode = StatusCode(404);
    pub(crate) const METHOD_NOT_ALLOWED: StatusCode = StatusCode(405);
    pub(crate) const INTERNAL_SERVER_ERROR: StatusCode = StatusCode(500);

    fn reason(self) -> &'static str {
        match self.0 {
            200 => "OK",
            400 => "Bad Request",
            404 => "Not Found",
            405 => "Method Not Allowed",
            _ => "Internal Server Error",
        }
    }
}

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

/// Serves `/healthz` (any method), `/metrics` (GET, HEAD) and Go's 404 for anything else on
/// `listener` until `token` is cancelled.
pub(crate) async fn serve(
    listener: TcpListener,
    state: HttpState,
    token: CancellationToken,
) -> io::Result<()> {
    let state = Arc::new(state);
    loop {
        let (stream, _) = tokio::select! {
            _ = token.cancelled() => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // Per-connection failures (e.g. the client reset) are not the server's.
                Err(e) if is_transient(&e) => continue,
                Err(e) => return Err(e),
            },
        };
        let state = state.clone();
        let token = token.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = token.cancelled() => {}
                _ = handle(stream, &state) => {}
            }
        });
    }
}

fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    ) || e.raw_os_error() == Some(24) // EMFILE: wait for the next accept
}

/// Reads one request head, answers it, closes the connection.
async fn handle(mut stream: TcpStream, state: &HttpState) {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(READ_TIMEOUT, async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            if head.len() > MAX_HEAD {
                return false;
            }
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        true
    })
    .await;
    if !matches!(read, Ok(true)) {
        return;
    }
    let (code, body, head_only) = route(&head, state).await;
    let mut response = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        code.0,
        code.reason(),
        if body.starts_with("# HELP") {
            "text/plain; version=0.0.4; charset=utf-8"
        } else {
            "text/plain; charset=utf-8"
        },
        body.len(),
    );
    if !head_only {
        response.push_str(&body);
    }
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// Picks the answer for a request head: (status, body, whether to leave the body out).
async fn route(head: &[u8], state: &HttpState) -> (StatusCode, String, bool) {
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return (StatusCode::BAD_REQUEST, "400 Bad Request".into(), false);
    };
    if !version.starts_with("HTTP/1.") {
        return (StatusCode::BAD_REQUEST, "400 Bad Request".into(), false);
    }
    let head_only = method == "HEAD";
    let path = target.split('?').next().unwrap_or_default();
    match path {
        "/healthz" => {
            let (code, body) = healthz(state).await;
            (code, body, head_only)
        }
        "/metrics" if method == "GET" || head_only => (
            StatusCode::OK,
            render_metrics(&state.driver_name, &state.registrar),
            head_only,
        ),
        "/metrics" => (
            StatusCode::METHOD_NOT_ALLOWED,
            "Method Not Allowed\n".into(),
            false,
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "404 page not found\n".into(),
            head_only,
        ),
    }
}

async fn healthz(state: &HttpState) -> (StatusCode, String) {
    let (code, body) = check(state).await;
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
                other => plugreg_runtime::report::chain(&other),
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
        Ok(Err(status)) => plugreg_runtime::report::grpc(&status),
        Err(_) => format!("rpc error: code = DeadlineExceeded desc = {EXPIRED}"),
    };
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("error getting info from node-registrar socket: {err}"),
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

    #[tokio::test]
    async fn routes_requests_the_go_way() {
        let state = HttpState {
            socket: PathBuf::from("/nonexistent/x-reg.sock"),
            driver_name: "x".into(),
            timeout: Duration::from_millis(100),
            registrar: Registrar::new(PluginInfo::default()),
        };
        let cases: &[(&str, u16, bool)] = &[
            ("GET /healthz HTTP/1.1\r\n\r\n", 404, false),
            ("POST /healthz?x=1 HTTP/1.1\r\n\r\n", 404, false),
            ("GET /metrics HTTP/1.1\r\n\r\n", 200, false),
            ("HEAD /metrics HTTP/1.0\r\n\r\n", 200, true),
            ("POST /metrics HTTP/1.1\r\n\r\n", 405, false),
            ("GET /debug/pprof/ HTTP/1.1\r\n\r\n", 404, false),
            ("garbage\r\n\r\n", 400, false),
            ("GET / SPDY/3\r\n\r\n", 400, false),
        ];
        for (head, code, head_only) in cases {
            let (c, body, h) = route(head.as_bytes(), &state).await;
            assert_eq!((c.0, h), (*code, *head_only), "{head:?}: {body}");
        }
        let (_, body, _) = route(b"GET /healthz HTTP/1.1\r\n\r\n", &state).await;
        assert_eq!(body, "registration socket does not exist");
    }
}
