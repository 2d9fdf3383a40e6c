//! The invariants of the `:authority` rewriter on arbitrary client bytes, shared by the property
//! test (`tests/authority_props.rs`) and the fuzz target (`fuzz/fuzz_targets/authority.rs`).
//!
//! Oracles that share no code with the rewriter: h2's own frame and HPACK decoder (`h2::Codec`,
//! public with h2's `unstable` feature) reads both what the client sent and what the rewriter
//! passes on, and loona-hpack sizes the decoded header lists. Invariants:
//! - no panic, and the rewriter's buffers and output per step stay within their bounds;
//! - if the rewriter accepts, h2 reads the same frames from its output as from its input, with
//!   only an `:authority` that is not a URI authority replaced by `localhost`, and the same
//!   connection error where h2 finds one;
//! - if it refuses, the input breaks a bound or a rule: h2 or loona-hpack fails on it, or a
//!   frame, header block, decoded header list or CONTINUATION run is over its limit, or it holds
//!   a PUSH_PROMISE.

use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use plugreg_transport::authority::{
    MAX_CONTINUATIONS, MAX_FRAME_SIZE, MAX_HEADER_BLOCK, MAX_HEADER_LIST_SIZE, MAX_TABLE_SIZE,
    Rewriter,
};
use tokio_stream::Stream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The output the check lets the rewriter prepare at once, as `AuthorityFix` does.
const OUT_LIMIT: usize = 4096;

/// A request's header block as h2 decoded it.
#[derive(Debug, PartialEq)]
struct Head {
    stream: u32,
    end_stream: bool,
    pseudo: [Option<String>; 6],
    fields: Vec<(String, Vec<u8>)>,
}

/// What h2 reads from a byte stream, frame by frame.
#[derive(Debug, PartialEq)]
enum Event {
    Headers(Head),
    /// Any other frame, by its Debug form.
    Frame(String),
    /// An error h2 resets one stream for, and reads on.
    StreamError(String),
    /// An error h2 ends the connection for; nothing is read after it.
    ConnError(String),
}

/// Whether the rewriter must replace this `:authority` (the rule, restated).
fn must_rewrite(v: &str) -> bool {
    v.is_empty() || http::uri::Authority::try_from(v).is_err()
}

/// Reads `bytes` (after the preface) with h2's codec until the end or a connection error.
fn h2_events(bytes: &[u8]) -> Vec<Event> {
    let io = std::io::Cursor::new(bytes.to_vec());
    let mut codec = h2::Codec::from(io);
    let mut cx = Context::from_waker(Waker::noop());
    let mut events = Vec::new();
    loop {
        match Pin::new(&mut codec).poll_next(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => events.push(match frame {
                h2::frame::Frame::Headers(h) => {
                    let stream = u32::from(h.stream_id());
                    let end_stream = h.is_end_stream();
                    let (p, map) = h.into_parts();
                    let s = |v: Option<&str>| v.map(str::to_owned);
                    Event::Headers(Head {
                        stream,
                        end_stream,
                        pseudo: [
                            p.method.map(|m| m.to_string()),
                            s(p.scheme.as_deref()),
                            s(p.authority.as_deref()),
                            s(p.path.as_deref()),
                            p.protocol.map(|v| format!("{v:?}")),
                            p.status.map(|v| v.to_string()),
                        ],
                        fields: map
                            .iter()
                            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                            .collect(),
                    })
                }
                other => Event::Frame(format!("{other:?}")),
            }),
            Poll::Ready(Some(Err(h2::proto::Error::Reset(id, reason, _)))) => {
                events.push(Event::StreamError(format!("{id:?} {reason:?}")))
            }
            Poll::Ready(Some(Err(h2::proto::Error::GoAway(_, reason, _)))) => {
                events.push(Event::ConnError(format!("{reason:?}")));
                break;
            }
            // The end, or a frame cut short by the end (the rewriter may hold a partial header
            // block back): not compared.
            Poll::Ready(Some(Err(h2::proto::Error::Io(..)))) | Poll::Ready(None) => break,
            Poll::Pending => unreachable!("a Cursor never blocks"),
        }
    }
    events
}

/// Replaces what the rewriter replaces in what h2 read from the client.
fn rewritten(mut events: Vec<Event>) -> Vec<Event> {
    for e in &mut events {
        if let Event::Headers(h) = e
            && let Some(a) = &mut h.pseudo[2]
            && must_rewrite(a)
        {
            *a = "localhost".into();
        }
    }
    events
}

/// Whether the input breaks a bound or rule of the rewriter's, seen through a small framer of
/// the check's own and loona-hpack.
fn breaks_a_bound(body: &[u8]) -> bool {
    let mut loona = loona_hpack::Decoder::new();
    loona.set_max_allowed_table_size(MAX_TABLE_SIZE);
    let mut pos = 0;
    // The header block being collected, its stream and its CONTINUATION count.
    let mut block: Option<(Vec<u8>, u32, usize)> = None;
    while body.len() - pos >= 9 {
        let h = &body[pos..pos + 9];
        let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
        let (kind, flags) = (h[3], h[4]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        // What the frame header alone breaks, as the rewriter sees it before the payload.
        if len > MAX_FRAME_SIZE || kind == 0x5 || (kind == 0x9) != block.is_some() {
            return true;
        }
        if let Some((_, s, n)) = &mut block {
            *n += 1;
            if *s != stream || *n > MAX_CONTINUATIONS {
                return true;
            }
        }
        let Some(payload) = body.get(pos + 9..pos + 9 + len) else {
            return false;
        };
        pos += 9 + len;
        let fragment = match kind {
            0x1 => {
                let mut p = payload;
                let mut pad = 0;
                if flags & 0x8 != 0 {
                    let Some((&n, rest)) = p.split_first() else {
                        return true;
                    };
                    pad = usize::from(n);
                    p = rest;
                }
                if flags & 0x20 != 0 {
                    let Some(rest) = p.get(5..) else { return true };
                    p = rest;
                }
                let Some(p) = p.get(..p.len().checked_sub(pad).unwrap_or(usize::MAX)) else {
                    return true;
                };
                block = Some((Vec::new(), stream, 0));
                p
            }
            0x9 => payload,
            _ => continue,
        };
        let Some((b, _, _)) = &mut block else {
            return true;
        };
        if b.len() + fragment.len() > MAX_HEADER_BLOCK {
            return true;
        }
        b.extend_from_slice(fragment);
        if flags & 0x4 != 0 {
            let b = block.take().map(|(b, _, _)| b).unwrap_or_default();
            let mut size = 0usize;
            let decoded = loona.decode_with_cb(&b, |n, v| size += n.len() + v.len() + 32);
            if decoded.is_err() || size > MAX_HEADER_LIST_SIZE {
                return true;
            }
        }
    }
    false
}

/// Checks the rewriter on `data`: its first byte picks how the rest is cut into reads, the rest
/// follows the connection preface. Returns whether the rewriter accepted it.
pub fn check(data: &[u8]) -> bool {
    let Some((&cut, body)) = data.split_first() else {
        return true;
    };
    let piece = if cut == 0 {
        usize::MAX
    } else {
        usize::from(cut)
    };
    let mut input = PREFACE.to_vec();
    input.extend_from_slice(body);

    let mut rw = Rewriter::new();
    let mut out = Vec::new();
    let mut step = Vec::new();
    let mut refused = None;
    'feed: for mut read in input.chunks(piece.min(input.len())) {
        while !read.is_empty() {
            match rw.feed_some(read, &mut step, OUT_LIMIT) {
                Ok(n) => read = &read[n..],
                Err(e) => {
                    refused = Some(e);
                    break 'feed;
                }
            }
            assert!(
                step.len() <= OUT_LIMIT + MAX_HEADER_LIST_SIZE + 3 * 9 + 5,
                "{} bytes of output prepared at once",
                step.len()
            );
            assert!(rw.buffered() <= MAX_FRAME_SIZE + MAX_HEADER_BLOCK + 9);
            out.append(&mut step);
        }
    }
    out.append(&mut step);
    assert!(out.starts_with(PREFACE) || refused.is_some());

    let expected = rewritten(h2_events(body));
    let got = h2_events(out.get(PREFACE.len()..).unwrap_or_default());
    match refused {
        None => {
            // h2 reads the same from both, up to a connection error it then finds in both.
            let mut expected = expected;
            if rw.in_header_block() && got.len() < expected.len() {
                // h2 decodes a header block frame by frame and may fail on the first frames of
                // one the input leaves unfinished; the rewriter holds such frames back.
                expected.pop_if(|e| matches!(e, Event::ConnError(_) | Event::StreamError(_)));
            }
            let n = expected.len().min(got.len());
            assert_eq!(got[..n], expected[..n], "what h2 read from the output");
            assert_eq!(
                got.len(),
                expected.len(),
                "h2 read {got:#?} from the output but {expected:#?} from the input"
            );
            true
        }
        Some(e) => {
            // What went through before the refusal reads as it did from the input.
            assert!(
                got.len() <= expected.len() && got[..] == expected[..got.len()],
                "output before the refusal: {got:#?} vs {expected:#?}"
            );
            let h2_objects = expected
                .iter()
                .any(|e| matches!(e, Event::ConnError(_) | Event::StreamError(_)));
            assert!(
                h2_objects || breaks_a_bound(body),
                "refused ({e}) input that h2 and loona-hpack accept within every bound: {expected:#?}"
            );
            false
        }
    }
}
