//! `fleetplane bench`: how fast the simulator runs, on one core.
//!
//! The workload is fixed (see `SyntheticConfig::bench_default`): a million synthetic requests
//! with shared prefixes on 64 instances of Llama-3.1-8B on H100 (TP 1), routed by
//! least-outstanding. It prints simulated requests per wall-clock second and the process's
//! peak resident memory.

use crate::Failure;
use anyhow::anyhow;
use clap::Args as ClapArgs;
use control::{peak_rss_kib, BenchSize};
use simulator::scenario::{FleetSection, Scenario, WorkloadSection};
use simulator::sim::{self, SimConfig};
use simulator::workload::SyntheticConfig;
use std::time::Instant;

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    pub size: BenchSize,

    /// Seed of the synthetic workload.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

pub fn run(args: Args) -> Result<(), Failure> {
    let mut synthetic = SyntheticConfig::bench_default();
    synthetic.requests = args.size.requests;
    let scenario = Scenario {
        seed: Some(args.seed),
        routers: Some(vec!["least-outstanding".into()]),
        fleet: FleetSection {
            instances: Some(args.size.instances),
            model: Some("llama-3.1-8b".into()),
            gpu: Some("h100".into()),
            tp: Some(1),
            ..FleetSection::default()
        },
        workload: WorkloadSection { synthetic: Some(synthetic), ..WorkloadSection::default() },
        ..Scenario::default()
    };
    let settings = scenario.resolve().map_err(|e| Failure::Input(e.into()))?;
    let run = &settings.routers[0];
    let workload = settings.open_workload(settings.rate_scale).map_err(|e| Failure::Input(e.into()))?;
    let started = Instant::now();
    // The infinite-cache bound would hold every distinct block of a million prompts.
    let config = SimConfig { infinite_cache_bound: false, ..settings.sim_config(run) };
    let out = sim::run(&config, workload, &mut |_| {}).map_err(|e| Failure::Input(e.into()))?;
    let wall_s = started.elapsed().as_secs_f64();
    let s = &out.summary;
    let simulated = s.requests + s.rejected;
    let peak_mib = peak_rss_kib().map(|k| format!("{:.1}", k as f64 / 1024.0)).unwrap_or_else(|| "n/a".into());
    println!(
        "| requests | instances | virtual s | wall s | simulated req/s | peak RSS MiB | SLO attainment | cache hit |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| {simulated} | {} | {:.0} | {wall_s:.2} | {:.0} | {peak_mib} | {:.3} | {:.3} |",
        args.size.instances,
        s.duration_s,
        simulated as f64 / wall_s,
        s.slo_attainment,
        s.cache_hit_rate
    );
    if simulated != args.size.requests {
        return Err(Failure::Output(anyhow!("simulated {simulated} requests of {}", args.size.requests)));
    }
    Ok(())
}
