//! `fleetplane simulate`: every router on the same arrivals, side by side.

use crate::cli::{describe, SimFlags};
use crate::progress::RunProgress;
use crate::Failure;
use anyhow::anyhow;
use clap::Args as ClapArgs;
use indicatif::MultiProgress;
use rayon::prelude::*;

use cost::{check_steps, load_profile, StepCheck};
use simulator::plot::{plot_cdfs, plot_timeline, CdfSeries, TimelineSeries};
use simulator::report::{comparison_table, groups_table, pools_table, sessions_table, write_json, Report, RunReport};
use simulator::scenario::{RunSpec, Settings};
use simulator::sim::{self, GiveUp, RunOutput, SimConfig};
use std::path::PathBuf;

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    pub flags: SimFlags,

    /// Write the results as JSON: {"runs":[{"router":..., "summary":{...}}]}.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,

    /// Draw TTFT and TPOT CDFs per router (SVG or PNG, by the file's extension).
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,

    /// Draw the time series of runs with pools (SLO attainment per window, GPUs, instances
    /// per pool, SLO loads; SVG or PNG). Runs get a time series with --mode pd or a scenario's
    /// [pools] timeline_s.
    #[arg(long, value_name = "PATH")]
    pub timeline_plot: Option<PathBuf>,

    /// Check the cost model (calibrated with --profile, or not) against the steps an engine
    /// served (`fleetplane engine --step-log FILE`): predicted against measured time, for
    /// decode-only steps and steps with prompt tokens.
    #[arg(long, value_name = "FILE.json")]
    pub check_steps: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<(), Failure> {
    let mut settings = args.flags.settings()?;
    if settings.routers.len() > 1 {
        // The routers side by side read the same trace.
        settings.keep_trace().map_err(|e| Failure::Input(e.into()))?;
    }
    println!("{}", describe(&settings));
    let step_check = match &args.check_steps {
        Some(path) => {
            let log = load_profile(path).map_err(|e| Failure::Input(e.into()))?;
            let check = check_steps(&settings.cost, &log)
                .map_err(|e| Failure::Input(anyhow!("--check-steps {}: {e}", path.display())))?;
            print!("{}", step_check_table(&check));
            Some(check)
        }
        None => None,
    };
    let outputs = run_routers(&settings, &settings.routers, settings.rate_scale, true, None, &MultiProgress::new())?;
    for o in &outputs {
        if let Some(why) = &o.first_rejection {
            eprintln!("warning: {}: {} requests refused; first: {why}", o.router, o.summary.rejected);
        }
    }
    let runs: Vec<RunReport> = outputs
        .iter()
        .map(|o| RunReport { router: o.router.clone(), summary: o.summary.clone(), decisions: o.decisions.clone() })
        .collect();
    print!("{}", comparison_table(&runs));
    for table in [pools_table(&runs), groups_table(&runs), sessions_table(&runs)] {
        if !table.is_empty() {
            print!("\n{table}");
        }
    }
    if let Some(path) = &args.json {
        write_json(path, &Report { runs, calibration: settings.calibration.clone(), step_check })
            .map_err(|e| Failure::Output(e.into()))?;
    }
    if let Some(path) = &args.plot {
        let series: Vec<CdfSeries> = outputs
            .iter()
            .map(|o| CdfSeries { label: o.router.clone(), ttft: o.ttft_cdf.clone(), tpot: o.tpot_cdf.clone() })
            .collect();
        plot_cdfs(path, &series).map_err(|e| Failure::Output(e.into()))?;
    }
    if let Some(path) = &args.timeline_plot {
        let series: Vec<TimelineSeries> = outputs
            .iter()
            .filter_map(|o| {
                let p = o.summary.pools.as_ref()?;
                Some(TimelineSeries {
                    label: o.router.clone(),
                    points: p.timeline.clone(),
                    shifts_s: p.shifts_s.clone(),
                })
            })
            .collect();
        plot_timeline(path, &series).map_err(|e| Failure::Output(e.into()))?;
    }
    Ok(())
}

/// Runs the routers side by side on rayon's threads (runs share nothing but a trace kept in
/// memory, [`Settings::keep_trace`]; each opens the workload afresh, so all see the same
/// arrivals). Results come back in the order the routers were given.
///
/// The infinite-cache bound depends on the arrivals alone, so only the first run measures it
/// (when `measure_bound`) and the others report its value. Each run longer than a second
/// shows a spinner in `multi`.
pub fn run_routers(
    settings: &Settings,
    routers: &[RunSpec],
    rate_scale: f64,
    measure_bound: bool,
    give_up: Option<GiveUp>,
    multi: &MultiProgress,
) -> Result<Vec<RunOutput>, Failure> {
    let results: Vec<Result<RunOutput, Failure>> = routers
        .par_iter()
        .enumerate()
        .map(|(i, run)| {
            let mut progress = RunProgress::new(multi, run.label());
            let workload = settings.open_workload(rate_scale).map_err(|e| Failure::Input(e.into()))?;
            let config =
                SimConfig { infinite_cache_bound: measure_bound && i == 0, give_up, ..settings.sim_config(run) };
            sim::run(&config, workload, &mut |p| progress.update(p)).map_err(|e| Failure::Input(e.into()))
        })
        .collect();
    let mut outputs = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    let bound = outputs.first().and_then(|o| o.summary.max_hit_rate);
    for o in &mut outputs {
        o.summary.max_hit_rate = bound;
    }
    Ok(outputs)
}

/// The cost model against served steps, one row per class of step.
fn step_check_table(c: &StepCheck) -> String {
    let mut out = format!(
        "cost model against {} served steps ({})\n{:<14}  {:>6}  {:>11}  {:>12}  {:>10}  {:>12}  {:>16}\n",
        c.all.steps,
        c.source,
        "steps",
        "count",
        "measured s",
        "predicted s",
        "sum error",
        "median error",
        "median |error|"
    );
    for (name, k) in [("all", &c.all), ("decode only", &c.decode_only), ("with prefill", &c.with_prefill)] {
        let sum = if k.measured_s > 0.0 { 100.0 * (k.predicted_s / k.measured_s - 1.0) } else { 0.0 };
        out += &format!(
            "{name:<14}  {:>6}  {:>11.2}  {:>12.2}  {sum:>+9.1}%  {:>+11.1}%  {:>15.1}%\n",
            k.steps,
            k.measured_s,
            k.predicted_s,
            100.0 * k.median_error,
            100.0 * k.median_abs_error
        );
    }
    out
}
