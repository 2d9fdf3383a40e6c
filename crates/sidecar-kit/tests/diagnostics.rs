//! The diagnostics server over real TCP on loopback: metrics at the configured path with
//! promhttp's content type, `/healthz/leader-election` only when a health is given, Go's 404
//! otherwise, `:port` addresses, bind failures with upstream's message, a bounded request
//! head, and a clean stop.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use plugreg_sidecar_kit::diagnostics::{HttpError, METRICS_CONTENT_TYPE, Server, serve};
use plugreg_sidecar_kit::leader::LeaderHealth;
use plugreg_sidecar_kit::metrics::Metrics;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(10);

struct Running {
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), HttpError>>,
    metrics: Arc<Metrics>,
}

async fn start(metrics_path: &str, leader: Option<LeaderHealth>) -> Running {
    let server = Server::bind("127.0.0.1:0", metrics_path)
        .await
        .expect("bind");
    let addr = server.local_addr().expect("local addr");
    let metrics = Arc::new(Metrics::new("hostpath.csi.k8s.io"));
    metrics.leader("", true);
    metrics.queue_add("claims");
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(server.serve(metrics.clone(), leader, shutdown.clone()));
    Running {
        addr,
        shutdown,
        task,
        metrics,
    }
}

/// One raw HTTP/1.1 exchange: (status line, lower-cased head, body).
async fn exchange(addr: SocketAddr, request: &[u8]) -> (String, String, String) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(request).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut raw))
        .await
        .expect("answer within the deadline")
        .expect("read");
    let text = String::from_utf8(raw).expect("utf-8");
    let (head, body) = text.split_once("\r\n\r\n").expect("a head");
    let (status, rest) = head.split_once("\r\n").unwrap_or((head, ""));
    (
        status.to_owned(),
        rest.to_ascii_lowercase(),
        body.to_owned(),
    )
}

async fn get(addr: SocketAddr, path: &str) -> (String, String, String) {
    exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes(),
    )
    .await
}

#[tokio::test]
async fn metrics_at_the_default_path_with_promhttps_content_type() {
    let r = start("/metrics", None).await;
    let (status, head, body) = get(r.addr, "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(
        head.contains(&format!("content-type: {METRICS_CONTENT_TYPE}\r\n"))
            || head.ends_with(&format!("content-type: {METRICS_CONTENT_TYPE}")),
        "{head}"
    );
    // The registry's text, but for the resident memory, which moves between two reads.
    let steady = |text: &str| {
        text.lines()
            .filter(|l| !l.starts_with("process_resident_memory_bytes "))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(steady(&body), steady(&r.metrics.render()));
    assert!(body.contains("\nprocess_resident_memory_bytes "), "{body}");
    // Any method, as Go's ServeMux with a method-less pattern.
    let (status, _, _) = exchange(
        r.addr,
        b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    )
    .await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    r.shutdown.cancel();
    r.task.await.expect("no panic").expect("clean stop");
}

#[tokio::test]
async fn a_custom_metrics_path_replaces_the_default_and_the_rest_is_404() {
    let r = start("/custom/m", None).await;
    assert_eq!(get(r.addr, "/custom/m").await.0, "HTTP/1.1 200 OK");
    for path in [
        "/metrics",
        "/custom/m/x",
        "/",
        "/healthz",
        "/healthz/leader-election",
    ] {
        let (status, head, body) = get(r.addr, path).await;
        assert_eq!(status, "HTTP/1.1 404 Not Found", "{path}");
        assert_eq!(body, "404 page not found\n", "{path}");
        assert!(head.contains("x-content-type-options: nosniff"), "{head}");
    }
    r.shutdown.cancel();
    r.task.await.expect("no panic").expect("clean stop");
}

#[tokio::test]
async fn a_metrics_path_ending_in_a_slash_serves_its_subtree() {
    let r = start("/m/", None).await;
    assert_eq!(get(r.addr, "/m/").await.0, "HTTP/1.1 200 OK");
    assert_eq!(get(r.addr, "/m/anything").await.0, "HTTP/1.1 200 OK");
    assert_eq!(get(r.addr, "/n/").await.0, "HTTP/1.1 404 Not Found");
    r.shutdown.cancel();
}

#[tokio::test]
async fn leader_health_is_served_only_when_given() {
    let r = start("/metrics", Some(LeaderHealth::new())).await;
    let (status, head, body) = get(r.addr, "/healthz/leader-election").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(body, "ok");
    assert!(
        head.contains("content-type: text/plain; charset=utf-8"),
        "{head}"
    );
    // Only the exact path.
    assert_eq!(
        get(r.addr, "/healthz/leader-election/x").await.0,
        "HTTP/1.1 404 Not Found"
    );
    assert_eq!(get(r.addr, "/metrics").await.0, "HTTP/1.1 200 OK");
    r.shutdown.cancel();
}

#[tokio::test]
async fn a_go_style_port_only_address_listens_on_every_interface() {
    let server = Server::bind(":0", "/metrics").await.expect("bind :0");
    let port = server.local_addr().expect("addr").port();
    assert_ne!(port, 0);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(server.serve(Arc::new(Metrics::new("d")), None, shutdown.clone()));
    let (status, _, _) = get(SocketAddr::from(([127, 0, 0, 1], port)), "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    shutdown.cancel();
    task.await.expect("no panic").expect("clean stop");
}

#[tokio::test]
async fn bind_failures_carry_upstreams_message() {
    let taken = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let err = Server::bind(&addr, "/metrics").await.unwrap_err();
    assert!(matches!(err, HttpError::Bind { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!(
            "Failed to start HTTP server at specified address (\"{addr}\") and metrics path (\"/metrics\"): "
        )),
        "{msg}"
    );

    // The one-call form fails the same way, before serving anything.
    let err = serve(
        "no-such-host.invalid:80",
        "/metrics",
        Arc::new(Metrics::new("d")),
        None,
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, HttpError::Bind { .. }), "{err:?}");

    let err = Server::bind("127.0.0.1:0", "metrics").await.unwrap_err();
    assert!(err.to_string().contains("must start with '/'"), "{err}");
}

#[tokio::test]
async fn an_oversized_request_head_is_refused() {
    let r = start("/metrics", None).await;
    let mut request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n".to_vec();
    for i in 0..1000 {
        request.extend_from_slice(format!("X-Filler-{i}: {}\r\n", "a".repeat(40)).as_bytes());
    }
    request.extend_from_slice(b"\r\n");
    let mut s = TcpStream::connect(r.addr).await.expect("connect");
    // The server may close before it has read everything: a write error is an answer too.
    let _ = s.write_all(&request).await;
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(WAIT, s.read_to_end(&mut raw))
        .await
        .expect("closed within the deadline");
    let text = String::from_utf8_lossy(&raw);
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 431"),
        "{text}"
    );
    // Still serving.
    assert_eq!(get(r.addr, "/metrics").await.0, "HTTP/1.1 200 OK");
    r.shutdown.cancel();
}
