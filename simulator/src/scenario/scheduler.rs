//! The `[scheduler]` section: the engines' prefill policy and KV high-water protection.

use super::{invalid, param_error, ScenarioError};
use engine::{FairPrefill, KvProtection, PrefillPolicy, RunawayAction};
use policies::Params;
use serde::{Deserialize, Serialize};

/// A step budget (`max_batch_tokens`, `None`: the engines' own), checked as a scenario's
/// fleet, a run's variant, the policy file, the live policy API and an engine's `Configure`
/// take it; `key` names the setting in the error.
pub fn step_budget(key: &'static str, budget: Option<u32>) -> Result<Option<u32>, ScenarioError> {
    match budget {
        Some(0) => Err(invalid(key, "must be at least 1")),
        budget => Ok(budget),
    }
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
    pub(super) fn overlay(self, over: SchedulerSection) -> SchedulerSection {
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

    /// An engine's scheduling as an operator sets it on a live fleet: the prefill policy
    /// and, when `kv_high_water` is given, the protection (a low-water mark alone is an error,
    /// since it would do nothing).
    pub fn engine_scheduling(&self) -> Result<(PrefillPolicy, Option<KvProtection>), ScenarioError> {
        let prefill = self.resolve()?;
        let (protection, on) = self.resolve_protection()?;
        if !on && self.kv_low_water.is_some() {
            return Err(invalid("scheduler.kv_low_water", "a low-water mark needs kv_high_water"));
        }
        Ok((prefill, on.then_some(protection)))
    }

    /// The KV high-water protection: its knobs, checked, and whether runs have it on unless
    /// their name says otherwise (`kv_high_water` given).
    pub(super) fn resolve_protection(&self) -> Result<(KvProtection, bool), ScenarioError> {
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

    pub(super) fn resolve(&self) -> Result<PrefillPolicy, ScenarioError> {
        let mut fair = FairPrefill::default();
        let given = [
            ("chunk_tokens", self.chunk_tokens.map(f64::from)),
            ("quota_kv_share", self.quota_kv_share),
            ("quota_growth", self.quota_growth),
            ("long_min_tokens", self.long_min_tokens.map(f64::from)),
        ];
        for (name, v) in given.into_iter().filter_map(|(n, v)| Some((n, v?))) {
            fair.set(name, v).map_err(|e| param_error("scheduler", e))?;
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
