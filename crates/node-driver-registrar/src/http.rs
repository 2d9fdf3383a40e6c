//! The diagnostics HTTP server: `/healthz` with upstream's codes and bodies, bounded by
//! `--timeout` as a whole (R4), and `/metrics` in the Prometheus text format.
//!
//! The server is `plugreg_sidecar_kit::http` (shared with livenessprobe, csi-provisioner and
//! `plugreg manager`): hyper's HTTP/1, one request per connection, with the bounds an endpoint
//! on the network needs (D7): up to [`MAX_CONNECTIONS`] connections open, idle ones nearly free
//! and evicted oldest first when a new client needs the room, a request head of at most
//! [`MAX_HEAD`] bytes within [`HEADER_READ_TIMEOUT`], each answer bounded in time, and a
//! back-off on accept errors such as EMFILE. Concurrent `/healthz` callers share one check
//! in flight, so a burst of probes costs one GetInfo self-call, not one each.

use std::fmt::Write as _;
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use plugreg_proto::pluginregistration::InfoRequest;
use plugreg_proto::pluginregistration::registration_client::RegistrationClient;
use plugreg_registrar::Registrar;
use plugreg_sidecar_kit::http::{NOT_FOUND_BODY, SharedCheck, text_response};
use plugreg_transport::PathKind;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::logging::V4;

pub use plugreg_sidecar_kit::http::{HEADER_READ_TIMEOUT, MAX_CONNECTIONS, MAX_HEAD};
pub(crate) use plugreg_sidecar_kit::http::{bind, local_addr};

/// A finished health check: status code and body.
type Verdict = (StatusCode, String);

/// What the handlers need, and the health check in flight.
#[derive(Debug)]
pub struct Diagnostics {
    socket: PathBuf,
    driver_name: String,
    timeout: Duration,
    registrar: Registrar,
    /// The check in flight, if any: later callers wait for its verdict instead of starting one.
    in_flight: SharedCheck<Verdict>,
}

impl Diagnostics {
    /// The handlers for the registration socket `socket` of `driver_name`, served by
    /// `registrar`; each `/healthz` check takes at most `timeout`.
    pub fn new(
        socket: PathBuf,
        driver_name: String,
        timeout: Duration,
        registrar: Registrar,
    ) -> Arc<Self> {
        Arc::new(Self {
            socket,
            driver_name,
            timeout,
            registrar,
            in_flight: SharedCheck::default(),
        })
    }
}

/// Serves `/healthz`, `/metrics` and Go's 404 for anything else on `listener` until `token` is
/// cancelled. Fails only on an accept error that is neither a client's nor a passing shortage.
pub(crate) async fn serve(
    listener: TcpListener,
    diagnostics: Arc<Diagnostics>,
    token: CancellationToken,
) -> io::Result<()> {
    let limit = diagnostics.timeout;
    plugreg_sidecar_kit::http::serve(listener, handler(diagnostics), limit, token).await
}

/// Serves one HTTP/1 connection (one request; the connection closes after the answer) with the
/// head-size and head-timeout limits, the whole of it bounded in time.
pub async fn serve_connection<I>(io: I, diagnostics: Arc<Diagnostics>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let limit = diagnostics.timeout;
    plugreg_sidecar_kit::http::serve_connection(io, handler(diagnostics), limit).await;
}

fn handler(
    diagnostics: Arc<Diagnostics>,
) -> impl Fn(Request<Incoming>) -> std::pin::Pin<Box<dyn Future<Output = Response<String>> + Send>>
+ Clone
+ Send
+ Sync
+ 'static {
    move |request| {
        let diagnostics = diagnostics.clone();
        Box::pin(async move { respond(&diagnostics, &request).await })
    }
}

/// The answer to one request: `/healthz` (any method), `/metrics` (GET, HEAD), 404 otherwise.
async fn respond(diagnostics: &Arc<Diagnostics>, request: &Request<Incoming>) -> Response<String> {
    let method = request.method();
    let (code, body) = match request.uri().path() {
        "/healthz" => healthz(diagnostics).await,
        "/metrics" if method == Method::GET || method == Method::HEAD => (
            StatusCode::OK,
            render_metrics(&diagnostics.driver_name, &diagnostics.registrar),
        ),
        "/metrics" => (
            StatusCode::METHOD_NOT_ALLOWED,
            "Method Not Allowed\n".into(),
        ),
        _ => (StatusCode::NOT_FOUND, NOT_FOUND_BODY.into()),
    };
    text_response(code, body)
}

/// The verdict of the check in flight, or of a new one if none is.
async fn healthz(diagnostics: &Arc<Diagnostics>) -> Verdict {
    let check = || {
        let diagnostics = diagnostics.clone();
        async move {
            let (code, body) = check(&diagnostics).await;
            if code == StatusCode::OK {
                tracing::trace!("Health check succeeded");
            } else {
                tracing::error!(err = %body, "Health check failed");
            }
            (code, body)
        }
    };
    diagnostics.in_flight.run(check).await.unwrap_or_else(|| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            "health check aborted".into(),
        )
    })
}

/// One health check: the socket must exist and be a socket, and a GetInfo self-call through it
/// must answer this driver's name, all within the timeout.
async fn check(diagnostics: &Diagnostics) -> Verdict {
    let deadline = Instant::now() + diagnostics.timeout;
    let path = &diagnostics.socket;
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
    let mut client = plugreg_transport::client!(RegistrationClient, channel);
    let info = tokio::time::timeout_at(deadline, client.get_info(InfoRequest {})).await;
    let err = match info {
        Ok(Ok(info)) => {
            let name = info.into_inner().name;
            if name == diagnostics.driver_name {
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
    let label = format!(
        "driver_name=\"{}\"",
        plugreg_runtime::prom::escape_label(driver_name)
    );
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
        "Whether the kubelet has confirmed the registration: 1 after NotifyRegistrationStatus(true) (to this instance, or to the one that handed it the socket), 0 before it or after a rejection.",
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
        assert_eq!(
            plugreg_runtime::prom::escape_label("a\"b\\c\n"),
            "a\\\"b\\\\c\\n"
        );
    }

    fn diagnostics() -> Arc<Diagnostics> {
        Diagnostics::new(
            PathBuf::from("/nonexistent/x-reg.sock"),
            "x".into(),
            Duration::from_millis(100),
            Registrar::new(PluginInfo::default()),
        )
    }

    /// Sends `request` over an in-memory connection to the real handler; returns what came back.
    async fn exchange(request: &[u8]) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let served = tokio::spawn(serve_connection(server, diagnostics()));
        client.write_all(request).await.unwrap();
        let mut out = Vec::new();
        client.read_to_end(&mut out).await.unwrap();
        served.await.unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    fn code(response: &str) -> u16 {
        response
            .strip_prefix("HTTP/1.")
            .and_then(|r| r.get(2..5))
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("not a response: {response:?}"))
    }

    #[tokio::test]
    async fn routes_requests_the_go_way() {
        let cases: &[(&str, u16, bool)] = &[
            ("GET /healthz HTTP/1.1\r\n\r\n", 404, true),
            (
                "POST /healthz?x=1 HTTP/1.1\r\ncontent-length: 3\r\n\r\nabc",
                404,
                true,
            ),
            ("GET /metrics HTTP/1.1\r\n\r\n", 200, true),
            ("HEAD /metrics HTTP/1.0\r\n\r\n", 200, false),
            ("POST /metrics HTTP/1.1\r\n\r\n", 405, true),
            ("GET /debug/pprof/ HTTP/1.1\r\n\r\n", 404, true),
            ("garbage\r\n\r\n", 400, false),
            ("GET / SPDY/3\r\n\r\n", 400, false),
        ];
        for (request, want, has_body) in cases {
            let response = exchange(request.as_bytes()).await;
            assert_eq!(code(&response), *want, "{request:?}: {response}");
            let body = response.split_once("\r\n\r\n").unwrap().1;
            assert_eq!(!body.is_empty(), *has_body, "{request:?}: {response}");
        }
        let response = exchange(b"GET /healthz HTTP/1.1\r\n\r\n").await;
        assert!(response.ends_with("\r\n\r\nregistration socket does not exist"));
        assert!(response.to_ascii_lowercase().contains("connection: close"));
    }

    #[tokio::test]
    async fn an_oversized_request_head_is_refused_without_buffering_it() {
        let mut request = b"GET /metrics HTTP/1.1\r\nx: ".to_vec();
        request.resize(MAX_HEAD * 4, b'a');
        let response = exchange(&request).await;
        assert_eq!(code(&response), 431, "{response}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_request_head_is_cut_off() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, server) = tokio::io::duplex(1024);
        let served = tokio::spawn(serve_connection(server, diagnostics()));
        let start = Instant::now();
        client
            .write_all(b"GET /metrics HTTP/1.1\r\nHost:")
            .await
            .unwrap();
        let mut out = Vec::new();
        // The client never finishes its head: the server closes once the head timeout passes.
        client.read_to_end(&mut out).await.unwrap();
        served.await.unwrap();
        assert!(
            start.elapsed() >= HEADER_READ_TIMEOUT,
            "{:?}",
            start.elapsed()
        );
        assert!(!String::from_utf8_lossy(&out).contains(" 200 "), "{out:?}");
    }
}
