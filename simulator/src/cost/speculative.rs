//! Speculative decoding as a cost-model calculation: what a drafter buys per decode step.
//!
//! Nothing here runs in the engine; `fleetplane capacity --spec NAME` prints it. A drafter
//! proposes `k` tokens per sequence; the target model verifies them (and the bonus token
//! after them) in one step of `k + 1` tokens per sequence. Position `i` is accepted with
//! probability `p_i` given that every earlier one was (its acceptance profile), so a step
//! emits `1 + Σ_i Π_{j ≤ i} p_j` tokens in expectation. TPOT falls by that many tokens over
//! what the step now costs:
//!
//! `TPOT = (draft + verify) / (1 + E[accepted])`, against one plain decode step per token.
//!
//! - **draft** = `sequential_passes × pass_fraction × plain decode step`: the drafter's
//!   forward passes, each priced as a share of the target's decode step at the same batch
//!   and context (a one-layer head or a small block model is mostly launch overhead and
//!   its own weights), plus the semi-autoregressive drafter's per-position bias steps.
//! - **verify** = the target's step on `verified` tokens per sequence after the context,
//!   priced by the roofline as a chunk of that many tokens (it reads the KV once and the
//!   weights once; the LM head of the extra positions is left out, small next to them).
//!
//! The presets' numbers are assumptions, typical of published acceptance lengths, not
//! measurements; docs/LAYOUTS.md lists them.

use engine::{BatchEntry, BatchStats, RequestId};

use super::error::UnknownName;
use super::roofline::CostModel;

/// A drafter: how many tokens it proposes, what it costs and how often they are accepted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Drafter {
    pub name: &'static str,
    /// Conditional acceptance of each drafted position, given all earlier ones accepted.
    pub acceptance: &'static [f64],
    /// Positions sent to the target for verification: all of them, or fewer when the drafter
    /// drops low-confidence positions (DSpark's confidence scheduling).
    pub verified: u32,
    /// Drafter forward passes run one after another per step.
    pub sequential_passes: u32,
    /// One drafter pass as a share of the target's plain decode step.
    pub pass_fraction: f64,
    /// Per drafted position, a light sequential step (bias correction and sampling) as a
    /// share of the target's plain decode step.
    pub per_position_fraction: f64,
}

static DRAFTERS: [Drafter; 3] = [
    // Autoregressive (EAGLE-3 style): one decoder-layer head run once per drafted token.
    Drafter {
        name: "eagle3",
        acceptance: &[0.8, 0.75, 0.7, 0.65],
        verified: 4,
        sequential_passes: 4,
        pass_fraction: 0.06,
        per_position_fraction: 0.0,
    },
    // Parallel (DFlash style): one pass drafts a block of 8; later positions decay fast.
    Drafter {
        name: "dflash",
        acceptance: &[0.8, 0.7, 0.6, 0.5, 0.4, 0.35, 0.3, 0.25],
        verified: 8,
        sequential_passes: 1,
        pass_fraction: 0.12,
        per_position_fraction: 0.0,
    },
    // Semi-autoregressive (DSpark style): one parallel pass for all logits, then a light
    // sequential bias-and-sample per position, which slows the decay; confidence scheduling
    // verifies only the first 5 positions.
    Drafter {
        name: "dspark",
        acceptance: &[0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45],
        verified: 5,
        sequential_passes: 1,
        pass_fraction: 0.12,
        per_position_fraction: 0.005,
    },
];

/// Looks a drafter preset up by name: eagle3, dflash or dspark.
pub fn drafter_by_name(name: &str) -> Result<&'static Drafter, UnknownName> {
    UnknownName::lookup(&DRAFTERS, "drafter", name, |d| d.name)
}

/// What speculation does to one decode step of `batch` sequences at `context` tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpeculativeStep {
    /// Drafted tokens the target accepts per step, in expectation (bonus token excluded).
    pub accepted: f64,
    pub draft_s: f64,
    pub verify_s: f64,
    /// Seconds per output token with speculation.
    pub tpot_s: f64,
    /// Seconds per output token without: one plain decode step.
    pub plain_tpot_s: f64,
}

impl Drafter {
    /// `Σ_{i ≤ verified} Π_{j ≤ i} p_j`: drafted tokens accepted per step in expectation.
    pub fn expected_accepted(&self) -> f64 {
        let mut reach = 1.0;
        let mut sum = 0.0;
        for &p in self.acceptance.iter().take(self.verified as usize) {
            reach *= p;
            sum += reach;
        }
        sum
    }

    /// The step with this drafter on `cost`'s layout. `batch` must be at least 1.
    pub fn step(&self, cost: &CostModel, batch: u32, context: u32) -> SpeculativeStep {
        assert!(batch > 0, "a decode step needs a sequence");
        let (mut plain, mut verify) = (BatchStats::default(), BatchStats::default());
        for i in 0..batch {
            plain.add(&entry(i, context, 1, false));
            verify.add(&entry(i, context, self.verified + 1, true));
        }
        let plain_tpot_s = cost.step_time(&plain).as_secs_f64();
        let drafted = self.acceptance.len() as f64;
        let draft_s = plain_tpot_s
            * (f64::from(self.sequential_passes) * self.pass_fraction + drafted * self.per_position_fraction);
        let verify_s = cost.step_time(&verify).as_secs_f64();
        let accepted = self.expected_accepted();
        SpeculativeStep { accepted, draft_s, verify_s, tpot_s: (draft_s + verify_s) / (1.0 + accepted), plain_tpot_s }
    }
}

fn entry(i: u32, context_tokens: u32, new_tokens: u32, is_prefill: bool) -> BatchEntry {
    BatchEntry::new(RequestId(u64::from(i)), context_tokens, new_tokens, is_prefill)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{gpu_by_name, model_by_name, CostParams, Deployment};

    #[test]
    fn expected_acceptance_follows_the_profile() {
        // EAGLE-3 preset: 0.8 + 0.8·0.75 + 0.8·0.75·0.7 + 0.8·0.75·0.7·0.65 = 2.093.
        let e = drafter_by_name("eagle3").expect("preset").expected_accepted();
        assert!((e - 2.093).abs() < 1e-12, "{e}");
        // DSpark verifies only its first 5 positions: 2.093 + 0.2730 × 0.6 = 2.2568.
        let d = drafter_by_name("dspark").expect("preset").expected_accepted();
        assert!((d - (2.093 + 0.273 * 0.6)).abs() < 1e-12, "{d}");
        assert_eq!(
            drafter_by_name("medusa").expect_err("not a preset").to_string(),
            "unknown drafter `medusa` (valid: eagle3, dflash, dspark)"
        );
    }

    #[test]
    fn speculation_cuts_tpot_at_batch_1_and_its_formula_holds() {
        let (m, g) = (model_by_name("llama-3.1-70b"), gpu_by_name("h100"));
        let cost =
            CostModel::new(m.expect("model"), g.expect("gpu"), Deployment::tensor_parallel(8), CostParams::default())
                .expect("fits");
        for name in ["eagle3", "dflash", "dspark"] {
            let s = drafter_by_name(name).expect("preset").step(&cost, 1, 4096);
            assert!((s.tpot_s - (s.draft_s + s.verify_s) / (1.0 + s.accepted)).abs() < 1e-15);
            // A weight-bound step verifies 5 to 9 tokens for little more than one.
            assert!(s.verify_s < 1.2 * s.plain_tpot_s, "{name}: {s:?}");
            assert!(s.tpot_s < 0.6 * s.plain_tpot_s, "{name}: {s:?}");
        }
    }
}
