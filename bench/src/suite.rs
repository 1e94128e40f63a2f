//! `fleetplane-bench suite`: how fast the simulator runs the configurations people run, on
//! one core: tiered KV with routers reading the prefix index, P/D pools, a large fleet.
//!
//! | case | fleet | workload |
//! | --- | --- | --- |
//! | `tiered-cache-aware` | `--instances` × the tiers scenario's instance, L1+L2+L3, cache-aware | its trace tiled: `--instances` / 8 copies side by side, wave after wave |
//! | `tiered-dynamo-kv` | the same, dynamo-kv | the same |
//! | `pd-slo-load` | the P/D scenario's `slo-load` run | its phased workload, cut at `--requests` |
//! | `instances-1000` | 1,000 instances, L1+L3 (host memory for 1,000 would not fit this process), cache-aware | the trace tiled 125 copies wide |
//!
//! Each case prints simulated requests per wall-clock second, the peak resident memory of
//! its run (the kernel's high-water mark, reset before each case) and the share of wall time
//! per phase of the driver loop ([`simulator::phases`]). The infinite-cache bound is off: it
//! would hold every distinct block of the tiled trace.

use anyhow::anyhow;
use clap::Args as ClapArgs;
use control::{peak_rss_kib, BenchSize, Failure};
use simulator::phases::{Phase, PhaseTimes};
use simulator::scenario::tiers::KvSection;
use simulator::scenario::{FleetSection, Scenario};
use simulator::sim::{self, RunOutput, SimConfig};
use simulator::workload::{self, Opener};
use std::path::PathBuf;
use std::time::Instant;

/// The cases, in the order they run by default.
const CASES: [&str; 4] = ["tiered-cache-aware", "tiered-dynamo-kv", "pd-slo-load", "instances-1000"];

/// Instances one copy of the trace is sized for (the tiers scenario's fleet).
const INSTANCES_PER_COPY: u32 = 8;

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    pub size: BenchSize,

    /// Cases to run, comma-separated: tiered-cache-aware, tiered-dynamo-kv, pd-slo-load,
    /// instances-1000 [default: all].
    #[arg(long, value_delimiter = ',')]
    pub cases: Option<Vec<String>>,

    /// Scenario of the tiered and large-fleet cases (its trace, instance and [kv] tiers).
    #[arg(long, default_value = "examples/mooncake-tiers.toml")]
    pub tiers_scenario: PathBuf,

    /// Scenario of the P/D case (its `slo-load` run).
    #[arg(long, default_value = "examples/pd-servegen.toml")]
    pub pd_scenario: PathBuf,

    /// Seed of every run.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Tokens of one entry of L2 and L3 in the tiered and large-fleet cases (an offload
    /// chunk: 256 as LMCache keeps them) [default: the tiers scenario's].
    #[arg(long, value_name = "TOKENS")]
    pub offload_chunk_tokens: Option<u32>,
}

/// One measured case.
struct Measured {
    case: String,
    instances: u32,
    wall_s: f64,
    peak_kib: Option<u64>,
    out: RunOutput,
    phases: PhaseTimes,
}

pub fn run(args: Args) -> Result<(), Failure> {
    let cases = args.cases.clone().unwrap_or_else(|| CASES.iter().map(|c| c.to_string()).collect());
    if let Some(bad) = cases.iter().find(|c| !CASES.contains(&c.as_str())) {
        return Err(Failure::Input(anyhow!("unknown case `{bad}` (valid: {})", CASES.join(", "))));
    }
    let header = Phase::ALL.iter().map(|p| format!(" {} |", p.name())).collect::<String>();
    println!("| case | requests | instances | virtual s | wall s | simulated req/s | peak RSS MiB |{header}");
    println!("|{}", " --- |".repeat(7 + Phase::ALL.len()));
    for case in &cases {
        let m = measure(&args, case)?;
        let s = &m.out.summary;
        let simulated = s.requests + s.rejected;
        let peak = m.peak_kib.map_or_else(|| "n/a".into(), |k| format!("{:.0}", k as f64 / 1024.0));
        let shares = Phase::ALL.iter().map(|&p| format!(" {:.1}% |", 100.0 * m.phases.share(p))).collect::<String>();
        println!(
            "| {} | {simulated} | {} | {:.0} | {:.2} | {:.0} | {peak} |{shares}",
            m.case,
            m.instances,
            s.duration_s,
            m.wall_s,
            simulated as f64 / m.wall_s,
        );
    }
    Ok(())
}

fn measure(args: &Args, case: &str) -> Result<Measured, Failure> {
    let input = |e: anyhow::Error| Failure::Input(e);
    let (scenario_path, instances, width) = match case {
        "pd-slo-load" => (&args.pd_scenario, None, None),
        "instances-1000" => (&args.tiers_scenario, Some(1000), Some(1000 / INSTANCES_PER_COPY)),
        _ => (&args.tiers_scenario, Some(args.size.instances), Some(args.size.instances.div_ceil(INSTANCES_PER_COPY))),
    };
    let base = Scenario::load(scenario_path).map_err(|e| input(anyhow!("{}: {e}", scenario_path.display())))?;
    let over = Scenario {
        seed: Some(args.seed),
        routers: match case {
            "tiered-dynamo-kv" => Some(vec!["dynamo-kv".into()]),
            "pd-slo-load" => None,
            _ => Some(vec!["cache-aware".into()]),
        },
        fleet: FleetSection { instances, ..FleetSection::default() },
        kv: KvSection {
            tiers: (case == "instances-1000").then(|| "l1,l3".into()),
            offload_chunk_tokens: args.offload_chunk_tokens,
            ..KvSection::default()
        },
        ..Scenario::default()
    };
    let settings = base.overlay(over).resolve().map_err(|e| input(e.into()))?;
    let run = match case {
        "pd-slo-load" => settings
            .routers
            .iter()
            .find(|r| r.pools.as_ref().and_then(|p| p.label.as_deref()).is_some_and(|l| l.starts_with("slo-load")))
            .ok_or_else(|| input(anyhow!("{}: no run labelled slo-load", scenario_path.display())))?,
        _ => &settings.routers[0],
    };
    let workload = match width {
        Some(width) => {
            let settings = settings.clone();
            let open: Opener = Box::new(move || settings.open_workload(settings.rate_scale));
            workload::tile(open, width, args.size.requests)
        }
        None => workload::limit(
            settings.open_workload(settings.rate_scale).map_err(|e| input(e.into()))?,
            args.size.requests,
        ),
    };
    let config = SimConfig { infinite_cache_bound: false, ..settings.sim_config(run) };
    // Resets the kernel's peak-memory mark, so that each case reports its own peak.
    let peak_reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let started = Instant::now();
    let (out, phases) = sim::run_timed(&config, workload, &mut |_| {}).map_err(|e| input(e.into()))?;
    let wall_s = started.elapsed().as_secs_f64();
    Ok(Measured {
        case: case.to_string(),
        instances: config.pd.as_ref().map_or(config.instances, |_| settings.instances),
        wall_s,
        peak_kib: peak_reset.then(peak_rss_kib).flatten(),
        out,
        phases,
    })
}
