//! The policy set an operator edits through the API: a policy file
//! ([`PolicyFile`]: the router and its parameters, the engines' scheduling with fair
//! prefill's parameters, the autoscaler of a P/D fleet and its parameters), the file
//! `fleetplane tune` writes and the simulator runs. Versions are stored as JSON; a version
//! stored before a field existed loads with that field's default, so old `{router}` versions
//! still load and roll back.

use super::errors::ApiError;
use super::pools::PoolArgs;
use crate::proto::Scheduling;
use crate::scheduling::Invalid;
use axum::http::StatusCode;
use policies::{AutoscalerConfig, RouterConfig};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use simulator::policy_file::PolicyFile;
use simulator::scenario::flow::FlowRun;
use simulator::scenario::ScenarioError;
use std::collections::BTreeMap;

/// One version of the policy set, as stored and as the API takes it: a policy file, so that
/// a live policy's JSON is a policy file and a policy file (TOML or JSON) a live policy. On a
/// live fleet a setting left out means the fleet's default: FCFS, no high-water mark, the
/// command line's autoscaler.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(transparent)]
pub struct Policy(pub PolicyFile);

/// A checked policy, resolved to what the controller and the engines take.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySet {
    pub router: RouterConfig,
    pub scheduling: Scheduling,
    /// Flow control at the controller, with whether engines admit by class.
    pub flow: FlowRun,
    /// The classes' own targets (the others take the fleet's SLO).
    pub class_slo: BTreeMap<engine::Class, simulator::slo::Slo>,
    /// `None` for a colocated fleet, which has no autoscaler.
    pub autoscaler: Option<AutoscalerConfig>,
}

/// The prefill schedulers an editor may offer.
pub const PREFILL_SCHEDULERS: [&str; 2] = ["fcfs", "fair"];

/// A simulator rule's refusal as the API's 400, naming the field.
fn refused(e: ScenarioError) -> ApiError {
    let Invalid { field, reason } = Invalid::of(e);
    ApiError::invalid(field, reason)
}

impl Policy {
    /// The policy a fleet runs before any version is stored: the command line's router, and
    /// the engines' own scheduling (they start FCFS without protection).
    pub fn command_line(router: &str) -> Policy {
        Policy(PolicyFile { router: router.to_string(), ..PolicyFile::default() })
    }

    /// A policy file's text as `fleetplane tune` writes it: JSON if it starts with `{` (a
    /// JSON policy is an object, and no TOML document starts so), TOML otherwise. The error
    /// names the key at fault.
    pub fn from_text(text: &str) -> Result<Policy, ApiError> {
        const WHAT: &str = "the policy file is not valid";
        let text = text.trim_start_matches('\u{feff}');
        if text.trim_start().starts_with('{') {
            let mut de = serde_json::Deserializer::from_str(text);
            return serde_path_to_error::deserialize(&mut de).map_err(|e| ApiError::invalid_json(WHAT, e));
        }
        let de = toml::Deserializer::parse(text)
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_toml", format!("{WHAT} TOML: {e}")))?;
        serde_path_to_error::deserialize(de).map_err(|e| ApiError::invalid_document("invalid_toml", WHAT, e))
    }

    /// Checks every setting by the simulator's rules for it (the router's, fair prefill's and
    /// the autoscaler's parameters by their one validator); the error names the field (the
    /// API's `param`, `router_params.copy_weight` for a parameter) and the valid values or
    /// range. `pools`: the fleet's pool flags, `None` for a colocated fleet.
    pub fn validate(&self, pools: Option<&PoolArgs>) -> Result<PolicySet, ApiError> {
        let p = &self.0;
        let router = p.router_config().map_err(refused)?;
        let (prefill, kv_protection) = p.scheduler().and_then(|s| s.engine_scheduling()).map_err(refused)?;
        simulator::scenario::step_budget("max_batch_tokens", p.max_batch_tokens).map_err(refused)?;
        let scheduling =
            Scheduling { max_batch_tokens: p.max_batch_tokens, ..crate::scheduling::wire(&prefill, kv_protection) };
        let autoscaler = match (pools, p.autoscaler.as_deref()) {
            (None, None | Some("none")) => {
                // Checked all the same: a colocated fleet's `none` has no parameters.
                p.autoscaler_over(AutoscalerConfig::None).map_err(refused)?;
                None
            }
            (None, Some(other)) => {
                return Err(ApiError::invalid(
                    "autoscaler",
                    format!(
                    "autoscaler `{other}` sizes the pools of serve --mode pd; this fleet is colocated (valid: none)"
                ),
                ))
            }
            (Some(pools), name) => {
                let flags = pools
                    .autoscaler(name.unwrap_or(&pools.autoscaler))
                    .map_err(|e| ApiError::invalid("autoscaler", e.to_string()))?;
                Some(p.autoscaler_over(flags).map_err(refused)?)
            }
        };
        let flow = p.flow_run().map_err(refused)?;
        p.check_class_slo().map_err(refused)?;
        Ok(PolicySet { router, scheduling, autoscaler, flow, class_slo: p.class_slo.clone() })
    }

    /// A stored version (validated when stored, but a newer build may know other names).
    pub fn stored(stored: Value, pools: Option<&PoolArgs>) -> Result<PolicySet, String> {
        let policy: Policy = serde_json::from_value(stored).map_err(|e| e.to_string())?;
        policy.validate(pools).map_err(|e| e.message().to_string())
    }

    /// A policy with every field present (defaults filled in: FCFS, no water marks, the
    /// engines' own step budget, the command line's autoscaler, no parameters), for the API;
    /// one the build cannot read is shown as stored.
    pub fn normalized(stored: Value) -> Value {
        let Ok(policy) = serde_json::from_value::<Policy>(stored.clone()) else { return stored };
        let mut v = serde_json::to_value(policy).unwrap_or(stored);
        if let Some(fields) = v.as_object_mut() {
            let defaults = [
                ("router_params", json!({})),
                ("prefill_scheduler", json!("fcfs")),
                ("prefill_params", json!({})),
                ("kv_high_water", Value::Null),
                ("kv_low_water", Value::Null),
                ("max_batch_tokens", Value::Null),
                ("autoscaler", Value::Null),
                ("autoscaler_params", json!({})),
                ("flow", Value::Null),
                ("flow_params", json!({})),
                ("class_priority", Value::Null),
                ("class_slo", json!({})),
            ];
            for (key, default) in defaults {
                fields.entry(key).or_insert(default);
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(v: Value) -> Policy {
        serde_json::from_value(v).expect("parses")
    }

    fn error_on(policy_json: Value, pools: Option<&PoolArgs>) -> (Option<String>, String) {
        let e = policy(policy_json).validate(pools).unwrap_err();
        (e.param().map(str::to_string), e.message().to_string())
    }

    fn error(policy_json: Value) -> (Option<String>, String) {
        error_on(policy_json, None)
    }

    fn pd_pools() -> PoolArgs {
        crate::serve::pools::tests::args(&["--mode", "pd", "--autoscaler", "slo-load", "--up-hold-ms", "700"])
    }

    #[test]
    fn a_version_stored_as_a_router_alone_loads_with_the_defaults() {
        let p = policy(json!({"router": "power-of-two"}));
        assert_eq!(p, Policy::command_line("power-of-two"));
        let set = p.validate(None).expect("valid");
        assert_eq!(set.scheduling, Scheduling { prefill: "fcfs".into(), ..Scheduling::default() });
        assert_eq!(set.autoscaler, None);
        // As older builds stored them: every field of the time, nulls included.
        let old = json!({"router": "round-robin", "prefill_scheduler": "fair", "kv_high_water": 0.9,
            "kv_low_water": null, "autoscaler": null});
        assert_eq!(policy(old.clone()).validate(None).expect("valid").scheduling.prefill, "fair");
        assert_eq!(
            Policy::normalized(old),
            json!({"router": "round-robin", "router_params": {}, "prefill_scheduler": "fair", "prefill_params": {},
                "kv_high_water": 0.9, "kv_low_water": null, "max_batch_tokens": null, "autoscaler": null, "autoscaler_params": {},
                "flow": null, "flow_params": {}, "class_priority": null, "class_slo": {}})
        );
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
    fn parameters_are_accepted_and_resolved_for_the_controller_and_the_engines() {
        let p = policy(json!({"router": "cache-aware", "router_params": {"copy_weight": 2.0},
            "prefill_scheduler": "fair", "prefill_params": {"chunk_tokens": 4096}}));
        let set = p.validate(None).expect("valid");
        assert_eq!(set.router.label(), "cache-aware(copy_weight=2)");
        assert_eq!(set.scheduling.prefill, "fair");
        assert_eq!(set.scheduling.chunk_tokens, Some(4096));
        assert_eq!(set.scheduling.quota_growth, Some(engine::FairPrefill::default().quota_growth));
        let pools = pd_pools();
        let p = policy(json!({"router": "round-robin", "autoscaler_params": {"up_load": 0.85}}));
        let Some(AutoscalerConfig::SloLoad { knobs }) = p.validate(Some(&pools)).expect("valid").autoscaler else {
            panic!("the command line's slo-load")
        };
        assert_eq!(knobs.up_load, 0.85);
        assert_eq!(knobs.up_hold, engine::Dur::from_millis(700), "the flags' hysteresis under the parameters");
    }

    #[test]
    fn each_invalid_parameter_is_named_with_its_range() {
        let (param, message) = error(json!({"router": "cache-aware", "router_params": {"copy_weight": 99}}));
        assert_eq!(param.as_deref(), Some("router_params.copy_weight"));
        assert_eq!(message, "cache-aware's `copy_weight` is 99, outside its range [0, 64]");
        let (param, message) = error(json!({"router": "round-robin", "router_params": {"copy_weight": 1}}));
        assert_eq!(param.as_deref(), Some("router_params.copy_weight"));
        assert!(message.starts_with("round-robin has no parameter `copy_weight`"), "{message}");
        let (param, message) = error(json!({"router": "round-robin", "prefill_params": {"chunk_tokens": 0.5}}));
        assert_eq!(param.as_deref(), Some("prefill_params.chunk_tokens"));
        assert!(message.contains("integer in [1, 1048576]"), "{message}");
        let (param, _) = error(json!({"router": "round-robin", "prefill_params": {"chunk": 1}}));
        assert_eq!(param.as_deref(), Some("prefill_params.chunk"));
        let (param, message) = error(json!({"router": "round-robin", "autoscaler_params": {"up_load": 0.9}}));
        assert_eq!(param.as_deref(), Some("autoscaler_params.up_load"));
        assert!(message.starts_with("none has no parameter `up_load`"), "a colocated fleet's: {message}");
        let pools = pd_pools();
        let (param, message) =
            error_on(json!({"router": "round-robin", "autoscaler_params": {"shrink_util": 0}}), Some(&pools));
        assert_eq!(param.as_deref(), Some("autoscaler_params.shrink_util"));
        assert!(message.ends_with("outside its range (0, 1]"), "{message}");
    }

    #[test]
    fn a_tuned_policy_files_text_is_a_policy_in_toml_or_json() {
        let file = PolicyFile {
            router: "cache-aware".into(),
            router_params: [("copy_weight".to_string(), 2.0)].into(),
            prefill_scheduler: Some("fair".into()),
            prefill_params: [("chunk_tokens".to_string(), 4096.0)].into(),
            kv_high_water: Some(0.9),
            ..PolicyFile::default()
        };
        let toml = file.to_toml();
        assert_eq!(Policy::from_text(&toml).expect("TOML").0, file);
        let json = serde_json::to_string_pretty(&file).expect("json");
        assert_eq!(Policy::from_text(&format!("\n{json}")).expect("JSON").0, file);
        // What the API shows, defaults filled in, reads back as the same policy file.
        let shown = Policy::normalized(serde_json::to_value(Policy(file.clone())).expect("json"));
        assert_eq!(Policy::from_text(&shown.to_string()).expect("the API's JSON").0, file);

        let e = Policy::from_text("router = \"cache-aware\"\n[router_params]\ncopy_weight = \"two\"\n").unwrap_err();
        assert_eq!(e.param(), Some("router_params.copy_weight"), "{}", e.message());
        let e = Policy::from_text("router = \"cache-aware\"\nroutr_params = {}\n").unwrap_err();
        assert!(e.message().contains("routr_params"), "{}", e.message());
        let e = Policy::from_text("router = ").unwrap_err();
        assert!(e.message().starts_with("the policy file is not valid TOML"), "{}", e.message());
    }

    #[test]
    fn a_pd_fleets_autoscaler_takes_the_serve_flags_hysteresis_or_the_command_lines() {
        let pools = pd_pools();
        let set = |autoscaler: Value| {
            policy(json!({"router": "round-robin", "autoscaler": autoscaler})).validate(Some(&pools))
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
