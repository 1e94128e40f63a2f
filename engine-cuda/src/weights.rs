//! Weights in the Hugging Face layout: `config.json` beside one `model.safetensors` or several
//! shards (named by `model.safetensors.index.json`, or every `*.safetensors` in the folder).
//!
//! Files are memory-mapped and indexed by tensor name once; each tensor is checked for shape
//! and dtype (bf16, f16 or f32; the last two are converted to bf16) before upload. The Q, K, V
//! projections of a layer are concatenated into one matrix, and so are gate and up, so that
//! each is one GEMM.

use super::config::LlamaConfig;
use super::context::Gpu;
use super::error::CudaError;
use cudarc::driver::CudaSlice;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Hugging Face tensor names of one decoder layer.
pub struct LayerNames {
    pub input_norm: String,
    pub q: String,
    pub k: String,
    pub v: String,
    pub o: String,
    pub post_norm: String,
    pub gate: String,
    pub up: String,
    pub down: String,
}

impl LayerNames {
    pub fn new(layer: usize) -> LayerNames {
        let p = format!("model.layers.{layer}");
        LayerNames {
            input_norm: format!("{p}.input_layernorm.weight"),
            q: format!("{p}.self_attn.q_proj.weight"),
            k: format!("{p}.self_attn.k_proj.weight"),
            v: format!("{p}.self_attn.v_proj.weight"),
            o: format!("{p}.self_attn.o_proj.weight"),
            post_norm: format!("{p}.post_attention_layernorm.weight"),
            gate: format!("{p}.mlp.gate_proj.weight"),
            up: format!("{p}.mlp.up_proj.weight"),
            down: format!("{p}.mlp.down_proj.weight"),
        }
    }
}

pub const EMBED: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";

/// Every tensor a model of shape `cfg` has, with its shape, in the order make-model writes
/// them (the order of transformers' state dict).
pub fn tensor_shapes(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let mut out = vec![(EMBED.to_string(), vec![cfg.vocab_size, h])];
    for l in 0..cfg.num_hidden_layers {
        let n = LayerNames::new(l);
        out.push((n.q, vec![cfg.q_dim(), h]));
        out.push((n.k, vec![cfg.kv_dim(), h]));
        out.push((n.v, vec![cfg.kv_dim(), h]));
        out.push((n.o, vec![h, cfg.q_dim()]));
        out.push((n.gate, vec![i, h]));
        out.push((n.up, vec![i, h]));
        out.push((n.down, vec![h, i]));
        out.push((n.input_norm, vec![h]));
        out.push((n.post_norm, vec![h]));
    }
    out.push((FINAL_NORM.to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push((LM_HEAD.to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// Where one tensor's bytes are.
#[derive(Clone, Debug)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range in the file (header included in the offset).
    start: usize,
    end: usize,
}

/// The memory-mapped safetensors files of a model folder, indexed by tensor name.
pub struct ModelFiles {
    paths: Vec<PathBuf>,
    maps: Vec<Mmap>,
    index: HashMap<String, Entry>,
}

impl ModelFiles {
    /// Maps and indexes the safetensors files of `dir`.
    pub fn open(dir: &Path) -> Result<ModelFiles, CudaError> {
        let paths = safetensors_files(dir)?;
        let mut maps = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for (fi, path) in paths.iter().enumerate() {
            let file = File::open(path).map_err(|e| CudaError::io(path, e))?;
            // SAFETY of the map (memmap2's contract): the file must not be truncated while
            // mapped. Model folders are read-only inputs; a concurrent writer would be an
            // operator error, and the worst case is a SIGBUS at load time, not corruption.
            #[allow(unsafe_code)]
            let map = unsafe { Mmap::map(&file) }.map_err(|e| CudaError::io(path, e))?;
            let (header_len, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| CudaError::Weights { path: path.clone(), msg: format!("not a safetensors file: {e}") })?;
            let data_start = 8 + header_len;
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                let entry = Entry {
                    file: fi,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + s,
                    end: data_start + e,
                };
                if index.insert(name.clone(), entry).is_some() {
                    return Err(CudaError::Weights {
                        path: path.clone(),
                        msg: format!("tensor {name} appears in more than one file"),
                    });
                }
            }
            maps.push(map);
        }
        Ok(ModelFiles { paths, maps, index })
    }

    /// The tensor's elements as bf16 bit patterns, checked against `shape`.
    pub fn bf16(&self, name: &str, shape: &[usize]) -> Result<Vec<u16>, CudaError> {
        let e = self.index.get(name).ok_or_else(|| CudaError::Weights {
            path: self.paths.first().cloned().unwrap_or_default(),
            msg: format!("missing tensor {name}"),
        })?;
        let path = &self.paths[e.file];
        if e.shape != shape {
            return Err(CudaError::Weights {
                path: path.clone(),
                msg: format!("tensor {name} has shape {:?}, config.json implies {shape:?}", e.shape),
            });
        }
        let bytes = &self.maps[e.file][e.start..e.end];
        let n: usize = shape.iter().product();
        let size = match e.dtype {
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            other => {
                return Err(CudaError::Weights {
                    path: path.clone(),
                    msg: format!("tensor {name} has dtype {other:?}; bf16, f16 or f32 expected"),
                })
            }
        };
        if bytes.len() != n * size {
            return Err(CudaError::Weights {
                path: path.clone(),
                msg: format!("tensor {name} holds {} bytes, its shape needs {}", bytes.len(), n * size),
            });
        }
        let out = match e.dtype {
            Dtype::BF16 => bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| {
                    half::bf16::from_f32(half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).to_bits()
                })
                .collect(),
            _ => bytes
                .chunks_exact(4)
                .map(|c| half::bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_bits())
                .collect(),
        };
        Ok(out)
    }

    /// Several tensors stacked along their first dimension (fused projections).
    pub fn bf16_concat(&self, parts: &[(&str, Vec<usize>)]) -> Result<Vec<u16>, CudaError> {
        let mut out = Vec::new();
        for (name, shape) in parts {
            out.extend(self.bf16(name, shape)?);
        }
        Ok(out)
    }
}

/// The safetensors files of a model folder: those the shard index names, else every
/// `*.safetensors` in name order.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, CudaError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| CudaError::io(&index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| CudaError::Weights { path: index.clone(), msg: format!("not JSON: {e}") })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| CudaError::Weights { path: index.clone(), msg: "no `weight_map` object".into() })?;
        let mut files: Vec<String> = Vec::new();
        for (tensor, f) in map {
            let f = f.as_str().ok_or_else(|| CudaError::Weights {
                path: index.clone(),
                msg: format!("weight_map entry for {tensor} is not a file name"),
            })?;
            if !files.iter().any(|x| x == f) {
                files.push(f.to_string());
            }
        }
        files.sort();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| CudaError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(CudaError::Weights { path: dir.to_path_buf(), msg: "no *.safetensors file".into() });
    }
    Ok(files)
}

/// One decoder layer on the GPU, bf16, PyTorch's `[out, in]` layout.
pub struct LayerWeights {
    pub input_norm: CudaSlice<u16>,
    /// `[q_dim + 2 * kv_dim, hidden]`: q, k and v projections stacked.
    pub qkv: CudaSlice<u16>,
    pub o: CudaSlice<u16>,
    pub post_norm: CudaSlice<u16>,
    /// `[2 * intermediate, hidden]`: gate then up.
    pub gate_up: CudaSlice<u16>,
    pub down: CudaSlice<u16>,
}

/// All weights on the GPU.
pub struct Weights {
    pub embed: CudaSlice<u16>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: CudaSlice<u16>,
    /// `None` when tied to the embeddings.
    pub lm_head: Option<CudaSlice<u16>>,
}

impl Weights {
    /// Bytes of device memory the weights of `cfg` take.
    pub fn bytes(cfg: &LlamaConfig) -> u64 {
        cfg.parameters() * 2
    }

    /// Loads `files` for the model `cfg` onto the GPU.
    pub fn load(gpu: &Gpu, cfg: &LlamaConfig, files: &ModelFiles) -> Result<Weights, CudaError> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let up = |host: Vec<u16>, what: &str| -> Result<CudaSlice<u16>, CudaError> {
            let mut d = gpu.zeros::<u16>(host.len(), what)?;
            gpu.upload(&host, &mut d, what)?;
            Ok(d)
        };
        let embed = up(files.bf16(EMBED, &[cfg.vocab_size, h])?, EMBED)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let n = LayerNames::new(l);
            let qkv = files.bf16_concat(&[
                (&n.q, vec![cfg.q_dim(), h]),
                (&n.k, vec![cfg.kv_dim(), h]),
                (&n.v, vec![cfg.kv_dim(), h]),
            ])?;
            let gate_up = files.bf16_concat(&[(&n.gate, vec![i, h]), (&n.up, vec![i, h])])?;
            layers.push(LayerWeights {
                input_norm: up(files.bf16(&n.input_norm, &[h])?, &n.input_norm)?,
                qkv: up(qkv, &n.q)?,
                o: up(files.bf16(&n.o, &[h, cfg.q_dim()])?, &n.o)?,
                post_norm: up(files.bf16(&n.post_norm, &[h])?, &n.post_norm)?,
                gate_up: up(gate_up, &n.gate)?,
                down: up(files.bf16(&n.down, &[h, i])?, &n.down)?,
            });
        }
        let final_norm = up(files.bf16(FINAL_NORM, &[h])?, FINAL_NORM)?;
        let lm_head =
            if cfg.tie_word_embeddings { None } else { Some(up(files.bf16(LM_HEAD, &[cfg.vocab_size, h])?, LM_HEAD)?) };
        gpu.sync()?;
        Ok(Weights { embed, layers, final_norm, lm_head })
    }

    /// The LM head's matrix (the embeddings when tied).
    pub fn lm_head(&self) -> &CudaSlice<u16> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}
