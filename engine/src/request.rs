//! What an instance is asked to serve, and what it reports back when done.

use crate::ids::{BlockHash, ModelId, RequestId};
use crate::service::Service;
use crate::time::{Dur, Time};
use std::fmt;
use std::num::NonZeroU32;

/// A generation request as the engine sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub id: RequestId,
    /// When the request reached the fleet (TTFT and queueing are measured from here).
    pub arrival: Time,
    pub prompt_tokens: u32,
    /// The bound on its output the client asked for (`max_tokens`): all that routers, load
    /// reports and KV admission know of the output before it ends, in the simulator as live.
    pub max_output_tokens: u32,
    /// Where the model's end-of-sequence comes, in output tokens, when before the bound: known
    /// only to a simulation (a trace's output length under a larger client bound; at least
    /// one, the token the prefill samples). `None`: the output runs to `max_output_tokens` (a
    /// live engine may still stop earlier, at an end-of-sequence token it samples).
    pub ends_after: Option<NonZeroU32>,
    /// Chained hashes of the prompt's full blocks at the engine's block size (see
    /// [`BlockHash`]); may be shorter than `prompt_tokens / block_size`, in which case the rest
    /// of the prompt is never shared.
    pub block_hashes: Vec<BlockHash>,
    /// `None` for a new request. For one evicted from another instance, what it had done
    /// there: the instance that takes it recomputes the prompt and the tokens generated so
    /// far (as after a preemption) and generates the rest, and its [`Finished`] record
    /// describes the whole request. Boxed: few requests carry one.
    pub resume: Option<Box<Resume>>,
    /// The model it asks for (see [`ModelId`]).
    pub model: ModelId,
    /// Its class, tenant, deadline and session (see [`crate::service`]).
    pub service: Service,
}

/// The record of a request's earlier placements, carried by the request when it is placed
/// again after an eviction (see [`Evicted`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resume {
    /// Output tokens generated so far, on every instance it left; they are part of
    /// `max_output_tokens`.
    pub generated: u32,
    /// When it was first admitted, and when its first token came out (TTFT stays measured
    /// from the original arrival to that token).
    pub admitted_at: Time,
    pub first_token_at: Time,
    /// Prompt tokens its first prefill found cached, by tier (a recompute elsewhere is not a
    /// prompt hit, as after a preemption).
    pub cached_tokens: [u32; 3],
    pub preemptions: u32,
    pub yields: u32,
    pub paused_wait: Dur,
    /// Times it was evicted so far (at least 1).
    pub evictions: u32,
}

impl Request {
    /// Tokens of KV the request holds when it finishes: the prompt plus every generated token
    /// but the last (whose KV is never written).
    pub fn peak_kv_tokens(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.max_output_tokens.max(1)) - 1
    }

    /// Output tokens it generates unless cut short: up to its end-of-sequence where the
    /// simulation knows it, else its bound; at least one (the token its prefill samples).
    pub fn output_len(&self) -> u32 {
        self.ends_after.map_or(self.max_output_tokens, |e| e.get().min(self.max_output_tokens)).max(1)
    }

    /// Output tokens generated before it came to this instance (0 for a new request).
    pub fn generated_before(&self) -> u32 {
        self.resume.as_ref().map_or(0, |r| r.generated)
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
    /// Tokens generated, on every instance it was placed on; fewer than asked for only when
    /// it was `ended`.
    pub output_tokens: u32,
    /// Prompt tokens served from the prefix cache instead of computed (token-weighted hit),
    /// by the tier they came from (indexed by [`crate::kv::Tier::index`]).
    pub cached_tokens: [u32; 3],
    /// Times the request was preempted and its KV recomputed.
    pub preemptions: u32,
    /// Times its prefill yielded to others at a chunk boundary (fair prefill), keeping its KV.
    pub yields: u32,
    /// Time it spent waiting for admission while its instance had paused admission (KV above
    /// the high-water mark), over every instance it was placed on.
    pub paused_wait: Dur,
    /// Times it was evicted from an instance and placed again.
    pub evictions: u32,
    /// `Some` when the instance ended it before its output was complete, and why.
    pub ended: Option<CutShort>,
}

/// Why a request left an instance before generating all of its output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutShort {
    /// It generated more than `limit` tokens on the instance while the instance's KV was at
    /// or above the high-water mark.
    Runaway { generated_here: u32, limit: u32 },
}

impl fmt::Display for CutShort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            CutShort::Runaway { generated_here, limit } => write!(
                f,
                "runaway: {generated_here} tokens generated here, over the limit of {limit}, with KV above the high-water mark"
            ),
        }
    }
}

/// A request the instance evicted before it finished: its KV is released, and the driver
/// must place it again (or account for it); `request.resume` carries what it had done.
#[derive(Clone, Debug)]
pub struct Evicted {
    pub request: Request,
    pub reason: CutShort,
}

/// A request whose prefill ended on a prefill-only instance, waiting for its KV to be sent.
#[derive(Clone, Debug)]
pub struct Handoff {
    /// The request as a decode instance takes it: `resume` carries the first token (and the
    /// timeline: admission, first-token time, cache hits) so the finished record describes the
    /// whole request.
    pub request: Request,
    /// Tokens of KV the transfer carries (the prompt's).
    pub kv_tokens: u32,
}
