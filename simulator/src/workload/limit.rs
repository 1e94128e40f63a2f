//! [`limit`]: the first `max` arrivals of any workload.

use super::{Arrival, Workload, WorkloadError};
use engine::BlockHash;

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
    fn limit_above_the_length_gives_everything() {
        let trace = TempTrace::new(
            "short.jsonl",
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n",
        );
        let w = open_trace(trace.path(), TraceFormat::Mooncake, &WorkloadOptions::default());
        assert_eq!(drain(w.map(|w| limit(w, 10))).len(), 1);
    }
}
