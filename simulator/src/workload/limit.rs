//! A slice of any workload: [`skip`] its first arrivals, [`limit`] it to a number of them.

use super::{Arrival, SessionStats, TurnEnd, Workload, WorkloadError};
use engine::{BlockHash, Time};

/// A workload without the first `n` arrivals of `w`, the rest shifted so that the first kept
/// arrives at time zero: another slice of the same trace, replayed from its own start.
pub fn skip(w: Box<dyn Workload>, n: u64) -> Box<dyn Workload> {
    Box::new(Skip { inner: w, skip: n, start: None })
}

struct Skip {
    inner: Box<dyn Workload>,
    /// Arrivals still to drop.
    skip: u64,
    /// The first kept arrival's time.
    start: Option<Time>,
}

impl Workload for Skip {
    fn next_arrival(&mut self, mut buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        while self.skip > 0 {
            match self.inner.next_arrival(buf)? {
                Some(a) => buf = a.block_hashes,
                None => return Ok(None),
            }
            self.skip -= 1;
        }
        let Some(mut a) = self.inner.next_arrival(buf)? else { return Ok(None) };
        let start = *self.start.get_or_insert(a.at);
        a.at = Time(a.at.0 - start.0);
        Ok(Some(a))
    }
}

/// A workload that ends after `max` arrivals of `w` (or earlier, if `w` does). It stops
/// pulling from `w` at the limit, so a trace is not read past it.
pub fn limit(w: Box<dyn Workload>, max: u64) -> Box<dyn Workload> {
    Box::new(Limit { inner: w, left: max })
}

struct Limit {
    inner: Box<dyn Workload>,
    /// Arrivals still allowed.
    left: u64,
}

impl Workload for Limit {
    fn next_arrival(&mut self, buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        if self.left == 0 {
            return Ok(None);
        }
        let next = self.inner.next_arrival(buf)?;
        if next.is_some() {
            self.left -= 1;
        } else {
            self.left = 0;
        }
        Ok(next)
    }

    fn closed_loop(&self) -> bool {
        self.inner.closed_loop()
    }

    fn ended(&mut self, end: TurnEnd) {
        self.inner.ended(end)
    }

    /// The arrival given back is counted again when it is handed out again.
    fn put_back(&mut self, arrival: Arrival) {
        self.left += 1;
        self.inner.put_back(arrival)
    }

    fn sessions(&self) -> Option<SessionStats> {
        self.inner.sessions()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::test_util::{drain, TempTrace};
    use crate::workload::{open_trace, TraceFormat, WorkloadOptions};

    #[test]
    fn limit_stops_after_max_arrivals_without_reading_further() {
        // Line 3 is malformed: a limit of 2 never reaches it.
        let trace = TempTrace::new(
            "limit.jsonl",
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n\
             {\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n\
             oops\n",
        );
        let opts = WorkloadOptions::default();
        let w = open_trace(trace.path(), TraceFormat::Mooncake, &opts);
        assert_eq!(drain(w.map(|w| limit(w, 2))).len(), 2);
        let w = open_trace(trace.path(), TraceFormat::Mooncake, &opts);
        assert_eq!(drain(w.map(|w| limit(w, 0))).len(), 0);
    }

    #[test]
    fn skip_drops_the_first_arrivals_and_starts_the_rest_at_zero() {
        let trace = TempTrace::new(
            "skip.jsonl",
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n\
             {\"timestamp\": 500, \"input_length\": 2, \"output_length\": 1, \"hash_ids\": [1]}\n\
             {\"timestamp\": 800, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [1]}\n",
        );
        let opts = WorkloadOptions::default();
        let kept = drain(open_trace(trace.path(), TraceFormat::Mooncake, &opts).map(|w| skip(w, 1)));
        let got: Vec<(u64, u32)> = kept.iter().map(|a| (a.at.0, a.prompt_tokens)).collect();
        assert_eq!(got, [(0, 2), (300_000, 3)]);
        assert!(drain(open_trace(trace.path(), TraceFormat::Mooncake, &opts).map(|w| skip(w, 5))).is_empty());
    }

    #[test]
    fn limit_above_the_length_gives_everything() {
        let trace = TempTrace::new(
            "short.jsonl",
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n",
        );
        let w = open_trace(trace.path(), TraceFormat::Mooncake, &WorkloadOptions::default());
        assert_eq!(drain(w.map(|w| limit(w, 10))).len(), 1);
    }
}
