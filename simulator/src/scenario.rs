//! Scenario files: every setting of a simulation in one TOML file, with command-line flags
//! laid over it.
//!
//! ```toml
//! seed = 42
//! routers = ["round-robin", "least-outstanding"]
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
//!
//! [workload]
//! trace = "../../shared/traces/mooncake-conversation.jsonl"   # relative to this file
//! format = "mooncake"
//! rate_scale = 1.0
//!
//! [slo]
//! ttft_ms = 2000
//! tpot_ms = 100
//!
//! [kv]                  # see `tiers.rs`
//! tiers = "l1,l2,l3"
//! ```
//!
//! A [`Scenario`] is the raw file (every field optional, unknown keys refused with their
//! name); [`Scenario::resolve`] fills the defaults, checks every name and gives [`Settings`].

use crate::cost::{gpu_by_name, model_by_name, CostError, CostModel, CostParams, CpMode, Deployment, UnknownName};
use crate::metrics::Slo;
use crate::sim::SimConfig;
use crate::tiers::{KvSection, KvTiers};
use crate::workload::{self, SyntheticConfig, TraceFormat, Workload, WorkloadError, WorkloadOptions};
use engine::{FairPrefill, InstanceConfig, KvProtection, PrefillPolicy, RunawayAction};
use policies::{RouterConfig, UnknownRouter};
use serde::{Deserialize, Serialize};
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
    pub routers: Option<Vec<String>>,
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
    pub block_size: Option<u32>,
    pub max_batch_tokens: Option<u32>,
    pub max_seqs: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadSection {
    pub trace: Option<PathBuf>,
    pub format: Option<String>,
    pub rate_scale: Option<f64>,
    pub max_requests: Option<u64>,
    pub synthetic: Option<SyntheticConfig>,
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
        let d = FairPrefill::default();
        let fair = FairPrefill {
            chunk_tokens: self.chunk_tokens.unwrap_or(d.chunk_tokens),
            quota_kv_share: self.quota_kv_share.unwrap_or(d.quota_kv_share),
            quota_growth: self.quota_growth.unwrap_or(d.quota_growth),
            long_min_tokens: self.long_min_tokens.unwrap_or(d.long_min_tokens),
        };
        if fair.chunk_tokens == 0 {
            return Err(invalid("scheduler.chunk_tokens", "must be at least 1"));
        }
        if !(fair.quota_kv_share.is_finite() && fair.quota_kv_share > 0.0 && fair.quota_kv_share <= 1.0) {
            return Err(invalid(
                "scheduler.quota_kv_share",
                format!("{} is not a share in (0, 1]", fair.quota_kv_share),
            ));
        }
        if !(fair.quota_growth.is_finite() && fair.quota_growth >= 1.0) {
            return Err(invalid("scheduler.quota_growth", format!("{} is not a number >= 1", fair.quota_growth)));
        }
        if fair.long_min_tokens == 0 {
            return Err(invalid("scheduler.long_min_tokens", "must be at least 1, or long prompts could starve"));
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
    Cost(#[from] CostError),
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error("invalid setting `{key}`: {reason}")]
    Invalid { key: &'static str, reason: String },
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
}

/// One run of a comparison: a router, on the scenario's fleet or a variant of it, written
/// `name@variant+variant`: KV tiers (`l1`, `l1+l2`, `l1+l2+l3`), the prefill scheduler
/// (`fcfs`, `fair`) and the KV high-water protection (`hw` on, `nohw` off). So an L1-only
/// baseline and a tiered fleet, FCFS and fair prefill, or runs with and without protection,
/// run on the same arrivals in one command.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSpec {
    pub router: RouterConfig,
    /// What followed `@`, as written (`None`: the scenario's fleet as it is).
    pub variant: Option<String>,
    pub tiers: KvTiers,
    pub prefill: PrefillPolicy,
    pub kv_protection: Option<KvProtection>,
}

impl RunSpec {
    /// The run's name in tables and JSON.
    pub fn label(&self) -> String {
        match &self.variant {
            Some(t) => format!("{}@{t}", self.router),
            None => self.router.to_string(),
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
    pub max_requests: Option<u64>,
    pub slo: Slo,
    pub tiers: KvTiers,
}

impl Scenario {
    /// Reads a scenario file; a relative trace path in it is taken relative to the file.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ScenarioError::Read { path: path.to_path_buf(), source })?;
        let mut s: Scenario = toml::from_str(&text)
            .map_err(|source| ScenarioError::Parse { path: path.to_path_buf(), source: Box::new(source) })?;
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
        let replaces_source = w.trace.is_some() || w.synthetic.is_some();
        let (trace, synthetic, format) = if replaces_source {
            (w.trace, w.synthetic, w.format)
        } else {
            (self.workload.trace, self.workload.synthetic, w.format.or(self.workload.format))
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
                block_size: f.block_size.or(self.fleet.block_size),
                max_batch_tokens: f.max_batch_tokens.or(self.fleet.max_batch_tokens),
                max_seqs: f.max_seqs.or(self.fleet.max_seqs),
            },
            workload: WorkloadSection {
                trace,
                format,
                rate_scale: w.rate_scale.or(self.workload.rate_scale),
                max_requests: w.max_requests.or(self.workload.max_requests),
                synthetic,
            },
            slo: SloSection {
                ttft_ms: over.slo.ttft_ms.or(self.slo.ttft_ms),
                tpot_ms: over.slo.tpot_ms.or(self.slo.tpot_ms),
            },
            kv: self.kv.overlay(over.kv),
            scheduler: self.scheduler.overlay(over.scheduler),
            cost: over.cost.or(self.cost),
        }
    }

    /// Fills defaults and checks every name and number.
    pub fn resolve(&self) -> Result<Settings, ScenarioError> {
        let names = match &self.routers {
            None => vec![RouterConfig::LeastOutstanding.name().to_string()],
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
        let cost = CostModel::new(model, gpu, deployment, params)?;
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
        let mut routers = Vec::with_capacity(names.len());
        for spec in &names {
            let (name, variant) = match spec.trim().split_once('@') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (spec.trim(), None),
            };
            let router: RouterConfig = name.parse()?;
            let (mut run_tiers, mut run_prefill, mut run_protection) = (tiers, prefill, kv_protection);
            if let Some(v) = &variant {
                let parts: Vec<&str> = v.split('+').map(str::trim).collect();
                const VARIANTS: [&str; 7] = ["l1", "l2", "l3", "fcfs", "fair", "hw", "nohw"];
                if let Some(unknown) = parts.iter().find(|p| !VARIANTS.contains(p)) {
                    let reason = format!("unknown variant `{unknown}` in `{spec}` (valid: {})", VARIANTS.join(", "));
                    return Err(invalid("routers", reason));
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
            routers.push(RunSpec {
                router,
                variant,
                tiers: run_tiers,
                prefill: run_prefill,
                kv_protection: run_protection,
            });
        }
        // The links are the same for every run; only which tiers are on differs.
        let cost = cost.with_links(tiers.links);
        let instance = InstanceConfig {
            block_size,
            total_blocks: cost.kv_blocks(block_size),
            max_batch_tokens,
            max_seqs,
            admission_watermark: defaults.admission_watermark,
            l2_blocks: tiers.l2_blocks,
            prefill,
            kv_protection,
        };
        let w = &self.workload;
        let workload = match (&w.trace, &w.synthetic) {
            (Some(_), Some(_)) => return Err(invalid("workload", "give either `trace` or `synthetic`, not both")),
            (None, None) => return Err(invalid("workload", "give a trace (--trace PATH) or a synthetic workload")),
            (Some(path), None) => {
                let format = match &w.format {
                    Some(name) => name.parse::<TraceFormat>()?,
                    None => TraceFormat::guess(path).ok_or_else(|| {
                        invalid("workload.format", format!("cannot tell the format of {}; name it", path.display()))
                    })?,
                };
                WorkloadSource::Trace { path: path.clone(), format }
            }
            (None, Some(cfg)) => WorkloadSource::Synthetic(Box::new(cfg.clone())),
        };
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
            max_requests: w.max_requests,
            slo,
            tiers,
        })
    }
}

impl Settings {
    /// A run of `router` on the scenario's own tiers.
    pub fn run_of(&self, router: RouterConfig) -> RunSpec {
        RunSpec {
            router,
            variant: None,
            tiers: self.tiers,
            prefill: self.instance.prefill,
            kv_protection: self.instance.kv_protection,
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
        }
    }

    /// Opens the workload afresh (each run reads the same arrivals), at `rate_scale`.
    pub fn open_workload(&self, rate_scale: f64) -> Result<Box<dyn Workload>, WorkloadError> {
        let opts = WorkloadOptions { block_size: self.instance.block_size, rate_scale, seed: self.seed };
        let w = match &self.workload {
            WorkloadSource::Trace { path, format } => workload::open_trace(path, *format, &opts)?,
            WorkloadSource::Synthetic(cfg) => workload::synthetic(cfg, &opts)?,
        };
        Ok(match self.max_requests {
            Some(n) => workload::limit(w, n),
            None => w,
        })
    }
}
