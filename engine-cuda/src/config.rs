//! A Llama-family model's shape, read from (and written to) Hugging Face's `config.json`.
//!
//! Only the fields the forward pass needs are read; each missing or ill-typed one is an error
//! naming the field. Presets give the shapes `fleetplane make-model` writes.

use super::error::CudaError;
use serde_json::{json, Map, Value};
use std::path::Path;

/// The shape and constants of a Llama-family decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Grouped-query attention: each KV head serves `num_attention_heads / num_key_value_heads`
    /// query heads.
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// Llama 3's frequency-dependent RoPE scaling; `None`: plain RoPE.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// The LM head reuses the embedding matrix (Llama 3.2 1B and 3B do).
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
}

/// `rope_scaling` with `rope_type: "llama3"`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: f32,
}

impl LlamaConfig {
    /// Reads `DIR/config.json`.
    pub fn load(dir: &Path) -> Result<LlamaConfig, CudaError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| CudaError::io(&path, e))?;
        LlamaConfig::from_json(&text).map_err(|msg| CudaError::Config { path, msg })
    }

    /// Parses the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<LlamaConfig, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let o = v.as_object().ok_or("not a JSON object")?;
        if let Some(mt) = o.get("model_type").and_then(Value::as_str) {
            if mt != "llama" {
                return Err(format!("model_type is {mt:?}; only \"llama\" is supported"));
            }
        }
        let hidden_size = uint(o, "hidden_size")?;
        let num_attention_heads = uint(o, "num_attention_heads")?;
        let num_key_value_heads = opt_uint(o, "num_key_value_heads")?.unwrap_or(num_attention_heads);
        let head_dim = match opt_uint(o, "head_dim")? {
            Some(d) => d,
            None if num_attention_heads > 0 => hidden_size / num_attention_heads,
            None => 0,
        };
        let rope_scaling = match o.get("rope_scaling") {
            None | Some(Value::Null) => None,
            Some(Value::Object(s)) => {
                let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("");
                if kind != "llama3" {
                    return Err(format!("rope_scaling type {kind:?} is not supported (only \"llama3\")"));
                }
                Some(Llama3RopeScaling {
                    factor: float(s, "rope_scaling.factor", "factor")?,
                    low_freq_factor: float(s, "rope_scaling.low_freq_factor", "low_freq_factor")?,
                    high_freq_factor: float(s, "rope_scaling.high_freq_factor", "high_freq_factor")?,
                    original_max_position_embeddings: float(
                        s,
                        "rope_scaling.original_max_position_embeddings",
                        "original_max_position_embeddings",
                    )?,
                })
            }
            Some(_) => return Err("rope_scaling is not an object".into()),
        };
        let cfg = LlamaConfig {
            hidden_size,
            intermediate_size: uint(o, "intermediate_size")?,
            num_hidden_layers: uint(o, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: uint(o, "vocab_size")?,
            rms_norm_eps: opt_float(o, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: opt_float(o, "rope_theta")?.unwrap_or(10_000.0),
            rope_scaling,
            tie_word_embeddings: o.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            max_position_embeddings: opt_uint(o, "max_position_embeddings")?.unwrap_or(8192),
            bos_token_id: token_id(o, "bos_token_id")?,
            eos_token_id: token_id(o, "eos_token_id")?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks what the kernels assume about the shape.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("vocab_size", self.vocab_size),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} must be positive"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        // The attention kernel gives each of a warp's 32 lanes head_dim / 32 elements, and
        // RoPE rotates pairs (i, i + head_dim / 2).
        if !matches!(self.head_dim, 64 | 128 | 256) {
            return Err(format!("head_dim {} is not supported (64, 128 or 256)", self.head_dim));
        }
        // The split attention kernel runs one warp per query head of a KV head's group in one
        // block, with the group's queries and a 32-key tile of K and V in static shared memory.
        let group = self.num_attention_heads / self.num_key_value_heads;
        let shared = group * self.head_dim * 4 + 32 * (self.head_dim + 2) * 2 + 32 * self.head_dim * 2;
        if group > 32 || shared > 48 << 10 {
            return Err(format!(
                "{group} query heads per KV head with head_dim {} are not supported (the attention kernel needs {shared} bytes of shared memory, at most 48 KiB, and at most 32 heads per group)",
                self.head_dim
            ));
        }
        if self.vocab_size > i32::MAX as usize {
            return Err(format!("vocab_size {} does not fit a token id", self.vocab_size));
        }
        Ok(())
    }

    /// Width of the fused Q, K, V projection's output.
    pub fn qkv_dim(&self) -> usize {
        (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
    }

    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Parameters, counting a tied LM head once.
    pub fn parameters(&self) -> u64 {
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let layer = h * self.qkv_dim() as u64 + self.q_dim() as u64 * h + 3 * h * i + 2 * h;
        let embed = self.vocab_size as u64 * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed + head + h + self.num_hidden_layers as u64 * layer
    }

    /// RoPE's inverse frequencies, one per rotated pair, with Llama 3's scaling applied: the
    /// same float32 computation as transformers' `_compute_llama3_parameters`, so that the
    /// angles match the reference bit for bit before the cosine.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base = self.rope_theta;
        let mut inv: Vec<f32> = (0..d / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32)).collect();
        if let Some(s) = self.rope_scaling {
            let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
            let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
            for f in &mut inv {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                *f = if wavelen > low_wavelen {
                    // Long wavelengths: slowed down by the full factor.
                    *f / s.factor
                } else if wavelen < high_wavelen {
                    *f
                } else {
                    // In between: a smooth blend of the scaled and unscaled frequency.
                    let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * *f / s.factor + smooth * *f
                };
            }
        }
        inv
    }

    /// The shapes `fleetplane make-model --config NAME` writes: `tiny` (a few MB, for tests),
    /// `llama-1b` (Llama 3.2 1B's shape) and `llama-8b` (Llama 3.1 8B's).
    pub fn preset(name: &str) -> Option<LlamaConfig> {
        let llama3 = Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        });
        let base = LlamaConfig {
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            vocab_size: 128_256,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_scaling: llama3,
            tie_word_embeddings: false,
            max_position_embeddings: 131_072,
            bos_token_id: Some(128_000),
            eos_token_id: Some(128_001),
        };
        match name {
            "llama-8b" => Some(base),
            "llama-1b" => Some(LlamaConfig {
                hidden_size: 2048,
                intermediate_size: 8192,
                num_hidden_layers: 16,
                head_dim: 64,
                rope_scaling: llama3.map(|s| Llama3RopeScaling { factor: 32.0, ..s }),
                tie_word_embeddings: true,
                ..base
            }),
            // Small enough for CI-sized GPU tests, yet with GQA (2 query heads per KV head),
            // head_dim 64 and RoPE scaling, so every code path of the large shapes runs.
            "tiny" => Some(LlamaConfig {
                hidden_size: 256,
                intermediate_size: 512,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                num_key_value_heads: 2,
                head_dim: 64,
                vocab_size: 512,
                max_position_embeddings: 8192,
                bos_token_id: Some(1),
                eos_token_id: Some(2),
                ..base
            }),
            _ => None,
        }
    }

    /// The names [`LlamaConfig::preset`] knows.
    pub const PRESETS: [&'static str; 3] = ["tiny", "llama-1b", "llama-8b"];

    /// `config.json` text in the Hugging Face layout, readable by transformers'
    /// `LlamaForCausalLM` and by [`LlamaConfig::from_json`].
    pub fn to_json(&self) -> String {
        let mut v = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "torch_dtype": "bfloat16",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        });
        if let Some(s) = self.rope_scaling {
            v["rope_scaling"] = json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            });
        }
        // Pretty-printed: a person reads it next to the weights.
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }
}

fn opt_uint(o: &Map<String, Value>, key: &str) -> Result<Option<usize>, String> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| format!("`{key}` is not a non-negative integer")),
    }
}

fn uint(o: &Map<String, Value>, key: &str) -> Result<usize, String> {
    opt_uint(o, key)?.ok_or_else(|| format!("missing `{key}`"))
}

fn opt_float(o: &Map<String, Value>, key: &str) -> Result<Option<f32>, String> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| format!("`{key}` is not a number")),
    }
}

fn float(o: &Map<String, Value>, name: &str, key: &str) -> Result<f32, String> {
    match o.get(key) {
        None | Some(Value::Null) => Err(format!("missing `{name}`")),
        Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| format!("`{name}` is not a number")),
    }
}

/// A token id, or the first of a list (Llama 3.1 lists several end-of-sequence ids).
fn token_id(o: &Map<String, Value>, key: &str) -> Result<Option<u32>, String> {
    let v = match o.get(key) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) => match a.first() {
            Some(v) => v,
            None => return Ok(None),
        },
        Some(v) => v,
    };
    v.as_u64().and_then(|n| u32::try_from(n).ok()).map(Some).ok_or_else(|| format!("`{key}` is not a token id"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_round_trip_through_config_json() {
        for name in LlamaConfig::PRESETS {
            let cfg = LlamaConfig::preset(name).expect("preset exists");
            assert_eq!(LlamaConfig::from_json(&cfg.to_json()), Ok(cfg), "{name}");
        }
    }

    /// Pins the published shapes: Llama 3.2 1B has 1.24B parameters, Llama 3.1 8B 8.03B.
    #[test]
    fn presets_have_the_published_parameter_counts() {
        let p1 = LlamaConfig::preset("llama-1b").unwrap().parameters();
        let p8 = LlamaConfig::preset("llama-8b").unwrap().parameters();
        assert_eq!(p1, 1_235_814_400);
        assert_eq!(p8, 8_030_261_248);
    }

    #[test]
    fn a_real_llama_3_config_parses() {
        let text = r#"{"architectures":["LlamaForCausalLM"],"attention_bias":false,"bos_token_id":128000,
          "eos_token_id":[128001,128008,128009],"hidden_act":"silu","hidden_size":4096,
          "intermediate_size":14336,"max_position_embeddings":131072,"model_type":"llama",
          "num_attention_heads":32,"num_hidden_layers":32,"num_key_value_heads":8,"rms_norm_eps":1e-05,
          "rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
          "original_max_position_embeddings":8192,"rope_type":"llama3"},"rope_theta":500000.0,
          "tie_word_embeddings":false,"torch_dtype":"bfloat16","vocab_size":128256}"#;
        let cfg = LlamaConfig::from_json(text).unwrap();
        assert_eq!(cfg.head_dim, 128);
        assert_eq!(cfg.eos_token_id, Some(128_001));
        assert_eq!(cfg.rope_scaling.unwrap().factor, 8.0);
    }

    #[test]
    fn config_errors_name_the_field() {
        let check = |text: &str, want: &str| {
            let err = LlamaConfig::from_json(text).unwrap_err();
            assert!(err.contains(want), "{err:?} should mention {want:?}");
        };
        check("[1]", "not a JSON object");
        check(r#"{"hidden_size":64}"#, "missing `num_attention_heads`");
        check(
            r#"{"hidden_size":"x","intermediate_size":1,"num_hidden_layers":1,"num_attention_heads":1,"vocab_size":1}"#,
            "hidden_size",
        );
        check(
            r#"{"hidden_size":96,"intermediate_size":1,"num_hidden_layers":1,"num_attention_heads":1,"vocab_size":1}"#,
            "head_dim 96",
        );
        check(r#"{"model_type":"mistral"}"#, "model_type");
    }

    /// Llama 3's scaling leaves high frequencies alone and divides low ones by the factor.
    #[test]
    fn llama3_rope_scaling_keeps_high_and_divides_low_frequencies() {
        let cfg = LlamaConfig::preset("llama-8b").unwrap();
        let plain = LlamaConfig { rope_scaling: None, ..cfg.clone() }.rope_inv_freq();
        let scaled = cfg.rope_inv_freq();
        assert_eq!(scaled[0], plain[0]);
        let last = plain.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() <= plain[last] * 1e-6);
    }
}
