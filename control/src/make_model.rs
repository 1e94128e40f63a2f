//! `fleetplane make-model`: a Llama-shaped model with random bf16 weights, written in the
//! Hugging Face layout (`config.json` + safetensors, sharded above 5 GB), so the CUDA engine's
//! tests and benchmarks need no download and transformers can load the same files.

use crate::Failure;
use anyhow::anyhow;
use clap::Args as ClapArgs;
use engine_cuda::{synth, LlamaConfig};
use std::path::PathBuf;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Shape: tiny (a few MB, for tests), llama-1b (Llama 3.2 1B) or llama-8b (Llama 3.1 8B).
    #[arg(long, value_name = "NAME")]
    pub config: String,

    /// Folder to write; created if missing.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,

    /// Seed of the weights: the same seed writes the same files on every machine.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Largest safetensors shard in GB; larger models are split.
    #[arg(long, value_name = "GB", default_value_t = 5)]
    pub shard_gb: u64,
}

pub fn run(args: Args) -> Result<(), Failure> {
    let cfg = LlamaConfig::preset(&args.config).ok_or_else(|| {
        Failure::Input(anyhow!("unknown --config {:?}; valid: {}", args.config, LlamaConfig::PRESETS.join(", ")))
    })?;
    println!("seed={} config={} parameters={}", args.seed, args.config, cfg.parameters());
    let shard_bytes = args.shard_gb.max(1).saturating_mul(1 << 30);
    let written = synth::write_random_model(&args.out, &cfg, args.seed, shard_bytes)
        .map_err(|e| Failure::Output(anyhow!("writing the model to {}: {e}", args.out.display())))?;
    println!(
        "wrote {} safetensors file(s), {} bytes of weights, to {}",
        written.files.len(),
        written.bytes,
        args.out.display()
    );
    Ok(())
}
