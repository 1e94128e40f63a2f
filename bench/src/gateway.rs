//! `fleetplane-bench gateway`: what the control plane adds to a request's latency. The same
//! open-loop load (short prompts, one output token) goes to an engine process directly over
//! gRPC, then through `fleetplane serve`'s OpenAI gateway (HTTP, auth, tokens, routing by the
//! controller, the engine's stream relayed); the engine runs with `--time-scale 0`, so its steps
//! take only their CPU time and the difference is the gateway's.

use anyhow::{anyhow, Context};
use clap::Args as ClapArgs;
use control::child::{serve_addresses, start};
use control::{proto, Failure};
use futures_util::StreamExt;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// `fleetplane serve`'s default database.
const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/fleetplane";

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Requests per path (after a warm-up of a tenth as many).
    #[arg(long, default_value_t = 20_000)]
    pub requests: u32,

    /// Offered load, requests per second (open loop).
    #[arg(long, default_value_t = 2_000.0)]
    pub rate: f64,

    /// Prompt tokens per request.
    #[arg(long, default_value_t = 64)]
    pub prompt_tokens: u32,

    /// PostgreSQL database for the control plane (created if missing).
    #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub database_url: String,

    /// The `fleetplane` binary that runs serve and the engine [default: the one beside this
    /// executable, as cargo builds both into target/release].
    #[arg(long, value_name = "PATH")]
    pub fleetplane: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<(), Failure> {
    if args.requests == 0 || !(args.rate.is_finite() && args.rate > 0.0) || args.prompt_tokens == 0 {
        return Err(Failure::Input(anyhow!("--requests, --rate and --prompt-tokens must be positive")));
    }
    let exe = match &args.fleetplane {
        Some(path) => path.clone(),
        None => std::env::current_exe()
            .map_err(|e| Failure::Input(anyhow!("cannot find this executable to find fleetplane beside it: {e}")))?
            .with_file_name("fleetplane"),
    };
    if !exe.is_file() {
        return Err(Failure::Input(anyhow!(
            "no fleetplane binary at {} (cargo build --release -p control, or --fleetplane PATH)",
            exe.display()
        )));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::Run(anyhow!("cannot start the async runtime: {e}")))?;
    runtime.block_on(bench(&exe, args)).map_err(Failure::Run)
}

struct PathResult {
    latencies_ms: Vec<f64>,
    errors: u32,
    wall: Duration,
}

impl PathResult {
    fn quantile(&mut self, q: f64) -> f64 {
        control::quantile(&mut self.latencies_ms, q)
    }
}

/// Sends `n` requests at `rate` per second; `one` sends one and says whether it succeeded.
async fn open_loop<F, Fut>(n: u32, rate: f64, one: F) -> PathResult
where
    F: Fn(u32) -> Fut,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    let (tx, mut rx) = mpsc::unbounded_channel();
    let start = Instant::now();
    for k in 0..n {
        tokio::time::sleep_until((start + Duration::from_secs_f64(f64::from(k) / rate)).into()).await;
        let fut = one(k);
        let tx = tx.clone();
        tokio::spawn(async move {
            let sent = Instant::now();
            let ok = fut.await;
            let _ = tx.send((ok, sent.elapsed()));
        });
    }
    drop(tx);
    let mut r = PathResult { latencies_ms: Vec::with_capacity(n as usize), errors: 0, wall: Duration::ZERO };
    while let Some((ok, d)) = rx.recv().await {
        if ok {
            r.latencies_ms.push(d.as_secs_f64() * 1e3);
        } else {
            r.errors += 1;
        }
    }
    r.wall = start.elapsed();
    r
}

/// A fresh secret for this run's control plane and engine.
fn token(role: &str) -> anyhow::Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| anyhow!("no randomness for a token: {e}"))?;
    Ok(format!("bench-{role}-{}", hex::encode(bytes)))
}

async fn bench(exe: &Path, args: Args) -> anyhow::Result<()> {
    let admin = token("admin")?;
    let engine_token = token("engine")?;
    let envs = [
        ("FLEETPLANE_ADMIN_TOKEN", admin.as_str()),
        ("FLEETPLANE_ENGINE_TOKEN", engine_token.as_str()),
        ("RUST_LOG", "warn"),
    ];
    let serve_args: Vec<String> = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--grpc-listen",
        "127.0.0.1:0",
        "--router",
        "least-outstanding",
        "--database-url",
        &args.database_url,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (_serve, line) = start(exe, "fleetplane serve", &serve_args, &envs, "serving http://").await?;
    let (http, grpc) = serve_addresses(&line)?;
    let engine_args: Vec<String> =
        ["engine", "--executor", "sim", "--time-scale", "0", "--control", &grpc, "--name", "bench"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    let (_engine, line) = start(exe, "an engine", &engine_args, &envs, "listening on").await?;
    let engine_addr =
        line.split_whitespace().last().ok_or_else(|| anyhow!("no engine address in `{line}`"))?.to_string();
    let client = reqwest::Client::builder().pool_max_idle_per_host(1024).build()?;
    for _ in 0..100 {
        let v: serde_json::Value =
            client.get(format!("{http}/api/fleet")).bearer_auth(&admin).send().await?.json().await?;
        if v["instances"]["serving"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{engine_addr}"))?
        .connect()
        .await
        .context("cannot reach the engine")?;
    let engine = control::engine_auth::Present::new(&engine_token)?.link(channel);
    let prompt =
        |k: u32| -> Vec<u32> { (0..args.prompt_tokens).map(|i| 1000 + (k * 7919 + i * 104_729) % 30_000).collect() };

    let direct = |k: u32| {
        let mut engine = engine.clone();
        let request = proto::GenerateRequest {
            request_id: u64::from(k) + 1,
            prompt: prompt(k),
            max_tokens: 1,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            generated: Vec::new(),
            ..Default::default()
        };
        async move {
            let Ok(stream) = engine.generate(request).await else { return false };
            let mut stream = stream.into_inner();
            let mut done = false;
            while let Some(Ok(chunk)) = stream.next().await {
                done |= chunk.finish_reason() != proto::FinishReason::Unspecified;
            }
            done
        }
    };
    let via_gateway = |k: u32| {
        let request = client
            .post(format!("{http}/v1/completions"))
            .bearer_auth(&admin)
            .json(&json!({"model": "llama-3.1-8b", "prompt": prompt(k), "max_tokens": 1}));
        async move {
            match request.send().await {
                Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
                _ => false,
            }
        }
    };
    let warm = (args.requests / 10).max(1);
    // Direct request ids must not collide with the gateway's (the engine keys streams by id).
    let offset = 10 * args.requests;
    open_loop(warm, args.rate, |k| direct(offset + k)).await;
    let mut a = open_loop(args.requests, args.rate, |k| direct(offset + warm + k)).await;
    open_loop(warm, args.rate, &via_gateway).await;
    let mut b = open_loop(args.requests, args.rate, &via_gateway).await;

    println!(
        "{} requests per path at {:.0} req/s offered, {}-token prompts, 1 output token",
        args.requests, args.rate, args.prompt_tokens
    );
    println!("{:<28} {:>10} {:>8} {:>8} {:>8} {:>8}", "path", "req/s", "p50 ms", "p90 ms", "p99 ms", "errors");
    for (name, r) in [("engine gRPC, direct", &mut a), ("gateway HTTP -> engine", &mut b)] {
        let rps = r.latencies_ms.len() as f64 / r.wall.as_secs_f64();
        let (p50, p90, p99) = (r.quantile(0.5), r.quantile(0.9), r.quantile(0.99));
        println!("{name:<28} {rps:>10.0} {p50:>8.3} {p90:>8.3} {p99:>8.3} {:>8}", r.errors);
    }
    println!(
        "added by the gateway: p50 {:.3} ms, p90 {:.3} ms, p99 {:.3} ms",
        b.quantile(0.5) - a.quantile(0.5),
        b.quantile(0.9) - a.quantile(0.9),
        b.quantile(0.99) - a.quantile(0.99)
    );
    Ok(())
}
