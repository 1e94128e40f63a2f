//! `fleetplane tune`: searches a policy's parameters for a scenario and an objective, on a
//! training slice of the workload, and measures the chosen policy on the held-out rest beside
//! the untuned policy and every other router.
//!
//! The search is CMA-ES (crate `cmaes`) in the unit cube of [`SearchSpace`], seeded by
//! `--seed`: each generation's points are simulated side by side, and since a simulation is a
//! function of its point, the search, its trials and its output are the same on any number of
//! threads. A point outside the cube is simulated at its nearest point of the cube and scored
//! a little worse, so that the search comes back inside.
//!
//! Objectives: `max-rate` (the highest rate scale that meets the attainment target, the
//! `max-rate` command's search, each trial's started from the untuned policy's answer),
//! `goodput` (requests per second that met the SLO, at the scenario's rate) and `cost` (GPU
//! cost per million tokens at the scenario's rate; a trial below the attainment target does
//! not count).

use crate::cli::{describe, SimFlags};
use crate::max_rate::{batch_width, check_precision, run_at, search, Target, DEFAULT_PRECISION};
use crate::Failure;
use anyhow::anyhow;
use clap::{Args as ClapArgs, ValueEnum};
use cmaes::{CMAESOptions, DVector};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use serde::Serialize;
use simulator::metrics::Summary;
use simulator::plot::{plot_search, SearchPlot};
use simulator::policy_file::PolicyFile;
use simulator::report::write_json;
use simulator::scenario::{Scenario, Settings};
use simulator::search_space::{scheduling_params, Dim, SearchSpace};
use simulator::workload::RecordedTrace;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    pub flags: SimFlags,

    /// Print every tunable parameter (each router's, fair prefill's, the KV water marks and the
    /// step budget, each autoscaler's) with its range, default and meaning, and exit; with
    /// --json, also as JSON.
    #[arg(long)]
    pub list_params: bool,

    /// Parameters to tune, comma-separated: a router parameter by its name, `prefill.NAME`
    /// (fair prefill's), `autoscaler.NAME`, `kv_high_water`, `kv_low_water`,
    /// `max_batch_tokens` (the engines' step budget: searched from a sixteenth of the
    /// scenario's to the scenario's), `flow.NAME` (the scenario's flow control rule's)
    /// [default: every parameter of the router, and max_batch_tokens].
    #[arg(long, value_name = "NAME[,NAME...]", value_delimiter = ',')]
    pub params: Vec<String>,

    /// Search NAME between LO and HI instead of a quarter to four times its value (the step
    /// budget: a sixteenth of it to it) (repeat for several).
    #[arg(long = "range", value_name = "NAME=LO:HI", value_parser = parse_range)]
    pub ranges: Vec<(String, (f64, f64))>,

    /// What the search maximizes (max-rate, goodput) or minimizes (cost).
    #[arg(long, value_enum, default_value_t = Objective::MaxRate)]
    pub objective: Objective,

    /// Share of requests that must meet both SLO targets (max-rate's target; cost's floor).
    #[arg(long, value_name = "X", default_value_t = 0.9)]
    pub target_attainment: f64,

    /// Max-rate's precision (see `fleetplane max-rate --precision`): the share within which
    /// each search pins the rate down, and the least gain on the held-out slice counted as one.
    #[arg(long, value_name = "SHARE", default_value_t = DEFAULT_PRECISION)]
    pub precision: f64,

    /// Simulations of the search (whole generations: rounded up to the population size).
    #[arg(long, value_name = "N", default_value_t = 48)]
    pub trials: usize,

    /// Points per CMA-ES generation, simulated side by side [default: 4 + 3 ln(parameters), at least 8].
    #[arg(long, value_name = "N")]
    pub population: Option<usize>,

    /// Share of the workload's requests the search sees (the first ones); the rest is the
    /// held-out slice the result is judged on. A closed loop (agent sessions) is not split:
    /// the search sees its sessions as drawn with --seed, the judgement those of the next seed.
    #[arg(long, value_name = "X", default_value_t = 0.5)]
    pub train_share: f64,

    /// Write the chosen policy as a policy file (TOML, or JSON if it ends in .json), for
    /// `simulate --policy`, `max-rate --policy` and the live fleet's policies.
    #[arg(long, value_name = "PATH")]
    pub out: Option<PathBuf>,

    /// Write the search and the held-out comparison as JSON.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,

    /// Draw the search: every trial's objective on the training slice, the best so far and
    /// the untuned policy's (SVG or PNG).
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Objective {
    MaxRate,
    Goodput,
    Cost,
}

impl Objective {
    fn label(self, target: f64) -> String {
        match self {
            Objective::MaxRate => format!("max rate scale at {:.0}% attainment", 100.0 * target),
            Objective::Goodput => "goodput (req/s meeting the SLO)".into(),
            Objective::Cost => format!("cost per million tokens at {:.0}% attainment", 100.0 * target),
        }
    }

    /// `a` is better than `b`.
    fn better(self, a: f64, b: f64) -> bool {
        match self {
            Objective::MaxRate | Objective::Goodput => a > b,
            Objective::Cost => a < b,
        }
    }

    /// `a` is better than `b` by more than the objective's precision: max-rate's search
    /// stops within `precision`, so a smaller gain may be the bisection's and not the policy's.
    fn beats(self, a: f64, b: f64, precision: f64) -> bool {
        match self {
            Objective::MaxRate => a > b * (1.0 + precision),
            _ => self.better(a, b),
        }
    }

    /// What the optimizer minimizes for a value.
    fn loss(self, value: f64) -> f64 {
        match self {
            Objective::MaxRate | Objective::Goodput => -value,
            Objective::Cost => value,
        }
    }
}

/// `NAME=LO:HI`.
fn parse_range(s: &str) -> Result<(String, (f64, f64)), String> {
    let bad = || format!("`{s}` is not NAME=LO:HI");
    let (name, range) = s.split_once('=').ok_or_else(bad)?;
    let (lo, hi) = range.split_once(':').ok_or_else(bad)?;
    let num = |v: &str| v.trim().parse::<f64>().map_err(|_| format!("`{v}` in `{s}` is not a number"));
    Ok((name.trim().to_string(), (num(lo)?, num(hi)?)))
}

/// One evaluation of a policy on a slice.
#[derive(Clone, Debug, Serialize)]
struct Eval {
    /// The objective's value; `None` where the policy missed the attainment target at every
    /// rate (max-rate) or at the scenario's (cost).
    value: Option<f64>,
    summary: Summary,
}

#[derive(Clone, Debug, Serialize)]
struct Trial {
    trial: usize,
    generation: usize,
    params: BTreeMap<String, f64>,
    value: Option<f64>,
    slo_attainment: f64,
}

#[derive(Debug, Serialize)]
struct HeldOutRun {
    policy: String,
    label: String,
    train: Option<f64>,
    value: Option<f64>,
    summary: Summary,
}

/// The requests one side of the search runs: a range of an open-loop workload's, or a
/// closed loop's sessions as drawn with one seed.
#[derive(Debug, Serialize)]
struct Slice {
    /// `None` for a closed loop: skipping its first turns would leave their sessions hanging.
    skip_requests: Option<u64>,
    /// `None`: all of them (a closed loop's sessions).
    requests: Option<u64>,
    /// The workload's seed.
    seed: u64,
}

impl Slice {
    fn describe(&self) -> String {
        match self.requests {
            Some(n) => {
                let skip = self.skip_requests.unwrap_or(0);
                format!("requests {}..{}", skip, skip + n)
            }
            None => format!("the sessions of seed {}", self.seed),
        }
    }
}

/// The held-out seed of a closed loop tuned on `seed`.
fn held_out_seed(seed: u64) -> u64 {
    seed.wrapping_add(1)
}

#[derive(Debug, Serialize)]
struct TuneReport {
    objective: Objective,
    target_attainment: f64,
    /// Max-rate's precision (the least held-out gain counted as one).
    precision: f64,
    seed: u64,
    train: Slice,
    held_out: Slice,
    space: Vec<Dim>,
    untuned: Trial,
    trials: Vec<Trial>,
    /// The best trial, or the untuned policy where no trial beat it.
    chosen: Trial,
    policy: PolicyFile,
    held_out_runs: Vec<HeldOutRun>,
    /// The chosen policy beat the untuned one on the held-out slice, by more than the
    /// objective's precision.
    improved_on_held_out: bool,
}

pub fn run(args: Args) -> Result<(), Failure> {
    if args.list_params {
        return list_params(&args);
    }
    let input = |e: String| Failure::Input(anyhow!(e));
    if !(args.target_attainment > 0.0 && args.target_attainment <= 1.0) {
        return Err(input(format!("--target-attainment must be in (0, 1], got {}", args.target_attainment)));
    }
    check_precision(args.precision)?;
    if !(args.train_share > 0.0 && args.train_share < 1.0) {
        return Err(input(format!("--train-share must be in (0, 1), got {}", args.train_share)));
    }
    if args.trials == 0 {
        return Err(input("--trials must be at least 1".into()));
    }
    let scenario = args.flags.scenario()?;
    let mut settings = resolve(&scenario)?;
    // Every trial of every slice reads the same trace.
    settings.keep_trace().map_err(|e| Failure::Input(e.into()))?;
    let [run] = settings.routers.as_slice() else {
        return Err(input(format!(
            "tune takes one router (--router NAME, or --policy FILE); got {}",
            settings.routers.len()
        )));
    };
    let ranges: BTreeMap<String, (f64, f64)> = args.ranges.iter().cloned().collect();
    let space = SearchSpace::new(run, &args.params, &ranges).map_err(|e| input(e.to_string()))?;
    // A policy file holds a policy, not a fleet: a run whose variant changes the fleet
    // (`NAME@l1`, `NAME@dspark`) would be tuned on one fleet and written for another.
    let as_policy = resolve(&space.base.overlay(scenario.clone()).map_err(|e| Failure::Input(e.into()))?)?;
    if as_policy.routers[0].tiers != run.tiers || as_policy.routers[0].drafter != run.drafter {
        return Err(input(format!(
            "tune runs a policy on the scenario's fleet, and `{}` changes the fleet (its KV tiers or drafter): set \
             them in the scenario or with flags (--kv-tiers, --spec) instead",
            run.label()
        )));
    }
    let (train, held_out) = slices(&settings, args.train_share)?;
    println!("{}", describe(&settings));
    println!(
        "tuning {} on {} for {}; held out: {}",
        space.dims.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", "),
        train.describe(),
        args.objective.label(args.target_attainment),
        held_out.describe(),
    );

    let population = args.population.unwrap_or_else(|| default_population(space.dims.len()));
    if population < 4 {
        return Err(input(format!("--population must be at least 4, got {population}")));
    }
    let generations = args.trials.div_ceil(population);
    let bar = ProgressBar::new((1 + generations * population) as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} trials {elapsed} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let judge = Judge {
        scenario: &scenario,
        objective: args.objective,
        target: args.target_attainment,
        precision: args.precision,
        quiet: MultiProgress::with_draw_target(ProgressDrawTarget::hidden()),
        recorded: settings.recorded.clone(),
    };

    let untuned_values = space.values(&space.start());
    let untuned_policy = space.policy(&untuned_values);
    let untuned_eval = judge.eval(&untuned_policy, &train, None, 1)?;
    bar.inc(1);
    let untuned = trial(&space, 0, 0, &untuned_values, &untuned_eval);
    // Each max-rate search starts where the untuned policy's ended: few doublings.
    let start_scale = untuned_eval.value;

    let trials = cma_search(&space, &judge, &train, start_scale, population, generations, settings.seed, &bar)?;
    bar.finish_and_clear();

    // The best trial that counted (the earliest of equals); it replaces the untuned policy
    // only where it beats it.
    let mut best: Option<(&Trial, f64)> = None;
    for t in &trials {
        let Some(v) = t.value else { continue };
        if best.is_none_or(|(_, b)| args.objective.better(v, b)) {
            best = Some((t, v));
        }
    }
    let chosen = match best {
        Some((t, v)) if untuned.value.is_none_or(|u| args.objective.better(v, u)) => t.clone(),
        _ => untuned.clone(),
    };
    let policy = space.policy(&space.dims.iter().map(|d| chosen.params[&d.name]).collect::<Vec<_>>());

    // The held-out slice: the chosen policy, the untuned one, every other router as it comes.
    let mut candidates =
        vec![("tuned", policy.clone(), chosen.value), ("untuned", untuned_policy.clone(), untuned.value)];
    for name in policies::RouterConfig::NAMES.iter().filter(|n| **n != untuned_policy.router) {
        let anchor = PolicyFile { router: name.to_string(), router_params: BTreeMap::new(), ..untuned_policy.clone() };
        candidates.push(("anchor", anchor, None));
    }
    eprintln!("judging {} policies on the held-out slice", candidates.len());
    let width = batch_width(candidates.len());
    let held_out_runs = candidates
        .par_iter()
        .map(|(role, p, train_value)| {
            let e = judge.eval(p, &held_out, None, width)?;
            let label = router_label(p);
            Ok(HeldOutRun { policy: role.to_string(), label, train: *train_value, value: e.value, summary: e.summary })
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    let improved = match (held_out_runs[0].value, held_out_runs[1].value) {
        (Some(t), Some(u)) => args.objective.beats(t, u, args.precision),
        (Some(_), None) => true,
        _ => false,
    };

    print!("{}", trials_table(&space, &untuned, &chosen, trials.len(), population));
    print!("{}", held_out_table(&held_out_runs, args.objective));
    if chosen.trial == 0 {
        println!("no trial beat the untuned policy on the training slice: the untuned policy is kept");
    } else if !improved {
        println!(
            "the tuned policy does not beat the untuned one on the held-out slice by more than the objective's \
             precision: it fits the training slice only (overfitting), or the difference is noise; keep the untuned \
             policy"
        );
    }
    println!("\n# chosen policy\n{}", policy.to_toml());
    if let Some(path) = &args.out {
        let text = if path.extension().is_some_and(|e| e == "json") {
            serde_json::to_string_pretty(&policy).map_err(|e| Failure::Output(e.into()))? + "\n"
        } else {
            policy.to_toml()
        };
        std::fs::write(path, text)
            .map_err(|e| Failure::Output(anyhow!("writing the policy to {}: {e}", path.display())))?;
    }
    if let Some(path) = &args.plot {
        let plot = SearchPlot {
            title: format!("tune: {}", untuned_policy.router),
            y_label: args.objective.label(args.target_attainment),
            trials: trials.iter().filter_map(|t| Some((t.trial as f64, t.value?))).collect(),
            untuned: untuned.value,
            maximize: args.objective != Objective::Cost,
        };
        plot_search(path, &plot).map_err(|e| Failure::Output(e.into()))?;
    }
    if let Some(path) = &args.json {
        let report = TuneReport {
            objective: args.objective,
            target_attainment: args.target_attainment,
            precision: args.precision,
            seed: settings.seed,
            train,
            held_out,
            space: space.dims.clone(),
            untuned,
            trials,
            chosen,
            policy,
            held_out_runs,
            improved_on_held_out: improved,
        };
        write_json(path, &report).map_err(|e| Failure::Output(e.into()))?;
    }
    Ok(())
}

fn resolve(scenario: &Scenario) -> Result<Settings, Failure> {
    scenario.clone().resolve().map_err(|e| Failure::Input(anyhow!("invalid settings: {e}")))
}

/// CMA-ES's default population, at least 8 so that a generation keeps several cores busy.
fn default_population(dims: usize) -> usize {
    (4 + (3.0 * (dims as f64).ln()).floor() as usize).max(8)
}

/// The training and held-out slices of the settings' requests: the first `share` of an
/// open-loop workload's requests and the rest; for a closed loop (agent sessions, whose later
/// turns exist only once the earlier ones ran, so that no request count splits them), its
/// sessions as drawn with the scenario's seed and, held out, as drawn with the next seed.
fn slices(settings: &Settings, share: f64) -> Result<(Slice, Slice), Failure> {
    let mut w = settings.open_workload(1.0).map_err(|e| Failure::Input(e.into()))?;
    let (skip, seed) = (settings.skip_requests.unwrap_or(0), settings.seed);
    if w.closed_loop() {
        let (skip, requests) = (settings.skip_requests, settings.max_requests);
        let held_out = Slice { skip_requests: skip, requests, seed: held_out_seed(seed) };
        return Ok((Slice { skip_requests: skip, requests, seed }, held_out));
    }
    let mut n = 0u64;
    while w.next_arrival(Vec::new()).map_err(|e| Failure::Input(e.into()))?.is_some() {
        n += 1;
    }
    let train = (n as f64 * share).floor() as u64;
    if train == 0 || train == n {
        return Err(Failure::Input(anyhow!(
            "the workload has {n} requests: too few to split at --train-share {share} (each slice needs one)"
        )));
    }
    Ok((
        Slice { skip_requests: Some(skip), requests: Some(train), seed },
        Slice { skip_requests: Some(skip + train), requests: Some(n - train), seed },
    ))
}

/// Evaluates policies on slices of the scenario's workload.
struct Judge<'a> {
    scenario: &'a Scenario,
    objective: Objective,
    target: f64,
    precision: f64,
    /// Runs inside a search show no spinners: the trials' bar says how far it is.
    quiet: MultiProgress,
    /// The scenario's trace, read once for every trial (each slice replays its part).
    recorded: Option<Arc<RecordedTrace>>,
}

impl Judge<'_> {
    /// `policy` on `slice`; a max-rate search starts at `start_scale` (or the scenario's
    /// rate), `width` runs at once; the other objectives run at the scenario's rate.
    fn eval(
        &self,
        policy: &PolicyFile,
        slice: &Slice,
        start_scale: Option<f64>,
        width: usize,
    ) -> Result<Eval, Failure> {
        let scenario = policy.overlay(self.scenario.clone()).map_err(|e| Failure::Input(e.into()))?;
        let mut settings = resolve(&scenario)?;
        settings.recorded = self.recorded.clone();
        settings.skip_requests = slice.skip_requests;
        settings.max_requests = slice.requests;
        settings.seed = slice.seed;
        match self.objective {
            Objective::MaxRate => {
                if let Some(s) = start_scale {
                    settings.rate_scale = s;
                }
                let run = &settings.routers[0];
                // Zero: the target is out of reach at any rate (long prompts alone miss it).
                let target = Target { attainment: self.target, class: None, precision: self.precision };
                let (scale, summary) = search(&settings, run, target, width, &self.quiet)?;
                Ok(Eval { value: (scale > 0.0).then_some(scale), summary })
            }
            Objective::Goodput | Objective::Cost => {
                let run = &settings.routers[0];
                let summary = run_at(&settings, run, settings.rate_scale, false, &self.quiet)?;
                let value = match self.objective {
                    Objective::Goodput => Some(summary.goodput_rps),
                    _ => (summary.slo_attainment >= self.target).then_some(summary.cost_per_mtok),
                };
                Ok(Eval { value, summary })
            }
        }
    }
}

fn trial(space: &SearchSpace, trial: usize, generation: usize, values: &[f64], e: &Eval) -> Trial {
    let params = space.dims.iter().zip(values).map(|(d, v)| (d.name.clone(), *v)).collect();
    Trial { trial, generation, params, value: e.value, slo_attainment: e.summary.slo_attainment }
}

/// What the optimizer sees for a trial: the loss, worse by the squared distance outside the
/// cube; a trial that does not count scores worse than any that does.
fn loss(objective: Objective, value: Option<f64>, outside: f64) -> f64 {
    let base = value.map_or(1e12, |v| objective.loss(v));
    base + (base.abs() + 1.0) * outside
}

/// Runs `generations` of CMA-ES from the space's start, `population` trials side by side.
#[allow(clippy::too_many_arguments)]
fn cma_search(
    space: &SearchSpace,
    judge: &Judge,
    train: &Slice,
    start_scale: Option<f64>,
    population: usize,
    generations: usize,
    seed: u64,
    bar: &ProgressBar,
) -> Result<Vec<Trial>, Failure> {
    // Points the search returns to (clamped onto the cube, or integers rounded) are simulated
    // once.
    let seen: Mutex<HashMap<Vec<u64>, Eval>> = Mutex::new(HashMap::new());
    let generation: Mutex<Vec<(Vec<f64>, Eval)>> = Mutex::new(Vec::new());
    let failure: Mutex<Option<Failure>> = Mutex::new(None);
    let width = batch_width(population);
    let objective = |x: &DVector<f64>| -> f64 {
        let values = space.values(x.as_slice());
        let key: Vec<u64> = values.iter().map(|v| v.to_bits()).collect();
        let outside: f64 = x.iter().map(|u| (u - u.clamp(0.0, 1.0)).powi(2)).sum();
        let known = seen.lock().ok().and_then(|s| s.get(&key).cloned());
        let eval = match known {
            Some(e) => e,
            None => match judge.eval(&space.policy(&values), train, start_scale, width) {
                Ok(e) => {
                    if let Ok(mut s) = seen.lock() {
                        s.insert(key, e.clone());
                    }
                    e
                }
                Err(e) => {
                    if let Ok(mut f) = failure.lock() {
                        f.get_or_insert(e);
                    }
                    return f64::MAX;
                }
            },
        };
        bar.inc(1);
        let l = loss(judge.objective, eval.value, outside);
        if let Ok(mut g) = generation.lock() {
            g.push((values, eval));
        }
        l
    };
    let mut cma = CMAESOptions::new(space.start(), 0.3)
        .population_size(population)
        .seed(seed)
        .build(objective)
        .map_err(|e| Failure::Input(anyhow!("the optimizer refused its options: {e:?}")))?;
    let mut trials = Vec::new();
    for g in 1..=generations {
        let stop = cma.next_parallel();
        if let Some(f) = failure.lock().ok().and_then(|mut f| f.take()) {
            return Err(f);
        }
        // The generation's trials in the order of their points: the same on any number of
        // threads.
        let mut points = generation.lock().map(|mut g| std::mem::take(&mut *g)).unwrap_or_default();
        points.sort_by(|a, b| a.0.iter().map(|v| v.to_bits()).cmp(b.0.iter().map(|v| v.to_bits())));
        for (values, eval) in points {
            trials.push(trial(space, trials.len() + 1, g, &values, &eval));
        }
        if stop.is_some() {
            // Converged (every point of a generation alike): more generations add nothing.
            break;
        }
    }
    Ok(trials)
}

/// The router with its parameters, as reports name it, and the step budget the policy sets.
fn router_label(p: &PolicyFile) -> String {
    let router = policies::RouterConfig::with_params(&p.router, &p.router_params)
        .map(|r| r.label())
        .unwrap_or_else(|_| p.router.clone());
    match p.max_batch_tokens {
        Some(budget) => format!("{router}, step budget {budget}"),
        None => router,
    }
}

fn fmt_value(v: Option<f64>) -> String {
    v.map_or("missed".to_string(), |v| format!("{v:.3}"))
}

fn trials_table(space: &SearchSpace, untuned: &Trial, chosen: &Trial, trials: usize, population: usize) -> String {
    let mut out = format!("\nsearch: {trials} trials, {population} per generation (training slice)\n");
    out += &format!("{:<10}", "");
    for d in &space.dims {
        out += &format!("  {:>22}", d.name);
    }
    out += &format!("  {:>10}  {:>10}\n", "objective", "attained");
    for (name, t) in [("range", None), ("untuned", Some(untuned)), ("chosen", Some(chosen))] {
        out += &format!("{name:<10}");
        for d in &space.dims {
            let cell = match t {
                None => format!("{}..{}", short(d.lo), short(d.hi)),
                Some(t) => short(t.params[&d.name]),
            };
            out += &format!("  {cell:>22}");
        }
        match t {
            None => out += "\n",
            Some(t) => {
                out += &format!("  {:>10}  {:>9.1}%", fmt_value(t.value), 100.0 * t.slo_attainment);
                if name == "chosen" && t.trial > 0 {
                    out += &format!("  (trial {})", t.trial);
                }
                out += "\n";
            }
        }
    }
    out
}

fn short(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v}")
    } else {
        format!("{v:.4}")
    }
}

fn held_out_table(runs: &[HeldOutRun], objective: Objective) -> String {
    let untuned = runs.get(1).and_then(|r| r.value);
    let mut out = format!(
        "\nheld-out slice\n{:<8}  {:<48}  {:>10}  {:>10}  {:>10}  {:>10}\n",
        "policy", "router", "training", "held-out", "vs untuned", "attained"
    );
    for r in runs {
        let vs = match (r.value, untuned) {
            (Some(v), Some(u)) if u != 0.0 => format!("{:+.1}%", 100.0 * (v / u - 1.0)),
            _ => "-".to_string(),
        };
        out += &format!(
            "{:<8}  {:<48}  {:>10}  {:>10}  {:>10}  {:>9.1}%\n",
            r.policy,
            r.label,
            r.train.map_or("-".to_string(), |v| format!("{v:.3}")),
            fmt_value(r.value),
            vs,
            100.0 * r.summary.slo_attainment
        );
    }
    if objective == Objective::Cost {
        out += "(cost: lower is better; `missed`: below the attainment target)\n";
    }
    out
}

/// `--list-params`: every policy's parameters, and the engines' other scheduling settings.
fn list_params(args: &Args) -> Result<(), Failure> {
    let catalog = policies::catalog();
    for p in &catalog {
        print!("{p}");
    }
    println!("scheduling (KV high-water protection, the step budget)");
    for p in scheduling_params() {
        let default = if p.name == "max_batch_tokens" { "scenario's" } else { "off" };
        println!("  {:<24} {:>10}  {:<28} {}", p.name, default, p.range(), p.doc);
    }
    println!(
        "\nWith tune --params: a router's parameters by name, fair prefill's as prefill.NAME, an autoscaler's as \
         autoscaler.NAME, kv_high_water, kv_low_water, max_batch_tokens, and the scenario's flow control rule's as \
         flow.NAME."
    );
    if let Some(path) = &args.json {
        #[derive(Serialize)]
        struct Listing<'a> {
            policies: &'a [policies::PolicyParams],
            scheduling: [policies::Param; 3],
        }
        write_json(path, &Listing { policies: &catalog, scheduling: scheduling_params() })
            .map_err(|e| Failure::Output(e.into()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_name_equals_lo_colon_hi() {
        assert_eq!(parse_range("copy_weight=1:8"), Ok(("copy_weight".into(), (1.0, 8.0))));
        assert_eq!(parse_range("copy_weight=1"), Err("`copy_weight=1` is not NAME=LO:HI".into()));
        assert_eq!(parse_range("x=a:2"), Err("`a` in `x=a:2` is not a number".into()));
    }

    #[test]
    fn a_trial_that_misses_or_leaves_the_cube_scores_worse() {
        let o = Objective::MaxRate;
        assert!(loss(o, Some(2.0), 0.0) < loss(o, Some(1.0), 0.0));
        assert!(loss(o, Some(2.0), 0.0) < loss(o, Some(2.0), 0.1));
        assert!(loss(o, Some(0.0), 0.0) < loss(o, None, 0.0));
        let c = Objective::Cost;
        assert!(loss(c, Some(1.0), 0.0) < loss(c, Some(2.0), 0.0));
        assert!(loss(c, Some(1e6), 0.0) < loss(c, None, 0.0));
    }
}
