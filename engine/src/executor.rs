//! The one seam between scheduling and computing: the simulator's cost model and the CUDA
//! forward pass both implement [`Executor`], so admission, batching and caching are the same
//! code in simulation and on the GPU.

use crate::batch::Batch;
use crate::time::Dur;

/// Runs one iteration of a batch.
pub trait Executor {
    /// Whether `Batch::block_tables` must be filled (a real forward pass reads KV memory; a
    /// cost model does not, and skipping the copy keeps the simulator fast).
    fn needs_block_tables(&self) -> bool {
        false
    }

    /// Executes `batch`. Returns how long it took: predicted by a cost model, or measured.
    /// Sampled tokens, when the executor produces them, go to `out` in batch-entry order
    /// (one per entry that completes its prompt or decodes).
    fn execute(&mut self, batch: &Batch, out: &mut StepOutput) -> Result<Dur, ExecutorError>;
}

/// What an iteration produced besides its duration.
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    /// Sampled token per producing entry; empty for executors that do not sample.
    pub tokens: Vec<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    #[error("executor failed: {0}")]
    Failed(String),
}
