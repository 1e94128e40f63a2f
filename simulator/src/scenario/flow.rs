//! The `[flow]` section: flow control at the controller (see [`policies::flow`]), several
//! rules side by side on the same arrivals.
//!
//! ```toml
//! [flow]
//! # Each entry is a run of every router: a rule's name, or a table of the name, the rule's
//! # parameters and `class_priority` (engines admit and preempt by class; default: on for
//! # `slo`, off for `none` and `llm-d`).
//! rules = ["none", "llm-d", "slo", { name = "slo", batch_headroom = 0.5 }, { name = "none", class_priority = true }]
//! # Engines hold agent sessions' KV through tool calls (engine::programs): pauses up to
//! # program_hold_s seconds, in at most program_hold_share of each engine's KV [default 0.5],
//! # and load a session's context back from L2/L3 program_prefetch_s seconds before its next
//! # turn is expected, and when one waits [default: no prefetch].
//! rules = [{ name = "slo", program_kv_share = 0.9, program_hold_s = 10, program_prefetch_s = 1 }]
//! ```
//!
//! Without `[flow]` every run places requests as they arrive, engines FCFS, and run names
//! say nothing of flow control.

use super::{invalid, param_error, ScenarioError};
use engine::{Dur, ProgramHold};
use policies::flow::FlowConfig;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowSection {
    pub rules: Option<Vec<FlowEntry>>,
}

/// One entry of `rules`: a name, or a table of the name and settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FlowEntry {
    Name(String),
    Table(BTreeMap<String, toml::Value>),
}

/// Flow control of one run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FlowRun {
    pub flow: FlowConfig,
    /// Engines admit and preempt by class ([`engine::InstanceConfig::class_priority`]).
    pub class_priority: bool,
    /// Engines hold sessions' KV through tool calls ([`engine::InstanceConfig::program_hold`]).
    pub program_hold: Option<ProgramHold>,
    /// Added to the run's name (`None` without a `[flow]` section).
    pub label: Option<String>,
}

impl FlowSection {
    pub(super) fn overlay(self, over: FlowSection) -> FlowSection {
        FlowSection { rules: over.rules.or(self.rules) }
    }

    /// One run per entry; a single plain run without the section.
    pub fn resolve_runs(&self) -> Result<Vec<FlowRun>, ScenarioError> {
        let Some(entries) = &self.rules else {
            return Ok(vec![FlowRun::default()]);
        };
        if entries.is_empty() {
            return Err(invalid("flow.rules", "name at least one rule (\"none\" for no flow control)"));
        }
        entries.iter().map(resolve_entry).collect()
    }
}

/// Engines' holds of sessions' KV ([`engine::programs`]) from `program_hold_s` (seconds),
/// `program_hold_share` and `program_prefetch_s` (seconds): the one check, for flow rules and
/// for an engine's scheduling.
pub fn program_hold(
    seconds: Option<f64>,
    share: Option<f64>,
    prefetch: Option<f64>,
) -> Result<Option<ProgramHold>, ScenarioError> {
    if let Some(s) = seconds.filter(|s| !(s.is_finite() && *s > 0.0)) {
        return Err(invalid("program_hold_s", format!("{s} is not seconds > 0")));
    }
    if let Some(s) = share.filter(|s| !(*s > 0.0 && *s <= 1.0)) {
        return Err(invalid("program_hold_share", format!("{s} is not a share in (0, 1]")));
    }
    if let Some(s) = prefetch.filter(|s| !(s.is_finite() && *s >= 0.0)) {
        return Err(invalid("program_prefetch_s", format!("{s} is not seconds >= 0")));
    }
    match (seconds, share, prefetch) {
        (None, None, None) => Ok(None),
        (None, Some(_), _) => Err(invalid("program_hold_share", "needs program_hold_s")),
        (None, _, Some(_)) => Err(invalid("program_prefetch_s", "needs program_hold_s")),
        (Some(s), share, prefetch) => Ok(Some(ProgramHold {
            max_pause: Dur::from_secs_f64(s),
            share: share.unwrap_or(ProgramHold::default().share),
            prefetch: prefetch.map(Dur::from_secs_f64),
        })),
    }
}

fn resolve_entry(entry: &FlowEntry) -> Result<FlowRun, ScenarioError> {
    let (name, table) = match entry {
        FlowEntry::Name(name) => (name.as_str(), None),
        FlowEntry::Table(table) => match table.get("name") {
            Some(toml::Value::String(name)) => (name.as_str(), Some(table)),
            _ => return Err(invalid("flow.rules", "a rule's table needs `name = \"RULE\"`")),
        },
    };
    let mut flow: FlowConfig =
        name.parse().map_err(|e: policies::flow::UnknownFlow| invalid("flow.rules", e.to_string()))?;
    let default_priority = matches!(flow, FlowConfig::Slo(_));
    let mut class_priority = default_priority;
    let (mut hold_s, mut hold_share, mut prefetch_s) = (None, None, None);
    for (key, value) in table.into_iter().flatten().filter(|(k, _)| *k != "name") {
        let number = match value {
            toml::Value::Float(v) => Some(*v),
            toml::Value::Integer(v) => Some(*v as f64),
            _ => None,
        };
        match (key.as_str(), value, number) {
            ("class_priority", toml::Value::Boolean(b), _) => class_priority = *b,
            ("class_priority", other, _) => {
                return Err(invalid(
                    "flow.rules",
                    format!("`class_priority` of `{name}` is {other}, not true or false"),
                ))
            }
            (_, other, None) => {
                return Err(invalid("flow.rules", format!("`{key}` of `{name}` is {other}, not a number")))
            }
            // The engines' holds, not the rule's: checked together below.
            ("program_hold_s", _, n) => hold_s = n,
            ("program_hold_share", _, n) => hold_share = n,
            ("program_prefetch_s", _, n) => prefetch_s = n,
            (_, _, Some(v)) => flow.set(key, v).map_err(|e| param_error("flow.rules", e))?,
        }
    }
    let program_hold = program_hold(hold_s, hold_share, prefetch_s)?;
    let mut label = format!("flow={}", flow.label());
    if class_priority != default_priority {
        label.push_str(if class_priority { "+class-priority" } else { "+fcfs-engines" });
    }
    if let Some(h) = &program_hold {
        label.push_str(&format!("+hold={}s", h.max_pause.as_secs_f64()));
        if hold_share.is_some() {
            label.push_str(&format!("/{}", h.share));
        }
        if let Some(p) = h.prefetch {
            label.push_str(&format!("+prefetch={}s", p.as_secs_f64()));
        }
    }
    Ok(FlowRun { flow, class_priority, program_hold, label: Some(label) })
}
