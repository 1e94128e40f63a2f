//! The policy set an operator edits through the API: the router, the engines' scheduling
//! (prefill scheduler, KV high- and low-water marks) and the autoscaler of a P/D fleet.
//! Versions are stored as JSON; a version stored before a field existed loads with that
//! field's default, so old `{router}` versions still load and roll back.

use super::gateway::ApiError;
use super::pools::PoolArgs;
use crate::proto::Scheduling;
use policies::{AutoscalerConfig, RouterConfig};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One version of the policy set, as stored and as the API takes it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    pub router: String,
    /// How every engine shares prefill: `fcfs` or `fair`.
    #[serde(default = "fcfs")]
    pub prefill_scheduler: String,
    /// Share of KV blocks in use at which engines pause admission; `None`: protection off.
    #[serde(default)]
    pub kv_high_water: Option<f64>,
    /// Share at which they resume; `None`: 80% of the high-water mark.
    #[serde(default)]
    pub kv_low_water: Option<f64>,
    /// The autoscaler of a P/D fleet; `None`: the one `serve --autoscaler` names.
    #[serde(default)]
    pub autoscaler: Option<String>,
}

fn fcfs() -> String {
    "fcfs".to_string()
}

/// A checked policy, resolved to what the controller and the engines take.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySet {
    pub router: RouterConfig,
    pub scheduling: Scheduling,
    /// `None` for a colocated fleet, which has no autoscaler.
    pub autoscaler: Option<AutoscalerConfig>,
}

/// The prefill schedulers an editor may offer.
pub const PREFILL_SCHEDULERS: [&str; 2] = ["fcfs", "fair"];

impl Policy {
    /// The policy a fleet runs before any version is stored: the command line's router, and
    /// the engines' own scheduling (they start FCFS without protection).
    pub fn command_line(router: &str) -> Policy {
        Policy {
            router: router.to_string(),
            prefill_scheduler: fcfs(),
            kv_high_water: None,
            kv_low_water: None,
            autoscaler: None,
        }
    }

    /// Checks every field against the simulator's rules for the same knobs; the error names
    /// the field (the API's `param`) and the valid values. `pools`: the fleet's pool flags,
    /// `None` for a colocated fleet.
    pub fn validate(&self, pools: Option<&PoolArgs>) -> Result<PolicySet, ApiError> {
        let router = self.router.parse::<RouterConfig>().map_err(|e| ApiError::invalid("router", e.to_string()))?;
        let scheduling = Scheduling {
            prefill: self.prefill_scheduler.clone(),
            kv_high_water: self.kv_high_water,
            kv_low_water: self.kv_low_water,
        };
        crate::scheduling::resolve(&scheduling).map_err(|e| ApiError::invalid(e.field, e.reason))?;
        let autoscaler = match (pools, self.autoscaler.as_deref()) {
            (None, None | Some("none")) => None,
            (None, Some(other)) => {
                return Err(ApiError::invalid(
                    "autoscaler",
                    format!(
                    "autoscaler `{other}` sizes the pools of serve --mode pd; this fleet is colocated (valid: none)"
                ),
                ))
            }
            (Some(p), name) => Some(
                p.autoscaler(name.unwrap_or(&p.autoscaler))
                    .map_err(|e| ApiError::invalid("autoscaler", e.to_string()))?,
            ),
        };
        Ok(PolicySet { router, scheduling, autoscaler })
    }

    /// A stored version (validated when stored, but a newer build may know other names).
    pub fn stored(stored: Value, pools: Option<&PoolArgs>) -> Result<PolicySet, String> {
        let policy: Policy = serde_json::from_value(stored).map_err(|e| e.to_string())?;
        policy.validate(pools).map_err(|e| e.message().to_string())
    }

    /// A stored version with every field present (defaults filled in), for the API; one the
    /// build cannot read is shown as stored.
    pub fn normalized(stored: Value) -> Value {
        match serde_json::from_value::<Policy>(stored.clone()) {
            Ok(p) => serde_json::to_value(p).unwrap_or(stored),
            Err(_) => stored,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn error(policy: Value) -> (Option<String>, String) {
        let p: Policy = serde_json::from_value(policy).expect("parses");
        let e = p.validate(None).unwrap_err();
        (e.param().map(str::to_string), e.message().to_string())
    }

    #[test]
    fn a_version_stored_as_a_router_alone_loads_with_the_defaults() {
        let p: Policy = serde_json::from_value(json!({"router": "power-of-two"})).expect("parses");
        assert_eq!(p, Policy::command_line("power-of-two"));
        let set = p.validate(None).expect("valid");
        assert_eq!(set.scheduling, Scheduling { prefill: "fcfs".into(), kv_high_water: None, kv_low_water: None });
        assert_eq!(set.autoscaler, None);
    }

    #[test]
    fn each_invalid_field_is_named_with_the_valid_values() {
        let (param, message) = error(json!({"router": "magic"}));
        assert_eq!(param, Some("router".into()));
        assert!(message.contains("valid:"), "{message}");
        assert_eq!(
            error(json!({"router": "round-robin", "prefill_scheduler": "lifo"})),
            (Some("prefill_scheduler".into()), "unknown prefill scheduler `lifo` (valid: fcfs, fair)".into())
        );
        assert_eq!(
            error(json!({"router": "round-robin", "kv_high_water": 1.2})),
            (Some("kv_high_water".into()), "1.2 is not a share in (0, 1]".into())
        );
        assert_eq!(
            error(json!({"router": "round-robin", "kv_high_water": 0.5, "kv_low_water": 0.6})),
            (Some("kv_low_water".into()), "0.6 is not a share in (0, kv_high_water = 0.5)".into())
        );
        assert_eq!(error(json!({"router": "round-robin", "autoscaler": "slo-load"})).0, Some("autoscaler".into()));
    }

    #[test]
    fn a_pd_fleets_autoscaler_takes_the_serve_flags_hysteresis_or_the_command_lines() {
        let pools =
            crate::serve::pools::tests::args(&["--mode", "pd", "--autoscaler", "slo-load", "--up-hold-ms", "700"]);
        let set = |autoscaler: Value| {
            let p: Policy =
                serde_json::from_value(json!({"router": "round-robin", "autoscaler": autoscaler})).expect("parses");
            p.validate(Some(&pools))
        };
        let Some(AutoscalerConfig::SloLoad { knobs }) = set(Value::Null).expect("valid").autoscaler else {
            panic!("none given: the command line's slo-load")
        };
        assert_eq!(knobs.up_hold, engine::Dur::from_millis(700));
        assert!(matches!(
            set(json!("fixed-xpyd")).expect("valid").autoscaler,
            Some(AutoscalerConfig::FixedXpyd { .. })
        ));
        assert_eq!(set(json!("none")).expect("valid").autoscaler, Some(AutoscalerConfig::None));
        let e = set(json!("magic")).unwrap_err();
        assert_eq!(
            (e.param(), e.message()),
            (Some("autoscaler"), "unknown autoscaler `magic` (valid: none, fixed-xpyd, slo-load)")
        );
    }
}
