//! A small HTTP/1 server for a sidecar's diagnostics (`/healthz`, `/metrics`): hyper, one
//! request per connection, with the bounds an endpoint on the network needs: at most
//! [`MAX_CONNECTIONS`] connections at once (the rest wait in the kernel's backlog), a request
//! head of at most [`MAX_HEAD`] bytes read within [`HEADER_READ_TIMEOUT`], a time limit on each
//! whole connection, and a back-off on accept errors such as EMFILE (which would otherwise fail
//! again at once, forever). [`SharedCheck`] lets concurrent `/healthz` callers share one check
//! in flight, so a burst of probes costs the driver one call, not one each.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use plugreg_runtime::Backoff;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;

/// Connections served at once; further clients wait in the listen backlog. Probes and scrapes
/// need few; each connection costs about 10 KiB, and 64 at once took a sidecar over 5 MiB.
pub const MAX_CONNECTIONS: usize = 16;
/// Longest request head (request line and headers) accepted; longer gets 431 and a close.
pub const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take to send its request head.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for writing a response, on top of the head timeout and the handler's own limit:
/// bounds a connection whose client never reads.
const WRITE_SLACK: Duration = Duration::from_secs(5);
/// Waits after failed accepts (EMFILE and friends): 5 ms doubling to 1 s, as Go's `net/http`.
const ACCEPT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(5), Duration::from_secs(1));

/// Go's 404 body.
pub const NOT_FOUND_BODY: &str = "404 page not found\n";

/// Binds the listener for a Go-style address: `:9809` (all interfaces), `host:port`,
/// `[::1]:9809`.
pub async fn bind(endpoint: &str) -> io::Result<TcpListener> {
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

/// The address a listener actually got (for logs and callers using port 0).
pub fn local_addr(listener: &TcpListener) -> Option<SocketAddr> {
    listener.local_addr().ok()
}

/// A response with `code`, `body` and a `text/plain` content type (Prometheus' text-format
/// version when the body is an exposition, as Go's sniffing and promhttp give).
pub fn text_response(code: StatusCode, body: String) -> Response<String> {
    let content_type = if body.starts_with("# HELP") {
        "text/plain; version=0.0.4; charset=utf-8"
    } else {
        "text/plain; charset=utf-8"
    };
    let mut response = Response::new(body);
    *response.status_mut() = code;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response
}

/// Serves connections from `listener` with `handler` until `token` is cancelled; each whole
/// connection may take `handler_limit` on top of the head timeout and a write allowance. Fails
/// only on an accept error that is neither a client's nor a passing shortage.
pub async fn serve<H, F>(
    listener: TcpListener,
    handler: H,
    handler_limit: Duration,
    token: CancellationToken,
) -> io::Result<()>
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<String>> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut failures = 0;
    loop {
        // A free slot first: at the cap, clients wait in the backlog, not in our memory.
        let slot = tokio::select! {
            _ = token.cancelled() => return Ok(()),
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
        };
        let accepted = tokio::select! {
            _ = token.cancelled() => return Ok(()),
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                failures = 0;
                let handler = handler.clone();
                let token = token.clone();
                tokio::spawn(async move {
                    let _slot = slot;
                    tokio::select! {
                        _ = token.cancelled() => {}
                        _ = serve_connection(stream, handler, handler_limit) => {}
                    }
                });
            }
            // The client gave up before we accepted: not the server's problem.
            Err(e) if is_client_error(&e) => {}
            Err(e) if is_shortage(&e) => {
                failures += 1;
                let wait = ACCEPT_BACKOFF.delay(failures);
                tracing::warn!(err = %e, retryIn = ?wait, "HTTP accept failed; retrying");
                tokio::select! {
                    _ = token.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            Err(e) => return Err(e),
        }
    }
}

fn is_client_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

/// Out of file descriptors (EMFILE, ENFILE) or kernel memory (ENOBUFS, ENOMEM): it passes, but
/// retrying at once fails again at once.
fn is_shortage(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(24 | 23 | 105 | 12))
}

/// Serves one HTTP/1 connection (one request; the connection closes after the answer) with the
/// head-size and head-timeout limits, the whole of it bounded in time.
pub async fn serve_connection<I, H, F>(io: I, handler: H, handler_limit: Duration)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<String>> + Send + 'static,
{
    let limit = HEADER_READ_TIMEOUT + handler_limit + WRITE_SLACK;
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let answer = handler(request);
        async move { Ok::<_, Infallible>(answer.await) }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HEAD)
        .keep_alive(false)
        // A client that shuts its sending side after the request still gets the answer.
        .half_close(true)
        .serve_connection(TokioIo::new(io), service);
    match tokio::time::timeout(limit, connection).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::trace!(err = %e, "HTTP connection ended with an error"),
        Err(_) => tracing::trace!("HTTP connection took too long; closed"),
    }
}

/// One check in flight, shared by its concurrent callers: a caller that arrives while a check
/// runs waits for that check's verdict instead of starting another.
#[derive(Debug)]
pub struct SharedCheck<V> {
    in_flight: Mutex<Option<watch::Receiver<Option<V>>>>,
}

impl<V> Default for SharedCheck<V> {
    fn default() -> Self {
        Self {
            in_flight: Mutex::new(None),
        }
    }
}

impl<V: Clone + Send + Sync + 'static> SharedCheck<V> {
    /// The verdict of the check in flight, or of a new one made by `start` if none is. The
    /// check runs in its own task, so it completes (within its own limit) even if every caller
    /// hangs up, and the next caller starts afresh. `None` if the check's task died (a panic).
    pub async fn run<F, Fut>(&self, start: F) -> Option<V>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = V> + Send + 'static,
    {
        let mut verdict = {
            let mut slot = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            // Join a check only while it runs: not one that finished, nor one whose task is gone.
            let running = |rx: &&watch::Receiver<Option<V>>| {
                rx.borrow().is_none() && rx.has_changed().is_ok()
            };
            match slot.as_ref().filter(running) {
                Some(rx) => rx.clone(),
                None => {
                    let (tx, rx) = watch::channel(None);
                    *slot = Some(rx.clone());
                    let check = start();
                    tokio::spawn(async move {
                        let _ = tx.send(Some(check.await));
                    });
                    rx
                }
            }
        };
        match verdict.wait_for(Option::is_some).await {
            Ok(v) => v.clone(),
            Err(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn concurrent_callers_share_one_check() {
        let shared = Arc::new(SharedCheck::<u32>::default());
        let started = Arc::new(AtomicUsize::new(0));
        let arrived = Arc::new(AtomicUsize::new(0));
        let (release, released) = watch::channel(false);
        let mut callers = Vec::new();
        for _ in 0..8 {
            let shared = shared.clone();
            let started = started.clone();
            let arrived = arrived.clone();
            let mut released = released.clone();
            callers.push(tokio::spawn(async move {
                // Single-threaded test runtime: `run` is polled right after this, in the same
                // poll, so by the time the test sees 8 arrivals all 8 have joined or started.
                arrived.fetch_add(1, Ordering::SeqCst);
                shared
                    .run(|| {
                        let n = started.fetch_add(1, Ordering::SeqCst) as u32;
                        async move {
                            let _ = released.wait_for(|r| *r).await;
                            n
                        }
                    })
                    .await
            }));
        }
        // Every caller is waiting on the one check before it is released.
        while arrived.load(Ordering::SeqCst) < 8 {
            tokio::task::yield_now().await;
        }
        release.send(true).unwrap();
        for c in callers {
            assert_eq!(c.await.unwrap(), Some(0));
        }
        assert_eq!(started.load(Ordering::SeqCst), 1);
        // A later caller starts a new check.
        let again = shared.run(|| async { 7 }).await;
        assert_eq!(again, Some(7));
    }

    #[tokio::test]
    async fn a_dead_check_gives_none_and_the_next_starts_afresh() {
        let shared = SharedCheck::<u32>::default();
        let got = shared
            .run(|| async {
                panic!("check failed hard");
            })
            .await;
        assert_eq!(got, None);
        assert_eq!(shared.run(|| async { 1 }).await, Some(1));
    }
}
