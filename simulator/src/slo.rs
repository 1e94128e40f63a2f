//! The SLO: the latency targets a request must meet to count towards goodput.

use engine::Finished;
use serde::{Deserialize, Serialize};

/// Latency targets a request must meet to count towards goodput.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slo {
    /// Time to first token, from arrival at the fleet.
    pub ttft_ms: f64,
    /// Mean time per output token after the first.
    pub tpot_ms: f64,
}

impl Slo {
    /// The largest target the policy API takes, in milliseconds: an hour.
    pub const MAX_MS: f64 = 3_600_000.0;

    /// The first target (by name, with its value) not above 0 and at most [`Slo::MAX_MS`].
    pub fn out_of_range(&self) -> Option<(&'static str, f64)> {
        [("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms)]
            .into_iter()
            .find(|&(_, v)| !(v > 0.0 && v <= Self::MAX_MS))
    }

    /// The targets as flow control takes them.
    pub fn targets(&self) -> policies::Targets {
        policies::Targets {
            ttft: engine::Dur::from_secs_f64(self.ttft_ms / 1e3),
            tpot: engine::Dur::from_secs_f64(self.tpot_ms / 1e3),
        }
    }

    /// Whether a finished request met both targets (the rule of [`Metrics::record`]: the
    /// TPOT target is compared without dividing, and one output token always meets it).
    pub fn met_by(&self, f: &Finished) -> bool {
        let ttft_met = f.first_token_at.since(f.request.arrival).0 as f64 <= self.ttft_ms * 1e3;
        let tpot_met = f.output_tokens < 2 || {
            let gaps = f64::from(f.output_tokens - 1);
            f.finished_at.since(f.first_token_at).0 as f64 <= self.tpot_ms * 1e3 * gaps
        };
        f.ended.is_none() && ttft_met && tpot_met
    }
}
