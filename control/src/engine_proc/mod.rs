//! `fleetplane engine`: one engine instance as a process. The engine crate's scheduler and KV
//! cache step in real time on their own thread ([`runner`]); the gRPC service ([`service`])
//! takes requests and streams tokens and events; [`register`] keeps the engine registered with
//! every control plane it was given.

mod register;
mod runner;
mod service;

pub use runner::Sampling;

use crate::proto;
use crate::Failure;
use anyhow::{anyhow, Context};
use clap::{Args as ClapArgs, ValueEnum};
use engine::{Executor, Instance, InstanceConfig};
use runner::{Backend, Runner, Shared};
use simulator::cost::{gpu_by_name, model_by_name, CostModel, CostModelExecutor, CostParams, Deployment};
use std::net::SocketAddr;
use std::sync::Mutex;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExecutorKind {
    /// The simulator's cost model: each step sleeps for the time the model predicts.
    Sim,
    /// The CUDA forward pass (needs a build with the `cuda` executor and a GPU).
    Cuda,
}

#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// What computes the steps.
    #[arg(long, value_enum, default_value = "sim")]
    pub executor: ExecutorKind,

    /// Model served: a cost-model name for `sim` (llama-3.1-8b, llama-3.1-70b, qwen3-32b,
    /// deepseek-v3).
    #[arg(long, default_value = "llama-3.1-8b")]
    pub model: String,

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

    /// Token budget of one iteration (chunked prefill).
    #[arg(long, default_value_t = 8192)]
    pub max_batch_tokens: u32,

    /// Address of the engine's gRPC service (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,

    /// Control planes to register with (their gRPC addresses), comma-separated; none: the
    /// engine runs alone.
    #[arg(long, value_delimiter = ',')]
    pub control: Vec<String>,

    /// Pool the engine serves in: colocated, prefill or decode.
    #[arg(long, default_value = "colocated")]
    pub pool: String,

    /// The engine's name in the fleet [default: engine-PORT].
    #[arg(long)]
    pub name: Option<String>,
}

struct SimBackend(CostModelExecutor);

impl Backend for SimBackend {
    fn executor(&mut self) -> &mut dyn Executor {
        &mut self.0
    }

    fn paced(&self) -> bool {
        true
    }
}

pub fn run(args: Args) -> Result<(), Failure> {
    if !matches!(args.pool.as_str(), "colocated" | "prefill" | "decode") {
        return Err(Failure::Input(anyhow!("unknown pool `{}` (valid: colocated, prefill, decode)", args.pool)));
    }
    let (backend, config) = match args.executor {
        ExecutorKind::Sim => sim_backend(&args).map_err(Failure::Input)?,
        ExecutorKind::Cuda => {
            return Err(Failure::Input(anyhow!(
                "this build serves no CUDA executor yet: run with --executor sim (see issue 8's notes)"
            )))
        }
    };
    let runtime = crate::runtime()?;
    runtime.block_on(serve(args, backend, config)).map_err(Failure::Run)
}

fn sim_backend(args: &Args) -> anyhow::Result<(Box<dyn Backend>, InstanceConfig)> {
    let model = model_by_name(&args.model)?;
    let gpu = gpu_by_name(&args.gpu)?;
    let cost = CostModel::new(model, gpu, Deployment::tensor_parallel(args.tp), CostParams::default())?;
    if args.block_size == 0 || !args.block_size.is_power_of_two() || args.block_size > 512 {
        return Err(anyhow!("--block-size {} is not a power of two between 1 and 512", args.block_size));
    }
    if args.max_batch_tokens == 0 {
        return Err(anyhow!("--max-batch-tokens must be at least 1"));
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
    Ok((Box::new(SimBackend(CostModelExecutor::new(cost))), config))
}

async fn serve(args: Args, backend: Box<dyn Backend>, config: InstanceConfig) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let name = args.name.clone().unwrap_or_else(|| format!("engine-{}", addr.port()));
    let instance = Instance::new(config.clone());
    let info = proto::EngineInfo {
        name: name.clone(),
        model: args.model.clone(),
        executor: format!("{:?}", args.executor).to_lowercase(),
        block_size: config.block_size,
        kv_blocks: config.total_blocks,
        capacity_tokens: instance.capacity_tokens(),
    };
    let shared = Shared::new();
    let (tx, rx) = std::sync::mpsc::channel();
    let runner = Runner::new(instance, backend, shared.clone());
    let loop_thread = std::thread::Builder::new().name("engine-loop".into()).spawn(move || runner.run(rx))?;
    let service = service::EngineService { commands: Mutex::new(tx), shared, info: info.clone() };
    for control in &args.control {
        tokio::spawn(register::keep_registered(control.clone(), addr, args.pool.clone(), info.clone()));
    }
    // Tests and the demo read this line to find the port.
    println!("engine {name} listening on {addr}");
    tracing::info!(%addr, model = %args.model, kv_blocks = config.total_blocks, "engine serving");
    tonic::transport::Server::builder()
        .add_service(proto::engine_server::EngineServer::new(service))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            crate::shutdown_signal(),
        )
        .await?;
    drop(loop_thread);
    Ok(())
}
