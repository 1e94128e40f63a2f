//! The KV events vLLM and SGLang publish over ZMQ, decoded: each message is three frames
//! `[topic, 8-byte big-endian sequence number, msgpack batch]`, the batch `[ts, [events],
//! dp_rank]` (or a map with those keys), each event either a map tagged `"type"` (vLLM since
//! mid-2026) or a positional array whose first element is the tag (vLLM before, SGLang).
//! Nothing here touches a socket: [`decode_message`] takes the frames.

use engine::kv::Tier;
use rmpv::Value;

/// A block hash as the engine computes it: vLLM has sent 64-bit integers and, since it
/// hashes with SHA-256, byte strings. Only compared, never recomputed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EngineHash {
    Int(i128),
    Bytes(Box<[u8]>),
}

/// One KV cache event of an engine, in the engine's own hashes.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// Blocks newly cached, in chain order: `token_ids` holds `block_size` tokens per block.
    Stored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        tier: Tier,
    },
    Removed {
        hashes: Vec<EngineHash>,
        tier: Tier,
    },
    /// The engine dropped its whole cache.
    Cleared,
}

/// One published message.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub seq: u64,
    pub events: Batched,
}

/// A batch's events, and those of them that could not be read, each with its reason: one
/// bad event (a kind this decoder does not know, or vLLM's placeholder for offloaded blocks
/// it could not describe, with no token ids) loses nothing else of its batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batched {
    pub events: Vec<EngineEvent>,
    pub skipped: Vec<DecodeError>,
}

/// Why a message could not be read; names the part that was wrong.
#[derive(Clone, Debug, thiserror::Error, PartialEq)]
pub enum DecodeError {
    #[error("expected 3 frames (topic, sequence, payload), got {0}")]
    Frames(usize),
    #[error("the sequence frame has {0} bytes, not 8")]
    Sequence(usize),
    #[error("the payload is not msgpack: {0}")]
    Msgpack(String),
    #[error("{0}")]
    Shape(String),
}

fn shape(what: impl Into<String>) -> DecodeError {
    DecodeError::Shape(what.into())
}

/// The sequence frame vLLM sends after the last batch of a replay (-1).
pub const END_OF_REPLAY: u64 = u64::MAX;

/// Reads a sequence-number frame.
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| DecodeError::Sequence(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Decodes one message from its frames.
pub fn decode_message(frames: &[&[u8]]) -> Result<Batch, DecodeError> {
    let [_topic, seq, payload] = frames else { return Err(DecodeError::Frames(frames.len())) };
    Ok(Batch { seq: decode_seq(seq)?, events: decode_batch(payload)? })
}

/// Decodes a batch's msgpack payload to its events; an event that cannot be read is listed
/// in `skipped` (named by its place in the batch), the batch itself only fails whole when
/// it is not a batch.
pub fn decode_batch(mut payload: &[u8]) -> Result<Batched, DecodeError> {
    let value = rmpv::decode::read_value(&mut payload).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let events = match &value {
        Value::Array(fields) => fields.get(1).ok_or_else(|| shape("the batch array has no events"))?,
        Value::Map(_) => field(&value, "events").ok_or_else(|| shape("the batch map has no `events`"))?,
        other => return Err(shape(format!("the batch is {}, not an array or map", kind(other)))),
    };
    let events = events.as_array().ok_or_else(|| shape("the batch's events are not an array"))?;
    let mut out = Batched::default();
    for (i, e) in events.iter().enumerate() {
        match decode_event(e) {
            Ok(e) => out.events.push(e),
            Err(e) => out.skipped.push(shape(format!("event {i}: {e}"))),
        }
    }
    Ok(out)
}

/// The names of the positional fields after the tag, in the order both vLLM's older
/// encoding and SGLang's use.
const STORED_FIELDS: [&str; 6] = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"];
const REMOVED_FIELDS: [&str; 2] = ["block_hashes", "medium"];

/// An event's fields by name, whichever encoding it came in.
struct Fields<'a> {
    tag: &'a str,
    named: Vec<(&'a str, &'a Value)>,
}

impl<'a> Fields<'a> {
    fn of(event: &'a Value) -> Result<Fields<'a>, DecodeError> {
        match event {
            Value::Map(entries) => {
                let mut named = Vec::with_capacity(entries.len());
                for (k, v) in entries {
                    named.push((k.as_str().ok_or_else(|| shape("a field name is not a string"))?, v));
                }
                let tag = named
                    .iter()
                    .find(|(k, _)| *k == "type")
                    .and_then(|(_, v)| v.as_str())
                    .ok_or_else(|| shape("the event map has no `type`"))?;
                Ok(Fields { tag, named })
            }
            Value::Array(items) => {
                let tag = items.first().and_then(Value::as_str).ok_or_else(|| shape("the event array has no tag"))?;
                let names: &[&str] = match tag {
                    "BlockStored" => &STORED_FIELDS,
                    "BlockRemoved" => &REMOVED_FIELDS,
                    _ => &[],
                };
                Ok(Fields { tag, named: names.iter().copied().zip(&items[1..]).collect() })
            }
            other => Err(shape(format!("the event is {}, not a map or array", kind(other)))),
        }
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.named.iter().find(|(k, _)| *k == name).map(|(_, v)| *v).filter(|v| !v.is_nil())
    }

    fn required(&self, name: &str) -> Result<&'a Value, DecodeError> {
        self.get(name).ok_or_else(|| shape(format!("{} without `{name}`", self.tag)))
    }
}

fn decode_event(event: &Value) -> Result<EngineEvent, DecodeError> {
    let f = Fields::of(event)?;
    match f.tag {
        "BlockStored" => {
            let hashes = hashes(f.required("block_hashes")?)?;
            let parent = f.get("parent_block_hash").map(hash).transpose()?;
            let token_ids = f
                .required("token_ids")?
                .as_array()
                .ok_or_else(|| shape("`token_ids` is not an array"))?
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| shape("a token id is not a u32")))
                .collect::<Result<Vec<_>, _>>()?;
            let block_size = f
                .required("block_size")?
                .as_u64()
                .and_then(|b| u32::try_from(b).ok())
                .filter(|&b| b > 0)
                .ok_or_else(|| shape("`block_size` is not a positive integer"))?;
            if token_ids.len() != hashes.len() * block_size as usize {
                return Err(shape(format!(
                    "{} token ids for {} blocks of {block_size} tokens",
                    token_ids.len(),
                    hashes.len()
                )));
            }
            Ok(EngineEvent::Stored { hashes, parent, token_ids, block_size, tier: tier(f.get("medium"))? })
        }
        "BlockRemoved" => {
            Ok(EngineEvent::Removed { hashes: hashes(f.required("block_hashes")?)?, tier: tier(f.get("medium"))? })
        }
        "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        other => Err(shape(format!("unknown event type `{other}`"))),
    }
}

fn field<'a>(map: &'a Value, name: &str) -> Option<&'a Value> {
    map.as_map()?.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v)
}

fn hashes(v: &Value) -> Result<Vec<EngineHash>, DecodeError> {
    v.as_array().ok_or_else(|| shape("`block_hashes` is not an array"))?.iter().map(hash).collect()
}

fn hash(v: &Value) -> Result<EngineHash, DecodeError> {
    match v {
        Value::Integer(i) => i
            .as_i64()
            .map(i128::from)
            .or_else(|| i.as_u64().map(i128::from))
            .map(EngineHash::Int)
            .ok_or_else(|| shape("a block hash is out of range")),
        Value::Binary(b) => Ok(EngineHash::Bytes(b.clone().into_boxed_slice())),
        Value::String(s) => Ok(EngineHash::Bytes(s.as_bytes().to_vec().into_boxed_slice())),
        other => Err(shape(format!("a block hash is {}", kind(other)))),
    }
}

/// The tier a medium names: the GPU's memory is L1, host memory L2, anything further
/// (disk, a file system, shared storage, an object store) L3. No medium: the GPU.
pub fn tier(medium: Option<&Value>) -> Result<Tier, DecodeError> {
    let Some(m) = medium else { return Ok(Tier::L1) };
    let name = m.as_str().ok_or_else(|| shape("`medium` is not a string"))?;
    match name.to_ascii_uppercase().as_str() {
        "GPU" | "HBM" => Ok(Tier::L1),
        "CPU" | "CPU_PINNED" | "HOST" => Ok(Tier::L2),
        "DISK" | "FS" | "FILE" | "STORAGE" | "OBJ" | "OBJECT" | "REMOTE" => Ok(Tier::L3),
        _ => Err(shape(format!("unknown medium `{name}`"))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "a boolean",
        Value::Integer(_) => "an integer",
        Value::F32(_) | Value::F64(_) => "a float",
        Value::String(_) => "a string",
        Value::Binary(_) => "bytes",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
        Value::Ext(..) => "an extension",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).expect("encode");
        out
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    fn ints(xs: &[u64]) -> Value {
        Value::Array(xs.iter().map(|&x| Value::from(x)).collect())
    }

    /// vLLM's encoding since mid-2026: events are maps tagged "type".
    fn tagged_batch() -> Value {
        let stored = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(vec![Value::Binary(vec![1; 32]), Value::Binary(vec![2; 32])])),
            (s("parent_block_hash"), Value::Nil),
            (s("token_ids"), ints(&[1, 2, 3, 4])),
            (s("block_size"), Value::from(2)),
            (s("lora_id"), Value::Nil),
            (s("medium"), s("GPU")),
            (s("lora_name"), Value::Nil),
        ]);
        let removed = Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), Value::Array(vec![Value::Binary(vec![2; 32])])),
            (s("medium"), s("CPU")),
        ]);
        let cleared = Value::Map(vec![(s("type"), s("AllBlocksCleared"))]);
        Value::Array(vec![Value::F64(1.5), Value::Array(vec![stored, removed, cleared]), Value::from(0)])
    }

    #[test]
    fn tagged_maps_decode() {
        let seq = 7u64.to_be_bytes();
        let payload = encode(&tagged_batch());
        let batch = decode_message(&[b"kv", &seq, &payload]).expect("decodes");
        assert_eq!(batch.seq, 7);
        let a = EngineHash::Bytes(vec![1; 32].into());
        let b = EngineHash::Bytes(vec![2; 32].into());
        assert_eq!(
            batch.events.events,
            vec![
                EngineEvent::Stored {
                    hashes: vec![a, b.clone()],
                    parent: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    tier: Tier::L1
                },
                EngineEvent::Removed { hashes: vec![b], tier: Tier::L2 },
                EngineEvent::Cleared,
            ]
        );
    }

    /// vLLM's encoding before mid-2026, and SGLang's: positional arrays, tag first.
    #[test]
    fn positional_arrays_decode() {
        let stored = Value::Array(vec![
            s("BlockStored"),
            ints(&[11, 12]),
            Value::from(10),
            ints(&[5, 6, 7, 8]),
            Value::from(2),
            Value::Nil,
            s("disk"),
        ]);
        let removed = Value::Array(vec![s("BlockRemoved"), Value::Array(vec![Value::from(-3)]), Value::Nil]);
        let cleared = Value::Array(vec![s("AllBlocksCleared")]);
        let batch = Value::Array(vec![Value::F64(2.0), Value::Array(vec![stored, removed, cleared])]);
        let events = decode_batch(&encode(&batch)).expect("decodes");
        assert!(events.skipped.is_empty());
        assert_eq!(
            events.events,
            vec![
                EngineEvent::Stored {
                    hashes: vec![EngineHash::Int(11), EngineHash::Int(12)],
                    parent: Some(EngineHash::Int(10)),
                    token_ids: vec![5, 6, 7, 8],
                    block_size: 2,
                    tier: Tier::L3
                },
                EngineEvent::Removed { hashes: vec![EngineHash::Int(-3)], tier: Tier::L1 },
                EngineEvent::Cleared,
            ]
        );
    }

    #[test]
    fn a_batch_map_decodes_too() {
        let batch = Value::Map(vec![
            (s("ts"), Value::F64(1.0)),
            (s("events"), Value::Array(vec![Value::Map(vec![(s("type"), s("AllBlocksCleared"))])])),
        ]);
        assert_eq!(decode_batch(&encode(&batch)).map(|b| b.events), Ok(vec![EngineEvent::Cleared]));
    }

    #[test]
    fn bad_messages_are_named() {
        assert_eq!(decode_message(&[b"kv", b"x"]), Err(DecodeError::Frames(2)));
        assert_eq!(decode_message(&[b"kv", b"abc", b""]), Err(DecodeError::Sequence(3)));
        assert!(matches!(decode_batch(&[0x92, 0x01]), Err(DecodeError::Msgpack(_))), "an array cut short");
        let bad_tokens = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Array(vec![
                s("BlockStored"),
                ints(&[1]),
                Value::Nil,
                ints(&[1, 2, 3]),
                Value::from(2),
            ])]),
        ]);
        // A bad event is skipped alone, named by its place; the rest of its batch is read.
        let skipped = |batch: &Value| {
            let b = decode_batch(&encode(batch)).expect("a batch");
            (b.events, b.skipped.iter().map(|e| e.to_string()).collect::<Vec<_>>())
        };
        let (events, why) = skipped(&bad_tokens);
        assert_eq!((events, why), (vec![], vec!["event 0: 3 token ids for 1 blocks of 2 tokens".to_string()]));
        let cleared = Value::Array(vec![s("AllBlocksCleared")]);
        let unknown = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![cleared.clone(), Value::Array(vec![s("Teleported")]), cleared]),
        ]);
        let (events, why) = skipped(&unknown);
        assert_eq!(events, vec![EngineEvent::Cleared, EngineEvent::Cleared], "the events around it are kept");
        assert_eq!(why, ["event 1: unknown event type `Teleported`"]);
        let medium = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Array(vec![s("BlockRemoved"), ints(&[1]), s("tape")])]),
        ]);
        assert_eq!(skipped(&medium).1, ["event 0: unknown medium `tape`"]);
        // vLLM's placeholder for an offloaded block it could not describe: no tokens, block size 0.
        let placeholder = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), ints(&[7])),
            (s("parent_block_hash"), Value::Nil),
            (s("token_ids"), Value::Array(vec![])),
            (s("block_size"), Value::from(0)),
            (s("medium"), s("CPU")),
        ]);
        let removed = Value::Map(vec![(s("type"), s("BlockRemoved")), (s("block_hashes"), ints(&[3]))]);
        let batch = Value::Array(vec![Value::F64(1.0), Value::Array(vec![placeholder, removed])]);
        let (events, why) = skipped(&batch);
        assert_eq!(events, vec![EngineEvent::Removed { hashes: vec![EngineHash::Int(3)], tier: Tier::L1 }]);
        assert_eq!(why, ["event 0: `block_size` is not a positive integer"]);
        assert!(matches!(decode_batch(&encode(&Value::from(3))), Err(DecodeError::Shape(_))), "not a batch");
    }

    /// Messages captured from real vLLM 0.32.0 (tiny Llama, block size 32): a completion of
    /// 39 prompt tokens, then a longer completion and a chat. The first stored block's tokens
    /// are the prompt's first 32, as vLLM's response listed them (`prompt_token_ids`).
    #[test]
    fn frames_captured_from_real_vllm_decode_and_map_to_the_gateways_hashes() {
        let data = include_bytes!("testdata/vllm-0.32.0-kv-events.bin");
        // Each message: a frame count, then each frame's length and bytes (big-endian u32s).
        let (mut at, mut messages) = (0, Vec::new());
        let take = |at: &mut usize, n: usize| {
            *at += n;
            &data[*at - n..*at]
        };
        while at < data.len() {
            let count = u32::from_be_bytes(take(&mut at, 4).try_into().unwrap());
            let mut frames = Vec::new();
            for _ in 0..count {
                let len = u32::from_be_bytes(take(&mut at, 4).try_into().unwrap()) as usize;
                frames.push(take(&mut at, len));
            }
            messages.push(decode_message(&frames).expect("a real message decodes"));
        }
        assert_eq!(messages.iter().map(|m| m.seq).collect::<Vec<_>>(), [0, 1, 2]);
        let prompt: [u32; 32] = [
            0, 436, 378, 430, 367, 402, 277, 414, 312, 315, 420, 427, 424, 394, 406, 410, 419, 411, 390, 303, 432, 284,
            418, 379, 415, 303, 417, 409, 429, 405, 408, 377,
        ];
        let mut map = super::super::hashes::BlockMap::default();
        let mut ours = engine::kv::KvEvents::new();
        assert!(messages.iter().all(|m| m.events.skipped.is_empty()), "real vLLM's events are all read");
        for e in &messages[0].events.events {
            map.translate(e, 32, &mut ours).expect("block size 32");
        }
        let expected = engine::block_hashes(&prompt, 32)[0];
        assert_eq!(ours, vec![engine::kv::KvEvent::Stored { tier: Tier::L1, hash: expected, page: expected }].into());
        let blocks: Vec<usize> = messages
            .iter()
            .map(|m| {
                m.events
                    .events
                    .iter()
                    .map(|e| match e {
                        EngineEvent::Stored { hashes, .. } => hashes.len(),
                        _ => 0,
                    })
                    .sum()
            })
            .collect();
        assert_eq!(blocks, [1, 4, 5], "39 tokens: 1 block; 12 × 11 + 1: 4; the chat: 5");
    }
}
