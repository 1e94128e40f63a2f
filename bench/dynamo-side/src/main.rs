//! Replays a Mooncake trace through NVIDIA Dynamo's simulator (the `dynamo-mocker` crate on
//! crates.io, with `aisimulate-core` underneath) and prints its wall time, so that it can be
//! timed beside `fleetplane simulate` on the same trace and fleet
//! (`scripts/dynamo-side-by-side.sh`, docs/BENCHMARKS.md).
//!
//! Bench-only: nothing here is part of fleetplane's workspace or binary.
//!
//! ```text
//! dynamo-side TRACE [--workers 8] [--block-size 16] [--kv-blocks N] [--max-batched-tokens 8192]
//!                   [--max-num-seqs 256] [--router kv|round-robin] [--trace-block-size 512]
//!                   [--arrival-speedup 1.0]
//!                   [--host-blocks N [--g3-blocks N] [--kv-bytes-per-token 131072]]
//! ```
//!
//! The call timed is dynamo-mocker's public
//! `replay::simulate_trace_file_with_router_mode` (offline replay: its vLLM-style scheduler
//! per worker, its default polynomial timing model, and, with `--router kv`, its KV router
//! with the default `KvRouterConfig`). The trace reader takes the trace's hash block size
//! (512 tokens for Mooncake's); the engines' KV block size is `--block-size`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use dynamo_mocker::config::MockerConfig;
use dynamo_mocker::replay::{ReplayRouterMode, TraceDistributionStats, simulate_trace_file_with_router_mode};

/// Both pinned with `=` in Cargo.toml.
const VERSIONS: &str = "dynamo-mocker 1.6.1 (aisimulate-core 0.13.0)";

struct Args {
    trace: PathBuf,
    workers: usize,
    block_size: usize,
    kv_blocks: usize,
    max_batched_tokens: usize,
    max_num_seqs: usize,
    router: ReplayRouterMode,
    trace_block_size: usize,
    arrival_speedup: f64,
    /// G2 (host) KV blocks per worker; 0: none.
    host_blocks: usize,
    /// G3 KV blocks shared by the cluster; 0: none (needs G2).
    g3_blocks: usize,
    kv_bytes_per_token: usize,
}

const USAGE: &str = "usage: dynamo-side TRACE [--workers N] [--block-size N] [--kv-blocks N] \
[--max-batched-tokens N] [--max-num-seqs N] [--router kv|round-robin] [--trace-block-size N] \
[--arrival-speedup X] [--host-blocks N [--g3-blocks N] [--kv-bytes-per-token N]]";

fn parse_args() -> Result<Args> {
    let mut args = Args {
        trace: PathBuf::new(),
        workers: 8,
        block_size: 16,
        kv_blocks: 16_384,
        max_batched_tokens: 8192,
        max_num_seqs: 256,
        router: ReplayRouterMode::KvRouter,
        trace_block_size: 512,
        arrival_speedup: 1.0,
        host_blocks: 0,
        g3_blocks: 0,
        kv_bytes_per_token: 131_072,
    };
    let mut trace = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        if arg == "-h" || arg == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        if !arg.starts_with("--") {
            if trace.replace(PathBuf::from(&arg)).is_some() {
                bail!("more than one trace given\n{USAGE}");
            }
            continue;
        }
        let value = it.next().with_context(|| format!("{arg} needs a value\n{USAGE}"))?;
        let number = || -> Result<usize> { value.parse().with_context(|| format!("{arg}: not a number: {value}")) };
        match arg.as_str() {
            "--workers" => args.workers = number()?,
            "--block-size" => args.block_size = number()?,
            "--kv-blocks" => args.kv_blocks = number()?,
            "--max-batched-tokens" => args.max_batched_tokens = number()?,
            "--max-num-seqs" => args.max_num_seqs = number()?,
            "--trace-block-size" => args.trace_block_size = number()?,
            "--host-blocks" => args.host_blocks = number()?,
            "--g3-blocks" => args.g3_blocks = number()?,
            "--kv-bytes-per-token" => args.kv_bytes_per_token = number()?,
            "--arrival-speedup" => {
                args.arrival_speedup = value.parse().with_context(|| format!("{arg}: not a number: {value}"))?
            }
            "--router" => {
                args.router = match value.as_str() {
                    "kv" => ReplayRouterMode::KvRouter,
                    "round-robin" => ReplayRouterMode::RoundRobin,
                    other => bail!("--router: {other}: expected kv or round-robin"),
                }
            }
            other => bail!("unknown flag {other}\n{USAGE}"),
        }
    }
    args.trace = trace.with_context(|| format!("no trace given\n{USAGE}"))?;
    Ok(args)
}

fn dist(name: &str, d: &TraceDistributionStats) -> String {
    format!("{name} ms: mean {:.1}, p50 {:.1}, p90 {:.1}, p99 {:.1}", d.mean_ms, d.median_ms, d.p90_ms, d.p99_ms)
}

fn main() -> Result<()> {
    let args = parse_args()?;
    // The canonical mapping of dynamo-mocker's README: vLLM-style scheduler, explicit KV
    // capacity and token budget, prefix caching and chunked prefill (their defaults) on.
    let mut engine = serde_json::json!({
        "backend": "vllm",
        "block_size": args.block_size,
        "num_gpu_blocks": args.kv_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_batched_tokens,
        "enable_prefix_caching": true,
        "enable_chunked_prefill": true,
    });
    // Optional lower tiers (not the like-for-like case): a host cache per worker (G2, PCIe
    // Gen5 x16 both ways, as examples/mooncake-tiers.toml's L2) and a cluster-shared G3
    // (25 GB/s per worker, 100 us to the first byte, as its L3).
    if args.host_blocks > 0 {
        engine["kv_cache_bytes_per_token"] = args.kv_bytes_per_token.into();
        engine["native_host_offload"] = serde_json::json!({
            "num_host_blocks": args.host_blocks,
            "d2h_bandwidth_gbps": 50.0,
            "h2d_bandwidth_gbps": 50.0,
        });
        if args.g3_blocks > 0 {
            engine["g3_offload"] = serde_json::json!({
                "scope": "cluster_shared",
                "num_g3_blocks": args.g3_blocks,
                "latency_to_first_byte_ms": 0.1,
                "read_bandwidth_gbps": 25.0,
                "write_bandwidth_gbps": 25.0,
            });
        }
    } else if args.g3_blocks > 0 {
        bail!("--g3-blocks needs --host-blocks (dynamo-mocker's G3 sits below G2)");
    }
    let config = MockerConfig::from_value(serde_json::json!({ "engine": engine }))
        .context("dynamo-mocker rejected the engine configuration")?;
    let router = match args.router {
        ReplayRouterMode::KvRouter => "kv",
        ReplayRouterMode::RoundRobin => "round-robin",
    };
    eprintln!(
        "{VERSIONS}: {} workers, router {router}, block size {}, {} KV blocks/worker, \
         max_num_batched_tokens {}, max_num_seqs {}, trace block size {}, arrival speedup {}, \
         host blocks/worker {}, G3 blocks {}",
        args.workers,
        args.block_size,
        args.kv_blocks,
        args.max_batched_tokens,
        args.max_num_seqs,
        args.trace_block_size,
        args.arrival_speedup,
        args.host_blocks,
        args.g3_blocks,
    );

    let start = Instant::now();
    let report = simulate_trace_file_with_router_mode(
        config,
        None, // the KV router's default KvRouterConfig
        None, // no prefill load estimator
        &args.trace,
        args.trace_block_size,
        args.workers,
        args.arrival_speedup,
        args.router,
    )?;
    let wall = start.elapsed().as_secs_f64();

    let counts = &report.request_counts;
    let t = &report.throughput;
    let l = &report.latency;
    println!(
        "requests {} (completed {}), input tokens {}, output tokens {}",
        counts.num_requests, counts.completed_requests, counts.total_input_tokens, counts.total_output_tokens
    );
    println!(
        "simulated time {:.1} s, {:.2} req/s simulated, prefix cache reused {:.1}%",
        t.duration_ms / 1000.0,
        t.request_throughput_rps,
        report.prefix_cache_reused_ratio * 100.0
    );
    println!("{}", dist("TTFT", &l.ttft));
    println!("{}", dist("TPOT", &l.tpot));
    println!("{}", dist("E2E", &l.e2e));
    println!(
        "wall {:.3} s (load + simulate), {:.0} simulated requests per wall second",
        wall,
        counts.num_requests as f64 / wall
    );
    // One line for scripts.
    println!(
        "SUMMARY wall_s={:.3} requests={} completed={} sim_s={:.1} ttft_p50_ms={:.1} \
         ttft_p90_ms={:.1} tpot_p50_ms={:.2} tpot_p90_ms={:.2} reuse={:.3}",
        wall,
        counts.num_requests,
        counts.completed_requests,
        t.duration_ms / 1000.0,
        l.ttft.median_ms,
        l.ttft.p90_ms,
        l.tpot.median_ms,
        l.tpot.p90_ms,
        report.prefix_cache_reused_ratio
    );
    Ok(())
}
