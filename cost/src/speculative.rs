//! Speculative decoding: drafter presets, what one step with a drafter costs, and how many
//! of its drafts the target accepts.
//!
//! A drafter proposes `k` tokens per sequence; the target model verifies `v ≤ k` of them (and
//! the bonus token after them) in one step of `v + 1` tokens per sequence. Position `i` is
//! accepted with probability `p_i` given that every earlier one was (its acceptance profile),
//! so a step emits `1 + Σ_i Π_{j ≤ i} p_j` tokens in expectation. TPOT falls by that many
//! tokens over what the step now costs:
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
//! [`Drafter::price`] is the one place a step is priced: `fleetplane capacity --spec`'s
//! calculation ([`Drafter::step`], a uniform batch) and the engine's speculating steps
//! ([`crate::CostModelExecutor`], the batch as scheduled, prefill chunks included) both
//! call it. [`Drafter::sample_accepted`] draws one sequence's accepted length in a step.
//!
//! The presets' numbers are assumptions, typical of published acceptance lengths, not
//! measurements; docs/LAYOUTS.md lists them.

use engine::{BatchEntry, BatchStats, RequestId};
use rand::Rng;

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

/// The name that turns speculation off wherever a drafter is named (`--spec none`).
pub const NO_SPECULATION: &str = "none";

/// `none`, or a drafter preset by name; an unknown name lists `none` and the presets.
pub fn drafter_or_none(name: &str) -> Result<Option<&'static Drafter>, UnknownName> {
    if name == NO_SPECULATION {
        return Ok(None);
    }
    drafter_by_name(name).map(Some).map_err(|mut e| {
        e.valid.insert(0, NO_SPECULATION);
        e
    })
}

/// The presets' names, in catalog order.
pub fn drafter_names() -> impl Iterator<Item = &'static str> {
    DRAFTERS.iter().map(|d| d.name)
}

/// What one step with a drafter costs, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepPrice {
    /// The speculating sequences' plain decode step (one token each, no drafter).
    pub plain_s: f64,
    pub draft_s: f64,
    /// The target's step: the batch with each speculating decode verifying its drafts.
    pub verify_s: f64,
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

    /// Drafts the target accepts out of `verified` (at most [`Drafter::verified`]): position
    /// `i` with probability `p_i` once every earlier one was accepted, stopping at the first
    /// rejection.
    pub fn sample_accepted(&self, verified: u32, rng: &mut impl Rng) -> u32 {
        let mut accepted = 0;
        for &p in self.acceptance.iter().take(verified.min(self.verified) as usize) {
            if rng.random::<f64>() >= p {
                break;
            }
            accepted += 1;
        }
        accepted
    }

    /// Adds a speculating decode entry (`new_tokens` = 1 + drafts to verify) to the two views
    /// of its step that [`Drafter::price`] reads: `drafting`, where it is a plain one-token
    /// decode, and `verifying`, where it is a chunk of `new_tokens` after its context.
    pub fn add_speculating(e: &BatchEntry, drafting: &mut BatchStats, verifying: &mut BatchStats) {
        drafting.add(&BatchEntry { new_tokens: 1, is_prefill: false, ..*e });
        verifying.add(&BatchEntry { is_prefill: true, load_tokens: [0; 2], ..*e });
    }

    /// Prices one step from the views [`Drafter::add_speculating`] builds (`verifying` also
    /// holds the batch's other entries as they are): the drafter's passes as shares of the
    /// speculating sequences' plain decode step, and the target's step on `verifying`.
    pub fn price(&self, cost: &CostModel, drafting: &BatchStats, verifying: &BatchStats) -> StepPrice {
        let plain_s = cost.step_time(drafting).as_secs_f64();
        let drafted = self.acceptance.len() as f64;
        let draft_s =
            plain_s * (f64::from(self.sequential_passes) * self.pass_fraction + drafted * self.per_position_fraction);
        StepPrice { plain_s, draft_s, verify_s: cost.step_time(verifying).as_secs_f64() }
    }

    /// The step with this drafter on `cost`'s layout, every one of `batch` sequences at
    /// `context` tokens verifying all its drafts. `batch` must be at least 1.
    pub fn step(&self, cost: &CostModel, batch: u32, context: u32) -> SpeculativeStep {
        assert!(batch > 0, "a decode step needs a sequence");
        let (mut drafting, mut verifying) = (BatchStats::default(), BatchStats::default());
        for i in 0..batch {
            let e = BatchEntry::new(RequestId(u64::from(i)), context, self.verified + 1, false);
            Drafter::add_speculating(&e, &mut drafting, &mut verifying);
        }
        let p = self.price(cost, &drafting, &verifying);
        let accepted = self.expected_accepted();
        SpeculativeStep {
            accepted,
            draft_s: p.draft_s,
            verify_s: p.verify_s,
            tpot_s: (p.draft_s + p.verify_s) / (1.0 + accepted),
            plain_tpot_s: p.plain_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{gpu_by_name, model_by_name, CostParams, Deployment};

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
    fn sampled_acceptance_averages_to_the_expected_length() {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for d in &DRAFTERS {
            let n = 200_000;
            let sum: u64 = (0..n).map(|_| u64::from(d.sample_accepted(d.verified, &mut rng))).sum();
            let mean = sum as f64 / f64::from(n);
            // The accepted length's standard deviation is about 2, so 0.03 is over six standard
            // errors of a 200,000-draw mean (and the seed is fixed).
            assert!((mean - d.expected_accepted()).abs() < 0.03, "{}: {mean} vs {}", d.name, d.expected_accepted());
            assert!((0..1000).all(|_| d.sample_accepted(2, &mut rng) <= 2), "at most the drafts verified");
        }
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
