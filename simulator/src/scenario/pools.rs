//! The `[pools]` section: colocated or prefill/decode pools, their autoscaler and its settings.

use super::{autoscaler_with_params, invalid, ScenarioError};
use crate::pools::{check, PdRun};
use engine::Dur;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `[pools]`: a disaggregated fleet, its autoscaler, and time series.
///
/// ```toml
/// [pools]
/// mode = "pd"                 # or "colocated" [default]
/// prefill_instances = 2       # at the start [default: 1]
/// decode_instances = 6        # [default: 1]
/// autoscaler = "slo-load"     # none, fixed-xpyd, slo-load [default: none]
/// autoscaler_params = { up_load = 0.85, down_hold = 30 }   # its knobs (`tune --list-params`)
/// startup_s = 10              # from Start to serving [default: 10]
/// gpu_budget = 16             # GPUs held at most [default: fleet.instances × GPUs per instance]
/// xpyd = "1:3"                # fixed-xpyd's group [default: the starting pools' ratio]
/// min_per_pool = 1            # [default: 1]
/// tick_s = 1                  # scaling period [default: 1]
/// slo_window_s = 20           # SLO load window [default: 20]
/// transfer_gb_s = 50          # KV link between P and D, GB/s [default: 50]
/// transfer_latency_ms = 1     # per transfer [default: 1]
/// timeline_s = 10             # time-series window [default: 10 for pd, none otherwise]
///
/// # Several runs on the same arrivals, each overriding the keys above:
/// runs = [ { label = "colocated", mode = "colocated" },
///          { label = "slo-load", autoscaler = "slo-load", startup_s = 10 } ]
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolsSection {
    pub label: Option<String>,
    pub mode: Option<String>,
    pub prefill_instances: Option<u32>,
    pub decode_instances: Option<u32>,
    pub autoscaler: Option<String>,
    /// The autoscaler's hysteresis knobs by name, over its defaults (durations in seconds).
    #[serde(default)]
    pub autoscaler_params: Option<BTreeMap<String, f64>>,
    pub startup_s: Option<f64>,
    pub gpu_budget: Option<u32>,
    pub xpyd: Option<String>,
    pub min_per_pool: Option<u32>,
    pub tick_s: Option<f64>,
    pub slo_window_s: Option<f64>,
    pub transfer_gb_s: Option<f64>,
    pub transfer_latency_ms: Option<f64>,
    pub timeline_s: Option<f64>,
    pub runs: Option<Vec<PoolsSection>>,
}

impl PoolsSection {
    pub(super) fn overlay(self, over: PoolsSection) -> PoolsSection {
        PoolsSection {
            label: over.label.or(self.label),
            mode: over.mode.or(self.mode),
            prefill_instances: over.prefill_instances.or(self.prefill_instances),
            decode_instances: over.decode_instances.or(self.decode_instances),
            autoscaler: over.autoscaler.or(self.autoscaler),
            autoscaler_params: over.autoscaler_params.or(self.autoscaler_params),
            startup_s: over.startup_s.or(self.startup_s),
            gpu_budget: over.gpu_budget.or(self.gpu_budget),
            xpyd: over.xpyd.or(self.xpyd),
            min_per_pool: over.min_per_pool.or(self.min_per_pool),
            tick_s: over.tick_s.or(self.tick_s),
            slo_window_s: over.slo_window_s.or(self.slo_window_s),
            transfer_gb_s: over.transfer_gb_s.or(self.transfer_gb_s),
            transfer_latency_ms: over.transfer_latency_ms.or(self.transfer_latency_ms),
            timeline_s: over.timeline_s.or(self.timeline_s),
            runs: over.runs.or(self.runs),
        }
    }

    /// One run's pools: `None` for a fixed colocated fleet without time series or label.
    /// Every run of `[pools]`: the section itself, or each of its `runs` over it.
    pub(super) fn resolve_runs(
        &self,
        fleet_instances: u32,
        gpus_per_instance: u32,
    ) -> Result<Vec<Option<PoolsRun>>, ScenarioError> {
        match &self.runs {
            None => Ok(vec![self.resolve(fleet_instances, gpus_per_instance)?]),
            Some(runs) if runs.is_empty() => Err(invalid("pools.runs", "name at least one run")),
            Some(runs) => runs
                .iter()
                .map(|run| {
                    if run.runs.is_some() {
                        return Err(invalid("pools.runs", "a run cannot have runs of its own"));
                    }
                    PoolsSection { runs: None, ..self.clone() }
                        .overlay(run.clone())
                        .resolve(fleet_instances, gpus_per_instance)
                })
                .collect(),
        }
    }

    fn resolve(&self, fleet_instances: u32, gpus_per_instance: u32) -> Result<Option<PoolsRun>, ScenarioError> {
        let seconds = |key: &'static str, v: Option<f64>, default: f64| {
            check::seconds(v.unwrap_or(default)).map_err(|reason| invalid(key, reason))
        };
        let positive_s = |key: &'static str, v: Option<f64>, default: f64| {
            check::positive_seconds(v.unwrap_or(default)).map_err(|reason| invalid(key, reason))
        };
        let autoscaler_name = self.autoscaler.as_deref().unwrap_or("none");
        let pd = match self.mode.as_deref().unwrap_or("colocated") {
            "colocated" => {
                if autoscaler_name != "none" {
                    return Err(invalid("pools.autoscaler", "autoscaling needs mode = \"pd\" (--mode pd)"));
                }
                None
            }
            "pd" => {
                let prefill = self.prefill_instances.unwrap_or(1);
                let decode = self.decode_instances.unwrap_or(1);
                if prefill == 0 || decode == 0 {
                    return Err(invalid("pools.prefill_instances", "each pool needs at least one instance"));
                }
                let min_per_pool = self.min_per_pool.unwrap_or(1).max(1);
                let xpyd = match &self.xpyd {
                    Some(s) => parse_xpyd(s)?,
                    None => {
                        let g = gcd(prefill, decode);
                        (prefill / g, decode / g)
                    }
                };
                let startup = seconds("pools.startup_s", self.startup_s, 10.0)?;
                let params = self.autoscaler_params.iter().flatten();
                let autoscaler =
                    autoscaler_with_params(autoscaler_name, startup, xpyd, params, "pools.autoscaler_params")?;
                let gpu_budget = self.gpu_budget.unwrap_or(fleet_instances * gpus_per_instance);
                check::gpu_budget(gpu_budget, prefill + decode, gpus_per_instance, "starting instances")
                    .map_err(|reason| invalid("pools.gpu_budget", reason))?;
                let transfer_bytes_per_s = check::bandwidth_gb_s(self.transfer_gb_s.unwrap_or(50.0))
                    .map_err(|reason| invalid("pools.transfer_gb_s", reason))?;
                Some(PdRun {
                    prefill,
                    decode,
                    autoscaler,
                    startup,
                    gpu_budget,
                    min_per_pool,
                    tick: positive_s("pools.tick_s", self.tick_s, 1.0)?,
                    slo_window: positive_s("pools.slo_window_s", self.slo_window_s, 20.0)?,
                    transfer_bytes_per_s,
                    transfer_latency: seconds(
                        "pools.transfer_latency_ms",
                        self.transfer_latency_ms.map(|ms| ms / 1e3),
                        0.001,
                    )?,
                })
            }
            other => return Err(invalid("pools.mode", format!("unknown mode `{other}` (valid: colocated, pd)"))),
        };
        let timeline = match (self.timeline_s, &pd) {
            (None, None) => None,
            (None, Some(_)) => Some(Dur::from_secs_f64(10.0)),
            (Some(s), _) => Some(positive_s("pools.timeline_s", Some(s), 10.0)?),
        };
        if pd.is_none() && timeline.is_none() && self.label.is_none() {
            return Ok(None);
        }
        Ok(Some(PoolsRun { label: self.label.clone(), pd, timeline }))
    }
}

/// `X:Y`, both at least 1.
fn parse_xpyd(s: &str) -> Result<(u32, u32), ScenarioError> {
    let bad = || invalid("pools.xpyd", format!("`{s}` is not X:Y with X, Y >= 1 (like 1:3)"));
    let (x, y) = s.split_once(':').ok_or_else(bad)?;
    let x: u32 = x.trim().parse().map_err(|_| bad())?;
    let y: u32 = y.trim().parse().map_err(|_| bad())?;
    if x == 0 || y == 0 {
        return Err(bad());
    }
    Ok((x, y))
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a.max(1)
    } else {
        gcd(b, a % b)
    }
}

/// One run's pools, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolsRun {
    /// Appended to the router's name in reports (`router/label`).
    pub label: Option<String>,
    pub pd: Option<PdRun>,
    pub timeline: Option<Dur>,
}
