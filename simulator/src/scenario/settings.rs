//! What a scenario resolves to: [`Settings`], with one [`RunSpec`] per compared run.

use super::flow::FlowRun;
use super::pools::PoolsRun;
use super::tiers::KvTiers;
use crate::sim::SimConfig;
use crate::slo::Slo;
use crate::workload::{
    self, AgenticConfig, ClassesConfig, MaxTokens, PhasedConfig, RecordedTrace, SyntheticConfig, TraceFormat, Workload,
    WorkloadError, WorkloadOptions,
};
use cost::{Calibration, CostModel, Drafter};
use engine::{Dur, InstanceConfig, KvProtection, PrefillPolicy};
use policies::RouterConfig;
use std::path::PathBuf;
use std::sync::Arc;

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
    /// Closed-loop agentic sessions.
    Agentic(Box<AgenticConfig>),
}

/// One run of a comparison: a router, on the scenario's fleet or a variant of it, written
/// `name@variant+variant`: KV tiers (`l1`, `l1+l2`, `l1+l2+l3`), the prefill scheduler
/// (`fcfs`, `fair`), the KV high-water protection (`hw` on, `nohw` off), speculative
/// decoding (a drafter preset, `eagle3`, `dflash`, `dspark`, or `nospec`) and the engines'
/// step budget (`b2048`: 2,048 tokens a step). So an L1-only baseline and a tiered fleet, FCFS
/// and fair prefill, runs with and without protection, each drafter against none, or two step
/// budgets, run on the same arrivals in one command.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSpec {
    pub router: RouterConfig,
    /// What followed `@`, as written (`None`: the scenario's fleet as it is).
    pub variant: Option<String>,
    pub tiers: KvTiers,
    pub prefill: PrefillPolicy,
    pub kv_protection: Option<KvProtection>,
    /// The engines' token budget of one step (`[fleet] max_batch_tokens`, or a policy's).
    pub max_batch_tokens: u32,
    /// Disaggregated pools, autoscaling, time series (`None`: a fixed colocated fleet).
    pub pools: Option<PoolsRun>,
    /// Speculative decoding's drafter (`None`: none).
    pub drafter: Option<&'static Drafter>,
    /// Flow control at the controller and class priority in the engines.
    pub flow: FlowRun,
}

impl RunSpec {
    /// The run's name in tables and JSON.
    pub fn label(&self) -> String {
        let name = match &self.variant {
            Some(t) => format!("{}@{t}", self.router.label()),
            None => self.router.label(),
        };
        let labels = [self.pools.as_ref().and_then(|p| p.label.as_deref()), self.flow.label.as_deref()];
        labels.into_iter().flatten().fold(name, |name, l| format!("{name}/{l}"))
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
    /// `[workload.classes]`: request classes, their targets and the tenants.
    pub classes: Option<ClassesConfig>,
    /// `[workload] max_tokens` (see [`SimConfig::max_tokens`]).
    pub max_tokens: MaxTokens,
    /// The trace read once, for commands that run it many times ([`Settings::keep_trace`]);
    /// used by [`Settings::open_workload`] wherever it serves these settings.
    pub recorded: Option<Arc<RecordedTrace>>,
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
            max_batch_tokens: self.instance.max_batch_tokens,
            pools: None,
            drafter: self.drafter,
            flow: FlowRun::default(),
        }
    }

    /// Each class's SLO (by [`engine::Class::index`]): its own targets where
    /// `[workload.classes]` gives them, else `[slo]`'s; `None` without classes.
    pub fn class_slos(&self) -> Option<[Slo; 3]> {
        let classes = self.classes.as_ref()?;
        Some(engine::Class::ALL.map(|class| match classes.mix.iter().find(|c| c.class == class) {
            Some(c) => {
                Slo { ttft_ms: c.ttft_ms.unwrap_or(self.slo.ttft_ms), tpot_ms: c.tpot_ms.unwrap_or(self.slo.tpot_ms) }
            }
            None => self.slo,
        }))
    }

    pub fn sim_config(&self, run: &RunSpec) -> SimConfig {
        SimConfig {
            seed: self.seed,
            label: run.label(),
            router: run.router,
            instances: self.instances,
            instance: InstanceConfig {
                l2_blocks: run.tiers.l2_blocks,
                offload_chunk_blocks: run.tiers.chunk_blocks,
                prefill: run.prefill,
                kv_protection: run.kv_protection,
                max_batch_tokens: run.max_batch_tokens,
                class_priority: run.flow.class_priority,
                program_hold: run.flow.program_hold,
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
            max_tokens: self.max_tokens,
            instances_per_gpu: self.instances_per_gpu,
            gpu_share_efficiency: self.gpu_share_efficiency,
            flow: run.flow.flow,
            class_slos: self.class_slos(),
            tenants: self.classes.as_ref().map(ClassesConfig::tenant_names).unwrap_or_default(),
            give_up: None,
        }
    }

    /// Whether every run reads the same number of requests whatever its rate scale: a trace's
    /// lines are the same at any rate (a synthetic, phased or closed-loop workload may make
    /// more or fewer).
    pub fn fixed_request_count(&self) -> bool {
        matches!(self.workload, WorkloadSource::Trace { .. })
    }

    /// Reads the trace once and keeps it (when it holds at most
    /// [`workload::RECORD_MAX_HASHES`] hashes), so that every later [`Settings::open_workload`]
    /// replays it rather than reading it again: for commands that run the same trace many
    /// times. Only as far as these settings read (their skipped and limited requests); a
    /// malformed line there is an error now. Other workloads are drawn at each run's rate and
    /// are left as they are.
    pub fn keep_trace(&mut self) -> Result<(), WorkloadError> {
        let WorkloadSource::Trace { path, format } = &self.workload else { return Ok(()) };
        let opts = self.workload_options(1.0);
        if self.recorded.as_ref().is_some_and(|r| r.serves(path, *format, &opts, self.requests_read())) {
            return Ok(());
        }
        let trace = RecordedTrace::record(path, *format, &opts, self.requests_read(), workload::RECORD_MAX_HASHES)?;
        self.recorded = trace.map(Arc::new);
        Ok(())
    }

    /// How many of the trace's requests a run reads: its skipped ones and those it keeps.
    fn requests_read(&self) -> Option<u64> {
        self.max_requests.map(|n| n.saturating_add(self.skip_requests.unwrap_or(0)))
    }

    fn workload_options(&self, rate_scale: f64) -> WorkloadOptions {
        WorkloadOptions { block_size: self.instance.block_size, rate_scale, seed: self.seed }
    }

    /// Opens the workload afresh (each run reads the same arrivals), at `rate_scale`.
    pub fn open_workload(&self, rate_scale: f64) -> Result<Box<dyn Workload>, WorkloadError> {
        let opts = self.workload_options(rate_scale);
        let w = match &self.workload {
            WorkloadSource::Trace { path, format } => match &self.recorded {
                Some(r) if r.serves(path, *format, &opts, self.requests_read()) => Box::new(r.replay(rate_scale)),
                _ => workload::open_trace(path, *format, &opts)?,
            },
            WorkloadSource::Synthetic(cfg) => workload::synthetic(cfg, &opts)?,
            WorkloadSource::Phased(cfg) => workload::phased(cfg, &opts)?,
            WorkloadSource::Agentic(cfg) => workload::agentic(cfg, &opts)?,
        };
        let w = match self.skip_requests {
            Some(n) => workload::skip(w, n),
            None => w,
        };
        let w = match &self.classes {
            Some(c) => workload::classify(w, c, self.seed),
            None => w,
        };
        Ok(match self.max_requests {
            Some(n) => workload::limit(w, n),
            None => w,
        })
    }
}
