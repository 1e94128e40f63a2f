//! What a fleet tells the controller: the news both drivers report, in the order it happened.

use crate::view::Role;
use engine::kv::KvEvents;
use engine::{CutShort, Dur, InstanceId, Load, ModelId, RequestId};

/// What a fleet tells the controller. Closed: a new kind of news must be handled everywhere.
#[derive(Clone, Debug, PartialEq)]
pub enum FleetEvent {
    /// An instance is ready to serve, and how much KV it can ever hold for one request.
    InstanceUp { instance: InstanceId, capacity_tokens: u64 },
    /// An instance stopped taking new requests; its in-flight ones finish.
    InstanceDraining { instance: InstanceId },
    /// An instance is gone (drained, or lost).
    InstanceDown { instance: InstanceId },
    /// The instance's queues and KV use at the end of an iteration.
    Load { instance: InstanceId, load: Load },
    /// A request left the instance after generating its output (or ended early, with a
    /// reason in its record). `output`: how long it was, for one that ended by itself.
    RequestFinished { instance: InstanceId, request: RequestId, output: Option<OutputEnd> },
    /// The instance evicted a request before it finished (KV high-water protection); the
    /// driver places it again through [`crate::Controller::place`].
    RequestEvicted { instance: InstanceId, request: RequestId, reason: CutShort },
    /// A request left the instance unfinished, as far as the live fleet could tell: its
    /// stream broke (the engine vanished, failed or stopped answering) or the engine evicted
    /// it. The driver places it again through [`crate::Controller::place`]. The simulator,
    /// which knows why, reports `RequestEvicted` instead.
    RequestLost { instance: InstanceId, request: RequestId },
    /// Changes to what an instance caches (for L3, to the shared store), in order, as the
    /// instance published them together. Published only when the controller asks for them
    /// ([`crate::Controller::wants_kv_events`]).
    Kv { instance: InstanceId, events: KvEvents },
    /// The instance serves one phase only (a disaggregated fleet); sent before its
    /// `InstanceUp`. Instances never told are colocated.
    InstanceRole { instance: InstanceId, role: Role },
    /// The model an instance serves, before its `InstanceUp`; instances never told serve
    /// model 0 (a fleet of one model, as the simulator's). Requests go only to instances of
    /// their own model.
    InstanceModel { instance: InstanceId, model: ModelId },
    /// A prefill instance computed the prompt of a request and sampled its first token
    /// `ttft` after the request arrived; its KV (`kv_tokens`) stays there until the controller
    /// sends it to a decode instance with [`Command::Transfer`].
    PrefillDone { instance: InstanceId, request: RequestId, kv_tokens: u64, output_tokens: u32, ttft: Dur },
    /// A KV transfer ended: `from` released the KV, `to` decodes the request.
    TransferDone { request: RequestId, from: InstanceId, to: InstanceId },
    /// `to` could not take a transfer (no KV room when it began); the KV stays on `from`
    /// and the controller places the request again.
    TransferRefused { request: RequestId, from: InstanceId, to: InstanceId },
    /// An instance asked for with [`Command::Start`] will not come: it failed before it
    /// served (a live engine process that exited at start).
    StartFailed { role: Role },
    /// A request finished with these latencies (sent after its `RequestFinished`, only to a
    /// controller that asked: [`crate::Controller::wants_latencies`]). `tpot` is `None` for
    /// outputs of one token.
    RequestLatency { instance: InstanceId, request: RequestId, ttft: Dur, tpot: Option<Dur> },
}

/// The length of an output that ended by itself (its end-of-sequence or its bound), beside
/// the bound its client asked for: how much of their bounds outputs use, which routers may
/// learn (a live router knows no output's length before it ends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputEnd {
    pub tokens: u32,
    pub bound: u32,
}
