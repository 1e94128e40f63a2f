//! An engine's scheduling (prefill policy, KV high-water protection) as the wire and the
//! policy API carry it: checked by the simulator's scenario rules, so a live fleet accepts
//! exactly what a simulation of it would.

use crate::proto::Scheduling;
use engine::{InstanceConfig, KvProtection, PrefillPolicy};
use simulator::scenario::{ScenarioError, SchedulerSection};

/// A scheduling refused: the field as the policy API names it, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Invalid {
    pub field: &'static str,
    pub reason: String,
}

/// Checks a scheduling and resolves it to the engine's types.
pub fn resolve(s: &Scheduling) -> Result<(PrefillPolicy, Option<KvProtection>), Invalid> {
    let section = SchedulerSection {
        prefill: Some(s.prefill.clone()),
        kv_high_water: s.kv_high_water,
        kv_low_water: s.kv_low_water,
        ..SchedulerSection::default()
    };
    section.engine_scheduling().map_err(|e| match e {
        ScenarioError::Invalid { key, reason } => Invalid { field: field_name(key), reason },
        other => Invalid { field: "scheduling", reason: other.to_string() },
    })
}

/// The policy API's name of a scenario's `[scheduler]` key.
fn field_name(key: &'static str) -> &'static str {
    match key {
        "scheduler.prefill" => "prefill_scheduler",
        "scheduler.kv_high_water" => "kv_high_water",
        "scheduler.kv_low_water" => "kv_low_water",
        other => other,
    }
}

/// The scheduling an engine runs, as it reports it.
pub fn of(config: &InstanceConfig) -> Scheduling {
    let prefill = match config.prefill {
        PrefillPolicy::Fcfs => "fcfs",
        PrefillPolicy::Fair(_) => "fair",
    };
    Scheduling {
        prefill: prefill.to_string(),
        kv_high_water: config.kv_protection.map(|p| p.high_water),
        kv_low_water: config.kv_protection.map(|p| p.low_water),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheduling(prefill: &str, high: Option<f64>, low: Option<f64>) -> Scheduling {
        Scheduling { prefill: prefill.into(), kv_high_water: high, kv_low_water: low }
    }

    #[test]
    fn a_resolved_scheduling_reports_as_it_was_given() {
        for s in [scheduling("fair", Some(0.9), Some(0.6)), scheduling("fcfs", None, None)] {
            let (prefill, kv_protection) = resolve(&s).expect("valid");
            assert_eq!(of(&InstanceConfig { prefill, kv_protection, ..InstanceConfig::default() }), s);
        }
    }

    #[test]
    fn errors_name_the_policy_field() {
        let field = |s: Scheduling| resolve(&s).map(|_| ()).unwrap_err().field;
        assert_eq!(field(scheduling("lifo", None, None)), "prefill_scheduler");
        assert_eq!(field(scheduling("fcfs", Some(0.0), None)), "kv_high_water");
        assert_eq!(field(scheduling("fcfs", Some(0.5), Some(0.7))), "kv_low_water");
    }
}
