//! A small HTTP/1 server for diagnostics (`/healthz`, `/metrics`, ...): hyper, one request per
//! connection, with the bounds an endpoint on the network needs. Its first duty is that a health
//! probe is answered at once, whatever other clients do: connect and send nothing, trickle
//! their request a byte at a time (slow-loris), or never read the answer.
//!
//! - Every connection is accepted at once (the listen backlog is [`LISTEN_BACKLOG`]), up to
//!   [`MAX_CONNECTIONS`] open (or half the
//!   open-file limit, which [`serve`] first raises to its hard limit, as Go's runtime does at
//!   start): nothing waits in the kernel's backlog while there is room.
//! - Until its request head is complete a connection costs no hyper state: an idle one only
//!   its socket and a small task, one sending its head a buffer the size of what it sent.
//!   At most [`MAX_ANSWERING`] connections are answered by hyper at once (buffers of about
//!   10 KiB each); others with a complete head wait for one of them, or take the place of one
//!   that is only writing out its answer.
//! - The whole head must arrive within [`HEADER_READ_TIMEOUT`] of the connect, and be at most
//!   [`MAX_HEAD`] bytes (longer gets 431 and a close).
//! - When every place is taken, a new client evicts the oldest connection that has no
//!   complete head yet or is only writing out its answer. Connections whose handler runs are
//!   kept (they are bounded by the handler's own limit); only when all are of that kind do new
//!   clients wait in the backlog.
//! - The handler and the writing of the answer are bounded in time, so a client that never
//!   reads frees its place.
//! - Failed accepts back off (EMFILE would otherwise fail again at once, forever); when out of
//!   file descriptors, an evictable connection gives its descriptor back first.
//!
//! [`SharedCheck`] lets concurrent `/healthz` callers share one check in flight, so a burst of
//! probes costs the driver one call, not one each.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

pub use hyper::body::Incoming;
pub use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use plugreg_runtime::Backoff;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Most connections open at once (fewer when the open-file limit is low: see [`serve`]). An
/// idle connection costs well under 1 KiB, so room for many keeps a probe from ever waiting.
pub const MAX_CONNECTIONS: usize = 1024;
/// Connections hyper answers at once (each costs about 10 KiB of buffers while it is answered,
/// which the allocator keeps afterwards); more with a complete head wait for a worker, or take
/// the worker of one that is only writing out its answer.
pub const MAX_ANSWERING: usize = 16;
/// Longest request head (request line and headers) accepted; longer gets 431 and a close.
pub const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take, from its connect, to send its whole request head.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for writing a response, on top of the handler's own limit: bounds a connection whose
/// client never reads.
const WRITE_SLACK: Duration = Duration::from_secs(5);
/// The head buffer grows by this much at a time: a probe's head fits in one step.
const HEAD_STEP: usize = 512;
/// Most header lines looked at when checking that a head is complete (hyper's own limit).
const MAX_HEADERS: usize = 100;
/// Waits after failed accepts (EMFILE and friends): 5 ms doubling to 1 s, as Go's `net/http`.
const ACCEPT_BACKOFF: Backoff = plugreg_runtime::accept::BACKOFF;

/// Go's 404 body.
pub const NOT_FOUND_BODY: &str = "404 page not found\n";

/// Connections the kernel queues for the server to accept (capped by `net.core.somaxconn`).
/// The server accepts at once while it has room, so the queue only fills while every
/// connection's handler runs; the standard library's 128 would then refuse new clients early.
pub const LISTEN_BACKLOG: u32 = 1024;

/// Binds the listener for a Go-style address: `:9809` (all interfaces), `host:port`,
/// `[::1]:9809`, with a backlog of [`LISTEN_BACKLOG`].
pub async fn bind(endpoint: &str) -> io::Result<TcpListener> {
    if let Some(port) = endpoint.strip_prefix(':') {
        // Go's ":port" listens on every interface, IPv6 and IPv4; fall back to IPv4 only on
        // hosts without IPv6.
        let port: u16 = port
            .parse()
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "invalid port"))?;
        return match listen(SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port))) {
            Ok(l) => Ok(l),
            Err(_) => listen(SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, port))),
        };
    }
    let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to listen on");
    for addr in tokio::net::lookup_host(endpoint).await? {
        match listen(addr) {
            Ok(l) => return Ok(l),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Listens on `addr` with a backlog of [`LISTEN_BACKLOG`] (and `SO_REUSEADDR`, as the standard
/// library sets it).
pub fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
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

/// The bounds of one server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most connections open at once (at least 1; also at most half the open-file limit).
    pub max_connections: usize,
    /// How long a handler may take; writing the answer may then take 5 s more.
    pub handler_limit: Duration,
}

impl Limits {
    /// [`MAX_CONNECTIONS`] connections, handlers bounded by `handler_limit`.
    pub fn new(handler_limit: Duration) -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            handler_limit,
        }
    }
}

/// Serves connections from `listener` with `handler` until `token` is cancelled, with
/// [`Limits::new`]`(handler_limit)`. See [`serve_with`].
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
    serve_with(listener, handler, Limits::new(handler_limit), token).await
}

/// Serves connections from `listener` with `handler` until `token` is cancelled, within
/// `limits`. Raises the process's soft open-file limit to its hard limit first (as Go's
/// runtime does at start), and keeps at most half of it for connections, so that a crowd of
/// clients cannot take the descriptors the rest of the program needs. Fails only on an accept
/// error that is neither a client's nor a passing shortage.
pub async fn serve_with<H, F>(
    listener: TcpListener,
    handler: H,
    limits: Limits,
    token: CancellationToken,
) -> io::Result<()>
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<String>> + Send + 'static,
{
    let open_files = raise_open_file_limit();
    let cap = limits
        .max_connections
        .min(usize::try_from(open_files / 2).unwrap_or(usize::MAX))
        .max(1);
    let table = Arc::new(Table::new(cap));
    let mut failures = 0;
    loop {
        // Room first: at the cap with nothing evictable, clients wait in the backlog.
        tokio::select! {
            _ = token.cancelled() => return Ok(()),
            _ = table.room() => {}
        }
        let accepted = tokio::select! {
            _ = token.cancelled() => return Ok(()),
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                failures = 0;
                table.make_room();
                let entry = table.open(token.child_token());
                let handler = handler.clone();
                let span = tracing::trace_span!("http connection");
                tokio::spawn(
                    connection(stream, handler, limits.handler_limit, entry).instrument(span),
                );
            }
            // The client gave up before we accepted: not the server's problem.
            Err(e) if is_client_error(&e) => {}
            Err(e) if plugreg_runtime::accept::is_shortage(&e) => {
                // Out of descriptors: an evictable connection gives its own back first.
                if let Some(seq) = table.evict(evictable) {
                    tokio::select! {
                        _ = token.cancelled() => return Ok(()),
                        _ = table.closed(seq) => {}
                    }
                    continue;
                }
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
    // accept(2) on Linux hands a pending network error of the new connection back as its own;
    // for TCP/IP the man page lists these, to be treated "like EAGAIN by retrying" (ETIMEDOUT
    // and EPERM, a firewall's refusal, likewise concern only that connection).
    const NETWORK: [i32; 10] = [
        1,   // EPERM
        64,  // ENONET
        71,  // EPROTO
        92,  // ENOPROTOOPT
        95,  // EOPNOTSUPP
        100, // ENETDOWN
        101, // ENETUNREACH
        110, // ETIMEDOUT
        112, // EHOSTDOWN
        113, // EHOSTUNREACH
    ];
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    ) || e.raw_os_error().is_some_and(|c| NETWORK.contains(&c))
}

/// Raises the soft limit on open files to the hard limit (Go's runtime does the same at start,
/// so the Go originals run with it) and returns the soft limit now in force.
pub fn raise_open_file_limit() -> u64 {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    // No limit reads as `None`; the kernel's own ceiling (fs.nr_open) is 1,048,576 by default.
    let unlimited = 1 << 20;
    let current = limit.current.unwrap_or(unlimited);
    match limit.maximum {
        Some(max) if max > current => {
            let raised = Rlimit {
                current: Some(max),
                maximum: Some(max),
            };
            match setrlimit(Resource::Nofile, raised) {
                Ok(()) => max,
                Err(_) => current,
            }
        }
        _ => current,
    }
}

/// The open connections of one server, oldest first, and the workers answering them.
#[derive(Debug)]
struct Table {
    cap: usize,
    conns: Mutex<Conns>,
    /// Signalled on every change of `conns` (waiters check their condition again).
    changed: Notify,
    /// One per connection hyper is answering.
    workers: Arc<Semaphore>,
}

#[derive(Debug, Default)]
struct Conns {
    next: u64,
    open: BTreeMap<u64, Entry>,
    /// Of `open`, how many were evicted and are closing.
    evicted: usize,
}

/// Where a connection stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No complete head yet, or waiting for a worker: no work done, may be evicted.
    Waiting,
    /// The handler runs: kept (the handler's limit bounds it).
    Answering,
    /// Only writing out the answer: may be evicted, and its worker taken.
    Writing,
}

#[derive(Debug)]
struct Entry {
    phase: Phase,
    evicted: bool,
    close: CancellationToken,
}

impl Conns {
    fn live(&self) -> usize {
        self.open.len() - self.evicted
    }

    fn oldest(&self, wanted: impl Fn(Phase) -> bool) -> Option<u64> {
        self.open
            .iter()
            .find(|(_, e)| !e.evicted && wanted(e.phase))
            .map(|(seq, _)| *seq)
    }
}

fn evictable(phase: Phase) -> bool {
    phase != Phase::Answering
}

impl Table {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            conns: Mutex::new(Conns::default()),
            changed: Notify::new(),
            workers: Arc::new(Semaphore::new(MAX_ANSWERING)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `ready` holds for the connections.
    async fn wait_until(&self, ready: impl Fn(&Conns) -> bool) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if ready(&self.lock()) {
                return;
            }
            changed.await;
        }
    }

    /// Waits until a new connection can be taken: below the cap, or one can be evicted.
    async fn room(&self) {
        self.wait_until(|c| c.live() < self.cap || c.oldest(evictable).is_some())
            .await;
    }

    /// At the cap, evicts the oldest evictable connection to make room for one more.
    fn make_room(&self) {
        if self.lock().live() >= self.cap {
            let _ = self.evict(evictable);
        }
    }

    /// Closes the oldest connection whose phase is `wanted` and names it; `None` when there is
    /// none.
    fn evict(&self, wanted: impl Fn(Phase) -> bool) -> Option<u64> {
        let mut conns = self.lock();
        let seq = conns.oldest(wanted)?;
        conns.evicted += 1;
        let entry = conns.open.get_mut(&seq).expect("found above");
        entry.evicted = true;
        entry.close.cancel();
        tracing::trace!("HTTP connection evicted for a newer one");
        Some(seq)
    }

    /// Waits until connection `seq` has closed (its descriptor and worker are given back).
    async fn closed(&self, seq: u64) {
        self.wait_until(|c| !c.open.contains_key(&seq)).await;
    }

    fn open(self: &Arc<Self>, close: CancellationToken) -> Open {
        let mut conns = self.lock();
        let seq = conns.next;
        conns.next += 1;
        conns.open.insert(
            seq,
            Entry {
                phase: Phase::Waiting,
                evicted: false,
                close: close.clone(),
            },
        );
        Open {
            table: self.clone(),
            seq,
            close,
        }
    }
}

/// One open connection's place in its [`Table`]; dropping it gives the place back.
#[derive(Debug)]
struct Open {
    table: Arc<Table>,
    seq: u64,
    close: CancellationToken,
}

impl Open {
    fn set_phase(&self, phase: Phase) {
        if let Some(e) = self.table.lock().open.get_mut(&self.seq) {
            e.phase = phase;
        }
        self.table.changed.notify_waiters();
    }

    /// A worker to answer with: a free one, else the one of the oldest connection that is only
    /// writing out its answer, else the first to come free.
    async fn worker(&self) -> OwnedSemaphorePermit {
        let table = &self.table;
        loop {
            if let Ok(worker) = table.workers.clone().try_acquire_owned() {
                return worker;
            }
            if let Some(seq) = table.evict(|phase| phase == Phase::Writing) {
                table.closed(seq).await;
                continue;
            }
            let writing = |c: &Conns| c.oldest(|phase| phase == Phase::Writing).is_some();
            tokio::select! {
                worker = table.workers.clone().acquire_owned() => {
                    return worker.expect("the semaphore is never closed");
                }
                _ = table.wait_until(writing) => {}
            }
        }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        let mut conns = self.table.lock();
        if conns.open.remove(&self.seq).is_some_and(|e| e.evicted) {
            conns.evicted -= 1;
        }
        drop(conns);
        self.table.changed.notify_waiters();
    }
}

/// Serves one accepted connection until it is done, timed out or evicted. The stream and the
/// worker are dropped before `place`, so an eviction has given them back when it is reported.
async fn connection<H, F>(stream: TcpStream, handler: H, handler_limit: Duration, place: Open)
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<String>> + Send + 'static,
{
    let place = Arc::new(place);
    let close = place.close.clone();
    let head_deadline = Instant::now() + HEADER_READ_TIMEOUT;
    let served = {
        let place = place.clone();
        async move {
            // An idle client costs no buffer: wait for its first byte without one.
            if tokio::time::timeout_at(head_deadline, stream.readable())
                .await
                .is_err()
            {
                return;
            }
            serve_io(stream, handler, handler_limit, head_deadline, Some(place)).await;
        }
    };
    tokio::select! {
        _ = close.cancelled() => {}
        _ = served => {}
    }
}

/// Serves one HTTP/1 connection (one request; the connection closes after the answer) with the
/// head-size and head-timeout limits, the whole of it bounded in time.
pub async fn serve_connection<I, H, F>(io: I, handler: H, handler_limit: Duration)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<String>> + Send + 'static,
{
    let head_deadline = Instant::now() + HEADER_READ_TIMEOUT;
    serve_io(io, handler, handler_limit, head_deadline, None).await;
}

/// Reads the request head by `head_deadline`, then (with a worker of `place`'s server) lets
/// hyper answer it within the handler's limit and the write allowance, keeping `place`'s phase.
async fn serve_io<I, H, F>(
    mut io: I,
    handler: H,
    handler_limit: Duration,
    head_deadline: Instant,
    place: Option<Arc<Open>>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<String>> + Send + 'static,
{
    let head = match read_head(&mut io, head_deadline).await {
        Head::Complete(head) => head,
        Head::TooLarge => {
            let refusal = "HTTP/1.1 431 Request Header Fields Too Large\r\n\
                           connection: close\r\ncontent-length: 0\r\n\r\n";
            let write = io.write_all(refusal.as_bytes());
            let _ = tokio::time::timeout(WRITE_SLACK, write).await;
            let _ = tokio::time::timeout(WRITE_SLACK, io.shutdown()).await;
            return;
        }
        Head::Gone => return,
    };
    let _worker = match &place {
        Some(place) => {
            let worker = place.worker().await;
            place.set_phase(Phase::Answering);
            Some(worker)
        }
        None => None,
    };
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let answer = handler(request);
        let place = place.clone();
        async move {
            let response = answer.await;
            if let Some(place) = place {
                place.set_phase(Phase::Writing);
            }
            Ok::<_, Infallible>(response)
        }
    });
    // Boxed: hyper's connection state is several KiB, and held inline it would size the task
    // of every connection, also those still waiting for (or never sending) their head.
    let connection = Box::pin(
        hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .max_buf_size(MAX_HEAD)
            .keep_alive(false)
            // A client that shuts its sending side after the request still gets the answer.
            .half_close(true)
            .serve_connection(TokioIo::new(Prefixed::new(head, io)), service),
    );
    match tokio::time::timeout(handler_limit + WRITE_SLACK, connection).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::trace!(err = %e, "HTTP connection ended with an error"),
        Err(_) => tracing::trace!("HTTP connection took too long; closed"),
    }
}

/// How reading a request head ended.
enum Head {
    /// The head is complete (or malformed beyond doubt, for hyper to answer): these bytes.
    Complete(Vec<u8>),
    /// No end of head within [`MAX_HEAD`] bytes.
    TooLarge,
    /// The client closed, failed, or was too slow.
    Gone,
}

/// Reads until the buffer holds a whole request head, growing the buffer only as bytes come.
async fn read_head<I: AsyncRead + Unpin>(io: &mut I, deadline: Instant) -> Head {
    let mut head = Vec::new();
    loop {
        if head.len() >= MAX_HEAD {
            return Head::TooLarge;
        }
        head.reserve(HEAD_STEP.min(MAX_HEAD - head.len()));
        match tokio::time::timeout_at(deadline, io.read_buf(&mut head)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Head::Gone,
            Ok(Ok(_)) => {}
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        match httparse::Request::new(&mut headers).parse(&head) {
            Ok(httparse::Status::Partial) => {}
            // Complete, or an error hyper reports to the client itself (400, 431).
            Ok(httparse::Status::Complete(_)) | Err(_) => return Head::Complete(head),
        }
    }
}

/// A connection whose first bytes were already read: they are read again first.
struct Prefixed<I> {
    head: Vec<u8>,
    read: usize,
    io: I,
}

impl<I> Prefixed<I> {
    fn new(head: Vec<u8>, io: I) -> Self {
        Self { head, read: 0, io }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Prefixed<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.read < this.head.len() {
            let rest = &this.head[this.read..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.read += n;
            if this.read == this.head.len() {
                this.head = Vec::new();
                this.read = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Prefixed<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
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
                    tokio::spawn(
                        async move {
                            let _ = tx.send(Some(check.await));
                        }
                        .instrument(tracing::trace_span!("shared check")),
                    );
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

    /// A connection's own network error from accept(2) is the client's, not the server's
    /// (the server keeps accepting); a shortage or anything else is not.
    #[test]
    fn accept_errors_of_one_connection_are_the_clients() {
        for code in [1, 64, 71, 92, 95, 100, 101, 110, 112, 113] {
            assert!(
                is_client_error(&io::Error::from_raw_os_error(code)),
                "{code}"
            );
        }
        assert!(is_client_error(&io::Error::from(
            io::ErrorKind::ConnectionAborted
        )));
        assert!(!is_client_error(&io::Error::from_raw_os_error(24))); // EMFILE
        assert!(!is_client_error(&io::Error::from_raw_os_error(9))); // EBADF
    }
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
