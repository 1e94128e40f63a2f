//! The bytes of a KV hand-off between two CUDA executors (P/D disaggregation): what
//! [`CudaExecutor::export_kv`](super::CudaExecutor::export_kv) writes on the prefill side and
//! [`CudaExecutor::import_request`](super::CudaExecutor::import_request) reads on the decode
//! side, through host memory.
//!
//! A payload is a 32-byte header, then the KV of every token in sequence order:
//!
//! ```text
//! header: "FPKV" | version u16 | dtype u8 | 0 u8 | layers u32 | kv_heads u32 | head_dim u32
//!         | block_size u32 | tokens u32 | 0 u32                        (little-endian)
//! body:   [tokens][layers][K, V][kv_heads][head_dim] elements of `dtype`
//! ```
//!
//! The body is token-major, not block-major: a token range is one contiguous run of bytes, so
//! the executor moves it through a bounded staging buffer a chunk of tokens at a time (one
//! gather or scatter kernel and one copy per chunk), and the payload does not depend on
//! which blocks held the KV. The sender's block size is in the header for the record; a
//! receiver with another block size reads the same body. Layers, KV heads, head size and dtype
//! must be the receiver's: anything else is refused, naming the field, before any byte is
//! copied to the GPU.

use std::ops::Range;

/// The first bytes of every payload.
pub const MAGIC: [u8; 4] = *b"FPKV";
/// The body layout this code writes and reads.
pub const VERSION: u16 = 1;
/// Bytes before the body.
pub const HEADER_BYTES: usize = 32;

/// How one KV element is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    Bf16,
}

impl KvDtype {
    fn code(self) -> u8 {
        match self {
            KvDtype::Bf16 => 1,
        }
    }

    fn from_code(code: u8) -> Option<KvDtype> {
        match code {
            1 => Some(KvDtype::Bf16),
            _ => None,
        }
    }

    pub fn bytes(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Bf16 => "bf16",
        }
    }
}

/// The shape of a model's KV cache: what sender and receiver must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype: KvDtype,
}

impl KvShape {
    /// Elements of one token's K (or V) in one layer: the KV pool's row.
    pub fn row_elems(&self) -> usize {
        self.kv_heads as usize * self.head_dim as usize
    }

    /// Bytes of one token's K (or V) in one layer.
    pub fn row_bytes(&self) -> usize {
        self.row_elems() * self.dtype.bytes()
    }

    /// Bytes one token takes in the body: K and V of every layer.
    pub fn token_bytes(&self) -> usize {
        2 * self.layers as usize * self.row_bytes()
    }
}

/// A payload's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvHeader {
    pub shape: KvShape,
    /// The sender's tokens per block (informational: the body is per token).
    pub block_size: u32,
    /// Tokens whose KV the body holds, from the sequence's first.
    pub tokens: u32,
}

/// Why a payload cannot be imported here.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvPayloadError {
    #[error("the KV payload has {len} bytes, fewer than its {HEADER_BYTES}-byte header")]
    Short { len: usize },
    #[error("not a KV payload: it starts with {0:02x?}, not \"FPKV\"")]
    Magic([u8; 4]),
    #[error("KV payload version {0} is not understood (this engine reads version {VERSION})")]
    Version(u16),
    #[error("the KV payload's dtype code {0} is unknown (1 is bf16)")]
    Dtype(u8),
    #[error("the KV payload of {tokens} tokens should have {expected} bytes but has {len}")]
    Length { tokens: u32, expected: usize, len: usize },
    #[error("the KV payload's {field} is {payload}, this model's is {here}: the engines serve different models")]
    Mismatch { field: &'static str, payload: String, here: String },
    #[error("the KV payload holds {payload} tokens but the request needs the KV of {needed}")]
    Tokens { payload: u32, needed: u32 },
}

impl KvHeader {
    /// Bytes of the whole payload: header and body.
    pub fn payload_bytes(&self) -> usize {
        HEADER_BYTES + self.tokens as usize * self.shape.token_bytes()
    }

    /// Appends the header's 32 bytes to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let s = &self.shape;
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&[s.dtype.code(), 0]);
        for v in [s.layers, s.kv_heads, s.head_dim, self.block_size, self.tokens, 0] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    /// Reads the header of `payload` and checks that the body has the length it implies.
    pub fn decode(payload: &[u8]) -> Result<KvHeader, KvPayloadError> {
        let Some(h) = payload.get(..HEADER_BYTES) else { return Err(KvPayloadError::Short { len: payload.len() }) };
        let word = |at: usize| u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
        let magic = [h[0], h[1], h[2], h[3]];
        if magic != MAGIC {
            return Err(KvPayloadError::Magic(magic));
        }
        let version = u16::from_le_bytes([h[4], h[5]]);
        if version != VERSION {
            return Err(KvPayloadError::Version(version));
        }
        let dtype = KvDtype::from_code(h[6]).ok_or(KvPayloadError::Dtype(h[6]))?;
        let header = KvHeader {
            shape: KvShape { layers: word(8), kv_heads: word(12), head_dim: word(16), dtype },
            block_size: word(20),
            tokens: word(24),
        };
        // In u128: a forged header must not overflow the length check.
        let expected = HEADER_BYTES as u128
            + u128::from(header.tokens)
                * 2
                * u128::from(header.shape.layers)
                * u128::from(header.shape.kv_heads)
                * u128::from(header.shape.head_dim)
                * dtype.bytes() as u128;
        if expected != payload.len() as u128 {
            return Err(KvPayloadError::Length {
                tokens: header.tokens,
                expected: usize::try_from(expected).unwrap_or(usize::MAX),
                len: payload.len(),
            });
        }
        Ok(header)
    }

    /// Checks that the payload fits a receiver of KV shape `here` that needs the KV of
    /// `needed` tokens.
    pub fn check(&self, here: &KvShape, needed: u32) -> Result<(), KvPayloadError> {
        let p = &self.shape;
        let fields = [("layer count", p.layers, here.layers), ("KV head count", p.kv_heads, here.kv_heads)];
        for (field, payload, here) in fields.into_iter().chain([("head dim", p.head_dim, here.head_dim)]) {
            if payload != here {
                return Err(KvPayloadError::Mismatch { field, payload: payload.to_string(), here: here.to_string() });
            }
        }
        if p.dtype != here.dtype {
            return Err(KvPayloadError::Mismatch {
                field: "dtype",
                payload: p.dtype.name().into(),
                here: here.dtype.name().into(),
            });
        }
        if self.tokens != needed {
            return Err(KvPayloadError::Tokens { payload: self.tokens, needed });
        }
        Ok(())
    }
}

/// Token ranges of `tokens` tokens, each at most `per_chunk` long (at least one token per
/// chunk): what one staging buffer moves at a time.
pub fn chunks(tokens: u32, per_chunk: u32) -> impl Iterator<Item = Range<u32>> {
    let per_chunk = per_chunk.max(1);
    (0..tokens.div_ceil(per_chunk)).map(move |c| c * per_chunk..((c + 1) * per_chunk).min(tokens))
}

/// Byte offset in a payload of token `token`'s K (`v` false) or V row of layer `layer`.
pub fn row_offset(shape: &KvShape, token: u32, layer: u32, v: bool) -> usize {
    let row = (token as usize * shape.layers as usize + layer as usize) * 2 + usize::from(v);
    HEADER_BYTES + row * shape.row_bytes()
}

/// The body the gather kernel writes, computed on the host from a copy of the KV pool (`k`
/// and `v` laid out as [`KvPool`](super::KvPool): per layer `layer_elems` elements of
/// `[slots][kv_heads][head_dim]`): the reference the kernel's layout is tested against.
pub fn gather_host(
    shape: &KvShape,
    k: &[u16],
    v: &[u16],
    layer_elems: usize,
    table: &[u32],
    block_size: u32,
    tokens: u32,
) -> Vec<u8> {
    let row = shape.row_elems();
    let mut body = Vec::with_capacity(tokens as usize * shape.token_bytes());
    for t in 0..tokens {
        let slot = table[(t / block_size) as usize] as usize * block_size as usize + (t % block_size) as usize;
        for layer in 0..shape.layers as usize {
            for cache in [k, v] {
                let at = layer * layer_elems + slot * row;
                body.extend(cache[at..at + row].iter().flat_map(|x| x.to_le_bytes()));
            }
        }
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: KvShape = KvShape { layers: 2, kv_heads: 2, head_dim: 64, dtype: KvDtype::Bf16 };

    fn payload(tokens: u32) -> Vec<u8> {
        let header = KvHeader { shape: SHAPE, block_size: 16, tokens };
        let mut out = Vec::new();
        header.encode(&mut out);
        out.resize(header.payload_bytes(), 0xab);
        out
    }

    /// Pins the header's bytes: another implementation (or a later version of this one) must
    /// write the same 32 bytes for the same shape.
    #[test]
    fn the_header_layout_is_pinned() {
        let mut out = Vec::new();
        KvHeader { shape: SHAPE, block_size: 16, tokens: 300 }.encode(&mut out);
        let want: Vec<u8> = [
            &b"FPKV"[..],
            &[1, 0, 1, 0],
            &[2, 0, 0, 0],
            &[2, 0, 0, 0],
            &[64, 0, 0, 0],
            &[16, 0, 0, 0],
            &[44, 1, 0, 0],
            &[0, 0, 0, 0],
        ]
        .concat();
        assert_eq!(out, want);
        // 2 layers × (K, V) × 2 heads × 64 dims × 2 bytes = 1 KiB a token.
        assert_eq!(SHAPE.token_bytes(), 1024);
        assert_eq!(KvHeader { shape: SHAPE, block_size: 16, tokens: 300 }.payload_bytes(), 32 + 300 * 1024);
    }

    #[test]
    fn a_header_round_trips_and_checks_against_the_same_shape() {
        let p = payload(37);
        let h = KvHeader::decode(&p).unwrap();
        assert_eq!(h, KvHeader { shape: SHAPE, block_size: 16, tokens: 37 });
        assert_eq!(h.check(&SHAPE, 37), Ok(()));
        // Another block size reads the same token-major body.
        let mut other = p.clone();
        other[20] = 32;
        assert_eq!(KvHeader::decode(&other).unwrap().check(&SHAPE, 37), Ok(()));
    }

    #[test]
    fn malformed_payloads_are_refused_naming_what_is_wrong() {
        let check = |bytes: &[u8], want: &str| {
            let err = KvHeader::decode(bytes).unwrap_err().to_string();
            assert!(err.contains(want), "{err:?} should mention {want:?}");
        };
        let p = payload(5);
        check(&p[..20], "20 bytes, fewer than its 32-byte header");
        check(&[b"GGUF", &p[4..]].concat(), "not a KV payload");
        let mut v2 = p.clone();
        v2[4] = 2;
        check(&v2, "version 2 is not understood");
        let mut f8 = p.clone();
        f8[6] = 9;
        check(&f8, "dtype code 9 is unknown");
        check(&p[..p.len() - 1], "5 tokens should have 5152 bytes but has 5151");
        let mut huge = p.clone();
        huge[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        check(&huge, "should have");
    }

    #[test]
    fn a_payload_of_another_model_or_length_is_refused_naming_the_field() {
        let h = KvHeader::decode(&payload(10)).unwrap();
        let check = |here: KvShape, needed: u32, want: &str| {
            let err = h.check(&here, needed).unwrap_err().to_string();
            assert!(err.contains(want), "{err:?} should mention {want:?}");
        };
        check(KvShape { layers: 16, ..SHAPE }, 10, "layer count is 2, this model's is 16");
        check(KvShape { kv_heads: 8, ..SHAPE }, 10, "KV head count is 2, this model's is 8");
        check(KvShape { head_dim: 128, ..SHAPE }, 10, "head dim is 64, this model's is 128");
        check(SHAPE, 11, "holds 10 tokens but the request needs the KV of 11");
    }

    #[test]
    fn chunks_cover_every_token_once_in_order() {
        let all: Vec<Range<u32>> = chunks(10, 4).collect();
        assert_eq!(all, [0..4, 4..8, 8..10]);
        assert_eq!(chunks(8, 4).count(), 2);
        assert_eq!(chunks(0, 4).count(), 0);
        assert_eq!(chunks(3, 0).collect::<Vec<_>>(), [0..1, 1..2, 2..3], "at least a token a chunk");
    }

    /// The host gather reads each token's row through the block table, and puts K then V of
    /// each layer where `row_offset` says.
    #[test]
    fn the_body_is_token_major_through_the_block_table() {
        let shape = KvShape { layers: 2, kv_heads: 1, head_dim: 2, dtype: KvDtype::Bf16 };
        // A pool of 4 blocks of 2 slots, per layer; element = layer * 1000 + slot * 10 + dim,
        // plus 500 for V.
        let (blocks, bs, row) = (4usize, 2u32, 2usize);
        let layer_elems = blocks * bs as usize * row;
        let fill = |plus: u16| -> Vec<u16> {
            (0..2 * layer_elems)
                .map(|i| {
                    let (layer, rest) = (i / layer_elems, i % layer_elems);
                    (layer * 1000 + (rest / row) * 10 + rest % row) as u16 + plus
                })
                .collect()
        };
        let (k, v) = (fill(0), fill(500));
        // Tokens 0, 1 in block 3 (slots 6, 7); token 2 in block 1 (slot 2).
        let body = gather_host(&shape, &k, &v, layer_elems, &[3, 1], bs, 3);
        assert_eq!(body.len(), 3 * shape.token_bytes());
        let at = |t: u32, layer: u32, is_v: bool| {
            let o = row_offset(&shape, t, layer, is_v) - HEADER_BYTES;
            [u16::from_le_bytes([body[o], body[o + 1]]), u16::from_le_bytes([body[o + 2], body[o + 3]])]
        };
        assert_eq!(at(0, 0, false), [60, 61]);
        assert_eq!(at(1, 0, true), [570, 571]);
        assert_eq!(at(1, 1, false), [1070, 1071]);
        assert_eq!(at(2, 1, true), [1520, 1521]);
        assert_eq!(at(2, 0, false), [20, 21]);
    }
}
