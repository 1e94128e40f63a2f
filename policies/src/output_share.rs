//! How much of their bounds (`max_tokens`) outputs use, learned from those that ended: fleet
//! knowledge the controller keeps in its view (across policy changes). Load reports count a
//! request's tokens still to generate up to its bound, which a live router cannot see past;
//! scaled by this share they are the expected tokens left again.

use crate::event::OutputEnd;

/// Each output that ended weighs one, one that ended `HALF_LIFE` outputs earlier half as
/// much: the share follows traffic whose outputs change.
const HALF_LIFE: f64 = 1024.0;

/// Decayed sums of the lengths and the bounds of the outputs that ended.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OutputShare {
    tokens: f64,
    bound: f64,
}

impl OutputShare {
    pub fn record(&mut self, end: OutputEnd) {
        let keep = 0.5f64.powf(1.0 / HALF_LIFE);
        self.tokens = self.tokens * keep + f64::from(end.tokens);
        self.bound = self.bound * keep + f64::from(end.bound);
    }

    /// The share of their bounds that outputs use, at most 1; 1 before any ended (only the
    /// bound is known). Exactly 1 where every output runs to its bound.
    pub fn share(&self) -> f64 {
        if self.bound > 0.0 {
            (self.tokens / self.bound).min(1.0)
        } else {
            1.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn end(tokens: u32, bound: u32) -> OutputEnd {
        OutputEnd { tokens, bound }
    }

    #[test]
    fn outputs_a_tenth_of_their_bound_give_a_tenth_and_recent_ones_count_more() {
        let mut s = OutputShare::default();
        assert_eq!(s.share(), 1.0);
        (0..100).for_each(|_| s.record(end(400, 4000)));
        assert!((s.share() - 0.1).abs() < 1e-12);
        (0..1024).for_each(|_| s.record(end(2000, 4000)));
        assert!(s.share() > 0.3 && s.share() < 0.5, "{}", s.share());
    }

    proptest! {
        /// Outputs that run to their bound (what a simulation of exact lengths gives) keep the
        /// share exactly 1, so estimates scaled by it are unchanged to the bit.
        #[test]
        fn outputs_at_their_bound_keep_the_share_exactly_one(bounds in proptest::collection::vec(0u32..100_000, 1..300)) {
            let mut s = OutputShare::default();
            for b in bounds {
                s.record(end(b.max(1), b));
                prop_assert_eq!(s.share(), 1.0);
            }
        }
    }
}
