//! Routers: given a request and the fleet view, pick an instance.
//!
//! A router decides and explains; it does not reserve, send or account (the controller does).
//! Each router lives in its own file with its rule at the top and its config type, which
//! holds its parameters ([`Params`]: defaults, ranges, docs) and builds it
//! ([`RouterFactory`]). [`RouterConfig`] is the registry: a new router is one file and one
//! line of [`registry!`]'s list.

pub use sglang_cache_aware::SglangBranch;

mod queue_order;

use crate::event::FleetEvent;
use crate::params::{Param, ParamError, Params, PolicyParams};
use crate::slo_load::DecodeModel;
use crate::view::FleetView;
use engine::{InstanceId, Request};
use std::collections::BTreeMap;
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
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
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
    /// tokens: the TPOT it adds to them) and `own` (the weighted own TPOT); the KV side:
    /// `kv` (the tokens by which the instance's KV would be over-committed, priced as
    /// prefill), `left` (the tokens its requests have still to generate, priced as prefill);
    /// `score = predicted_ttft + stall + own + kv + left`. `output_share`: the share of their
    /// bounds (`max_tokens`) that outputs used lately, which scales the reported tokens left
    /// in `stall`, `kv` and `left` (1 where outputs run to their bounds). `all_guarded`: every candidate was
    /// hot, so the guard was waived. `lost`: the request was predicted to miss its TTFT target
    /// on every instance and went where it does least harm among the queues below the cap
    /// (triage, `lost_cap`; the terms are that instance's).
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
        kv_ms: f64,
        left_ms: f64,
        score_ms: f64,
        output_share: f64,
        all_guarded: bool,
        lost: bool,
    },
}

/// A router's config: its parameters, and the factory of the router.
pub trait RouterFactory: Params + Default + Copy + Into<RouterConfig> {
    /// Builds the router; `seed` is the run's seed (routers that draw derive theirs from it).
    fn build(&self, seed: u64, hints: &CostHints) -> Box<dyn Router>;
}

/// The registry: each line is `module => Variant(Config)`, the router's file and its config
/// type (whose [`Params::POLICY`] is the router's name).
macro_rules! registry {
    ($($module:ident => $variant:ident($config:ident),)*) => {
        $(mod $module; pub use $module::$config;)*

        /// A router by name, with its parameters: the factory of routers.
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum RouterConfig {
            $($variant($config),)*
        }

        $(impl From<$config> for RouterConfig {
            fn from(c: $config) -> RouterConfig {
                RouterConfig::$variant(c)
            }
        })*

        impl RouterConfig {
            /// Every router's name, in the registry's order.
            pub const NAMES: &'static [&'static str] = &[$(<$config as Params>::POLICY,)*];

            /// Every router with its default parameters.
            pub fn all() -> Vec<RouterConfig> {
                vec![$(RouterConfig::$variant($config::default()),)*]
            }

            pub fn name(&self) -> &'static str {
                match self {
                    $(RouterConfig::$variant(_) => <$config as Params>::POLICY,)*
                }
            }

            /// Builds the router; `seed` is the run's seed (routers that draw derive theirs
            /// from it).
            pub fn build(&self, seed: u64, hints: &CostHints) -> Box<dyn Router> {
                match self {
                    $(RouterConfig::$variant(c) => c.build(seed, hints),)*
                }
            }

            /// The router's parameters.
            pub fn params(&self) -> &'static [Param] {
                match self {
                    $(RouterConfig::$variant(_) => <$config as Params>::PARAMS,)*
                }
            }

            /// Every parameter's value.
            pub fn values(&self) -> std::collections::BTreeMap<String, f64> {
                match self {
                    $(RouterConfig::$variant(c) => c.values(),)*
                }
            }

            /// Sets one parameter, checked against its range.
            pub fn set(&mut self, name: &str, value: f64) -> Result<(), ParamError> {
                match self {
                    $(RouterConfig::$variant(c) => c.set(name, value),)*
                }
            }

            /// Every router's parameters with their defaults.
            pub fn catalog() -> Vec<PolicyParams> {
                vec![$(PolicyParams::of("router", <$config as Params>::POLICY, &$config::default()),)*]
            }
        }
    };
}

registry! {
    round_robin => RoundRobin(RoundRobinConfig),
    least_outstanding => LeastOutstanding(LeastOutstandingConfig),
    power_of_two => PowerOfTwo(PowerOfTwoConfig),
    sglang_cache_aware => SglangCacheAware(SglangCacheAwareConfig),
    dynamo_kv => DynamoKv(DynamoKvConfig),
    llm_d => LlmD(LlmDConfig),
    cache_aware => CacheAware(CacheAwareConfig),
}

impl RouterConfig {
    pub fn names() -> Vec<&'static str> {
        RouterConfig::NAMES.to_vec()
    }

    /// The router `name` with `params` over its defaults: the one check of a router setting,
    /// for scenarios, policy files and the live policy API.
    pub fn with_params(name: &str, params: &BTreeMap<String, f64>) -> Result<RouterConfig, RouterError> {
        let mut router: RouterConfig = name.parse()?;
        for (param, value) in params {
            router.set(param, *value)?;
        }
        Ok(router)
    }

    /// The parameters that differ from the router's defaults.
    pub fn changed(&self) -> BTreeMap<String, f64> {
        let defaults = self.name().parse::<RouterConfig>().map(|r| r.values()).unwrap_or_default();
        crate::params::changed(self.values(), &defaults)
    }

    /// The router's name in reports: its name, followed by the parameters that differ from
    /// its defaults (`dynamo-kv(overlap_score_weight=2)`), so that runs of one router with
    /// other parameters are told apart.
    pub fn label(&self) -> String {
        let changed = self.changed();
        if changed.is_empty() {
            return self.name().to_string();
        }
        let params: Vec<String> = changed.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("{}({})", self.name(), params.join(","))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown router `{name}` (valid: {})", RouterConfig::NAMES.join(", "))]
pub struct UnknownRouter {
    pub name: String,
}

/// A router setting refused: an unknown name, or a parameter unknown or out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouterError {
    #[error(transparent)]
    Unknown(#[from] UnknownRouter),
    #[error(transparent)]
    Param(#[from] ParamError),
}

impl FromStr for RouterConfig {
    type Err = UnknownRouter;
    /// The router with its default parameters.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RouterConfig::all().into_iter().find(|r| r.name() == s).ok_or_else(|| UnknownRouter { name: s.to_string() })
    }
}

impl fmt::Display for RouterConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests;
