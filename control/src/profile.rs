//! `fleetplane profile`: the CUDA engine's step profile — measured iteration times over a
//! grid of batch shapes — written as JSON for `fleetplane simulate --profile`, which fits
//! the cost model's efficiencies to it (cost/src/calibrate.rs).

use crate::Failure;
use anyhow::{anyhow, Context};
use clap::Args as ClapArgs;
use cost::{gpu_names, model_by_name, model_names, ModelSpec};
use engine::{StepProfile, PROFILE_FORMAT};
use engine_cuda::{
    libraries_present, serving_shapes, sweep, CudaExecutor, CudaExecutorConfig, LlamaConfig, ModelSource,
};
use std::path::PathBuf;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// A model folder (config.json + safetensors), or `random:NAME` for random weights drawn
    /// on the GPU in the shape of a `make-model` preset (tiny, llama-1b, llama-8b).
    #[arg(long, value_name = "DIR|random:NAME")]
    pub model: String,

    /// JSON file to write.
    #[arg(long, value_name = "FILE.json")]
    pub out: PathBuf,

    /// The cost model's name of the GPU [default: found in the device's name, e.g. h200].
    #[arg(long, value_name = "NAME")]
    pub gpu: Option<String>,

    /// Device memory the executor may use, in GiB, as `fleetplane engine` takes it.
    #[arg(long, value_name = "GIB")]
    pub gpu_memory_gib: Option<f64>,

    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,

    /// Tokens per KV block, as the engines use.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,

    /// Largest step in tokens, as the engines use (chunked prefill's budget).
    #[arg(long, default_value_t = 8192)]
    pub max_batch_tokens: u32,
}

/// `DIR` or `random:NAME`, as `--model` of `profile` and of `engine --executor cuda` take it.
pub fn model_source(arg: &str) -> anyhow::Result<ModelSource> {
    if let Some(name) = arg.strip_prefix("random:") {
        let config = LlamaConfig::preset(name)
            .ok_or_else(|| anyhow!("unknown model preset `{name}` (valid: {})", LlamaConfig::PRESETS.join(", ")))?;
        return Ok(ModelSource::Random { config, seed: 0 });
    }
    let dir = PathBuf::from(arg);
    if !dir.join("config.json").is_file() {
        return Err(anyhow!(
            "--model {} is not a model folder (no config.json) nor random:NAME; make one with `fleetplane make-model`",
            dir.display()
        ));
    }
    Ok(ModelSource::Dir(dir))
}

/// The cost model's entry with this shape (layers, widths, heads, vocabulary).
pub(crate) fn catalog_model(cfg: &LlamaConfig) -> Option<&'static ModelSpec> {
    let same = |m: &ModelSpec| {
        [m.layers, m.hidden, m.q_heads, m.kv_heads, m.head_dim, m.ffn, m.vocab].map(|x| x as usize)
            == [
                cfg.num_hidden_layers,
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.intermediate_size,
                cfg.vocab_size,
            ]
    };
    model_names().into_iter().filter_map(|n| model_by_name(n).ok()).find(|m| same(m))
}

/// The cost model's GPU whose name the device's contains (`NVIDIA H200` → `h200`).
pub(crate) fn catalog_gpu(device: &str) -> Option<&'static str> {
    let device = device.to_lowercase();
    gpu_names().into_iter().find(|g| device.split(|c: char| !c.is_alphanumeric()).any(|w| w == *g))
}

/// The executor settings `profile` and `engine --executor cuda` take from their flags, checked:
/// the model (`DIR` or `random:NAME`), the device memory budget, and that CUDA loads here.
pub fn executor_config(
    model: &str,
    device: usize,
    gpu_memory_gib: Option<f64>,
    block_size: u32,
    max_batch_tokens: u32,
) -> anyhow::Result<CudaExecutorConfig> {
    let source = model_source(model)?;
    if let Err(missing) = libraries_present() {
        return Err(anyhow!("the CUDA executor needs a GPU driver and CUDA libraries: {missing}"));
    }
    let gpu_memory_bytes = match gpu_memory_gib {
        Some(g) if !(g.is_finite() && g > 0.0) => return Err(anyhow!("--gpu-memory-gib must be a positive number")),
        Some(g) => Some((g * (1u64 << 30) as f64) as u64),
        None => None,
    };
    Ok(CudaExecutorConfig { device, gpu_memory_bytes, block_size, max_batch_tokens, ..CudaExecutorConfig::new(source) })
}

pub fn run(args: Args) -> Result<(), Failure> {
    let config = executor_config(&args.model, args.device, args.gpu_memory_gib, args.block_size, args.max_batch_tokens)
        .map_err(Failure::Input)?;
    let max_seqs = config.max_seqs;
    let mut exec =
        CudaExecutor::new(config).map_err(|e| Failure::Run(anyhow!("cannot start the CUDA executor: {e}")))?;
    let device = exec.device_name().map_err(|e| Failure::Run(e.into()))?;
    let model = catalog_model(exec.model_config()).ok_or_else(|| {
        Failure::Input(anyhow!("the model's shape is none of the cost model's ({})", model_names().join(", ")))
    })?;
    let gpu = match &args.gpu {
        Some(g) => cost::gpu_by_name(g).map_err(|e| Failure::Input(e.into()))?.name,
        None => catalog_gpu(&device).ok_or_else(|| {
            Failure::Input(anyhow!(
                "cannot tell which GPU `{device}` is; name it with --gpu ({})",
                gpu_names().join(", ")
            ))
        })?,
    };
    let shapes = serving_shapes(args.max_batch_tokens, max_seqs);
    eprintln!("profiling {} batch shapes of {} on {device} ({} KV blocks)", shapes.len(), model.name, exec.kv_blocks());
    let (samples, skipped) = sweep(&mut exec, &shapes).map_err(|e| Failure::Run(e.into()))?;
    for s in &skipped {
        eprintln!("skipped (KV does not fit): {s:?}");
    }
    println!("| prefill seqs | prefill tokens | decode seqs | decode context | ms |");
    println!("| --- | --- | --- | --- | --- |");
    for s in &samples {
        let ctx = if s.decode_seqs > 0 { s.decode_context_tokens / u64::from(s.decode_seqs) } else { 0 };
        println!("| {} | {} | {} | {ctx} | {:.3} |", s.prefill_seqs, s.prefill_tokens, s.decode_seqs, s.seconds * 1e3);
    }
    let profile = StepProfile {
        format: PROFILE_FORMAT,
        model: model.name.to_string(),
        gpu: gpu.to_string(),
        tp: 1,
        block_size: args.block_size,
        source: format!(
            "fleetplane {} CUDA engine on {device}, {} KV blocks, max {} tokens per step",
            env!("CARGO_PKG_VERSION"),
            exec.kv_blocks(),
            args.max_batch_tokens
        ),
        samples,
    };
    let text = serde_json::to_string_pretty(&profile).map_err(|e| Failure::Output(e.into()))?;
    std::fs::write(&args.out, text)
        .with_context(|| format!("writing {}", args.out.display()))
        .map_err(Failure::Output)?;
    println!("wrote {} samples to {}", profile.samples.len(), args.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_map_to_the_cost_models_catalog() {
        let cfg = LlamaConfig::preset("llama-8b").expect("preset");
        assert_eq!(catalog_model(&cfg).map(|m| m.name), Some("llama-3.1-8b"));
        let tiny = LlamaConfig::preset("tiny").expect("preset");
        assert_eq!(catalog_model(&tiny).map(|m| m.name), None);
        assert_eq!(catalog_gpu("NVIDIA H200"), Some("h200"));
        assert_eq!(catalog_gpu("NVIDIA H100 80GB HBM3"), Some("h100"));
        assert_eq!(catalog_gpu("Tesla T4"), None);
    }

    #[test]
    fn model_arguments_are_checked() {
        assert!(matches!(model_source("random:llama-8b"), Ok(ModelSource::Random { .. })));
        let err = model_source("random:gpt-9").map(|_| ()).expect_err("no such preset").to_string();
        assert!(err.starts_with("unknown model preset `gpt-9` (valid: "), "{err}");
        let err = model_source("/nonexistent").map(|_| ()).expect_err("no folder").to_string();
        assert!(err.contains("is not a model folder"), "{err}");
    }
}
