//! `fleetplane engine`: one engine instance as a process. The engine crate's scheduler and KV
//! cache step in real time on their own thread ([`runner`]); the gRPC service ([`service`])
//! takes requests and streams tokens and events; [`register`] keeps the engine registered with
//! every control plane it was given.

mod handoff;
mod register;
mod runner;
mod service;

pub use runner::Sampling;

use crate::engine_auth;
use crate::proto;
use crate::Failure;
use anyhow::{anyhow, Context};
use clap::{Args as ClapArgs, ValueEnum};
use cost::{
    calibrated_cost, drafter_or_none, gpu_by_name, model_by_name, CostModelExecutor, CostParams, Deployment,
    NO_SPECULATION,
};
use engine::{Executor, Instance, InstanceConfig};
use runner::{Backend, Runner, Shared};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;
use tonic::service::interceptor::InterceptedService;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExecutorKind {
    /// The simulator's cost model: each step sleeps for the time the model predicts.
    Sim,
    /// The CUDA forward pass (needs a build with the `cuda` executor and a GPU).
    Cuda,
}

/// A pool on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RoleArg {
    Colocated,
    Prefill,
    Decode,
}

impl From<RoleArg> for policies::Role {
    fn from(r: RoleArg) -> policies::Role {
        match r {
            RoleArg::Colocated => policies::Role::Colocated,
            RoleArg::Prefill => policies::Role::Prefill,
            RoleArg::Decode => policies::Role::Decode,
        }
    }
}

#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// What computes the steps.
    #[arg(long, value_enum, default_value = "sim")]
    pub executor: ExecutorKind,

    /// Model served: a cost-model name for `sim` (llama-3.1-8b, llama-3.1-70b, qwen3-32b,
    /// deepseek-v3); a Hugging Face model folder (config.json + safetensors) for `cuda`, or
    /// `random:NAME` (random weights drawn on the GPU in a make-model preset's shape).
    #[arg(long, default_value = "llama-3.1-8b")]
    pub model: String,

    /// Name clients ask for [default: the cost-model name, or the model folder's name].
    #[arg(long)]
    pub served_model_name: Option<String>,

    /// `cuda`: GPU memory this engine may use for weights, buffers and KV, so that several
    /// engines share one GPU [default: 90% of the free memory].
    #[arg(long, value_name = "GIB")]
    pub gpu_memory_gib: Option<f64>,

    /// `cuda`: the CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,

    /// GPU the cost model stands for (a100, h100, h200, b200).
    #[arg(long, default_value = "h100")]
    pub gpu: String,

    /// Tensor-parallel degree of the instance.
    #[arg(long, default_value_t = 1)]
    pub tp: u32,

    /// Tokens per KV block (every engine of a fleet must use the same).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,

    /// KV blocks of the instance [default: as many as the GPU's memory holds].
    #[arg(long)]
    pub kv_blocks: Option<u32>,

    /// `sim`: a step lasts this many times the predicted time (0: as fast as the CPU goes,
    /// for benchmarks of what surrounds the engine; 0.1: a replay ten times faster).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,

    /// `sim`: speculative decoding with a drafter preset, eagle3, dflash or dspark, or none
    /// (docs/LAYOUTS.md): decode steps verify drafts and stream every accepted token.
    #[arg(long, default_value = "none")]
    pub spec: String,

    /// `sim` with --spec: seed of the drafter's acceptance draws (give each engine its own).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,

    /// Token budget of one iteration (chunked prefill).
    #[arg(long, default_value_t = 8192)]
    pub max_batch_tokens: u32,

    /// `sim`: a step profile measured on the CUDA engine (`fleetplane profile`); the cost
    /// model's efficiencies are fitted to it.
    #[arg(long, value_name = "FILE.json")]
    pub profile: Option<std::path::PathBuf>,

    /// Address of the engine's gRPC service (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,

    /// Control planes to register with (their gRPC addresses), comma-separated; none: the
    /// engine runs alone.
    #[arg(long, value_delimiter = ',')]
    pub control: Vec<String>,

    /// Phase the engine serves (its pool): colocated, prefill (stops each request after its
    /// first token and hands its KV to a decode engine) or decode.
    #[arg(long, alias = "pool", value_enum, default_value = "colocated")]
    pub role: RoleArg,

    /// `--role prefill`: seconds a prefilled request's KV is held waiting for its transfer
    /// before it is freed (the control plane that would send it is gone).
    #[arg(long, default_value_t = 120.0)]
    pub parked_limit_s: f64,

    /// Write every step this engine serves (batch shape and time) to FILE as a step profile,
    /// rewritten every 10 s while busy and when the engine goes idle: what the engine did under live traffic, for `simulate
    /// --profile` or to check a calibrated cost model against.
    #[arg(long, value_name = "FILE.json")]
    pub step_log: Option<std::path::PathBuf>,

    /// Exit when the process that started this engine exits (engines an actuator started
    /// go with their control plane).
    #[arg(long)]
    pub exit_with_parent: bool,

    /// On SIGTERM (or Ctrl-C): seconds to wait for the requests in flight (parked hand-offs
    /// too) to finish, with no new ones taken, before exiting; control planes place what is
    /// left elsewhere.
    #[arg(long, default_value_t = 30.0, value_name = "S")]
    pub drain_timeout_s: f64,

    /// The engine's name in the fleet [default: engine-PORT].
    #[arg(long)]
    pub name: Option<String>,

    /// The model's tokenizer (a tokenizer.json, or a folder holding one), which control
    /// planes fetch to tokenize this model's text prompts [default: tokenizer.json in the
    /// `cuda` model folder, if there is one; otherwise none: the gateway's stand-in].
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<std::path::PathBuf>,
}

/// The cost model's step times, scaled by `--time-scale`.
struct SimBackend {
    exec: CostModelExecutor,
    scale: f64,
}

impl Executor for SimBackend {
    fn draft_tokens(&self) -> u32 {
        self.exec.draft_tokens()
    }

    fn execute(
        &mut self,
        batch: &engine::Batch,
        out: &mut engine::StepOutput,
    ) -> Result<engine::Dur, engine::ExecutorError> {
        let d = self.exec.execute(batch, out)?;
        Ok(engine::Dur::from_secs_f64(d.as_secs_f64() * self.scale))
    }
}

impl Backend for SimBackend {
    fn executor(&mut self) -> &mut dyn Executor {
        self
    }

    fn paced(&self) -> bool {
        true
    }

    fn shape(&self) -> Option<(&'static str, &'static str)> {
        let cost = self.exec.cost_model();
        Some((cost.model().name, cost.gpu().name))
    }
}

pub fn run(args: Args) -> Result<(), Failure> {
    if !(args.drain_timeout_s.is_finite() && args.drain_timeout_s >= 0.0) {
        return Err(Failure::Input(anyhow!("--drain-timeout-s {} must be a number >= 0", args.drain_timeout_s)));
    }
    if !(args.parked_limit_s.is_finite() && args.parked_limit_s > 0.0) {
        return Err(Failure::Input(anyhow!("--parked-limit-s {} must be a positive number", args.parked_limit_s)));
    }
    if args.executor == ExecutorKind::Cuda && args.spec != NO_SPECULATION {
        return Err(Failure::Input(anyhow!(
            "--spec {} needs --executor sim: the CUDA engine has no drafter",
            args.spec
        )));
    }
    let (backend, config) = match args.executor {
        ExecutorKind::Sim => sim_backend(&args).map_err(Failure::Input)?,
        ExecutorKind::Cuda => cuda_backend(&args).map_err(Failure::Input)?,
    };
    let tokenizer = match (&args.tokenizer, args.executor) {
        (Some(path), _) => Some(path.clone()),
        (None, ExecutorKind::Cuda) => crate::tokenizer::in_model_dir(std::path::Path::new(&args.model)),
        (None, ExecutorKind::Sim) => None,
    };
    let tokenizer = tokenizer.map(|p| crate::tokenizer::load(&p)).transpose().map_err(Failure::Input)?;
    let runtime = crate::runtime()?;
    runtime.block_on(serve(args, backend, config, tokenizer)).map_err(Failure::Run)
}

fn sim_backend(args: &Args) -> anyhow::Result<(Box<dyn Backend>, InstanceConfig)> {
    let model = model_by_name(&args.model)?;
    let gpu = gpu_by_name(&args.gpu)?;
    let deployment = Deployment::tensor_parallel(args.tp);
    let (cost, fit) = calibrated_cost(model, gpu, deployment, CostParams::default(), args.profile.as_deref())?;
    if let (Some(fit), Some(path)) = (fit, &args.profile) {
        tracing::info!(median_error = fit.median_error, "cost model calibrated on {}", path.display());
    }
    if args.block_size == 0 || !args.block_size.is_power_of_two() || args.block_size > 512 {
        return Err(anyhow!("--block-size {} is not a power of two between 1 and 512", args.block_size));
    }
    if args.max_batch_tokens == 0 {
        return Err(anyhow!("--max-batch-tokens must be at least 1"));
    }
    if !(args.time_scale.is_finite() && args.time_scale >= 0.0) {
        return Err(anyhow!("--time-scale {} is not a number >= 0", args.time_scale));
    }
    let total_blocks = match args.kv_blocks {
        Some(0) => return Err(anyhow!("--kv-blocks must be at least 1")),
        Some(n) => n,
        None => cost.kv_blocks(args.block_size),
    };
    let config = InstanceConfig {
        block_size: args.block_size,
        total_blocks,
        max_batch_tokens: args.max_batch_tokens,
        ..InstanceConfig::default()
    };
    let mut exec = CostModelExecutor::new(cost);
    if let Some(d) = drafter_or_none(&args.spec)? {
        exec = exec.with_drafter(d, args.seed);
    }
    Ok((Box::new(SimBackend { exec, scale: args.time_scale }), config))
}

/// Resolves when this process's parent changes (it exited and the process was re-parented).
async fn parent_gone() {
    let parent = std::os::unix::process::parent_id();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if std::os::unix::process::parent_id() != parent {
            return;
        }
    }
}

struct CudaBackend(engine_cuda::CudaExecutor, Option<(&'static str, &'static str)>);

impl Backend for CudaBackend {
    fn shape(&self) -> Option<(&'static str, &'static str)> {
        self.1
    }

    fn notes(&self) -> String {
        let (captured, replayed, failed) = self.0.graph_stats();
        let failed = failed.map(|f| format!(", failed: {f}")).unwrap_or_default();
        format!("decode CUDA graphs captured {captured}, replayed {replayed}{failed}")
    }

    fn executor(&mut self) -> &mut dyn Executor {
        &mut self.0
    }

    fn paced(&self) -> bool {
        false
    }

    fn admit(&mut self, id: engine::RequestId, prompt: &[u32], s: runner::Sampling) {
        let sampling = engine_cuda::Sampling { temperature: s.temperature, top_p: s.top_p, seed: s.seed };
        self.0.set_request(id, prompt.to_vec(), sampling);
    }

    fn release(&mut self, id: engine::RequestId) {
        self.0.release(id);
    }

    fn export_kv(
        &mut self,
        _id: engine::RequestId,
        blocks: &[engine::BlockId],
        tokens: u32,
    ) -> Result<Vec<u8>, String> {
        self.0.export_kv(blocks, tokens).map_err(|e| e.to_string())
    }

    fn import(&mut self, r: &runner::Imported<'_>, blocks: &[engine::BlockId]) -> Result<(), String> {
        if r.kv.is_empty() {
            return Err(
                "the hand-off carries no KV bytes (its prefill engine has none to send: a cost-model engine?)".into()
            );
        }
        let s = r.sampling;
        let sampling = engine_cuda::Sampling { temperature: s.temperature, top_p: s.top_p, seed: s.seed };
        self.0.import_request(r.id, r.prompt.to_vec(), r.generated, sampling, blocks, r.kv).map_err(|e| e.to_string())
    }
}

fn cuda_backend(args: &Args) -> anyhow::Result<(Box<dyn Backend>, InstanceConfig)> {
    use engine_cuda::CudaExecutor;
    let config = crate::profile::executor_config(
        &args.model,
        args.device,
        args.gpu_memory_gib,
        args.block_size,
        args.max_batch_tokens,
    )?;
    let exec = CudaExecutor::new(config).map_err(|e| anyhow!("cannot start the CUDA executor: {e}"))?;
    let mut instance = exec.instance_config();
    if let Some(n) = args.kv_blocks {
        instance.total_blocks = instance.total_blocks.min(n);
    }
    // The cost model's names for a step log; an engine of another shape serves without them.
    let model = crate::profile::catalog_model(exec.model_config()).map(|m| m.name);
    let gpu = exec.device_name().ok().and_then(|d| crate::profile::catalog_gpu(&d));
    let shape = model.zip(gpu);
    Ok((Box::new(CudaBackend(exec, shape)), instance))
}

async fn serve(
    args: Args,
    backend: Box<dyn Backend>,
    config: InstanceConfig,
    tokenizer: Option<crate::tokenizer::Loaded>,
) -> anyhow::Result<()> {
    // The token it registers with and requires on every call to it.
    let token = std::env::var(engine_auth::ENV).ok().filter(|t| !t.is_empty()).ok_or_else(|| {
        anyhow!("set {}: the engine registers with it and requires it on every call", engine_auth::ENV)
    })?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let name = args.name.clone().unwrap_or_else(|| format!("engine-{}", addr.port()));
    let model = args.served_model_name.clone().unwrap_or_else(|| match args.executor {
        ExecutorKind::Sim => args.model.clone(),
        ExecutorKind::Cuda => std::path::Path::new(&args.model)
            .file_name()
            .map_or_else(|| args.model.clone(), |n| n.to_string_lossy().into_owned()),
    });
    let instance = Instance::new(config.clone());
    let info = proto::EngineInfo {
        name: name.clone(),
        model: model.clone(),
        executor: format!("{:?}", args.executor).to_lowercase(),
        block_size: config.block_size,
        kv_blocks: config.total_blocks,
        capacity_tokens: instance.capacity_tokens(),
        tokenizer_sha256: tokenizer.as_ref().map(|t| t.sha256.clone()).unwrap_or_default(),
        cost: backend.shape().map(|(model, gpu)| proto::CostShape {
            model: model.to_string(),
            gpu: gpu.to_string(),
            tp: args.tp,
            max_batch_tokens: config.max_batch_tokens,
            time_scale: match args.executor {
                ExecutorKind::Sim => args.time_scale,
                ExecutorKind::Cuda => 1.0,
            },
        }),
    };
    let shared = Shared::new();
    let (tx, rx) = std::sync::mpsc::channel();
    let parked_limit = Duration::from_secs_f64(args.parked_limit_s);
    let drain_timeout = Duration::from_secs_f64(args.drain_timeout_s);
    let step_log = match &args.step_log {
        None => None,
        Some(path) => {
            let (model, gpu) = backend.shape().ok_or_else(|| {
                anyhow!("--step-log: the model or GPU is none of the cost model's (`fleetplane capacity --help`)")
            })?;
            let profile = engine::StepProfile {
                format: engine::PROFILE_FORMAT,
                model: model.to_string(),
                gpu: gpu.to_string(),
                tp: args.tp,
                block_size: config.block_size,
                source: format!(
                    "steps served by fleetplane {} engine `{name}` ({:?} executor, {} KV blocks)",
                    env!("CARGO_PKG_VERSION"),
                    args.executor,
                    config.total_blocks
                ),
                samples: Vec::new(),
            };
            let log = runner::StepLog::start(path.clone(), profile)
                .with_context(|| format!("cannot start the step log {}", path.display()))?;
            Some(log)
        }
    };
    let runner = Runner::new(instance, backend, shared.clone(), args.role == RoleArg::Prefill, parked_limit)
        .with_step_log(step_log);
    let loop_thread = std::thread::Builder::new().name("engine-loop".into()).spawn(move || runner.run(rx))?;
    let service = service::EngineService {
        commands: Mutex::new(tx),
        shared: shared.clone(),
        info: info.clone(),
        tokenizer: tokenizer.map(|t| t.json),
    };
    let pool = policies::Role::from(args.role).name();
    for control in &args.control {
        let beat = register::keep_registered(
            control.clone(),
            token.clone(),
            addr,
            pool.to_string(),
            info.clone(),
            shared.clone(),
        );
        tokio::spawn(beat);
    }
    // Tests and the demo read this line to find the port.
    println!("engine {name} listening on {addr}");
    tracing::info!(%addr, %model, kv_blocks = config.total_blocks, "engine serving");
    let engine_service = proto::engine_server::EngineServer::new(service)
        .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(proto::MAX_MESSAGE_BYTES);
    let server = tonic::transport::Server::builder()
        .add_service(InterceptedService::new(engine_service, engine_auth::Require::new(&token)))
        .serve_with_incoming(crate::incoming(listener));
    // No graceful stop of the server: it would wait for every open stream, and control
    // planes keep their event streams open for as long as the engine lives. Exiting closes
    // them; what is still here is placed again elsewhere.
    let parent = async {
        if args.exit_with_parent {
            parent_gone().await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        served = server => served?,
        () = parent => tracing::info!("the process that started this engine is gone: stopping"),
        () = drain_on_signal(&shared, drain_timeout) => {}
    }
    drop(loop_thread);
    Ok(())
}

/// Waits for SIGTERM or Ctrl-C, then drains: no new requests (the heartbeat tells the control
/// planes, and `Generate` refuses them), and returns once nothing is in flight or `bound` has
/// passed.
async fn drain_on_signal(shared: &Shared, bound: Duration) {
    crate::shutdown_signal().await;
    shared.draining.store(true, Ordering::Relaxed);
    let deadline = tokio::time::Instant::now() + bound;
    let left = || shared.in_flight.load(Ordering::Relaxed);
    tracing::info!(in_flight = left(), "stopping: draining for up to {bound:?}");
    while left() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    match left() {
        0 => tracing::info!("drained: stopping"),
        n => tracing::warn!(in_flight = n, "drain bound reached: stopping; the control planes place them again"),
    }
}
