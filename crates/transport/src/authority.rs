//! Accepts gRPC clients that send a socket path as HTTP/2 `:authority`.
//!
//! grpc-go before 2022 (and so every kubelet before about 1.26, grpc-java, grpc-swift and
//! others) sends the Unix socket path, e.g. `/var/lib/kubelet/plugins_registry/x-reg.sock`, as
//! `:authority`. hyperium/h2, under tonic, rejects such a request with RST_STREAM
//! PROTOCOL_ERROR (hyperium/h2#487, unmerged), so a plugin served by tonic could never register
//! with those kubelets. [`AuthorityFix`] sits between the socket and the HTTP/2 server: it parses
//! the client's frames, decodes every header block (keeping the client's HPACK dynamic table in
//! step), replaces an `:authority` that is not a valid URI authority by `localhost`, and
//! re-encodes the block without the dynamic table. Every other frame passes through unchanged.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The smallest SETTINGS_MAX_FRAME_SIZE a peer may announce; what we emit stays under it.
const MAX_FRAME: usize = 16_384;
/// Largest frame accepted from the client (the server enforces its own, smaller limit).
const MAX_INPUT_FRAME: usize = 16 * 1024 * 1024;
/// Largest header block accepted from the client.
const MAX_HEADER_BLOCK: usize = 1024 * 1024;

/// The value put in place of an invalid `:authority`.
pub const FALLBACK_AUTHORITY: &[u8] = b"localhost";

/// A header block being collected across HEADERS and CONTINUATION frames.
struct Pending {
    stream: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
}

/// Rewrites the client-to-server half of an HTTP/2 connection (pure: bytes in, bytes out).
pub struct Rewriter {
    preface_left: usize,
    input: Vec<u8>,
    decoder: loona_hpack::Decoder<'static>,
    pending: Option<Pending>,
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
            .field("buffered", &self.input.len())
            .field("rewritten", &self.rewritten)
            .finish()
    }
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

impl Rewriter {
    /// A rewriter expecting the connection preface.
    pub fn new() -> Self {
        Self {
            preface_left: PREFACE.len(),
            input: Vec::new(),
            decoder: loona_hpack::Decoder::new(),
            pending: None,
            rewritten: 0,
        }
    }

    /// How many `:authority` values were replaced.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Takes `data` read from the client and appends what the server should read to `out`.
    pub fn feed(&mut self, mut data: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        if self.preface_left > 0 {
            let n = self.preface_left.min(data.len());
            out.extend_from_slice(&data[..n]);
            self.preface_left -= n;
            data = &data[n..];
        }
        self.input.extend_from_slice(data);
        let mut pos = 0;
        while self.input.len() - pos >= FRAME_HEADER {
            let h = &self.input[pos..pos + FRAME_HEADER];
            let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
            if len > MAX_INPUT_FRAME {
                return Err(invalid(format!("HTTP/2 frame of {len} bytes")));
            }
            if self.input.len() - pos < FRAME_HEADER + len {
                break;
            }
            let (kind, flags) = (h[3], h[4]);
            let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            let frame_end = pos + FRAME_HEADER + len;
            match kind {
                HEADERS | CONTINUATION => {
                    let payload = self.input[pos + FRAME_HEADER..frame_end].to_vec();
                    self.header_frame(kind, flags, stream, &payload, out)?;
                }
                _ => {
                    if self.pending.is_some() {
                        return Err(invalid("frame interleaved inside a header block"));
                    }
                    out.extend_from_slice(&self.input[pos..frame_end]);
                }
            }
            pos = frame_end;
        }
        self.input.drain(..pos);
        Ok(())
    }

    fn header_frame(
        &mut self,
        kind: u8,
        flags: u8,
        stream: u32,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> io::Result<()> {
        let fragment = if kind == HEADERS {
            if self.pending.is_some() {
                return Err(invalid("HEADERS inside a header block"));
            }
            let mut p = payload;
            let mut pad = 0usize;
            if flags & PADDED != 0 {
                let (&n, rest) = p
                    .split_first()
                    .ok_or_else(|| invalid("short padded HEADERS"))?;
                pad = usize::from(n);
                p = rest;
            }
            let priority = if flags & PRIORITY != 0 {
                if p.len() < 5 {
                    return Err(invalid("short HEADERS priority"));
                }
                let mut pr = [0u8; 5];
                pr.copy_from_slice(&p[..5]);
                p = &p[5..];
                Some(pr)
            } else {
                None
            };
            if pad > p.len() {
                return Err(invalid("HEADERS padding longer than the frame"));
            }
            self.pending = Some(Pending {
                stream,
                flags,
                priority,
                block: Vec::new(),
            });
            &p[..p.len() - pad]
        } else {
            match &self.pending {
                Some(pd) if pd.stream == stream => payload,
                _ => return Err(invalid("CONTINUATION without a header block")),
            }
        };
        let pending = self.pending.as_mut().expect("set above");
        if pending.block.len() + fragment.len() > MAX_HEADER_BLOCK {
            return Err(invalid("header block too large"));
        }
        pending.block.extend_from_slice(fragment);
        if flags & END_HEADERS == 0 {
            return Ok(());
        }
        let pending = self.pending.take().expect("set above");
        let mut headers: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        self.decoder
            .decode_with_cb(&pending.block, |n, v| {
                headers.push((n.into_owned(), v.into_owned()))
            })
            .map_err(|e| invalid(format!("HPACK: {e:?}")))?;
        for (name, value) in headers.iter_mut() {
            if name.as_slice() == b":authority" && !valid_authority(value) {
                *value = FALLBACK_AUTHORITY.to_vec();
                self.rewritten += 1;
            }
        }
        let mut block = Vec::with_capacity(pending.block.len() + 16);
        for (name, value) in &headers {
            encode_literal(name, value, &mut block);
        }
        write_header_frames(
            pending.stream,
            pending.flags & END_STREAM,
            pending.priority,
            &block,
            out,
        );
        Ok(())
    }
}

fn valid_authority(v: &[u8]) -> bool {
    !v.is_empty() && http::uri::Authority::try_from(v).is_ok()
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
    let first = block.len().min(MAX_FRAME - prio_len);
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
        let n = rest.len().min(MAX_FRAME);
        let flags = if n == rest.len() { END_HEADERS } else { 0 };
        frame_header(n, CONTINUATION, flags, stream, out);
        out.extend_from_slice(&rest[..n]);
        rest = &rest[n..];
    }
}

/// A server-side connection whose client-to-server bytes go through a [`Rewriter`].
#[derive(Debug)]
pub struct AuthorityFix<S> {
    inner: S,
    rewriter: Rewriter,
    out: Vec<u8>,
    out_pos: usize,
    scratch: Box<[u8]>,
}

impl<S> AuthorityFix<S> {
    /// Wraps an accepted connection.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            rewriter: Rewriter::new(),
            out: Vec::new(),
            out_pos: 0,
            scratch: vec![0u8; 16 * 1024].into_boxed_slice(),
        }
    }

    /// The wrapped connection.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
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
            let mut rb = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            if rb.filled().is_empty() {
                return Poll::Ready(Ok(()));
            }
            this.rewriter.feed(rb.filled(), &mut this.out)?;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
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
        let block = vec![0u8; MAX_FRAME * 2 + 10];
        write_header_frames(5, 0, None, &block, &mut out);
        assert_eq!(out[3], HEADERS);
        assert_eq!(out[4] & END_HEADERS, 0);
        let second = 9 + MAX_FRAME;
        assert_eq!(out[second + 3], CONTINUATION);
        let third = second + 9 + MAX_FRAME;
        assert_eq!(out[third + 4] & END_HEADERS, END_HEADERS);
    }
}
