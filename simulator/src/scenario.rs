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

use crate::metrics::Slo;
use crate::pools::PdRun;
use crate::sim::SimConfig;
use crate::tiers::{KvSection, KvTiers};
use crate::workload::{self, PhasedConfig, SyntheticConfig, TraceFormat, Workload, WorkloadError, WorkloadOptions};
use cost::{
    calibrated_cost, drafter_by_name, drafter_names, drafter_or_none, gpu_by_name, model_by_name, Calibration,
    CostError, CostModel, CostParams, CpMode, Deployment, Drafter, ProfileError, UnknownName, NO_SPECULATION,
};
use engine::{Dur, FairPrefill, InstanceConfig, KvProtection, PrefillPolicy, RunawayAction};
use policies::{AutoscalerConfig, ParamError, Params, RouterConfig, RouterError, UnknownAutoscaler, UnknownRouter};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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

/// `[pools]`: a disaggregated fleet, its autoscaler, and time series.
///
/// ```toml
/// [pools]
/// mode = "pd"                 # or "colocated" [default]
/// prefill_instances = 2       # at the start [default: 1]
/// decode_instances = 6        # [default: 1]
/// autoscaler = "slo-load"     # none, fixed-xpyd, slo-load [default: none]
/// autoscaler_params = { up_load = 0.85, down_hold = 30 }   # its knobs (`tune --list-params`)
/// startup_s = 10              # from Start to serving [default: 10]
/// gpu_budget = 16             # GPUs held at most [default: fleet.instances × GPUs per instance]
/// xpyd = "1:3"                # fixed-xpyd's group [default: the starting pools' ratio]
/// min_per_pool = 1            # [default: 1]
/// tick_s = 1                  # scaling period [default: 1]
/// slo_window_s = 20           # SLO load window [default: 20]
/// transfer_gb_s = 50          # KV link between P and D, GB/s [default: 50]
/// transfer_latency_ms = 1     # per transfer [default: 1]
/// timeline_s = 10             # time-series window [default: 10 for pd, none otherwise]
///
/// # Several runs on the same arrivals, each overriding the keys above:
/// runs = [ { label = "colocated", mode = "colocated" },
///          { label = "slo-load", autoscaler = "slo-load", startup_s = 10 } ]
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolsSection {
    pub label: Option<String>,
    pub mode: Option<String>,
    pub prefill_instances: Option<u32>,
    pub decode_instances: Option<u32>,
    pub autoscaler: Option<String>,
    /// The autoscaler's hysteresis knobs by name, over its defaults (durations in seconds).
    #[serde(default)]
    pub autoscaler_params: Option<BTreeMap<String, f64>>,
    pub startup_s: Option<f64>,
    pub gpu_budget: Option<u32>,
    pub xpyd: Option<String>,
    pub min_per_pool: Option<u32>,
    pub tick_s: Option<f64>,
    pub slo_window_s: Option<f64>,
    pub transfer_gb_s: Option<f64>,
    pub transfer_latency_ms: Option<f64>,
    pub timeline_s: Option<f64>,
    pub runs: Option<Vec<PoolsSection>>,
}

impl PoolsSection {
    fn overlay(self, over: PoolsSection) -> PoolsSection {
        PoolsSection {
            label: over.label.or(self.label),
            mode: over.mode.or(self.mode),
            prefill_instances: over.prefill_instances.or(self.prefill_instances),
            decode_instances: over.decode_instances.or(self.decode_instances),
            autoscaler: over.autoscaler.or(self.autoscaler),
            autoscaler_params: over.autoscaler_params.or(self.autoscaler_params),
            startup_s: over.startup_s.or(self.startup_s),
            gpu_budget: over.gpu_budget.or(self.gpu_budget),
            xpyd: over.xpyd.or(self.xpyd),
            min_per_pool: over.min_per_pool.or(self.min_per_pool),
            tick_s: over.tick_s.or(self.tick_s),
            slo_window_s: over.slo_window_s.or(self.slo_window_s),
            transfer_gb_s: over.transfer_gb_s.or(self.transfer_gb_s),
            transfer_latency_ms: over.transfer_latency_ms.or(self.transfer_latency_ms),
            timeline_s: over.timeline_s.or(self.timeline_s),
            runs: over.runs.or(self.runs),
        }
    }

    /// One run's pools: `None` for a fixed colocated fleet without time series or label.
    fn resolve(&self, fleet_instances: u32, gpus_per_instance: u32) -> Result<Option<PoolsRun>, ScenarioError> {
        let seconds = |key: &'static str, v: Option<f64>, default: f64| -> Result<Dur, ScenarioError> {
            let v = v.unwrap_or(default);
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(key, format!("{v} is not a number of seconds >= 0")));
            }
            Ok(Dur::from_secs_f64(v))
        };
        let positive_s = |key: &'static str, v: Option<f64>, default: f64| -> Result<Dur, ScenarioError> {
            let d = seconds(key, v, default)?;
            if d == Dur::ZERO {
                return Err(invalid(key, "must be positive"));
            }
            Ok(d)
        };
        let autoscaler_name = self.autoscaler.as_deref().unwrap_or("none");
        let pd = match self.mode.as_deref().unwrap_or("colocated") {
            "colocated" => {
                if autoscaler_name != "none" {
                    return Err(invalid("pools.autoscaler", "autoscaling needs mode = \"pd\" (--mode pd)"));
                }
                None
            }
            "pd" => {
                let prefill = self.prefill_instances.unwrap_or(1);
                let decode = self.decode_instances.unwrap_or(1);
                if prefill == 0 || decode == 0 {
                    return Err(invalid("pools.prefill_instances", "each pool needs at least one instance"));
                }
                let min_per_pool = self.min_per_pool.unwrap_or(1).max(1);
                let xpyd = match &self.xpyd {
                    Some(s) => parse_xpyd(s)?,
                    None => {
                        let g = gcd(prefill, decode);
                        (prefill / g, decode / g)
                    }
                };
                let startup = seconds("pools.startup_s", self.startup_s, 10.0)?;
                let params = self.autoscaler_params.iter().flatten();
                let autoscaler =
                    autoscaler_with_params(autoscaler_name, startup, xpyd, params, "pools.autoscaler_params")?;
                let gpu_budget = self.gpu_budget.unwrap_or(fleet_instances * gpus_per_instance);
                if gpu_budget < (prefill + decode) * gpus_per_instance {
                    let reason = format!(
                        "{gpu_budget} GPUs cannot hold the {} starting instances of {gpus_per_instance} GPUs",
                        prefill + decode
                    );
                    return Err(invalid("pools.gpu_budget", reason));
                }
                let gb_s = self.transfer_gb_s.unwrap_or(50.0);
                if !(gb_s.is_finite() && gb_s > 0.0) {
                    return Err(invalid("pools.transfer_gb_s", format!("{gb_s} is not a positive bandwidth")));
                }
                Some(PdRun {
                    prefill,
                    decode,
                    autoscaler,
                    startup,
                    gpu_budget,
                    min_per_pool,
                    tick: positive_s("pools.tick_s", self.tick_s, 1.0)?,
                    slo_window: positive_s("pools.slo_window_s", self.slo_window_s, 20.0)?,
                    transfer_bytes_per_s: gb_s * 1e9,
                    transfer_latency: seconds(
                        "pools.transfer_latency_ms",
                        self.transfer_latency_ms.map(|ms| ms / 1e3),
                        0.001,
                    )?,
                })
            }
            other => return Err(invalid("pools.mode", format!("unknown mode `{other}` (valid: colocated, pd)"))),
        };
        let timeline = match (self.timeline_s, &pd) {
            (None, None) => None,
            (None, Some(_)) => Some(Dur::from_secs_f64(10.0)),
            (Some(s), _) => Some(positive_s("pools.timeline_s", Some(s), 10.0)?),
        };
        if pd.is_none() && timeline.is_none() && self.label.is_none() {
            return Ok(None);
        }
        Ok(Some(PoolsRun { label: self.label.clone(), pd, timeline }))
    }
}

/// `X:Y`, both at least 1.
fn parse_xpyd(s: &str) -> Result<(u32, u32), ScenarioError> {
    let bad = || invalid("pools.xpyd", format!("`{s}` is not X:Y with X, Y >= 1 (like 1:3)"));
    let (x, y) = s.split_once(':').ok_or_else(bad)?;
    let x: u32 = x.trim().parse().map_err(|_| bad())?;
    let y: u32 = y.trim().parse().map_err(|_| bad())?;
    if x == 0 || y == 0 {
        return Err(bad());
    }
    Ok((x, y))
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a.max(1)
    } else {
        gcd(b, a % b)
    }
}

/// One run's pools, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolsRun {
    /// Appended to the router's name in reports (`router/label`).
    pub label: Option<String>,
    pub pd: Option<PdRun>,
    pub timeline: Option<Dur>,
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
}

/// `[scheduler]`: `prefill = "fcfs"` (default) or `"fair"`, and fair prefill's knobs (see
/// [`engine::FairPrefill`]); and the KV high-water protection (see [`engine::KvProtection`]):
///
/// ```toml
/// [scheduler]
/// kv_high_water = 0.9           # pause admission at 90% of KV blocks in use ...
/// kv_low_water = 0.7            # ... until back at 70% [default: 80% of kv_high_water]
/// runaway_output_tokens = 4096  # under pressure, evict requests past 4,096 tokens [default: none]
/// runaway_action = "reroute"    # or "end" [default: reroute]
/// max_evictions = 1             # a request evicted this often runs to its end [default: no cap]
/// ```
///
/// Protection is on when `kv_high_water` is given, for every run but those written
/// `router@nohw`; a run written `router@hw` has it on either way (at a high-water mark of
/// [`DEFAULT_KV_HIGH_WATER`] when none is given).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerSection {
    pub prefill: Option<String>,
    /// Prompts with at most this many tokens left to compute are short [default: 8192].
    pub chunk_tokens: Option<u32>,
    /// A long prompt's first quota, as a share of the instance's KV tokens [default: 0.02].
    pub quota_kv_share: Option<f64>,
    /// Each yield multiplies the next quota by this [default: 2].
    pub quota_growth: Option<f64>,
    /// Tokens of each iteration short prompts leave to long ones [default: 1024].
    pub long_min_tokens: Option<u32>,
    /// Share of KV blocks in use at which admission pauses, in (0, 1].
    pub kv_high_water: Option<f64>,
    /// Share at which it resumes, in (0, kv_high_water) [default: 80% of kv_high_water].
    pub kv_low_water: Option<f64>,
    /// Tokens a request may generate on an instance before it counts as a runaway, evicted
    /// when KV use is at the high-water mark [default: none, no eviction].
    pub runaway_output_tokens: Option<u32>,
    /// What becomes of an evicted runaway: `reroute` (placed on another instance) or `end`.
    pub runaway_action: Option<String>,
    /// Evictions after which a request runs to its end where it is [default: no cap].
    pub max_evictions: Option<u32>,
}

/// The high-water mark of `router@hw` runs when the scenario gives none.
pub const DEFAULT_KV_HIGH_WATER: f64 = 0.9;

/// Evictions after which a request runs to its end, when none is given: no cap. (A cap of 1
/// on examples/long-output-burst.toml stops the bouncing but leaves the long outputs holding
/// KV where they are: short requests' TTFT p99 460 s instead of 57 s.)
pub const DEFAULT_MAX_EVICTIONS: u32 = u32::MAX;

/// The low-water mark, as a share of the high-water mark, when none is given.
pub const DEFAULT_KV_LOW_WATER_SHARE: f64 = 0.8;

impl SchedulerSection {
    fn overlay(self, over: SchedulerSection) -> SchedulerSection {
        SchedulerSection {
            prefill: over.prefill.or(self.prefill),
            chunk_tokens: over.chunk_tokens.or(self.chunk_tokens),
            quota_kv_share: over.quota_kv_share.or(self.quota_kv_share),
            quota_growth: over.quota_growth.or(self.quota_growth),
            long_min_tokens: over.long_min_tokens.or(self.long_min_tokens),
            kv_high_water: over.kv_high_water.or(self.kv_high_water),
            kv_low_water: over.kv_low_water.or(self.kv_low_water),
            runaway_output_tokens: over.runaway_output_tokens.or(self.runaway_output_tokens),
            runaway_action: over.runaway_action.or(self.runaway_action),
            max_evictions: over.max_evictions.or(self.max_evictions),
        }
    }

    /// An engine's scheduling as an operator sets it on a live fleet: the prefill policy
    /// and, when `kv_high_water` is given, the protection (a low-water mark alone is an error,
    /// since it would do nothing).
    pub fn engine_scheduling(&self) -> Result<(PrefillPolicy, Option<KvProtection>), ScenarioError> {
        let prefill = self.resolve()?;
        let (protection, on) = self.resolve_protection()?;
        if !on && self.kv_low_water.is_some() {
            return Err(invalid("scheduler.kv_low_water", "a low-water mark needs kv_high_water"));
        }
        Ok((prefill, on.then_some(protection)))
    }

    /// The KV high-water protection: its knobs, checked, and whether runs have it on unless
    /// their name says otherwise (`kv_high_water` given).
    fn resolve_protection(&self) -> Result<(KvProtection, bool), ScenarioError> {
        let high_water = self.kv_high_water.unwrap_or(DEFAULT_KV_HIGH_WATER);
        if !(high_water.is_finite() && high_water > 0.0 && high_water <= 1.0) {
            return Err(invalid("scheduler.kv_high_water", format!("{high_water} is not a share in (0, 1]")));
        }
        let low_water = self.kv_low_water.unwrap_or(high_water * DEFAULT_KV_LOW_WATER_SHARE);
        if !(low_water.is_finite() && low_water > 0.0 && low_water < high_water) {
            return Err(invalid(
                "scheduler.kv_low_water",
                format!("{low_water} is not a share in (0, kv_high_water = {high_water})"),
            ));
        }
        if self.runaway_output_tokens == Some(0) {
            return Err(invalid("scheduler.runaway_output_tokens", "must be at least 1"));
        }
        let runaway_action = match self.runaway_action.as_deref().unwrap_or("reroute") {
            "reroute" => RunawayAction::Reroute,
            "end" => RunawayAction::End,
            other => {
                return Err(invalid(
                    "scheduler.runaway_action",
                    format!("unknown runaway action `{other}` (valid: reroute, end)"),
                ))
            }
        };
        let protection = KvProtection {
            high_water,
            low_water,
            runaway_output_tokens: self.runaway_output_tokens,
            runaway_action,
            max_evictions: self.max_evictions.unwrap_or(DEFAULT_MAX_EVICTIONS),
        };
        Ok((protection, self.kv_high_water.is_some()))
    }

    fn resolve(&self) -> Result<PrefillPolicy, ScenarioError> {
        let mut fair = FairPrefill::default();
        let given = [
            ("chunk_tokens", self.chunk_tokens.map(f64::from)),
            ("quota_kv_share", self.quota_kv_share),
            ("quota_growth", self.quota_growth),
            ("long_min_tokens", self.long_min_tokens.map(f64::from)),
        ];
        for (name, v) in given.into_iter().filter_map(|(n, v)| Some((n, v?))) {
            fair.set(name, v).map_err(|e| param_error("scheduler", e))?;
        }
        match self.prefill.as_deref().unwrap_or("fcfs") {
            "fcfs" => Ok(PrefillPolicy::Fcfs),
            "fair" => Ok(PrefillPolicy::Fair(fair)),
            other => {
                Err(invalid("scheduler.prefill", format!("unknown prefill scheduler `{other}` (valid: fcfs, fair)")))
            }
        }
    }
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

/// Where requests come from.
#[derive(Clone, Debug, PartialEq)]
pub enum WorkloadSource {
    Trace {
        path: PathBuf,
        format: TraceFormat,
    },
    /// Boxed: the description is large, and read once per run.
    Synthetic(Box<SyntheticConfig>),
    Phased(Box<PhasedConfig>),
}

/// One run of a comparison: a router, on the scenario's fleet or a variant of it, written
/// `name@variant+variant`: KV tiers (`l1`, `l1+l2`, `l1+l2+l3`), the prefill scheduler
/// (`fcfs`, `fair`), the KV high-water protection (`hw` on, `nohw` off) and speculative
/// decoding (a drafter preset, `eagle3`, `dflash`, `dspark`, or `nospec`). So an L1-only
/// baseline and a tiered fleet, FCFS and fair prefill, runs with and without protection, or
/// each drafter against none, run on the same arrivals in one command.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSpec {
    pub router: RouterConfig,
    /// What followed `@`, as written (`None`: the scenario's fleet as it is).
    pub variant: Option<String>,
    pub tiers: KvTiers,
    pub prefill: PrefillPolicy,
    pub kv_protection: Option<KvProtection>,
    /// Disaggregated pools, autoscaling, time series (`None`: a fixed colocated fleet).
    pub pools: Option<PoolsRun>,
    /// Speculative decoding's drafter (`None`: none).
    pub drafter: Option<&'static Drafter>,
}

impl RunSpec {
    /// The run's name in tables and JSON.
    pub fn label(&self) -> String {
        let name = match &self.variant {
            Some(t) => format!("{}@{t}", self.router.label()),
            None => self.router.label(),
        };
        match self.pools.as_ref().and_then(|p| p.label.as_deref()) {
            Some(l) => format!("{name}/{l}"),
            None => name,
        }
    }
}

/// A resolved, validated scenario.
#[derive(Clone, Debug)]
pub struct Settings {
    pub seed: u64,
    pub routers: Vec<RunSpec>,
    pub instances: u32,
    pub instance: InstanceConfig,
    pub cost: CostModel,
    pub workload: WorkloadSource,
    pub rate_scale: f64,
    pub skip_requests: Option<u64>,
    pub max_requests: Option<u64>,
    pub slo: Slo,
    pub tiers: KvTiers,
    /// The fit of the cost model to `fleet.profile`, when one was given.
    pub calibration: Option<Calibration>,
    /// The scenario's drafter (`[fleet] spec`); runs may override it (`name@dspark`).
    pub drafter: Option<&'static Drafter>,
    /// `[fleet] dispatch_ms` (see [`SimConfig::dispatch`]).
    pub dispatch: Dur,
    /// `[fleet] instances_per_gpu` (see [`SimConfig::instances_per_gpu`]).
    pub instances_per_gpu: u32,
    pub gpu_share_efficiency: f64,
}

impl Scenario {
    /// Reads a scenario file; a relative trace path in it is taken relative to the file.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ScenarioError::Read { path: path.to_path_buf(), source })?;
        let mut s: Scenario = toml::from_str(&text)
            .map_err(|source| ScenarioError::Parse { path: path.to_path_buf(), source: Box::new(source) })?;
        if let Some(phased) = &mut s.workload.phased {
            phased.relative_to(path.parent().unwrap_or(Path::new(".")));
        }
        if let Some(profile) = &s.fleet.profile {
            if profile.is_relative() {
                let base = path.parent().unwrap_or(Path::new("."));
                s.fleet.profile = Some(base.join(profile));
            }
        }
        if let Some(trace) = &s.workload.trace {
            if trace.is_relative() {
                let base = path.parent().unwrap_or(Path::new("."));
                s.workload.trace = Some(base.join(trace));
            }
        }
        Ok(s)
    }

    /// `over`'s settings win where it has them (command-line flags over a file).
    pub fn overlay(self, over: Scenario) -> Scenario {
        let f = over.fleet;
        let w = over.workload;
        // A trace given on top replaces a synthetic workload below, and the other way round.
        let replaces_source = w.trace.is_some() || w.synthetic.is_some() || w.phased.is_some();
        let (trace, synthetic, phased, format) = if replaces_source {
            (w.trace, w.synthetic, w.phased, w.format)
        } else {
            (self.workload.trace, self.workload.synthetic, self.workload.phased, w.format.or(self.workload.format))
        };
        Scenario {
            seed: over.seed.or(self.seed),
            routers: over.routers.or(self.routers),
            fleet: FleetSection {
                instances: f.instances.or(self.fleet.instances),
                model: f.model.or(self.fleet.model),
                gpu: f.gpu.or(self.fleet.gpu),
                tp: f.tp.or(self.fleet.tp),
                dp_attention: f.dp_attention.or(self.fleet.dp_attention),
                ep: f.ep.or(self.fleet.ep),
                cp: f.cp.or(self.fleet.cp),
                cp_mode: f.cp_mode.or(self.fleet.cp_mode),
                spec: f.spec.or(self.fleet.spec),
                block_size: f.block_size.or(self.fleet.block_size),
                max_batch_tokens: f.max_batch_tokens.or(self.fleet.max_batch_tokens),
                max_seqs: f.max_seqs.or(self.fleet.max_seqs),
                kv_blocks: f.kv_blocks.or(self.fleet.kv_blocks),
                profile: f.profile.or(self.fleet.profile),
                dispatch_ms: f.dispatch_ms.or(self.fleet.dispatch_ms),
                instances_per_gpu: f.instances_per_gpu.or(self.fleet.instances_per_gpu),
                gpu_share_efficiency: f.gpu_share_efficiency.or(self.fleet.gpu_share_efficiency),
            },
            workload: WorkloadSection {
                trace,
                format,
                rate_scale: w.rate_scale.or(self.workload.rate_scale),
                skip_requests: w.skip_requests.or(self.workload.skip_requests),
                max_requests: w.max_requests.or(self.workload.max_requests),
                synthetic,
                phased,
            },
            slo: SloSection {
                ttft_ms: over.slo.ttft_ms.or(self.slo.ttft_ms),
                tpot_ms: over.slo.tpot_ms.or(self.slo.tpot_ms),
            },
            kv: self.kv.overlay(over.kv),
            scheduler: self.scheduler.overlay(over.scheduler),
            cost: over.cost.or(self.cost),
            pools: self.pools.overlay(over.pools),
        }
    }

    /// Fills defaults and checks every name and number.
    pub fn resolve(&self) -> Result<Settings, ScenarioError> {
        let names = match &self.routers {
            None => vec![RouterEntry::from("least-outstanding")],
            Some(names) if names.is_empty() => return Err(invalid("routers", "name at least one router")),
            Some(names) => names.clone(),
        };
        let f = &self.fleet;
        let instances = f.instances.unwrap_or(DEFAULT_INSTANCES);
        if instances == 0 {
            return Err(invalid("fleet.instances", "must be at least 1"));
        }
        let model = model_by_name(f.model.as_deref().unwrap_or(DEFAULT_MODEL))?;
        let gpu = gpu_by_name(f.gpu.as_deref().unwrap_or(DEFAULT_GPU))?;
        let params = self.cost.clone().unwrap_or_default();
        let deployment = Deployment {
            tp: f.tp.unwrap_or(1),
            dp_attention: f.dp_attention.unwrap_or(1),
            ep: f.ep.unwrap_or(1),
            cp: f.cp.unwrap_or(1),
            cp_mode: f.cp_mode.unwrap_or_default(),
        };
        let (cost, calibration) = calibrated_cost(model, gpu, deployment, params, f.profile.as_deref())?;
        let drafter = drafter_or_none(f.spec.as_deref().unwrap_or(NO_SPECULATION))?;
        let defaults = InstanceConfig::default();
        let block_size = f.block_size.unwrap_or(defaults.block_size);
        if block_size == 0 || !block_size.is_power_of_two() || block_size > 512 {
            return Err(invalid("fleet.block_size", format!("{block_size} is not a power of two between 1 and 512")));
        }
        let max_batch_tokens = f.max_batch_tokens.unwrap_or(defaults.max_batch_tokens);
        if max_batch_tokens == 0 {
            return Err(invalid("fleet.max_batch_tokens", "must be at least 1"));
        }
        let max_seqs = f.max_seqs.unwrap_or(defaults.max_seqs);
        if max_seqs == 0 {
            return Err(invalid("fleet.max_seqs", "must be at least 1"));
        }
        let tiers = self.kv.resolve(&cost, block_size)?;
        let prefill = self.scheduler.resolve()?;
        let (protection, protection_on) = self.scheduler.resolve_protection()?;
        let kv_protection = protection_on.then_some(protection);
        let pool_runs = match &self.pools.runs {
            None => vec![self.pools.resolve(instances, cost.gpus())?],
            Some(runs) if runs.is_empty() => return Err(invalid("pools.runs", "name at least one run")),
            Some(runs) => {
                let mut out = Vec::with_capacity(runs.len());
                for run in runs {
                    if run.runs.is_some() {
                        return Err(invalid("pools.runs", "a run cannot have runs of its own"));
                    }
                    let merged = PoolsSection { runs: None, ..self.pools.clone() }.overlay(run.clone());
                    out.push(merged.resolve(instances, cost.gpus())?);
                }
                out
            }
        };
        let mut routers = Vec::with_capacity(names.len() * pool_runs.len());
        for entry in &names {
            let (spec, params) = entry.parts()?;
            let (name, variant) = match spec.trim().split_once('@') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (spec.trim(), None),
            };
            let router = router_with_params(name, &params, "routers")?;
            let (mut run_tiers, mut run_prefill, mut run_protection) = (tiers, prefill, kv_protection);
            let mut run_drafter = drafter;
            if let Some(v) = &variant {
                let parts: Vec<&str> = v.split('+').map(str::trim).collect();
                let variants: Vec<&str> = ["l1", "l2", "l3", "fcfs", "fair", "hw", "nohw", NO_SPEC_VARIANT]
                    .into_iter()
                    .chain(drafter_names())
                    .collect();
                if let Some(unknown) = parts.iter().find(|p| !variants.contains(p)) {
                    let reason = format!("unknown variant `{unknown}` in `{spec}` (valid: {})", variants.join(", "));
                    return Err(invalid("routers", reason));
                }
                let (drafters, parts): (Vec<&str>, Vec<&str>) =
                    parts.into_iter().partition(|p| *p == NO_SPEC_VARIANT || drafter_by_name(p).is_ok());
                match drafters[..] {
                    [] => {}
                    [NO_SPEC_VARIANT] => run_drafter = None,
                    [d] => run_drafter = Some(drafter_by_name(d)?),
                    _ => return Err(invalid("routers", format!("`{spec}` names two drafters"))),
                }
                let (switches, parts): (Vec<&str>, Vec<&str>) =
                    parts.into_iter().partition(|p| matches!(*p, "hw" | "nohw"));
                let (scheduler, tier_names): (Vec<&str>, Vec<&str>) =
                    parts.into_iter().partition(|p| matches!(*p, "fcfs" | "fair"));
                if scheduler.len() > 1 {
                    return Err(invalid("routers", format!("`{spec}` names two prefill schedulers")));
                }
                match switches[..] {
                    [] => {}
                    ["hw"] => run_protection = Some(protection),
                    ["nohw"] => run_protection = None,
                    _ => return Err(invalid("routers", format!("`{spec}` names hw or nohw twice"))),
                }
                if let Some(&s) = scheduler.first() {
                    let section = SchedulerSection { prefill: Some(s.to_string()), ..self.scheduler.clone() };
                    run_prefill = section.resolve()?;
                }
                if !tier_names.is_empty() {
                    let section = KvSection { tiers: Some(tier_names.join(",")), ..self.kv.clone() };
                    run_tiers = section.resolve(&cost, block_size)?;
                }
            }
            for pools in &pool_runs {
                routers.push(RunSpec {
                    router,
                    variant: variant.clone(),
                    tiers: run_tiers,
                    prefill: run_prefill,
                    kv_protection: run_protection,
                    pools: pools.clone(),
                    drafter: run_drafter,
                });
            }
        }
        let total_blocks = match f.kv_blocks {
            Some(0) => return Err(invalid("fleet.kv_blocks", "must be at least 1")),
            Some(n) => n,
            None => cost.kv_blocks(block_size),
        };
        // The links are the same for every run; only which tiers are on differs.
        let cost = cost.with_links(tiers.links);
        let instance = InstanceConfig {
            block_size,
            total_blocks,
            max_batch_tokens,
            max_seqs,
            admission_watermark: defaults.admission_watermark,
            l2_blocks: tiers.l2_blocks,
            prefill,
            kv_protection,
        };
        let w = &self.workload;
        let workload = match (&w.trace, &w.synthetic, &w.phased) {
            (None, None, Some(cfg)) => WorkloadSource::Phased(Box::new(cfg.resolve()?)),
            (_, _, Some(_)) => {
                return Err(invalid("workload", "give one of `trace`, `synthetic` and `phased`, not several"))
            }
            (Some(_), Some(_), None) => {
                return Err(invalid("workload", "give either `trace` or `synthetic`, not both"))
            }
            (None, None, None) => {
                return Err(invalid("workload", "give a trace (--trace PATH) or a synthetic workload"))
            }
            (Some(path), None, None) => {
                let format = match &w.format {
                    Some(name) => name.parse::<TraceFormat>()?,
                    None => TraceFormat::guess(path).ok_or_else(|| {
                        invalid("workload.format", format!("cannot tell the format of {}; name it", path.display()))
                    })?,
                };
                WorkloadSource::Trace { path: path.clone(), format }
            }
            (None, Some(cfg), None) => WorkloadSource::Synthetic(Box::new(cfg.clone())),
        };
        let dispatch_ms = f.dispatch_ms.unwrap_or(0.0);
        if !(dispatch_ms.is_finite() && dispatch_ms >= 0.0) {
            return Err(invalid("fleet.dispatch_ms", format!("{dispatch_ms} is not a number of milliseconds >= 0")));
        }
        let instances_per_gpu = f.instances_per_gpu.unwrap_or(1);
        if instances_per_gpu == 0 {
            return Err(invalid("fleet.instances_per_gpu", "must be at least 1"));
        }
        if instances_per_gpu > 1 && (cost.gpus() > 1 || routers.iter().any(|r| r.pools.is_some())) {
            return Err(invalid(
                "fleet.instances_per_gpu",
                "engines share a GPU only as one-GPU instances of a colocated fleet",
            ));
        }
        let gpu_share_efficiency = f.gpu_share_efficiency.unwrap_or(1.0);
        if !(gpu_share_efficiency > 0.0 && gpu_share_efficiency <= 1.0) {
            return Err(invalid(
                "fleet.gpu_share_efficiency",
                format!("{gpu_share_efficiency} is not a share in (0, 1]"),
            ));
        }
        let rate_scale = w.rate_scale.unwrap_or(1.0);
        if !(rate_scale.is_finite() && rate_scale > 0.0) {
            return Err(invalid("workload.rate_scale", format!("{rate_scale} is not a positive number")));
        }
        let slo = Slo {
            ttft_ms: self.slo.ttft_ms.unwrap_or(DEFAULT_TTFT_SLO_MS),
            tpot_ms: self.slo.tpot_ms.unwrap_or(DEFAULT_TPOT_SLO_MS),
        };
        for (key, v) in [("slo.ttft_ms", slo.ttft_ms), ("slo.tpot_ms", slo.tpot_ms)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(key, format!("{v} is not a positive number of milliseconds")));
            }
        }
        Ok(Settings {
            seed: self.seed.unwrap_or(DEFAULT_SEED),
            routers,
            instances,
            instance,
            cost,
            workload,
            rate_scale,
            skip_requests: w.skip_requests,
            max_requests: w.max_requests,
            slo,
            tiers,
            calibration,
            drafter,
            dispatch: Dur::from_secs_f64(dispatch_ms / 1e3),
            instances_per_gpu,
            gpu_share_efficiency,
        })
    }
}

/// The run variant without speculation (`name@nospec`, like `@nohw`).
pub const NO_SPEC_VARIANT: &str = "nospec";

impl Settings {
    /// A run of `router` on the scenario's own tiers.
    pub fn run_of(&self, router: RouterConfig) -> RunSpec {
        RunSpec {
            router,
            variant: None,
            tiers: self.tiers,
            prefill: self.instance.prefill,
            kv_protection: self.instance.kv_protection,
            pools: None,
            drafter: self.drafter,
        }
    }

    pub fn sim_config(&self, run: &RunSpec) -> SimConfig {
        SimConfig {
            seed: self.seed,
            label: run.label(),
            router: run.router,
            instances: self.instances,
            instance: InstanceConfig {
                l2_blocks: run.tiers.l2_blocks,
                prefill: run.prefill,
                kv_protection: run.kv_protection,
                ..self.instance.clone()
            },
            cost: self.cost.clone(),
            slo: self.slo,
            l3_blocks: run.tiers.l3_blocks,
            event_delay: run.tiers.event_delay,
            infinite_cache_bound: true,
            pd: run.pools.as_ref().and_then(|p| p.pd),
            timeline: run.pools.as_ref().and_then(|p| p.timeline),
            shifts_s: match &self.workload {
                WorkloadSource::Phased(cfg) => cfg.shifts_s().iter().map(|s| s / self.rate_scale).collect(),
                _ => Vec::new(),
            },
            drafter: run.drafter,
            dispatch: self.dispatch,
            instances_per_gpu: self.instances_per_gpu,
            gpu_share_efficiency: self.gpu_share_efficiency,
        }
    }

    /// Opens the workload afresh (each run reads the same arrivals), at `rate_scale`.
    pub fn open_workload(&self, rate_scale: f64) -> Result<Box<dyn Workload>, WorkloadError> {
        let opts = WorkloadOptions { block_size: self.instance.block_size, rate_scale, seed: self.seed };
        let w = match &self.workload {
            WorkloadSource::Trace { path, format } => workload::open_trace(path, *format, &opts)?,
            WorkloadSource::Synthetic(cfg) => workload::synthetic(cfg, &opts)?,
            WorkloadSource::Phased(cfg) => workload::phased(cfg, &opts)?,
        };
        let w = match self.skip_requests {
            Some(n) => workload::skip(w, n),
            None => w,
        };
        Ok(match self.max_requests {
            Some(n) => workload::limit(w, n),
            None => w,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `toml_text` over a ten-request synthetic workload, resolved.
    pub(crate) fn resolve(toml_text: &str) -> Result<Settings, ScenarioError> {
        let base = r#"
            [workload.synthetic]
            requests = 10
            arrival = { kind = "poisson", rate_rps = 1.0 }
            input = { kind = "constant", tokens = 100 }
            output = { kind = "constant", tokens = 10 }
        "#;
        let s: Scenario = toml::from_str(&format!("{toml_text}\n{base}")).expect("parses");
        s.resolve()
    }

    #[test]
    fn a_scenario_without_pools_runs_a_fixed_colocated_fleet() {
        let s = resolve("").expect("valid");
        assert_eq!(s.routers[0].pools, None);
        assert_eq!(s.sim_config(&s.routers[0]).pd, None);
    }

    #[test]
    fn pool_runs_multiply_the_routers_and_inherit_the_section() {
        let s = resolve(
            r#"
            routers = ["round-robin", "least-outstanding"]
            [pools]
            gpu_budget = 12
            startup_s = 30
            runs = [ { label = "colo" }, { label = "slo", mode = "pd", prefill_instances = 2, decode_instances = 4, autoscaler = "slo-load" } ]
            "#,
        )
        .expect("valid");
        let labels: Vec<String> = s.routers.iter().map(RunSpec::label).collect();
        assert_eq!(labels, ["round-robin/colo", "round-robin/slo", "least-outstanding/colo", "least-outstanding/slo"]);
        let pd = s.routers[1].pools.as_ref().and_then(|p| p.pd).expect("a pd run");
        assert_eq!((pd.prefill, pd.decode, pd.gpu_budget, pd.startup), (2, 4, 12, Dur::from_millis(30_000)));
        assert_eq!(pd.autoscaler.name(), "slo-load");
        assert_eq!(s.routers[0].pools.as_ref().map(|p| p.pd), Some(None), "colo has a label and no pools");
    }

    #[test]
    fn drafters_come_from_the_fleet_section_and_run_variants() {
        let s = resolve(
            r#"
            routers = ["round-robin", "round-robin@nospec", "round-robin@eagle3", "round-robin@dspark+l1"]
            [fleet]
            spec = "dflash"
            "#,
        )
        .expect("valid");
        let drafters: Vec<Option<&str>> = s.routers.iter().map(|r| s.sim_config(r).drafter.map(|d| d.name)).collect();
        assert_eq!(drafters, [Some("dflash"), None, Some("eagle3"), Some("dspark")]);
        assert_eq!(resolve("[fleet]\nspec = \"none\"").expect("valid").drafter, None);
        assert_eq!(resolve("").expect("valid").drafter, None, "no speculation by default");
    }

    #[test]
    fn bad_drafters_name_the_valid_ones() {
        let err = |t: &str| resolve(t).expect_err("invalid").to_string();
        assert_eq!(err("[fleet]\nspec = \"medusa\""), "unknown drafter `medusa` (valid: none, eagle3, dflash, dspark)");
        assert_eq!(
            err("routers = [\"round-robin@eagle3+dspark\"]"),
            "invalid setting `routers`: `round-robin@eagle3+dspark` names two drafters"
        );
        assert_eq!(
            err("routers = [\"round-robin@medusa\"]"),
            "invalid setting `routers`: unknown variant `medusa` in `round-robin@medusa` \
             (valid: l1, l2, l3, fcfs, fair, hw, nohw, nospec, eagle3, dflash, dspark)"
        );
    }

    #[test]
    fn bad_pool_settings_name_their_key() {
        let err = |t: &str| resolve(t).expect_err("invalid").to_string();
        assert_eq!(
            err("[pools]\nmode = \"split\""),
            "invalid setting `pools.mode`: unknown mode `split` (valid: colocated, pd)"
        );
        assert_eq!(
            err("[pools]\nautoscaler = \"slo-load\""),
            "invalid setting `pools.autoscaler`: autoscaling needs mode = \"pd\" (--mode pd)"
        );
        assert_eq!(
            err("[pools]\nmode = \"pd\"\nautoscaler = \"magic\""),
            "unknown autoscaler `magic` (valid: none, fixed-xpyd, slo-load)"
        );
        assert_eq!(
            err("[pools]\nmode = \"pd\"\nxpyd = \"2x3\""),
            "invalid setting `pools.xpyd`: `2x3` is not X:Y with X, Y >= 1 (like 1:3)"
        );
        assert_eq!(
            err("[pools]\nmode = \"pd\"\nprefill_instances = 6\ndecode_instances = 6\ngpu_budget = 8"),
            "invalid setting `pools.gpu_budget`: 8 GPUs cannot hold the 12 starting instances of 1 GPUs"
        );
        assert!(toml::from_str::<Scenario>("[pools]\nprefil_instances = 2").is_err(), "unknown keys are refused");
        assert_eq!(
            err("[fleet]\ndispatch_ms = -1.0"),
            "invalid setting `fleet.dispatch_ms`: -1 is not a number of milliseconds >= 0"
        );
        assert_eq!(resolve("[fleet]\ndispatch_ms = 2.5").expect("valid").dispatch, Dur(2_500));
        assert_eq!(
            err("[fleet]\ninstances_per_gpu = 0"),
            "invalid setting `fleet.instances_per_gpu`: must be at least 1"
        );
        assert_eq!(
            err("[fleet]\ntp = 2\ninstances_per_gpu = 2"),
            "invalid setting `fleet.instances_per_gpu`: engines share a GPU only as one-GPU instances of a colocated fleet"
        );
        assert_eq!(
            err("[fleet]\ngpu_share_efficiency = 1.5"),
            "invalid setting `fleet.gpu_share_efficiency`: 1.5 is not a share in (0, 1]"
        );
    }

    #[test]
    fn fixed_xpyd_groups_default_to_the_starting_ratio() {
        let s =
            resolve("[pools]\nmode = \"pd\"\nprefill_instances = 2\ndecode_instances = 6\nautoscaler = \"fixed-xpyd\"")
                .expect("valid");
        let pd = s.routers[0].pools.as_ref().and_then(|p| p.pd).expect("pd");
        assert!(matches!(pd.autoscaler, AutoscalerConfig::FixedXpyd { x: 1, y: 3, .. }));
        assert_eq!(s.sim_config(&s.routers[0]).timeline, Some(Dur::from_millis(10_000)), "pd runs have a time series");
    }

    #[test]
    fn an_engines_live_scheduling_is_checked_like_a_scenarios() {
        let check = |prefill: &str, high: Option<f64>, low: Option<f64>| {
            let section = SchedulerSection {
                prefill: Some(prefill.into()),
                kv_high_water: high,
                kv_low_water: low,
                ..SchedulerSection::default()
            };
            section.engine_scheduling().map_err(|e| e.to_string())
        };
        let (prefill, protection) = check("fair", Some(0.9), None).expect("valid");
        assert!(matches!(prefill, PrefillPolicy::Fair(_)));
        assert_eq!(protection.map(|p| (p.high_water, p.runaway_output_tokens)), Some((0.9, None)));
        assert!((protection.expect("on").low_water - 0.72).abs() < 1e-9, "80% of the high-water mark");
        assert_eq!(check("fcfs", None, None), Ok((PrefillPolicy::Fcfs, None)));
        assert_eq!(
            check("lifo", None, None).unwrap_err(),
            "invalid setting `scheduler.prefill`: unknown prefill scheduler `lifo` (valid: fcfs, fair)"
        );
        assert_eq!(
            check("fcfs", Some(1.5), None).unwrap_err(),
            "invalid setting `scheduler.kv_high_water`: 1.5 is not a share in (0, 1]"
        );
        assert_eq!(
            check("fcfs", Some(0.8), Some(0.9)).unwrap_err(),
            "invalid setting `scheduler.kv_low_water`: 0.9 is not a share in (0, kv_high_water = 0.8)"
        );
        assert_eq!(
            check("fcfs", None, Some(0.5)).unwrap_err(),
            "invalid setting `scheduler.kv_low_water`: a low-water mark needs kv_high_water"
        );
    }

    #[test]
    fn a_routers_table_sets_its_parameters_and_labels_the_run() {
        let s =
            resolve(r#"routers = ["dynamo-kv", { name = "dynamo-kv@l1", overlap_score_weight = 2 }]"#).expect("valid");
        let weights: Vec<RouterConfig> = s.routers.iter().map(|r| s.sim_config(r).router).collect();
        let weight = |w| RouterConfig::from(policies::router::DynamoKvConfig { overlap_score_weight: w });
        assert_eq!(weights, [weight(1.0), weight(2.0)]);
        let labels: Vec<String> = s.routers.iter().map(RunSpec::label).collect();
        assert_eq!(labels, ["dynamo-kv", "dynamo-kv(overlap_score_weight=2)@l1"]);
    }

    #[test]
    fn a_router_or_autoscaler_parameter_out_of_range_names_itself_and_its_range() {
        let e = resolve(r#"routers = [{ name = "llm-d", kv_weight = 20.0 }]"#).unwrap_err().to_string();
        assert_eq!(e, "invalid setting `routers.kv_weight`: llm-d's `kv_weight` is 20, outside its range [0, 16]");
        let e = resolve(r#"routers = [{ name = "llm-d", kv = "high" }]"#).unwrap_err().to_string();
        assert_eq!(e, "invalid setting `routers`: `kv` of `llm-d` is \"high\", not a number");
        let e = resolve(r#"routers = [{ overlap_score_weight = 1 }]"#).unwrap_err().to_string();
        assert!(e.contains("needs `name"), "{e}");
        let pd = "[pools]\nmode = \"pd\"\nautoscaler = \"slo-load\"\n";
        let s = resolve(&format!("{pd}autoscaler_params = {{ up_load = 0.9, up_hold = 2.5 }}")).expect("valid");
        let Some(AutoscalerConfig::SloLoad { knobs }) =
            s.routers[0].pools.as_ref().and_then(|p| p.pd).map(|p| p.autoscaler)
        else {
            panic!("slo-load")
        };
        assert_eq!((knobs.up_load, knobs.up_hold), (0.9, Dur::from_millis(2_500)));
        let e = resolve(&format!("{pd}autoscaler_params = {{ shrink_util = 0 }}")).unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid setting `pools.autoscaler_params.shrink_util`: autoscaler's `shrink_util` is 0, outside its range (0, 1]"
        );
        let e = resolve("[scheduler]\nquota_growth = 0.5").unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid setting `scheduler.quota_growth`: fair's `quota_growth` is 0.5, outside its range [1, 16]"
        );
    }
}
