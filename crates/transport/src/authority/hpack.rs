//! A bounded HPACK decoder (RFC 7541) for the client-to-server direction.
//!
//! Written for [`super::Rewriter`]: it charges every field against the header-list budget
//! (name + value + 32 bytes, RFC 7541 §4.1, as h2 counts) *before* copying or Huffman-decoding
//! it, keeps the dynamic table within [`super::MAX_TABLE_SIZE`], and hands each field to a
//! callback as borrowed bytes instead of building a list. A header block that references one
//! large table entry thousands of times therefore costs at most the budget, never
//! entries x references.

use std::collections::VecDeque;

use super::{Reason, Refused};

/// The static table (RFC 7541 Appendix A); index 1 is the first entry.
const STATIC: [(&[u8], &[u8]); 61] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

/// Code length in bits of each symbol of the HPACK Huffman code (RFC 7541 Appendix B; symbol
/// 256 is EOS). The code is canonical, so these lengths determine every code word.
const HUFFMAN_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28,
    28, 28, 28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5,
    5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6,
    6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22,
    23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22,
    21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20,
    22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19,
    21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22,
    22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, 30,
];

/// The canonical-code tables derived from [`HUFFMAN_LENGTHS`].
struct Canonical {
    /// How many code words have each length.
    count: [u32; 31],
    /// The numerically smallest code word of each length.
    first: [u32; 31],
    /// Where the symbols of each length start in `symbols`.
    offset: [u16; 31],
    /// Symbols ordered by (length, symbol).
    symbols: [u16; 257],
}

const fn canonical() -> Canonical {
    let mut c = Canonical {
        count: [0; 31],
        first: [0; 31],
        offset: [0; 31],
        symbols: [0; 257],
    };
    let mut n = 0;
    let mut len = 1;
    while len <= 30 {
        c.offset[len] = n as u16;
        let mut sym = 0;
        while sym < 257 {
            if HUFFMAN_LENGTHS[sym] as usize == len {
                c.symbols[n] = sym as u16;
                c.count[len] += 1;
                n += 1;
            }
            sym += 1;
        }
        len += 1;
    }
    let mut code = 0u32;
    let mut len = 1;
    while len <= 30 {
        c.first[len] = code;
        code = (code + c.count[len]) << 1;
        len += 1;
    }
    c
}

const CANONICAL: Canonical = canonical();
const EOS: u16 = 256;

fn compression(what: &'static str) -> Refused {
    Refused::new(Reason::CompressionError, what)
}

fn too_large() -> Refused {
    Refused::new(
        Reason::EnhanceYourCalm,
        "decoded header list larger than 16 KiB",
    )
}

/// Decodes Huffman-coded `src` into `dst`, refusing once `dst` would exceed `budget` bytes.
fn huffman(src: &[u8], dst: &mut Vec<u8>, budget: usize) -> Result<(), Refused> {
    let c = &CANONICAL;
    let mut code = 0u32;
    let mut len = 0usize;
    for &byte in src {
        for bit in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> bit) & 1);
            len += 1;
            let i = code.wrapping_sub(c.first[len]);
            if i < c.count[len] {
                let sym = c.symbols[usize::from(c.offset[len]) + i as usize];
                if sym == EOS {
                    return Err(compression("EOS symbol inside a Huffman string"));
                }
                if dst.len() >= budget {
                    return Err(too_large());
                }
                dst.push(sym as u8);
                code = 0;
                len = 0;
            } else if len == 30 {
                return Err(compression("invalid Huffman code"));
            }
        }
    }
    // At most 7 bits of padding, and they must be the most significant bits of EOS (all ones).
    if len > 7 || code != (1u32 << len) - 1 {
        return Err(compression("invalid Huffman padding"));
    }
    Ok(())
}

/// Reads an integer with an `prefix`-bit prefix (RFC 7541 §5.1), at most 5 bytes long as in
/// h2, so the value stays below 2^28.
fn integer(src: &mut &[u8], prefix: u8) -> Result<usize, Refused> {
    let (&first, rest) = src
        .split_first()
        .ok_or_else(|| compression("truncated integer"))?;
    *src = rest;
    let mask = (1u8 << prefix) - 1;
    let mut value = usize::from(first & mask);
    if value < usize::from(mask) {
        return Ok(value);
    }
    for shift in [0, 7, 14, 21] {
        let (&b, rest) = src
            .split_first()
            .ok_or_else(|| compression("truncated integer"))?;
        *src = rest;
        value += usize::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(compression("integer longer than 5 bytes"))
}

/// Reads a string literal into `dst`, refusing before it decodes more than `budget` bytes.
fn string(src: &mut &[u8], dst: &mut Vec<u8>, budget: usize) -> Result<(), Refused> {
    let huff = src.first().is_some_and(|b| b & 0x80 != 0);
    let len = integer(src, 7)?;
    if len > src.len() {
        return Err(compression("truncated string"));
    }
    let (raw, rest) = src.split_at(len);
    *src = rest;
    dst.clear();
    if huff {
        huffman(raw, dst, budget)
    } else if len > budget {
        Err(too_large())
    } else {
        dst.extend_from_slice(raw);
        Ok(())
    }
}

/// One dynamic-table entry: name and value in one allocation.
struct Entry {
    bytes: Box<[u8]>,
    name_len: usize,
}

impl Entry {
    fn name(&self) -> &[u8] {
        &self.bytes[..self.name_len]
    }
    fn value(&self) -> &[u8] {
        &self.bytes[self.name_len..]
    }
    fn size(&self) -> usize {
        self.bytes.len() + 32
    }
}

/// The decoding side of one connection's HPACK state.
pub(super) struct Decoder {
    /// Newest first.
    table: VecDeque<Entry>,
    size: usize,
    max_size: usize,
    name: Vec<u8>,
    value: Vec<u8>,
}

impl Decoder {
    pub(super) fn new() -> Self {
        Self {
            table: VecDeque::new(),
            size: 0,
            max_size: super::MAX_TABLE_SIZE,
            name: Vec::new(),
            value: Vec::new(),
        }
    }

    fn evict_to(&mut self, max: usize) {
        while self.size > max {
            match self.table.pop_back() {
                Some(e) => self.size -= e.size(),
                None => break,
            }
        }
    }

    fn get(&self, index: usize) -> Result<(&[u8], &[u8]), Refused> {
        match index {
            0 => Err(compression("header index 0")),
            1..=61 => Ok(STATIC[index - 1]),
            _ => self
                .table
                .get(index - 62)
                .map(|e| (e.name(), e.value()))
                .ok_or_else(|| compression("header index past the dynamic table")),
        }
    }

    /// Decodes one complete header block, calling `emit` for each field in order. Refuses
    /// (leaving the table in an unspecified state: the connection must end) when the block is
    /// malformed or its header list exceeds `limit` bytes.
    pub(super) fn decode(
        &mut self,
        mut src: &[u8],
        limit: usize,
        mut emit: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), Refused> {
        let mut total = 0usize;
        let mut seen_field = false;
        while let Some(&b) = src.first() {
            if b & 0x80 != 0 {
                let (name, value) = self.get(integer(&mut src, 7)?)?;
                total += name.len() + value.len() + 32;
                if total > limit {
                    return Err(too_large());
                }
                emit(name, value);
            } else if b & 0xe0 == 0x20 {
                // Only before the first field (RFC 7541 §4.2), as h2 enforces.
                if seen_field {
                    return Err(compression("dynamic table size update after a field"));
                }
                let size = integer(&mut src, 5)?;
                if size > super::MAX_TABLE_SIZE {
                    return Err(compression("dynamic table size update above 4096"));
                }
                self.max_size = size;
                self.evict_to(size);
                continue;
            } else {
                // 01xxxxxx: literal with incremental indexing; 0000xxxx / 0001xxxx: without
                // indexing / never indexed (the same thing to a decoder).
                let index = b & 0x40 != 0;
                let name_index = integer(&mut src, if index { 6 } else { 4 })?;
                let budget = limit.checked_sub(total + 32).ok_or_else(too_large)?;
                let mut name = std::mem::take(&mut self.name);
                let named = if name_index == 0 {
                    string(&mut src, &mut name, budget)
                } else {
                    self.get(name_index).and_then(|(n, _)| {
                        if n.len() > budget {
                            return Err(too_large());
                        }
                        name.clear();
                        name.extend_from_slice(n);
                        Ok(())
                    })
                };
                let mut value = std::mem::take(&mut self.value);
                let valued = named.and_then(|()| string(&mut src, &mut value, budget - name.len()));
                if let Err(e) = valued {
                    self.name = name;
                    self.value = value;
                    return Err(e);
                }
                total += name.len() + value.len() + 32;
                emit(&name, &value);
                if index {
                    self.insert(&name, &value);
                }
                self.name = name;
                self.value = value;
            }
            seen_field = true;
        }
        Ok(())
    }

    fn insert(&mut self, name: &[u8], value: &[u8]) {
        let size = name.len() + value.len() + 32;
        if size > self.max_size {
            // RFC 7541 §4.4: an entry larger than the table empties it and is not added.
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict_to(self.max_size - size);
        let mut bytes = Vec::with_capacity(name.len() + value.len());
        bytes.extend_from_slice(name);
        bytes.extend_from_slice(value);
        self.table.push_front(Entry {
            bytes: bytes.into_boxed_slice(),
            name_len: name.len(),
        });
        self.size += size;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_static_table_matches_an_independent_decoder() {
        let mut other = loona_hpack::Decoder::new();
        for i in 1..=61u8 {
            let got = other.decode(&[0x80 | i]).unwrap();
            let (n, v) = STATIC[usize::from(i) - 1];
            assert_eq!(got, vec![(n.to_vec(), v.to_vec())], "index {i}");
        }
    }

    #[test]
    fn huffman_decodes_the_rfc_example_and_every_byte() {
        let all: Vec<u8> = (0..=255u8).collect();
        // RFC 7541 C.4.1: "www.example.com".
        let mut out = Vec::new();
        huffman(
            &[
                0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
            ],
            &mut out,
            100,
        )
        .unwrap();
        assert_eq!(out, b"www.example.com");
        let encoded = encode_huffman(&all);
        out.clear();
        huffman(&encoded, &mut out, 1000).unwrap();
        assert_eq!(out, all);
        assert!(huffman(&encoded, &mut Vec::new(), 255).is_err(), "budget");
        // Padding of 8 bits, padding that is not all ones, and an explicit EOS are refused.
        assert!(huffman(&[0xf1, 0xe3, 0xff], &mut Vec::new(), 100).is_err());
        let mut zero = Vec::new();
        huffman(&[0x07], &mut zero, 100).unwrap();
        assert_eq!(zero, b"0", "5-bit '0' and 3 bits of padding");
        assert!(huffman(&[0x00], &mut Vec::new(), 100).is_err());
        assert!(huffman(&[0xff, 0xff, 0xff, 0xfc], &mut Vec::new(), 100).is_err());
    }

    /// Encodes with codes derived from the lengths (canonical assignment), for the test only.
    fn encode_huffman(src: &[u8]) -> Vec<u8> {
        let c = &CANONICAL;
        let mut codes = [(0u32, 0usize); 257];
        for len in 1..=30 {
            for i in 0..c.count[len] {
                let sym = c.symbols[usize::from(c.offset[len]) + i as usize];
                codes[usize::from(sym)] = (c.first[len] + i, len);
            }
        }
        let (mut acc, mut bits, mut out) = (0u64, 0usize, Vec::new());
        for &b in src {
            let (code, len) = codes[usize::from(b)];
            acc = (acc << len) | u64::from(code);
            bits += len;
            while bits >= 8 {
                out.push((acc >> (bits - 8)) as u8);
                bits -= 8;
            }
        }
        if bits > 0 {
            out.push(((acc << (8 - bits)) as u8) | ((1u8 << (8 - bits)) - 1));
        }
        out
    }

    #[test]
    fn rfc_7541_c3_requests_keep_the_table_in_step() {
        let mut d = Decoder::new();
        let blocks: [&[u8]; 3] = [
            b"\x82\x86\x84\x41\x0fwww.example.com",
            b"\x82\x86\x84\xbe\x58\x08no-cache",
            b"\x82\x87\x85\xbf\x40\x0acustom-key\x0ccustom-value",
        ];
        let mut lists = Vec::new();
        for b in blocks {
            let mut l = Vec::new();
            d.decode(b, 16384, |n, v| l.push((n.to_vec(), v.to_vec())))
                .unwrap();
            lists.push(l);
        }
        assert_eq!(
            lists[2][3],
            (b":authority".to_vec(), b"www.example.com".to_vec())
        );
        assert_eq!(
            lists[2][4],
            (b"custom-key".to_vec(), b"custom-value".to_vec())
        );
        assert_eq!(d.size, 164, "RFC 7541 C.3.3 table size");
    }

    #[test]
    fn refuses_past_the_budget_before_copying() {
        let mut d = Decoder::new();
        // One 4000-byte entry into the table, then references to it.
        let mut block = vec![0x40, 0x01, b'x', 0x7f, 0xa1, 0x1e];
        block.extend(std::iter::repeat_n(b'a', 4000));
        block.extend(std::iter::repeat_n(0xbe, 1000));
        let mut emitted = 0usize;
        let err = d
            .decode(&block, 16384, |n, v| emitted += n.len() + v.len() + 32)
            .unwrap_err();
        assert_eq!(err.reason, Reason::EnhanceYourCalm);
        assert!(emitted <= 16384);
    }

    #[test]
    fn refuses_table_size_updates_above_4096_or_after_a_field() {
        let mut d = Decoder::new();
        assert_eq!(
            d.decode(&[0x3f, 0xe2, 0x1f], 16384, |_, _| ())
                .unwrap_err()
                .reason,
            Reason::CompressionError
        );
        let mut d = Decoder::new();
        assert!(
            d.decode(&[0x3f, 0xe1, 0x1f], 16384, |_, _| ()).is_ok(),
            "4096 is fine"
        );
        assert!(d.decode(&[0x82, 0x20], 16384, |_, _| ()).is_err());
    }
}
