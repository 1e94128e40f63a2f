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

    /// Drafted tokens the executor verifies per decoding sequence and step (speculative
    /// decoding); 0 when it does not speculate. The scheduler then gives each decode entry up to
    /// this many more tokens (`BatchEntry::new_tokens` = 1 + drafts to verify), reserving their
    /// KV and budget, and the executor says in `StepOutput::accepted` how many were accepted.
    fn draft_tokens(&self) -> u32 {
        0
    }

    /// Executes `batch`. Returns how long it took: predicted by a cost model, or measured.
    /// Sampled tokens, when the executor produces them, go to `out` in batch-entry order
    /// (one per entry that completes its prompt, and one per token a decode entry produces).
    fn execute(&mut self, batch: &Batch, out: &mut StepOutput) -> Result<Dur, ExecutorError>;
}

/// What an iteration produced besides its duration.
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    /// Sampled token per produced token, in batch-entry order; empty for executors that do
    /// not sample.
    pub tokens: Vec<u32>,
    /// Drafts accepted per batch entry, in entry order: a decode entry produced `1 +
    /// accepted[k]` tokens (at most its `new_tokens`). Empty when the executor did not
    /// speculate: every decode entry produced one token.
    pub accepted: Vec<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    #[error("executor failed: {0}")]
    Failed(String),
}
