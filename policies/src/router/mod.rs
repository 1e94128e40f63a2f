//! Routers: given a request and the fleet view, pick an instance.
//!
//! A router decides and explains; it does not reserve, send or account (the controller does).
//! Each router lives in its own file with its rule at the top; [`RouterConfig`] is the
//! registry that turns a name into one.

mod cache_aware;
mod dynamo_kv;
mod least_outstanding;
mod llm_d;
mod power_of_two;
mod round_robin;
mod sglang_cache_aware;

pub use cache_aware::{CacheAware, CacheAwareConfig};
pub use dynamo_kv::{DynamoKv, DynamoKvConfig};
pub use least_outstanding::LeastOutstanding;
pub use llm_d::{LlmD, LlmDConfig};
pub use power_of_two::PowerOfTwo;
pub use round_robin::RoundRobin;
pub use sglang_cache_aware::{SglangBranch, SglangCacheAware, SglangCacheAwareConfig};

use crate::fleet::FleetEvent;
use crate::slo_load::DecodeModel;
use crate::view::FleetView;
use engine::{InstanceId, Request};
use std::fmt;
use std::str::FromStr;

/// A routing policy.
pub trait Router: Send {
    fn name(&self) -> &'static str;
    /// The instance for `request`, among the serving instances that can hold it; `None` when
    /// there is none.
    fn pick(&mut self, request: &Request, fleet: &FleetView) -> Option<Pick>;
    /// Lifecycle news, for routers that keep state of their own.
    fn on_event(&mut self, _event: &FleetEvent) {}
    /// The last pick, of `request` for `instance`, was not taken (the fleet refused it):
    /// routers that count what they sent take it back. SGLang's rule keeps the prefix it
    /// inserted into its tree, as SGLang's gateway does (it inserts when it selects).
    fn unpick(&mut self, _request: &Request, _instance: InstanceId) {}
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
    /// Tokens one iteration computes at most (decode tokens plus prefill chunks): the size
    /// of the chunks a long prompt is computed in, beside the running decodes.
    pub max_batch_tokens: u32,
    /// How a decode-only step's time grows with the batch and its KV.
    pub decode: DecodeModel,
}

impl Default for CostHints {
    /// Llama-3.1-8B on one H100 with PCIe Gen5 host memory and a 200 Gb/s shared store.
    fn default() -> Self {
        CostHints {
            block_size: 16,
            prefill_tokens_per_s: 40_000.0,
            l2_tokens_per_s: 400_000.0,
            l3_tokens_per_s: 200_000.0,
            max_batch_tokens: 8192,
            decode: DecodeModel::default(),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Pick {
    pub instance: InstanceId,
    pub why: Why,
}

/// The reason for a pick, kept so that a decision can be explained (and written to a run's
/// JSON, tagged with the rule's name).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "rule", rename_all = "kebab-case")]
pub enum Why {
    /// Next in turn.
    Turn,
    /// Fewest outstanding tokens among all candidates.
    LeastOutstanding { outstanding_tokens: u64 },
    /// The less loaded of two instances drawn at random.
    PowerOfTwo { drawn: [InstanceId; 2], outstanding_tokens: [u64; 2] },
    /// SGLang's cache-aware rule: the branch taken, the longest prefix remembered on a
    /// candidate out of the request's blocks, and the spread of in-flight requests.
    SglangCacheAware {
        branch: SglangBranch,
        matched_blocks: u32,
        request_blocks: u32,
        in_flight_min: u32,
        in_flight_max: u32,
    },
    /// Dynamo's lowest cost `prefill_blocks + decode_blocks` (overlap weight 1), with the
    /// blocks of the prompt the instance holds on its GPU.
    DynamoKv { overlap_blocks: u32, prefill_blocks: f64, decode_blocks: u64, cost: f64 },
    /// llm-d's highest weighted score `3 × prefix + 2 × queue + 2 × kv`, with the inputs
    /// (prefix blocks matched in L1, L2, L3) and each scorer's score in [0, 1].
    LlmD {
        matched_blocks: [u32; 3],
        waiting: u32,
        kv_usage: f64,
        prefix_score: f64,
        queue_score: f64,
        kv_score: f64,
        score: f64,
    },
    /// Lowest predicted cost to the SLO: the cached prefix found on the instance by tier; the
    /// time-to-first-token terms (`predicted_ttft = queue + max(prefill, load) + copy`); the
    /// decode side: `step` (the decode step the request would join: its own predicted TPOT),
    /// `batch_step` (the step the instance's running batch sees while the prompt's chunks are
    /// computed), `stall` (the prompt's prefill time × the running requests' Σ 1 / remaining
    /// tokens: the TPOT it adds to them) and `own` (the weighted own TPOT); `score =
    /// predicted_ttft + stall + own`. `all_guarded`: every candidate was hot, so the guard was
    /// waived.
    CacheAware {
        l1_tokens: u32,
        l2_tokens: u32,
        l3_tokens: u32,
        queue_ms: f64,
        prefill_ms: f64,
        load_ms: f64,
        copy_ms: f64,
        predicted_ttft_ms: f64,
        step_ms: f64,
        batch_step_ms: f64,
        stall_ms: f64,
        own_ms: f64,
        score_ms: f64,
        all_guarded: bool,
    },
}

/// A router by name, and its settings: the factory of routers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterConfig {
    RoundRobin,
    LeastOutstanding,
    PowerOfTwo,
    SglangCacheAware,
    DynamoKv,
    LlmD,
    CacheAware,
}

impl RouterConfig {
    pub const ALL: [RouterConfig; 7] = [
        RouterConfig::RoundRobin,
        RouterConfig::LeastOutstanding,
        RouterConfig::PowerOfTwo,
        RouterConfig::SglangCacheAware,
        RouterConfig::DynamoKv,
        RouterConfig::LlmD,
        RouterConfig::CacheAware,
    ];

    pub fn name(self) -> &'static str {
        match self {
            RouterConfig::RoundRobin => "round-robin",
            RouterConfig::LeastOutstanding => "least-outstanding",
            RouterConfig::PowerOfTwo => "power-of-two",
            RouterConfig::SglangCacheAware => "sglang-cache-aware",
            RouterConfig::DynamoKv => "dynamo-kv",
            RouterConfig::LlmD => "llm-d",
            RouterConfig::CacheAware => "cache-aware",
        }
    }

    pub fn names() -> Vec<&'static str> {
        RouterConfig::ALL.iter().map(|r| r.name()).collect()
    }

    /// Builds the router; `seed` is the run's seed (routers that draw derive theirs from it).
    pub fn build(self, seed: u64, hints: &CostHints) -> Box<dyn Router> {
        match self {
            RouterConfig::RoundRobin => Box::new(RoundRobin::default()),
            RouterConfig::LeastOutstanding => Box::new(LeastOutstanding),
            RouterConfig::PowerOfTwo => Box::new(PowerOfTwo::new(engine::ids::derive_seed(seed, "power-of-two", 0))),
            RouterConfig::SglangCacheAware => Box::new(SglangCacheAware::new(
                SglangCacheAwareConfig::for_block_size(hints.block_size),
                hints.block_size,
            )),
            RouterConfig::DynamoKv => Box::new(DynamoKv::new(DynamoKvConfig::default(), hints.block_size)),
            RouterConfig::LlmD => {
                Box::new(LlmD::new(LlmDConfig::default(), engine::ids::derive_seed(seed, "llm-d", 0)))
            }
            RouterConfig::CacheAware => Box::new(CacheAware::new(CacheAwareConfig::default(), *hints)),
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
