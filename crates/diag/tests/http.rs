//! The diagnostics server on real TCP connections (loopback): a probe is answered whatever
//! other clients do (issue 17, finding 1).

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use plugreg_diag::http::{
    HEADER_READ_TIMEOUT, Incoming, Limits, Request, Response, StatusCode, serve_connection,
    serve_with, text_response,
};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

const SECS10: Duration = Duration::from_secs(10);

/// Serves `handler` on a free loopback port with at most `max_connections`.
async fn start<H, F>(handler: H, max_connections: usize) -> (SocketAddr, CancellationToken)
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = Response<String>> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let token = CancellationToken::new();
    let limits = Limits {
        max_connections,
        handler_limit: SECS10,
    };
    tokio::spawn(serve_with(listener, handler, limits, token.clone()));
    (addr, token)
}

async fn ok(_: Request<Incoming>) -> Response<String> {
    text_response(StatusCode::OK, "ok".into())
}

/// One GET on a fresh connection; the whole response, or the error that ended the wait.
fn get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(SECS10))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: t\r\n\r\n")?;
    let mut response = String::new();
    s.read_to_string(&mut response)?;
    Ok(response)
}

async fn get_async(addr: SocketAddr, path: &'static str) -> std::io::Result<String> {
    tokio::task::spawn_blocking(move || get(addr, path))
        .await
        .unwrap()
}

/// A blocking client connection with a small receive buffer, so that an answer of a few MiB
/// it does not read fills the buffers on both sides.
async fn slow_reader(addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let stream = socket.connect(addr).await.unwrap().into_std().unwrap();
    stream.set_nonblocking(false).unwrap();
    stream
}

/// A handler answering `/big` with [`BIG`] bytes, anything else with "ok".
fn big_or_ok() -> impl Fn(
    Request<Incoming>,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Response<String>> + Send>,
> + Clone
+ Send
+ Sync
+ 'static {
    |request: Request<Incoming>| {
        Box::pin(async move {
            match request.uri().path() {
                "/big" => text_response(StatusCode::OK, "x".repeat(BIG)),
                _ => text_response(StatusCode::OK, "ok".into()),
            }
        })
    }
}

/// More than the loopback buffers hold (4 MiB to send, a few KiB to receive).
const BIG: usize = 8 << 20;

/// Sends a request for `/big` and reads the start of the answer: the rest is stuck.
fn start_big_answer(reader: &mut TcpStream) {
    reader
        .write_all(b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n")
        .unwrap();
    reader.set_read_timeout(Some(SECS10)).unwrap();
    let mut first = [0u8; 12];
    reader.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
}

/// Whether the answer on `reader` ends before all of it came.
fn cut_short(reader: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    let read = reader.read_to_end(&mut rest);
    let ended = read.is_ok() || read.is_err_and(|e| e.kind() == ErrorKind::ConnectionReset);
    ended && rest.len() < BIG
}

/// Whether the server closed `s` (a read sees the end, or a reset), waiting up to 10 s.
fn closed_by_server(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(SECS10)).unwrap();
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => e.kind() == ErrorKind::ConnectionReset,
    }
}

/// Whether `s` is still open: nothing to read, and no end.
fn still_open(s: &TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let open = matches!((&*s).read(&mut [0u8; 1]), Err(e) if e.kind() == ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    open
}

/// Raises this process's soft open-file limit to its hard limit; fails the test if that leaves
/// fewer than `needed` descriptors.
fn need_descriptors(needed: u64) {
    let soft = plugreg_diag::http::raise_open_file_limit();
    assert!(
        soft >= needed,
        "this test needs {needed} open files; RLIMIT_NOFILE allows {soft} (raise the hard limit)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_is_answered_behind_1000_idle_and_slow_loris_clients() {
    need_descriptors(2 * 1000 + 200);
    let (addr, token) = start(ok, plugreg_diag::http::MAX_CONNECTIONS).await;
    let crowd = tokio::task::spawn_blocking(move || {
        let mut crowd = Vec::new();
        for i in 0..1000 {
            let mut s = TcpStream::connect(addr).unwrap();
            if i % 2 == 1 {
                // Slow-loris: part of a head, the rest never comes.
                s.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Slow: ")
                    .unwrap();
            }
            crowd.push(s);
        }
        crowd
    })
    .await
    .unwrap();
    let response = get_async(addr, "/healthz")
        .await
        .expect("the probe was answered");
    assert!(response.starts_with("HTTP/1.1 200 "), "{response}");
    assert!(response.ends_with("\r\n\r\nok"), "{response}");
    drop(crowd);
    token.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_cap_a_client_evicts_the_oldest_idle_one() {
    let (addr, token) = start(ok, 4).await;
    let mut idle: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // The server accepts in connect order: the four, then the request, which evicts the oldest.
    let response = get_async(addr, "/healthz").await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200 "), "{response}");
    assert!(
        closed_by_server(&mut idle[0]),
        "the oldest idle client was closed"
    );
    for s in &idle[1..] {
        assert!(still_open(s), "a younger idle client was closed");
    }
    token.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_whose_handler_runs_is_never_evicted() {
    // Handlers wait for a permit; each says when it started.
    let gate = Arc::new(Semaphore::new(0));
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let handler = {
        let gate = gate.clone();
        move |_: Request<Incoming>| {
            let gate = gate.clone();
            let started = started_tx.clone();
            async move {
                let _ = started.send(());
                gate.acquire().await.unwrap().forget();
                text_response(StatusCode::OK, "done".into())
            }
        }
    };
    let (addr, token) = start(handler, 2).await;
    let first = tokio::task::spawn_blocking(move || get(addr, "/a"));
    let second = tokio::task::spawn_blocking(move || get(addr, "/b"));
    started.recv().await.unwrap();
    started.recv().await.unwrap();
    // Both places are taken by running handlers: a third client waits for one of them.
    let third = tokio::task::spawn_blocking(move || get(addr, "/c"));
    gate.add_permits(3);
    for client in [first, second, third] {
        let response = client.await.unwrap().unwrap();
        assert!(response.starts_with("HTTP/1.1 200 "), "{response}");
        assert!(response.ends_with("done"), "{response}");
    }
    token.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_its_answer_is_evicted_for_a_new_one() {
    let (addr, token) = start(big_or_ok(), 1).await;
    let mut reader = slow_reader(addr).await;
    start_big_answer(&mut reader);
    // The only place is the reader's: the probe takes it.
    let response = get_async(addr, "/healthz").await.unwrap();
    assert!(response.ends_with("\r\n\r\nok"), "{response}");
    assert!(
        cut_short(&mut reader),
        "the client that did not read kept its place"
    );
    token.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_do_not_read_give_their_worker_to_a_probe() {
    let (addr, token) = start(big_or_ok(), 1024).await;
    let mut readers = Vec::new();
    for _ in 0..plugreg_diag::http::MAX_ANSWERING {
        let mut reader = slow_reader(addr).await;
        start_big_answer(&mut reader);
        readers.push(reader);
    }
    // Every worker writes to a client that does not read; the probe takes the oldest one's.
    let response = get_async(addr, "/healthz").await.unwrap();
    assert!(response.ends_with("\r\n\r\nok"), "{response}");
    assert!(
        cut_short(&mut readers[0]),
        "the oldest reader kept its worker"
    );
    token.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_head_trickled_a_byte_at_a_time_is_cut_off_at_the_head_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut client, server) = tokio::io::duplex(1024);
    let served = tokio::spawn(serve_connection(server, ok, SECS10));
    let start = tokio::time::Instant::now();
    let head = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut sent = 0;
    for byte in head.iter().cycle() {
        if client.write_all(&[*byte]).await.is_err() || served.is_finished() {
            break;
        }
        sent += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    served.await.unwrap();
    let mut out = Vec::new();
    let _ = client.read_to_end(&mut out).await;
    assert!(out.is_empty(), "{:?}", String::from_utf8_lossy(&out));
    let took = start.elapsed();
    assert!(
        took >= HEADER_READ_TIMEOUT && took < HEADER_READ_TIMEOUT + Duration::from_secs(1),
        "cut off after {took:?} ({sent} bytes)"
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_that_never_reads_is_cut_off_after_the_handler_and_write_limits() {
    use tokio::io::AsyncWriteExt;
    let (mut client, server) = tokio::io::duplex(1024);
    let big = |_: Request<Incoming>| async { text_response(StatusCode::OK, "x".repeat(1 << 20)) };
    let limit = Duration::from_secs(2);
    let start = tokio::time::Instant::now();
    let served = tokio::spawn(serve_connection(server, big, limit));
    client
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    served.await.unwrap();
    let took = start.elapsed();
    // The handler's limit and the 5 s allowed for writing.
    let bound = limit + Duration::from_secs(5);
    assert!(
        took >= bound && took < bound + Duration::from_secs(1),
        "{took:?}"
    );
    drop(client);
}
