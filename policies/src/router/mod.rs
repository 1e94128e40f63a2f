//! Routers: given a request and the fleet view, pick an instance.
//!
//! A router decides and explains; it does not reserve, send or account (the controller does).
//! Each router lives in its own file with its rule at the top; [`RouterConfig`] is the
//! registry that turns a name into one.

mod least_outstanding;
mod power_of_two;
mod round_robin;

pub use least_outstanding::LeastOutstanding;
pub use power_of_two::PowerOfTwo;
pub use round_robin::RoundRobin;

use crate::fleet::FleetEvent;
use crate::view::FleetView;
use engine::{InstanceId, Request};
use std::fmt;
use std::str::FromStr;

/// A routing policy.
pub trait Router {
    fn name(&self) -> &'static str;
    /// The instance for `request`, among the serving instances that can hold it; `None` when
    /// there is none.
    fn pick(&mut self, request: &Request, fleet: &FleetView) -> Option<Pick>;
    /// Lifecycle news, for routers that keep state of their own.
    fn on_event(&mut self, _event: &FleetEvent) {}
    /// Whether the router reads the global prefix index ([`FleetView::index`]): only then do
    /// fleets publish KV events and the controller index them.
    fn wants_kv_events(&self) -> bool {
        false
    }
}

/// What routers may know of the fleet's hardware, from its cost model: enough to turn
/// tokens into predicted seconds. All rates are per instance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostHints {
    /// Tokens per KV block (the granularity of the prefix index).
    pub block_size: u32,
    /// Prompt tokens one instance computes per second at a full batch.
    pub prefill_tokens_per_s: f64,
    /// Cached tokens per second loaded back from host memory (L2) into GPU memory.
    pub l2_tokens_per_s: f64,
    /// Cached tokens per second loaded from the shared store (L3).
    pub l3_tokens_per_s: f64,
}

impl Default for CostHints {
    /// Llama-3.1-8B on one H100 with PCIe Gen5 host memory and a 200 Gb/s shared store.
    fn default() -> Self {
        CostHints { block_size: 16, prefill_tokens_per_s: 40_000.0, l2_tokens_per_s: 400_000.0, l3_tokens_per_s: 200_000.0 }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Pick {
    pub instance: InstanceId,
    pub why: Why,
}

/// The reason for a pick, kept so that a decision can be explained.
#[derive(Clone, Debug, PartialEq)]
pub enum Why {
    /// Next in turn.
    Turn,
    /// Fewest outstanding tokens among all candidates.
    LeastOutstanding { outstanding_tokens: u64 },
    /// The less loaded of two instances drawn at random.
    PowerOfTwo { drawn: [InstanceId; 2], outstanding_tokens: [u64; 2] },
}

/// A router by name, and its settings: the factory of routers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterConfig {
    RoundRobin,
    LeastOutstanding,
    PowerOfTwo,
}

impl RouterConfig {
    pub const ALL: [RouterConfig; 3] =
        [RouterConfig::RoundRobin, RouterConfig::LeastOutstanding, RouterConfig::PowerOfTwo];

    pub fn name(self) -> &'static str {
        match self {
            RouterConfig::RoundRobin => "round-robin",
            RouterConfig::LeastOutstanding => "least-outstanding",
            RouterConfig::PowerOfTwo => "power-of-two",
        }
    }

    pub fn names() -> Vec<&'static str> {
        RouterConfig::ALL.iter().map(|r| r.name()).collect()
    }

    /// Builds the router; `seed` is the run's seed (routers that draw derive theirs from it).
    pub fn build(self, seed: u64, _hints: &CostHints) -> Box<dyn Router> {
        match self {
            RouterConfig::RoundRobin => Box::new(RoundRobin::default()),
            RouterConfig::LeastOutstanding => Box::new(LeastOutstanding),
            RouterConfig::PowerOfTwo => Box::new(PowerOfTwo::new(engine::ids::derive_seed(seed, "power-of-two", 0))),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown router `{name}` (valid: {})", RouterConfig::names().join(", "))]
pub struct UnknownRouter {
    pub name: String,
}

impl FromStr for RouterConfig {
    type Err = UnknownRouter;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RouterConfig::ALL.into_iter().find(|r| r.name() == s).ok_or_else(|| UnknownRouter { name: s.to_string() })
    }
}

impl fmt::Display for RouterConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests;
