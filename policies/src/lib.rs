//! Fleet-level decisions, pure and deterministic.
//!
//! [`Controller`] is a sans-IO state machine: it hears [`FleetEvent`]s, routes requests and
//! emits [`Command`]s, with `now` always an argument. A fleet backend implements [`Fleet`]:
//! the simulator's fleet in virtual time, or the live driver over gRPC. The policy tested
//! offline is therefore the policy deployed.
//!
//! | module | purpose |
//! | --- | --- |
//! | `fleet` | the [`Fleet`] trait, [`FleetEvent`] in, [`Command`] out |
//! | `view` | [`FleetView`]: what the controller knows of each instance |
//! | `controller` | [`Controller`]: admission, routing, accounting |
//! | `prefix_index` | [`PrefixIndex`]: which instance caches which prefix, from KV events |
//! | `router` | the [`Router`] trait, one file per router, and the registry |

pub mod controller;
pub mod fleet;
pub mod prefix_index;
pub mod router;
pub mod view;

pub use controller::{Controller, ControllerConfig, Reject, Route};
pub use fleet::{Command, DispatchError, Fleet, FleetEvent};
pub use prefix_index::{PrefixIndex, PrefixMatches, TierMatch};
pub use router::{CostHints, Pick, Router, RouterConfig, UnknownRouter, Why};
pub use view::{CandidateRule, FleetView, InstanceState, InstanceView};
