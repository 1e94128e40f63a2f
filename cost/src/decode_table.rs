//! Decode-only steps priced from an engine's measured steps rather than the roofline.
//!
//! A decode step of a small batch is a few milliseconds of launch-bound, kernel-specific work
//! (a GEMV path for one or two rows, cuBLAS above, CUDA graphs padded to batch-size buckets)
//! whose shape no roofline follows to within a few percent, and a replay's time per output
//! token is made of such steps. A profile measured them: a grid of batch sizes (the engine's
//! graph buckets) by context, or every step an engine served (`engine --step-log`). Per
//! measured batch size, the step time is a straight line in the batch's total context (the
//! KV it reads), fitted by least squares: exact through a grid's points when they are
//! collinear, the trend through a served log's thousands. A decode step of `b` sequences
//! holding `T` context tokens is priced on the line of the smallest measured batch `B ≥ b`
//! (the bucket the engine pads it to: its GEMMs run `B` rows, its attention reads `T` tokens).
//! Batches above the largest measured, and every step with prompt tokens, keep the roofline.

use engine::{BatchStats, StepProfile};

/// Per measured batch size, its step time as a line in the total context.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeTable {
    /// Ascending in batch size.
    batches: Vec<BatchLine>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct BatchLine {
    seqs: u32,
    samples: usize,
    /// Seconds at zero context, and per context token.
    intercept_s: f64,
    slope_s: f64,
    /// The fastest step measured at this batch size: the line is not taken below half of it.
    floor_s: f64,
}

impl DecodeTable {
    /// The table of `profile`'s decode-only samples; `None` when it has none.
    pub fn from_profile(profile: &StepProfile) -> Option<DecodeTable> {
        let mut points: Vec<(u32, f64, f64)> = profile
            .samples
            .iter()
            .filter(|s| s.prefill_seqs == 0 && s.decode_seqs > 0)
            .map(|s| (s.decode_seqs, s.decode_context_tokens as f64, s.seconds))
            .collect();
        points.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.total_cmp(&b.2)));
        let batches: Vec<BatchLine> =
            points.chunk_by(|a, b| a.0 == b.0).map(|group| BatchLine::fit(group[0].0, group)).collect();
        (!batches.is_empty()).then_some(DecodeTable { batches })
    }

    /// Measured decode steps behind the table.
    pub fn samples(&self) -> usize {
        self.batches.iter().map(|b| b.samples).sum()
    }

    /// Batch sizes measured.
    pub fn batch_sizes(&self) -> usize {
        self.batches.len()
    }

    /// The measured price of `stats` if it is a plain decode step the table covers.
    pub fn price(&self, stats: &BatchStats) -> Option<f64> {
        let plain_decode = stats.prefill_tokens == 0
            && stats.decode_seqs > 0
            && stats.load_l2_tokens == 0
            && stats.load_l3_tokens == 0
            && stats.prefetch_l2_tokens == 0
            && stats.prefetch_l3_tokens == 0;
        if !plain_decode {
            return None;
        }
        let line = self.batches.iter().find(|b| b.seqs >= stats.decode_seqs)?;
        let t = line.intercept_s + line.slope_s * stats.decode_context_tokens as f64;
        Some(t.max(0.5 * line.floor_s))
    }
}

impl BatchLine {
    /// Least squares through `(seqs, context, seconds)` points of one batch size; a flat line
    /// when they share one context.
    fn fit(seqs: u32, points: &[(u32, f64, f64)]) -> BatchLine {
        let n = points.len() as f64;
        let mean_x = points.iter().map(|p| p.1).sum::<f64>() / n;
        let mean_y = points.iter().map(|p| p.2).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.1 - mean_x).powi(2)).sum();
        let sxy: f64 = points.iter().map(|p| (p.1 - mean_x) * (p.2 - mean_y)).sum();
        let slope_s = if sxx > 0.0 { sxy / sxx } else { 0.0 };
        BatchLine {
            seqs,
            samples: points.len(),
            intercept_s: mean_y - slope_s * mean_x,
            slope_s,
            floor_s: points.iter().map(|p| p.2).fold(f64::INFINITY, f64::min),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::{BatchEntry, RequestId, StepSample, PROFILE_FORMAT};
    use proptest::prelude::*;

    fn decode(seqs: u32, context: u32) -> BatchStats {
        let mut s = BatchStats::default();
        for i in 0..seqs {
            s.add(&BatchEntry::new(RequestId(u64::from(i)), context, 1, false));
        }
        s
    }

    /// Batches 1, 2, 4 at contexts 128 and 1024: 4 ms + 1 ms per 10,000 context tokens + 0.1
    /// ms per row.
    fn table() -> DecodeTable {
        let mut samples = Vec::new();
        for b in [1u32, 2, 4] {
            for c in [128u32, 1024] {
                let s = decode(b, c);
                let ms = 4.0 + s.decode_context_tokens as f64 / 1e4 + 0.1 * f64::from(b);
                samples.push(StepSample::new(&s, ms / 1e3));
            }
        }
        let profile = StepProfile {
            format: PROFILE_FORMAT,
            model: "llama-3.1-8b".into(),
            gpu: "h200".into(),
            tp: 1,
            block_size: 16,
            source: "test".into(),
            samples,
        };
        DecodeTable::from_profile(&profile).expect("decode samples")
    }

    /// The price in ms, to the nanosecond.
    fn ms(t: &DecodeTable, s: &BatchStats) -> Option<f64> {
        t.price(s).map(|x| (x * 1e9).round() / 1e6)
    }

    fn expected(base_ms: f64, s: &BatchStats) -> Option<f64> {
        Some(((base_ms + s.decode_context_tokens as f64 / 1e4) * 1e6).round() / 1e6)
    }

    #[test]
    fn a_measured_shape_costs_what_was_measured_and_a_batch_pays_its_bucket() {
        let t = table();
        let two = decode(2, 1024);
        assert_eq!(ms(&t, &two), expected(4.2, &two));
        // Three sequences run as four rows, reading three sequences' context.
        let three = decode(3, 1024);
        assert_eq!(ms(&t, &three), expected(4.4, &three));
        // The line through the measured points, beyond them too.
        let long = decode(1, 4096);
        assert_eq!(ms(&t, &long), expected(4.1, &long));
    }

    #[test]
    fn steps_the_grid_does_not_cover_keep_the_roofline() {
        let t = table();
        assert_eq!(t.price(&decode(5, 128)), None, "above the largest batch measured");
        let mut mixed = decode(2, 128);
        mixed.add(&BatchEntry::new(RequestId(9), 0, 64, true));
        assert_eq!(t.price(&mixed), None, "a prompt chunk");
        let mut loading = decode(2, 128);
        loading.load_l2_tokens = 512;
        assert_eq!(t.price(&loading), None, "KV loaded from L2");
    }

    proptest! {
        #[test]
        fn prices_are_positive_and_grow_with_context(b in 1u32..=4, c in 1u32..20_000, extra in 1u32..5_000) {
            let t = table();
            let (short, long) = (t.price(&decode(b, c)).expect("covered"), t.price(&decode(b, c + extra)).expect("covered"));
            prop_assert!(short > 0.0 && long >= short);
        }
    }
}
