//! A measured step profile: how long an executor's iterations took against their batch shape.
//!
//! A GPU executor writes one (the CUDA engine sweeps batch shapes: `fleetplane profile`); the
//! simulator's cost model is calibrated on it (`fleetplane simulate --profile FILE`). A sample
//! keeps exactly the [`BatchStats`] aggregates the cost model reads, so a sample's shape is
//! what the model would see for the same batch.

use crate::batch::BatchStats;
use serde::{Deserialize, Serialize};

/// The version of the format written today; readers refuse others.
pub const PROFILE_FORMAT: u32 = 1;

/// Step times of one executor on one machine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepProfile {
    pub format: u32,
    /// The cost-model name of the model's shape (e.g. `llama-3.1-8b`).
    pub model: String,
    /// The cost-model name of the GPU (e.g. `h200`).
    pub gpu: String,
    /// GPUs of the instance (tensor parallelism).
    pub tp: u32,
    pub block_size: u32,
    /// Who measured it and how, for the reader (device name, executor settings, date).
    pub source: String,
    pub samples: Vec<StepSample>,
}

/// One batch shape and its measured time (the median of several repetitions).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepSample {
    pub prefill_seqs: u32,
    pub prefill_tokens: u64,
    pub prefill_attention_pairs: u64,
    pub decode_seqs: u32,
    pub decode_context_tokens: u64,
    pub seconds: f64,
}

impl StepSample {
    pub fn new(stats: &BatchStats, seconds: f64) -> StepSample {
        StepSample {
            prefill_seqs: stats.prefill_seqs,
            prefill_tokens: stats.prefill_tokens,
            prefill_attention_pairs: stats.prefill_attention_pairs,
            decode_seqs: stats.decode_seqs,
            decode_context_tokens: stats.decode_context_tokens,
            seconds,
        }
    }

    /// The batch aggregates the sample was measured on (nothing loaded from lower tiers).
    pub fn stats(&self) -> BatchStats {
        BatchStats {
            prefill_seqs: self.prefill_seqs,
            prefill_tokens: self.prefill_tokens,
            prefill_attention_pairs: self.prefill_attention_pairs,
            decode_seqs: self.decode_seqs,
            decode_context_tokens: self.decode_context_tokens,
            ..BatchStats::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BatchEntry, RequestId};

    #[test]
    fn a_sample_keeps_the_batch_aggregates() {
        let mut stats = BatchStats::default();
        stats.add(&BatchEntry::new(RequestId(1), 100, 512, true));
        stats.add(&BatchEntry::new(RequestId(2), 4000, 1, false));
        let s = StepSample::new(&stats, 0.02);
        assert_eq!(s.stats(), stats);
        assert_eq!(s.seconds, 0.02);
    }
}
