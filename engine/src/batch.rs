//! One iteration's work: which sequences run and how many tokens each computes.

use crate::ids::{BlockId, RequestId};

/// A sequence's share of an iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchEntry {
    pub request: RequestId,
    /// Tokens whose KV is already present before this iteration (cached prefix included).
    pub context_tokens: u32,
    /// Tokens computed this iteration: 1 for a decode step, a chunk for prefill.
    pub new_tokens: u32,
    /// True while the sequence is (re)computing its prompt; false for a decode step.
    pub is_prefill: bool,
    /// Cached tokens loaded into GPU memory for this entry from host memory (L2) and from
    /// the shared store (L3) before its chunk can attend to them.
    pub load_tokens: [u32; 2],
    /// This entry's block table is `Batch::block_tables[blocks.0..blocks.1]` when the executor
    /// asked for block tables (the cost model does not).
    pub blocks: (u32, u32),
}

impl BatchEntry {
    /// An entry with nothing loaded from the lower tiers and no block table: what cost
    /// models and their tests build.
    pub fn new(request: RequestId, context_tokens: u32, new_tokens: u32, is_prefill: bool) -> BatchEntry {
        BatchEntry { request, context_tokens, new_tokens, is_prefill, load_tokens: [0; 2], blocks: (0, 0) }
    }
}

/// Aggregates of a batch: all a roofline cost model needs, computed once per iteration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchStats {
    pub prefill_seqs: u32,
    pub prefill_tokens: u64,
    /// Sum over prefill tokens of the number of positions each attends to (its causal context,
    /// cached prefix included): the attention work of the chunk.
    pub prefill_attention_pairs: u64,
    pub decode_seqs: u32,
    /// Sum of the context lengths of the decode sequences: the KV bytes a decode step reads.
    pub decode_context_tokens: u64,
    /// Tokens of KV loaded from L2 and from L3 during the iteration.
    pub load_l2_tokens: u64,
    pub load_l3_tokens: u64,
    /// Tokens of KV loaded from L2 and from L3 in the background of the iteration, ahead of
    /// the turns that will use them (`crate::programs`): no compute waits for them.
    pub prefetch_l2_tokens: u64,
    pub prefetch_l3_tokens: u64,
}

impl BatchStats {
    pub fn tokens(&self) -> u64 {
        self.prefill_tokens + u64::from(self.decode_seqs)
    }

    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }

    pub fn add(&mut self, e: &BatchEntry) {
        if e.is_prefill {
            let (c, n) = (u64::from(e.context_tokens), u64::from(e.new_tokens));
            self.prefill_seqs += 1;
            self.prefill_tokens += n;
            // Token i of the chunk (0-based) attends to c + i + 1 positions.
            self.prefill_attention_pairs += n * c + n * (n + 1) / 2;
            self.load_l2_tokens += u64::from(e.load_tokens[0]);
            self.load_l3_tokens += u64::from(e.load_tokens[1]);
        } else {
            self.decode_seqs += 1;
            self.decode_context_tokens += u64::from(e.context_tokens) + 1;
        }
    }
}

/// The batch an instance hands to its executor. Owned by the instance and reused across
/// iterations so that the hot loop does not allocate.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub entries: Vec<BatchEntry>,
    pub stats: BatchStats,
    /// Flattened block tables, filled only for executors that read KV memory.
    pub block_tables: Vec<BlockId>,
}

impl Batch {
    pub fn clear(&mut self) {
        self.entries.clear();
        self.stats = BatchStats::default();
        self.block_tables.clear();
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn block_table(&self, e: &BatchEntry) -> &[BlockId] {
        &self.block_tables[e.blocks.0 as usize..e.blocks.1 as usize]
    }
}
