//! `fleetplane`: the command-line entry point.
//!
//! | module | command |
//! | --- | --- |
//! | `cli` | flags shared by the simulation commands, turned into a scenario overlay |
//! | `simulate` | `fleetplane simulate`: routers side by side on the same arrivals |
//! | `max_rate` | `fleetplane max-rate`: the highest rate that meets the SLO, per router |
//! | `tune` | `fleetplane tune`: a policy's parameters searched (CMA-ES) on one slice, judged on the rest |
//! | `bench` | `fleetplane bench`: simulator speed and memory on a million requests |
//! | `capacity` | `fleetplane capacity`: KV capacity and step times of a model, GPU and layout, without a trace |
//! | `make_model` | `fleetplane make-model`: a random-weight Llama model in the Hugging Face layout |
//! | `profile` | `fleetplane profile`: the CUDA engine's step times over batch shapes, for `simulate --profile` |
//! | `profile_vllm` | `fleetplane profile-vllm`: a vLLM server's step times through its API, for `simulate --profile` |
//! | `progress` | progress display on stderr for runs longer than a second |
//! | `serve` | `fleetplane serve`: the live control plane (gateway, API, metrics, engine registry, PostgreSQL) |
//! | `engine_proc` | `fleetplane engine`: one engine instance as a gRPC process |
//! | `demo` | `fleetplane demo`: serve, a few sim engines and a trace replayer, on this machine |
//! | `replay` | `fleetplane replay`: sends a workload's requests through a gateway in real time |
//! | `scheduling` | an engine's prefill policy and KV water marks on the wire, checked |
//!
//! The library (`lib.rs`) holds what `fleetplane-bench` (`bench/`, the developer's benchmarks)
//! shares with this binary: the protocol (`proto`, proto/fleetplane.proto), the engine token
//! (`engine_auth`), child processes (`child`) and exit codes.

mod bench;
mod capacity;
mod cli;
mod demo;
mod engine_proc;
mod latency;
mod make_model;
mod max_rate;
mod profile;
mod profile_vllm;
mod progress;
mod replay;
mod scheduling;
mod serve;
mod simulate;
mod tokenizer;
mod tune;

use clap::{Parser, Subcommand};
// The protocol, the engine token and exit codes are the library's, shared with
// `fleetplane-bench` (the developer's benchmarks, `bench/`).
use control::{engine_auth, proto, Failure};
use std::process::ExitCode;

/// Control plane of an LLM inference fleet: cache-aware placement, long-request protection,
/// P/D pool sizing: the policy simulator, the live control plane and its engine processes.
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
    /// Search a policy's parameters (router weights and guards, fair prefill, KV water marks,
    /// autoscaler) for an objective on a training slice of the workload, judge the result on
    /// the held-out rest beside the untuned policy and every other router, and write it as a
    /// policy file.
    Tune(tune::Args),
    /// Measure the simulator: a million synthetic requests on 64 instances; prints requests
    /// simulated per wall-clock second and peak memory.
    Bench(bench::Args),
    /// Print KV capacity (tokens per GPU, per instance, per node), the largest batch at a
    /// context and prefill and decode step times for a model, GPU and deployment layout
    /// (--tp, --dp-attention, --ep), from the cost model alone.
    Capacity(capacity::Args),
    /// Write a Llama-shaped model with random bf16 weights (config.json + safetensors).
    MakeModel(make_model::Args),
    /// Measure the CUDA engine's step times over a grid of batch shapes and write them as a
    /// profile that `simulate --profile` calibrates the cost model on.
    Profile(profile::Args),
    /// Measure a running vLLM server's step times through its OpenAI API and write them as a
    /// profile that `simulate --profile` calibrates the cost model on.
    ProfileVllm(profile_vllm::Args),
    /// Run the live control plane: OpenAI-compatible gateway, REST API, Prometheus metrics and
    /// the engine registry, with fleet state in PostgreSQL (DATABASE_URL).
    Serve(serve::Args),
    /// Run one engine instance as a process serving gRPC, registered with control planes.
    Engine(engine_proc::Args),
    /// Start the live system on this machine: serve (local PostgreSQL), a few simulated
    /// engines and a replayer sending a workload through the gateway.
    Demo(demo::Args),
    /// Send a workload (a trace or a synthetic mix, with the simulate flags) through a running
    /// gateway at its arrival times and report what the clients saw.
    Replay(replay::Args),
    /// Measure what a live fleet's path adds to each request beyond its engines' steps
    /// (gateway, routing, gRPC, streaming): the simulator's --dispatch-ms.
    Latency(latency::Args),
}

/// The async runtime of the live commands (the simulator needs none), with logs on stderr
/// (RUST_LOG, default `info`).
fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::Run(anyhow::anyhow!("cannot start the async runtime: {e}")))
}

/// Accepted connections of a gRPC listener, with Nagle's algorithm off: streams write one
/// small frame per token, and Nagle would hold each behind the peer's delayed ACK.
fn incoming(
    listener: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|conn| {
        conn.inspect(|s| {
            let _ = s.set_nodelay(true);
        })
    })
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Lets a printing command die quietly when its reader goes away (`fleetplane simulate |
/// head`) instead of panicking in `print!`: Rust ignores SIGPIPE, so a closed pipe is a write
/// error that `print!` turns into a panic. Only for the commands that print and exit; servers
/// keep ignoring it (a client that hangs up must not stop them).
#[cfg(unix)]
#[allow(unsafe_code)] // one libc call, before any thread exists
fn die_on_closed_stdout() {
    // SAFETY: setting a signal's disposition to its default has no memory effects, and no
    // other thread is running yet to race on it.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(not(unix))]
fn die_on_closed_stdout() {}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let prints_and_exits =
        !matches!(cli.command, Command::Serve(_) | Command::Engine(_) | Command::Demo(_) | Command::Replay(_));
    if prints_and_exits {
        die_on_closed_stdout();
    }
    let result = match cli.command {
        Command::Simulate(args) => simulate::run(args),
        Command::MaxRate(args) => max_rate::run(args),
        Command::Tune(args) => tune::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Capacity(args) => capacity::run(args),
        Command::Latency(args) => latency::run(args),
        Command::MakeModel(args) => make_model::run(args),
        Command::Profile(args) => profile::run(args),
        Command::ProfileVllm(args) => profile_vllm::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Engine(args) => engine_proc::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Replay(args) => replay::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => f.report(),
    }
}
