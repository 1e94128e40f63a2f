//! The batch-independent factors of a [`CostModel`](crate::CostModel): everything its step
//! time needs from the model, GPU, deployment and parameters, folded in once when it is
//! built, so that a step is a handful of multiply-adds. The formulas are in
//! [`Coefficients::derive`]; weights and KV bytes per GPU beside them.

use crate::gpu::GpuSpec;
use crate::model::{Attention, ModelSpec};
use crate::params::{CostParams, Deployment};

/// Batch-independent factors, in seconds per unit of work on one GPU. "Per rank token" terms
/// multiply the busiest attention rank's tokens, the others the whole batch's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Coefficients {
    /// Attention-side GEMMs (the projections) on one rank's `tp` GPUs.
    pub(crate) attention_gemm_s_per_token: f64,
    /// The other GEMMs, spread over all the instance's GPUs.
    pub(crate) gemm_s_per_token: f64,
    pub(crate) lm_head_s_per_sample: f64,
    pub(crate) attention_s_per_pair: f64,
    /// Time to stream the weights every step reads (all but the routed experts and the
    /// embedding table).
    pub(crate) always_read_weights_s: f64,
    pub(crate) routed: Option<RoutedExperts>,
    /// Time to read or write one token's KV on one rank.
    pub(crate) kv_s_per_token: f64,
    /// The all-reduce inside an attention TP group.
    pub(crate) comm_s_per_rank_token: f64,
    /// The collectives over all GPUs around FFNs spread TP-style.
    pub(crate) comm_s_per_token: f64,
    /// Expert parallelism's dispatch and combine.
    pub(crate) alltoall_s_per_rank_token: f64,
    pub(crate) comm_s_per_step: f64,
    pub(crate) overhead_s: f64,
    /// Added to steps with prompt tokens (run without CUDA graphs).
    pub(crate) prefill_overhead_s: f64,
    /// Per sequence in the step (sampling, bookkeeping).
    pub(crate) sequence_overhead_s: f64,
    pub(crate) kv_capacity_tokens: u64,
}

/// What it takes to read the routed experts a batch touches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RoutedExperts {
    pub(crate) experts: f64,
    /// `ln(1 − k/E)`: a token misses a given expert with probability `1 − k/E`, so `N` tokens
    /// all miss it with `exp(N · ln(1 − k/E))`.
    pub(crate) ln_miss: f64,
    /// Time to stream one expert's weights over all MoE layers, per GPU (its 1/G shard under
    /// TP, or under EP a whole expert on 1/G of the GPUs: the same in expectation).
    pub(crate) s_per_expert: f64,
}

/// KV bytes one token occupies on one rank. GQA splits the KV heads over the ranks, and
/// replicates one head per rank when there are fewer heads than ranks. MLA's latent is shared
/// by all heads, so every rank keeps all of it: TP does not reduce MLA's KV per rank.
pub(crate) fn kv_bytes_per_token_per_rank(model: &ModelSpec, tp: u32) -> u64 {
    match model.attention {
        Attention::Gqa => {
            let heads = (model.kv_heads / tp).max(1);
            2 * u64::from(model.layers)
                * u64::from(heads)
                * u64::from(model.head_dim)
                * u64::from(model.kv_bytes_per_element)
        }
        Attention::Mla { .. } => model.kv_bytes_per_token(),
    }
    .max(1)
}

/// Parameters on the attention side of the split: replicated on every DP rank, split by `tp`
/// inside it.
fn attention_side_params(m: &ModelSpec) -> u64 {
    m.attention_params() + m.embedding_params()
}

/// Weight bytes on one GPU: `attention side / tp + everything else / G`, with `G = tp × dp`
/// GPUs (routed experts sharded by expert under EP and by TP without: the same bytes per
/// GPU). Written over the common denominator `G`, so that plain TP is exactly
/// `weights / tp`, rounded up.
pub(crate) fn weight_bytes_per_gpu(m: &ModelSpec, d: Deployment) -> u64 {
    let attention = u128::from(attention_side_params(m).min(m.total_params));
    let rest = u128::from(m.total_params) - attention;
    let bytes = (attention * u128::from(d.dp_attention) + rest) * u128::from(m.weight_bytes_per_param);
    u64::try_from(bytes.div_ceil(u128::from(d.model_gpus()))).unwrap_or(u64::MAX)
}

impl Coefficients {
    pub(crate) fn derive(
        m: &ModelSpec,
        gpu: &GpuSpec,
        d: Deployment,
        p: &CostParams,
        kv_bytes_per_token: u64,
    ) -> Coefficients {
        // Context parallelism replicates all of this `cp` times: each replica's terms are
        // those of the `model_gpus()` it spans.
        let (tp, tp_f, gpus_f) = (d.tp, f64::from(d.tp), f64::from(d.model_gpus()));
        let (hidden, vocab, layers) = (f64::from(m.hidden), f64::from(m.vocab), f64::from(m.layers));
        // GEMMs run at the weights' precision; attention at the KV cache's.
        let gemm_peak = if m.weight_bytes_per_param == 1 { gpu.fp8_flops } else { gpu.bf16_flops };
        let attention_peak = if m.kv_bytes_per_element == 1 { gpu.fp8_flops } else { gpu.bf16_flops };
        // The attention side runs on one rank's `tp` GPUs, the rest on all `G`.
        let rank_gemm_flop_s = tp_f * gemm_peak * p.compute_efficiency;
        let gemm_flop_s = gpus_f * gemm_peak * p.compute_efficiency;
        let attention_flop_s = tp_f * attention_peak * p.attention_efficiency();
        // FLOPs per (query, key) pair over all layers and heads. GQA: QKᵀ and PV, each a
        // multiply-add over head_dim. MLA in its absorbed form works on the latent directly:
        // QKᵀ over kv_lora_rank + rope and PV over the latent, counted as 2 × (rank + rope).
        let heads = f64::from(m.q_heads);
        let attention_flops_per_pair = match m.attention {
            Attention::Gqa => 4.0 * layers * heads * f64::from(m.head_dim),
            Attention::Mla { kv_lora_rank, rope_head_dim, .. } => {
                2.0 * layers * heads * f64::from(kv_lora_rank + rope_head_dim) * 2.0
            }
        };

        // GEMM parameters a token multiplies through on each side: the attention projections
        // on its rank; the rest of the body on all GPUs.
        let body = m.active_body_params();
        let rank_body = m.attention_params().min(body);

        let hbm_bytes_per_s = gpu.hbm_bytes_per_s * p.memory_efficiency;
        let wbytes = f64::from(m.weight_bytes_per_param);
        let rank_read_params = m.attention_params();
        let rest_read_params =
            m.total_params.saturating_sub(m.routed_expert_params() + m.embedding_params() + rank_read_params);
        let routed = m.moe.map(|moe| RoutedExperts {
            experts: f64::from(moe.experts),
            ln_miss: (1.0 - f64::from(moe.experts_per_token) / f64::from(moe.experts)).ln(),
            s_per_expert: m.params_per_routed_expert() as f64 * wbytes / gpus_f / hbm_bytes_per_s,
        });

        // Activations move as bf16, `hidden` values per token. A ring all-reduce over n GPUs
        // moves 2(n − 1)/n of the message through each GPU's link; an all-gather followed by
        // a reduce-scatter moves the same.
        let token_bytes = hidden * 2.0;
        let ring = |n: f64| 2.0 * (n - 1.0) / n * token_bytes / gpu.link_bytes_per_s;
        let (allreduce_s, alltoall_s) = (p.allreduce_latency_us * 1e-6, p.alltoall_latency_us * 1e-6);
        // (1) After attention, every layer: an all-reduce inside the rank's TP group of the
        //     rank's tokens.
        let (comm_s_per_rank_token, attention_latency_s) =
            if tp > 1 { (layers * ring(tp_f), layers * allreduce_s) } else { (0.0, 0.0) };
        // (2) After each FFN spread TP-style over all G GPUs (dense layers; MoE layers with
        //     shared experts, or without EP): a collective of all the batch's tokens. Under
        //     plain TP it is the layer's second all-reduce; under attention DP the ranks'
        //     tokens are gathered to every GPU first and the results reduce-scattered back,
        //     two collectives. It is not overlapped with the all-to-all of (3).
        let moe_layers = f64::from(m.moe_layers());
        let shared_experts = m.moe.is_some_and(|moe| moe.shared_experts > 0);
        let gathered_layers = if d.ep > 1 && !shared_experts { layers - moe_layers } else { layers };
        let collectives = if d.dp_attention > 1 { 2.0 } else { 1.0 };
        let (comm_s_per_token, gathered_latency_s) = if d.model_gpus() > 1 {
            (gathered_layers * ring(gpus_f), gathered_layers * collectives * allreduce_s)
        } else {
            (0.0, 0.0)
        };
        // (3) Each MoE layer under EP: every GPU sends each of its tokens (the rank's tokens
        //     over its `tp` GPUs) to the other GPUs that host one of the token's top-k experts,
        //     and gets the results back (dispatch and combine, two all-to-alls). A given other
        //     GPU hosts at least one of k experts drawn from E with probability
        //     ≈ 1 − (1 − 1/ep)^k, so a token goes to `(ep − 1)(1 − (1 − 1/ep)^k)` other GPUs
        //     (4.6 for top-8 at ep 8). At k = 1 this is the familiar `(ep − 1)/ep` share.
        let (alltoall_s_per_rank_token, alltoall_latency_s) = match m.moe {
            Some(moe) if d.ep > 1 => {
                let ep = f64::from(d.ep);
                let remote = (ep - 1.0) * (1.0 - (1.0 - 1.0 / ep).powi(moe.experts_per_token as i32));
                let per_token = moe_layers * 2.0 * remote * token_bytes / gpu.link_bytes_per_s / tp_f;
                (per_token, moe_layers * 2.0 * alltoall_s)
            }
            _ => (0.0, 0.0),
        };

        Coefficients {
            attention_gemm_s_per_token: 2.0 * rank_body as f64 / rank_gemm_flop_s,
            gemm_s_per_token: 2.0 * (body - rank_body) as f64 / gemm_flop_s,
            lm_head_s_per_sample: 2.0 * hidden * vocab / gemm_flop_s,
            attention_s_per_pair: attention_flops_per_pair / attention_flop_s,
            always_read_weights_s: (rank_read_params as f64 / tp_f + rest_read_params as f64 / gpus_f) * wbytes
                / hbm_bytes_per_s,
            routed,
            kv_s_per_token: kv_bytes_per_token as f64 / (gpu.hbm_bytes_per_s * p.kv_memory_efficiency()),
            comm_s_per_rank_token,
            comm_s_per_token,
            alltoall_s_per_rank_token,
            comm_s_per_step: attention_latency_s + gathered_latency_s + alltoall_latency_s,
            overhead_s: p.step_overhead_us * 1e-6,
            prefill_overhead_s: p.prefill_step_overhead_us * 1e-6,
            sequence_overhead_s: p.sequence_overhead_us * 1e-6,
            kv_capacity_tokens: 0,
        }
    }

    pub(crate) fn with_capacity(self, kv_capacity_tokens: u64) -> Coefficients {
        Coefficients { kv_capacity_tokens, ..self }
    }
}
