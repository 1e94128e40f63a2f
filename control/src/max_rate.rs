//! `fleetplane max-rate`: the highest arrival-rate multiplier at which a router still meets
//! the SLO attainment target.
//!
//! Attainment falls as the rate rises, so the search brackets the answer by doubling (or
//! halving) the rate scale from the starting `--rate-scale`, then bisects on a log scale
//! until the bracket is narrower than 1%. The reported scale is the highest one that was
//! seen to meet the target, with the summary of that run.
//!
//! All cores: the routers' searches run side by side, and each evaluates several steps at
//! once: the next doublings together, and the next bisection levels as a tree of every rate
//! they could try (2^k − 1 runs for k levels, whichever way each goes). Only the runs the
//! sequential search would have made decide, so the result is the same, byte for byte, on
//! any number of threads (`RAYON_NUM_THREADS=1` is the sequential search).

use crate::cli::{describe, SimFlags};
use crate::simulate::run_routers;
use crate::Failure;
use clap::Args as ClapArgs;
use indicatif::MultiProgress;
use rayon::prelude::*;

use simulator::metrics::Summary;
use simulator::report::{max_rate_table, write_json, MaxRateReport, MaxRateRun};
use simulator::scenario::{RunSpec, Settings};
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

    /// Write {"runs":[{"router":..., "max_rate_scale":X, "summary":{...}}]} as JSON.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
}

/// Doublings or halvings tried before giving up on a bracket.
const MAX_BRACKET_STEPS: u32 = 12;
/// The bisection stops when high / low is below this.
pub(crate) const PRECISION: f64 = 1.01;

pub fn run(args: Args) -> Result<(), Failure> {
    if !(args.target_attainment > 0.0 && args.target_attainment <= 1.0) {
        return Err(Failure::Input(anyhow::anyhow!(
            "--target-attainment must be in (0, 1], got {}",
            args.target_attainment
        )));
    }
    let settings = args.flags.settings()?;
    let target = Target { attainment: args.target_attainment, class: args.target_class };
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
    let mut out = run_routers(settings, std::slice::from_ref(run), scale, measure_bound, multi)?;
    Ok(out.remove(0).summary)
}

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
    let first = run_at(settings, run, settings.rate_scale, true, multi)?;
    let bound = first.max_hit_rate;
    let search = Search { settings, run, target, width, multi };
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
    multi: &'a MultiProgress,
}

impl Search<'_> {
    fn meets(&self, s: &Summary) -> bool {
        self.target.met_by(s)
    }

    /// Runs at every scale given, side by side; the results in the same order.
    fn runs_at(&self, scales: &[f64]) -> Vec<Result<Summary, Failure>> {
        scales.par_iter().map(|&scale| run_at(self.settings, self.run, scale, false, self.multi)).collect()
    }

    /// Brackets then bisects the rate scale, from the run at the scenario's rate.
    fn bisect(&self, first: Summary) -> Result<(f64, Summary), Failure> {
        let start = self.settings.rate_scale;
        let (mut low, mut high, mut best) = if self.meets(&first) {
            // Doubling until a rate misses; meeting the target at every rate tried reports
            // the highest.
            let b = self.bracket(start, 2.0, |s| !self.meets(s))?;
            let best = b.last_run.unwrap_or(first);
            match b.stop {
                Some((high, _)) => (b.last, high, best),
                None => return Ok((b.last, best)),
            }
        } else {
            // Halving until a rate meets it; missing even at a tiny rate means the SLO is out
            // of reach for this fleet.
            let b = self.bracket(start, 0.5, |s| self.meets(s))?;
            match b.stop {
                Some((low, best)) => (low, b.last, best),
                None => return Ok((0.0, first)),
            }
        };
        while high / low > PRECISION {
            // The next levels of bisection, every way they could go, breadth first: node i's
            // halves are nodes 2i + 1 (it missed) and 2i + 2 (it met the target).
            let mut tree = vec![None; self.width];
            let mut brackets = vec![(low, high); self.width];
            for i in 0..self.width {
                let (lo, hi) = brackets[i];
                if (i > 0 && tree[(i - 1) / 2].is_none()) || hi / lo <= PRECISION {
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
            let mut results: Vec<Option<Result<Summary, Failure>>> =
                tree.iter().map(|m| m.and_then(|_| results.next())).collect();
            // Down the path the sequential search takes.
            let mut i = 0;
            while let Some(mid) = tree.get(i).copied().flatten() {
                let s = results[i].take().expect("a run for every rate of the tree")?;
                if self.meets(&s) {
                    low = mid;
                    best = s;
                    i = 2 * i + 2;
                } else {
                    high = mid;
                    i = 2 * i + 1;
                }
            }
        }
        Ok((low, best))
    }

    /// Multiplies the scale by `factor` from `start` until `stop` holds, at most
    /// `MAX_BRACKET_STEPS` times, `width` runs at once.
    fn bracket(&self, start: f64, factor: f64, stop: impl Fn(&Summary) -> bool) -> Result<Bracket, Failure> {
        let (mut last, mut last_run) = (start, None);
        let mut steps = 0;
        while steps < MAX_BRACKET_STEPS {
            let n = self.width.min((MAX_BRACKET_STEPS - steps) as usize);
            // Scaling by a power of two is exact: these are the sequential loop's scales.
            let scales: Vec<f64> = (1..=n as i32).map(|j| last * factor.powi(j)).collect();
            for (scale, s) in scales.iter().zip(self.runs_at(&scales)) {
                steps += 1;
                let s = s?;
                if stop(&s) {
                    return Ok(Bracket { last, last_run, stop: Some((*scale, s)) });
                }
                (last, last_run) = (*scale, Some(s));
            }
        }
        Ok(Bracket { last, last_run, stop: None })
    }
}

/// Where [`Search::bracket`] ended.
struct Bracket {
    /// The last scale before the stop (the start if none), and its run.
    last: f64,
    last_run: Option<Summary>,
    /// The scale where it stopped, and its run; none if it never did.
    stop: Option<(f64, Summary)>,
}
