//! A trace read once and kept in memory, for commands that simulate it many times: the
//! routers of `simulate` side by side, `max-rate`'s bisection points, `tune`'s trials.
//!
//! Reading a trace is parsing its lines and chaining its block hashes, one hash after the
//! other (each depends on the one before), which is a fixed cost per run: a tenth of a
//! tiered Mooncake run and a fifth of an L1 one. A recording keeps what the reader made at
//! rate scale 1 (each arrival's time in microseconds, lengths, hashes side by side in one
//! vector) and replays it at any rate with the reader's own scaling, so a replay hands out
//! exactly the arrivals a fresh reader would (test: `a_replay_equals_a_fresh_read`).
//!
//! Only traces are recorded: synthetic and agentic workloads draw their arrivals at the rate
//! they run at. A recording is made for one block size and seed (Azure's unique hashes come
//! from the seed) and holds at most [`MAX_HASHES`] hashes; past that the trace is streamed
//! as before, its memory growing with the requests in flight only.

use super::{open_trace, scaled_time, Arrival, TraceFormat, Workload, WorkloadError, WorkloadOptions};
use engine::BlockHash;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The most block hashes a recording holds (256 MiB); a longer trace is streamed.
pub const MAX_HASHES: usize = 32 << 20;

/// One recorded arrival; its hashes are `hashes[previous end..end]`.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// The reader's time at rate 1 (`scaled_time(us, 1.0)` is `us` exactly).
    at_us: u64,
    prompt_tokens: u32,
    output_tokens: u32,
    end: usize,
}

/// The arrivals of a trace as its reader made them at rate scale 1.
pub struct RecordedTrace {
    path: PathBuf,
    format: TraceFormat,
    block_size: u32,
    seed: u64,
    arrivals: Vec<Entry>,
    hashes: Vec<BlockHash>,
    /// Whether the trace ended before the recording stopped (else it holds a first part).
    complete: bool,
}

impl fmt::Debug for RecordedTrace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RecordedTrace({}: {} arrivals, {} hashes{})",
            self.path.display(),
            self.arrivals.len(),
            self.hashes.len(),
            if self.complete { "" } else { ", a first part" }
        )
    }
}

impl RecordedTrace {
    /// Reads the trace at `path` with `opts`' block size and seed, its first `arrivals`
    /// requests when given (a run that reads no further must not fail on a line it never
    /// reads). `Ok(None)` when the trace holds more than `max_hashes` hashes: stream it.
    /// A malformed line is the error a run reading it would meet.
    pub fn record(
        path: &Path,
        format: TraceFormat,
        opts: &WorkloadOptions,
        arrivals: Option<u64>,
        max_hashes: usize,
    ) -> Result<Option<RecordedTrace>, WorkloadError> {
        let mut reader = open_trace(path, format, &WorkloadOptions { rate_scale: 1.0, ..opts.clone() })?;
        let mut trace = RecordedTrace {
            path: path.to_path_buf(),
            format,
            block_size: opts.block_size,
            seed: opts.seed,
            arrivals: Vec::new(),
            hashes: Vec::new(),
            complete: false,
        };
        let mut buf = Vec::new();
        while arrivals.is_none_or(|n| (trace.arrivals.len() as u64) < n) {
            let Some(a) = reader.next_arrival(std::mem::take(&mut buf))? else {
                trace.complete = true;
                break;
            };
            if trace.hashes.len() + a.block_hashes.len() > max_hashes {
                return Ok(None);
            }
            trace.hashes.extend_from_slice(&a.block_hashes);
            trace.arrivals.push(Entry {
                at_us: a.at.0,
                prompt_tokens: a.prompt_tokens,
                output_tokens: a.output_tokens,
                end: trace.hashes.len(),
            });
            buf = a.block_hashes;
        }
        trace.arrivals.shrink_to_fit();
        trace.hashes.shrink_to_fit();
        Ok(Some(trace))
    }

    /// Whether a reader of `path` with these options, reading at most `arrivals` requests
    /// (all: `None`), would hand out what this recording replays.
    pub fn serves(&self, path: &Path, format: TraceFormat, opts: &WorkloadOptions, arrivals: Option<u64>) -> bool {
        let long_enough = self.complete || arrivals.is_some_and(|n| n <= self.arrivals.len() as u64);
        self.path == path
            && self.format == format
            && self.block_size == opts.block_size
            && self.seed == opts.seed
            && long_enough
    }

    /// The recording handed out at `rate_scale`, from its first arrival.
    pub fn replay(self: &Arc<Self>, rate_scale: f64) -> Replay {
        Replay { trace: Arc::clone(self), next: 0, rate_scale }
    }
}

/// A recorded trace handed out at a rate scale.
pub struct Replay {
    trace: Arc<RecordedTrace>,
    next: usize,
    rate_scale: f64,
}

impl Workload for Replay {
    fn next_arrival(&mut self, mut buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        let Some(e) = self.trace.arrivals.get(self.next) else { return Ok(None) };
        let start = self.next.checked_sub(1).map_or(0, |i| self.trace.arrivals[i].end);
        self.next += 1;
        buf.clear();
        buf.extend_from_slice(&self.trace.hashes[start..e.end]);
        Ok(Some(Arrival {
            // The reader's own scaling of the same microseconds: the same times to the bit.
            at: scaled_time(e.at_us, self.rate_scale),
            prompt_tokens: e.prompt_tokens,
            output_tokens: e.output_tokens,
            block_hashes: buf,
            service: Default::default(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::test_util::{drain, TempTrace, AZURE_CONVERSATION, MOONCAKE_CONVERSATION};

    fn opts(rate_scale: f64, seed: u64) -> WorkloadOptions {
        WorkloadOptions { block_size: 16, rate_scale, seed }
    }

    #[test]
    fn a_replay_equals_a_fresh_read() {
        for (path, format) in [(MOONCAKE_CONVERSATION, TraceFormat::Mooncake), (AZURE_CONVERSATION, TraceFormat::Azure)]
        {
            let path = Path::new(path);
            let trace =
                RecordedTrace::record(path, format, &opts(1.0, 7), None, MAX_HASHES).expect("reads").expect("fits");
            let trace = Arc::new(trace);
            assert!(trace.serves(path, format, &opts(3.7, 7), None));
            assert!(!trace.serves(path, format, &opts(1.0, 8), None), "another seed");
            for scale in [1.0, 0.37, 3.7, 4.4321] {
                let fresh = drain(open_trace(path, format, &opts(scale, 7)));
                let replayed = drain(Ok(Box::new(trace.replay(scale)) as Box<dyn Workload>));
                assert!(!fresh.is_empty());
                assert_eq!(fresh, replayed, "{} at {scale}", path.display());
            }
        }
    }

    #[test]
    fn a_first_part_is_recorded_and_serves_only_runs_within_it() {
        let path = Path::new(MOONCAKE_CONVERSATION);
        let trace = RecordedTrace::record(path, TraceFormat::Mooncake, &opts(1.0, 1), Some(100), MAX_HASHES)
            .expect("reads")
            .expect("fits");
        assert_eq!(trace.arrivals.len(), 100);
        assert!(trace.serves(path, TraceFormat::Mooncake, &opts(2.0, 1), Some(100)));
        assert!(!trace.serves(path, TraceFormat::Mooncake, &opts(2.0, 1), Some(101)));
        assert!(!trace.serves(path, TraceFormat::Mooncake, &opts(2.0, 1), None));
    }

    #[test]
    fn a_trace_past_the_cap_is_not_recorded() {
        let path = Path::new(MOONCAKE_CONVERSATION);
        let trace = RecordedTrace::record(path, TraceFormat::Mooncake, &opts(1.0, 1), None, 10_000).expect("reads");
        assert!(trace.is_none());
    }

    #[test]
    fn a_malformed_line_is_the_error_a_run_would_meet_unless_past_the_arrivals_read() {
        let jsonl = TempTrace::new(
            "bad.jsonl",
            "{\"timestamp\": 0, \"input_length\": 40, \"output_length\": 5, \"hash_ids\": [1]}\n\
             {\"timestamp\": 5, \"input_length\": 40, \"output_length\": 5}\n",
        );
        let err = RecordedTrace::record(jsonl.path(), TraceFormat::Mooncake, &opts(1.0, 1), None, MAX_HASHES)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("line 2") && err.contains("hash_ids"), "{err}");
        let first = RecordedTrace::record(jsonl.path(), TraceFormat::Mooncake, &opts(1.0, 1), Some(1), MAX_HASHES);
        assert!(matches!(first, Ok(Some(_))));
    }
}
