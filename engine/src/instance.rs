//! One engine instance: its queues, its KV cache and the step protocol its driver follows.
//!
//! # Contract
//!
//! A driver (the simulator's event loop, or a live engine process) calls, with `now` never
//! moving backwards:
//!
//! 1. [`Instance::enqueue`] for each arriving request, at any time;
//! 2. [`Instance::begin_step`] when the instance is idle and [`Instance::has_work`]: it forms a
//!    batch, runs the executor and returns how long the iteration takes;
//! 3. [`Instance::end_step`] once that long has passed: tokens are credited, prompt blocks are
//!    cached, finished requests are handed back, and so are requests evicted by the KV
//!    high-water protection (the driver places them again: none is dropped here).
//!
//! Requests arriving during a step wait for the next one, as in a real engine.
//!
//! # KV high-water protection
//!
//! With [`InstanceConfig::kv_protection`], KV use is `used blocks / total blocks`, where used
//! blocks are those held by requests (cached blocks nobody holds count as free):
//!
//! - **Hysteresis.** Once use reaches `high_water` (checked at the end of each step and
//!   before each admission), the instance admits no waiting request (new prompts, and
//!   preempted ones) until use is back at or below `low_water`; running requests go on. It
//!   never pauses with nothing running, so it cannot stall. The load report says whether it
//!   is paused, so that routers can look elsewhere; the time spent paused is kept, and each
//!   request's wait while paused (`Finished::paused_wait`).
//! - **Runaways.** A running request that has generated more than `runaway_output_tokens`
//!   tokens *on this instance* is a runaway. Only at the end of a step with use at or above
//!   `high_water` are runaways evicted, the one holding the most KV first, until use is at or
//!   below `low_water` or none is left: KV pressure, not length alone, is the trigger, so a
//!   long output on an instance with room runs on. An evicted request releases its KV and
//!   either goes back to the driver ([`RunawayAction::Reroute`]: an [`Evicted`] whose request
//!   carries its progress in `resume`) or finishes early with the reason
//!   ([`RunawayAction::End`]: `Finished::ended`). Counting tokens per instance bounds the
//!   evictions of a request by `output / runaway_output_tokens`: it makes that much progress
//!   before each one, so a re-routed request cannot bounce forever.

use crate::batch::Batch;
use crate::executor::{Executor, ExecutorError, StepOutput};
use crate::ids::{BlockHash, RequestId};
use crate::kv::{KvCache, KvEvents, SeqKv, SharedStore};
use crate::programs::{Hold, Holds, ProgramHold, Sessions};
use crate::request::{CutShort, Evicted, Finished, Request};
use crate::sequence::Seq;
use crate::time::{Dur, Time};
use std::collections::VecDeque;

/// Sizing and scheduling limits of an instance.
#[derive(Clone, Debug, PartialEq)]
pub struct InstanceConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks the instance's memory holds.
    pub total_blocks: u32,
    /// Token budget of one iteration (decode tokens plus prefill chunk tokens).
    pub max_batch_tokens: u32,
    /// Sequences in one iteration.
    pub max_seqs: u32,
    /// Share of blocks kept free when admitting new requests, so that running ones can grow
    /// a little before anyone is preempted (vLLM's watermark).
    pub admission_watermark: f64,
    /// KV blocks of host memory (L2) that blocks evicted from GPU memory are demoted to;
    /// 0 switches L2 off.
    pub l2_blocks: u32,
    /// Blocks of one entry of L2 and L3, an offload chunk (see
    /// [`KvCache::offload_chunks`]); 1: single blocks.
    pub offload_chunk_blocks: u32,
    /// How prefill chunks are shared among the prompts being computed.
    pub prefill: PrefillPolicy,
    /// KV high-water protection (see the module doc); `None`: off.
    pub kv_protection: Option<KvProtection>,
    /// Admit and preempt by the requests' [`crate::Class`] (vLLM's `--scheduling-policy
    /// priority`): a waiting request goes ahead of every waiting one of a lower class, and
    /// preemption takes the lowest class first. Off: FCFS, classes ignored.
    pub class_priority: bool,
    /// With class priority: while an interactive request is decoding, the prefill tokens
    /// of lower classes in one iteration, at most (so that its steps stay short: its TPOT);
    /// `None`: no cap.
    pub lower_class_step_tokens: Option<u32>,
    /// Keep agent sessions' KV in GPU memory through their tool calls (see
    /// [`crate::programs`]); `None`: finished turns' blocks are left to LRU.
    pub program_hold: Option<ProgramHold>,
}

/// Admission hysteresis on KV use, and what to do with runaway requests under pressure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvProtection {
    /// Share of KV blocks in use at or above which admission pauses, in (0, 1].
    pub high_water: f64,
    /// Share at or below which it resumes, in (0, `high_water`).
    pub low_water: f64,
    /// Tokens a request may generate on the instance before it counts as a runaway;
    /// `None`: no request does (only admission pauses).
    pub runaway_output_tokens: Option<u32>,
    pub runaway_action: RunawayAction,
    /// Evictions after which a request is no longer a runaway candidate: it runs to its end
    /// where it is, so that a long output does not bounce between instances recomputing its
    /// context each time.
    pub max_evictions: u32,
}

/// What becomes of a runaway evicted under KV pressure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RunawayAction {
    /// Handed back to the driver to be placed on another instance, where it recomputes its
    /// prompt and output so far and generates the rest.
    #[default]
    Reroute,
    /// Finished with what it generated, marked as ended and why.
    End,
}

/// How the scheduler shares the token budget among prompts being computed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum PrefillPolicy {
    /// In order of admission: a long prompt takes the whole budget chunk after chunk.
    #[default]
    Fcfs,
    Fair(FairPrefill),
}

/// Chunk-level fair prefill (the seed's long-input scheduling):
///
/// - a prompt with at most `chunk_tokens` left to compute is **short** and goes first, FCFS,
///   from running and waiting requests alike (a long one waiting does not block it);
/// - while any long prompt is pending, shorts leave it at least `long_min_tokens` of every
///   iteration's budget, so long prompts always progress;
/// - long prompts are served in turn; when another long one is pending, each may compute
///   at most its **quota** before yielding at the chunk boundary: it keeps the KV it has
///   computed and goes to the back of the turn, and its next quota is `quota_growth` times
///   larger. The first quota is `quota_kv_share` of the instance's KV tokens.
///
/// Bound on a long prompt's wait: once admitted, it finishes its prefill within
/// `(its tokens + the long prefill tokens admitted before it) / long_min_tokens` iterations,
/// since long prompts together get at least `long_min_tokens` of each iteration and turns
/// only reorder them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FairPrefill {
    pub chunk_tokens: u32,
    pub quota_kv_share: f64,
    pub quota_growth: f64,
    pub long_min_tokens: u32,
}

impl Default for FairPrefill {
    fn default() -> Self {
        FairPrefill { chunk_tokens: 8192, quota_kv_share: 0.02, quota_growth: 2.0, long_min_tokens: 1024 }
    }
}

impl Default for InstanceConfig {
    fn default() -> Self {
        InstanceConfig {
            block_size: 16,
            total_blocks: 4096,
            max_batch_tokens: 8192,
            max_seqs: 256,
            admission_watermark: 0.01,
            l2_blocks: 0,
            offload_chunk_blocks: 1,
            prefill: PrefillPolicy::Fcfs,
            kv_protection: None,
            class_priority: false,
            lower_class_step_tokens: None,
            program_hold: None,
        }
    }
}

/// Why an instance refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    #[error("request needs {needed_tokens} tokens of KV but the instance holds at most {capacity_tokens}")]
    TooLarge { needed_tokens: u64, capacity_tokens: u64 },
    #[error("request has an empty prompt")]
    EmptyPrompt,
    /// A KV transfer needs its blocks at once, and this many are not available.
    #[error("a KV transfer needs {needed_blocks} free KV blocks but only {available_blocks} are available")]
    NoKvRoom { needed_blocks: u32, available_blocks: u32 },
    /// Only a request whose prefill ran elsewhere (it carries its first token in `resume`)
    /// can take its KV by transfer.
    #[error("request has no first token to continue from: its prefill has not run")]
    NotPrefilled,
}

/// What a load report carries (the fields vLLM's metrics expose, plus outstanding work).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    pub waiting: u32,
    pub running: u32,
    pub kv_used_blocks: u32,
    pub kv_total_blocks: u32,
    pub kv_cached_blocks: u32,
    /// Prompt tokens still to compute, over all queued and running requests.
    pub prefill_tokens_left: u64,
    /// Tokens still to generate.
    pub decode_tokens_left: u64,
    /// KV use reached the high-water mark and has not yet fallen to the low-water mark: no
    /// waiting request is admitted.
    pub admission_paused: bool,
}

#[derive(Debug)]
pub struct Instance {
    pub(crate) config: InstanceConfig,
    pub(crate) kv: KvCache,
    /// Slot-indexed sequences; a slot is reused after its request finishes.
    pub(crate) slots: Vec<Option<Seq>>,
    pub(crate) free_slots: Vec<u32>,
    /// Requests not yet admitted (or preempted), in order of service.
    pub(crate) waiting: VecDeque<u32>,
    /// Admitted requests in order of admission; preemption takes from the back.
    pub(crate) running: Vec<u32>,
    /// Sequences holding KV while it is transferred to or from another instance (P/D
    /// disaggregation, see `crate::handoff`): in no queue, never scheduled.
    pub(crate) parked: Vec<u32>,
    /// Prefill-only requests whose prefill ended since the last `take_handoffs`.
    pub(crate) handoffs: Vec<crate::request::Handoff>,
    pub(crate) batch: Batch,
    /// Slot of each batch entry, in entry order.
    pub(crate) batch_slots: Vec<u32>,
    /// A copy of a queue the scheduler walks while changing it (kept to avoid allocating).
    pub(crate) scratch: Vec<u32>,
    pub(crate) output: StepOutput,
    /// Requests that produced a token in the last step, in batch order, once per token.
    pub(crate) emitted: Vec<RequestId>,
    pub(crate) stepping: bool,
    pub(crate) prefill_tokens_left: u64,
    pub(crate) decode_tokens_left: u64,
    /// Last turn handed out to a prefill (fair prefill's rotation).
    pub(crate) next_turn: u64,
    /// Since when admission has been paused (KV high-water protection), if it is.
    paused_since: Option<Time>,
    /// Length of the pauses that have ended.
    paused_total: Dur,
    /// Sessions' paths kept through their tool calls ([`InstanceConfig::program_hold`]).
    pub(crate) holds: Holds,
    /// Sessions' pauses and prefetches due ([`InstanceConfig::program_hold`]).
    pub(crate) sessions: Sessions,
}

impl Instance {
    pub fn new(config: InstanceConfig) -> Instance {
        Instance::with_shared_store(config, None)
    }

    /// An instance whose evicted blocks go on to `l3`, the store its fleet shares (none: no L3).
    pub fn with_shared_store(config: InstanceConfig, l3: Option<SharedStore>) -> Instance {
        Instance {
            kv: KvCache::with_tiers(config.total_blocks, config.block_size, config.l2_blocks, l3)
                .offload_chunks(config.offload_chunk_blocks),
            config,
            slots: Vec::new(),
            free_slots: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            parked: Vec::new(),
            handoffs: Vec::new(),
            batch: Batch::default(),
            batch_slots: Vec::new(),
            scratch: Vec::new(),
            output: StepOutput::default(),
            emitted: Vec::new(),
            stepping: false,
            prefill_tokens_left: 0,
            decode_tokens_left: 0,
            next_turn: 0,
            paused_since: None,
            paused_total: Dur::ZERO,
            holds: Holds::default(),
            sessions: Sessions::default(),
        }
    }

    pub fn config(&self) -> &InstanceConfig {
        &self.config
    }

    /// Changes how prefill is shared and the KV high-water protection (an operator's policy
    /// change). Called between steps only. Queued and running requests stay where they are:
    /// fair prefill's turns and quotas are kept on every sequence, so a switch either way
    /// loses no request; admission is re-checked against the new marks at once.
    pub fn set_scheduling(&mut self, now: Time, prefill: PrefillPolicy, kv_protection: Option<KvProtection>) {
        assert!(!self.stepping, "set_scheduling called during a step");
        self.config.prefill = prefill;
        self.config.kv_protection = kv_protection;
        if kv_protection.is_none() {
            if let Some(since) = self.paused_since.take() {
                self.paused_total += now.since(since);
            }
        } else {
            self.update_admission(now);
        }
        self.debug_check();
    }

    /// Changes the token budget of one step (decode tokens plus prefill chunks): an operator's
    /// policy change, between steps. A smaller budget computes prompts in smaller chunks, so the
    /// decodes beside them wait less per step (TPOT) and prompts take more steps (TTFT).
    pub fn set_max_batch_tokens(&mut self, tokens: u32) {
        assert!(!self.stepping, "set_max_batch_tokens called during a step");
        assert!(tokens > 0, "a step's token budget is at least 1");
        self.config.max_batch_tokens = tokens;
        self.debug_check();
    }

    /// Turns class priority on or off (see [`InstanceConfig::class_priority`]); turned on,
    /// the requests waiting are put in class order (FCFS within a class, as they were).
    pub fn set_class_priority(&mut self, on: bool, lower_class_step_tokens: Option<u32>) {
        assert!(!self.stepping, "set_class_priority called during a step");
        self.config.class_priority = on;
        self.config.lower_class_step_tokens = lower_class_step_tokens;
        if on {
            let mut waiting: Vec<u32> = self.waiting.drain(..).collect();
            waiting.sort_by_key(|&s| self.seq(s).request.service.engine_class());
            self.waiting = waiting.into();
        }
        self.debug_check();
    }

    /// Turns the holds of sessions' KV on, changes them, or (`None`) turns them off and drops
    /// every hold (see [`crate::programs`]).
    pub fn set_program_hold(&mut self, now: Time, hold: Option<ProgramHold>) {
        assert!(!self.stepping, "set_program_hold called during a step");
        self.config.program_hold = hold;
        if hold.is_none() {
            while self.drop_hold(now, None) {}
        }
        self.debug_check();
    }

    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Starts recording the KV events of every tier, for a fleet that publishes them.
    pub fn record_kv_events(&mut self) {
        self.kv.record_events();
    }

    /// Moves the KV events recorded since the last call into `out` (an empty `out` trades
    /// buffers with the cache, copying nothing).
    pub fn drain_kv_events(&mut self, out: &mut KvEvents) {
        self.kv.drain_events(out);
    }

    /// Largest request (prompt plus output) this instance can ever hold.
    pub fn capacity_tokens(&self) -> u64 {
        u64::from(self.config.total_blocks) * u64::from(self.config.block_size)
    }

    /// Checks that a request could be served here, without queueing it.
    pub fn admissible(&self, request: &Request) -> Result<(), Rejected> {
        if request.prompt_tokens == 0 {
            return Err(Rejected::EmptyPrompt);
        }
        let needed_tokens = request.peak_kv_tokens();
        if needed_tokens > self.capacity_tokens() {
            return Err(Rejected::TooLarge { needed_tokens, capacity_tokens: self.capacity_tokens() });
        }
        Ok(())
    }

    /// Queues a request that arrived at `now`. A request that can never fit is refused (with
    /// the request returned).
    pub fn enqueue(&mut self, now: Time, request: Request) -> Result<(), (Rejected, Request)> {
        self.enqueue_slot(now, request).map(|_| ())
    }

    /// [`Instance::enqueue`], giving the request's slot.
    pub(crate) fn enqueue_slot(&mut self, now: Time, request: Request) -> Result<u32, (Rejected, Request)> {
        if let Err(e) = self.admissible(&request) {
            return Err((e, request));
        }
        if let (Some(_), Some(session)) = (self.config.program_hold, request.service.session) {
            self.sessions.arrived(now, session);
        }
        let seq = Seq::new(request, self.paused_clock(now));
        self.prefill_tokens_left += u64::from(seq.prefill_left());
        self.decode_tokens_left += u64::from(seq.declared_left());
        let slot = crate::slots::place(&mut self.slots, &mut self.free_slots, Some(seq));
        let at = self.waiting_place(slot, false);
        self.waiting.insert(at, slot);
        Ok(slot)
    }

    /// Where waiting slot `s` goes in the waiting queue: at the back (or, `preempted`, the
    /// front), within its class when classes have priority.
    pub(crate) fn waiting_place(&self, s: u32, preempted: bool) -> usize {
        if !self.config.class_priority {
            return if preempted { 0 } else { self.waiting.len() };
        }
        let class = self.seq(s).request.service.engine_class();
        let class_of = |&w: &u32| self.seq(w).request.service.engine_class();
        if preempted {
            self.waiting.iter().position(|w| class_of(w) >= class).unwrap_or(self.waiting.len())
        } else {
            self.waiting.iter().position(|w| class_of(w) > class).unwrap_or(self.waiting.len())
        }
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn is_stepping(&self) -> bool {
        self.stepping
    }

    /// Requests queued, running, or holding KV for a transfer.
    pub fn in_flight(&self) -> usize {
        self.running.len() + self.waiting.len() + self.parked.len()
    }

    pub fn load(&self) -> Load {
        Load {
            waiting: self.waiting.len() as u32,
            running: self.running.len() as u32,
            kv_used_blocks: self.kv_used_blocks(),
            kv_total_blocks: self.kv.total_blocks(),
            kv_cached_blocks: self.kv.cached_blocks(),
            prefill_tokens_left: self.prefill_tokens_left,
            decode_tokens_left: self.decode_tokens_left,
            admission_paused: self.admission_paused(),
        }
    }

    /// Blocks held by requests: what sessions' holds alone keep is reclaimable on demand, as
    /// cached blocks are, so it does not count.
    pub fn kv_used_blocks(&self) -> u32 {
        let held: u32 = self.holds.nodes().map(|n| self.kv.sole_blocks(n)).sum();
        self.kv.used_blocks() - held
    }

    /// Whether admission is paused by the KV high-water protection.
    pub fn admission_paused(&self) -> bool {
        self.paused_since.is_some()
    }

    /// Total time admission has been paused, up to `now`.
    pub fn paused_clock(&self, now: Time) -> Dur {
        self.paused_total + self.paused_since.map_or(Dur::ZERO, |since| now.since(since))
    }

    /// Pauses admission when KV use has reached the high-water mark, resumes it when use is
    /// back at the low-water mark (or nothing runs); returns whether it is paused.
    pub(crate) fn update_admission(&mut self, now: Time) -> bool {
        let Some(p) = self.config.kv_protection else { return false };
        let used = f64::from(self.kv_used_blocks());
        let total = f64::from(self.kv.total_blocks());
        match self.paused_since {
            None if used >= p.high_water * total && !self.running.is_empty() => self.paused_since = Some(now),
            Some(since) if used <= p.low_water * total || self.running.is_empty() => {
                self.paused_total += now.since(since);
                self.paused_since = None;
            }
            _ => {}
        }
        self.paused_since.is_some()
    }

    /// The batch of the step in progress (for a driver that streams its tokens).
    pub fn batch(&self) -> &Batch {
        &self.batch
    }

    /// Tokens the executor sampled in the step in progress, in batch-entry order.
    pub fn step_output(&self) -> &StepOutput {
        &self.output
    }

    /// Drops a queued or running request whose client went away, releasing its KV (the blocks
    /// it cached stay in the prefix tree for others). Returns whether it was here; a request
    /// parked for a KV hand-off is left to its transfer. Called between steps only.
    pub fn cancel(&mut self, now: Time, id: RequestId) -> bool {
        assert!(!self.stepping, "cancel called during a step");
        let Some(slot) = self.slots.iter().position(|s| s.as_ref().is_some_and(|q| q.request.id == id)) else {
            return false;
        };
        let slot = slot as u32;
        if let Some(i) = self.waiting.iter().position(|&s| s == slot) {
            self.waiting.remove(i);
        } else if let Some(i) = self.running.iter().position(|&s| s == slot) {
            self.running.remove(i);
        } else {
            return false;
        }
        let mut seq = self.slots[slot as usize].take().expect("queued slot is empty");
        self.kv.release(now, &mut seq.kv);
        self.prefill_tokens_left -= u64::from(seq.prefill_left());
        self.decode_tokens_left -= u64::from(seq.declared_left());
        self.free_slots.push(slot);
        if self.config.kv_protection.is_some() {
            self.update_admission(now);
        }
        self.debug_check();
        true
    }

    /// Requests that produced a token in the step [`Instance::end_step`] last credited, in
    /// batch order, once per token (a speculative step can produce several for one request):
    /// what a live engine streams (with the executor's sampled tokens, when it samples, in the
    /// same order).
    pub fn emitted(&self) -> &[RequestId] {
        &self.emitted
    }

    /// Forms the next batch and runs it. Returns `Ok(None)` when there is nothing to run.
    pub fn begin_step(&mut self, now: Time, exec: &mut dyn Executor) -> Result<Option<Dur>, ExecutorError> {
        assert!(!self.stepping, "begin_step called during a step");
        if !self.holds.is_empty() {
            self.expire_holds(now);
        }
        self.form_batch(now, exec.needs_block_tables(), exec.draft_tokens());
        if self.batch.is_empty() {
            return Ok(None);
        }
        self.prefetch_programs(now);
        self.output.tokens.clear();
        self.output.accepted.clear();
        match exec.execute(&self.batch, &mut self.output) {
            Ok(d) => {
                self.stepping = true;
                Ok(Some(d))
            }
            Err(e) => {
                // Nothing was computed: the sequences keep their blocks and are rescheduled.
                for k in 0..self.batch_slots.len() {
                    let s = self.batch_slots[k];
                    self.seq_mut(s).in_batch = false;
                }
                Err(e)
            }
        }
    }

    /// Credits the step begun by [`Instance::begin_step`], which ended at `now`. Finished
    /// requests (and runaways ended early) are appended to `finished`, runaways evicted to
    /// be placed elsewhere to `evicted`.
    pub fn end_step(&mut self, now: Time, finished: &mut Vec<Finished>, evicted: &mut Vec<Evicted>) {
        assert!(self.stepping, "end_step without begin_step");
        self.stepping = false;
        let block_size = self.config.block_size;
        let mut any_done = false;
        self.emitted.clear();
        let speculated = !self.output.accepted.is_empty();
        for k in 0..self.batch.entries.len() {
            let e = self.batch.entries[k];
            let slot = self.batch_slots[k];
            let seq = self.slots[slot as usize].as_mut().expect("batched slot is empty");
            seq.in_batch = false;
            let emits = if e.is_prefill {
                seq.kv_len += e.new_tokens;
                self.prefill_tokens_left -= u64::from(e.new_tokens);
                self.kv.commit(now, &mut seq.kv, &seq.request.block_hashes, seq.kv_len / block_size);
                seq.kv_len == seq.prefill_len
            } else if speculated {
                // The last token and the accepted drafts get their KV (the scheduler reserved
                // blocks for every verified position); the step samples one token after each.
                // The accepted drafts' tokens are credited here, the step's last one below.
                let accepted = self.output.accepted.get(k).copied().unwrap_or(0);
                debug_assert!(accepted < e.new_tokens, "{} accepted of {} verified", accepted, e.new_tokens - 1);
                let n = (1 + accepted).min(e.new_tokens).min(seq.decode_left());
                seq.kv_len += n;
                seq.generated += n - 1;
                self.decode_tokens_left -= u64::from(n - 1);
                self.emitted.extend(std::iter::repeat_n(e.request, n as usize - 1));
                true
            } else {
                seq.kv_len += 1;
                true
            };
            if emits {
                seq.generated += 1;
                self.decode_tokens_left -= 1;
                self.emitted.push(e.request);
                seq.first_token_at.get_or_insert(now);
                any_done |= seq.generated >= seq.stop_at();
            }
        }
        if any_done {
            self.retire_finished(now, finished);
        }
        if let Some(p) = self.config.kv_protection {
            if let Some(limit) = p.runaway_output_tokens {
                self.evict_runaways(now, limit, &p, finished, evicted);
            }
            self.update_admission(now);
        }
        self.debug_check();
    }

    /// Under KV pressure (use at or above the high-water mark), evicts runaways, the one
    /// holding the most blocks first, until use is at or below the low-water mark.
    fn evict_runaways(
        &mut self,
        now: Time,
        limit: u32,
        p: &KvProtection,
        finished: &mut Vec<Finished>,
        evicted: &mut Vec<Evicted>,
    ) {
        let total = f64::from(self.kv.total_blocks());
        if f64::from(self.kv_used_blocks()) < p.high_water * total {
            return;
        }
        // Each pass evicts one request or stops: bounded by the running queue's length.
        while f64::from(self.kv_used_blocks()) > p.low_water * total {
            // Ties go to the most recently admitted (the last in the queue).
            let Some(pos) = (0..self.running.len())
                .filter(|&i| {
                    let seq = self.seq(self.running[i]);
                    seq.generated_here() > limit && seq.evictions < p.max_evictions
                })
                .max_by_key(|&i| (self.seq(self.running[i]).kv.blocks.len(), i))
            else {
                break;
            };
            let s = self.running.remove(pos);
            let mut seq = self.slots[s as usize].take().expect("running slot is empty");
            self.kv.release(now, &mut seq.kv);
            self.prefill_tokens_left -= u64::from(seq.prefill_left());
            self.decode_tokens_left -= u64::from(seq.declared_left());
            let reason = CutShort::Runaway { generated_here: seq.generated_here(), limit };
            match p.runaway_action {
                RunawayAction::Reroute => evicted.push(Evicted { request: seq.into_evicted(now), reason }),
                RunawayAction::End => finished.push(seq.into_finished(now, Some(reason))),
            }
            self.free_slots.push(s);
        }
    }

    fn retire_finished(&mut self, now: Time, finished: &mut Vec<Finished>) {
        let mut kept = 0;
        for i in 0..self.running.len() {
            let s = self.running[i];
            let seq = self.seq(s);
            if seq.generated < seq.stop_at() {
                self.running[kept] = s;
                kept += 1;
                continue;
            }
            if seq.generated < seq.target_output() {
                self.park_sending(now, s);
                continue;
            }
            let mut seq = self.slots[s as usize].take().expect("running slot is empty");
            // Its end-of-sequence came before the bound the report counted to.
            self.decode_tokens_left -= u64::from(seq.declared_left());
            self.release_finished(now, &mut seq);
            self.free_slots.push(s);
            finished.push(seq.into_finished(now, None));
        }
        self.running.truncate(kept);
    }

    /// Releases a finished turn's KV, or keeps its path for its session's next turn (see
    /// [`crate::programs`]).
    fn release_finished(&mut self, now: Time, seq: &mut Seq) {
        let (Some(config), Some(session)) = (self.config.program_hold, seq.request.service.session) else {
            self.kv.release(now, &mut seq.kv);
            return;
        };
        if let Some(old) = self.holds.take(session) {
            self.kv.release_path(now, old.node);
        }
        let cached = &seq.request.block_hashes[..(seq.kv.tree_blocks as usize).min(seq.request.block_hashes.len())];
        self.sessions.ended(now, session, cached, config.prefetch);
        if !Holds::worth_holding(&config, self.sessions.pause(session)) {
            self.kv.release(now, &mut seq.kv);
            return;
        }
        self.keep_path(now, session, &mut seq.kv, &config);
    }

    /// Keeps `kv`'s tree path as `session`'s hold (its private blocks, if any, are freed),
    /// dropping the shortest holds while they pass their share.
    fn keep_path(&mut self, now: Time, session: crate::SessionId, kv: &mut SeqKv, config: &ProgramHold) {
        if let Some((node, blocks)) = self.kv.release_keeping_path(kv) {
            self.holds.add(Hold { session, node, blocks, since: now });
            while self.holds.blocks() > self.hold_cap(config) && self.drop_hold(now, None) {}
        }
    }

    /// Blocks admission keeps free ([`InstanceConfig::admission_watermark`]).
    pub(crate) fn watermark_blocks(&self) -> u32 {
        (f64::from(self.kv.total_blocks()) * self.config.admission_watermark) as u32
    }

    fn hold_cap(&self, config: &ProgramHold) -> u32 {
        (config.share * f64::from(self.kv.total_blocks())) as u32
    }

    /// Loads sessions' contexts back from L2/L3 in the background of the step just formed
    /// (see [`crate::programs`]): first the turns waiting here, then, if none waits, the
    /// sessions whose next turn is expected within the lead.
    fn prefetch_programs(&mut self, now: Time) {
        let Some((config, lead)) = self.config.program_hold.and_then(|h| Some((h, h.prefetch?))) else { return };
        let mut budget = self.kv.blocks_for(self.config.max_batch_tokens);
        self.scratch.clear();
        self.scratch.extend(self.waiting.iter().copied());
        for k in 0..self.scratch.len() {
            let s = self.scratch[k];
            let seq = self.seq(s);
            let Some(session) = seq.request.service.session.filter(|_| !seq.prefetched) else { continue };
            // As the scheduler matches it: at least one prompt token is computed.
            let max = ((seq.prefill_len - 1) / self.config.block_size) as usize;
            let hashes = std::mem::take(&mut self.seq_mut(s).request.block_hashes);
            let (loaded, done) = self.prefetch(now, session, &hashes[..max.min(hashes.len())], budget, &config);
            let seq = self.seq_mut(s);
            seq.request.block_hashes = hashes;
            seq.prefetched = done;
            budget -= loaded;
            if budget == 0 {
                return;
            }
        }
        if !self.waiting.is_empty() {
            return;
        }
        while let Some((session, hashes)) = self.sessions.take_due(now + lead) {
            let (loaded, done) = self.prefetch(now, session, &hashes, budget, &config);
            budget -= loaded;
            if !done {
                self.sessions.again(now, session, hashes);
                return;
            }
        }
    }

    /// Loads into L1 what of `hashes` (a session's context) L1 lacks and L2/L3 hold, at most
    /// `budget` blocks and into room beyond the watermark and within the holds' share, and
    /// holds the path for `session`. Returns the blocks loaded and whether nothing of the
    /// prefix is left below L1.
    fn prefetch(
        &mut self,
        now: Time,
        session: crate::SessionId,
        hashes: &[BlockHash],
        budget: u32,
        config: &ProgramHold,
    ) -> (u32, bool) {
        let watermark = self.watermark_blocks();
        let mut kv = SeqKv::default();
        self.kv.match_more(now, &mut kv, hashes, hashes.len() as u32);
        // The path just matched is referenced by `kv`: a hold of it can go.
        if let Some(h) = self.holds.take(session) {
            self.kv.release_path(now, h.node);
        }
        let room = self
            .kv
            .available_blocks()
            .saturating_sub(watermark)
            .min(self.hold_cap(config).saturating_sub(self.holds.blocks() + kv.tree_blocks))
            .min(budget);
        let all = self.kv.peek_lower(&kv, hashes, hashes.len() as u32);
        let hit = self.kv.peek_lower(&kv, hashes, kv.tree_blocks + room);
        if hit.blocks() == 0 || !self.kv.promote(now, &mut kv, hashes, hit) {
            let done = all.blocks() == 0;
            self.keep_path(now, session, &mut kv, config);
            return (0, done);
        }
        let block_size = self.config.block_size;
        self.batch.stats.prefetch_l2_tokens += u64::from(hit.l2 * block_size);
        self.batch.stats.prefetch_l3_tokens += u64::from(hit.l3 * block_size);
        self.keep_path(now, session, &mut kv, config);
        (hit.blocks(), hit.blocks() == all.blocks())
    }

    /// Drops the hold of the shortest program, `last`'s only when no other is left (a turn
    /// of `last` waiting for room has matched most of its session's path: dropping that hold
    /// frees little); false when none is left.
    pub(crate) fn drop_hold(&mut self, now: Time, last: Option<crate::SessionId>) -> bool {
        match self.holds.take_shortest(last).or_else(|| self.holds.take_shortest(None)) {
            Some(h) => {
                self.kv.release_path(now, h.node);
                true
            }
            None => false,
        }
    }

    /// Drops the holds older than the longest pause held.
    fn expire_holds(&mut self, now: Time) {
        let Some(config) = self.config.program_hold else { return };
        while let Some(h) = self.holds.take_expired(now, config.max_pause) {
            self.kv.release_path(now, h.node);
        }
    }

    /// A turn of a held session was admitted: it holds the path itself now.
    pub(crate) fn resume_program(&mut self, now: Time, s: u32) {
        let Some(session) = self.seq(s).request.service.session else { return };
        if let Some(h) = self.holds.take(session) {
            self.kv.release_path(now, h.node);
        }
    }

    pub(crate) fn seq_mut(&mut self, slot: u32) -> &mut Seq {
        self.slots[slot as usize].as_mut().expect("slot is empty")
    }

    pub(crate) fn seq(&self, slot: u32) -> &Seq {
        self.slots[slot as usize].as_ref().expect("slot is empty")
    }

    fn debug_check(&self) {
        if cfg!(any(test, feature = "invariants")) {
            self.check_invariants();
        }
    }

    /// Checks every bookkeeping rule of the instance; panics naming the broken one.
    pub fn check_invariants(&self) {
        let mut seen = vec![false; self.slots.len()];
        for &s in self.waiting.iter().chain(self.running.iter()).chain(self.parked.iter()) {
            assert!(!seen[s as usize], "slot {s} queued twice");
            seen[s as usize] = true;
        }
        for &s in &self.parked {
            assert!(self.seq(s).parked.is_some(), "parked slot {s} is not marked parked");
        }
        for &s in self.waiting.iter().chain(self.running.iter()) {
            assert!(self.seq(s).parked.is_none(), "queued slot {s} is marked parked");
        }
        for &s in &self.free_slots {
            assert!(self.slots[s as usize].is_none(), "free slot {s} holds a sequence");
        }
        let (mut private, mut prefill, mut decode) = (0u32, 0u64, 0u64);
        for (i, seq) in self.slots.iter().enumerate() {
            let Some(seq) = seq else { continue };
            assert!(seen[i], "slot {i} holds a sequence in no queue");
            assert!(seq.kv.blocks.len() as u32 >= self.kv.blocks_for(seq.kv_len), "slot {i} has KV without blocks");
            private += seq.kv.private_blocks();
            prefill += u64::from(seq.prefill_left());
            decode += u64::from(seq.declared_left());
        }
        for &s in &self.waiting {
            let seq = self.seq(s);
            assert!(seq.kv.blocks.is_empty() && seq.kv_len == 0, "waiting slot {s} holds KV");
        }
        if self.config.kv_protection.is_none() {
            assert!(self.paused_since.is_none(), "admission paused without protection");
        }
        assert_eq!(prefill, self.prefill_tokens_left, "prefill tokens left");
        assert_eq!(decode, self.decode_tokens_left, "decode tokens left");
        self.holds.check_invariants();
        self.kv.check_invariants(private);
    }
}
