//! Forming one iteration's batch: continuous batching with chunked prefill.
//!
//! Order of service within the token budget (`max_batch_tokens`) and sequence limit:
//!
//! 1. **Decode first**: every running sequence past its prompt gets one token, so that a
//!    long prompt never stalls the streams already generating. With a speculating executor
//!    (`Executor::draft_tokens` = k) it gets `1 + k` tokens to verify instead, fewer when its
//!    output needs fewer or the budget is short.
//! 2. **Continuing prefills**: running sequences still computing their prompt get the next
//!    chunk, as large as the remaining budget allows, in order of admission.
//! 3. **Admission**: waiting requests in FCFS order. The cached prefix is matched first (it
//!    needs no compute): in L1, then on into L2 and L3, whose blocks are loaded into L1 and
//!    whose transfer is charged to the iteration that computes the chunk after them. Then the
//!    first chunk is allocated; admission stops at the first request that does not fit (head
//!    of line) and keeps a watermark of free blocks. Nothing is admitted while the KV
//!    high-water protection has paused admission (see [`crate::instance`]).
//!
//! When a running sequence needs a block and none is left, the most recently admitted running
//! sequence is **preempted by recompute**: its blocks are released (its cached prompt blocks
//! stay in the prefix tree, so the recompute often hits them) and it goes back to the front
//! of the waiting queue with everything it has seen (prompt and generated tokens) to prefill
//! again. A victim already placed in this batch is taken out of it.
//!
//! With **class priority** (`InstanceConfig::class_priority`, as vLLM's priority policy) the
//! waiting queue is kept in class order (FCFS within a class; a preempted request at the
//! front of its class), so admission serves a higher class first, and the victim is the most
//! recently admitted sequence of the lowest class running. With FCFS prefill, steps 2 and 3
//! go class by class: a higher class's chunks, continuing and new, take the budget before a
//! lower class's (so an interactive prompt does not wait for a long batch prompt's chunks);
//! with fair prefill, its passes run as they are over the class-ordered queue. While an
//! interactive request decodes, lower classes' chunks in one iteration can be capped
//! (`lower_class_step_tokens`), so its steps stay within its TPOT target.

use crate::batch::{BatchEntry, BatchStats};
use crate::instance::{FairPrefill, Instance, PrefillPolicy};
use crate::kv::{LowerHit, Tier};
use crate::sequence::Seq;
use crate::time::Time;

/// Budget left while a batch is being formed.
struct Budget {
    tokens: u32,
    seqs: u32,
}

impl Budget {
    fn open(&self) -> bool {
        self.tokens > 0 && self.seqs > 0
    }

    fn take(&mut self, tokens: u32) {
        self.tokens -= tokens;
        self.seqs -= 1;
    }

    fn give_back(&mut self, tokens: u32) {
        self.tokens += tokens;
        self.seqs += 1;
    }
}

/// Which prefills a scheduling pass serves.
#[derive(Clone, Copy)]
enum Filter {
    Any,
    /// Those with at most this many prompt tokens left to compute.
    AtMost(u32),
    /// Those of one request class.
    Of(crate::Class),
}

impl Filter {
    fn admits(self, seq: &Seq) -> bool {
        match self {
            Filter::Any => true,
            Filter::AtMost(n) => seq.prefill_left() <= n,
            Filter::Of(class) => seq.request.service.engine_class() == class,
        }
    }
}

/// The quota of a long prefill after `yields` yields: `base × growth^yields` tokens.
fn quota(base: f64, growth: f64, yields: u32) -> u32 {
    (base * growth.powi(yields.min(64) as i32)).min(f64::from(u32::MAX)) as u32
}

impl Instance {
    /// Forms the next batch: `with_block_tables` for an executor that reads KV memory,
    /// `draft_tokens` drafts verified per decode for a speculating one (0: none).
    pub(crate) fn form_batch(&mut self, now: Time, with_block_tables: bool, draft_tokens: u32) {
        if draft_tokens == 0 && repeat_allowed() && self.repeat_decodes() {
            if with_block_tables {
                self.batch.block_tables.clear();
                self.fill_block_tables();
            }
            return;
        }
        self.batch.clear();
        self.batch_slots.clear();
        let mut budget = Budget { tokens: self.config.max_batch_tokens, seqs: self.config.max_seqs };
        self.schedule_decodes(now, &mut budget, draft_tokens);
        match self.config.prefill {
            PrefillPolicy::Fcfs if self.config.class_priority => {
                // A class's chunks, continuing or new, before any of a lower class; once a
                // class's head does not fit in KV, no lower class is admitted past it.
                let mut blocked = false;
                let cap = self.config.lower_class_step_tokens.filter(|_| self.interactive_decoding());
                for class in crate::Class::ALL {
                    if let (Some(cap), crate::Class::Standard) = (cap, class) {
                        budget.tokens = budget.tokens.min(cap);
                    }
                    self.schedule_running_prefills(now, &mut budget, Filter::Of(class));
                    if !blocked {
                        blocked = !self.admit_waiting(now, &mut budget, Filter::Of(class), 0);
                    }
                }
            }
            PrefillPolicy::Fcfs => {
                self.schedule_running_prefills(now, &mut budget, Filter::Any);
                self.admit_waiting(now, &mut budget, Filter::Any, 0);
            }
            PrefillPolicy::Fair(fair) => self.schedule_fair(now, &mut budget, &fair),
        }
        for e in &self.batch.entries {
            self.batch.stats.add(e);
        }
        if with_block_tables {
            self.fill_block_tables();
        }
    }

    /// The batch after one that decoded every running sequence, when nothing waits to join
    /// it: the same entries one token further, each taking its next block where it needs
    /// one, in running order, as the passes below would. This is ~99% of a long-context
    /// fleet's steps, so they skip the passes. Returns false, changing nothing, where the
    /// passes could do otherwise: a prefill or a waiting request, a changed running queue,
    /// or a block that would need a preemption.
    fn repeat_decodes(&mut self) -> bool {
        if !self.batch_repeats() {
            return false;
        }
        let n = self.batch.entries.len() as u32;
        let block_size = self.config.block_size;
        // A sequence's next token needs a block when its last one is full.
        let needs_block = |seq: &Seq| seq.kv_len == seq.kv.blocks.len() as u32 * block_size;
        let need = self.running.iter().filter(|&&s| needs_block(self.seq(s))).count();
        if need as u32 > self.kv.available_blocks() {
            return false;
        }
        let mut context = 0;
        for k in 0..self.batch_slots.len() {
            let seq = self.slots[self.batch_slots[k] as usize].as_mut().expect("running slot is empty");
            if needs_block(seq) {
                let ok = self.kv.allocate(&mut seq.kv, 1);
                debug_assert!(ok, "the blocks were counted available");
            }
            seq.in_batch = true;
            self.batch.entries[k].context_tokens = seq.kv_len;
            context += u64::from(seq.kv_len) + 1;
        }
        self.batch.stats = BatchStats { decode_seqs: n, decode_context_tokens: context, ..BatchStats::default() };
        true
    }

    /// Whether the batch formed last is one the next can repeat one token further: one
    /// decode token for every running sequence, nothing else, nothing waiting, within the
    /// budget ([`Instance::repeat_decodes`], and coasting's steps).
    pub(crate) fn batch_repeats(&self) -> bool {
        let n = self.batch.entries.len() as u32;
        n > 0
            && self.batch.stats.prefill_seqs == 0
            && self.waiting.is_empty()
            && n <= self.config.max_seqs
            && n <= self.config.max_batch_tokens
            && self.batch_slots == self.running
            && self.batch.entries.iter().all(|e| e.new_tokens == 1)
    }

    /// Whether an interactive request is past its prompt, generating.
    fn interactive_decoding(&self) -> bool {
        self.running.iter().any(|&s| {
            let seq = self.seq(s);
            seq.is_decoding() && seq.request.service.engine_class() == crate::Class::Interactive
        })
    }

    /// One decode entry per running sequence past its prompt. A speculating step verifies
    /// `draft_tokens` drafts after the sequence's last token and writes KV for all of those
    /// positions, so KV for `1 + drafts` tokens is reserved before the step, preempting if
    /// need be, as vLLM reserves its lookahead slots; blocks of rejected positions stay with
    /// the sequence for its next tokens. Drafts are clamped to the output left (tokens past
    /// it would be thrown away) and to the budget.
    fn schedule_decodes(&mut self, now: Time, budget: &mut Budget, draft_tokens: u32) {
        // Over a copy of the running queue: a reservation may preempt sequences anywhere in
        // it (the lowest class first, with class priority), and those are then waiting.
        let mut order = std::mem::take(&mut self.scratch);
        order.clear();
        order.extend_from_slice(&self.running);
        for &s in &order {
            if !budget.open() {
                break;
            }
            let seq = self.seq(s);
            if !seq.is_decoding() {
                // Prefilling, or preempted by an earlier reservation of this pass.
                continue;
            }
            let n =
                if draft_tokens == 0 { 1 } else { (1 + draft_tokens).min(seq.decode_left()).min(budget.tokens).max(1) };
            if !self.reserve(now, s, n, budget) {
                // `s` itself was preempted; the others may still decode.
                continue;
            }
            self.push_entry(s, n, false);
            budget.take(n);
        }
        self.scratch = order;
    }

    /// Fair chunked prefill (see [`FairPrefill`]): short prompts first, FCFS, leaving
    /// `long_min_tokens` to the long ones when any is pending; then the long ones in turn,
    /// each up to its quota when another long one waits for the budget.
    fn schedule_fair(&mut self, now: Time, budget: &mut Budget, fair: &FairPrefill) {
        let chunk = fair.chunk_tokens;
        let is_long = |seq: &Seq| seq.prefill_left() > chunk;
        let running_longs =
            self.running.iter().filter(|&&s| self.seq(s).is_prefilling() && is_long(self.seq(s))).count();
        let waiting_longs = self.waiting.iter().filter(|&&s| is_long(self.seq(s))).count();
        let reserve = if running_longs + waiting_longs > 0 { fair.long_min_tokens.min(budget.tokens) } else { 0 };
        // KV the admitted long prompts still need to finish: short ones admitted into it
        // would be preempted (recomputed) when the long ones resume.
        let kept_blocks: u32 = self
            .running
            .iter()
            .map(|&s| self.seq(s))
            .filter(|seq| seq.is_prefilling() && is_long(seq))
            .map(|seq| self.kv.blocks_for(seq.prefill_len).saturating_sub(seq.kv.blocks.len() as u32))
            .sum();
        budget.tokens -= reserve;
        self.schedule_running_prefills(now, budget, Filter::AtMost(chunk));
        self.admit_waiting(now, budget, Filter::AtMost(chunk), kept_blocks);
        budget.tokens += reserve;

        let mut longs: Vec<u32> = self.running.iter().copied().filter(|&s| self.seq(s).is_prefilling()).collect();
        longs.sort_by_key(|&s| self.seq(s).turn);
        let contended = longs.len() + waiting_longs > 1;
        let quota_base = (f64::from(self.kv.total_blocks()) * f64::from(self.config.block_size) * fair.quota_kv_share)
            .max(f64::from(self.config.block_size));
        for s in longs {
            if !budget.open() {
                break;
            }
            // An earlier long one's reservation may have preempted this one.
            if !self.running.contains(&s) || self.seq(s).in_batch {
                continue;
            }
            self.match_cached_prefix(now, s);
            let seq = self.seq_mut(s);
            if seq.quota_left == 0 {
                seq.quota_left = quota(quota_base, fair.quota_growth, seq.yields);
            }
            let cap = if contended { seq.quota_left } else { u32::MAX };
            let n = seq.prefill_left().min(budget.tokens).min(cap);
            if n == 0 || !self.reserve(now, s, n, budget) {
                continue;
            }
            self.push_entry(s, n, true);
            budget.take(n);
            let next_turn = self.next_turn + 1;
            let seq = self.slots[s as usize].as_mut().expect("slot is empty");
            seq.quota_left = seq.quota_left.saturating_sub(n);
            if seq.quota_left == 0 && seq.prefill_left() > n {
                // Quota spent at a chunk boundary: keep the KV, go to the back of the turn,
                // come back with a larger quota.
                seq.yields += 1;
                seq.turn = next_turn;
                self.next_turn = next_turn;
            }
        }
        self.admit_waiting(now, budget, Filter::Any, 0);
    }

    fn schedule_running_prefills(&mut self, now: Time, budget: &mut Budget, filter: Filter) {
        let mut i = 0;
        while i < self.running.len() && budget.open() {
            let s = self.running[i];
            let seq = self.seq(s);
            if seq.in_batch || seq.is_decoding() || !filter.admits(seq) {
                i += 1;
                continue;
            }
            self.match_cached_prefix(now, s);
            let hit = self.peek_lower(s);
            if hit.blocks() > 0 && hit.blocks() <= self.kv.available_blocks() {
                self.load_lower(now, s, hit);
            }
            let chunk = self.seq(s).prefill_left().min(budget.tokens);
            if chunk == 0 {
                i += 1;
                continue;
            }
            if !self.reserve(now, s, chunk, budget) {
                break;
            }
            self.push_entry(s, chunk, true);
            budget.take(chunk);
            i += 1;
        }
    }

    /// Admits waiting requests that pass `filter` in FCFS order, until one does not fit (head
    /// of line among them). False when it stopped at one that did not fit in KV (or with
    /// admission paused), not for want of budget.
    fn admit_waiting(&mut self, now: Time, budget: &mut Budget, filter: Filter, kept_blocks: u32) -> bool {
        let watermark = self.watermark_blocks() + kept_blocks;
        let mut at = 0;
        while budget.open() {
            let Some(&s) = self.waiting.get(at) else {
                break;
            };
            if !filter.admits(self.seq(s)) {
                at += 1;
                continue;
            }
            if self.update_admission(now) {
                return false;
            }
            self.match_cached_prefix(now, s);
            // Blocks loaded from L2 or L3 take L1 blocks too, so a request that cannot be
            // admitted without them cannot be with them: skip the lower tiers' lookups then.
            let seq = self.seq(s);
            let at_least = self.kv.blocks_for(seq.kv_len + seq.prefill_left().min(budget.tokens));
            let at_least = at_least.saturating_sub(seq.kv.blocks.len() as u32);
            let available = self.kv.available_blocks();
            if at_least > available || (at_least + watermark > available && !self.running.is_empty()) {
                self.unmatch(now, s);
                if self.drop_hold(now, self.seq(s).request.service.session) {
                    continue;
                }
                return false;
            }
            let hit = self.peek_lower(s);
            let lower_tokens = hit.blocks() * self.config.block_size;
            let seq = self.seq(s);
            let chunk = (seq.prefill_left() - lower_tokens).min(budget.tokens);
            let need = self.kv.blocks_for(seq.kv_len + lower_tokens + chunk).saturating_sub(seq.kv.blocks.len() as u32);
            let available = self.kv.available_blocks();
            if need > available || (need + watermark > available && !self.running.is_empty()) {
                self.unmatch(now, s);
                if self.drop_hold(now, self.seq(s).request.service.session) {
                    continue;
                }
                return false;
            }
            self.load_lower(now, s, hit);
            let paused_clock = self.paused_clock(now);
            let seq = self.slots[s as usize].as_mut().expect("waiting slot is empty");
            let ok = self.kv.allocate(&mut seq.kv, need - hit.blocks());
            debug_assert!(ok, "the blocks were counted available");
            seq.admitted_at.get_or_insert(now);
            seq.paused_wait += paused_clock - seq.paused_mark;
            self.next_turn += 1;
            seq.turn = self.next_turn;
            self.waiting.remove(at);
            self.running.push(s);
            self.resume_program(now, s);
            self.push_entry(s, chunk, true);
            budget.take(chunk);
        }
        true
    }

    /// Extends a prefilling sequence's cached prefix from its cursor: at admission, and again
    /// at each chunk boundary (another request may have cached the next blocks meanwhile).
    /// At least one prompt token is always computed, since its logits give the first token.
    fn match_cached_prefix(&mut self, now: Time, s: u32) {
        let block_size = self.config.block_size;
        let seq = self.slots[s as usize].as_mut().expect("slot is empty");
        if seq.kv.private_blocks() > 0 || seq.is_decoding() {
            return;
        }
        seq.reserve_table(block_size, self.kv.total_blocks());
        let max_blocks = (seq.prefill_len - 1) / block_size;
        let matched = self.kv.match_more(now, &mut seq.kv, &seq.request.block_hashes, max_blocks);
        let tokens = matched * block_size;
        seq.kv_len += tokens;
        if seq.counts_hits() {
            seq.cached_tokens[Tier::L1.index()] += tokens;
        }
        self.prefill_tokens_left -= u64::from(tokens);
    }

    /// How far a prefilling sequence's prefix continues in L2 and L3 past what L1 matched.
    fn peek_lower(&self, s: u32) -> LowerHit {
        let seq = self.seq(s);
        if seq.is_decoding() {
            return LowerHit::default();
        }
        let max_blocks = (seq.prefill_len - 1) / self.config.block_size;
        self.kv.peek_lower(&seq.kv, &seq.request.block_hashes, max_blocks)
    }

    /// Loads `hit` (from [`Instance::peek_lower`], L1 having room for it) into L1. The
    /// tokens count as computed; their transfer is charged to the sequence's next chunk.
    fn load_lower(&mut self, now: Time, s: u32, hit: LowerHit) {
        if hit.blocks() == 0 {
            return;
        }
        let block_size = self.config.block_size;
        let seq = self.slots[s as usize].as_mut().expect("slot is empty");
        let ok = self.kv.promote(now, &mut seq.kv, &seq.request.block_hashes, hit);
        debug_assert!(ok, "the blocks were counted available");
        let (l2, l3) = (hit.l2 * block_size, hit.l3 * block_size);
        seq.kv_len += l2 + l3;
        seq.loading[0] += l2;
        seq.loading[1] += l3;
        if seq.counts_hits() {
            seq.cached_tokens[Tier::L2.index()] += l2;
            seq.cached_tokens[Tier::L3.index()] += l3;
        }
        self.prefill_tokens_left -= u64::from(l2 + l3);
    }

    /// Undoes the match of a request that could not be admitted after all.
    fn unmatch(&mut self, now: Time, s: u32) {
        let seq = self.slots[s as usize].as_mut().expect("slot is empty");
        self.kv.release(now, &mut seq.kv);
        self.prefill_tokens_left += u64::from(seq.kv_len);
        if seq.counts_hits() {
            seq.cached_tokens = [0; 3];
        }
        seq.kv_len = 0;
    }

    /// Makes sure running sequence `s` has blocks for `new_tokens` more tokens, preempting
    /// from the back of the running queue until it does. Returns false when `s` itself had
    /// to be preempted.
    fn reserve(&mut self, now: Time, s: u32, new_tokens: u32, budget: &mut Budget) -> bool {
        let block_size = self.config.block_size;
        loop {
            let seq = self.slots[s as usize].as_mut().expect("slot is empty");
            let tokens = seq.kv_len + new_tokens;
            // Most decode steps fit in the last block: no division, no allocation.
            if tokens <= seq.kv.blocks.len() as u32 * block_size {
                return true;
            }
            let need = self.kv.blocks_for(tokens) - seq.kv.blocks.len() as u32;
            if self.kv.allocate(&mut seq.kv, need) {
                return true;
            }
            // Held sessions' KV goes before any running request is preempted.
            if self.drop_hold(now, None) {
                continue;
            }
            let victim = self.victim();
            self.preempt(now, victim, budget);
            if victim == s {
                return false;
            }
        }
    }

    /// The running sequence preemption takes: the most recently admitted one, of the lowest
    /// class when classes have priority.
    fn victim(&self) -> u32 {
        let last = *self.running.last().expect("a running sequence needs blocks");
        if !self.config.class_priority {
            return last;
        }
        let lowest = self.running.iter().map(|&r| self.seq(r).request.service.engine_class()).max();
        let lowest = lowest.expect("a running sequence needs blocks");
        *self.running.iter().rev().find(|&&r| self.seq(r).request.service.engine_class() == lowest).unwrap_or(&last)
    }

    fn preempt(&mut self, now: Time, s: u32, budget: &mut Budget) {
        let pos = self.running.iter().rposition(|&r| r == s).expect("victim is running");
        self.running.remove(pos);
        if let Some(k) = self.batch_slots.iter().position(|&b| b == s) {
            let e = self.batch.entries.remove(k);
            self.batch_slots.remove(k);
            budget.give_back(e.new_tokens);
        }
        let paused_clock = self.paused_clock(now);
        let seq = self.slots[s as usize].as_mut().expect("slot is empty");
        self.kv.release(now, &mut seq.kv);
        seq.paused_mark = paused_clock;
        let before = seq.prefill_left();
        seq.prefill_len = seq.request.prompt_tokens + seq.generated;
        seq.kv_len = 0;
        seq.loading = [0; 2];
        seq.in_batch = false;
        seq.preemptions += 1;
        self.prefill_tokens_left += u64::from(seq.prefill_left()) - u64::from(before);
        let at = self.waiting_place(s, true);
        self.waiting.insert(at, s);
    }

    fn push_entry(&mut self, s: u32, new_tokens: u32, is_prefill: bool) {
        let seq = self.slots[s as usize].as_mut().expect("slot is empty");
        seq.in_batch = true;
        let load_tokens = if is_prefill { std::mem::take(&mut seq.loading) } else { [0; 2] };
        self.batch.entries.push(BatchEntry {
            request: seq.request.id,
            context_tokens: seq.kv_len,
            new_tokens,
            is_prefill,
            load_tokens,
            blocks: (0, 0),
        });
        self.batch_slots.push(s);
    }

    fn fill_block_tables(&mut self) {
        for k in 0..self.batch.entries.len() {
            let seq = self.slots[self.batch_slots[k] as usize].as_ref().expect("slot is empty");
            let start = self.batch.block_tables.len() as u32;
            self.batch.block_tables.extend_from_slice(&seq.kv.blocks);
            self.batch.entries[k].blocks = (start, self.batch.block_tables.len() as u32);
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Forms every batch by the full passes (for the test that compares them with
    /// [`Instance::repeat_decodes`]).
    pub(crate) static PASSES_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(crate) fn repeat_allowed() -> bool {
    #[cfg(test)]
    return !PASSES_ONLY.with(std::cell::Cell::get);
    #[cfg(not(test))]
    true
}
