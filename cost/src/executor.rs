//! The cost model behind the engine's [`Executor`] seam: the simulator (and
//! `fleetplane engine --executor sim`) runs the real scheduler and asks this executor how long
//! each batch takes instead of running a forward pass.
//!
//! With a [`Drafter`] it speculates: the scheduler gives each decode `1 + verified` tokens, the
//! step is priced by [`Drafter::price`], and each speculating sequence's accepted drafts are
//! drawn from the drafter's acceptance profile with the executor's own seeded generator (one
//! per instance, see [`CostModelExecutor::for_instance`]), so runs replay from their seed.

use engine::ids::derive_seed;
use engine::{Batch, BatchStats, Dur, Executor, ExecutorError, InstanceId, StepOutput};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::roofline::CostModel;
use super::speculative::Drafter;

/// An executor that predicts step times from a [`CostModel`] and produces no tokens.
#[derive(Clone, Debug)]
pub struct CostModelExecutor {
    model: CostModel,
    spec: Option<Speculation>,
    /// The steps' time, summed in whole microseconds (step times are whole microseconds: the
    /// sum does not depend on the order steps are priced in), and their prefill part.
    busy: Dur,
    prefill_s: f64,
}

/// Where an executor's GPU time went: every step's time, and the part of it that its prefill
/// chunks added to the step its decodes alone would have taken. With decode work held
/// fixed, saving a fraction of the prefill work (cache hits) buys a busy fleet `1 / (1 −
/// share × fraction saved)`; decode work is not fixed (shared prefix blocks let an instance
/// decode larger batches), so this is an estimate, not a bound.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpuTime {
    pub busy_s: f64,
    pub prefill_s: f64,
}

impl GpuTime {
    pub fn add(&mut self, other: GpuTime) {
        self.busy_s += other.busy_s;
        self.prefill_s += other.prefill_s;
    }

    /// The prefill part of the busy time (0 when idle).
    pub fn prefill_share(&self) -> f64 {
        if self.busy_s > 0.0 {
            self.prefill_s / self.busy_s
        } else {
            0.0
        }
    }
}

/// A speculating executor's drafter, generator and tally.
#[derive(Clone, Debug)]
struct Speculation {
    drafter: &'static Drafter,
    /// The run's seed, from which each instance's generator derives.
    seed: u64,
    rng: ChaCha8Rng,
    tally: SpeculationTally,
}

/// Decode steps of one sequence that verified drafts, and the drafts accepted in them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpeculationTally {
    pub verifications: u64,
    pub accepted: u64,
}

impl SpeculationTally {
    pub fn add(&mut self, other: SpeculationTally) {
        self.verifications += other.verifications;
        self.accepted += other.accepted;
    }

    /// Drafts accepted per verifying sequence-step (0 when none verified).
    pub fn mean_accepted(&self) -> f64 {
        if self.verifications == 0 {
            0.0
        } else {
            self.accepted as f64 / self.verifications as f64
        }
    }
}

impl CostModelExecutor {
    pub fn new(model: CostModel) -> CostModelExecutor {
        CostModelExecutor { model, spec: None, busy: Dur::ZERO, prefill_s: 0.0 }
    }

    /// Speculates with `drafter`; acceptance draws derive from `seed` (the run's).
    pub fn with_drafter(self, drafter: &'static Drafter, seed: u64) -> CostModelExecutor {
        let rng = ChaCha8Rng::seed_from_u64(derive_seed(seed, "drafter", 0));
        let spec = Speculation { drafter, seed, rng, tally: SpeculationTally::default() };
        CostModelExecutor { spec: Some(spec), ..self }
    }

    /// The executor of instance `id`: the same model and drafter, its own generator (seeded
    /// from the run's seed and `id`, so that an instance's draws do not depend on when the
    /// others step) and an empty tally.
    pub fn for_instance(&self, id: InstanceId) -> CostModelExecutor {
        let spec = self.spec.as_ref().map(|s| Speculation {
            rng: ChaCha8Rng::seed_from_u64(derive_seed(s.seed, "drafter", u64::from(id.0))),
            tally: SpeculationTally::default(),
            ..s.clone()
        });
        CostModelExecutor { model: self.model.clone(), spec, busy: Dur::ZERO, prefill_s: 0.0 }
    }

    pub fn cost_model(&self) -> &CostModel {
        &self.model
    }

    pub fn drafter(&self) -> Option<&'static Drafter> {
        self.spec.as_ref().map(|s| s.drafter)
    }

    /// What speculation did so far (`None` without a drafter).
    pub fn tally(&self) -> Option<SpeculationTally> {
        self.spec.as_ref().map(|s| s.tally)
    }

    /// The GPU time of the steps priced so far.
    pub fn gpu_time(&self) -> GpuTime {
        GpuTime { busy_s: self.busy.as_secs_f64(), prefill_s: self.prefill_s }
    }

    /// Adds `total` of decode-only steps priced by [`CostModel::step_time`] outside
    /// [`Executor::execute`] (a simulator's coasted steps) to the GPU time.
    pub fn count_steps(&mut self, total: Dur) {
        self.busy += total;
    }

    /// Adds a step of `total` to the GPU time; `plain` is the step priced without speculation,
    /// whose prefill part is what its prefill chunks add to the step its decodes alone would
    /// take (the decode aggregates come only from decode entries, so they are that step's).
    fn account(&mut self, stats: &BatchStats, total: Dur, plain: Dur) {
        self.busy += total;
        if stats.prefill_tokens == 0 {
            return;
        }
        let decodes = BatchStats {
            decode_seqs: stats.decode_seqs,
            decode_context_tokens: stats.decode_context_tokens,
            ..BatchStats::default()
        };
        let decodes_s = self.model.step_time(&decodes).as_secs_f64();
        self.prefill_s += (plain.as_secs_f64() - decodes_s).clamp(0.0, total.as_secs_f64());
    }
}

impl Executor for CostModelExecutor {
    /// The roofline reads only the batch aggregates, so block tables are never copied.
    fn needs_block_tables(&self) -> bool {
        false
    }

    fn draft_tokens(&self) -> u32 {
        self.spec.as_ref().map_or(0, |s| s.drafter.verified)
    }

    fn execute(&mut self, batch: &Batch, out: &mut StepOutput) -> Result<Dur, ExecutorError> {
        let Some(spec) = &mut self.spec else {
            let total = self.model.step_time(&batch.stats);
            self.account(&batch.stats, total, total);
            return Ok(total);
        };
        let (mut drafting, mut verifying) = (BatchStats::default(), BatchStats::default());
        for e in &batch.entries {
            let drafts = if e.is_prefill { 0 } else { e.new_tokens - 1 };
            if drafts == 0 {
                verifying.add(e);
                out.accepted.push(0);
                continue;
            }
            Drafter::add_speculating(e, &mut drafting, &mut verifying);
            let accepted = spec.drafter.sample_accepted(drafts, &mut spec.rng);
            spec.tally.verifications += 1;
            spec.tally.accepted += u64::from(accepted);
            out.accepted.push(accepted);
        }
        let p = spec.drafter.price(&self.model, &drafting, &verifying);
        let total = Dur::from_secs_f64(p.draft_s + p.verify_s);
        // The prefill part as a plain step would price it: speculation changes the decodes.
        self.account(&batch.stats, total, self.model.step_time(&batch.stats));
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{drafter_by_name, gpu_by_name, model_by_name, CostParams, Deployment};
    use engine::{BatchEntry, RequestId};

    fn model() -> CostModel {
        let (m, g) = (model_by_name("llama-3.1-8b"), gpu_by_name("h200"));
        CostModel::new(m.expect("model"), g.expect("gpu"), Deployment::tensor_parallel(1), CostParams::default())
            .expect("fits")
    }

    fn push(batch: &mut Batch, entry: BatchEntry) {
        batch.entries.push(entry);
        batch.stats.add(&entry);
    }

    #[test]
    fn the_executor_returns_the_cost_model_step_time_and_no_tokens() {
        let model = model();
        let mut batch = Batch::default();
        push(&mut batch, BatchEntry::new(RequestId(7), 100, 1, false));
        let mut exec = CostModelExecutor::new(model.clone());
        let mut out = StepOutput::default();
        assert!(!exec.needs_block_tables());
        assert_eq!(exec.draft_tokens(), 0);
        assert_eq!(exec.execute(&batch, &mut out).ok(), Some(model.step_time(&batch.stats)));
        assert!(out.tokens.is_empty() && out.accepted.is_empty());
        batch.clear();
        assert_eq!(exec.execute(&batch, &mut out).ok(), Some(Dur::ZERO));
    }

    #[test]
    fn a_speculating_step_is_priced_by_the_drafter_and_accepts_at_most_its_drafts() {
        let model = model();
        let d = drafter_by_name("dspark").expect("preset");
        let mut exec = CostModelExecutor::new(model.clone()).with_drafter(d, 42).for_instance(InstanceId(3));
        assert_eq!(exec.draft_tokens(), 5);
        let mut batch = Batch::default();
        let prefill = BatchEntry::new(RequestId(1), 0, 512, true);
        let last = BatchEntry::new(RequestId(2), 900, 1, false);
        let spec = BatchEntry::new(RequestId(3), 1000, 6, false);
        for e in [prefill, last, spec] {
            push(&mut batch, e);
        }
        let mut out = StepOutput::default();
        let d_step = exec.execute(&batch, &mut out).expect("priced");
        // By hand: the plain decode of sequence 3 prices the draft; the prefill chunk, the
        // one-token decode and sequence 3's 6-token chunk run as one verify step.
        let (mut drafting, mut verifying) = (BatchStats::default(), BatchStats::default());
        drafting.add(&BatchEntry::new(RequestId(3), 1000, 1, false));
        for e in [prefill, last, BatchEntry::new(RequestId(3), 1000, 6, true)] {
            verifying.add(&e);
        }
        let p = d.price(&model, &drafting, &verifying);
        assert_eq!(d_step, Dur::from_secs_f64(p.draft_s + p.verify_s));
        assert!(p.draft_s > 0.0 && p.verify_s > model.step_time(&batch.stats).as_secs_f64());
        assert_eq!(out.accepted.len(), 3);
        assert_eq!(out.accepted[..2], [0, 0], "only speculating decodes accept drafts");
        assert!(out.accepted[2] <= 5);
        assert_eq!(exec.tally(), Some(SpeculationTally { verifications: 1, accepted: u64::from(out.accepted[2]) }));
    }

    #[test]
    fn instances_draw_from_their_own_seeded_generators() {
        let d = drafter_by_name("eagle3").expect("preset");
        let base = CostModelExecutor::new(model()).with_drafter(d, 42);
        let mut batch = Batch::default();
        for i in 0..64 {
            push(&mut batch, BatchEntry::new(RequestId(i), 100, 5, false));
        }
        let draws = |id: u32| {
            let mut exec = base.for_instance(InstanceId(id));
            let mut out = StepOutput::default();
            exec.execute(&batch, &mut out).expect("priced");
            out.accepted
        };
        assert_eq!(draws(0), draws(0), "same seed and instance, same draws");
        assert_ne!(draws(0), draws(1), "another instance draws otherwise");
    }
}
