//! Coasting: the decode steps ahead that change nothing anyone observes, credited at once.
//!
//! Once an instance decodes every running sequence with nothing waiting, each next step is
//! the same batch one token further ([`Instance::repeat_decodes`]) until a sequence
//! finishes or needs a new block. Those steps in between end with nothing finished, no KV
//! allocated or evicted, no event: only the step's time and each sequence's length change.
//! A driver that knows their times (the simulator: the cost model prices each batch from
//! [`Instance::coast_stats`]) may skip them and credit them in one pass
//! ([`Instance::coast`]), as long as nothing reaches the instance in between: a request
//! enqueued mid-way must find the instance where the steps one by one would have left it,
//! which the driver gets by crediting the steps ended before it ([`Instance::coast`] with
//! fewer steps). Loads in between are [`Instance::load_after`].

use crate::instance::Instance;
use crate::{BatchStats, Load};

impl Instance {
    /// Steps after the one in progress that end with nothing to observe: the step in
    /// progress and the next `k - 1` end with no sequence finished, and each is followed by
    /// the same batch one token further, needing no new block. 0 where the next step end may
    /// matter, or where the instance does anything per step besides decoding (KV high-water
    /// protection, sessions' holds), or the batch is not one that repeats (a prefill, a
    /// request waiting, speculation).
    pub fn coastable_steps(&self) -> u32 {
        if !self.stepping
            || !crate::scheduler::repeat_allowed()
            || self.config.kv_protection.is_some()
            || self.config.program_hold.is_some()
            || !self.output.accepted.is_empty()
            || !self.batch_repeats()
        {
            return 0;
        }
        let block_size = self.config.block_size;
        let mut steps = u32::MAX;
        for &s in &self.running {
            let seq = self.seq(s);
            if seq.first_token_at.is_none() {
                return 0;
            }
            // Step `j` (from 0, the one in progress) ends with `generated + j + 1` tokens
            // and leaves `kv_len + j + 1` positions, the next needing a block when full.
            let before_stop = seq.stop_at().saturating_sub(seq.generated + 1);
            let room = (seq.kv.blocks.len() as u32 * block_size).saturating_sub(seq.kv_len + 1);
            steps = steps.min(before_stop).min(room);
        }
        steps
    }

    /// The batch of the `j`th step after the one in progress, while coasting (`j` at most
    /// [`Instance::coastable_steps`]): the same sequences, `j` tokens longer each.
    pub fn coast_stats(&self, j: u32) -> BatchStats {
        let stats = &self.batch.stats;
        let grown = u64::from(stats.decode_seqs) * u64::from(j);
        BatchStats {
            decode_seqs: stats.decode_seqs,
            decode_context_tokens: stats.decode_context_tokens + grown,
            ..BatchStats::default()
        }
    }

    /// Credits `steps` coasted steps (at most [`Instance::coastable_steps`]): the step in
    /// progress and the `steps - 1` after it have ended, and the next is in progress, as
    /// [`Instance::end_step`] and [`Instance::begin_step`] one by one would leave it.
    pub fn coast(&mut self, steps: u32) {
        debug_assert!(steps <= self.coastable_steps(), "coasting past a step that matters");
        if steps == 0 {
            return;
        }
        self.emitted.clear();
        for k in 0..self.batch_slots.len() {
            let seq = self.slots[self.batch_slots[k] as usize].as_mut().expect("batched slot is empty");
            seq.kv_len += steps;
            seq.generated += steps;
            self.batch.entries[k].context_tokens = seq.kv_len;
            self.emitted.push(seq.request.id);
        }
        self.batch.stats = self.coast_stats(steps);
        self.decode_tokens_left -= u64::from(self.batch.stats.decode_seqs) * u64::from(steps);
    }

    /// The load the instance reports after `steps` coasted step ends from the one in
    /// progress (at most [`Instance::coastable_steps`]).
    pub fn load_after(&self, steps: u32) -> Load {
        let mut load = self.load();
        load.decode_tokens_left -= u64::from(self.batch.stats.decode_seqs) * u64::from(steps);
        load
    }
}
