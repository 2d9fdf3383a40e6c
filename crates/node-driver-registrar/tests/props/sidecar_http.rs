//! The checks behind the `sidecar_http` fuzz target and its property test: arbitrary bytes sent
//! as one client connection to the sidecar's real HTTP handler (`http::serve_connection`, the
//! code the TCP listener runs for each connection), over an in-memory duplex stream.
//!
//! Each input must end in a well-formed HTTP/1 response or a close, bounded in size, within the
//! connection's time limit, without a panic. The registration socket named in the handler does
//! not exist, so `/healthz` answers 404 at once (the check itself is not fed by the input).
//!
//! Shared by `tests/props.rs` (arbtest) and `fuzz/fuzz_targets/sidecar_http.rs` (libFuzzer).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use plugreg_node_driver_registrar::http::{Diagnostics, HEADER_READ_TIMEOUT, serve_connection};
use plugreg_registrar::{PluginInfo, Registrar};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest answer the handler may give (the metrics text is about 1 KiB).
const MAX_RESPONSE: usize = 64 * 1024;

struct Fixture {
    runtime: tokio::runtime::Runtime,
    diagnostics: Arc<Diagnostics>,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| Fixture {
        runtime: tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
        diagnostics: Diagnostics::new(
            "/nonexistent/plugreg-fuzz/csi.example.com-reg.sock".into(),
            "csi.example.com".into(),
            Duration::from_millis(200),
            Registrar::new(PluginInfo {
                name: "csi.example.com".into(),
                ..Default::default()
            }),
        ),
    })
}

const METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "OPTIONS", "CONNECT", "PRI", "get", "",
];
const TARGETS: &[&str] = &[
    "/healthz",
    "/metrics",
    "/metrics?x=1",
    "http://h/metrics",
    "*",
    "/",
    "/debug/pprof/",
    "//healthz",
    "/%00",
];
const VERSIONS: &[&str] = &[
    "HTTP/1.1",
    "HTTP/1.0",
    "HTTP/2.0",
    "HTTP/0.9",
    "HTTP/1.1 x",
    "",
];
const HEADERS: &[&str] = &[
    "Host: x",
    "Content-Length: 5",
    "Content-Length: 99999999999999999999",
    "Content-Length: -1",
    "Transfer-Encoding: chunked",
    "Transfer-Encoding: gzip, chunked",
    "Connection: keep-alive",
    "Connection: upgrade",
    "Upgrade: h2c",
    "Expect: 100-continue",
    "X: \u{7f}",
    " folded",
    ":",
];

/// Reads the input as a request: a grammar of methods, targets, versions and headers (so the
/// fuzzer gets past the request line quickly), or, for odd first bytes, the raw bytes.
pub fn request_from(data: &[u8]) -> Vec<u8> {
    let Some((&mode, rest)) = data.split_first() else {
        return Vec::new();
    };
    if mode % 2 == 1 {
        return rest.to_vec();
    }
    let mut bytes = rest.iter().copied();
    let mut pick = |n: usize| usize::from(bytes.next().unwrap_or(0)) % n;
    let mut out = format!(
        "{} {} {}\r\n",
        METHODS[pick(METHODS.len())],
        TARGETS[pick(TARGETS.len())],
        VERSIONS[pick(VERSIONS.len())]
    );
    for _ in 0..pick(6) {
        out.push_str(HEADERS[pick(HEADERS.len())]);
        out.push_str("\r\n");
    }
    if pick(4) != 0 {
        out.push_str("\r\n");
    }
    let mut out = out.into_bytes();
    out.extend(bytes);
    out
}

/// Every property, for one input.
pub fn check(data: &[u8]) {
    exchange(&request_from(data));
}

/// Sends `request` as one connection, closes the sending side, and checks what comes back.
pub fn exchange(request: &[u8]) {
    let f = fixture();
    let response = f.runtime.block_on(async {
        let (client, server) = tokio::io::duplex(16 * 1024);
        let served = tokio::spawn(serve_connection(server, f.diagnostics.clone()));
        let (mut rx, mut tx) = tokio::io::split(client);
        let send = async {
            // The server may answer and close before it has read everything: not an error.
            let _ = tx.write_all(request).await;
            let _ = tx.shutdown().await;
        };
        let receive = async {
            let mut out = Vec::new();
            let _ = (&mut rx)
                .take(MAX_RESPONSE as u64 + 1)
                .read_to_end(&mut out)
                .await;
            out
        };
        let limit = HEADER_READ_TIMEOUT + Duration::from_secs(10);
        let ((), response) = tokio::time::timeout(limit, async { tokio::join!(send, receive) })
            .await
            .expect("the connection neither answered nor closed in time");
        drop(rx);
        tokio::time::timeout(limit, served)
            .await
            .expect("the connection task did not end")
            .expect("the connection task panicked");
        response
    });
    assert!(
        response.len() <= MAX_RESPONSE,
        "{} bytes of response",
        response.len()
    );
    if response.is_empty() {
        return; // closed without an answer
    }
    let text = String::from_utf8_lossy(&response);
    let status_line = text.split("\r\n").next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    let code = parts.next().unwrap_or_default();
    assert!(
        matches!(version, "HTTP/1.1" | "HTTP/1.0"),
        "bad status line {status_line:?} for {:?}",
        String::from_utf8_lossy(request)
    );
    assert!(
        code.len() == 3 && code.bytes().all(|b| b.is_ascii_digit()),
        "bad status code in {status_line:?}"
    );
    assert!(
        text.contains("\r\n\r\n"),
        "response without the end of its head: {text:?}"
    );
    // Only the answers the handler gives, or hyper's own refusals.
    assert!(
        matches!(
            code,
            "200" | "404" | "405" | "500" | "400" | "431" | "414" | "501" | "505"
        ),
        "unexpected status {code} for {:?}",
        String::from_utf8_lossy(request)
    );
}
