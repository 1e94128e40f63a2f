//! The roofline: one iteration's time from its [`BatchStats`], and an instance's KV capacity.
//!
//! `step = overhead + max(compute, memory) + tp_comm`, all per GPU:
//!
//! - compute: `2 × active body params × tokens` (GEMMs) `+ 2 × hidden × vocab` per sampling
//!   sequence (LM head) `+` attention FLOPs per (query, key) pair, divided by
//!   `tp × peak × compute_efficiency`. GEMMs run at the FP8 peak when the weights are FP8.
//! - memory: weights streamed once per step (`weights / tp`, without the embedding table of
//!   which only a few rows are read; for an MoE only the routed experts the batch touches)
//!   plus KV read and written, divided by `hbm × memory_efficiency`.
//! - tp_comm: two ring all-reduces of the activations per layer.
//!
//! Everything that does not depend on the batch is folded into [`Coefficients`] when the
//! model is built, so [`CostModel::step_time`] is a handful of multiply-adds: it runs once per
//! simulated iteration, millions of times per run.

use engine::{BatchStats, Dur};

use super::error::CostError;
use super::gpu::GpuSpec;
use super::model::{Attention, ModelSpec};
use super::params::{CostParams, Deployment};

/// A model on a GPU type with a deployment: predicts step times and KV capacity.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    model: &'static ModelSpec,
    gpu: &'static GpuSpec,
    deployment: Deployment,
    params: CostParams,
    links: TierLinks,
    /// Derived once from the four above; private so that it cannot go stale.
    k: Coefficients,
}

/// The links KV is loaded back over from the lower tiers, per GPU (each rank loads its own
/// shard over its own PCIe link and NIC, in parallel).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierLinks {
    /// Host memory (L2) to GPU, bytes per second.
    pub l2_bytes_per_s: f64,
    /// Shared store (L3) to GPU, bytes per second.
    pub l3_bytes_per_s: f64,
    /// Fixed latency of a load from L3, seconds.
    pub l3_latency_s: f64,
}

impl Default for TierLinks {
    /// PCIe Gen5 x16 at its practical ~50 GB/s; a 200 Gb/s RDMA NIC per GPU (25 GB/s) with
    /// 100 µs to reach the store.
    fn default() -> Self {
        TierLinks { l2_bytes_per_s: 50e9, l3_bytes_per_s: 25e9, l3_latency_s: 100e-6 }
    }
}

/// Batch-independent factors, in seconds per unit of work on one GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Coefficients {
    gemm_s_per_token: f64,
    lm_head_s_per_sample: f64,
    attention_s_per_pair: f64,
    /// Time to stream the weights every step reads (all but the routed experts and the
    /// embedding table).
    always_read_weights_s: f64,
    routed: Option<RoutedExperts>,
    /// Time to read or write one token's KV on one rank.
    kv_s_per_token: f64,
    comm_s_per_token: f64,
    comm_s_per_step: f64,
    overhead_s: f64,
    kv_capacity_tokens: u64,
}

/// What it takes to read the routed experts a batch touches.
#[derive(Clone, Copy, Debug, PartialEq)]
struct RoutedExperts {
    experts: f64,
    /// `ln(1 − k/E)`: a token misses a given expert with probability `1 − k/E`, so `N` tokens
    /// all miss it with `exp(N · ln(1 − k/E))`.
    ln_miss: f64,
    /// Time to stream one expert's weights over all MoE layers (this rank's shard).
    s_per_expert: f64,
}

/// The terms of one step's time, in seconds. [`StepBreakdown::total_s`] is the step time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepBreakdown {
    pub compute_s: f64,
    pub memory_s: f64,
    pub comm_s: f64,
    pub overhead_s: f64,
    /// Loading cached KV from L2 and L3 into GPU memory.
    pub load_s: f64,
    /// The part of `load_s` no compute hides: the first layer's share, and the L3 latency.
    pub load_exposed_s: f64,
}

impl StepBreakdown {
    /// Compute and memory traffic overlap (the slower one bounds the step); communication
    /// and the fixed overhead do not. KV loads overlap layer by layer, as engines with
    /// layer-wise loading do (LMCache, SGLang HiCache): layer l + 1 loads while layer l
    /// computes, so only the first layer's load (and the store's latency) is exposed.
    pub fn total_s(&self) -> f64 {
        let hidden_load = self.load_s - self.load_exposed_s;
        self.overhead_s + self.load_exposed_s + self.compute_s.max(self.memory_s).max(hidden_load) + self.comm_s
    }

    pub fn is_compute_bound(&self) -> bool {
        self.compute_s > self.memory_s
    }
}

impl CostModel {
    /// Checks the deployment and parameters and that the weights fit, then derives the
    /// per-unit costs.
    pub fn new(
        model: &'static ModelSpec,
        gpu: &'static GpuSpec,
        deployment: Deployment,
        params: CostParams,
    ) -> Result<CostModel, CostError> {
        deployment.validate(model)?;
        params.validate()?;
        let tp = u64::from(deployment.tp);
        let usable_bytes = (gpu.memory_bytes as f64 * params.memory_utilization).floor() as u64;
        let available_bytes = usable_bytes.saturating_sub(params.activation_reserve_bytes);
        let weight_bytes_per_gpu = model.weight_bytes().div_ceil(tp);
        if weight_bytes_per_gpu >= available_bytes {
            return Err(CostError::WeightsDoNotFit {
                model: model.name,
                gpu: gpu.name,
                tp: deployment.tp,
                needed_bytes: weight_bytes_per_gpu,
                available_bytes,
                memory_bytes: gpu.memory_bytes,
                memory_utilization: params.memory_utilization,
                activation_reserve_bytes: params.activation_reserve_bytes,
            });
        }
        let kv_bytes_per_token = kv_bytes_per_token_per_rank(model, deployment.tp);
        let k = Coefficients::derive(model, gpu, deployment.tp, &params, kv_bytes_per_token)
            .with_capacity((available_bytes - weight_bytes_per_gpu) / kv_bytes_per_token);
        Ok(CostModel { model, gpu, deployment, params, links: TierLinks::default(), k })
    }

    /// The same model with other links to the lower KV tiers.
    pub fn with_links(self, links: TierLinks) -> CostModel {
        CostModel { links, ..self }
    }

    pub fn links(&self) -> TierLinks {
        self.links
    }

    /// Bytes of KV one token occupies on one GPU of the instance.
    pub fn kv_bytes_per_token_per_gpu(&self) -> u64 {
        kv_bytes_per_token_per_rank(self.model, self.deployment.tp)
    }

    /// Seconds to load `l2_tokens` from host memory and `l3_tokens` from the shared store,
    /// and the part of it no compute can hide.
    fn load_time(&self, l2_tokens: u64, l3_tokens: u64) -> (f64, f64) {
        if l2_tokens == 0 && l3_tokens == 0 {
            return (0.0, 0.0);
        }
        let bytes = self.kv_bytes_per_token_per_gpu() as f64;
        let l = self.links;
        let latency = if l3_tokens > 0 { l.l3_latency_s } else { 0.0 };
        let transfer = l2_tokens as f64 * bytes / l.l2_bytes_per_s + l3_tokens as f64 * bytes / l.l3_bytes_per_s;
        (transfer + latency, transfer / f64::from(self.model.layers) + latency)
    }

    pub fn model(&self) -> &'static ModelSpec {
        self.model
    }

    pub fn gpu(&self) -> &'static GpuSpec {
        self.gpu
    }

    pub fn deployment(&self) -> Deployment {
        self.deployment
    }

    pub fn params(&self) -> &CostParams {
        &self.params
    }

    /// Predicted duration of one iteration; zero for an empty batch.
    pub fn step_time(&self, stats: &BatchStats) -> Dur {
        Dur::from_secs_f64(self.step_breakdown(stats).total_s())
    }

    /// The terms of [`CostModel::step_time`]; all zero for an empty batch.
    pub fn step_breakdown(&self, s: &BatchStats) -> StepBreakdown {
        if s.is_empty() {
            return StepBreakdown::default();
        }
        let k = &self.k;
        let tokens = s.tokens() as f64;
        let samples = f64::from(s.prefill_seqs) + f64::from(s.decode_seqs);
        let pairs = (s.prefill_attention_pairs + s.decode_context_tokens) as f64;
        let compute_s = k.gemm_s_per_token * tokens + k.lm_head_s_per_sample * samples + k.attention_s_per_pair * pairs;

        let weights_s = k.always_read_weights_s
            + k.routed.map_or(0.0, |r| r.experts * (1.0 - (tokens * r.ln_miss).exp()) * r.s_per_expert);
        // KV read: a decode step reads its whole context. A prefill chunk reads its cached
        // context about once (flash attention keeps the chunk's queries on chip), but the
        // aggregates do not keep each chunk's context, so it is approximated as `seqs × mean
        // positions a new token attends to`: for one chunk of n tokens after c cached ones that
        // is c + (n + 1)/2, an overestimate of n/2 tokens, small next to the weights and exact
        // in the limit of long cached prefixes. KV written: one entry per new token.
        let prefill_read = if s.prefill_tokens > 0 {
            f64::from(s.prefill_seqs) * s.prefill_attention_pairs as f64 / s.prefill_tokens as f64
        } else {
            0.0
        };
        let kv_tokens = s.decode_context_tokens as f64 + prefill_read + tokens;
        let memory_s = weights_s + k.kv_s_per_token * kv_tokens;

        let (load_s, load_exposed_s) = self.load_time(s.load_l2_tokens, s.load_l3_tokens);
        StepBreakdown {
            compute_s,
            memory_s,
            comm_s: k.comm_s_per_step + k.comm_s_per_token * tokens,
            overhead_s: k.overhead_s,
            load_s,
            load_exposed_s,
        }
    }

    /// Tokens of KV the instance can hold. Under pure TP every rank stores its shard of every
    /// token, so the ranks are identical and one rank's free memory over its per-token bytes
    /// is the instance's capacity (not multiplied by `tp`).
    pub fn kv_capacity_tokens(&self) -> u64 {
        self.k.kv_capacity_tokens
    }

    /// Whole KV blocks of `block_size` tokens the instance can hold.
    pub fn kv_blocks(&self, block_size: u32) -> u32 {
        assert!(block_size > 0, "block size must be positive");
        u32::try_from(self.k.kv_capacity_tokens / u64::from(block_size)).unwrap_or(u32::MAX)
    }

    /// GPUs one instance occupies.
    pub fn gpus(&self) -> u32 {
        self.deployment.tp
    }

    /// Assumed price of one instance per hour in USD.
    pub fn price_per_hour(&self) -> f64 {
        f64::from(self.gpus()) * self.gpu.usd_per_hour
    }
}

/// KV bytes one token occupies on one rank. GQA splits the KV heads over the ranks, and
/// replicates one head per rank when there are fewer heads than ranks. MLA's latent is shared
/// by all heads, so every rank keeps all of it: TP does not reduce MLA's KV per rank.
fn kv_bytes_per_token_per_rank(model: &ModelSpec, tp: u32) -> u64 {
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

impl Coefficients {
    fn derive(m: &ModelSpec, gpu: &GpuSpec, tp: u32, p: &CostParams, kv_bytes_per_token: u64) -> Coefficients {
        let tp_f = f64::from(tp);
        let (hidden, vocab, layers) = (f64::from(m.hidden), f64::from(m.vocab), f64::from(m.layers));
        // GEMMs run at the weights' precision; attention at the KV cache's.
        let gemm_peak = if m.weight_bytes_per_param == 1 { gpu.fp8_flops } else { gpu.bf16_flops };
        let attention_peak = if m.kv_bytes_per_element == 1 { gpu.fp8_flops } else { gpu.bf16_flops };
        let gemm_flop_s = tp_f * gemm_peak * p.compute_efficiency;
        let attention_flop_s = tp_f * attention_peak * p.compute_efficiency;
        // FLOPs per (query, key) pair over all layers and heads. GQA: QKᵀ and PV, each a
        // multiply-add over head_dim. MLA in its absorbed form works on the latent directly:
        // QKᵀ over kv_lora_rank + rope and PV over the latent, counted as 2 × (rank + rope).
        let heads = f64::from(m.q_heads);
        let attention_flops_per_pair = match m.attention {
            Attention::Gqa => 4.0 * layers * heads * f64::from(m.head_dim),
            Attention::Mla { kv_lora_rank, rope_head_dim } => {
                2.0 * layers * heads * f64::from(kv_lora_rank + rope_head_dim) * 2.0
            }
        };

        let hbm_bytes_per_s = gpu.hbm_bytes_per_s * p.memory_efficiency;
        let wbytes = f64::from(m.weight_bytes_per_param);
        let always_read_params = m.total_params.saturating_sub(m.routed_expert_params() + m.embedding_params());
        let routed = m.moe.map(|moe| RoutedExperts {
            experts: f64::from(moe.experts),
            ln_miss: (1.0 - f64::from(moe.experts_per_token) / f64::from(moe.experts)).ln(),
            s_per_expert: m.params_per_routed_expert() as f64 * wbytes / tp_f / hbm_bytes_per_s,
        });

        // Two all-reduces per layer (after attention and after the FFN) of tokens × hidden
        // bf16 activations; a ring moves 2(tp − 1)/tp of the message through each link.
        let allreduces = 2.0 * layers;
        let ring_share = 2.0 * (tp_f - 1.0) / tp_f;
        let (comm_s_per_token, comm_s_per_step) = if tp > 1 {
            (allreduces * ring_share * hidden * 2.0 / gpu.link_bytes_per_s, allreduces * p.allreduce_latency_us * 1e-6)
        } else {
            (0.0, 0.0)
        };

        Coefficients {
            gemm_s_per_token: 2.0 * m.active_body_params() as f64 / gemm_flop_s,
            lm_head_s_per_sample: 2.0 * hidden * vocab / gemm_flop_s,
            attention_s_per_pair: attention_flops_per_pair / attention_flop_s,
            always_read_weights_s: always_read_params as f64 * wbytes / tp_f / hbm_bytes_per_s,
            routed,
            kv_s_per_token: kv_bytes_per_token as f64 / hbm_bytes_per_s,
            comm_s_per_token,
            comm_s_per_step,
            overhead_s: p.step_overhead_us * 1e-6,
            kv_capacity_tokens: 0,
        }
    }

    fn with_capacity(self, kv_capacity_tokens: u64) -> Coefficients {
        Coefficients { kv_capacity_tokens, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::gpu::gpu_by_name;
    use crate::cost::model::model_by_name;
    use engine::{BatchEntry, RequestId};

    fn cost(model: &str, gpu: &str, tp: u32) -> CostModel {
        let (m, g) = (model_by_name(model), gpu_by_name(gpu));
        CostModel::new(m.expect("model"), g.expect("gpu"), Deployment { tp }, CostParams::default())
            .expect("deployment fits")
    }

    /// Stats of `seqs` decode steps, each with `context` tokens already cached.
    fn decode(seqs: u32, context: u32) -> BatchStats {
        let mut s = BatchStats::default();
        for i in 0..seqs {
            s.add(&entry(i, context, 1, false));
        }
        s
    }

    /// Stats of one prefill chunk of `tokens` after `context` cached tokens.
    fn prefill(tokens: u32, context: u32) -> BatchStats {
        let mut s = BatchStats::default();
        s.add(&entry(0, context, tokens, true));
        s
    }

    fn entry(i: u32, context_tokens: u32, new_tokens: u32, is_prefill: bool) -> BatchEntry {
        BatchEntry {
            request: RequestId(u64::from(i)),
            context_tokens,
            new_tokens,
            is_prefill,
            load_tokens: [0; 2],
            blocks: (0, 0),
        }
    }

    #[test]
    fn decode_step_of_llama_8b_on_h100_is_near_weight_bytes_over_bandwidth() {
        let c = cost("llama-3.1-8b", "h100", 1);
        // 8.03B params × 2 bytes = 16.06 GB over 3.35 TB/s = 4.79 ms.
        let ideal_s = 16_060_522_496.0 / 3.35e12;
        let step_s = c.step_time(&decode(1, 128)).as_secs_f64();
        let ratio = step_s / ideal_s;
        assert!((0.8..1.2).contains(&ratio), "step {step_s} s, ideal {ideal_s} s, ratio {ratio}");
        assert!(!c.step_breakdown(&decode(1, 128)).is_compute_bound());
    }

    #[test]
    fn kv_loaded_back_is_hidden_behind_compute_but_for_its_first_layer() {
        let c = cost("llama-3.1-8b", "h100", 1);
        let chunk = prefill(512, 8192);
        let mut loaded = chunk;
        // 8K tokens of 128 KiB from host memory at 50 GB/s: 21.5 ms, of which 1/32 exposed.
        loaded.load_l2_tokens = 8192;
        let (plain, with_load) = (c.step_breakdown(&chunk), c.step_breakdown(&loaded));
        let load_s = 8192.0 * 131_072.0 / 50e9;
        assert!((with_load.load_s - load_s).abs() < 1e-9);
        assert!(with_load.load_s > plain.compute_s, "this load is longer than the chunk's compute");
        let expected = plain.overhead_s + load_s / 32.0 + (load_s * 31.0 / 32.0) + plain.comm_s;
        assert!((with_load.total_s() - expected).abs() < 1e-9);
        // A small load hides entirely behind a long chunk except its first layer.
        let mut small = prefill(8192, 0);
        small.load_l3_tokens = 1024;
        let b = c.step_breakdown(&small);
        let exposed = 1024.0 * 131_072.0 / 25e9 / 32.0 + 100e-6;
        assert!((b.total_s() - c.step_breakdown(&prefill(8192, 0)).total_s() - exposed).abs() < 1e-9);
    }

    #[test]
    fn an_8k_prefill_on_h100_is_compute_bound() {
        let c = cost("llama-3.1-8b", "h100", 1);
        let stats = prefill(8192, 0);
        assert_eq!(stats.prefill_attention_pairs, 8192 * 8193 / 2);
        let b = c.step_breakdown(&stats);
        assert!(b.compute_s > b.memory_s, "{b:?}");
        // 2 × 8.03e9 params × 8192 tokens / 989e12 FLOP/s = 133 ms.
        let ideal_s = 2.0 * 8.03e9 * 8192.0 / 989e12;
        let ratio = c.step_time(&stats).as_secs_f64() / ideal_s;
        assert!((1.0..1.8).contains(&ratio), "ratio {ratio}, {b:?}");
    }

    #[test]
    fn kv_capacity_of_llama_70b_on_8_h100_matches_hand_calculation() {
        let c = cost("llama-3.1-70b", "h100", 8);
        // Per GPU: 80 GiB × 0.9 = 85_899_345_920 × 0.9     = 77_309_411_328 bytes usable
        //   − weights 70_553_706_496 × 2 bytes / 8 ranks   = 17_638_426_624
        //   − activation reserve 2 GiB                     =  2_147_483_648
        //   = 57_523_501_056 bytes for KV.
        // Per token per rank: 8 kv heads / 8 ranks = 1 head:
        //   2 (K, V) × 80 layers × 1 head × 128 × 2 bytes = 40_960 bytes (40 KiB).
        // 57_523_501_056 / 40_960 = 1_404_382.35 → 1_404_382 tokens, the same on every rank.
        assert_eq!(c.kv_capacity_tokens(), 1_404_382);
        assert_eq!(c.kv_blocks(16), 1_404_382 / 16);
        assert_eq!(c.gpus(), 8);
        assert_eq!(c.price_per_hour(), 8.0 * 2.5);
    }

    #[test]
    fn mla_kv_is_replicated_on_every_tp_rank() {
        let c = cost("deepseek-v3", "h200", 8);
        // Per GPU: floor(141e9 × 0.9) = 126_900_000_000 − 671e9 / 8 = 83_875_000_000
        //   − 2 GiB = 40_877_516_352 bytes. Every rank keeps the whole latent:
        //   61 layers × (512 + 64) × 2 bytes = 70_272 bytes per token → 581_704 tokens.
        assert_eq!(c.kv_capacity_tokens(), 581_704);
    }

    #[test]
    fn llama_70b_does_not_fit_on_one_a100() {
        let (m, g) = (model_by_name("llama-3.1-70b"), gpu_by_name("a100"));
        let err = CostModel::new(m.expect("model"), g.expect("gpu"), Deployment { tp: 1 }, CostParams::default())
            .expect_err("141 GB of weights on an 80 GB GPU");
        assert_eq!(
            err.to_string(),
            "model `llama-3.1-70b` does not fit on gpu `a100` with tp 1: weights need 141.1 GB \
             per GPU, 75.2 GB available (85.9 GB x 0.9 memory utilization - 2.1 GB activation \
             reserve)"
        );
    }

    #[test]
    fn an_empty_batch_takes_no_time() {
        let c = cost("llama-3.1-8b", "h100", 1);
        assert_eq!(c.step_time(&BatchStats::default()), Dur::ZERO);
    }

    #[test]
    fn step_time_grows_with_batch_size_and_context() {
        let c = cost("qwen3-32b", "h100", 2);
        let by_batch: Vec<Dur> = [1, 8, 64, 256].map(|n| c.step_time(&decode(n, 1024))).to_vec();
        assert!(by_batch.windows(2).all(|w| w[0] < w[1]), "{by_batch:?}");
        let by_context: Vec<Dur> = [0, 1024, 8192, 32768].map(|ctx| c.step_time(&decode(32, ctx))).to_vec();
        assert!(by_context.windows(2).all(|w| w[0] < w[1]), "{by_context:?}");
        let by_prefix: Vec<Dur> = [0, 4096, 16384].map(|ctx| c.step_time(&prefill(2048, ctx))).to_vec();
        assert!(by_prefix.windows(2).all(|w| w[0] < w[1]), "{by_prefix:?}");
    }

    #[test]
    fn tp_two_halves_weight_traffic_but_pays_for_allreduces() {
        let (one, two) = (cost("llama-3.1-8b", "h100", 1), cost("llama-3.1-8b", "h100", 2));
        let (b1, b2) = (one.step_breakdown(&decode(1, 128)), two.step_breakdown(&decode(1, 128)));
        assert_eq!(b1.comm_s, 0.0);
        // 32 layers × 2 all-reduces × 8 µs, plus the transfers: 64 × (2 × 1/2) × 8 KiB of
        // activations over 450 GB/s ≈ 1.2 µs.
        let expected_s = 64.0 * 8e-6 + 64.0 * 8192.0 / 450e9;
        assert!((b2.comm_s - expected_s).abs() < 1e-9, "{b2:?}");
        assert!(b2.memory_s < 0.51 * b1.memory_s, "{b1:?} {b2:?}");
        assert!(b2.total_s() < b1.total_s());
    }

    #[test]
    fn an_moe_decode_reads_only_the_experts_it_routes_to() {
        let c = cost("deepseek-v3", "h200", 8);
        let all_weights_s = 671e9 / 8.0 / (4.8e12 * 0.9);
        let one = c.step_breakdown(&decode(1, 1024)).memory_s;
        let many = c.step_breakdown(&decode(512, 1024)).memory_s;
        // One token touches 8 of 256 experts: about 37B of the 671B weights are read.
        assert!(one < 0.1 * all_weights_s, "{one} vs {all_weights_s}");
        // 512 tokens touch almost every expert (256 × (1 − (31/32)^512) ≈ 256).
        assert!(many > 0.9 * all_weights_s, "{many} vs {all_weights_s}");
    }
}
