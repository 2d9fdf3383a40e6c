//! The diagnostics HTTP server: one HTTP/1 server for
//! `--http-endpoint` (or the deprecated `--metrics-address`) serving
//!
//! - `--metrics-path` (default `/metrics`): [`Metrics::render`] in the Prometheus text format;
//! - `/healthz/leader-election`: [`LeaderHealth::check`], `ok` (200) or `internal server
//!   error: <err>` (500), only when the caller passes a health (upstream: with
//!   `--leader-election` and an address from `--http-endpoint`, not `--metrics-address`);
//! - Go's `404 page not found` for anything else.
//!
//! Routing follows Go's `ServeMux` for the patterns used: exact paths, and a metrics path
//! ending in `/` serves its whole subtree; any method. `/debug/pprof/` (`--enable-pprof`) has
//! no Rust counterpart and is not served.
//!
//! The server is [`crate::http`]: idle connections evicted oldest first when a
//! new client needs the room, a request head of at most 16 KiB read within 5 s, one request
//! per connection, each answer bounded in time, back-off on accept errors.
//!
//! Binding is a step of its own ([`Server::bind`]) so that the binary can turn a bad address
//! into upstream's exit (255, "Failed to start HTTP server at specified address ...") before
//! anything else starts.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::http::{NOT_FOUND_BODY, text_response};
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::flags::ControllerFlags;
use crate::leader::LeaderHealth;
use crate::metrics::Metrics;

/// Where the leader-election health check is served (csi-lib-utils' `HealthCheckerAddress`).
pub const LEADER_HEALTH_PATH: &str = "/healthz/leader-election";
/// The content type of a metrics answer (promhttp's text format).
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// The time one connection may take on top of the head timeout and a write allowance: the
/// handlers are in-memory and need far less.
const HANDLER_LIMIT: Duration = Duration::from_secs(10);

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The address could not be listened on (or the metrics path cannot be served). The text
    /// is upstream's fatal message.
    #[error(
        "Failed to start HTTP server at specified address ({addr:?}) and metrics path ({metrics_path:?}): {source}"
    )]
    Bind {
        /// The address as given.
        addr: String,
        /// The metrics path as given.
        metrics_path: String,
        /// What failed.
        #[source]
        source: io::Error,
    },
    /// Accepting connections failed for good (not a client's error, not a passing shortage).
    #[error("HTTP server at {addr:?} failed: {source}")]
    Serve {
        /// The address as given.
        addr: String,
        /// What failed.
        #[source]
        source: io::Error,
    },
}

/// A bound, not yet serving, diagnostics server.
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    addr: String,
    metrics_path: String,
}

impl Server {
    /// Listens on `addr` (Go syntax: `:8080` is every interface, `host:port`, `[::1]:8080`)
    /// for a server whose metrics live at `metrics_path`, and logs upstream's
    /// `ServeMux listening at "<addr>"`.
    pub async fn bind(addr: &str, metrics_path: &str) -> Result<Self, HttpError> {
        let fail = |source| HttpError::Bind {
            addr: addr.to_owned(),
            metrics_path: metrics_path.to_owned(),
            source,
        };
        if !metrics_path.starts_with('/') {
            // Go's ServeMux refuses (panics on) a pattern that is not a path.
            return Err(fail(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the metrics path must start with '/'",
            )));
        }
        tracing::info!("ServeMux listening at {addr:?}");
        let listener = crate::http::bind(addr).await.map_err(fail)?;
        Ok(Self {
            listener,
            addr: addr.to_owned(),
            metrics_path: metrics_path.to_owned(),
        })
    }

    /// The address actually bound (for `:0`).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        crate::http::local_addr(&self.listener)
    }

    /// Serves until `shutdown` is cancelled. `leader`: the health behind
    /// `/healthz/leader-election`; `None` leaves that path unserved (404).
    pub async fn serve(
        self,
        metrics: Arc<Metrics>,
        leader: Option<LeaderHealth>,
        shutdown: CancellationToken,
    ) -> Result<(), HttpError> {
        let routes = Arc::new(Routes {
            metrics_path: self.metrics_path,
            metrics,
            leader,
        });
        let handler = move |request: Request<Incoming>| {
            let routes = routes.clone();
            async move { routes.respond(request.uri().path()) }
        };
        crate::http::serve(self.listener, handler, HANDLER_LIMIT, shutdown)
            .await
            .map_err(|source| HttpError::Serve {
                addr: self.addr,
                source,
            })
    }
}

/// Binds `addr` and serves until `shutdown` is cancelled (see [`Server`]).
pub async fn serve(
    addr: &str,
    metrics_path: &str,
    metrics: Arc<Metrics>,
    leader: Option<LeaderHealth>,
    shutdown: CancellationToken,
) -> Result<(), HttpError> {
    Server::bind(addr, metrics_path)
        .await?
        .serve(metrics, leader, shutdown)
        .await
}

/// Binds and serves the address the controller flags ask for, if any (`--http-endpoint`, else
/// `--metrics-address`; the caller has refused both at once with
/// [`ControllerFlags::http_address`]), regardless of leadership. Serves `--metrics-path` and,
/// when [`ControllerFlags::serves_leader_health`], `/healthz/leader-election` from `health`.
/// Returns the token that stops it; a bind failure is upstream's fatal error (exit 255).
pub async fn spawn(
    flags: &ControllerFlags,
    metrics: Arc<Metrics>,
    health: &LeaderHealth,
) -> Result<Option<CancellationToken>, HttpError> {
    let address = flags.http_address().unwrap_or(&flags.http_endpoint);
    if address.is_empty() {
        return Ok(None);
    }
    let server = Server::bind(address, &flags.metrics_path).await?;
    let leader = flags.serves_leader_health().then(|| health.clone());
    let token = CancellationToken::new();
    let stop = token.clone();
    tokio::spawn(async move {
        if let Err(e) = server.serve(metrics, leader, stop).await {
            tracing::error!("{e}");
        }
    });
    Ok(Some(token))
}

/// What is served where.
struct Routes {
    metrics_path: String,
    metrics: Arc<Metrics>,
    leader: Option<LeaderHealth>,
}

impl Routes {
    fn respond(&self, path: &str) -> Response<String> {
        // The more specific pattern first, as ServeMux picks the longest match.
        if path == LEADER_HEALTH_PATH
            && let Some(health) = &self.leader
        {
            return match health.check() {
                Ok(()) => text_response(StatusCode::OK, "ok".to_owned()),
                Err(e) => go_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("internal server error: {e}\n"),
                ),
            };
        }
        if self.serves_metrics(path) {
            let mut response = Response::new(self.metrics.render());
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(METRICS_CONTENT_TYPE),
            );
            return response;
        }
        go_error(StatusCode::NOT_FOUND, NOT_FOUND_BODY.to_owned())
    }

    fn serves_metrics(&self, path: &str) -> bool {
        let pattern = self.metrics_path.as_str();
        path == pattern || (pattern.ends_with('/') && path.starts_with(pattern))
    }
}

/// Go's `http.Error`: text, and `X-Content-Type-Options: nosniff`.
fn go_error(code: StatusCode, body: String) -> Response<String> {
    let mut response = text_response(code, body);
    response.headers_mut().insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::time::Instant;

    /// A leader's health gone bad answers 500 with upstream's text, over real TCP.
    #[tokio::test]
    async fn a_leader_that_stopped_renewing_is_unhealthy() {
        let health = LeaderHealth::new();
        health.configure("", Duration::ZERO);
        let server = Server::bind("127.0.0.1:0", "/metrics").await.unwrap();
        let addr = server.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(server.serve(
            Arc::new(Metrics::new("d")),
            Some(health.clone()),
            shutdown.clone(),
        ));
        let get = || async {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /healthz/leader-election HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };

        health.observe(true, Instant::now());
        let ok = get().await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.ends_with("\r\n\r\nok"), "{ok}");

        let long_ago = Instant::now()
            .checked_sub(HEALTH_TOLERANCE_PLUS)
            .expect("a monotonic clock that old");
        health.observe(true, long_ago);
        let bad = get().await;
        assert!(
            bad.starts_with("HTTP/1.1 500 Internal Server Error\r\n"),
            "{bad}"
        );
        assert!(bad.contains("x-content-type-options: nosniff\r\n"), "{bad}");
        assert!(
            bad.ends_with(
                "\r\n\r\ninternal server error: failed election to renew leadership on lease \n"
            ),
            "{bad}"
        );
        shutdown.cancel();
        task.await.unwrap().unwrap();
    }

    const HEALTH_TOLERANCE_PLUS: Duration =
        Duration::from_secs(crate::leader::HEALTH_TOLERANCE.as_secs() + 1);
}
