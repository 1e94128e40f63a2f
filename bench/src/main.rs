//! `fleetplane-bench`: the developer's benchmarks of fleetplane's parts, kept out of the
//! product binary (`fleetplane bench`, the simulator's speed, stays there).
//!
//! | module | command |
//! | --- | --- |
//! | `suite` | `fleetplane-bench suite`: the simulator on tiered, cache-aware, P/D and 1,000-instance fleets |
//! | `matching` | `fleetplane-bench matching`: chunked prefill's prefix matching, cursor vs rescan |
//! | `index` | `fleetplane-bench index`: the global prefix index's event rate, query latency and memory |
//! | `gateway` | `fleetplane-bench gateway`: latency the gateway adds over calling an engine directly |

mod gateway;
mod index;
mod matching;
mod suite;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// Benchmarks of fleetplane's simulator, KV cache, prefix index and gateway.
#[derive(Parser, Debug)]
#[command(name = "fleetplane-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Measure the simulator on the configurations people run: a trace tiled to a million
    /// requests on 64 instances with L1+L2+L3 (cache-aware, dynamo-kv), P/D pools under
    /// slo-load, 1,000 instances; prints simulated req/s, peak memory and time per phase.
    Suite(suite::Args),
    /// Measure the KV cache's per-sequence cursor: a 128K-token prompt prefilled in 8K chunks,
    /// matching and insertion resumed from the cursor vs rescanned from the root at every chunk.
    Matching(matching::Args),
    /// Measure the global prefix index: 1,000 instances and 10M indexed blocks; prints KV
    /// events applied per second, query latency percentiles and bytes per block.
    Index(index::Args),
    /// Measure the gateway: the same load sent to an engine directly over gRPC and through
    /// `fleetplane serve`'s OpenAI API; prints latency percentiles and the difference.
    Gateway(gateway::Args),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Suite(args) => suite::run(args),
        Command::Matching(args) => matching::run(args),
        Command::Index(args) => index::run(args),
        Command::Gateway(args) => gateway::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => f.report(),
    }
}
