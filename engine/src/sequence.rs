//! A request's state inside an instance.

use crate::kv::SeqKv;
use crate::request::{Finished, Request};
use crate::time::Time;

#[derive(Debug)]
pub(crate) struct Seq {
    pub request: Request,
    pub kv: SeqKv,
    /// Tokens to compute before decoding: the prompt, or after a preemption the prompt plus
    /// the tokens generated so far (recompute). Completing them samples one token.
    pub prefill_len: u32,
    /// Tokens whose KV is in this sequence's blocks.
    pub kv_len: u32,
    pub generated: u32,
    pub admitted_at: Option<Time>,
    pub first_token_at: Option<Time>,
    /// Prompt tokens found cached, by tier.
    pub cached_tokens: [u32; 3],
    /// Tokens loaded from L2 and L3 for the next prefill chunk: their transfer is charged to
    /// the iteration that computes it.
    pub loading: [u32; 2],
    pub preemptions: u32,
    /// Scheduled in the batch being formed or executed.
    pub in_batch: bool,
    /// Fair prefill: place in the turn of long prefills (lower goes first), prompt tokens it
    /// may still compute before yielding (0: a new quota is due), and yields so far.
    pub turn: u64,
    pub quota_left: u32,
    pub yields: u32,
}

impl Seq {
    pub fn new(request: Request, table: Vec<crate::ids::BlockId>) -> Seq {
        Seq {
            prefill_len: request.prompt_tokens,
            request,
            kv: SeqKv { blocks: table, tree_blocks: 0, node: None },
            kv_len: 0,
            generated: 0,
            admitted_at: None,
            first_token_at: None,
            cached_tokens: [0; 3],
            loading: [0; 2],
            preemptions: 0,
            in_batch: false,
            turn: 0,
            quota_left: 0,
            yields: 0,
        }
    }

    pub fn is_decoding(&self) -> bool {
        self.kv_len >= self.prefill_len
    }

    pub fn is_prefilling(&self) -> bool {
        !self.is_decoding()
    }

    /// Output tokens the request wants; at least one (the token its prefill samples).
    pub fn target_output(&self) -> u32 {
        self.request.max_output_tokens.max(1)
    }

    pub fn prefill_left(&self) -> u32 {
        self.prefill_len.saturating_sub(self.kv_len)
    }

    pub fn decode_left(&self) -> u32 {
        self.target_output() - self.generated
    }

    /// Hit accounting counts only the first prefill, so that a recompute after preemption
    /// cannot push the hit rate above what the prompt allows.
    pub fn counts_hits(&self) -> bool {
        self.first_token_at.is_none() && self.preemptions == 0
    }

    pub fn into_finished(self, now: Time) -> (Finished, Vec<crate::ids::BlockId>) {
        let admitted_at = self.admitted_at.unwrap_or(now);
        let finished = Finished {
            admitted_at,
            first_token_at: self.first_token_at.unwrap_or(now),
            finished_at: now,
            output_tokens: self.generated,
            cached_tokens: self.cached_tokens,
            preemptions: self.preemptions,
            yields: self.yields,
            request: self.request,
        };
        (finished, self.kv.blocks)
    }
}
