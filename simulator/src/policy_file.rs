//! Policy files: one router with its parameters, the engines' scheduling (prefill scheduler
//! and its parameters, KV water marks) and the autoscaler with its parameters, in TOML or
//! JSON (by the extension: `.json` is JSON). [`PolicyFile::overlay`] runs it in place of a
//! scenario's routers (`simulate` and `max-rate --policy FILE`); `fleetplane tune` writes them.
//!
//! ```toml
//! router = "dynamo-kv"
//! router_params = { overlap_score_weight = 1.5 }
//! prefill_scheduler = "fair"
//! prefill_params = { chunk_tokens = 4096 }
//! kv_high_water = 0.9
//! kv_low_water = 0.7
//! max_batch_tokens = 2048                       # the engines' token budget of one step
//! autoscaler = "slo-load"
//! autoscaler_params = { up_load = 0.85 }
//! flow = "slo"                                  # flow control at the controller
//! flow_params = { batch_headroom = 0.6 }
//! class_priority = true                         # engines admit by class [default: with slo]
//! class_slo = { interactive = { ttft_ms = 500, tpot_ms = 50 } }
//! ```
//!
//! Only `router` is required; a key left out keeps the scenario's setting (on a live fleet:
//! FCFS, no high-water mark, `serve --autoscaler`). The live policy API (`PUT /api/policies`)
//! stores this type, so a live policy's JSON is a policy file and a policy file a live policy.
//! Every value is checked where the scenario's own settings are
//! ([`Scenario::resolve`]), by the policy types' one validator ([`policies::Params`]).

use crate::scenario::flow::{FlowEntry, FlowRun, FlowSection};
use crate::scenario::{
    autoscaler_with_params, router_with_params, set_autoscaler_params, step_budget, FleetSection, PoolsSection,
    RouterEntry, RunSpec, Scenario, ScenarioError, SchedulerSection,
};
use crate::slo::Slo;
use engine::{Class, Dur, FairPrefill, InstanceConfig, PrefillPolicy};
use policies::params::changed;
use policies::{AutoscalerConfig, Knobs, Params, RouterConfig};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyFile {
    pub router: String,
    /// The router's parameters by name, over its defaults.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub router_params: BTreeMap<String, f64>,
    /// `fcfs` or `fair`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_scheduler: Option<String>,
    /// Fair prefill's parameters by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prefill_params: BTreeMap<String, f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_high_water: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_low_water: Option<f64>,
    /// The engines' token budget of one step, decode tokens plus prefill chunks (vLLM's
    /// `--max-num-batched-tokens`, SGLang's `--chunked-prefill-size`): smaller, the decodes
    /// beside a long prompt's chunks wait less a step; larger, prompts take fewer steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_tokens: Option<u32>,
    /// A P/D fleet's autoscaler (the scenario's `[pools] autoscaler`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaler: Option<String>,
    /// Its hysteresis knobs by name (durations in seconds).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub autoscaler_params: BTreeMap<String, f64>,
    /// Flow control at the controller: `none`, `slo` or `llm-d` (see [`policies::flow`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow: Option<String>,
    /// The flow rule's parameters by name (durations in seconds).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub flow_params: BTreeMap<String, f64>,
    /// Whether engines admit and preempt by class [default: on with `slo`, off otherwise].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class_priority: Option<bool>,
    /// Targets of the classes that do not take the fleet's SLO (`interactive`, `batch`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub class_slo: BTreeMap<Class, Slo>,
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyFileError {
    #[error("reading policy {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("parsing policy {path}: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("policy {path}: {source}")]
    Invalid { path: PathBuf, source: Box<ScenarioError> },
}

impl PolicyFile {
    /// Reads a policy file (JSON if its name ends in `.json`, TOML otherwise) and checks it.
    pub fn load(path: &Path) -> Result<PolicyFile, PolicyFileError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| PolicyFileError::Read { path: path.into(), source })?;
        let parsed = if path.extension().is_some_and(|e| e == "json") {
            serde_json::from_str(&text).map_err(|e| e.to_string())
        } else {
            toml::from_str(&text).map_err(|e| e.to_string())
        };
        let policy: PolicyFile = parsed.map_err(|reason| PolicyFileError::Parse { path: path.into(), reason })?;
        policy.check().map_err(|source| PolicyFileError::Invalid { path: path.into(), source: Box::new(source) })?;
        Ok(policy)
    }

    /// The policy as TOML, the form [`PolicyFile::load`] reads.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a policy file's fields are all TOML values")
    }

    /// A policy of `router` as configured (its parameters that differ from the defaults).
    pub fn of_router(router: &RouterConfig) -> PolicyFile {
        PolicyFile { router: router.name().to_string(), router_params: router.changed(), ..PolicyFile::default() }
    }

    /// The policy `run` runs: its router's parameters that differ from the defaults, its
    /// prefill scheduler (fair prefill's changed parameters), its KV water marks, and a P/D
    /// fleet's autoscaler with the knobs that differ from those for its start-up time.
    pub fn of_run(run: &RunSpec) -> PolicyFile {
        let (prefill_scheduler, prefill_params) = match &run.prefill {
            PrefillPolicy::Fcfs => (None, BTreeMap::new()),
            PrefillPolicy::Fair(f) => (Some("fair".to_string()), changed(f.values(), &FairPrefill::default().values())),
        };
        let pd = run.pools.as_ref().and_then(|p| p.pd.as_ref());
        let autoscaler_params = pd
            .and_then(|pd| Some(changed(pd.autoscaler.knobs()?.values(), &Knobs::for_startup(pd.startup).values())))
            .unwrap_or_default();
        PolicyFile {
            prefill_scheduler,
            prefill_params,
            kv_high_water: run.kv_protection.map(|k| k.high_water),
            kv_low_water: run.kv_protection.map(|k| k.low_water),
            max_batch_tokens: (run.max_batch_tokens != InstanceConfig::default().max_batch_tokens)
                .then_some(run.max_batch_tokens),
            autoscaler: pd.map(|pd| pd.autoscaler.name().to_string()),
            autoscaler_params,
            ..PolicyFile::of_router(&run.router)
        }
    }

    /// The policy with `run`'s flow control: its rule, the parameters that differ from the
    /// rule's defaults, the engines' holds of sessions' KV and their class priority.
    pub fn with_flow_of(self, run: &RunSpec) -> PolicyFile {
        let f = &run.flow;
        let mut flow_params = f.flow.changed();
        if let Some(h) = f.program_hold {
            flow_params.insert("program_hold_s".into(), h.max_pause.as_secs_f64());
            flow_params.insert("program_hold_share".into(), h.share);
            if let Some(p) = h.prefetch {
                flow_params.insert("program_prefetch_s".into(), p.as_secs_f64());
            }
        }
        PolicyFile {
            flow: Some(f.flow.name().to_string()),
            flow_params,
            class_priority: Some(f.class_priority),
            ..self
        }
    }

    /// Checks every setting, each by its one validator: the router and its parameters, the
    /// scheduling (as an engine takes it) and fair prefill's parameters, the autoscaler and its
    /// parameters.
    pub fn check(&self) -> Result<(), ScenarioError> {
        self.router_config()?;
        self.scheduler()?.engine_scheduling()?;
        step_budget("max_batch_tokens", self.max_batch_tokens)?;
        if let Some(name) = &self.autoscaler {
            autoscaler_with_params(name, Dur::ZERO, (1, 1), &self.autoscaler_params, "autoscaler_params")?;
        }
        self.flow_run()?;
        self.check_class_slo()
    }

    /// Checks the classes' own targets (each above 0 and at most [`Slo::MAX_MS`]).
    pub fn check_class_slo(&self) -> Result<(), ScenarioError> {
        for (class, slo) in &self.class_slo {
            if let Some((what, v)) = slo.out_of_range() {
                let reason = format!("{class}'s {what} is {v}, not milliseconds above 0 and at most {}", Slo::MAX_MS);
                return Err(ScenarioError::Invalid { key: "class_slo", reason });
            }
        }
        Ok(())
    }

    /// The `[flow]` entry the policy gives (`None`: the scenario's, or none live).
    fn flow_entry(&self) -> Option<FlowEntry> {
        let name = self.flow.as_ref()?;
        let mut table: BTreeMap<String, toml::Value> =
            self.flow_params.iter().map(|(k, v)| (k.clone(), toml::Value::Float(*v))).collect();
        table.insert("name".into(), toml::Value::String(name.clone()));
        if let Some(on) = self.class_priority {
            table.insert("class_priority".into(), toml::Value::Boolean(on));
        }
        Some(FlowEntry::Table(table))
    }

    /// The flow control the policy gives, checked (none when it names no rule).
    pub fn flow_run(&self) -> Result<FlowRun, ScenarioError> {
        let rules = self.flow_entry().map(|e| vec![e]);
        let mut runs = FlowSection { rules }.resolve_runs()?;
        Ok(runs.remove(0))
    }

    /// The router with the policy's parameters.
    pub fn router_config(&self) -> Result<RouterConfig, ScenarioError> {
        router_with_params(&self.router, &self.router_params, "router_params")
    }

    /// `autoscaler` (a fleet's, as its own settings make it) with the policy's parameters over
    /// it.
    pub fn autoscaler_over(&self, autoscaler: AutoscalerConfig) -> Result<AutoscalerConfig, ScenarioError> {
        set_autoscaler_params(autoscaler, &self.autoscaler_params, "autoscaler_params")
    }

    /// The `[scheduler]` settings the policy gives (fair prefill's parameters checked).
    pub fn scheduler(&self) -> Result<SchedulerSection, ScenarioError> {
        let mut fair = FairPrefill::default();
        for (name, v) in &self.prefill_params {
            fair.set(name, *v).map_err(|e| ScenarioError::Param { key: "prefill_params", source: e })?;
        }
        let given = |name: &str| self.prefill_params.contains_key(name);
        Ok(SchedulerSection {
            prefill: self.prefill_scheduler.clone(),
            chunk_tokens: given("chunk_tokens").then_some(fair.chunk_tokens),
            quota_kv_share: given("quota_kv_share").then_some(fair.quota_kv_share),
            quota_growth: given("quota_growth").then_some(fair.quota_growth),
            long_min_tokens: given("long_min_tokens").then_some(fair.long_min_tokens),
            kv_high_water: self.kv_high_water,
            kv_low_water: self.kv_low_water,
            ..SchedulerSection::default()
        })
    }

    /// `scenario` running this policy: its routers replaced by this router, and the
    /// scheduling and autoscaler settings the policy gives laid over the scenario's.
    pub fn overlay(&self, scenario: Scenario) -> Result<Scenario, ScenarioError> {
        let pools = PoolsSection {
            autoscaler: self.autoscaler.clone(),
            autoscaler_params: (!self.autoscaler_params.is_empty()).then(|| self.autoscaler_params.clone()),
            ..PoolsSection::default()
        };
        let mut scenario = scenario;
        if let Some(classes) = scenario.workload.classes.as_mut() {
            for c in &mut classes.mix {
                if let Some(slo) = self.class_slo.get(&c.class) {
                    (c.ttft_ms, c.tpot_ms) = (Some(slo.ttft_ms), Some(slo.tpot_ms));
                }
            }
        }
        let over = Scenario {
            routers: Some(vec![RouterEntry::with_params(&self.router, &self.router_params)]),
            scheduler: self.scheduler()?,
            fleet: FleetSection { max_batch_tokens: self.max_batch_tokens, ..FleetSection::default() },
            pools,
            flow: FlowSection { rules: self.flow_entry().map(|e| vec![e]) },
            ..Scenario::default()
        };
        Ok(scenario.overlay(over))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> PolicyFile {
        PolicyFile {
            router: "cache-aware".into(),
            router_params: [("copy_weight".to_string(), 2.5), ("hot_slack".to_string(), 4.0)].into(),
            prefill_scheduler: Some("fair".into()),
            prefill_params: [("chunk_tokens".to_string(), 4096.0)].into(),
            kv_high_water: Some(0.9),
            kv_low_water: Some(0.7),
            max_batch_tokens: Some(2048),
            autoscaler: Some("slo-load".into()),
            autoscaler_params: [("up_load".to_string(), 0.85)].into(),
            flow: Some("slo".into()),
            flow_params: [("batch_headroom".to_string(), 0.6)].into(),
            class_priority: Some(true),
            class_slo: [(Class::Interactive, Slo { ttft_ms: 500.0, tpot_ms: 50.0 })].into(),
        }
    }

    #[test]
    fn a_policy_file_round_trips_through_toml_and_json() {
        let dir = std::env::temp_dir().join(format!("fp-policy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let p = policy();
        let toml_path = dir.join("p.toml");
        std::fs::write(&toml_path, p.to_toml()).expect("write");
        assert_eq!(PolicyFile::load(&toml_path).expect("reads"), p);
        let json_path = dir.join("p.json");
        std::fs::write(&json_path, serde_json::to_string(&p).expect("json")).expect("write");
        assert_eq!(PolicyFile::load(&json_path).expect("reads"), p);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_policy_replaces_the_scenarios_routers_with_its_router_and_parameters() {
        let base = Scenario { routers: Some(vec!["round-robin".into(), "llm-d".into()]), ..Scenario::default() };
        let s = policy().overlay(base).expect("valid");
        let (name, params) = s.routers.as_ref().expect("routers")[0].parts().expect("entry");
        assert_eq!((name, params), ("cache-aware", policy().router_params));
        assert_eq!(s.routers.as_ref().map(Vec::len), Some(1));
        assert_eq!(s.scheduler.chunk_tokens, Some(4096));
        assert_eq!(s.fleet.max_batch_tokens, Some(2048));
        let colocated = PolicyFile { autoscaler: None, autoscaler_params: BTreeMap::new(), ..policy() };
        let workload = "[workload.synthetic]\nrequests = 10\narrival = { kind = \"poisson\", rate_rps = 1.0 }\n\
                        input = { kind = \"constant\", tokens = 100 }\noutput = { kind = \"constant\", tokens = 10 }";
        let base: Scenario = toml::from_str(workload).expect("parses");
        let runs = colocated.overlay(base).and_then(|s| s.resolve()).expect("resolves").routers;
        assert_eq!(runs[0].max_batch_tokens, 2048, "the policy's budget is the run's");
        assert_eq!(s.pools.autoscaler_params, Some(policy().autoscaler_params));
    }

    #[test]
    fn each_invalid_setting_of_a_policy_names_its_parameter() {
        let check = |p: PolicyFile| p.check().unwrap_err().to_string();
        let mut p = policy();
        p.router_params.insert("own_weight".into(), -1.0);
        assert_eq!(
            check(p),
            "invalid setting `router_params.own_weight`: cache-aware's `own_weight` is -1, outside its range [0, 16]"
        );
        let p = PolicyFile { prefill_params: [("chunk_tokens".to_string(), 0.5)].into(), ..policy() };
        assert!(check(p).starts_with("invalid setting `prefill_params.chunk_tokens`"));
        let p = PolicyFile { autoscaler_params: [("up".to_string(), 1.0)].into(), ..policy() };
        assert!(check(p).starts_with("invalid setting `autoscaler_params.up`: autoscaler has no parameter `up`"));
        let p = PolicyFile { max_batch_tokens: Some(0), ..policy() };
        assert_eq!(check(p), "invalid setting `max_batch_tokens`: must be at least 1");
        let p = PolicyFile { kv_high_water: Some(1.5), ..policy() };
        assert_eq!(check(p), "invalid setting `scheduler.kv_high_water`: 1.5 is not a share in (0, 1]");
        assert!(check(PolicyFile { router: "magic".into(), ..PolicyFile::default() }).starts_with("unknown router"));
    }
}
