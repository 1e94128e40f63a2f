//! What an instance is asked to serve, and what it reports back when done.

use crate::ids::{BlockHash, RequestId};
use crate::time::Time;

/// A generation request as the engine sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub id: RequestId,
    /// When the request reached the fleet (TTFT and queueing are measured from here).
    pub arrival: Time,
    pub prompt_tokens: u32,
    /// Tokens to generate. The simulator knows the exact count from the trace; a live engine
    /// may stop earlier at an end-of-sequence token.
    pub max_output_tokens: u32,
    /// Chained hashes of the prompt's full blocks at the engine's block size (see
    /// [`BlockHash`]); may be shorter than `prompt_tokens / block_size`, in which case the rest
    /// of the prompt is never shared.
    pub block_hashes: Vec<BlockHash>,
}

impl Request {
    /// Tokens of KV the request holds when it finishes: the prompt plus every generated token
    /// but the last (whose KV is never written).
    pub fn peak_kv_tokens(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.max_output_tokens.max(1)) - 1
    }
}

impl Finished {
    /// Prompt tokens served from any tier of the cache.
    pub fn cached_total(&self) -> u32 {
        self.cached_tokens.iter().sum()
    }
}

/// A request that left the instance, with its timeline.
///
/// The request itself is handed back so that the caller can recycle its hash buffer.
#[derive(Clone, Debug)]
pub struct Finished {
    pub request: Request,
    /// First time any of its tokens was scheduled (end of queueing).
    pub admitted_at: Time,
    pub first_token_at: Time,
    pub finished_at: Time,
    pub output_tokens: u32,
    /// Prompt tokens served from the prefix cache instead of computed (token-weighted hit),
    /// by the tier they came from (indexed by [`crate::kv::Tier::index`]).
    pub cached_tokens: [u32; 3],
    /// Times the request was preempted and its KV recomputed.
    pub preemptions: u32,
    /// Times its prefill yielded to others at a chunk boundary (fair prefill), keeping its KV.
    pub yields: u32,
}
