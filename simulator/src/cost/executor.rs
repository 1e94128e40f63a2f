//! The cost model behind the engine's [`Executor`] seam: the simulator (and
//! `fleetplane engine --executor sim`) runs the real scheduler and asks this executor how long
//! each batch takes instead of running a forward pass.

use engine::{Batch, Dur, Executor, ExecutorError, StepOutput};

use super::roofline::CostModel;

/// An executor that predicts step times from a [`CostModel`] and produces no tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModelExecutor {
    model: CostModel,
}

impl CostModelExecutor {
    pub fn new(model: CostModel) -> CostModelExecutor {
        CostModelExecutor { model }
    }

    pub fn cost_model(&self) -> &CostModel {
        &self.model
    }
}

impl Executor for CostModelExecutor {
    /// The roofline reads only the batch aggregates, so block tables are never copied.
    fn needs_block_tables(&self) -> bool {
        false
    }

    fn execute(&mut self, batch: &Batch, _out: &mut StepOutput) -> Result<Dur, ExecutorError> {
        Ok(self.model.step_time(&batch.stats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{gpu_by_name, model_by_name, CostParams, Deployment};
    use engine::{BatchEntry, RequestId};

    #[test]
    fn the_executor_returns_the_cost_model_step_time_and_no_tokens() {
        let (m, g) = (model_by_name("llama-3.1-8b"), gpu_by_name("h200"));
        let model =
            CostModel::new(m.expect("model"), g.expect("gpu"), Deployment::tensor_parallel(1), CostParams::default())
                .expect("fits");
        let mut batch = Batch::default();
        let entry = BatchEntry::new(RequestId(7), 100, 1, false);
        batch.entries.push(entry);
        batch.stats.add(&entry);
        let mut exec = CostModelExecutor::new(model.clone());
        let mut out = StepOutput::default();
        assert!(!exec.needs_block_tables());
        assert_eq!(exec.execute(&batch, &mut out).ok(), Some(model.step_time(&batch.stats)));
        assert!(out.tokens.is_empty());
        batch.clear();
        assert_eq!(exec.execute(&batch, &mut out).ok(), Some(Dur::ZERO));
    }
}
