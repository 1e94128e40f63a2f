//! Flow control ahead of routing: requests wait at the controller, in bounded queues per
//! priority band, until the fleet has room for them; sheddable work is refused when it
//! cannot be served in time.
//!
//! | file | purpose |
//! | --- | --- |
//! | `mod.rs` | [`FlowConfig`] (which rule, as a factory), the [`FlowRule`] trait, [`Targets`], [`Shed`] |
//! | `queue.rs` | [`Flow`]: the bands, the tenants' queues within a band, shedding by time |
//! | `slo.rs` | `slo`: room from predicted queue delay, decode step and KV against the SLO; least attained service; least slack first |
//! | `llm_d.rs` | `llm-d`: llm-d's flow control (queue depth and KV utilisation thresholds, round robin, FCFS) |
//! | `usage.rs` | tenants' recent service (decayed weighted tokens): least attained service, over-share |
//!
//! What every rule shares (in [`Flow`]): strict priority between bands (a band is served
//! only when every higher band's queue is empty or its head has no room); within a band,
//! tenants take turns by the rule's [`Fairness`]; within a tenant, the rule's order. A
//! request is released at a request boundary: after an event that may have made room (a
//! request finished, a load report), never by preempting one already placed. `none` (no
//! rule) places every request at once, as before flow control existed.
//!
//! **Invariant:** every request offered ends exactly once: placed (now or on release),
//! or shed (with its reason and a retry-after).

mod llm_d;
pub mod programs;
mod queue;
mod slo;
mod usage;

pub use llm_d::LlmDFlowConfig;
pub use queue::{Flow, Offer};
pub use slo::SloFlowConfig;

use crate::params::{Param, ParamError, Params, PolicyParams};
use crate::router::CostHints;
use crate::view::FleetView;
use engine::{Class, Dur, Request, Time};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// A class's latency targets, which flow control orders and sizes by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Targets {
    pub ttft: Dur,
    pub tpot: Dur,
}

/// How the tenants of one band share it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fairness {
    /// The tenant with the least attained service goes next, service counted in weighted
    /// tokens: prompt tokens plus `output_weight` × output tokens of the requests it was
    /// given (virtual token counting), decayed with `half_life` (see [`usage`]): what a
    /// tenant had long ago does not count against it, nor idle time for it.
    LeastAttained { output_weight: f64, half_life: Dur },
    /// Tenants in turn, one request each.
    RoundRobin,
}

/// The part of flow control that differs between rules.
pub trait FlowRule: Send + fmt::Debug {
    fn name(&self) -> &'static str;

    /// Whether the fleet has room for `request` now; if not, it waits in its band.
    /// `over_share`: its tenant had more than an equal share of the recent service (with
    /// least attained service).
    fn has_room(&self, view: &FleetView, request: &Request, over_share: bool) -> bool;

    /// Its place in its tenant's queue: lower goes first.
    fn order(&self, request: &Request) -> i64;

    /// When a queued request stops being on time (it goes behind the band's requests that
    /// still are), if ever.
    fn late_at(&self, request: &Request) -> Option<Time>;

    /// When a queued request is shed, if ever (only sheddable requests are).
    fn shed_at(&self, request: &Request) -> Option<Time>;

    /// Whether a sheddable request that finds no room is shed at once instead of queued.
    fn shed_when_full(&self) -> bool;

    fn fairness(&self) -> Fairness;

    /// Requests a band holds at most; an arrival beyond it is refused.
    fn queue_limit(&self) -> usize;

    /// Admission by program (see [`programs`]): the share of the candidates' GPU KV that
    /// programs in progress may fill, when one stops being in progress, and how waiting
    /// programs start and growing ones pause; `None`: off.
    fn program_admission(&self) -> Option<(f64, engine::Dur, programs::Packing)> {
        None
    }
}

/// Which flow control a fleet runs, with its parameters: the factory of its [`FlowRule`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum FlowConfig {
    /// No flow control: every request is placed when it arrives.
    #[default]
    None,
    Slo(SloFlowConfig),
    LlmD(LlmDFlowConfig),
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown flow control `{0}` (valid: none, slo, llm-d)")]
pub struct UnknownFlow(pub String);

impl FromStr for FlowConfig {
    type Err = UnknownFlow;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(FlowConfig::None),
            "slo" => Ok(FlowConfig::Slo(SloFlowConfig::default())),
            "llm-d" => Ok(FlowConfig::LlmD(LlmDFlowConfig::default())),
            _ => Err(UnknownFlow(s.to_string())),
        }
    }
}

impl FlowConfig {
    pub const NAMES: [&'static str; 3] = ["none", "slo", "llm-d"];

    pub fn name(&self) -> &'static str {
        match self {
            FlowConfig::None => "none",
            FlowConfig::Slo(_) => "slo",
            FlowConfig::LlmD(_) => "llm-d",
        }
    }

    /// Sets one parameter by name (see [`crate::params`]); `none` has none.
    pub fn set(&mut self, name: &str, value: f64) -> Result<(), ParamError> {
        match self {
            FlowConfig::None => {
                Err(ParamError::Unknown { policy: "none", param: name.to_string(), valid: String::new() })
            }
            FlowConfig::Slo(c) => c.set(name, value),
            FlowConfig::LlmD(c) => c.set(name, value),
        }
    }

    /// The rule's parameters (none for `none`).
    pub fn params(&self) -> &'static [Param] {
        match self {
            FlowConfig::None => &[],
            FlowConfig::Slo(_) => SloFlowConfig::PARAMS,
            FlowConfig::LlmD(_) => LlmDFlowConfig::PARAMS,
        }
    }

    /// Every parameter with its value.
    pub fn values(&self) -> BTreeMap<String, f64> {
        match self {
            FlowConfig::None => BTreeMap::new(),
            FlowConfig::Slo(c) => c.values(),
            FlowConfig::LlmD(c) => c.values(),
        }
    }

    /// Parameters that differ from the rule's defaults, for labels.
    pub fn changed(&self) -> BTreeMap<String, f64> {
        match self {
            FlowConfig::None => BTreeMap::new(),
            FlowConfig::Slo(c) => crate::params::changed(c.values(), &SloFlowConfig::default().values()),
            FlowConfig::LlmD(c) => crate::params::changed(c.values(), &LlmDFlowConfig::default().values()),
        }
    }

    /// The name with the parameters that differ from the defaults: `slo(batch_headroom=0.5)`.
    pub fn label(&self) -> String {
        let changed = self.changed();
        if changed.is_empty() {
            return self.name().to_string();
        }
        let params: Vec<String> = changed.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("{}({})", self.name(), params.join(","))
    }

    /// The rule, for a fleet priced by `hints` whose classes aim at `targets` (by
    /// [`Class::index`]); `None` for no flow control.
    pub fn build(&self, hints: &CostHints, targets: [Targets; 3]) -> Option<Box<dyn FlowRule>> {
        match *self {
            FlowConfig::None => None,
            FlowConfig::Slo(c) => Some(Box::new(slo::SloFlow::new(c, *hints, targets))),
            FlowConfig::LlmD(c) => Some(Box::new(llm_d::LlmDFlow::new(c))),
        }
    }

    /// What the engines' class priority caps lower classes' prompt tokens per step at while
    /// an interactive request decodes (`slo` only; the others leave engines as they are).
    pub fn lower_class_step_tokens(&self, hints: &CostHints, targets: &[Targets; 3]) -> Option<u32> {
        match self {
            FlowConfig::Slo(c) => Some(c.lower_class_step_tokens(hints, &targets[Class::Interactive.index()])),
            _ => None,
        }
    }

    /// Every rule's parameters with their defaults.
    pub fn catalog() -> Vec<PolicyParams> {
        vec![
            PolicyParams::of("flow", "slo", &SloFlowConfig::default()),
            PolicyParams::of("flow", "llm-d", &LlmDFlowConfig::default()),
        ]
    }
}

/// Why flow control refused a request.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
pub enum ShedReason {
    #[error("the fleet is saturated and {class} requests are sheddable")]
    Saturated { class: Class },
    #[error("the {class} queue is full ({limit} requests waiting)")]
    QueueFull { class: Class, limit: usize },
    #[error("waited {waited_ms} ms for room, past the {class} class's limit")]
    Waited { class: Class, waited_ms: u64 },
}

impl ShedReason {
    /// A short stable name, for metrics and API error codes.
    pub fn code(&self) -> &'static str {
        match self {
            ShedReason::Saturated { .. } => "shed",
            ShedReason::QueueFull { .. } => "queue_full",
            ShedReason::Waited { .. } => "shed",
        }
    }
}

/// A request flow control refused, handed back with its payload.
#[derive(Debug)]
pub struct Shed<P> {
    pub request: Request,
    pub payload: P,
    pub reason: ShedReason,
    /// When to try again: the queued work ahead of it at the fleet's prefill rate.
    pub retry_after: Dur,
}

/// Seconds to wait before retrying, given the prompt tokens waiting ahead and the fleet's
/// prefill rate: at least 1 s, at most 5 minutes.
pub(crate) fn retry_after(tokens_ahead: u64, fleet_tokens_per_s: f64) -> Dur {
    let s = if fleet_tokens_per_s > 0.0 { tokens_ahead as f64 / fleet_tokens_per_s } else { 0.0 };
    Dur::from_secs_f64(s.clamp(1.0, 300.0).ceil())
}
#[cfg(test)]
mod tests;
