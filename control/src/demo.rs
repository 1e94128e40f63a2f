//! `fleetplane demo`: the live system on one machine. Starts `fleetplane serve` (on the local
//! PostgreSQL), a few engines with the cost-model executor, and a replayer that sends a
//! workload through the gateway; prints where everything is, then keeps serving until Ctrl-C.
//! With `--mode pd` the control plane runs prefill and decode pools, and its autoscaler
//! starts and stops the engine processes itself (the local actuator).

use crate::replay;
use crate::serve::pools::Mode;
use crate::serve::DEFAULT_DATABASE_URL;
use crate::Failure;
use anyhow::{anyhow, Context};
use clap::Args as ClapArgs;
use control::child::{serve_addresses, start};
use simulator::scenario::Scenario;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tokio::process::Child;

/// The workload the demo replays unless given a scenario: conversations sharing a few system
/// prompts, at a rate a handful of simulated H100s serve comfortably.
const DEFAULT_WORKLOAD: &str = r#"
seed = 7
[workload.synthetic]
requests = 2000
arrival = { kind = "poisson", rate_rps = 6.0 }
input = { kind = "lognormal", median = 1024, sigma = 0.8, min = 16, max = 16384 }
output = { kind = "lognormal", median = 128, sigma = 0.6, min = 1, max = 1024 }
prefix = { groups = 8, tokens = 768, share = 0.7 }
"#;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// HTTP address of the gateway, API and metrics.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// gRPC address engines register at.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub grpc_listen: SocketAddr,

    /// Engine processes to start (cost-model executor); with `--mode pd`, the most the
    /// autoscaler may run (its GPU budget).
    #[arg(long, default_value_t = 4)]
    pub engines: u32,

    /// colocated, or pd: prefill and decode pools sized by the autoscaler.
    #[arg(long, value_enum, default_value = "colocated")]
    pub mode: crate::serve::pools::Mode,

    /// Pool sizing with `--mode pd`: none, fixed-xpyd or slo-load.
    #[arg(long, default_value = "slo-load")]
    pub autoscaler: String,

    /// Model the engines serve (a cost-model name).
    #[arg(long, default_value = "llama-3.1-8b")]
    pub model: String,

    /// Scenario whose workload to replay [default: a built-in shared-prefix conversation mix].
    #[arg(long, value_name = "FILE.toml")]
    pub scenario: Option<PathBuf>,

    /// Requests to replay [default: the whole workload].
    #[arg(long)]
    pub requests: Option<u64>,

    /// Stop everything when the replay ends instead of serving on until Ctrl-C.
    #[arg(long)]
    pub exit_after_replay: bool,

    /// PostgreSQL database (created if missing).
    #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub database_url: String,
}

pub fn run(args: Args) -> Result<(), Failure> {
    if args.engines == 0 {
        return Err(Failure::Input(anyhow!("--engines must be at least 1")));
    }
    if args.mode == Mode::Pd && args.engines < 2 {
        return Err(Failure::Input(anyhow!("--mode pd needs --engines 2 or more (a prefill and a decode engine)")));
    }
    let scenario = match &args.scenario {
        Some(path) => Scenario::load(path).map_err(|e| Failure::Input(e.into()))?,
        None => toml::from_str(DEFAULT_WORKLOAD).map_err(|e| Failure::Input(anyhow!("built-in workload: {e}")))?,
    };
    let settings = scenario.resolve().map_err(|e| Failure::Input(e.into()))?;
    let runtime = crate::runtime()?;
    runtime.block_on(demo(args, settings)).map_err(Failure::Run)
}

/// How long the children have to exit after SIGTERM when the demo stops, before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// The demo's child processes. Each leads a process group of its own, so that a terminal's
/// Ctrl-C reaches the demo alone and the demo stops them in order ([`Children::stop`]); each
/// gets SIGTERM if the demo dies first (it cannot outlive it).
#[derive(Default)]
struct Children(Vec<(String, Child)>);

impl Children {
    /// SIGTERM to every child's group, then, for those still running after `grace`, SIGKILL;
    /// every child is reaped (none is left a zombie).
    async fn stop(self, grace: Duration) {
        for (_, child) in &self.0 {
            signal_group(child, libc::SIGTERM);
        }
        let deadline = tokio::time::Instant::now() + grace;
        for (what, mut child) in self.0 {
            if tokio::time::timeout_at(deadline, child.wait()).await.is_err() {
                eprintln!("{what} still running {grace:?} after SIGTERM: killed");
                signal_group(&child, libc::SIGKILL);
                let _ = child.wait().await;
            }
        }
    }
}

/// Sends `signal` to the process group `child` leads (gone already: nothing to do).
#[allow(unsafe_code)]
fn signal_group(child: &Child, signal: libc::c_int) {
    let Some(group) = child.id().and_then(|id| libc::pid_t::try_from(id).ok()) else { return };
    // SAFETY: kill(2) takes no pointers; a group that is gone gives ESRCH, ignored.
    unsafe { libc::kill(-group, signal) };
}

async fn demo(args: Args, settings: simulator::scenario::Settings) -> anyhow::Result<()> {
    let admin = std::env::var("FLEETPLANE_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .map_or_else(crate::serve::new_token, Ok)?;
    let engine_token = crate::serve::new_token()?;
    let envs = [("FLEETPLANE_ADMIN_TOKEN", admin.as_str()), ("FLEETPLANE_ENGINE_TOKEN", engine_token.as_str())];
    let mut serve_args: Vec<String> = vec![
        "serve".into(),
        "--listen".into(),
        args.listen.to_string(),
        "--grpc-listen".into(),
        args.grpc_listen.to_string(),
        "--database-url".into(),
        args.database_url.clone(),
    ];
    // A P/D fleet starts empty: the leader fills each pool with engine processes.
    let pd = args.mode == Mode::Pd;
    if pd {
        let budget = args.engines.to_string();
        let flags = ["--mode", "pd", "--actuator", "local", "--autoscaler", &args.autoscaler, "--gpu-budget", &budget];
        serve_args.extend(flags.iter().map(|s| s.to_string()));
        serve_args.extend(["--engine-model".to_string(), args.model.clone()]);
    }
    let mut children = Children::default();
    let outcome = run_fleet(&args, &settings, &admin, &serve_args, &envs, &mut children).await;
    children.stop(STOP_GRACE).await;
    outcome
}

/// Starts serve and the engines (each put in `children` as it starts, so that a failure
/// later still stops it), replays the workload, and serves on until Ctrl-C unless asked not to.
async fn run_fleet(
    args: &Args,
    settings: &simulator::scenario::Settings,
    admin: &str,
    serve_args: &[String],
    envs: &[(&str, &str)],
    children: &mut Children,
) -> anyhow::Result<()> {
    let pd = args.mode == Mode::Pd;
    let exe = std::env::current_exe().context("cannot find the fleetplane binary")?;
    let (serve, line) = start(&exe, "fleetplane serve", serve_args, envs, "serving http://").await?;
    children.0.push(("fleetplane serve".into(), serve));
    // The addresses it bound (port 0 picks free ones).
    let (http, grpc) = serve_addresses(&line)?;
    for i in 0..if pd { 0 } else { args.engines } {
        let engine_args: Vec<String> = [
            "engine",
            "--executor",
            "sim",
            "--model",
            &args.model,
            "--control",
            &grpc,
            "--name",
            &format!("demo-engine-{i}"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let name = format!("engine demo-engine-{i}");
        children.0.push((name.clone(), start(&exe, &name, &engine_args, envs, "listening on").await?.0));
    }
    let gateway = http;
    wait_for_engines(&gateway, admin, if pd { 2 } else { args.engines }).await?;
    println!();
    println!("fleetplane demo is up:");
    println!("  console               {gateway}/console/  (log in with the admin token)");
    println!("  gateway (OpenAI API)  {gateway}/v1   model `{}`", args.model);
    println!("  REST API              {gateway}/api  (OpenAPI: {gateway}/api/openapi.json)");
    println!("  metrics               {gateway}/metrics");
    println!("  admin token           {admin}");
    println!("  try: curl -s {gateway}/v1/completions -H 'Authorization: Bearer {admin}' -H 'Content-Type: application/json' \\");
    println!("         -d '{{\"model\": \"{}\", \"prompt\": \"Hello, fleet\", \"max_tokens\": 16}}'", args.model);
    println!();
    println!("replaying the workload through the gateway ...");
    let opts = replay::Options {
        max_requests: args.requests.or(settings.max_requests),
        ..replay::Options::new(settings, &gateway, admin, &args.model, replay::DEFAULT_VOCAB)
    };
    let workload = settings.open_workload(settings.rate_scale)?;
    let mut summary = replay::replay(opts, workload, crate::shutdown_signal()).await?;
    print!("{}", summary.table());
    if let Some(e) = &summary.first_error {
        println!("first failure: {e}");
    }
    if summary.stopped {
        println!("stopped; stopping serve and the engines");
    } else if !args.exit_after_replay {
        println!("replay done; still serving at {gateway} (Ctrl-C stops everything)");
        crate::shutdown_signal().await;
    }
    if summary.failed > 0 && summary.ok == 0 {
        return Err(anyhow!("no request succeeded"));
    }
    Ok(())
}

async fn wait_for_engines(gateway: &str, token: &str, n: u32) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    for _ in 0..200 {
        let r = client.get(format!("{gateway}/api/fleet")).bearer_auth(token).send().await;
        if let Ok(r) = r {
            if let Ok(v) = r.json::<serde_json::Value>().await {
                if v["instances"]["serving"].as_u64().unwrap_or(0) >= u64::from(n) {
                    return Ok(());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(anyhow!("the engines did not all register within 20 s"))
}
