//! `fleetplane max-rate`: the highest arrival-rate multiplier at which a router still meets
//! the SLO attainment target.
//!
//! Attainment falls as the rate rises, so the search brackets the answer by doubling (or
//! halving) the rate scale from the starting `--rate-scale`, then bisects on a log scale
//! until the bracket is narrower than `--precision` (1%). The reported scale is the highest one that was
//! seen to meet the target, with the summary of that run.
//!
//! All cores: the routers' searches run side by side, and each evaluates several steps at
//! once: the next doublings together, and the next bisection levels as a tree of every rate
//! they could try (2^k − 1 runs for k levels, whichever way each goes). Only the runs the
//! sequential search would have made decide, so the result is the same, byte for byte, on
//! any number of threads (`RAYON_NUM_THREADS=1` is the sequential search).
//!
//! A run that misses the target is used only for that verdict, so on a trace (the same
//! requests at every rate) a search's runs stop as soon as their misses put the target out
//! of reach ([`simulator::sim::GiveUp`]); the first run, whose summary is reported when no
//! rate meets the target, always runs to the end.

use crate::cli::{describe, SimFlags};
use crate::simulate::run_routers;
use crate::Failure;
use clap::Args as ClapArgs;
use indicatif::MultiProgress;
use rayon::prelude::*;

use simulator::metrics::Summary;
use simulator::report::{max_rate_table, write_json, MaxRateReport, MaxRateRun};
use simulator::scenario::{RunSpec, Settings};
use simulator::sim::{GiveUp, RunOutput};
use std::path::PathBuf;

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    pub flags: SimFlags,

    /// Share of requests that must meet both the TTFT and the TPOT target.
    #[arg(long, value_name = "X", default_value_t = 0.9)]
    pub target_attainment: f64,

    /// Whose attainment counts: one class's (`interactive`, `standard`, `batch`; the scenario
    /// needs [workload.classes]) [default: every request's].
    #[arg(long, value_name = "CLASS")]
    pub target_class: Option<engine::Class>,

    /// The search stops when the rate is known within this share (the bisection's bracket);
    /// halving it costs about one more run a search.
    #[arg(long, value_name = "SHARE", default_value_t = DEFAULT_PRECISION)]
    pub precision: f64,

    /// Write {"runs":[{"router":..., "max_rate_scale":X, "summary":{...}}]} as JSON.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
}

/// Doublings or halvings tried before giving up on a bracket.
const MAX_BRACKET_STEPS: u32 = 12;
/// The bisection stops when high / low is below 1 + this.
pub(crate) const DEFAULT_PRECISION: f64 = 0.01;

/// Checks a `--precision`.
pub(crate) fn check_precision(precision: f64) -> Result<f64, Failure> {
    if (1e-4..=0.5).contains(&precision) {
        Ok(precision)
    } else {
        Err(Failure::Input(anyhow::anyhow!("--precision must be in [0.0001, 0.5], got {precision}")))
    }
}

pub fn run(args: Args) -> Result<(), Failure> {
    if !(args.target_attainment > 0.0 && args.target_attainment <= 1.0) {
        return Err(Failure::Input(anyhow::anyhow!(
            "--target-attainment must be in (0, 1], got {}",
            args.target_attainment
        )));
    }
    let mut settings = args.flags.settings()?;
    let precision = check_precision(args.precision)?;
    // Every bisection point of every router reads the same trace.
    settings.keep_trace().map_err(|e| Failure::Input(e.into()))?;
    let target = Target { attainment: args.target_attainment, class: args.target_class, precision };
    if let Some(class) = target.class {
        if settings.classes.as_ref().is_none_or(|c| !c.mix.iter().any(|m| m.class == class)) {
            return Err(Failure::Input(anyhow::anyhow!(
                "--target-class {class}: the scenario's [workload.classes] has no {class} requests"
            )));
        }
    }
    let of = target.class.map(|c| format!(" of {c} requests")).unwrap_or_default();
    println!("{} | target attainment {}{of}", describe(&settings), args.target_attainment);
    // One search per run, side by side, each with its share of the threads.
    let width = batch_width(settings.routers.len());
    let multi = MultiProgress::new();
    let runs = settings
        .routers
        .par_iter()
        .map(|run| {
            let (max_rate_scale, summary) = search(&settings, run, target, width, &multi)?;
            Ok(MaxRateRun { router: run.label(), max_rate_scale, summary })
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    print!("{}", max_rate_table(&runs));
    if let Some(path) = &args.json {
        write_json(path, &MaxRateReport { runs }).map_err(|e| Failure::Output(e.into()))?;
    }
    Ok(())
}

/// One run at rate `scale`; the infinite-cache bound is measured only when `measure_bound`
/// (it depends on the arrivals, not on their rate, so a search measures it once).
pub(crate) fn run_at(
    settings: &Settings,
    run: &RunSpec,
    scale: f64,
    measure_bound: bool,
    multi: &MultiProgress,
) -> Result<Summary, Failure> {
    Ok(run_one(settings, run, scale, measure_bound, None, multi)?.summary)
}

/// One run at rate `scale`, stopping early as [`GiveUp`] says (none: to the end).
fn run_one(
    settings: &Settings,
    run: &RunSpec,
    scale: f64,
    measure_bound: bool,
    give_up: Option<GiveUp>,
    multi: &MultiProgress,
) -> Result<RunOutput, Failure> {
    let mut out = run_routers(settings, std::slice::from_ref(run), scale, measure_bound, give_up, multi)?;
    Ok(out.remove(0))
}

/// A search's run at one rate: its summary, or none when it stopped as soon as it could no
/// longer meet the target (a miss).
type Ran = Option<Summary>;

/// Runs one search makes at once: its share of rayon's threads (shared by `searches`), as
/// the size of a full tree of bisection levels (1, 3, 7, ...). Rounded down: six searches on
/// 16 threads running 3 at once each took 2.3x the CPU time for the same wall time.
pub(crate) fn batch_width(searches: usize) -> usize {
    let share = (rayon::current_num_threads() / searches.max(1)).max(1);
    (1usize << (share + 1).ilog2()) - 1
}

/// The attainment a search holds a run to: of every request, or of one class's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Target {
    pub attainment: f64,
    pub class: Option<engine::Class>,
    /// The share of the rate within which the search pins it down.
    pub precision: f64,
}

impl Target {
    pub(crate) fn met_by(&self, s: &Summary) -> bool {
        let attained = match self.class {
            None => s.slo_attainment,
            Some(c) => s.classes.iter().find(|g| g.name == c.name()).map_or(0.0, |g| g.slo_attainment),
        };
        attained >= self.attainment
    }
}

/// The highest rate scale at which `run` meets `target` attainment, searched from the
/// settings' rate scale with `width` runs at once, and the summary of the run at that scale.
pub(crate) fn search(
    settings: &Settings,
    run: &RunSpec,
    target: Target,
    width: usize,
    multi: &MultiProgress,
) -> Result<(f64, Summary), Failure> {
    search_giving_up(settings, run, target, width, multi, true)
}

/// [`search`], whose runs stop early as misses where they can (`give_up`) or all run to the end.
fn search_giving_up(
    settings: &Settings,
    run: &RunSpec,
    target: Target,
    width: usize,
    multi: &MultiProgress,
    give_up: bool,
) -> Result<(f64, Summary), Failure> {
    let first = run_at(settings, run, settings.rate_scale, true, multi)?;
    let bound = first.max_hit_rate;
    // Every run reads the first one's requests when they come from a trace; a class's
    // attainment needs the class's count, which is not known ahead.
    let give_up = (give_up && settings.fixed_request_count() && target.class.is_none())
        .then(|| GiveUp { attainment: target.attainment, requests: first.requests + first.rejected });
    let search = Search { settings, run, target, width, give_up, multi };
    let (scale, mut best) = search.bisect(first)?;
    best.max_hit_rate = bound;
    Ok((scale, best))
}

/// One router's search.
struct Search<'a> {
    settings: &'a Settings,
    run: &'a RunSpec,
    target: Target,
    /// Runs made at once.
    width: usize,
    /// When a run may stop as a miss.
    give_up: Option<GiveUp>,
    multi: &'a MultiProgress,
}

impl Search<'_> {
    /// The run's summary if it met the target.
    fn met(&self, s: Ran) -> Option<Summary> {
        s.filter(|s| self.target.met_by(s))
    }

    /// Runs at every scale given, side by side; the results in the same order.
    fn runs_at(&self, scales: &[f64]) -> Vec<Result<Ran, Failure>> {
        scales
            .par_iter()
            .map(|&scale| {
                let out = run_one(self.settings, self.run, scale, false, self.give_up, self.multi)?;
                Ok((!out.gave_up).then_some(out.summary))
            })
            .collect()
    }

    /// Brackets then bisects the rate scale, from the run at the scenario's rate.
    fn bisect(&self, first: Summary) -> Result<(f64, Summary), Failure> {
        let start = self.settings.rate_scale;
        let (mut low, mut high, mut best) = if self.target.met_by(&first) {
            // Doubling until a rate misses; meeting the target at every rate tried reports
            // the highest.
            let b = self.bracket(start, 2.0, false)?;
            let best = b.last_run.unwrap_or(first);
            match b.stop {
                Some((high, _)) => (b.last, high, best),
                None => return Ok((b.last, best)),
            }
        } else {
            // Halving until a rate meets it; missing even at a tiny rate means the SLO is out
            // of reach for this fleet.
            let b = self.bracket(start, 0.5, true)?;
            match b.stop {
                Some((low, Some(best))) => (low, b.last, best),
                _ => return Ok((0.0, first)),
            }
        };
        let bracket = 1.0 + self.target.precision;
        while high / low > bracket {
            // The next levels of bisection, every way they could go, breadth first: node i's
            // halves are nodes 2i + 1 (it missed) and 2i + 2 (it met the target).
            let mut tree = vec![None; self.width];
            let mut brackets = vec![(low, high); self.width];
            for i in 0..self.width {
                let (lo, hi) = brackets[i];
                if (i > 0 && tree[(i - 1) / 2].is_none()) || hi / lo <= bracket {
                    continue;
                }
                let mid = (lo * hi).sqrt();
                tree[i] = Some(mid);
                for (child, bracket) in [(2 * i + 1, (lo, mid)), (2 * i + 2, (mid, hi))] {
                    if child < self.width {
                        brackets[child] = bracket;
                    }
                }
            }
            let scales: Vec<f64> = tree.iter().flatten().copied().collect();
            let mut results = self.runs_at(&scales).into_iter();
            let mut results: Vec<Option<Result<Ran, Failure>>> =
                tree.iter().map(|m| m.and_then(|_| results.next())).collect();
            // Down the path the sequential search takes.
            let mut i = 0;
            while let Some(mid) = tree.get(i).copied().flatten() {
                let s = results[i].take().expect("a run for every rate of the tree")?;
                match self.met(s) {
                    Some(s) => {
                        low = mid;
                        best = s;
                        i = 2 * i + 2;
                    }
                    None => {
                        high = mid;
                        i = 2 * i + 1;
                    }
                }
            }
        }
        Ok((low, best))
    }

    /// Multiplies the scale by `factor` from `start` until a run meets the target (`until_met`)
    /// or misses it, at most `MAX_BRACKET_STEPS` times, `width` runs at once.
    fn bracket(&self, start: f64, factor: f64, until_met: bool) -> Result<Bracket, Failure> {
        let (mut last, mut last_run) = (start, None);
        let mut steps = 0;
        while steps < MAX_BRACKET_STEPS {
            let n = self.width.min((MAX_BRACKET_STEPS - steps) as usize);
            // Scaling by a power of two is exact: these are the sequential loop's scales.
            let scales: Vec<f64> = (1..=n as i32).map(|j| last * factor.powi(j)).collect();
            for (scale, s) in scales.iter().zip(self.runs_at(&scales)) {
                steps += 1;
                match (self.met(s?), until_met) {
                    (Some(s), true) => return Ok(Bracket { last, last_run, stop: Some((*scale, Some(s))) }),
                    (None, false) => return Ok(Bracket { last, last_run, stop: Some((*scale, None)) }),
                    (s, _) => (last, last_run) = (*scale, s),
                }
            }
        }
        Ok(Bracket { last, last_run, stop: None })
    }
}

/// Where [`Search::bracket`] ended.
struct Bracket {
    /// The last scale before the stop (the start if none), and its run if it met the target.
    last: f64,
    last_run: Option<Summary>,
    /// The scale where it stopped, and its run if it met the target; none if it never did.
    stop: Option<(f64, Option<Summary>)>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use simulator::scenario::Scenario;

    /// Runs that stop as soon as they miss change no search: every router of the tiered
    /// Mooncake example, from a rate that meets the target (doubling) and from one that
    /// misses it (halving), finds the same scale and reports the same summary as runs to the
    /// end.
    #[test]
    fn giving_up_on_missing_runs_changes_no_result() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/mooncake-tiers.toml");
        let mut scenario = Scenario::load(&path).expect("loads");
        scenario.workload.max_requests = Some(400);
        let mut settings = scenario.resolve().expect("valid");
        let multi = MultiProgress::new();
        let target = Target { attainment: 0.9, class: None, precision: DEFAULT_PRECISION };
        for start in [1.0, 64.0] {
            settings.rate_scale = start;
            for run in &settings.routers {
                let json = |give_up| {
                    let Ok((scale, summary)) = search_giving_up(&settings, run, target, 3, &multi, give_up) else {
                        panic!("{} from x{start}: the search failed", run.label())
                    };
                    serde_json::to_string(&(scale, summary)).expect("JSON")
                };
                assert_eq!(json(true), json(false), "{} from x{start}", run.label());
            }
        }
    }
}
