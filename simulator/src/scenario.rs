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
//! tp = 1
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

use crate::cost::{gpu_by_name, model_by_name, CostError, CostModel, CostParams, Deployment, UnknownName};
use crate::metrics::Slo;
use crate::sim::SimConfig;
use crate::tiers::{KvSection, KvTiers};
use crate::workload::{self, SyntheticConfig, TraceFormat, Workload, WorkloadError, WorkloadOptions};
use engine::InstanceConfig;
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
    /// Overrides of the cost model's efficiency factors and overheads.
    pub cost: Option<CostParams>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSection {
    pub instances: Option<u32>,
    pub model: Option<String>,
    pub gpu: Option<String>,
    pub tp: Option<u32>,
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
    Trace { path: PathBuf, format: TraceFormat },
    Synthetic(SyntheticConfig),
}

/// One run of a comparison: a router, on the scenario's KV tiers or on its own, written
/// `name@l1+l2+l3` (so that an L1-only baseline and a tiered fleet run on the same arrivals).
#[derive(Clone, Debug, PartialEq)]
pub struct RunSpec {
    pub router: RouterConfig,
    /// The tiers after `@`, as written (`None`: the scenario's).
    pub tiers_override: Option<String>,
    pub tiers: KvTiers,
}

impl RunSpec {
    /// The run's name in tables and JSON.
    pub fn label(&self) -> String {
        match &self.tiers_override {
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
        let cost = CostModel::new(model, gpu, Deployment { tp: f.tp.unwrap_or(1) }, params)?;
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
        let mut routers = Vec::with_capacity(names.len());
        for spec in &names {
            let (name, over) = match spec.trim().split_once('@') {
                Some((n, t)) => (n, Some(t.to_string())),
                None => (spec.trim(), None),
            };
            let router: RouterConfig = name.parse()?;
            let run_tiers = match &over {
                Some(t) => {
                    KvSection { tiers: Some(t.replace('+', ",")), ..self.kv.clone() }.resolve(&cost, block_size)?
                }
                None => tiers,
            };
            routers.push(RunSpec { router, tiers_override: over, tiers: run_tiers });
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
            (None, Some(cfg)) => WorkloadSource::Synthetic(cfg.clone()),
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
        RunSpec { router, tiers_override: None, tiers: self.tiers }
    }

    pub fn sim_config(&self, run: &RunSpec) -> SimConfig {
        SimConfig {
            seed: self.seed,
            label: run.label(),
            router: run.router,
            instances: self.instances,
            instance: InstanceConfig { l2_blocks: run.tiers.l2_blocks, ..self.instance.clone() },
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
