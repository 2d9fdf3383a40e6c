//! Accepts gRPC clients that send a socket path as HTTP/2 `:authority`, within fixed bounds.
//!
//! The kubelet's grpc-go sends the Unix socket path as `:authority`: v1.20 (grpc-go 1.27) the raw
//! path, e.g. `/var/lib/kubelet/plugins_registry/x-reg.sock`, v1.36 (grpc-go 1.79) the path
//! percent-encoded (`%2Fvar%2Flib%2F...`); grpc-java, grpc-swift and others do the like. Neither is
//! a valid URI authority (seen in crates/interop against both real kubelets). hyperium/h2, under tonic, rejects such a request with RST_STREAM
//! PROTOCOL_ERROR (hyperium/h2#487, unmerged), so a plugin served by tonic could never register
//! with those kubelets. [`AuthorityFix`] sits between the socket and the HTTP/2 server: it parses
//! the client's frames, decodes every header block (keeping the client's HPACK dynamic table in
//! step), replaces an `:authority` that is not a valid URI authority by `localhost`, and
//! re-encodes the block without the dynamic table. Every other frame streams through unchanged.
//!
//! Everything the client sends is bounded before it is buffered or decoded (D7): frames above
//! [`MAX_FRAME_SIZE`], encoded header blocks above [`MAX_HEADER_BLOCK`] or spread over more than
//! [`MAX_CONTINUATIONS`] CONTINUATION frames, decoded header lists above
//! [`MAX_HEADER_LIST_SIZE`] and a dynamic table above [`MAX_TABLE_SIZE`] are refused: the client
//! gets a GOAWAY and the connection is closed. A header block that references one table entry
//! thousands of times (an "HPACK bomb") thus costs at most 16 KiB, not entries x references.

mod hpack;

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// Largest frame payload accepted from a client: the initial SETTINGS_MAX_FRAME_SIZE, which
/// plugreg's servers never raise. Frames we emit stay within it too.
pub const MAX_FRAME_SIZE: usize = 16_384;
/// Largest decoded header list accepted, counted as RFC 7541 §4.1 and h2 do (name + value + 32
/// per field); h2's and hyper's default.
pub const MAX_HEADER_LIST_SIZE: usize = 16_384;
/// Largest HPACK dynamic table a client may use: the initial SETTINGS_HEADER_TABLE_SIZE, which
/// plugreg's servers keep, so a size update above it is refused.
pub const MAX_TABLE_SIZE: usize = 4_096;
/// Largest encoded header block (padding excluded). A sane encoder never needs more bytes than
/// the decoded list counts, so this refuses nothing [`MAX_HEADER_LIST_SIZE`] would accept.
pub const MAX_HEADER_BLOCK: usize = MAX_HEADER_LIST_SIZE;
/// Most CONTINUATION frames after one HEADERS frame (empty ones cost no buffer but still work).
pub const MAX_CONTINUATIONS: usize = 16;

/// The value put in place of an invalid `:authority`.
pub const FALLBACK_AUTHORITY: &[u8] = b"localhost";

/// The HTTP/2 error code (RFC 9113 §7) a refusal is reported with in the GOAWAY.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Framing the HTTP/2 server would refuse as well (0x1).
    ProtocolError = 0x1,
    /// A frame longer than [`MAX_FRAME_SIZE`] (0x6).
    FrameSizeError = 0x6,
    /// Undecodable HPACK, or a dynamic table larger than [`MAX_TABLE_SIZE`] (0x9).
    CompressionError = 0x9,
    /// A header list, header block or CONTINUATION run over its bound (0xb).
    EnhanceYourCalm = 0xb,
}

/// Why a client's connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("HTTP/2 client refused with {reason:?}: {what}")]
pub struct Refused {
    /// The error code sent in the GOAWAY.
    pub reason: Reason,
    /// What was wrong.
    pub what: &'static str,
}

impl Refused {
    fn new(reason: Reason, what: &'static str) -> Self {
        Self { reason, what }
    }

    /// The GOAWAY frame that reports this refusal, naming `last_stream` as the last stream the
    /// server may have processed.
    pub fn goaway(&self, last_stream: u32) -> [u8; FRAME_HEADER + 8] {
        let mut f = [0u8; FRAME_HEADER + 8];
        f[2] = 8;
        f[3] = GOAWAY;
        f[9..13].copy_from_slice(&(last_stream & 0x7fff_ffff).to_be_bytes());
        f[13..17].copy_from_slice(&(self.reason as u32).to_be_bytes());
        f
    }
}

fn frame_too_large() -> Refused {
    Refused::new(
        Reason::FrameSizeError,
        "frame larger than SETTINGS_MAX_FRAME_SIZE",
    )
}

/// The payload length in a frame header.
fn frame_len(h: &[u8; FRAME_HEADER]) -> usize {
    (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2])
}

fn protocol(what: &'static str) -> Refused {
    Refused::new(Reason::ProtocolError, what)
}

/// Where the rewriter stands in the client's byte stream.
#[derive(Debug, Clone, Copy)]
enum State {
    /// Inside the connection preface, `n` bytes of it seen.
    Preface(usize),
    /// Inside a frame header, `have` bytes of it seen (kept in `Rewriter::head`).
    Head { have: usize },
    /// Streaming `left` more payload bytes of a frame that is not part of a header block.
    Pass { left: usize },
    /// Collecting `left` more payload bytes of a HEADERS or CONTINUATION frame.
    Collect { left: usize },
    /// Refused; no byte is accepted any more.
    Refused(Refused),
}

/// The header block being collected across HEADERS and CONTINUATION frames.
struct Pending {
    stream: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    continuations: usize,
}

/// Rewrites the client-to-server half of an HTTP/2 connection (pure: bytes in, bytes out).
///
/// Buffers at most one frame header, one header frame ([`MAX_FRAME_SIZE`]), one encoded header
/// block ([`MAX_HEADER_BLOCK`]) and the dynamic table ([`MAX_TABLE_SIZE`]); every other payload
/// streams through as it arrives.
pub struct Rewriter {
    state: State,
    head: [u8; FRAME_HEADER],
    /// Payload of the header frame being collected.
    frame: Vec<u8>,
    /// The encoded header block so far (padding and priority removed).
    block: Vec<u8>,
    /// The re-encoded block, reused between blocks.
    encoded: Vec<u8>,
    pending: Option<Pending>,
    decoder: hpack::Decoder,
    last_stream: u32,
    rewritten: u64,
}

impl Default for Rewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Rewriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rewriter")
            .field("state", &self.state)
            .field("buffered", &self.buffered())
            .field("rewritten", &self.rewritten)
            .finish()
    }
}

impl Rewriter {
    /// A rewriter expecting the connection preface.
    pub fn new() -> Self {
        Self {
            state: State::Preface(0),
            head: [0; FRAME_HEADER],
            frame: Vec::new(),
            block: Vec::new(),
            encoded: Vec::new(),
            pending: None,
            decoder: hpack::Decoder::new(),
            last_stream: 0,
            rewritten: 0,
        }
    }

    /// How many `:authority` values were replaced.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// The highest stream whose header block was passed on.
    pub fn last_stream(&self) -> u32 {
        self.last_stream
    }

    /// Whether a header block has begun and not ended (its frames are held back until it
    /// ends; h2 would decode them as they come).
    pub fn in_header_block(&self) -> bool {
        self.pending.is_some()
    }

    /// Client bytes held back, waiting for the rest of their frame or header block (bounded by
    /// [`MAX_FRAME_SIZE`] + [`MAX_HEADER_BLOCK`] + a frame header).
    pub fn buffered(&self) -> usize {
        let head = match self.state {
            State::Head { have } => have,
            _ => 0,
        };
        head + self.frame.len() + self.block.len()
    }

    /// Takes `data` read from the client and appends what the server should read to `out`.
    ///
    /// On a refusal, `out` holds what came before the offending frame, and every later call
    /// fails the same way. A few bytes of header block may decode to up to
    /// [`MAX_HEADER_LIST_SIZE`], so `out` can grow much faster than `data`: a caller that must
    /// bound its memory uses [`Rewriter::feed_some`].
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) -> Result<(), Refused> {
        self.feed_some(data, out, usize::MAX).map(|_| ())
    }

    /// Like [`Rewriter::feed`], but stops taking bytes once `out` holds `out_limit` bytes or
    /// more, and returns how many bytes of `data` it took. `out` then holds at most `out_limit`
    /// plus one re-encoded header block ([`MAX_HEADER_LIST_SIZE`] and three frame headers).
    pub fn feed_some(
        &mut self,
        data: &[u8],
        out: &mut Vec<u8>,
        out_limit: usize,
    ) -> Result<usize, Refused> {
        let result = self.feed_inner(data, out, out_limit);
        if let Err(e) = &result {
            self.state = State::Refused(*e);
            self.frame = Vec::new();
            self.block = Vec::new();
        }
        result
    }

    fn feed_inner(
        &mut self,
        mut data: &[u8],
        out: &mut Vec<u8>,
        out_limit: usize,
    ) -> Result<usize, Refused> {
        let total = data.len();
        while !data.is_empty() && out.len() < out_limit {
            match &mut self.state {
                State::Refused(e) => return Err(*e),
                State::Preface(seen) => {
                    let n = (PREFACE.len() - *seen).min(data.len());
                    if data[..n] != PREFACE[*seen..*seen + n] {
                        return Err(protocol("not the HTTP/2 connection preface"));
                    }
                    out.extend_from_slice(&data[..n]);
                    *seen += n;
                    data = &data[n..];
                    if *seen == PREFACE.len() {
                        self.state = State::Head { have: 0 };
                    }
                }
                State::Head { have } => {
                    let n = (FRAME_HEADER - *have).min(data.len());
                    self.head[*have..*have + n].copy_from_slice(&data[..n]);
                    *have += n;
                    data = &data[n..];
                    // Refuse an oversized frame as soon as its length is known, as h2 does.
                    if *have >= 3 && frame_len(&self.head) > MAX_FRAME_SIZE {
                        return Err(frame_too_large());
                    }
                    if *have == FRAME_HEADER {
                        self.frame_header(out)?;
                    }
                }
                State::Pass { left } => {
                    let n = (*left).min(data.len()).min(out_limit - out.len());
                    out.extend_from_slice(&data[..n]);
                    *left -= n;
                    data = &data[n..];
                    if *left == 0 {
                        self.state = State::Head { have: 0 };
                    }
                }
                State::Collect { left } => {
                    let n = (*left).min(data.len());
                    self.frame.extend_from_slice(&data[..n]);
                    *left -= n;
                    data = &data[n..];
                    if *left == 0 {
                        self.header_frame(out)?;
                    }
                }
            }
        }
        Ok(total - data.len())
    }

    /// A complete frame header is in `self.head`.
    fn frame_header(&mut self, out: &mut Vec<u8>) -> Result<(), Refused> {
        let h = self.head;
        let len = frame_len(&h);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        match (h[3], &mut self.pending) {
            (PUSH_PROMISE, _) => return Err(protocol("PUSH_PROMISE from a client")),
            (HEADERS, Some(_)) => return Err(protocol("HEADERS inside a header block")),
            (HEADERS, None) => {}
            (CONTINUATION, Some(p)) if p.stream == stream => {
                p.continuations += 1;
                if p.continuations > MAX_CONTINUATIONS {
                    return Err(Refused::new(
                        Reason::EnhanceYourCalm,
                        "too many CONTINUATION frames",
                    ));
                }
            }
            (CONTINUATION, Some(_)) => return Err(protocol("CONTINUATION on another stream")),
            (CONTINUATION, None) => return Err(protocol("CONTINUATION without a header block")),
            (_, Some(_)) => return Err(protocol("frame interleaved inside a header block")),
            (_, None) => {
                out.extend_from_slice(&h);
                self.state = if len == 0 {
                    State::Head { have: 0 }
                } else {
                    State::Pass { left: len }
                };
                return Ok(());
            }
        }
        self.frame.clear();
        if len == 0 {
            return self.header_frame(out);
        }
        self.state = State::Collect { left: len };
        Ok(())
    }

    /// A complete HEADERS or CONTINUATION frame: header in `self.head`, payload in `self.frame`.
    fn header_frame(&mut self, out: &mut Vec<u8>) -> Result<(), Refused> {
        self.state = State::Head { have: 0 };
        let (kind, flags) = (self.head[3], self.head[4]);
        let stream = u32::from_be_bytes([self.head[5], self.head[6], self.head[7], self.head[8]])
            & 0x7fff_ffff;
        let payload = std::mem::take(&mut self.frame);
        let result = self.header_fragment(kind, flags, stream, &payload, out);
        self.frame = payload;
        self.frame.clear();
        result
    }

    fn header_fragment(
        &mut self,
        kind: u8,
        flags: u8,
        stream: u32,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), Refused> {
        let fragment = if kind == HEADERS {
            // h2 refuses this as soon as the frame is complete; we would only pass it on at
            // the end of the block.
            if stream == 0 {
                return Err(protocol("HEADERS on stream 0"));
            }
            let mut p = payload;
            let mut pad = 0usize;
            if flags & PADDED != 0 {
                let (&n, rest) = p
                    .split_first()
                    .ok_or_else(|| protocol("padded HEADERS without a pad length"))?;
                pad = usize::from(n);
                p = rest;
            }
            let priority = if flags & PRIORITY != 0 {
                let (pr, rest) = p
                    .split_first_chunk::<5>()
                    .ok_or_else(|| protocol("HEADERS shorter than its priority fields"))?;
                p = rest;
                // A stream depending on itself: h2 would reset it without decoding the block,
                // and its HPACK table would then differ from ours. Refuse instead.
                if u32::from_be_bytes([pr[0], pr[1], pr[2], pr[3]]) & 0x7fff_ffff == stream {
                    return Err(protocol("HEADERS depending on its own stream"));
                }
                Some(*pr)
            } else {
                None
            };
            if pad > p.len() {
                return Err(protocol("HEADERS padding longer than the frame"));
            }
            self.pending = Some(Pending {
                stream,
                flags,
                priority,
                continuations: 0,
            });
            self.block.clear();
            &p[..p.len() - pad]
        } else {
            payload
        };
        if self.block.len() + fragment.len() > MAX_HEADER_BLOCK {
            return Err(Refused::new(
                Reason::EnhanceYourCalm,
                "header block larger than 16 KiB",
            ));
        }
        self.block.extend_from_slice(fragment);
        if flags & END_HEADERS == 0 {
            return Ok(());
        }
        let Some(pending) = self.pending.take() else {
            return Err(protocol("header block without HEADERS"));
        };
        let mut encoded = std::mem::take(&mut self.encoded);
        encoded.clear();
        let rewritten = &mut self.rewritten;
        let decoded = self
            .decoder
            .decode(&self.block, MAX_HEADER_LIST_SIZE, |name, value| {
                let value = if name == b":authority" && needs_rewrite(value) {
                    *rewritten += 1;
                    FALLBACK_AUTHORITY
                } else {
                    value
                };
                encode_literal(name, value, &mut encoded);
            });
        self.block.clear();
        if decoded.is_ok() {
            write_header_frames(
                pending.stream,
                pending.flags & END_STREAM,
                pending.priority,
                &encoded,
                out,
            );
            self.last_stream = self.last_stream.max(pending.stream);
        }
        self.encoded = encoded;
        decoded
    }
}

/// Whether an `:authority` must be replaced: text that is not a URI authority (a socket path, or
/// empty). Non-UTF-8 bytes are left for the server to refuse, as it would without us.
fn needs_rewrite(v: &[u8]) -> bool {
    std::str::from_utf8(v).is_ok() && (v.is_empty() || http::uri::Authority::try_from(v).is_err())
}

/// HPACK integer with an `n`-bit prefix (RFC 7541 §5.1).
fn encode_int(mut value: usize, n: u8, first: u8, out: &mut Vec<u8>) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    value -= max;
    while value >= 128 {
        out.push((value % 128 + 128) as u8);
        value /= 128;
    }
    out.push(value as u8);
}

/// "Literal header field without indexing, new name", no Huffman: touches no dynamic table.
fn encode_literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.push(0x00);
    encode_int(name.len(), 7, 0, out);
    out.extend_from_slice(name);
    encode_int(value.len(), 7, 0, out);
    out.extend_from_slice(value);
}

fn frame_header(len: usize, kind: u8, flags: u8, stream: u32, out: &mut Vec<u8>) {
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
}

fn write_header_frames(
    stream: u32,
    end_stream: u8,
    priority: Option<[u8; 5]>,
    block: &[u8],
    out: &mut Vec<u8>,
) {
    let prio_len = if priority.is_some() { 5 } else { 0 };
    let first = block.len().min(MAX_FRAME_SIZE - prio_len);
    let mut flags = end_stream | if priority.is_some() { PRIORITY } else { 0 };
    if first == block.len() {
        flags |= END_HEADERS;
    }
    frame_header(first + prio_len, HEADERS, flags, stream, out);
    if let Some(p) = priority {
        out.extend_from_slice(&p);
    }
    out.extend_from_slice(&block[..first]);
    let mut rest = &block[first..];
    while !rest.is_empty() {
        let n = rest.len().min(MAX_FRAME_SIZE);
        let flags = if n == rest.len() { END_HEADERS } else { 0 };
        frame_header(n, CONTINUATION, flags, stream, out);
        out.extend_from_slice(&rest[..n]);
        rest = &rest[n..];
    }
}

/// Follows the frames the server writes, so a GOAWAY of ours lands between two of them.
#[derive(Debug, Default)]
struct FrameTracker {
    head: [u8; 3],
    /// Frame-header bytes seen of the current frame (0 at a boundary or inside a payload).
    have: usize,
    /// Payload bytes still to come.
    left: usize,
}

impl FrameTracker {
    fn at_boundary(&self) -> bool {
        self.have == 0 && self.left == 0
    }

    /// How many bytes may be written before the current frame ends (`usize::MAX` at a boundary).
    fn to_boundary(&self) -> usize {
        match (self.have, self.left) {
            (0, 0) => usize::MAX,
            (0, left) => left,
            (have, _) => FRAME_HEADER - have,
        }
    }

    fn written(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.left > 0 {
                let n = self.left.min(bytes.len());
                self.left -= n;
                bytes = &bytes[n..];
                continue;
            }
            if self.have < 3 {
                self.head[self.have] = bytes[0];
            }
            self.have += 1;
            bytes = &bytes[1..];
            if self.have == FRAME_HEADER {
                self.have = 0;
                self.left = (usize::from(self.head[0]) << 16)
                    | (usize::from(self.head[1]) << 8)
                    | usize::from(self.head[2]);
            }
        }
    }
}

/// How much is read from the client at once.
const READ_SIZE: usize = 16 * 1024;
/// How much rewritten output is prepared ahead of the server's reads (plus one header block).
const OUT_SIZE: usize = 16 * 1024;

/// How long a refused client has to take its GOAWAY before the connection is simply closed.
const GOAWAY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The GOAWAY being sent after a refusal.
#[derive(Debug)]
struct GoAway {
    refused: Refused,
    frame: [u8; FRAME_HEADER + 8],
    sent: usize,
    /// When to give up on sending it and just close.
    deadline: Pin<Box<tokio::time::Sleep>>,
}

/// A server-side connection whose client-to-server bytes go through a [`Rewriter`].
///
/// When the rewriter refuses, the wrapper waits for the server to finish the frame it is
/// writing, writes a GOAWAY with the refusal's error code, shuts the socket down and fails the
/// server's read, so the server drops the connection; whatever the server writes after that is
/// discarded.
#[derive(Debug)]
pub struct AuthorityFix<S> {
    inner: S,
    rewriter: Rewriter,
    out: Vec<u8>,
    out_pos: usize,
    /// Bytes read from the client; `input[in_pos..in_len]` is not fed to the rewriter yet.
    input: Box<[u8]>,
    in_pos: usize,
    in_len: usize,
    server: FrameTracker,
    goaway: Option<GoAway>,
    read_waker: Option<Waker>,
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<S> AuthorityFix<S> {
    /// Wraps an accepted connection.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            rewriter: Rewriter::new(),
            out: Vec::new(),
            out_pos: 0,
            input: vec![0u8; READ_SIZE].into_boxed_slice(),
            in_pos: 0,
            in_len: 0,
            server: FrameTracker::default(),
            goaway: None,
            read_waker: None,
            _permit: None,
        }
    }

    /// Wraps an accepted connection that holds one of the listener's connection slots until it
    /// is dropped.
    pub(crate) fn with_permit(inner: S, permit: tokio::sync::OwnedSemaphorePermit) -> Self {
        Self {
            _permit: Some(permit),
            ..Self::new(inner)
        }
    }

    /// The wrapped connection.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    fn goaway_sent(&self) -> bool {
        self.goaway
            .as_ref()
            .is_some_and(|g| g.sent == g.frame.len())
    }
}

impl<S: AsyncWrite + Unpin> AuthorityFix<S> {
    /// Writes the rest of the GOAWAY (only at a frame boundary of the server's output).
    fn poll_goaway(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Some(g) = &mut self.goaway else {
            return Poll::Ready(Ok(()));
        };
        while g.sent < g.frame.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &g.frame[g.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            g.sent += n;
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if let Some(g) = &mut this.goaway {
                let refused = g.refused;
                let io_err = || io::Error::new(io::ErrorKind::InvalidData, refused);
                // A client that stops reading must not hold its connection slot for ever.
                if g.deadline.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(io_err()));
                }
                if !this.goaway_sent() {
                    if !this.server.at_boundary() {
                        // The server is mid-frame; its next write wakes us at the boundary.
                        this.read_waker = Some(cx.waker().clone());
                        return Poll::Pending;
                    }
                    ready!(this.poll_goaway(cx))?;
                }
                // Best effort: the client has its GOAWAY; the server learns from the error.
                let _ = ready!(Pin::new(&mut this.inner).poll_shutdown(cx));
                return Poll::Ready(Err(io_err()));
            }
            if this.out_pos < this.out.len() {
                let n = (this.out.len() - this.out_pos).min(buf.remaining());
                buf.put_slice(&this.out[this.out_pos..this.out_pos + n]);
                this.out_pos += n;
                if this.out_pos == this.out.len() {
                    this.out.clear();
                    this.out_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.in_pos == this.in_len {
                let mut rb = ReadBuf::new(&mut this.input);
                ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
                if rb.filled().is_empty() {
                    return Poll::Ready(Ok(()));
                }
                this.in_len = rb.filled().len();
                this.in_pos = 0;
            }
            // Only streams already handed to the server may have been processed.
            let last_stream = this.rewriter.last_stream();
            let input = &this.input[this.in_pos..this.in_len];
            match this.rewriter.feed_some(input, &mut this.out, OUT_SIZE) {
                Ok(n) => this.in_pos += n,
                Err(refused) => {
                    tracing::warn!(error = %refused, "refusing an HTTP/2 client");
                    this.out.clear();
                    this.out_pos = 0;
                    this.goaway = Some(GoAway {
                        frame: refused.goaway(last_stream),
                        refused,
                        sent: 0,
                        deadline: Box::pin(tokio::time::sleep(GOAWAY_TIMEOUT)),
                    });
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.goaway.is_some() {
            if this.server.at_boundary() {
                // Nothing of the server's may follow the GOAWAY.
                ready!(this.poll_goaway(cx))?;
                if let Some(w) = this.read_waker.take() {
                    w.wake();
                }
                return Poll::Ready(Ok(buf.len()));
            }
            let n = buf.len().min(this.server.to_boundary());
            let n = ready!(Pin::new(&mut this.inner).poll_write(cx, &buf[..n]))?;
            this.server.written(&buf[..n]);
            if this.server.at_boundary()
                && let Some(w) = this.read_waker.take()
            {
                w.wake();
            }
            return Poll::Ready(Ok(n));
        }
        let n = ready!(Pin::new(&mut this.inner).poll_write(cx, buf))?;
        this.server.written(&buf[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.goaway_sent() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.goaway_sent() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.goaway.is_some() {
            let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| b);
            return self.poll_write(cx, first);
        }
        let this = &mut *self;
        let n = ready!(Pin::new(&mut this.inner).poll_write_vectored(cx, bufs))?;
        let mut left = n;
        for b in bufs {
            let k = left.min(b.len());
            this.server.written(&b[..k]);
            left -= k;
            if left == 0 {
                break;
            }
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for AuthorityFix<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers_frame(stream: u32, flags: u8, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        frame_header(payload.len(), HEADERS, flags, stream, &mut f);
        f.extend_from_slice(payload);
        f
    }

    fn decode_all(bytes: &[u8]) -> Vec<Vec<(String, String)>> {
        let mut d = loona_hpack::Decoder::new();
        let mut pos = PREFACE.len();
        let mut blocks = Vec::new();
        let mut block = Vec::new();
        while pos < bytes.len() {
            let h = &bytes[pos..pos + 9];
            let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
            let (kind, flags) = (h[3], h[4]);
            let mut p = &bytes[pos + 9..pos + 9 + len];
            if kind == HEADERS && flags & PRIORITY != 0 {
                p = &p[5..];
            }
            if kind == HEADERS || kind == CONTINUATION {
                block.extend_from_slice(p);
                if flags & END_HEADERS != 0 {
                    let hs = d.decode(&block).unwrap();
                    blocks.push(
                        hs.into_iter()
                            .map(|(n, v)| {
                                (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap())
                            })
                            .collect(),
                    );
                    block.clear();
                }
            }
            pos += 9 + len;
        }
        blocks
    }

    fn request(authority: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
        vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (b":scheme".to_vec(), b"http".to_vec()),
            (
                b":path".to_vec(),
                b"/pluginregistration.Registration/GetInfo".to_vec(),
            ),
            (b":authority".to_vec(), authority.as_bytes().to_vec()),
            (b"content-type".to_vec(), b"application/grpc".to_vec()),
        ]
    }

    fn encode(enc: &mut loona_hpack::Encoder<'_>, hs: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        enc.encode(hs.iter().map(|(n, v)| (n.as_slice(), v.as_slice())))
    }

    #[test]
    fn replaces_a_socket_path_authority_and_keeps_the_rest() {
        let mut enc = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        input.extend(headers_frame(
            1,
            END_HEADERS,
            &encode(
                &mut enc,
                &request("/var/lib/kubelet/plugins_registry/x-reg.sock"),
            ),
        ));
        // A DATA frame passes unchanged.
        let data = [0, 0, 2, 0x0, END_STREAM, 0, 0, 0, 1, 0xab, 0xcd];
        input.extend_from_slice(&data);
        // A second request on the same connection.
        input.extend(headers_frame(
            3,
            END_HEADERS | END_STREAM,
            &encode(
                &mut enc,
                &request("/var/lib/kubelet/plugins_registry/x-reg.sock"),
            ),
        ));

        let mut rw = Rewriter::new();
        let mut out = Vec::new();
        rw.feed(&input, &mut out).unwrap();
        assert_eq!(rw.rewritten(), 2);
        assert!(out.starts_with(PREFACE));
        let blocks = decode_all(&out);
        assert_eq!(blocks.len(), 2);
        for b in &blocks {
            assert!(b.contains(&(":authority".into(), "localhost".into())));
            assert!(b.contains(&(
                ":path".into(),
                "/pluginregistration.Registration/GetInfo".into()
            )));
        }
        assert!(
            out.windows(data.len()).any(|w| w == data),
            "DATA frame unchanged"
        );
    }

    #[test]
    fn leaves_a_valid_authority_alone() {
        let mut enc = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        input.extend(headers_frame(
            1,
            END_HEADERS,
            &encode(&mut enc, &request("localhost")),
        ));
        let mut rw = Rewriter::new();
        let mut out = Vec::new();
        rw.feed(&input, &mut out).unwrap();
        assert_eq!(rw.rewritten(), 0);
        assert!(decode_all(&out)[0].contains(&(":authority".into(), "localhost".into())));
    }

    #[test]
    fn joins_continuations_strips_padding_keeps_priority_and_survives_byte_by_byte_input() {
        let mut enc = loona_hpack::Encoder::new();
        let block = encode(&mut enc, &request("/tmp/s.sock"));
        let (a, b) = block.split_at(block.len() / 2);
        let mut payload = vec![3u8];
        payload.extend_from_slice(&[0, 0, 0, 0, 15]);
        payload.extend_from_slice(a);
        payload.extend_from_slice(&[0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(headers_frame(1, PADDED | PRIORITY, &payload));
        let mut cont = Vec::new();
        frame_header(b.len(), CONTINUATION, END_HEADERS, 1, &mut cont);
        cont.extend_from_slice(b);
        input.extend(cont);

        let mut rw = Rewriter::new();
        let mut out = Vec::new();
        for byte in &input {
            rw.feed(std::slice::from_ref(byte), &mut out).unwrap();
        }
        assert_eq!(rw.rewritten(), 1);
        let blocks = decode_all(&out);
        assert_eq!(blocks.len(), 1);
        assert!(blocks[0].contains(&(":authority".into(), "localhost".into())));
        // The priority fields survive.
        assert_eq!(
            &out[PREFACE.len() + 9..PREFACE.len() + 14],
            &[0, 0, 0, 0, 15]
        );
    }

    #[test]
    fn refuses_nonsense_instead_of_panicking() {
        let mut rw = Rewriter::new();
        let mut out = Vec::new();
        let mut input = PREFACE.to_vec();
        let mut cont = Vec::new();
        frame_header(1, CONTINUATION, END_HEADERS, 1, &mut cont);
        cont.push(0);
        input.extend(cont);
        assert!(rw.feed(&input, &mut out).is_err());
        let mut rw = Rewriter::new();
        let mut input = PREFACE.to_vec();
        input.extend(headers_frame(1, END_HEADERS | PADDED, &[200, 1, 2]));
        assert!(rw.feed(&input, &mut Vec::new()).is_err());
        let mut rw = Rewriter::new();
        let mut input = PREFACE.to_vec();
        input.extend(headers_frame(1, END_HEADERS, &[0xff, 0xff, 0xff, 0xff]));
        assert!(rw.feed(&input, &mut Vec::new()).is_err());
    }

    #[test]
    fn long_header_blocks_are_split_into_continuations() {
        let mut out = Vec::new();
        let block = vec![0u8; MAX_FRAME_SIZE * 2 + 10];
        write_header_frames(5, 0, None, &block, &mut out);
        assert_eq!(out[3], HEADERS);
        assert_eq!(out[4] & END_HEADERS, 0);
        let second = 9 + MAX_FRAME_SIZE;
        assert_eq!(out[second + 3], CONTINUATION);
        let third = second + 9 + MAX_FRAME_SIZE;
        assert_eq!(out[third + 4] & END_HEADERS, END_HEADERS);
    }
}
