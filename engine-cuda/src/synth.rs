//! Models with random weights written in the Hugging Face layout (`config.json` and
//! safetensors, sharded above a size), so tests and benchmarks need no download and
//! transformers can load the very same files as a reference.
//!
//! Weights are uniform with the standard deviation of transformers' Llama initialisation
//! (0.02); norm weights are 1 ± 0.1, not exactly 1, so that a kernel that forgot to apply them
//! fails the comparison. Every tensor is drawn from a sub-seed of (seed, tensor name), so the
//! files are the same on every machine and thread count.

use super::config::LlamaConfig;
use super::error::CudaError;
use super::weights::tensor_shapes;
use engine::ids::{derive_seed, mix64};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Standard deviation of the projection and embedding weights.
const WEIGHT_STD: f32 = 0.02;
/// Spread of norm weights around 1.
const NORM_SPREAD: f32 = 0.1;
/// Elements drawn per work unit: each unit has its own sub-seed, so the output does not
/// depend on how units are spread over threads.
const UNIT: usize = 1 << 20;

/// What [`write_random_model`] wrote.
#[derive(Clone, Debug)]
pub struct Written {
    pub files: Vec<PathBuf>,
    pub bytes: u64,
}

/// Writes `config.json` and random bf16 weights for `cfg` into `dir` (created if missing).
/// Models larger than `max_shard_bytes` are split into `model-0000K-of-0000N.safetensors`
/// shards with a `model.safetensors.index.json`, as the Hugging Face hub lays them out.
pub fn write_random_model(
    dir: &Path,
    cfg: &LlamaConfig,
    seed: u64,
    max_shard_bytes: u64,
) -> Result<Written, CudaError> {
    std::fs::create_dir_all(dir).map_err(|e| CudaError::io(dir, e))?;
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, cfg.to_json()).map_err(|e| CudaError::io(&config_path, e))?;
    let tensors = tensor_shapes(cfg);
    let shards = plan_shards(&tensors, max_shard_bytes);
    let n = shards.len();
    let mut files = Vec::new();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (k, shard) in shards.iter().enumerate() {
        let name =
            if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", k + 1) };
        let path = dir.join(&name);
        let specs: Vec<&(String, Vec<usize>)> = shard.iter().map(|&i| &tensors[i]).collect();
        total += write_shard(&path, &specs, seed)?;
        for s in &specs {
            weight_map.insert(s.0.clone(), serde_json::Value::String(name.clone()));
        }
        files.push(path);
    }
    if n > 1 {
        let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        let path = dir.join("model.safetensors.index.json");
        std::fs::write(&path, index.to_string()).map_err(|e| CudaError::io(&path, e))?;
    }
    Ok(Written { files, bytes: total })
}

/// Splits tensors, in order, into shards of at most `max_bytes` (a larger tensor gets a shard
/// of its own).
pub fn plan_shards(tensors: &[(String, Vec<usize>)], max_bytes: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, (_, shape)) in tensors.iter().enumerate() {
        let bytes = 2 * shape.iter().product::<usize>() as u64;
        if size > 0 && size + bytes > max_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("one shard at least").push(i);
        size += bytes;
    }
    shards
}

/// The safetensors header for `specs` laid out back to back in order, padded with spaces to
/// a multiple of 8 bytes as the format recommends.
pub fn header(specs: &[&(String, Vec<usize>)]) -> Vec<u8> {
    let mut meta = serde_json::Map::new();
    meta.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0usize;
    for (name, shape) in specs {
        let bytes = 2 * shape.iter().product::<usize>();
        meta.insert(
            name.clone(),
            serde_json::json!({ "dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + bytes] }),
        );
        offset += bytes;
    }
    let mut text = serde_json::Value::Object(meta).to_string().into_bytes();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    text
}

/// Streams one shard: header, then each tensor as it is drawn (one tensor in memory at a
/// time). Returns the bytes of tensor data written.
fn write_shard(path: &Path, specs: &[&(String, Vec<usize>)], seed: u64) -> Result<u64, CudaError> {
    let file = std::fs::File::create(path).map_err(|e| CudaError::io(path, e))?;
    let mut w = BufWriter::with_capacity(1 << 22, file);
    let head = header(specs);
    let io = |e| CudaError::io(path, e);
    w.write_all(&(head.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&head).map_err(io)?;
    let mut written = 0u64;
    for (name, shape) in specs {
        let n: usize = shape.iter().product();
        let values = random_tensor(name, n, seed);
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.write_all(&bytes).map_err(io)?;
        written += bytes.len() as u64;
    }
    w.flush().map_err(io)?;
    Ok(written)
}

/// `n` bf16 bit patterns for tensor `name`: norm weights near 1, everything else uniform
/// with standard deviation [`WEIGHT_STD`]. Drawn in parallel, one sub-seed per unit.
pub fn random_tensor(name: &str, n: usize, seed: u64) -> Vec<u16> {
    let is_norm = name.ends_with("norm.weight");
    // Uniform on [-a, a] has standard deviation a / sqrt(3).
    let (center, spread) = if is_norm { (1.0, NORM_SPREAD) } else { (0.0, WEIGHT_STD * 3f32.sqrt()) };
    let tensor_seed = derive_seed(seed, name, 0);
    let mut out = vec![0u16; n];
    let threads = std::thread::available_parallelism().map_or(1, |p| p.get()).min(32);
    let units: Vec<(usize, &mut [u16])> = out.chunks_mut(UNIT).enumerate().collect();
    let per_thread = units.len().div_ceil(threads).max(1);
    let mut groups: Vec<Vec<(usize, &mut [u16])>> = Vec::new();
    let mut it = units.into_iter().peekable();
    while it.peek().is_some() {
        groups.push(it.by_ref().take(per_thread).collect());
    }
    std::thread::scope(|s| {
        for group in groups {
            s.spawn(move || {
                for (u, chunk) in group {
                    let mut state = derive_seed(tensor_seed, "unit", u as u64);
                    for v in chunk.iter_mut() {
                        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                        // 24 random bits to a uniform in [-1, 1).
                        let x = (mix64(state) >> 40) as f32 * (2.0 / 16_777_216.0) - 1.0;
                        *v = half::bf16::from_f32(center + spread * x).to_bits();
                    }
                }
            });
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::ModelFiles;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fleetplane-synth-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn random_model_reads_back_with_the_safetensors_crate_and_the_loader() {
        let cfg = LlamaConfig::preset("tiny").unwrap();
        let dir = temp_dir("single");
        let w = write_random_model(&dir, &cfg, 7, u64::MAX).unwrap();
        assert_eq!(w.files.len(), 1);
        assert_eq!(w.bytes, cfg.parameters() * 2);
        let bytes = std::fs::read(&w.files[0]).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), tensor_shapes(&cfg).len());
        let t = st.tensor("model.layers.1.mlp.down_proj.weight").unwrap();
        assert_eq!(t.shape(), &[256, 512]);
        assert_eq!(t.dtype(), safetensors::Dtype::BF16);
        let files = ModelFiles::open(&dir).unwrap();
        let norm = files.bf16("model.norm.weight", &[256]).unwrap();
        assert!(norm.iter().all(|&b| (half::bf16::from_bits(b).to_f32() - 1.0).abs() <= 0.11));
        assert_eq!(LlamaConfig::load(&dir).unwrap(), cfg);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sharded_models_load_the_same_tensors() {
        let cfg = LlamaConfig::preset("tiny").unwrap();
        let (one, many) = (temp_dir("one"), temp_dir("many"));
        write_random_model(&one, &cfg, 3, u64::MAX).unwrap();
        let w = write_random_model(&many, &cfg, 3, 400_000).unwrap();
        assert!(w.files.len() > 2, "{} shards", w.files.len());
        let (a, b) = (ModelFiles::open(&one).unwrap(), ModelFiles::open(&many).unwrap());
        for (name, shape) in tensor_shapes(&cfg) {
            assert_eq!(a.bf16(&name, &shape).unwrap(), b.bf16(&name, &shape).unwrap(), "{name}");
        }
        std::fs::remove_dir_all(&one).unwrap();
        std::fs::remove_dir_all(&many).unwrap();
    }

    #[test]
    fn loader_errors_name_the_tensor_and_the_problem() {
        let cfg = LlamaConfig::preset("tiny").unwrap();
        let dir = temp_dir("errors");
        write_random_model(&dir, &cfg, 1, u64::MAX).unwrap();
        let files = ModelFiles::open(&dir).unwrap();
        let err = files.bf16("model.norm.weight", &[255]).unwrap_err().to_string();
        assert!(err.contains("model.norm.weight") && err.contains("[256]"), "{err}");
        let err = files.bf16("lm_head.bias", &[1]).unwrap_err().to_string();
        assert!(err.contains("missing tensor lm_head.bias"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        let err = ModelFiles::open(&dir).err().expect("folder is gone").to_string();
        assert!(err.contains(&dir.display().to_string()), "{err}");
    }

    #[test]
    fn random_weights_are_reproducible_and_have_the_intended_spread() {
        let a = random_tensor("model.layers.0.mlp.up_proj.weight", 3 * UNIT + 5, 11);
        assert_eq!(a, random_tensor("model.layers.0.mlp.up_proj.weight", 3 * UNIT + 5, 11));
        assert_ne!(a[..100], random_tensor("model.layers.0.mlp.gate_proj.weight", 100, 11)[..]);
        let xs: Vec<f64> = a.iter().map(|&b| f64::from(half::bf16::from_bits(b).to_f32())).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let std = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64).sqrt();
        assert!(mean.abs() < 1e-4 && (std - 0.02).abs() < 1e-4, "mean {mean} std {std}");
    }
}
