//! Workloads: where the simulator's requests come from.
//!
//! The event loop pulls one [`Arrival`] at a time from a [`Workload`]. Traces are streamed
//! line by line, so memory grows with the requests in flight, never with the trace's length
//! (a command that runs one trace many times may keep it read once: [`RecordedTrace`]);
//! synthetic generators draw each request when it is asked for.
//!
//! | file | purpose |
//! | --- | --- |
//! | `mod.rs` | [`Arrival`], the [`Workload`] trait, [`WorkloadError`], [`TraceFormat`], [`open_trace`] |
//! | `lines.rs` | a bounded line reader over a file: line numbers, UTF-8 and I/O errors |
//! | `mooncake.rs` | Mooncake JSONL: 512-token `hash_ids` mapped onto the engine's block size |
//! | `azure.rs` | Azure LLM inference CSV: wall-clock timestamps, no prefix information |
//! | `synthetic.rs` | [`SyntheticConfig`]: Poisson / gamma arrivals, rate schedules, length distributions, shared system prompts |
//! | `phased.rs` | [`PhasedConfig`]: phases of rates and length scales over a trace's length table |
//! | `servegen.rs` | [`ServeGenShape`]: phases from the ServeGen aggregate's per-window rates and mean lengths |
//! | `agentic.rs` | [`AgenticConfig`]: closed-loop agent sessions (turns, tool calls, growing contexts) |
//! | `classes.rs` | [`ClassesConfig`]: request classes and tenants drawn for any workload ([`classify`]) |
//! | `limit.rs` | a slice of any workload: [`skip`] its first requests, [`limit`] it to a number of them |
//! | `max_tokens.rs` | [`MaxTokens`]: the output bound clients ask for, all a router knows of an output before it ends |
//! | `tile.rs` | any workload [`tile`]d to a size: copies side by side and wave after wave, hashes salted per copy |
//! | `recorded.rs` | [`RecordedTrace`]: a trace read once and replayed at any rate, for commands that run it many times |
//! | `test_util.rs` | tests only: temporary trace files, the public traces' paths, draining a workload |
//!
//! Guardrails:
//! - **Invariant:** arrivals come in non-decreasing time order; a trace whose timestamps go
//!   backwards is an error, never re-sorted (sorting would need the whole trace in memory).
//! - **Invariant:** bad input is an error naming the file, the 1-based line and the reason
//!   (for example: parsing trace PATH: line 12: missing field \`input_length\`), never a
//!   panic. After an error a workload is finished: later calls return `Ok(None)`.
//! - **Determinism:** every random choice (synthetic arrivals and lengths, the unique block
//!   hashes of requests without prefix information) derives from [`WorkloadOptions::seed`]
//!   through [`engine::ids::mix64`] and a seeded ChaCha; nothing reads a clock or the OS RNG.
//! - **Rate scaling:** [`WorkloadOptions::rate_scale`] X divides every arrival time by X, so
//!   X = 2 offers the same requests at twice the rate (load sweeps).
//! - **Boundary:** trace formats stay here; the rest of the simulator sees only [`Arrival`]s
//!   with chained [`BlockHash`]es of the engine's block size.

mod agentic;
mod azure;
mod classes;
mod limit;
mod lines;
mod max_tokens;
mod mooncake;
mod phased;
mod recorded;
mod servegen;
mod synthetic;
mod tile;

#[cfg(test)]
mod test_util;

use engine::{BlockHash, Service, Time};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use agentic::{agentic, AgenticConfig, SessionStats, TurnEnd};
pub use classes::{classify, ClassShare, ClassesConfig, TenantShare};
pub use limit::{limit, skip};
pub use max_tokens::{BadMaxTokens, MaxTokens};
pub use mooncake::MOONCAKE_BLOCK_TOKENS;
pub use phased::{phased, Phase, PhasedConfig};
pub use recorded::{RecordedTrace, MAX_HASHES as RECORD_MAX_HASHES};
pub use servegen::{ServeGenShape, SERVEGEN_WINDOW_S};
pub use synthetic::{
    synthetic, ArrivalProcess, LengthDist, LongInputs, LongOutputs, PrefixGroups, RateStep, SyntheticConfig,
};
pub use tile::{tile, Opener};

/// One request entering the fleet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arrival {
    /// When it arrives, after rate scaling.
    pub at: Time,
    /// Prompt length in tokens (at least 1).
    pub prompt_tokens: u32,
    /// Tokens to generate as the trace or distribution says; may be 0 (the engine generates
    /// at least one).
    pub output_tokens: u32,
    /// Chained hashes of the prompt's full engine blocks (`prompt_tokens / block_size` of
    /// them), starting from [`BlockHash::ROOT`]: equal hashes at equal positions mean a shared
    /// prefix. The tail shorter than a block has no hash.
    pub block_hashes: Vec<BlockHash>,
    /// Its class, tenant and deadline ([`classify`] draws them; the default otherwise).
    pub service: Service,
}

/// A source of arrivals, pulled one at a time by the simulator's event loop.
///
/// Contract: call [`Workload::next_arrival`] until it returns `Ok(None)` or an error; the
/// arrivals come in non-decreasing [`Arrival::at`] order. After `Ok(None)` or an error,
/// later calls return `Ok(None)`.
///
/// A **closed-loop** workload ([`Workload::closed_loop`], the agentic sessions) also hears
/// when each request it sent ended ([`Workload::ended`]): a later turn may then come before
/// the arrival the caller holds, so the caller gives that one back ([`Workload::put_back`])
/// and asks again. Order holds among what is handed out after each call.
pub trait Workload: Send {
    /// Next arrival in non-decreasing time order, or None at the end. `buf` is an empty
    /// vector to fill with block hashes; a workload that reads past requests it leaves out
    /// fills the same one again. The simulator passes a new one each time: a finished
    /// request's, handed back, would keep the capacity of the longest prompt it ever held,
    /// and every buffer in circulation would end up that large.
    fn next_arrival(&mut self, buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError>;

    /// Whether arrivals depend on when earlier requests end.
    fn closed_loop(&self) -> bool {
        false
    }

    /// A request of a session ended (closed-loop workloads only).
    fn ended(&mut self, _end: TurnEnd) {}

    /// Takes back an arrival handed out but not sent, to hand it out again in order
    /// (closed-loop workloads only; others are never given one back).
    fn put_back(&mut self, _arrival: Arrival) {}

    /// The sessions' outcome so far (closed-loop workloads only).
    fn sessions(&self) -> Option<SessionStats> {
        None
    }
}

impl<W: Workload + ?Sized> Workload for Box<W> {
    fn next_arrival(&mut self, buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        (**self).next_arrival(buf)
    }
    fn closed_loop(&self) -> bool {
        (**self).closed_loop()
    }
    fn ended(&mut self, end: TurnEnd) {
        (**self).ended(end)
    }
    fn put_back(&mut self, arrival: Arrival) {
        (**self).put_back(arrival)
    }
    fn sessions(&self) -> Option<SessionStats> {
        (**self).sessions()
    }
}

/// Why a workload could not be opened, configured or read.
///
/// I/O reasons are part of the message (not a `source`), so one line says everything.
#[derive(thiserror::Error, Debug)]
pub enum WorkloadError {
    /// The trace file could not be opened.
    #[error("opening trace {}: {reason}", .path.display())]
    Open { path: PathBuf, reason: std::io::Error },

    /// Reading the trace failed part way (a disk or network file system error).
    #[error("reading trace {}: line {line}: {reason}", .path.display())]
    Read { path: PathBuf, line: u64, reason: std::io::Error },

    /// A line of the trace is malformed; `line` is 1-based.
    #[error("parsing trace {}: line {line}: {reason}", .path.display())]
    Parse { path: PathBuf, line: u64, reason: String },

    /// The trace cannot be read with these options (for example a block size that does not
    /// divide Mooncake's 512-token blocks).
    #[error("trace {}: {reason}", .path.display())]
    Unsupported { path: PathBuf, reason: String },

    /// A [`WorkloadOptions`] field is out of range.
    #[error("workload option `{key}` {reason}")]
    Option { key: &'static str, reason: String },

    /// A [`SyntheticConfig`] field is out of range; `key` is its path, like `input.median`.
    #[error("synthetic workload: `{key}` {reason}")]
    Config { key: String, reason: String },

    /// A trace format name that is not one of [`TraceFormat::NAMES`].
    #[error("unknown trace format `{name}` (valid: {})", TraceFormat::NAMES.join(", "))]
    UnknownFormat { name: String },
}

/// The trace file formats [`open_trace`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TraceFormat {
    /// Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).
    Mooncake,
    /// Azure LLM inference CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).
    Azure,
}

impl TraceFormat {
    /// Every format's name, as [`FromStr`] accepts it.
    pub const NAMES: [&'static str; 2] = ["mooncake", "azure"];

    pub fn name(self) -> &'static str {
        match self {
            TraceFormat::Mooncake => "mooncake",
            TraceFormat::Azure => "azure",
        }
    }

    /// The format a file's extension suggests: `.jsonl` is Mooncake, `.csv` is Azure.
    pub fn guess(path: &Path) -> Option<TraceFormat> {
        let ext = path.extension()?.to_str()?;
        if ext.eq_ignore_ascii_case("jsonl") {
            Some(TraceFormat::Mooncake)
        } else if ext.eq_ignore_ascii_case("csv") {
            Some(TraceFormat::Azure)
        } else {
            None
        }
    }
}

impl FromStr for TraceFormat {
    type Err = WorkloadError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mooncake" => Ok(TraceFormat::Mooncake),
            "azure" => Ok(TraceFormat::Azure),
            _ => Err(WorkloadError::UnknownFormat { name: s.to_string() }),
        }
    }
}

impl fmt::Display for TraceFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How any workload is turned into arrivals for one run.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadOptions {
    /// The engine's KV block size in tokens: block hashes cover this many tokens each.
    pub block_size: u32,
    /// Multiplies the arrival rate: every arrival time is divided by it. Finite and > 0.
    pub rate_scale: f64,
    /// The run's seed; every random choice of a workload derives from it.
    pub seed: u64,
}

impl Default for WorkloadOptions {
    /// Block size 16 (vLLM's default), the trace's own rate, seed 0.
    fn default() -> Self {
        WorkloadOptions { block_size: 16, rate_scale: 1.0, seed: 0 }
    }
}

impl WorkloadOptions {
    pub fn validate(&self) -> Result<(), WorkloadError> {
        if self.block_size == 0 {
            return Err(WorkloadError::Option { key: "block_size", reason: "must be at least 1 token".into() });
        }
        if !(self.rate_scale.is_finite() && self.rate_scale > 0.0) {
            return Err(WorkloadError::Option {
                key: "rate_scale",
                reason: format!("must be finite and > 0 (got {})", self.rate_scale),
            });
        }
        Ok(())
    }
}

/// Opens a trace file for streaming. Format-level problems found up front (a missing file,
/// a bad Azure header, a block size Mooncake cannot map) are reported here; per-line problems
/// come from [`Workload::next_arrival`].
pub fn open_trace(
    path: &Path,
    format: TraceFormat,
    opts: &WorkloadOptions,
) -> Result<Box<dyn Workload>, WorkloadError> {
    opts.validate()?;
    Ok(match format {
        TraceFormat::Mooncake => Box::new(Fused::new(mooncake::MooncakeTrace::open(path, opts)?)),
        TraceFormat::Azure => Box::new(Fused::new(azure::AzureTrace::open(path, opts)?)),
    })
}

/// Arrival time of an offset of `us` microseconds at `rate_scale` times the rate. Division
/// and rounding are both monotone, so non-decreasing offsets stay non-decreasing.
fn scaled_time(us: u64, rate_scale: f64) -> Time {
    if rate_scale == 1.0 {
        Time(us)
    } else {
        // `as` saturates: an absurdly small scale gives the last representable time, not a panic.
        Time((us as f64 / rate_scale).round() as u64)
    }
}

/// A trace reader's one-arrival step, before fusing.
trait ReadArrival {
    fn read_arrival(&mut self, buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError>;
}

/// Ends a reader for good at its end or its first error: the error is reported once, and no
/// line after a bad one is read.
struct Fused<R> {
    reader: R,
    done: bool,
}

impl<R> Fused<R> {
    fn new(reader: R) -> Fused<R> {
        Fused { reader, done: false }
    }
}

impl<R: ReadArrival + Send> Workload for Fused<R> {
    fn next_arrival(&mut self, buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        if self.done {
            return Ok(None);
        }
        let result = self.reader.read_arrival(buf);
        if !matches!(result, Ok(Some(_))) {
            self.done = true;
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_util::TempTrace;

    #[test]
    fn trace_format_parses_names_and_lists_valid_ones_on_error() {
        assert_eq!("mooncake".parse::<TraceFormat>().ok(), Some(TraceFormat::Mooncake));
        assert_eq!("azure".parse::<TraceFormat>().ok(), Some(TraceFormat::Azure));
        let err = "burstgpt".parse::<TraceFormat>().err().map(|e| e.to_string());
        assert_eq!(err.as_deref(), Some("unknown trace format `burstgpt` (valid: mooncake, azure)"));
        for name in TraceFormat::NAMES {
            assert_eq!(name.parse::<TraceFormat>().ok().map(|f| f.to_string()).as_deref(), Some(name));
        }
    }

    #[test]
    fn trace_format_is_guessed_from_the_extension() {
        assert_eq!(TraceFormat::guess(Path::new("a/b.jsonl")), Some(TraceFormat::Mooncake));
        assert_eq!(TraceFormat::guess(Path::new("b.CSV")), Some(TraceFormat::Azure));
        assert_eq!(TraceFormat::guess(Path::new("b.json")), None);
        assert_eq!(TraceFormat::guess(Path::new("noext")), None);
    }

    #[test]
    fn rate_scale_must_be_finite_and_positive() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let opts = WorkloadOptions { rate_scale: bad, ..WorkloadOptions::default() };
            let err = opts.validate().err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.starts_with("workload option `rate_scale` must be finite and > 0"), "{err}");
        }
        let opts = WorkloadOptions { block_size: 0, ..WorkloadOptions::default() };
        assert!(opts.validate().is_err());
    }

    #[test]
    fn opening_a_missing_trace_names_the_path_and_the_os_reason() {
        let path = std::env::temp_dir().join("fleetplane-workload-does-not-exist.jsonl");
        for format in [TraceFormat::Mooncake, TraceFormat::Azure] {
            let err = open_trace(&path, format, &WorkloadOptions::default()).err().map(|e| e.to_string());
            let err = err.unwrap_or_default();
            assert!(err.starts_with(&format!("opening trace {}: ", path.display())), "{err}");
            assert!(err.contains("No such file") || err.contains("cannot find"), "{err}");
        }
    }

    #[test]
    fn scaled_time_divides_and_keeps_order() {
        assert_eq!(scaled_time(1_000, 1.0), Time(1_000));
        assert_eq!(scaled_time(1_000, 2.0), Time(500));
        assert_eq!(scaled_time(1_001, 2.0), Time(501));
        assert_eq!(scaled_time(1_000, 0.5), Time(2_000));
    }

    #[test]
    fn a_rate_scale_of_two_halves_trace_arrival_times() {
        let jsonl = TempTrace::new(
            "scale.jsonl",
            "{\"timestamp\": 1000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
             {\"timestamp\": 3001, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [2]}\n",
        );
        let csv = TempTrace::new(
            "scale.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n\
             2023-11-16 18:15:46.0000000,10,1\n\
             2023-11-16 18:15:47.5000010,10,1\n",
        );
        for (trace, format, unscaled) in
            [(&jsonl, TraceFormat::Mooncake, [1_000_000, 3_001_000]), (&csv, TraceFormat::Azure, [0, 1_500_001])]
        {
            for scale in [1.0, 2.0] {
                let opts = WorkloadOptions { rate_scale: scale, ..WorkloadOptions::default() };
                let times: Vec<u64> =
                    test_util::drain(open_trace(trace.path(), format, &opts)).into_iter().map(|a| a.at.0).collect();
                let expected: Vec<u64> = unscaled.iter().map(|&us: &u64| (us as f64 / scale).round() as u64).collect();
                assert_eq!(times, expected, "{format} at scale {scale}");
            }
        }
    }

    #[test]
    fn a_boxed_workload_is_a_workload() {
        let opts = WorkloadOptions::default();
        let cfg = SyntheticConfig::bench_default();
        let boxed: Box<Box<dyn Workload>> = Box::new(synthetic(&cfg, &opts).expect("valid config"));
        let mut limited = limit(boxed, 3);
        let mut n = 0;
        while let Some(_a) = limited.next_arrival(Vec::new()).expect("synthetic never fails") {
            n += 1;
        }
        assert_eq!(n, 3);
    }
}
