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
//! | `output_share` | how much of their bounds (`max_tokens`) outputs use, learned from those that ended |
//! | `controller` | [`Controller`]: admission, routing, accounting |
//! | `prefix_index` | [`PrefixIndex`]: which instance caches which prefix, from KV events |
//! | `router` | the [`Router`] trait, one file per router, and the registry |
//! | `pd` | disaggregated fleets: handoffs to decode, SLO load, pool sizing ([`PdConfig`]) |
//! | `pairing` | choosing the decode instance of a request whose prefill ended |
//! | `slo_load` | [`SloLoad`]: `Load_P` and `Load_D` from actual and predicted latency |
//! | `autoscaler` | the [`Autoscaler`] trait, one file per scaling policy, and the registry |
//! | `flow` | [`Flow`]: flow control ahead of routing (priority bands, tenants, shedding), one file per rule |
//! | `params` | [`Params`]: each policy's tunable parameters, their ranges and the one check |

pub mod autoscaler;
pub mod controller;
pub mod event;
pub mod fleet;
pub mod flow;
pub mod output_share;
pub mod pairing;
pub mod params;
pub mod pd;
pub mod prefix_index;
pub mod router;
pub mod slo_load;
pub mod view;

pub use autoscaler::{Autoscaler, AutoscalerConfig, Knobs, PoolSize, UnknownAutoscaler};
pub use controller::{Controller, ControllerConfig, Released};
pub use event::{FleetEvent, OutputEnd};
pub use fleet::{Command, DispatchError, Fleet, PlaceError, Reject, Route, Unplaced};
pub use flow::{Flow, FlowConfig, Shed, ShedReason, Targets};
pub use pairing::TransferHints;
pub use params::{Param, ParamError, Params, PolicyParams};
pub use pd::{PdConfig, PdStatus, ScalingEvent};
pub use prefix_index::{PrefixIndex, PrefixMatches, TierMatch};
pub use router::{CostHints, Pick, Router, RouterConfig, RouterError, RouterFactory, UnknownRouter, Why};
pub use slo_load::{DecodeModel, Loads, SloLoad, SloLoadConfig};
pub use view::{CandidateRule, FleetView, InstanceState, InstanceView, Role};

/// Every tunable parameter of every router, prefill scheduler and autoscaler, with defaults.
pub fn catalog() -> Vec<PolicyParams> {
    let mut out = router::RouterConfig::catalog();
    out.push(PolicyParams::of("prefill-scheduler", "fair", &engine::FairPrefill::default()));
    out.extend(autoscaler::AutoscalerConfig::catalog());
    out.extend(flow::FlowConfig::catalog());
    out
}
