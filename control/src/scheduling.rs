//! An engine's scheduling (prefill policy and fair prefill's parameters, KV high-water
//! protection) as the wire and the policy API carry it: checked by the simulator's scenario
//! rules, so a live fleet accepts exactly what a simulation of it would; and the one mapping
//! of those rules' errors to the policy API's field names.

use crate::proto::Scheduling;
use engine::{InstanceConfig, KvProtection, PrefillPolicy, ProgramHold};
use policies::Params;
use simulator::scenario::{ScenarioError, SchedulerSection};
use std::collections::BTreeMap;

/// A setting refused: the field as the policy API names it (`kv_high_water`,
/// `router_params.copy_weight`), and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Invalid {
    pub field: String,
    pub reason: String,
}

impl Invalid {
    /// A scenario rule's error with the policy API's name of its setting; a parameter's names
    /// its range.
    pub fn of(e: ScenarioError) -> Invalid {
        let (field, reason) = match e {
            ScenarioError::Invalid { key, reason } => (field_name(key).to_string(), reason),
            ScenarioError::Param { key, source } => {
                (format!("{}.{}", field_name(key), source.param()), source.to_string())
            }
            ScenarioError::UnknownRouter(e) => ("router".to_string(), e.to_string()),
            ScenarioError::UnknownAutoscaler(e) => ("autoscaler".to_string(), e.to_string()),
            other => ("policy".to_string(), other.to_string()),
        };
        Invalid { field, reason }
    }
}

/// The policy API's name of a scenario's key.
fn field_name(key: &'static str) -> &'static str {
    match key {
        "scheduler.prefill" => "prefill_scheduler",
        "scheduler.kv_high_water" => "kv_high_water",
        "scheduler.kv_low_water" => "kv_low_water",
        // Fair prefill's knobs as a wire scheduling carries them.
        "scheduler" => "prefill_params",
        // A policy gives the holds of sessions' KV among its flow rule's parameters.
        "program_hold_s" => "flow_params.program_hold_s",
        "program_hold_share" => "flow_params.program_hold_share",
        "program_prefetch_s" => "flow_params.program_prefetch_s",
        other => other,
    }
}

/// A scheduling's class priority: whether it is on, and the cap on lower classes' prompt
/// tokens per step while an interactive request decodes (see
/// [`InstanceConfig::class_priority`]). A cap without priority is refused.
pub fn class_priority(s: &Scheduling) -> Result<(bool, Option<u32>), Invalid> {
    let on = s.class_priority.unwrap_or(false);
    match s.lower_class_step_tokens {
        Some(_) if !on => Err(Invalid {
            field: "lower_class_step_tokens".into(),
            reason: "caps lower classes only with class_priority on".into(),
        }),
        Some(0) => Err(Invalid { field: "lower_class_step_tokens".into(), reason: "must be at least 1".into() }),
        cap => Ok((on, cap)),
    }
}

/// A scheduling's step budget (`None`: the engine's own), checked as a policy's is.
pub fn max_batch_tokens(s: &Scheduling) -> Result<Option<u32>, Invalid> {
    simulator::scenario::step_budget("max_batch_tokens", s.max_batch_tokens).map_err(Invalid::of)
}

/// The step budget an engine started with `own` runs at when asked for `asked`: its own when
/// none is asked, never more (its buffers are sized for it).
pub fn budget_in_force(asked: Option<u32>, own: u32) -> u32 {
    asked.map_or(own, |b| b.min(own))
}

/// A scheduling's holds of sessions' KV (see [`engine::programs`]), checked as a flow rule's
/// are.
pub fn program_hold(s: &Scheduling) -> Result<Option<ProgramHold>, Invalid> {
    simulator::scenario::program_hold(s.program_hold_s, s.program_hold_share, s.program_prefetch_s).map_err(Invalid::of)
}

/// `scheduling` with the fields of `hold` (`program_hold_s`, `program_hold_share`,
/// `program_prefetch_s`).
pub fn with_program_hold(scheduling: Scheduling, hold: Option<ProgramHold>) -> Scheduling {
    Scheduling {
        program_hold_s: hold.map(|h| h.max_pause.as_secs_f64()),
        program_hold_share: hold.map(|h| h.share),
        program_prefetch_s: hold.and_then(|h| h.prefetch).map(|p| p.as_secs_f64()),
        ..scheduling
    }
}

/// Checks a scheduling and resolves it to the engine's types.
pub fn resolve(s: &Scheduling) -> Result<(PrefillPolicy, Option<KvProtection>), Invalid> {
    let section = SchedulerSection {
        prefill: Some(s.prefill.clone()),
        chunk_tokens: s.chunk_tokens,
        quota_kv_share: s.quota_kv_share,
        quota_growth: s.quota_growth,
        long_min_tokens: s.long_min_tokens,
        kv_high_water: s.kv_high_water,
        kv_low_water: s.kv_low_water,
        ..SchedulerSection::default()
    };
    section.engine_scheduling().map_err(Invalid::of)
}

/// The scheduling of resolved engine settings, every value explicit (fair prefill's
/// parameters, the low-water mark), so that an engine resolves it to the same settings.
pub fn wire(prefill: &PrefillPolicy, kv_protection: Option<KvProtection>) -> Scheduling {
    let (name, fair) = match prefill {
        PrefillPolicy::Fcfs => ("fcfs", None),
        PrefillPolicy::Fair(f) => ("fair", Some(f)),
    };
    Scheduling {
        prefill: name.to_string(),
        kv_high_water: kv_protection.map(|p| p.high_water),
        kv_low_water: kv_protection.map(|p| p.low_water),
        chunk_tokens: fair.map(|f| f.chunk_tokens),
        quota_kv_share: fair.map(|f| f.quota_kv_share),
        quota_growth: fair.map(|f| f.quota_growth),
        long_min_tokens: fair.map(|f| f.long_min_tokens),
        class_priority: None,
        lower_class_step_tokens: None,
        program_hold_s: None,
        program_hold_share: None,
        program_prefetch_s: None,
        max_batch_tokens: None,
    }
}

/// The scheduling an engine runs, as it reports it (its step budget always).
pub fn of(config: &InstanceConfig) -> Scheduling {
    let scheduling = Scheduling {
        class_priority: config.class_priority.then_some(true),
        max_batch_tokens: Some(config.max_batch_tokens),
        lower_class_step_tokens: config.lower_class_step_tokens.filter(|_| config.class_priority),
        ..wire(&config.prefill, config.kv_protection)
    };
    with_program_hold(scheduling, config.program_hold)
}

/// Fair prefill's parameters of a scheduling by name, as policies write them (none under
/// FCFS, or for a scheduling this build cannot read).
pub fn prefill_params(s: &Scheduling) -> BTreeMap<String, f64> {
    match resolve(s) {
        Ok((PrefillPolicy::Fair(fair), _)) => fair.values(),
        _ => BTreeMap::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheduling(prefill: &str, high: Option<f64>, low: Option<f64>) -> Scheduling {
        Scheduling { prefill: prefill.into(), kv_high_water: high, kv_low_water: low, ..Scheduling::default() }
    }

    #[test]
    fn a_resolved_scheduling_reports_as_it_was_given() {
        let fair = Scheduling {
            chunk_tokens: Some(4096),
            quota_kv_share: Some(0.05),
            quota_growth: Some(3.0),
            long_min_tokens: Some(512),
            ..scheduling("fair", Some(0.9), Some(0.6))
        };
        let budget = Some(InstanceConfig::default().max_batch_tokens);
        let fair = Scheduling { max_batch_tokens: budget, ..fair };
        for s in [fair, Scheduling { max_batch_tokens: budget, ..scheduling("fcfs", None, None) }] {
            let (prefill, kv_protection) = resolve(&s).expect("valid");
            assert_eq!(of(&InstanceConfig { prefill, kv_protection, ..InstanceConfig::default() }), s);
        }
    }

    #[test]
    fn fair_prefills_parameters_reach_the_engines_scheduler() {
        let s = Scheduling { chunk_tokens: Some(2048), ..scheduling("fair", None, None) };
        let Ok((PrefillPolicy::Fair(fair), None)) = resolve(&s) else { panic!("fair, no protection") };
        assert_eq!(fair, engine::FairPrefill { chunk_tokens: 2048, ..engine::FairPrefill::default() });
        assert_eq!(prefill_params(&s)["chunk_tokens"], 2048.0);
        assert_eq!(prefill_params(&s).len(), 4, "the defaults of the others");
        assert!(prefill_params(&scheduling("fcfs", None, None)).is_empty());
    }

    #[test]
    fn errors_name_the_policy_field() {
        let field = |s: Scheduling| resolve(&s).map(|_| ()).unwrap_err().field;
        assert_eq!(field(scheduling("lifo", None, None)), "prefill_scheduler");
        assert_eq!(field(scheduling("fcfs", Some(0.0), None)), "kv_high_water");
        assert_eq!(field(scheduling("fcfs", Some(0.5), Some(0.7))), "kv_low_water");
        let e = resolve(&Scheduling { quota_growth: Some(0.5), ..scheduling("fair", None, None) }).unwrap_err();
        assert_eq!(e.field, "prefill_params.quota_growth");
        assert_eq!(e.reason, "fair's `quota_growth` is 0.5, outside its range [1, 16]");
    }
}
