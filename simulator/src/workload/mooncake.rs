//! Mooncake JSONL traces (kvcache-ai/Mooncake, FAST'25).
//!
//! One object a line:
//!
//! ```text
//! {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}
//! ```
//!
//! `timestamp` is milliseconds from the trace's start (arrivals keep that offset), and
//! `hash_ids` holds one id per 512-token block of the prompt: the same id at the same position
//! means the same prefix. Other keys are ignored; blank lines are skipped.
//!
//! Mapping onto the engine's block size B (B must divide 512): engine block j covers tokens
//! `[jB, (j+1)B)`, which lie in trace block `jB / 512` at sub-block `(jB % 512) / B`. Only the
//! prompt's full engine blocks (`input_length / B`) get a hash:
//!
//! ```text
//! hash(k, sub) = last(k - 1).chain(key(id_k, sub)),  last(-1) = ROOT
//! ```
//!
//! where `last(k)` is the hash of trace block k's last engine block: each block's hash names
//! its whole prefix (the trace blocks before it, its own id and its place in it), so two
//! prompts share exactly the engine blocks under their shared trace blocks. Chained from one
//! trace block to the next rather than block by block, the sub-blocks of a trace block hash
//! independently of each other (one dependent mix per 512 tokens, not per block: reading the
//! trace was a chain of 9 M dependent mixes). The keys depend on the trace alone (not the
//! seed): they name content.
//!
//! Parsing writes `hash_ids` into one reused vector through a serde visitor, so a line costs
//! no allocation beyond the caller's `buf`.

use super::lines::Lines;
use super::{scaled_time, Arrival, ReadArrival, WorkloadError, WorkloadOptions};
use engine::ids::mix64;
use engine::BlockHash;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::fmt;
use std::path::Path;

/// Tokens per `hash_ids` entry in Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

pub(super) struct MooncakeTrace {
    lines: Lines,
    block_size: u32,
    rate_scale: f64,
    /// `hash_ids` of the current line, reused.
    ids: Vec<u64>,
    /// The previous line's timestamp in ms, for the ordering check.
    prev_ms: Option<f64>,
}

impl MooncakeTrace {
    pub(super) fn open(path: &Path, opts: &WorkloadOptions) -> Result<MooncakeTrace, WorkloadError> {
        if MOONCAKE_BLOCK_TOKENS.checked_rem(opts.block_size) != Some(0) {
            return Err(WorkloadError::Unsupported {
                path: path.to_path_buf(),
                reason: format!(
                    "engine block size {} must divide the Mooncake trace's {MOONCAKE_BLOCK_TOKENS}-token hash blocks",
                    opts.block_size
                ),
            });
        }
        Ok(MooncakeTrace {
            lines: Lines::open(path)?,
            block_size: opts.block_size,
            rate_scale: opts.rate_scale,
            ids: Vec::new(),
            prev_ms: None,
        })
    }

    fn read(&mut self, mut buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        let (line, raw) = loop {
            let Some((line, text)) = self.lines.next_line()? else { return Ok(None) };
            if text.trim().is_empty() {
                continue;
            }
            match parse_line(text, &mut self.ids) {
                Ok(raw) => break (line, raw),
                Err(reason) => return Err(self.lines.error(line, reason)),
            }
        };
        let ms = raw.timestamp_ms;
        if !(ms.is_finite() && ms >= 0.0) {
            return Err(self.lines.error(line, format!("timestamp must be a number of ms >= 0 (got {ms})")));
        }
        if let Some(prev) = self.prev_ms {
            if ms < prev {
                return Err(self.lines.error(line, format!("timestamp goes backwards ({ms} ms after {prev} ms)")));
            }
        }
        if raw.input_length == 0 {
            return Err(self.lines.error(line, "input_length must be at least 1"));
        }
        let blocks = raw.input_length / self.block_size;
        let sub_blocks = MOONCAKE_BLOCK_TOKENS / self.block_size;
        let needed = blocks.div_ceil(sub_blocks) as usize;
        if self.ids.len() < needed {
            return Err(self.lines.error(
                line,
                format!(
                    "hash_ids has {} ids but input_length {} needs {needed} (one per {MOONCAKE_BLOCK_TOKENS} tokens)",
                    self.ids.len(),
                    raw.input_length
                ),
            ));
        }
        self.prev_ms = Some(ms);

        buf.clear();
        buf.reserve(blocks as usize);
        let mut last = BlockHash::ROOT;
        for (&id, full_block_count) in self.ids.iter().zip((0..blocks).step_by(sub_blocks as usize)) {
            let id_key = mix64(id);
            // One push at a time: as a loop the compiler would vectorise, each 64-bit multiply
            // of the mixes becomes three 32-bit ones.
            let tail = last;
            for sub in 0..sub_blocks.min(blocks - full_block_count) {
                last = tail.chain(sub_block_key(id_key, sub));
                buf.push(last);
            }
        }
        debug_assert_eq!(buf.len(), blocks as usize);

        // Rounds to the microsecond; milliseconds up to 2^53 / 1000 are exact.
        let at = scaled_time((ms * 1_000.0).round() as u64, self.rate_scale);
        Ok(Some(Arrival {
            at,
            prompt_tokens: raw.input_length,
            output_tokens: raw.output_length,
            block_hashes: buf,
            service: Default::default(),
        }))
    }
}

impl ReadArrival for MooncakeTrace {
    fn read_arrival(&mut self, buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        self.read(buf)
    }
}

/// Content key of engine sub-block `sub` of the trace block whose id mixes to `id_key`
/// (`mix64(id)`, once a trace block): `chain` mixes the key again, so the sub-block's place
/// goes in unmixed (ids' keys differing only in their 5 low bits are as rare as collisions).
fn sub_block_key(id_key: u64, sub: u32) -> u64 {
    id_key ^ u64::from(sub)
}

/// The scalar fields of one line; `hash_ids` goes into the caller's vector.
#[derive(Debug, PartialEq)]
struct RawLine {
    timestamp_ms: f64,
    input_length: u32,
    output_length: u32,
}

/// Parses one line, leaving its `hash_ids` in `ids`; the error is the reason alone.
fn parse_line(text: &str, ids: &mut Vec<u64>) -> Result<RawLine, String> {
    let mut de = serde_json::Deserializer::from_str(text);
    let raw = LineSeed { ids }.deserialize(&mut de).map_err(json_reason)?;
    de.end().map_err(json_reason)?;
    Ok(raw)
}

/// serde_json's message without its " at line 1 column N" (the line is ours to number);
/// syntax errors keep the column, where it helps.
fn json_reason(e: serde_json::Error) -> String {
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let msg = full.strip_suffix(suffix.as_str()).unwrap_or(&full);
    match e.classify() {
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
            format!("bad JSON: {msg} (column {})", e.column())
        }
        _ => msg.to_string(),
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum Field {
    Timestamp,
    InputLength,
    OutputLength,
    HashIds,
    #[serde(other)]
    Other,
}

struct LineSeed<'a> {
    ids: &'a mut Vec<u64>,
}

impl<'de> DeserializeSeed<'de> for LineSeed<'_> {
    type Value = RawLine;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<RawLine, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for LineSeed<'_> {
    type Value = RawLine;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Mooncake request object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawLine, A::Error> {
        let mut timestamp_ms = None;
        let mut input_length = None;
        let mut output_length = None;
        let mut has_ids = false;
        self.ids.clear();
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                Field::Timestamp if timestamp_ms.is_some() => return Err(de::Error::duplicate_field("timestamp")),
                // Accepts integers and fractional milliseconds alike.
                Field::Timestamp => timestamp_ms = Some(map.next_value::<f64>()?),
                Field::InputLength if input_length.is_some() => return Err(de::Error::duplicate_field("input_length")),
                Field::InputLength => input_length = Some(map.next_value::<u32>()?),
                Field::OutputLength if output_length.is_some() => {
                    return Err(de::Error::duplicate_field("output_length"))
                }
                Field::OutputLength => output_length = Some(map.next_value::<u32>()?),
                Field::HashIds if has_ids => return Err(de::Error::duplicate_field("hash_ids")),
                Field::HashIds => {
                    map.next_value_seed(IdsSeed { ids: &mut *self.ids })?;
                    has_ids = true;
                }
                Field::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if !has_ids {
            return Err(de::Error::missing_field("hash_ids"));
        }
        Ok(RawLine {
            timestamp_ms: timestamp_ms.ok_or_else(|| de::Error::missing_field("timestamp"))?,
            input_length: input_length.ok_or_else(|| de::Error::missing_field("input_length"))?,
            output_length: output_length.ok_or_else(|| de::Error::missing_field("output_length"))?,
        })
    }
}

/// Appends a JSON array of ids to a reused vector.
struct IdsSeed<'a> {
    ids: &'a mut Vec<u64>,
}

impl<'de> DeserializeSeed<'de> for IdsSeed<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for IdsSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of non-negative integer hash ids")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(id) = seq.next_element::<u64>()? {
            self.ids.push(id);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::test_util::{drain, first_error, TempTrace, MOONCAKE_CONVERSATION};
    use crate::workload::{limit, open_trace, TraceFormat};

    fn opts(block_size: u32) -> WorkloadOptions {
        WorkloadOptions { block_size, ..WorkloadOptions::default() }
    }

    fn read_str(contents: &str, block_size: u32) -> Vec<Arrival> {
        let trace = TempTrace::new("t.jsonl", contents);
        drain(open_trace(trace.path(), TraceFormat::Mooncake, &opts(block_size)))
    }

    /// The error for a one-trace file, with the temporary path replaced by `PATH`.
    fn error_of(contents: &str, block_size: u32) -> String {
        let trace = TempTrace::new("bad.jsonl", contents);
        let err = first_error(open_trace(trace.path(), TraceFormat::Mooncake, &opts(block_size)));
        err.replace(&trace.path().display().to_string(), "PATH")
    }

    /// Pins Mooncake's format: one `hash_ids` entry per 512 tokens, so two prompts whose first
    /// id agrees share exactly the engine blocks inside the first 512 tokens.
    #[test]
    fn mooncake_hash_ids_cover_512_token_blocks() {
        let text = "{\"timestamp\": 0, \"input_length\": 1500, \"output_length\": 5, \"hash_ids\": [7, 8, 9]}\n\
                    {\"timestamp\": 0, \"input_length\": 1500, \"output_length\": 5, \"hash_ids\": [7, 10, 11]}\n";
        for block_size in [1, 16, 64, 512] {
            let arrivals = read_str(text, block_size);
            assert_eq!(arrivals.len(), 2);
            let (a, b) = (&arrivals[0].block_hashes, &arrivals[1].block_hashes);
            assert_eq!(a.len(), (1500 / block_size) as usize);
            assert_eq!(b.len(), a.len());
            let shared = a.iter().zip(b).take_while(|(x, y)| x == y).count();
            assert_eq!(shared, (512 / block_size) as usize, "block size {block_size}");
            assert!(a.iter().zip(b).skip(shared).all(|(x, y)| x != y));
        }
    }

    #[test]
    fn mooncake_block_hashes_chain_from_the_root_trace_block_by_trace_block() {
        let arrivals =
            read_str("{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [3, 4, 5]}", 256);
        let h0 = BlockHash::ROOT.chain(sub_block_key(mix64(3), 0));
        let h1 = BlockHash::ROOT.chain(sub_block_key(mix64(3), 1));
        let h2 = h1.chain(sub_block_key(mix64(4), 0));
        let h3 = h1.chain(sub_block_key(mix64(4), 1));
        assert_eq!(arrivals[0].block_hashes, [h0, h1, h2, h3]);
    }

    #[test]
    fn mooncake_keys_are_pinned() {
        assert_eq!(sub_block_key(mix64(0), 0), mix64(0));
        assert_eq!(sub_block_key(mix64(0), 3), mix64(0) ^ 3);
        assert_ne!(sub_block_key(mix64(0), 1), sub_block_key(mix64(1), 0));
    }

    #[test]
    fn first_hundred_mooncake_lines_arrive_in_order_with_their_lengths() {
        let w = open_trace(MOONCAKE_CONVERSATION.as_ref(), TraceFormat::Mooncake, &opts(16));
        let arrivals = drain(w.map(|w| limit(w, 100)));
        assert_eq!(arrivals.len(), 100);
        assert!(arrivals.windows(2).all(|p| p[0].at <= p[1].at));
        let first = &arrivals[0];
        assert_eq!((first.at.0, first.prompt_tokens, first.output_tokens), (0, 6758, 500));
        assert_eq!(first.block_hashes.len(), 6758 / 16);
        // The first four prompts start with the same id 0: they share the first 32 blocks.
        assert_eq!(arrivals[1].block_hashes[..32], first.block_hashes[..32]);
        assert_ne!(arrivals[1].block_hashes[32], first.block_hashes[32]);
    }

    /// Streams the whole trace: one arrival per line, every full 16-token block hashed.
    #[test]
    fn whole_mooncake_trace_streams_one_arrival_per_line() {
        let mut w = open_trace(MOONCAKE_CONVERSATION.as_ref(), TraceFormat::Mooncake, &opts(16))
            .unwrap_or_else(|e| panic!("{e}"));
        let (mut n, mut last, mut buf) = (0u64, engine::Time::ZERO, Vec::new());
        while let Some(a) = w.next_arrival(buf).unwrap_or_else(|e| panic!("{e}")) {
            assert_eq!(a.block_hashes.len(), (a.prompt_tokens / 16) as usize);
            assert!(a.at >= last);
            last = a.at;
            n += 1;
            buf = a.block_hashes;
            buf.clear();
        }
        assert_eq!(n, 12_031);
        // 58.9 minutes.
        assert!((3_530_000_000..3_540_000_000).contains(&last.0), "{last:?}");
        assert_eq!(w.next_arrival(Vec::new()).ok(), Some(None));
    }

    #[test]
    fn blank_lines_are_skipped_but_counted() {
        let text = "\n{\"timestamp\": 1, \"input_length\": 16, \"output_length\": 0, \"hash_ids\": [1]}\n  \n\
                    {\"timestamp\": 1, \"input_length\": 16, \"output_length\": 0}\n";
        assert_eq!(error_of(text, 16), "parsing trace PATH: line 4: missing field `hash_ids`");
    }

    #[test]
    fn zero_output_length_is_read_as_is() {
        let arrivals =
            read_str("{\"timestamp\": 2.5, \"input_length\": 15, \"output_length\": 0, \"hash_ids\": []}", 16);
        assert_eq!(arrivals.len(), 1);
        assert_eq!((arrivals[0].at.0, arrivals[0].output_tokens), (2_500, 0));
        assert!(arrivals[0].block_hashes.is_empty());
    }

    #[test]
    fn unknown_keys_are_ignored() {
        let arrivals = read_str(
            "{\"session\": {\"a\": [1]}, \"timestamp\": 0, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [1]}",
            16,
        );
        assert_eq!(arrivals.len(), 1);
    }

    #[test]
    fn malformed_mooncake_lines_name_the_file_line_and_reason() {
        let ok = "{\"timestamp\": 1500, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [1]}\n";
        let check = |bad: &str, expected: &str| {
            assert_eq!(error_of(&format!("{ok}{ok}{bad}\n"), 16), format!("parsing trace PATH: line 3: {expected}"));
        };
        check("{\"timestamp\": 1, \"output_length\": 1, \"hash_ids\": [1]}", "missing field `input_length`");
        check("{\"timestamp\": 1, \"input_length\": 16", "bad JSON: EOF while parsing an object (column 35)");
        check("garbage", "bad JSON: expected value (column 1)");
        check(
            "{\"timestamp\": 1500, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [1]} x",
            "bad JSON: trailing characters (column 78)",
        );
        check(
            "{\"timestamp\": 1200, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [1]}",
            "timestamp goes backwards (1200 ms after 1500 ms)",
        );
        check(
            "{\"timestamp\": 1500, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}",
            "input_length must be at least 1",
        );
        check(
            "{\"timestamp\": 1500, \"input_length\": -3, \"output_length\": 1, \"hash_ids\": []}",
            "invalid value: integer `-3`, expected u32",
        );
        check(
            "{\"timestamp\": 1500, \"input_length\": 1100, \"output_length\": 1, \"hash_ids\": [1, 2]}",
            "hash_ids has 2 ids but input_length 1100 needs 3 (one per 512 tokens)",
        );
        check(
            "{\"timestamp\": 1500, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [\"a\"]}",
            "invalid type: string \"a\", expected u64",
        );
        check("[1, 2]", "invalid type: sequence, expected a Mooncake request object");
        check(
            "{\"timestamp\": 1500, \"timestamp\": 1500, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [1]}",
            "duplicate field `timestamp`",
        );
        check(
            "{\"timestamp\": -1, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [1]}",
            "timestamp must be a number of ms >= 0 (got -1)",
        );
    }

    #[test]
    fn a_block_size_that_does_not_divide_512_is_rejected_naming_the_file() {
        let err = error_of("", 24);
        assert_eq!(err, "trace PATH: engine block size 24 must divide the Mooncake trace's 512-token hash blocks");
    }

    #[test]
    fn after_an_error_the_trace_is_finished() {
        let trace = TempTrace::new(
            "after.jsonl",
            "oops\n{\"timestamp\": 1, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [1]}\n",
        );
        let mut w = open_trace(trace.path(), TraceFormat::Mooncake, &opts(16)).unwrap_or_else(|e| panic!("{e}"));
        assert!(w.next_arrival(Vec::new()).is_err());
        assert_eq!(w.next_arrival(Vec::new()).ok(), Some(None));
    }
}
