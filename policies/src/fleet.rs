//! The boundary between the controller and a fleet backend.

use crate::controller::Route;
use engine::kv::KvEvent;
use engine::{CutShort, InstanceId, Load, Request, RequestId, Time};

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
    /// driver places it again through [`crate::Controller::reroute`].
    RequestEvicted { instance: InstanceId, request: RequestId, reason: CutShort },
    /// Changes to what instances cache (for L3, to the shared store), in order, each with
    /// the instance that published it; batched as engines publish them. Published only when
    /// the controller asks for them ([`crate::Controller::wants_kv_events`]).
    Kv { events: Vec<(InstanceId, KvEvent)> },
}

/// What the controller asks a fleet to do besides serving requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Stop routing to the instance, let its requests finish, then take it down.
    Drain { instance: InstanceId },
}

/// Why a fleet could not take a routed request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DispatchError {
    #[error("{instance} is not serving")]
    NotServing { instance: InstanceId },
    #[error("{instance} refused the request: {reason}")]
    Refused { instance: InstanceId, reason: engine::Rejected },
}

/// A fleet backend: the simulator's, or the live one.
pub trait Fleet {
    /// Hands a routed request to its instance.
    fn dispatch(&mut self, now: Time, request: Request, route: &Route) -> Result<(), (DispatchError, Request)>;
    /// Carries out a controller command.
    fn apply(&mut self, now: Time, command: &Command);
    /// Moves the events that happened since the last call into `out`, in order.
    fn poll_events(&mut self, out: &mut Vec<FleetEvent>);
}
