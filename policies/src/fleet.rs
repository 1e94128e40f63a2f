//! The boundary between the controller and a fleet backend.

use crate::controller::Reject;
use crate::router::Why;
use crate::view::Role;
use engine::kv::KvEvent;
use engine::{CutShort, Dur, InstanceId, Load, ModelId, Request, RequestId, Time};

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
    /// reason in its record).
    RequestFinished { instance: InstanceId, request: RequestId },
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
    Kv { instance: InstanceId, events: Vec<KvEvent> },
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

/// What the controller asks a fleet to do besides serving requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Stop routing to the instance, let its requests finish, then take it down.
    Drain { instance: InstanceId },
    /// Start a new instance in the pool of `role`; it announces itself with `InstanceRole`
    /// and `InstanceUp` once started (which takes the fleet's start-up time).
    Start { role: Role },
    /// Send the KV of `request`, whose prefill ended on `from`, to decode instance `to`.
    Transfer { request: RequestId, from: InstanceId, to: InstanceId },
}

/// Where a request goes and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// The instance that computes the prompt.
    pub prefill: InstanceId,
    /// The instance that generates the output (the same one in a colocated fleet).
    pub decode: InstanceId,
    pub why: Why,
}

/// Why a fleet could not take a routed request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DispatchError {
    #[error("{instance} is not serving")]
    NotServing { instance: InstanceId },
    #[error("{instance} refused the request: {reason}")]
    Refused { instance: InstanceId, reason: engine::Rejected },
}

/// Why a request could not be placed: no instance for it, or the chosen one did not take it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    #[error(transparent)]
    Reject(#[from] Reject),
    #[error(transparent)]
    Dispatch(#[from] DispatchError),
}

/// A request that was not placed, handed back whole with its payload.
#[derive(Debug)]
pub struct Unplaced<P> {
    pub error: PlaceError,
    pub request: Request,
    pub payload: P,
}

/// A fleet backend: the simulator's, or the live one.
///
/// # Contract
///
/// - Requests reach [`Fleet::dispatch`] only through [`crate::Controller::place`], right after
///   the controller routed them: the one path from a decision to a fleet, in both drivers.
/// - `Ok`: the fleet owns the request and its payload and reports, on the instance it went to,
///   exactly one end of its stay there: `RequestFinished`, `RequestEvicted` or `RequestLost`
///   (the driver places it again), or `PrefillDone` and later `TransferDone` or
///   `TransferRefused` for the transfer the controller then commands.
/// - `Err`: the fleet did nothing with it and reports nothing of it; it hands the request and
///   payload back, and `place` undoes the controller's accounting of the route.
/// - [`Fleet::poll_events`] yields events in the order they happened; an instance announces
///   itself (`InstanceModel`, `InstanceRole`, then `InstanceUp`) before any news of it.
pub trait Fleet {
    /// What a request carries besides [`Request`] to be served: nothing in the simulator; the
    /// client's tokens and its reply channel in the live fleet.
    type Payload;
    /// Hands a routed request to its instance.
    #[allow(clippy::type_complexity)]
    fn dispatch(
        &mut self,
        now: Time,
        request: Request,
        payload: Self::Payload,
        route: &Route,
    ) -> Result<(), (DispatchError, Request, Self::Payload)>;
    /// Carries out a controller command.
    fn apply(&mut self, now: Time, command: &Command);
    /// Moves the events that happened since the last call into `out`, in order.
    fn poll_events(&mut self, out: &mut Vec<FleetEvent>);
}
