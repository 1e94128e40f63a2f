//! `fleetplane max-rate`: the highest arrival-rate multiplier at which a router still meets
//! the SLO attainment target.
//!
//! Attainment falls as the rate rises, so the search brackets the answer by doubling (or
//! halving) the rate scale from the starting `--rate-scale`, then bisects on a log scale
//! until the bracket is narrower than 1%. The reported scale is the highest one that was
//! seen to meet the target, with the summary of that run.

use crate::cli::{describe, SimFlags};
use crate::simulate::run_routers;
use crate::Failure;
use clap::Args as ClapArgs;

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

    /// Write {"runs":[{"router":..., "max_rate_scale":X, "summary":{...}}]} as JSON.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
}

/// Doublings or halvings tried before giving up on a bracket.
const MAX_BRACKET_STEPS: u32 = 12;
/// The bisection stops when high / low is below this.
const PRECISION: f64 = 1.01;

pub fn run(args: Args) -> Result<(), Failure> {
    if !(args.target_attainment > 0.0 && args.target_attainment <= 1.0) {
        return Err(Failure::Input(anyhow::anyhow!(
            "--target-attainment must be in (0, 1], got {}",
            args.target_attainment
        )));
    }
    let settings = args.flags.settings()?;
    println!("{} | target attainment {}", describe(&settings), args.target_attainment);
    // One search per run, side by side (each bisection step is one simulation).
    let results: Vec<Result<MaxRateRun, Failure>> = std::thread::scope(|scope| {
        let settings = &settings;
        let handles: Vec<_> = settings
            .routers
            .iter()
            .map(|run| {
                scope.spawn(move || {
                    let (max_rate_scale, summary) = search(settings, run, args.target_attainment)?;
                    Ok(MaxRateRun { router: run.label(), max_rate_scale, summary })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Failure::Output(anyhow::anyhow!("a search thread panicked")))))
            .collect()
    });
    let runs = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    print!("{}", max_rate_table(&runs));
    if let Some(path) = &args.json {
        write_json(path, &MaxRateReport { runs }).map_err(|e| Failure::Output(e.into()))?;
    }
    Ok(())
}

/// One run at rate `scale`; the infinite-cache bound is measured only when `measure_bound`
/// (it depends on the arrivals, not on their rate, so a search measures it once).
fn run_at(settings: &Settings, run: &RunSpec, scale: f64, measure_bound: bool) -> Result<Summary, Failure> {
    let mut out = run_routers(settings, std::slice::from_ref(run), scale, measure_bound)?;
    Ok(out.remove(0).summary)
}

fn search(settings: &Settings, run: &RunSpec, target: f64) -> Result<(f64, Summary), Failure> {
    let first = run_at(settings, run, settings.rate_scale, true)?;
    let bound = first.max_hit_rate;
    let (scale, mut best) = bisect(settings, run, target, first)?;
    best.max_hit_rate = bound;
    Ok((scale, best))
}

/// Brackets then bisects the rate scale, from the run at the scenario's rate.
fn bisect(settings: &Settings, run: &RunSpec, target: f64, first: Summary) -> Result<(f64, Summary), Failure> {
    let attainment_at = |settings, run, scale| run_at(settings, run, scale, false);
    let meets = |s: &Summary| s.slo_attainment >= target;
    let start = settings.rate_scale;
    let (mut low, mut high, mut best) = if meets(&first) {
        let (mut low, mut best) = (start, first);
        let mut high = None;
        for _ in 0..MAX_BRACKET_STEPS {
            let s = attainment_at(settings, run, low * 2.0)?;
            if !meets(&s) {
                high = Some(low * 2.0);
                break;
            }
            low *= 2.0;
            best = s;
        }
        // Meets the target at every rate tried: report the highest.
        let Some(high) = high else { return Ok((low, best)) };
        (low, high, best)
    } else {
        let mut high = start;
        let mut found = None;
        for _ in 0..MAX_BRACKET_STEPS {
            let s = attainment_at(settings, run, high / 2.0)?;
            if meets(&s) {
                found = Some((high / 2.0, s));
                break;
            }
            high /= 2.0;
        }
        // Misses the target even at a tiny rate (the SLO is out of reach for this fleet).
        let Some((low, best)) = found else { return Ok((0.0, first)) };
        (low, high, best)
    };
    while high / low > PRECISION {
        let mid = (low * high).sqrt();
        let s = attainment_at(settings, run, mid)?;
        if meets(&s) {
            low = mid;
            best = s;
        } else {
            high = mid;
        }
    }
    Ok((low, best))
}
