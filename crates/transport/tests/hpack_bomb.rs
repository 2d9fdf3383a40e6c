//! Hostile HTTP/2 clients against a real tonic server served by `plugreg_transport::serve` on a
//! Unix socket: each gets a GOAWAY and a closed connection, and the server's memory stays flat.
//!
//! One test in this binary on purpose: it measures the process's peak RSS, which other tests
//! running in parallel threads would disturb.

use std::time::Duration;

use plugreg_proto::example::v1beta1::example_client::ExampleClient;
use plugreg_proto::example::v1beta1::example_server::{Example, ExampleServer};
use plugreg_proto::example::v1beta1::{ExampleRequest, ExampleResponse};
use plugreg_transport::{bind, connect_path, serve, server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const PROTOCOL_ERROR: u32 = 0x1;
const FRAME_SIZE_ERROR: u32 = 0x6;
const COMPRESSION_ERROR: u32 = 0x9;
const ENHANCE_YOUR_CALM: u32 = 0xb;

/// Growth of the server process's peak RSS tolerated per hostile client: a safety bound far
/// below what the unbounded decoder took (gigabytes), far above what a refusal costs.
const MAX_GROWTH_KIB: u64 = 64 * 1024;

struct Echo;

#[tonic::async_trait]
impl Example for Echo {
    async fn get_example_info(
        &self,
        req: Request<ExampleRequest>,
    ) -> Result<Response<ExampleResponse>, Status> {
        Ok(Response::new(ExampleResponse {
            error: req.into_inner().request,
        }))
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The connection preface and an empty SETTINGS frame.
fn start() -> Vec<u8> {
    let mut v = PREFACE.to_vec();
    v.extend(frame(SETTINGS, 0, 0, &[]));
    v
}

/// A header block of `size` bytes: one 4000-byte literal put in the dynamic table, then
/// one-byte references to it (index 62), each decoding to 4 KiB. Sent as HEADERS plus
/// CONTINUATIONs of 16 KiB, as a real client may.
fn bomb(size: usize) -> Vec<u8> {
    let mut block = vec![0x40, 0x01, b'x', 0x7f, 0xa1, 0x1e]; // name "x", value length 4000
    block.extend(std::iter::repeat_n(b'a', 4000));
    block.resize(size, 0xbe);
    let mut v = start();
    let mut chunks = block.chunks(16_384).peekable();
    let mut kind = HEADERS;
    while let Some(c) = chunks.next() {
        let flags = if chunks.peek().is_none() {
            END_HEADERS
        } else {
            0
        };
        v.extend(frame(kind, flags, 1, c));
        kind = CONTINUATION;
    }
    v
}

/// What a hostile client saw: the GOAWAY's (last stream, error code), and whether the server
/// closed the connection.
#[derive(Debug)]
struct Outcome {
    goaway: Option<(u32, u32)>,
    closed: bool,
}

/// Sends `payload` and reads what the server answers until it closes (or 20 s pass: a hang).
async fn hostile(path: &std::path::Path, payload: Vec<u8>) -> Outcome {
    let (mut rd, mut wr) = UnixStream::connect(path).await.unwrap().into_split();
    // The server may stop reading before the end of the payload: write on the side.
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&payload).await;
        wr
    });
    let mut got = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(20), async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) => return true,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                // Closing with unread client bytes resets the connection: closed too.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(e) => panic!("reading from the server: {e}"),
            }
        }
    })
    .await
    .unwrap_or(false);
    writer.abort();
    let mut goaway = None;
    let mut pos = 0;
    while got.len() - pos >= 9 {
        let h = &got[pos..pos + 9];
        let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
        let Some(p) = got.get(pos + 9..pos + 9 + len) else {
            break;
        };
        if h[3] == GOAWAY && p.len() >= 8 {
            let last = u32::from_be_bytes(p[0..4].try_into().unwrap()) & 0x7fff_ffff;
            let code = u32::from_be_bytes(p[4..8].try_into().unwrap());
            goaway.get_or_insert((last, code));
        }
        pos += 9 + len;
    }
    Outcome { goaway, closed }
}

/// A field of /proc/self/status, in KiB.
fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"))
}

/// Resets the peak RSS to the current RSS when the kernel lets us (Linux >= 4.0); either way
/// returns the baseline to measure growth from.
fn reset_peak() -> u64 {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    status_kib("VmHWM")
}

async fn assert_refused(path: &std::path::Path, what: &str, payload: Vec<u8>, code: u32) {
    let before = reset_peak();
    let outcome = hostile(path, payload).await;
    let peak = status_kib("VmHWM");
    let growth = peak.saturating_sub(before);
    eprintln!("{what}: {outcome:?}, peak RSS {before} -> {peak} KiB (+{growth} KiB)");
    assert!(
        growth < MAX_GROWTH_KIB,
        "{what}: server peak RSS grew by {growth} KiB"
    );
    assert_eq!(
        outcome.goaway,
        Some((0, code)),
        "{what}: expected a GOAWAY with error code {code:#x}"
    );
    assert!(
        outcome.closed,
        "{what}: the server kept the connection open"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_header_blocks_get_a_goaway_and_memory_stays_flat() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bomb.sock");
    let socket = bind(&path).unwrap();
    let token = CancellationToken::new();
    let t = token.clone();
    let router = server().add_service(ExampleServer::new(Echo));
    let task = tokio::spawn(async move { serve(router, socket, t.cancelled_owned()).await });

    // The HPACK bomb from issue 8: 256 KiB of header block, 64 K references to a 4 KiB entry.
    assert_refused(
        &path,
        "256 KiB HPACK bomb",
        bomb(256 * 1024),
        ENHANCE_YOUR_CALM,
    )
    .await;
    // Small enough to be decoded, still over 16 KiB once decoded.
    assert_refused(
        &path,
        "12 KiB HPACK bomb",
        bomb(12 * 1024),
        ENHANCE_YOUR_CALM,
    )
    .await;

    // A frame above SETTINGS_MAX_FRAME_SIZE (16 KiB), even one that is not a header frame.
    let mut v = start();
    let mut data = frame(0x0, 0, 1, &[]);
    data[..3].copy_from_slice(&[0x01, 0x00, 0x00]); // announces 64 KiB
    v.extend(data);
    v.extend(vec![0u8; 64 * 1024]);
    assert_refused(&path, "64 KiB DATA frame", v, FRAME_SIZE_ERROR).await;

    // A dynamic table size update above 4096.
    let mut v = start();
    v.extend(frame(HEADERS, END_HEADERS, 1, &[0x3f, 0xe2, 0x1f, 0x82]));
    assert_refused(&path, "table size 4097", v, COMPRESSION_ERROR).await;

    // A CONTINUATION flood: empty frames that never end the block.
    let mut v = start();
    v.extend(frame(HEADERS, 0, 1, &[0x82]));
    for _ in 0..10_000 {
        v.extend(frame(CONTINUATION, 0, 1, &[]));
    }
    assert_refused(&path, "CONTINUATION flood", v, ENHANCE_YOUR_CALM).await;

    // Garbage instead of the connection preface.
    assert_refused(
        &path,
        "no preface",
        b"GET / HTTP/1.1\r\n\r\n".repeat(100),
        PROTOCOL_ERROR,
    )
    .await;

    // The server survived all of that and still serves a normal client.
    let ch = connect_path(&path, Duration::from_secs(5)).await.unwrap();
    let reply = ExampleClient::new(ch)
        .get_example_info(ExampleRequest {
            request: "still here".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(reply.into_inner().error, "still here");

    token.cancel();
    task.await.unwrap().unwrap();
}
