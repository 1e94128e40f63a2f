//! The boundary between the controller and a fleet backend.

use crate::event::FleetEvent;
use crate::router::Why;
use crate::view::Role;
use engine::{InstanceId, Request, RequestId, Time};

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

/// Why a request could not be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    #[error("no instance is serving")]
    NoInstance,
    #[error("request needs {needed_tokens} tokens of KV, more than any serving instance holds ({largest_tokens})")]
    TooLarge { needed_tokens: u64, largest_tokens: u64 },
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
