//! Scenario files: every setting of a simulation in one TOML file, with command-line flags
//! laid over it.
//!
//! ```toml
//! seed = 42
//! # Each run's router: a name, or an inline table of the name and router parameters
//! # (`fleetplane tune --list-params` lists them with defaults and ranges; a run whose parameters differ
//! # from the defaults is labelled with them, `dynamo-kv(overlap_score_weight=2)`).
//! routers = ["round-robin", "least-outstanding", { name = "dynamo-kv", overlap_score_weight = 2.0 }]
//!
//! [fleet]
//! instances = 8
//! model = "llama-3.1-8b"
//! gpu = "h100"
//! tp = 1                # TP inside one attention rank
//! dp_attention = 1      # attention data-parallel ranks; the instance has tp × dp_attention GPUs
//! ep = 1                # expert parallelism (MoE): 1 or tp × dp_attention
//! cp = 1                # context-parallel replicas; the instance has tp × dp_attention × cp GPUs
//! cp_mode = "ring"      # how CP replicas exchange K/V: "ring" or "allgather"
//! spec = "dspark"       # speculative decoding: "none", "eagle3", "dflash" or "dspark"
//!
//! [workload]
//! trace = "../traces/mooncake-conversation.jsonl"   # relative to this file
//! format = "mooncake"
//! rate_scale = 1.0
//!
//! [slo]
//! ttft_ms = 2000
//! tpot_ms = 100
//!
//! [kv]                  # see `tiers.rs`
//! tiers = "l1,l2,l3"
//!
//! [flow]                # see `flow.rs`: flow control rules side by side
//! rules = ["none", "slo"]
//!
//! [pools]               # see `PoolsSection`: disaggregated prefill/decode pools, autoscaling
//! mode = "pd"
//! prefill_instances = 2
//! decode_instances = 6
//! autoscaler = "slo-load"
//! autoscaler_params = { up_load = 0.85 }   # the autoscaler's hysteresis knobs
//! ```
//!
//! A [`Scenario`] is the raw file (every field optional, unknown keys refused with their
//! name); [`Scenario::resolve`] fills the defaults, checks every name and gives [`Settings`].

use crate::workload::{AgenticConfig, ClassesConfig, MaxTokens, PhasedConfig, SyntheticConfig, WorkloadError};
use cost::{CostError, CostParams, CpMode, ProfileError, UnknownName};
use engine::Dur;
use flow::FlowSection;
use policies::{AutoscalerConfig, ParamError, RouterConfig, RouterError, UnknownAutoscaler, UnknownRouter};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use tiers::KvSection;

pub mod flow;
mod pools;
mod resolve;
mod scheduler;
mod settings;
#[cfg(test)]
pub(crate) mod tests;
pub mod tiers;

pub use flow::program_hold;
pub use pools::{PoolsRun, PoolsSection};
pub use scheduler::{
    step_budget, SchedulerSection, DEFAULT_KV_HIGH_WATER, DEFAULT_KV_LOW_WATER_SHARE, DEFAULT_MAX_EVICTIONS,
};
pub use settings::{RunSpec, Settings, WorkloadSource, NO_SPEC_VARIANT};

pub const DEFAULT_SEED: u64 = 42;
pub const DEFAULT_INSTANCES: u32 = 8;
pub const DEFAULT_MODEL: &str = "llama-3.1-8b";
pub const DEFAULT_GPU: &str = "h100";
pub const DEFAULT_TTFT_SLO_MS: f64 = 2000.0;
pub const DEFAULT_TPOT_SLO_MS: f64 = 100.0;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub seed: Option<u64>,
    pub routers: Option<Vec<RouterEntry>>,
    #[serde(default)]
    pub fleet: FleetSection,
    #[serde(default)]
    pub workload: WorkloadSection,
    #[serde(default)]
    pub slo: SloSection,
    /// KV tiers below GPU memory (see [`crate::tiers`]).
    #[serde(default)]
    pub kv: KvSection,
    /// How each engine shares its prefill budget.
    #[serde(default)]
    pub scheduler: SchedulerSection,
    /// Overrides of the cost model's efficiency factors and overheads.
    pub cost: Option<CostParams>,
    /// Prefill/decode pools and autoscaling (absent: a fixed colocated fleet).
    #[serde(default)]
    pub pools: PoolsSection,
    /// Flow control at the controller, rules side by side (absent: none).
    #[serde(default)]
    pub flow: FlowSection,
}

/// One entry of `routers`: a run's name (`"cache-aware@l1+l2"`), or an inline table of that
/// name and the router's parameters (`{ name = "dynamo-kv", overlap_score_weight = 2.0 }`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RouterEntry {
    Name(String),
    Table(BTreeMap<String, toml::Value>),
}

impl RouterEntry {
    /// The run's name as written and the router's parameters.
    pub fn parts(&self) -> Result<(&str, BTreeMap<String, f64>), ScenarioError> {
        let table = match self {
            RouterEntry::Name(name) => return Ok((name, BTreeMap::new())),
            RouterEntry::Table(table) => table,
        };
        let Some(toml::Value::String(name)) = table.get("name") else {
            return Err(invalid("routers", "a router's table needs `name = \"ROUTER\"`"));
        };
        let mut params = BTreeMap::new();
        for (key, value) in table.iter().filter(|(k, _)| *k != "name") {
            let v = match value {
                toml::Value::Float(v) => *v,
                toml::Value::Integer(v) => *v as f64,
                other => {
                    let reason = format!("`{key}` of `{name}` is {other}, not a number");
                    return Err(invalid("routers", reason));
                }
            };
            params.insert(key.clone(), v);
        }
        Ok((name, params))
    }

    /// The entry of a run named `name` (a router, `@` and variants) with router parameters.
    pub fn with_params(name: &str, params: &BTreeMap<String, f64>) -> RouterEntry {
        if params.is_empty() {
            return RouterEntry::Name(name.to_string());
        }
        let mut table: BTreeMap<String, toml::Value> =
            params.iter().map(|(k, v)| (k.clone(), toml::Value::Float(*v))).collect();
        table.insert("name".to_string(), toml::Value::String(name.to_string()));
        RouterEntry::Table(table)
    }
}

impl From<&str> for RouterEntry {
    fn from(name: &str) -> RouterEntry {
        RouterEntry::Name(name.to_string())
    }
}

impl From<String> for RouterEntry {
    fn from(name: String) -> RouterEntry {
        RouterEntry::Name(name)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSection {
    pub instances: Option<u32>,
    pub model: Option<String>,
    pub gpu: Option<String>,
    /// Tensor-parallel degree inside one attention rank.
    pub tp: Option<u32>,
    /// Attention data-parallel ranks per instance (see [`Deployment`]).
    #[serde(default)]
    pub dp_attention: Option<u32>,
    /// Expert-parallel degree: 1 or the instance's GPUs (`tp × dp_attention`).
    #[serde(default)]
    pub ep: Option<u32>,
    /// Context-parallel replicas per instance (see [`Deployment`]).
    #[serde(default)]
    pub cp: Option<u32>,
    /// How context-parallel replicas exchange K/V: ring or all-gather.
    #[serde(default)]
    pub cp_mode: Option<CpMode>,
    /// Speculative decoding's drafter preset, or `none` (see [`cost::Drafter`]).
    #[serde(default)]
    pub spec: Option<String>,
    pub block_size: Option<u32>,
    pub max_batch_tokens: Option<u32>,
    pub max_seqs: Option<u32>,
    /// KV blocks per instance [default: as many as the GPU memory left by the weights holds];
    /// set it to match engines given a memory budget (several sharing one GPU).
    #[serde(default)]
    pub kv_blocks: Option<u32>,
    /// A step profile measured on the engine (JSON, see [`engine::StepProfile`]): the cost
    /// model's efficiencies and overhead are fitted to it ([`cost::calibrate`]),
    /// replacing those of `[cost]`. Relative to the scenario file.
    #[serde(default)]
    pub profile: Option<PathBuf>,
    /// The live path's latency per request outside the engines' steps, in milliseconds
    /// (see [`SimConfig::dispatch`]; `fleetplane latency` measures it) [default: 0].
    #[serde(default)]
    pub dispatch_ms: Option<f64>,
    /// Engines sharing one GPU, each with its share of the memory (`kv_blocks`); their steps
    /// take turns on it [default: 1]. Only for one-GPU instances in a colocated fleet.
    #[serde(default)]
    pub instances_per_gpu: Option<u32>,
    /// With `instances_per_gpu` > 1: the share of the GPU's time left to steps while several
    /// engines' steps overlap, the rest lost to context switches [default: 1]. Two `fleetplane
    /// profile` runs at once on one GPU measure it (docs/BENCHMARKS.md: 0.89 on an H200).
    #[serde(default)]
    pub gpu_share_efficiency: Option<f64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadSection {
    pub trace: Option<PathBuf>,
    pub format: Option<String>,
    pub rate_scale: Option<f64>,
    /// Leave out the first N requests (the rest start at time zero): another slice.
    #[serde(default)]
    pub skip_requests: Option<u64>,
    pub max_requests: Option<u64>,
    pub synthetic: Option<SyntheticConfig>,
    /// A workload whose shape shifts in phases (see [`crate::workload::PhasedConfig`]).
    pub phased: Option<PhasedConfig>,
    /// Closed-loop agentic sessions (see [`crate::workload::AgenticConfig`]).
    #[serde(default)]
    pub agentic: Option<AgenticConfig>,
    /// Request classes and tenants drawn per request (see [`crate::workload::ClassesConfig`]).
    #[serde(default)]
    pub classes: Option<ClassesConfig>,
    /// What clients ask as `max_tokens`: `"exact"` (the trace's output lengths, known in
    /// advance) or a number of tokens (see [`crate::workload::MaxTokens`]) [default: exact].
    #[serde(default)]
    pub max_tokens: Option<MaxTokens>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SloSection {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("reading scenario {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("parsing scenario {path}: {source}")]
    Parse { path: PathBuf, source: Box<toml::de::Error> },
    #[error(transparent)]
    UnknownName(#[from] UnknownName),
    #[error(transparent)]
    UnknownRouter(#[from] UnknownRouter),
    #[error(transparent)]
    UnknownAutoscaler(#[from] UnknownAutoscaler),
    #[error(transparent)]
    Cost(#[from] CostError),
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("invalid setting `{key}`: {reason}")]
    Invalid { key: &'static str, reason: String },
    /// A policy's parameter refused; `key` is where it was set (`routers`,
    /// `pools.autoscaler_params`, `scheduler`), the error names the parameter and its range.
    #[error("invalid setting `{key}.{}`: {source}", source.param())]
    Param { key: &'static str, source: ParamError },
}

fn param_error(key: &'static str, source: ParamError) -> ScenarioError {
    ScenarioError::Param { key, source }
}

/// The router `name` with `params` (set under `key`), as [`RouterConfig::with_params`] checks it.
pub(crate) fn router_with_params(
    name: &str,
    params: &BTreeMap<String, f64>,
    key: &'static str,
) -> Result<RouterConfig, ScenarioError> {
    RouterConfig::with_params(name, params).map_err(|e| match e {
        RouterError::Unknown(e) => ScenarioError::UnknownRouter(e),
        RouterError::Param(e) => param_error(key, e),
    })
}

/// The autoscaler `name` with `params` (set under `key`) over its defaults.
pub(crate) fn autoscaler_with_params<'a>(
    name: &str,
    startup: Dur,
    xpyd: (u32, u32),
    params: impl IntoIterator<Item = (&'a String, &'a f64)>,
    key: &'static str,
) -> Result<AutoscalerConfig, ScenarioError> {
    set_autoscaler_params(AutoscalerConfig::by_name(name, startup, xpyd)?, params, key)
}

/// `autoscaler` with `params` (set under `key`) over its settings: a live fleet's autoscaler
/// starts from `serve`'s flags, not the defaults.
pub fn set_autoscaler_params<'a>(
    mut autoscaler: AutoscalerConfig,
    params: impl IntoIterator<Item = (&'a String, &'a f64)>,
    key: &'static str,
) -> Result<AutoscalerConfig, ScenarioError> {
    for (param, v) in params {
        autoscaler.set(param, *v).map_err(|e| param_error(key, e))?;
    }
    Ok(autoscaler)
}

fn invalid(key: &'static str, reason: impl Into<String>) -> ScenarioError {
    ScenarioError::Invalid { key, reason: reason.into() }
}
