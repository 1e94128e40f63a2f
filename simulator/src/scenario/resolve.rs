//! Resolving a scenario: flags over the file, defaults, and every setting checked once.

use super::pools::PoolsRun;
use super::settings::{RunSpec, Settings, WorkloadSource, NO_SPEC_VARIANT};
use super::tiers::{KvSection, KvTiers};
use super::{
    invalid, router_with_params, step_budget, FleetSection, RouterEntry, Scenario, ScenarioError, SchedulerSection,
    SloSection, WorkloadSection, DEFAULT_GPU, DEFAULT_INSTANCES, DEFAULT_MODEL, DEFAULT_SEED, DEFAULT_TPOT_SLO_MS,
    DEFAULT_TTFT_SLO_MS,
};
use crate::slo::Slo;
use crate::workload::TraceFormat;
use cost::{
    calibrated_cost, drafter_by_name, drafter_names, drafter_or_none, gpu_by_name, model_by_name, CostModel,
    Deployment, Drafter, NO_SPECULATION,
};
use engine::{Dur, InstanceConfig, KvProtection, PrefillPolicy};
use std::path::Path;

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
    pub fn overlay(mut self, over: Scenario) -> Scenario {
        let f = over.fleet;
        let w = over.workload;
        // A trace given on top replaces a synthetic workload below, and the other way round.
        let replaces_source = w.trace.is_some() || w.synthetic.is_some() || w.phased.is_some() || w.agentic.is_some();
        let (trace, synthetic, phased, agentic, format) = if replaces_source {
            (w.trace, w.synthetic, w.phased, w.agentic, w.format)
        } else {
            let o = &mut self.workload;
            (o.trace.take(), o.synthetic.take(), o.phased.take(), o.agentic.take(), w.format.or(o.format.take()))
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
                agentic,
                classes: w.classes.or(self.workload.classes),
                max_tokens: w.max_tokens.or(self.workload.max_tokens),
            },
            slo: SloSection {
                ttft_ms: over.slo.ttft_ms.or(self.slo.ttft_ms),
                tpot_ms: over.slo.tpot_ms.or(self.slo.tpot_ms),
            },
            kv: self.kv.overlay(over.kv),
            scheduler: self.scheduler.overlay(over.scheduler),
            cost: over.cost.or(self.cost),
            pools: self.pools.overlay(over.pools),
            flow: self.flow.overlay(over.flow),
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
        let max_batch_tokens =
            step_budget("fleet.max_batch_tokens", f.max_batch_tokens)?.unwrap_or(defaults.max_batch_tokens);
        let max_seqs = f.max_seqs.unwrap_or(defaults.max_seqs);
        if max_seqs == 0 {
            return Err(invalid("fleet.max_seqs", "must be at least 1"));
        }
        let tiers = self.kv.resolve(&cost, block_size)?;
        let prefill = self.scheduler.resolve()?;
        let (protection, protection_on) = self.scheduler.resolve_protection()?;
        let kv_protection = protection_on.then_some(protection);
        let pool_runs = self.pools.resolve_runs(instances, cost.gpus())?;
        let flow_runs = self.flow.resolve_runs()?;
        let base = RunBase { tiers, prefill, protection, kv_protection, max_batch_tokens, drafter };
        let mut routers = Vec::with_capacity(names.len() * pool_runs.len() * flow_runs.len());
        for entry in &names {
            for flow in &flow_runs {
                let specs = self.run_specs(entry, &base, &cost, block_size, &pool_runs)?;
                routers.extend(specs.into_iter().map(|spec| RunSpec { flow: flow.clone(), ..spec }));
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
            offload_chunk_blocks: tiers.chunk_blocks,
            prefill,
            kv_protection,
            class_priority: false,
            lower_class_step_tokens: None,
            program_hold: None,
        };
        let w = &self.workload;
        let workload = w.source()?;
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
        if matches!(workload, WorkloadSource::Agentic(_)) && w.skip_requests.is_some() {
            let reason = "a closed-loop agentic workload has no slices: its turns depend on the run";
            return Err(invalid("workload.skip_requests", reason));
        }
        let slo = self.slo.resolve()?;
        let classes = match &w.classes {
            Some(c) => {
                c.validate()?;
                Some(c.clone())
            }
            None => None,
        };
        Ok(Settings {
            classes,
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
            max_tokens: w.max_tokens.unwrap_or_default(),
            recorded: None,
        })
    }

    /// One entry of `routers`: its router with parameters and its variant (`name@l1+fair`)
    /// over the scenario's fleet, once per pools run.
    fn run_specs(
        &self,
        entry: &RouterEntry,
        base: &RunBase,
        cost: &CostModel,
        block_size: u32,
        pool_runs: &[Option<PoolsRun>],
    ) -> Result<Vec<RunSpec>, ScenarioError> {
        let (spec, params) = entry.parts()?;
        let (name, variant) = match spec.trim().split_once('@') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (spec.trim(), None),
        };
        let router = router_with_params(name, &params, "routers")?;
        let (mut run_tiers, mut run_prefill, mut run_protection) = (base.tiers, base.prefill, base.kv_protection);
        let (mut run_drafter, mut run_budget) = (base.drafter, base.max_batch_tokens);
        if let Some(v) = &variant {
            let parts: Vec<&str> = v.split('+').map(str::trim).collect();
            let variants: Vec<&str> = ["l1", "l2", "l3", "fcfs", "fair", "hw", "nohw", NO_SPEC_VARIANT]
                .into_iter()
                .chain(drafter_names())
                .collect();
            if let Some(unknown) = parts.iter().find(|p| !variants.contains(p) && budget_variant(p).is_none()) {
                let reason = format!(
                    "unknown variant `{unknown}` in `{spec}` (valid: {}, or bN for a step budget of N tokens)",
                    variants.join(", ")
                );
                return Err(invalid("routers", reason));
            }
            let (budgets, parts): (Vec<&str>, Vec<&str>) = parts.into_iter().partition(|p| budget_variant(p).is_some());
            match budgets[..] {
                [] => {}
                [b] => {
                    let checked = step_budget("routers", budget_variant(b))
                        .map_err(|_| invalid("routers", format!("`{spec}`: a step budget is at least 1 token")))?;
                    run_budget = checked.unwrap_or(run_budget);
                }
                _ => return Err(invalid("routers", format!("`{spec}` names two step budgets"))),
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
                ["hw"] => run_protection = Some(base.protection),
                ["nohw"] => run_protection = None,
                _ => return Err(invalid("routers", format!("`{spec}` names hw or nohw twice"))),
            }
            if let Some(&s) = scheduler.first() {
                let section = SchedulerSection { prefill: Some(s.to_string()), ..self.scheduler.clone() };
                run_prefill = section.resolve()?;
            }
            if !tier_names.is_empty() {
                let section = KvSection { tiers: Some(tier_names.join(",")), ..self.kv.clone() };
                run_tiers = section.resolve(cost, block_size)?;
            }
        }
        let specs = pool_runs.iter().map(|pools| RunSpec {
            router,
            variant: variant.clone(),
            tiers: run_tiers,
            prefill: run_prefill,
            kv_protection: run_protection,
            max_batch_tokens: run_budget,
            pools: pools.clone(),
            drafter: run_drafter,
            flow: Default::default(),
        });
        Ok(specs.collect())
    }
}

/// The step budget a run variant `bN` gives (`b2048`: 2,048 tokens a step), if `part` is one.
fn budget_variant(part: &str) -> Option<u32> {
    part.strip_prefix('b').filter(|n| n.bytes().all(|c| c.is_ascii_digit())).and_then(|n| n.parse().ok())
}

/// What a run inherits from the scenario, before its variant changes it.
struct RunBase {
    tiers: KvTiers,
    prefill: PrefillPolicy,
    /// The protection's settings, and whether it is on.
    protection: KvProtection,
    kv_protection: Option<KvProtection>,
    max_batch_tokens: u32,
    drafter: Option<&'static Drafter>,
}

impl WorkloadSection {
    /// Where the requests come from: one of a trace, a synthetic generator and phases.
    fn source(&self) -> Result<WorkloadSource, ScenarioError> {
        if let Some(cfg) = &self.agentic {
            if self.trace.is_some() || self.synthetic.is_some() || self.phased.is_some() {
                return Err(invalid(
                    "workload",
                    "give one of `trace`, `synthetic`, `phased` and `agentic`, not several",
                ));
            }
            cfg.validate()?;
            return Ok(WorkloadSource::Agentic(Box::new(cfg.clone())));
        }
        Ok(match (&self.trace, &self.synthetic, &self.phased) {
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
                let format = match &self.format {
                    Some(name) => name.parse::<TraceFormat>()?,
                    None => TraceFormat::guess(path).ok_or_else(|| {
                        invalid("workload.format", format!("cannot tell the format of {}; name it", path.display()))
                    })?,
                };
                WorkloadSource::Trace { path: path.clone(), format }
            }
            (None, Some(cfg), None) => WorkloadSource::Synthetic(Box::new(cfg.clone())),
        })
    }
}

impl SloSection {
    fn resolve(&self) -> Result<Slo, ScenarioError> {
        let slo = Slo {
            ttft_ms: self.ttft_ms.unwrap_or(DEFAULT_TTFT_SLO_MS),
            tpot_ms: self.tpot_ms.unwrap_or(DEFAULT_TPOT_SLO_MS),
        };
        for (key, v) in [("slo.ttft_ms", slo.ttft_ms), ("slo.tpot_ms", slo.tpot_ms)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(key, format!("{v} is not a positive number of milliseconds")));
            }
        }
        Ok(slo)
    }
}
