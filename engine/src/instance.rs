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
//!    cached, finished requests are handed back.
//!
//! Requests arriving during a step wait for the next one, as in a real engine.

use crate::batch::Batch;
use crate::executor::{Executor, ExecutorError, StepOutput};
use crate::ids::BlockId;
use crate::kv::{KvCache, KvEvent, SharedStore};
use crate::request::{Finished, Request};
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
    /// How prefill chunks are shared among the prompts being computed.
    pub prefill: PrefillPolicy,
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
            prefill: PrefillPolicy::Fcfs,
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
}

#[derive(Debug)]
pub struct Instance {
    pub(crate) config: InstanceConfig,
    pub(crate) kv: KvCache,
    /// Slot-indexed sequences; a slot is reused after its request finishes.
    pub(crate) slots: Vec<Option<Seq>>,
    pub(crate) free_slots: Vec<u32>,
    /// Block-table vectors of finished sequences, kept to avoid allocating per request.
    pub(crate) spare_tables: Vec<Vec<BlockId>>,
    /// Requests not yet admitted (or preempted), in order of service.
    pub(crate) waiting: VecDeque<u32>,
    /// Admitted requests in order of admission; preemption takes from the back.
    pub(crate) running: Vec<u32>,
    pub(crate) batch: Batch,
    /// Slot of each batch entry, in entry order.
    pub(crate) batch_slots: Vec<u32>,
    output: StepOutput,
    stepping: bool,
    pub(crate) prefill_tokens_left: u64,
    pub(crate) decode_tokens_left: u64,
    /// Last turn handed out to a prefill (fair prefill's rotation).
    pub(crate) next_turn: u64,
}

impl Instance {
    pub fn new(config: InstanceConfig) -> Instance {
        Instance::with_shared_store(config, None)
    }

    /// An instance whose evicted blocks go on to `l3`, the store its fleet shares (none: no L3).
    pub fn with_shared_store(config: InstanceConfig, l3: Option<SharedStore>) -> Instance {
        Instance {
            kv: KvCache::with_tiers(config.total_blocks, config.block_size, config.l2_blocks, l3),
            config,
            slots: Vec::new(),
            free_slots: Vec::new(),
            spare_tables: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            batch: Batch::default(),
            batch_slots: Vec::new(),
            output: StepOutput::default(),
            stepping: false,
            prefill_tokens_left: 0,
            decode_tokens_left: 0,
            next_turn: 0,
        }
    }

    pub fn config(&self) -> &InstanceConfig {
        &self.config
    }

    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Starts recording the KV events of every tier, for a fleet that publishes them.
    pub fn record_kv_events(&mut self) {
        self.kv.record_events();
    }

    /// Moves the KV events recorded since the last call into `out`.
    pub fn drain_kv_events(&mut self, out: &mut Vec<KvEvent>) {
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

    /// Queues a request. A request that can never fit is refused (with the request returned).
    pub fn enqueue(&mut self, request: Request) -> Result<(), (Rejected, Request)> {
        if let Err(e) = self.admissible(&request) {
            return Err((e, request));
        }
        let table = self.spare_tables.pop().unwrap_or_default();
        let seq = Seq::new(request, table);
        self.prefill_tokens_left += u64::from(seq.prefill_left());
        self.decode_tokens_left += u64::from(seq.decode_left());
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(seq);
                s
            }
            None => {
                self.slots.push(Some(seq));
                self.slots.len() as u32 - 1
            }
        };
        self.waiting.push_back(slot);
        Ok(())
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn is_stepping(&self) -> bool {
        self.stepping
    }

    /// Requests queued or running.
    pub fn in_flight(&self) -> usize {
        self.running.len() + self.waiting.len()
    }

    pub fn load(&self) -> Load {
        Load {
            waiting: self.waiting.len() as u32,
            running: self.running.len() as u32,
            kv_used_blocks: self.kv.used_blocks(),
            kv_total_blocks: self.kv.total_blocks(),
            kv_cached_blocks: self.kv.cached_blocks(),
            prefill_tokens_left: self.prefill_tokens_left,
            decode_tokens_left: self.decode_tokens_left,
        }
    }

    /// The batch of the step in progress (for a driver that streams its tokens).
    pub fn batch(&self) -> &Batch {
        &self.batch
    }

    /// Tokens the executor sampled in the step in progress, in batch-entry order.
    pub fn step_output(&self) -> &StepOutput {
        &self.output
    }

    /// Forms the next batch and runs it. Returns `Ok(None)` when there is nothing to run.
    pub fn begin_step(&mut self, now: Time, exec: &mut dyn Executor) -> Result<Option<Dur>, ExecutorError> {
        assert!(!self.stepping, "begin_step called during a step");
        self.form_batch(now, exec.needs_block_tables());
        if self.batch.is_empty() {
            return Ok(None);
        }
        self.output.tokens.clear();
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
    /// requests are appended to `finished`.
    pub fn end_step(&mut self, now: Time, finished: &mut Vec<Finished>) {
        assert!(self.stepping, "end_step without begin_step");
        self.stepping = false;
        let block_size = self.config.block_size;
        let mut any_done = false;
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
            } else {
                seq.kv_len += 1;
                true
            };
            if emits {
                seq.generated += 1;
                self.decode_tokens_left -= 1;
                seq.first_token_at.get_or_insert(now);
                any_done |= seq.generated >= seq.target_output();
            }
        }
        if any_done {
            self.retire_finished(now, finished);
        }
        self.debug_check();
    }

    fn retire_finished(&mut self, now: Time, finished: &mut Vec<Finished>) {
        let mut kept = 0;
        for i in 0..self.running.len() {
            let s = self.running[i];
            let seq = self.seq(s);
            if seq.generated < seq.target_output() {
                self.running[kept] = s;
                kept += 1;
                continue;
            }
            let mut seq = self.slots[s as usize].take().expect("running slot is empty");
            self.kv.release(now, &mut seq.kv);
            let (done, table) = seq.into_finished(now);
            self.spare_tables.push(table);
            self.free_slots.push(s);
            finished.push(done);
        }
        self.running.truncate(kept);
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
        for &s in self.waiting.iter().chain(self.running.iter()) {
            assert!(!seen[s as usize], "slot {s} queued twice");
            seen[s as usize] = true;
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
            decode += u64::from(seq.decode_left());
        }
        for &s in &self.waiting {
            let seq = self.seq(s);
            assert!(seq.kv.blocks.is_empty() && seq.kv_len == 0, "waiting slot {s} holds KV");
        }
        assert_eq!(prefill, self.prefill_tokens_left, "prefill tokens left");
        assert_eq!(decode, self.decode_tokens_left, "decode tokens left");
        self.kv.check_invariants(private);
    }
}
