//! `fleetplane`: the command-line entry point.
//!
//! | module | command |
//! | --- | --- |
//! | `cli` | flags shared by the simulation commands, turned into a scenario overlay |
//! | `simulate` | `fleetplane simulate`: routers side by side on the same arrivals |
//! | `max_rate` | `fleetplane max-rate`: the highest rate that meets the SLO, per router |
//! | `bench` | `fleetplane bench`: simulator speed and memory on a million requests |
//! | `bench_matching` | `fleetplane bench-matching`: chunked prefill's prefix matching, cursor vs rescan |
//! | `bench_index` | `fleetplane bench-index`: the global prefix index's event rate, query latency and memory |
//! | `capacity` | `fleetplane capacity`: KV capacity and step times of a model, GPU and layout, without a trace |
//! | `progress` | progress display on stderr for runs longer than a second |

mod bench;
mod bench_index;
mod bench_matching;
mod capacity;
mod cli;
mod max_rate;
mod progress;
mod simulate;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// Control plane of an LLM inference fleet: cache-aware placement, long-request protection,
/// P/D pool sizing. This build has the policy simulator.
#[derive(Parser, Debug)]
#[command(name = "fleetplane", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replay a trace (or a synthetic workload) against a simulated fleet, one run per router
    /// on the same arrivals, and print a side-by-side comparison.
    Simulate(simulate::Args),
    /// Find, per router, the highest --rate-scale at which SLO attainment still meets a target.
    MaxRate(max_rate::Args),
    /// Measure the simulator: a million synthetic requests on 64 instances; prints requests
    /// simulated per wall-clock second and peak memory.
    Bench(bench::Args),
    /// Measure the KV cache's per-sequence cursor: a 128K-token prompt prefilled in 8K chunks,
    /// matching and insertion resumed from the cursor vs rescanned from the root at every chunk.
    BenchMatching(bench_matching::Args),
    /// Measure the global prefix index: 1,000 instances and 10M indexed blocks; prints KV
    /// events applied per second, query latency percentiles and bytes per block.
    BenchIndex(bench_index::Args),
    /// Print KV capacity (tokens per GPU, per instance, per node), the largest batch at a
    /// context and prefill and decode step times for a model, GPU and deployment layout
    /// (--tp, --dp-attention, --ep), from the cost model alone.
    Capacity(capacity::Args),
}

/// Exit codes: 1 for a failure while running, 2 for bad input (flags, scenario, trace),
/// 3 for an output that could not be written.
pub enum Failure {
    Input(anyhow::Error),
    Output(anyhow::Error),
}

impl Failure {
    fn report(self) -> ExitCode {
        let (code, err) = match self {
            Failure::Input(e) => (2, e),
            Failure::Output(e) => (3, e),
        };
        eprintln!("error: {err:#}");
        ExitCode::from(code)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Simulate(args) => simulate::run(args),
        Command::MaxRate(args) => max_rate::run(args),
        Command::Bench(args) => bench::run(args),
        Command::BenchMatching(args) => bench_matching::run(args),
        Command::BenchIndex(args) => bench_index::run(args),
        Command::Capacity(args) => capacity::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => f.report(),
    }
}
