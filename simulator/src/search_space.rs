//! The space `fleetplane tune` searches: policy parameters by name, each in a range, laid
//! over the unit cube an optimizer moves in, and the policy file of any point of it.
//!
//! Names: a router parameter by its own name (`copy_weight`); fair prefill's as
//! `prefill.NAME` (tuning one runs fair prefill); the autoscaler's as `autoscaler.NAME`;
//! `kv_high_water` and `kv_low_water` (tuning either runs KV high-water protection);
//! `max_batch_tokens`, the engines' token budget of one step; the flow control rule's as
//! `flow.NAME` (the scenario's run must have a rule).
//!
//! A parameter's range is its own range narrowed to a quarter to four times the value the
//! scenario runs with (a weight's useful values are within a small factor of a sane default;
//! the full ranges are safety bounds, up to 1,024 for a request count), or what `--range`
//! gives. The step budget's is a sixteenth of the scenario's to the scenario's: a live engine
//! cannot take a budget above the one it started with (its buffers are sized for it), and
//! what a smaller one trades (decodes that wait less beside a prompt's chunks, prompts that
//! take more steps) is what a search can find. It is searched on a log scale.

use crate::policy_file::PolicyFile;
use crate::scenario::RunSpec;
use policies::params::{Kind, Param, Params};
use policies::{AutoscalerConfig, RouterConfig};
use std::collections::BTreeMap;

/// One searched parameter.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Dim {
    /// As `--params` names it.
    pub name: String,
    pub kind: Kind,
    pub lo: f64,
    pub hi: f64,
    /// The value the scenario runs with, where the search starts.
    pub start: f64,
    /// Searched on a log scale (equal steps are equal ratios): a size whose effect goes by
    /// its ratio to another (the step budget against the prompts' lengths).
    pub log: bool,
    #[serde(skip)]
    target: Target,
}

impl Dim {
    /// The value at `u` in [0, 1] of the range, before rounding.
    fn at(&self, u: f64) -> f64 {
        let u = u.clamp(0.0, 1.0);
        if self.log {
            self.lo * (self.hi / self.lo).powf(u)
        } else {
            self.lo + u * (self.hi - self.lo)
        }
    }

    /// Where `v` lies in the range, as a point of [0, 1].
    fn unit(&self, v: f64) -> f64 {
        if self.log {
            (v / self.lo).ln() / (self.hi / self.lo).ln()
        } else {
            (v - self.lo) / (self.hi - self.lo)
        }
    }
}

/// Where a parameter goes in a policy file.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Target {
    Router(&'static str),
    Prefill(&'static str),
    Autoscaler(&'static str),
    KvHighWater,
    KvLowWater,
    BatchTokens,
    Flow(&'static str),
}

/// How far below its start a size is searched by default: down to a sixteenth.
const SIZE_RANGE: f64 = 16.0;

impl Target {
    /// A size whose effect goes by ratio (the step budget): searched on a log scale, by
    /// default from a [`SIZE_RANGE`]th of its start up to the start, not in the window
    /// around it other parameters get.
    fn is_size(self) -> bool {
        self == Target::BatchTokens
    }
}

#[derive(Clone, Debug)]
pub struct SearchSpace {
    pub dims: Vec<Dim>,
    /// The scenario's run as a policy file: what every point changes.
    pub base: PolicyFile,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpaceError {
    #[error("unknown parameter `{name}` to tune with {router} (valid: {valid})")]
    Unknown { name: String, router: String, valid: String },
    #[error("parameter `{0}` is named twice")]
    Twice(String),
    #[error("--range {name}: {reason}")]
    Range { name: String, reason: String },
}

/// Fair prefill's parameters, with their defaults.
fn fair_params() -> &'static [Param] {
    <engine::FairPrefill as Params>::PARAMS
}

const KV_HIGH_WATER: Param = Param {
    name: "kv_high_water",
    kind: Kind::Float,
    min: 0.0,
    min_open: true,
    max: 1.0,
    doc: "share of KV blocks in use at which an instance stops admitting (turns protection on)",
};
const KV_LOW_WATER: Param = Param {
    name: "kv_low_water",
    kind: Kind::Float,
    min: 0.0,
    min_open: true,
    max: 1.0,
    doc: "share at which a paused instance admits again, below kv_high_water",
};
const MAX_BATCH_TOKENS: Param = Param {
    name: "max_batch_tokens",
    kind: Kind::Integer,
    min: 1.0,
    min_open: false,
    max: 1_048_576.0,
    doc: "the engines' token budget of one step, decode tokens plus prefill chunks (vLLM's --max-num-batched-tokens)",
};
/// Where a search of a water mark starts when the scenario runs without protection.
const KV_HIGH_START: f64 = 0.95;

impl SearchSpace {
    /// The parameters `names` of `run`'s policy (none: every parameter of its router and the
    /// engines' step budget, the setting that moves a TPOT-bound fleet most), with `ranges`
    /// (`name → (lo, hi)`) in place of the default ranges.
    pub fn new(
        run: &RunSpec,
        names: &[String],
        ranges: &BTreeMap<String, (f64, f64)>,
    ) -> Result<SearchSpace, SpaceError> {
        let mut base = PolicyFile::of_run(run);
        let router = &run.router;
        let names: Vec<String> = match names {
            [] => router.params().iter().map(|p| p.name).chain([MAX_BATCH_TOKENS.name]).map(String::from).collect(),
            given => given.to_vec(),
        };
        let mut dims: Vec<Dim> = Vec::new();
        for name in names {
            if dims.iter().any(|d| d.name == name) {
                return Err(SpaceError::Twice(name));
            }
            let (param, target, start) = lookup(run, &name).ok_or_else(|| SpaceError::Unknown {
                name: name.clone(),
                router: router.name().into(),
                valid: valid(run).join(", "),
            })?;
            let (lo, hi) = match ranges.get(&name) {
                Some(&(lo, hi)) => {
                    let check = |v: f64| {
                        param
                            .check("tune", v)
                            .map_err(|e| SpaceError::Range { name: name.clone(), reason: e.to_string() })
                    };
                    check(lo)?;
                    check(hi)?;
                    if lo >= hi {
                        return Err(SpaceError::Range {
                            name,
                            reason: format!("{lo}:{hi} is empty (write LO:HI with LO < HI)"),
                        });
                    }
                    (lo, hi)
                }
                None if target.is_size() => ((start / SIZE_RANGE).round().max(param.min), start),
                None => window(&param, start),
            };
            let log = target.is_size();
            dims.push(Dim { name, kind: param.kind, lo, hi, start: start.clamp(lo, hi), log, target });
        }
        if dims.iter().any(|d| d.target == Target::BatchTokens) {
            // Every point's file names its budget, the start's too (the scenario's).
            base.max_batch_tokens = Some(run.max_batch_tokens);
        }
        if dims.iter().any(|d| matches!(d.target, Target::Flow(_))) {
            // The run's flow control goes into every point's file, as it runs in the scenario.
            base = base.with_flow_of(run);
        }
        if let Some(name) = ranges.keys().find(|k| !dims.iter().any(|d| &d.name == *k)) {
            return Err(SpaceError::Range {
                name: name.clone(),
                reason: "not a parameter being tuned (add it to --params)".into(),
            });
        }
        Ok(SearchSpace { dims, base })
    }

    /// The start as a point of the unit cube.
    pub fn start(&self) -> Vec<f64> {
        self.dims.iter().map(|d| d.unit(d.start)).collect()
    }

    /// Each coordinate of `x` (clamped to [0, 1]) as its parameter's value, integers rounded.
    pub fn values(&self, x: &[f64]) -> Vec<f64> {
        self.dims
            .iter()
            .zip(x)
            .map(|(d, &u)| {
                let v = d.at(u);
                match d.kind {
                    Kind::Integer => v.round(),
                    // Four significant digits: finer than any effect a simulation shows, and
                    // a policy file a person can read. The value simulated is the one written.
                    Kind::Float | Kind::Seconds => significant(v, 4).clamp(d.lo, d.hi),
                }
            })
            .collect()
    }

    /// The policy file with `values` (one per dimension) laid over the base.
    pub fn policy(&self, values: &[f64]) -> PolicyFile {
        let mut p = self.base.clone();
        for (d, &v) in self.dims.iter().zip(values) {
            match d.target {
                Target::Router(n) => {
                    p.router_params.insert(n.into(), v);
                }
                Target::Prefill(n) => {
                    p.prefill_scheduler = Some("fair".into());
                    p.prefill_params.insert(n.into(), v);
                }
                Target::Autoscaler(n) => {
                    p.autoscaler_params.insert(n.into(), v);
                }
                Target::KvHighWater => p.kv_high_water = Some(v),
                Target::KvLowWater => p.kv_low_water = Some(v),
                Target::BatchTokens => p.max_batch_tokens = Some(v as u32),
                Target::Flow(n) => {
                    p.flow_params.insert(n.into(), v);
                }
            }
        }
        // A water mark tuned alone keeps its partner valid: the low mark at 80% of the high
        // one, as the scenario's default is, unless the low one is tuned too.
        let tuned = |t: Target| self.dims.iter().any(|d| d.target == t);
        if tuned(Target::KvHighWater) && !tuned(Target::KvLowWater) {
            p.kv_low_water = p.kv_high_water.map(|h| 0.8 * h);
        }
        if tuned(Target::KvLowWater) && p.kv_high_water.is_none() {
            p.kv_high_water = Some(KV_HIGH_START);
        }
        // The router's parameters that are its defaults are left out, as a file written by
        // hand would.
        if let Ok(r) = RouterConfig::with_params(&p.router, &p.router_params) {
            p.router_params = r.changed();
        }
        p
    }
}

/// `v` rounded to `digits` significant digits.
fn significant(v: f64, digits: i32) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let scale = 10f64.powi(digits - 1 - v.abs().log10().floor() as i32);
    (v * scale).round() / scale
}

/// A parameter by the name `--params` uses, with where it goes and its value in `run`.
fn lookup(run: &RunSpec, name: &str) -> Option<(Param, Target, f64)> {
    if let Some(n) = name.strip_prefix("prefill.") {
        let p = *fair_params().iter().find(|p| p.name == n)?;
        let fair = match &run.prefill {
            engine::PrefillPolicy::Fair(f) => *f,
            engine::PrefillPolicy::Fcfs => engine::FairPrefill::default(),
        };
        return Some((p, Target::Prefill(p.name), fair.get(p.name)?));
    }
    if let Some(n) = name.strip_prefix("flow.") {
        let flow = &run.flow.flow;
        let p = *flow.params().iter().find(|p| p.name == n)?;
        return Some((p, Target::Flow(p.name), *flow.values().get(p.name)?));
    }
    if let Some(n) = name.strip_prefix("autoscaler.") {
        let knobs = autoscaler(run)?.knobs()?;
        let p = *<policies::Knobs as Params>::PARAMS.iter().find(|p| p.name == n)?;
        return Some((p, Target::Autoscaler(p.name), knobs.get(p.name)?));
    }
    let protection = run.kv_protection;
    match name {
        "kv_high_water" => {
            Some((KV_HIGH_WATER, Target::KvHighWater, protection.map_or(KV_HIGH_START, |k| k.high_water)))
        }
        "kv_low_water" => {
            Some((KV_LOW_WATER, Target::KvLowWater, protection.map_or(0.8 * KV_HIGH_START, |k| k.low_water)))
        }
        "max_batch_tokens" => Some((MAX_BATCH_TOKENS, Target::BatchTokens, f64::from(run.max_batch_tokens))),
        _ => {
            let p = *run.router.params().iter().find(|p| p.name == name)?;
            Some((p, Target::Router(p.name), run.router.values().get(p.name).copied()?))
        }
    }
}

fn autoscaler(run: &RunSpec) -> Option<&AutoscalerConfig> {
    Some(&run.pools.as_ref()?.pd.as_ref()?.autoscaler)
}

/// Every name `--params` takes for `run`.
pub fn valid(run: &RunSpec) -> Vec<String> {
    let mut out: Vec<String> = run.router.params().iter().map(|p| p.name.to_string()).collect();
    out.extend(fair_params().iter().map(|p| format!("prefill.{}", p.name)));
    out.extend(scheduling_params().iter().map(|p| p.name.to_string()));
    out.extend(run.flow.flow.params().iter().map(|p| format!("flow.{}", p.name)));
    if autoscaler(run).and_then(AutoscalerConfig::knobs).is_some() {
        out.extend(<policies::Knobs as Params>::PARAMS.iter().map(|p| format!("autoscaler.{}", p.name)));
    }
    out
}

/// The default range: a quarter to four times `start` within the parameter's own range (from
/// its minimum to a sixteenth of its span when `start` is zero).
fn window(p: &Param, start: f64) -> (f64, f64) {
    let (lo, hi) = if start > 0.0 { (start / 4.0, start * 4.0) } else { (p.min, p.min + (p.max - p.min) / 16.0) };
    let lo = lo.max(p.min);
    // An open minimum is never reached: stay a hair above it.
    let lo = if p.min_open && lo <= p.min { p.min + (hi.min(p.max) - p.min) * 1e-3 } else { lo };
    (lo, hi.min(p.max))
}

/// The engines' scheduling settings outside fair prefill (the water marks, the step budget)
/// as parameters, for listings.
pub fn scheduling_params() -> [Param; 3] {
    [KV_HIGH_WATER, KV_LOW_WATER, MAX_BATCH_TOKENS]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(toml_text: &str) -> RunSpec {
        crate::scenario::tests::resolve(toml_text).expect("valid").routers.remove(0)
    }

    #[test]
    fn a_router_is_tuned_on_its_own_parameters_by_default_around_its_values() {
        let r = run(r#"routers = [{ name = "cache-aware", copy_weight = 2.0 }]"#);
        let space = SearchSpace::new(&r, &[], &BTreeMap::new()).expect("space");
        let names: Vec<&str> = space.dims.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "copy_weight",
                "stall_weight",
                "own_weight",
                "hot_factor",
                "hot_slack",
                "kv_weight",
                "left_weight",
                "lost_queue_factor",
                "lost_cap",
                "max_batch_tokens"
            ]
        );
        let copy = &space.dims[0];
        assert_eq!((copy.lo, copy.start, copy.hi), (0.5, 2.0, 8.0));
        // hot_factor's own range starts at 1.
        assert_eq!(space.dims[3].lo, 1.0);
        // The start maps back to the scenario's policy.
        let at_start = space.policy(&space.values(&space.start()));
        assert_eq!(at_start, space.base);
        assert_eq!(at_start.router_params, [("copy_weight".to_string(), 2.0)].into());
    }

    #[test]
    fn flow_controls_parameters_are_tuned_with_the_runs_rule_and_holds() {
        let r = run(r#"routers = ["cache-aware"]
[flow]
rules = [{ name = "slo", program_kv_share = 0.9, program_hold_s = 10 }]"#);
        let names = vec!["flow.program_kv_share".to_string()];
        let space = SearchSpace::new(&r, &names, &BTreeMap::new()).expect("space");
        assert_eq!((space.dims[0].lo, space.dims[0].start, space.dims[0].hi), (0.225, 0.9, 3.6));
        let p = space.policy(&space.values(&[1.0]));
        assert_eq!(p.flow.as_deref(), Some("slo"));
        assert_eq!(p.flow_params["program_kv_share"], 3.6);
        assert_eq!(p.flow_params["program_hold_s"], 10.0, "the run's holds go along");
        p.check().expect("a valid policy");
        assert!(valid(&r).contains(&"flow.batch_headroom".to_string()));
        // Without a rule there is nothing to tune.
        let plain = run(r#"routers = ["cache-aware"]"#);
        assert!(SearchSpace::new(&plain, &names, &BTreeMap::new()).is_err());
    }

    #[test]
    fn every_point_of_the_cube_is_a_valid_policy() {
        let r = run(r#"routers = ["dynamo-kv"]"#);
        let names: Vec<String> =
            ["overlap_score_weight", "prefill.chunk_tokens", "kv_high_water"].iter().map(|s| s.to_string()).collect();
        let space = SearchSpace::new(&r, &names, &BTreeMap::new()).expect("space");
        for x in [vec![0.0; 3], vec![1.0; 3], vec![-3.0, 0.5, 7.0], vec![0.33, 0.77, 0.01]] {
            let p = space.policy(&space.values(&x));
            p.check().unwrap_or_else(|e| panic!("{x:?}: {e}"));
            assert_eq!(p.prefill_scheduler.as_deref(), Some("fair"));
            let w = p.router_params.get("overlap_score_weight").copied().unwrap_or(1.0);
            assert_eq!(w, significant(w, 4), "four significant digits");
            let chunk = p.prefill_params["chunk_tokens"];
            assert_eq!(chunk.fract(), 0.0, "an integer parameter is whole");
            assert!(p.kv_low_water < p.kv_high_water);
        }
    }

    #[test]
    fn the_step_budget_is_searched_below_the_scenarios_and_goes_into_the_policy() {
        let r = run(r#"routers = ["cache-aware"]
[fleet]
max_batch_tokens = 4096"#);
        let space = SearchSpace::new(&r, &["max_batch_tokens".to_string()], &BTreeMap::new()).expect("space");
        assert_eq!((space.dims[0].lo, space.dims[0].start, space.dims[0].hi), (256.0, 4096.0, 4096.0));
        assert_eq!(space.base.max_batch_tokens, Some(4096), "the scenario's budget, not the default, is the base");
        // On a log scale: the middle of 256..4096 is 1,024.
        let p = space.policy(&space.values(&[0.5]));
        assert_eq!(p.max_batch_tokens, Some(1024));
        assert_eq!(space.values(&space.start()), [4096.0], "the start maps back to the scenario's budget");
        p.check().expect("a valid policy");
        let default = run(r#"routers = ["cache-aware"]"#);
        assert_eq!(PolicyFile::of_run(&default).max_batch_tokens, None, "the engines' default is left out");
    }

    #[test]
    fn bad_names_and_ranges_are_refused_naming_them() {
        let r = run(r#"routers = ["least-outstanding"]"#);
        let space = SearchSpace::new(&r, &[], &BTreeMap::new()).expect("a router without parameters");
        let names: Vec<&str> = space.dims.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["max_batch_tokens"], "the step budget alone");
        let names = vec!["copy_weight".to_string()];
        let e = SearchSpace::new(&r, &names, &BTreeMap::new()).unwrap_err();
        assert!(
            e.to_string().starts_with(
                "unknown parameter `copy_weight` to tune with least-outstanding (valid: prefill.chunk_tokens"
            ),
            "{e}"
        );
        let r = run(r#"routers = ["dynamo-kv"]"#);
        let range = |lo, hi| [("overlap_score_weight".to_string(), (lo, hi))].into();
        let e = SearchSpace::new(&r, &[], &range(2.0, 1.0)).unwrap_err();
        assert_eq!(e.to_string(), "--range overlap_score_weight: 2:1 is empty (write LO:HI with LO < HI)");
        let e = SearchSpace::new(&r, &[], &range(0.0, 99.0)).unwrap_err();
        assert!(e.to_string().contains("outside its range [0, 16]"), "{e}");
        let e = SearchSpace::new(&r, &[], &[("kv_high_water".to_string(), (0.5, 0.9))].into()).unwrap_err();
        assert!(e.to_string().contains("not a parameter being tuned"), "{e}");
        let e = SearchSpace::new(&r, &["autoscaler.up_load".to_string()], &BTreeMap::new()).unwrap_err();
        assert!(matches!(e, SpaceError::Unknown { .. }), "a colocated fleet has no autoscaler: {e}");
    }
}
