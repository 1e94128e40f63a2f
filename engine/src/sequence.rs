//! A request's state inside an instance.

use crate::kv::SeqKv;
use crate::request::{CutShort, Finished, Request, Resume};
use crate::time::{Dur, Time};

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
    /// Output tokens generated before it came to this instance (see [`Request::resume`]):
    /// the runaway rule counts only the tokens generated here.
    pub generated_before: u32,
    /// Time waited for admission while admission was paused, and the instance's paused
    /// clock when it last entered the waiting queue (see `Instance::paused_clock`).
    pub paused_wait: Dur,
    pub paused_mark: Dur,
    pub evictions: u32,
    /// Prefill-only (disaggregated prefill): the sequence stops after its first token and
    /// hands its KV to a decode instance instead of decoding here.
    pub handoff: bool,
    /// Out of the queues while its KV travels to or from another instance (see
    /// `crate::handoff`).
    pub parked: Option<Parked>,
    /// Its session's context was loaded back from L2/L3 while it waited
    /// (`crate::programs`): nothing more to prefetch for it.
    pub prefetched: bool,
}

/// Why a sequence waits outside the queues, holding its blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Parked {
    /// Its prefill ended here and its KV is being sent; the blocks are freed when the
    /// transfer ends.
    Sending,
    /// Its KV is being received into blocks reserved for it; it decodes once the transfer ends.
    Receiving,
}

impl Seq {
    /// A sequence for `request`; one resumed after an eviction recomputes its prompt and the
    /// tokens it generated, as after a preemption, and keeps its timeline.
    pub fn new(request: Request, paused_mark: Dur) -> Seq {
        let resume = request.resume.as_deref().copied();
        let generated = request.generated_before();
        assert!(generated < request.output_len(), "{} resumed with its output already complete", request.id);
        Seq {
            prefill_len: request.prompt_tokens + generated,
            request,
            kv: SeqKv::default(),
            kv_len: 0,
            generated,
            admitted_at: resume.map(|r| r.admitted_at),
            first_token_at: resume.map(|r| r.first_token_at),
            cached_tokens: resume.map_or([0; 3], |r| r.cached_tokens),
            loading: [0; 2],
            preemptions: resume.map_or(0, |r| r.preemptions),
            in_batch: false,
            turn: 0,
            quota_left: 0,
            yields: resume.map_or(0, |r| r.yields),
            generated_before: generated,
            paused_wait: resume.map_or(Dur::ZERO, |r| r.paused_wait),
            paused_mark,
            evictions: resume.map_or(0, |r| r.evictions),
            handoff: false,
            parked: None,
            prefetched: false,
        }
    }

    pub fn is_decoding(&self) -> bool {
        self.kv_len >= self.prefill_len
    }

    pub fn is_prefilling(&self) -> bool {
        !self.is_decoding()
    }

    /// Output tokens the request generates; at least one (the token its prefill samples).
    pub fn target_output(&self) -> u32 {
        self.request.output_len()
    }

    pub fn prefill_left(&self) -> u32 {
        self.prefill_len.saturating_sub(self.kv_len)
    }

    /// Tokens generated when the sequence leaves this instance: its whole output, or for a
    /// prefill-only sequence the one token its prefill samples (the decode instance generates
    /// the rest; a request placed again after an eviction has generated some already).
    pub fn stop_at(&self) -> u32 {
        if self.handoff {
            (self.generated_before + 1).min(self.target_output())
        } else {
            self.target_output()
        }
    }

    /// Tokens still to generate on this instance.
    pub fn decode_left(&self) -> u32 {
        self.stop_at().saturating_sub(self.generated)
    }

    /// Tokens still to generate on this instance as far as anyone outside the engine can know:
    /// up to the client's bound (`max_output_tokens`), not the end-of-sequence a simulation
    /// knows of. What the load report counts, as a live engine's would; at least
    /// [`Seq::decode_left`].
    pub fn declared_left(&self) -> u32 {
        let bound = self.request.max_output_tokens.max(1);
        let stop = if self.handoff { (self.generated_before + 1).min(bound) } else { bound };
        stop.saturating_sub(self.generated)
    }

    /// Hit accounting counts only the first prefill, so that a recompute after preemption
    /// cannot push the hit rate above what the prompt allows.
    pub fn counts_hits(&self) -> bool {
        self.first_token_at.is_none() && self.preemptions == 0
    }

    /// Makes room in the block table for the whole request (its peak KV, at most
    /// `most_blocks`) when it gets its first blocks: a table grown chunk by chunk and decode
    /// block by decode block would double up to it, a quarter of it spare on average.
    pub(crate) fn reserve_table(&mut self, block_size: u32, most_blocks: u32) {
        if self.kv.blocks.capacity() == 0 {
            // Up to its end-of-sequence where a simulation knows it: the bound may be far.
            let peak = u64::from(self.request.prompt_tokens) + u64::from(self.target_output()) - 1;
            let whole = peak.div_ceil(u64::from(block_size)).min(u64::from(most_blocks));
            self.kv.blocks.reserve_exact(whole as usize);
        }
    }

    /// Tokens generated on this instance (the runaway rule's count).
    pub fn generated_here(&self) -> u32 {
        self.generated - self.generated_before
    }

    /// The record of a request that left: finished, or `ended` early.
    pub fn into_finished(self, now: Time, ended: Option<CutShort>) -> Finished {
        let admitted_at = self.admitted_at.unwrap_or(now);
        Finished {
            admitted_at,
            first_token_at: self.first_token_at.unwrap_or(now),
            finished_at: now,
            output_tokens: self.generated,
            cached_tokens: self.cached_tokens,
            preemptions: self.preemptions,
            yields: self.yields,
            paused_wait: self.paused_wait,
            evictions: self.evictions,
            ended,
            request: self.request,
        }
    }

    /// The request of an evicted sequence (its KV already released), carrying its timeline
    /// to the instance that takes it next.
    pub fn into_evicted(mut self, now: Time) -> Request {
        self.request.resume = Some(Box::new(Resume {
            generated: self.generated,
            admitted_at: self.admitted_at.unwrap_or(now),
            first_token_at: self.first_token_at.unwrap_or(now),
            cached_tokens: self.cached_tokens,
            preemptions: self.preemptions,
            yields: self.yields,
            paused_wait: self.paused_wait,
            evictions: self.evictions + 1,
        }));
        self.request
    }
}
