//! Autoscalers: how many prefill and decode instances a disaggregated fleet should run.
//!
//! An [`Autoscaler`] decides from the SLO loads ([`crate::slo_load`]) and the pools' sizes;
//! it sends nothing: the controller turns its [`Scale`] into `Start` and `Drain` commands
//! within the GPU budget and records each decision with the loads that caused it. Each policy
//! lives in its own file with its rule at the top; [`AutoscalerConfig`] is the registry.
//!
//! | file | policy |
//! | --- | --- |
//! | `none.rs` | `none`: the pools keep the size they started with |
//! | `fixed_xpyd.rs` | `fixed-xpyd`: whole groups of x prefill + y decode instances (the baseline) |
//! | `slo_load.rs` | `slo-load`: each pool on its own, from its SLO load |
//!
//! Both scaling policies share [`Knobs`]: a band of loads between which nothing changes
//! (hysteresis), how long a load must stay outside the band before acting, and cooldowns
//! after acting, the one after scaling up at least the start-up time (the effect of new
//! capacity cannot be seen before it serves).

mod fixed_xpyd;
mod none;
mod slo_load;

pub use fixed_xpyd::FixedXpyd;
pub use none::NoScaling;
pub use slo_load::SloLoadScaler;

use crate::params::{ParamError, Params, PolicyParams};
use crate::slo_load::Loads;
use engine::{Dur, Time};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// A pool's instances by lifecycle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolSize {
    pub serving: u32,
    /// Asked for and not up yet.
    pub starting: u32,
    pub draining: u32,
}

impl PoolSize {
    /// Instances that serve or soon will: what a decision counts as the pool's size.
    pub fn planned(&self) -> u32 {
        self.serving + self.starting
    }
}

/// What an autoscaler decides from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleInput {
    pub now: Time,
    pub loads: Loads,
    pub prefill: PoolSize,
    pub decode: PoolSize,
    /// Instances the GPU budget still allows to start.
    pub headroom: u32,
    /// Fewest serving instances per pool.
    pub min_per_pool: u32,
    /// Requests whose prefill ended, waiting for a decode instance with KV room: the decode
    /// pool holds the prefill pool back.
    pub waiting_handoffs: u32,
}

/// Instances to add (positive) or drain (negative) per pool, and why.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scale {
    pub prefill: i32,
    pub decode: i32,
    pub reason: &'static str,
}

/// A scaling policy.
/// `Send`: the live control service moves its controller between threads.
pub trait Autoscaler: Send {
    fn name(&self) -> &'static str;
    /// Called at every scaling tick; a zero [`Scale`] changes nothing.
    fn decide(&mut self, input: &ScaleInput) -> Scale;
    /// Whether the pool of `role` (of `input`) could give up `n` serving instances to the other
    /// pool, when the other must grow and the budget is spent. By default no pool gives.
    fn can_spare(&self, _input: &ScaleInput, _role: crate::view::Role, _n: u32) -> bool {
        false
    }
}

/// Hysteresis and cooldown, shared by the scaling policies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Knobs {
    /// A pool whose load stays above this for `up_hold` grows.
    pub up_load: f64,
    /// A pool whose load stays below this for `down_hold` may shrink...
    pub down_load: f64,
    /// ...if its utilization with one instance (or group) fewer stays below this: the spare
    /// capacity kept against a burst (at 0.5, a doubling of the rate still fits).
    pub shrink_util: f64,
    /// Growth aims at this load.
    pub target_load: f64,
    pub up_hold: Dur,
    pub down_hold: Dur,
    /// After growing: new instances must start and their effect show before growing again.
    pub up_cooldown: Dur,
    /// After any change, before shrinking.
    pub down_cooldown: Dur,
}

impl Knobs {
    /// Defaults for instances that take `startup` to start: grow after 1 s above 0.8, shrink
    /// after 60 s below 0.4, wait for the start-up plus 10 s before growing again and 120 s
    /// (at least the up cooldown) before shrinking.
    pub fn for_startup(startup: Dur) -> Knobs {
        let up_cooldown = Dur(startup.0 + 10_000_000);
        Knobs {
            up_load: 0.8,
            down_load: 0.4,
            shrink_util: 0.5,
            target_load: 0.6,
            up_hold: Dur::from_millis(1_000),
            down_hold: Dur::from_millis(60_000),
            up_cooldown,
            down_cooldown: Dur(up_cooldown.0.max(120_000_000)),
        }
    }
}

crate::params!(Knobs, "autoscaler", {
    up_load: float from 0.0 ..= 16.0, "a pool whose load stays above this for up_hold grows";
    down_load: float from 0.0 ..= 16.0, "a pool whose load stays below this for down_hold may shrink";
    shrink_util: float above 0.0 ..= 1.0, "and shrinks only if its utilization with one instance (or group) fewer stays below this";
    target_load: float above 0.0 ..= 16.0, "growth aims at this load";
    up_hold: seconds from 0.0 ..= 3600.0, "how long the load must stay above up_load";
    down_hold: seconds from 0.0 ..= 3600.0, "how long the load must stay below down_load";
    up_cooldown: seconds from 0.0 ..= 3600.0, "after growing, before growing again [default: start-up time + 10 s]";
    down_cooldown: seconds from 0.0 ..= 3600.0, "after any change, before shrinking [default: the larger of up_cooldown and 120 s]";
});

/// How long a condition has held: the hysteresis timer of one pool and direction.
#[derive(Clone, Copy, Debug, Default)]
struct Held {
    since: Option<Time>,
}

impl Held {
    /// Notes whether the condition holds at `now`; true once it has held for `hold`.
    fn check(&mut self, now: Time, holds: bool, hold: Dur) -> bool {
        if !holds {
            self.since = None;
            return false;
        }
        now.since(*self.since.get_or_insert(now)) >= hold
    }
}

/// Whether `cooldown` has passed since `last`.
fn cooled(now: Time, last: Option<Time>, cooldown: Dur) -> bool {
    last.is_none_or(|t| now.since(t) >= cooldown)
}

/// Instances a pool of `planned` needs to bring `load` down to `target`, beyond those it has
/// (at least 1); the load is capped at 3 so that one wild sample cannot fill the budget.
fn growth(planned: u32, load: f64, target: f64) -> u32 {
    let planned = f64::from(planned.max(1));
    let wanted = (planned * load.min(3.0) / target).ceil();
    ((wanted - planned).max(1.0)) as u32
}

/// Whether a pool of `serving` at utilization `util` stays under `target` with `fewer` fewer.
fn can_shrink(serving: u32, fewer: u32, min: u32, util: f64, target: f64) -> bool {
    serving >= min + fewer && serving > fewer && util * f64::from(serving) / f64::from(serving - fewer) < target
}

/// An autoscaler by name, and its settings: the factory of autoscalers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AutoscalerConfig {
    None,
    FixedXpyd { x: u32, y: u32, knobs: Knobs },
    SloLoad { knobs: Knobs },
}

impl AutoscalerConfig {
    pub const NAMES: [&'static str; 3] = ["none", "fixed-xpyd", "slo-load"];

    pub fn name(&self) -> &'static str {
        match self {
            AutoscalerConfig::None => "none",
            AutoscalerConfig::FixedXpyd { .. } => "fixed-xpyd",
            AutoscalerConfig::SloLoad { .. } => "slo-load",
        }
    }

    /// `name` with the default knobs for `startup`, groups of `x` prefill and `y` decode
    /// instances for `fixed-xpyd`.
    pub fn by_name(name: &str, startup: Dur, (x, y): (u32, u32)) -> Result<AutoscalerConfig, UnknownAutoscaler> {
        let knobs = Knobs::for_startup(startup);
        match name {
            "none" => Ok(AutoscalerConfig::None),
            "fixed-xpyd" => Ok(AutoscalerConfig::FixedXpyd { x, y, knobs }),
            "slo-load" => Ok(AutoscalerConfig::SloLoad { knobs }),
            _ => Err(UnknownAutoscaler { name: name.to_string() }),
        }
    }

    /// The policy's hysteresis knobs; `none` has none.
    pub fn knobs(&self) -> Option<&Knobs> {
        match self {
            AutoscalerConfig::None => None,
            AutoscalerConfig::FixedXpyd { knobs, .. } | AutoscalerConfig::SloLoad { knobs } => Some(knobs),
        }
    }

    /// Sets one of the policy's hysteresis [`Knobs`], checked against its range; `none` has
    /// no parameters.
    pub fn set(&mut self, name: &str, value: f64) -> Result<(), ParamError> {
        match self {
            AutoscalerConfig::None => {
                Err(ParamError::Unknown { policy: "none", param: name.to_string(), valid: "none".to_string() })
            }
            AutoscalerConfig::FixedXpyd { knobs, .. } | AutoscalerConfig::SloLoad { knobs } => knobs.set(name, value),
        }
    }

    /// The parameters with their values (`none` has none).
    pub fn values(&self) -> BTreeMap<String, f64> {
        self.knobs().map(Knobs::values).unwrap_or_default()
    }

    /// Every autoscaler's parameters with their defaults (for instances that start in 10 s).
    pub fn catalog() -> Vec<PolicyParams> {
        let knobs = Knobs::for_startup(Dur::from_millis(10_000));
        vec![
            PolicyParams { role: "autoscaler", policy: "none", params: Vec::new() },
            PolicyParams::of("autoscaler", "fixed-xpyd", &knobs),
            PolicyParams::of("autoscaler", "slo-load", &knobs),
        ]
    }

    pub fn build(&self) -> Box<dyn Autoscaler> {
        match *self {
            AutoscalerConfig::None => Box::new(NoScaling),
            AutoscalerConfig::FixedXpyd { x, y, knobs } => Box::new(FixedXpyd::new(x, y, knobs)),
            AutoscalerConfig::SloLoad { knobs } => Box::new(SloLoadScaler::new(knobs)),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown autoscaler `{name}` (valid: {})", AutoscalerConfig::NAMES.join(", "))]
pub struct UnknownAutoscaler {
    pub name: String,
}

impl FromStr for AutoscalerConfig {
    type Err = UnknownAutoscaler;
    /// The name with default knobs, no start-up time and 1P1D groups.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        AutoscalerConfig::by_name(s, Dur::ZERO, (1, 1))
    }
}

impl fmt::Display for AutoscalerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests;
