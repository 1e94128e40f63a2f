//! The roofline: one iteration's time from its [`BatchStats`], and an instance's KV capacity.
//!
//! `step = overhead + max(compute, memory) + comm`, all on the busiest GPU (with
//! [`CostParams::serial_attention`], `max(GEMM compute, weights) + max(attention compute, KV
//! traffic)` in place of the one max: attention kernels that run after the GEMMs instead of
//! hiding under them). The model is
//! split in two sides (see [`Deployment`]): the **attention side** (attention projections
//! and the attention itself, the KV cache, the embedding table) runs on the DP rank that owns
//! each sequence, split by `tp` inside the rank; the **expert / dense side** (routed and
//! shared experts, dense FFN, LM head) is spread over all
//! `G = tp × dp_attention` GPUs. The busiest rank does `f(n) / dp` of the batch's attention
//! work, where `f` is the DP load-imbalance factor ([`CostModel::dp_imbalance_factor`]; 1
//! under plain TP).
//!
//! - compute: `2 × attention-side params × tokens × f/dp / tp` `+ 2 × other body params ×
//!   tokens / G` (GEMMs) `+ 2 × hidden × vocab / G` per sampling sequence (LM head) `+`
//!   attention FLOPs per (query, key) pair `× f/dp / tp`, each over `peak ×
//!   compute_efficiency` (attention over `peak × attention_efficiency`, which defaults to it). GEMMs run at the FP8 peak when the weights are FP8.
//! - memory: the weights of one GPU streamed once per step (without the embedding table, of
//!   which only a few rows are read; for an MoE only the routed experts the batch touches)
//!   plus the rank's KV read and written (`× f/dp`), divided by `hbm × memory_efficiency`.
//! - comm: per layer, a ring all-reduce inside the attention TP group of the rank's tokens;
//!   per layer with an FFN spread TP-style (dense FFN, shared experts, or routed experts
//!   without EP), a collective over all `G` GPUs of the batch's tokens (an all-reduce under plain TP; an all-gather plus a reduce-scatter
//!   under attention DP); per MoE layer with EP, an all-to-all dispatch and combine of the
//!   rank's tokens. Formulas at [`Coefficients::derive`](crate::coefficients::Coefficients::derive).
//!
//! Everything that does not depend on the batch is folded into [`Coefficients`] when the
//! model is built, so [`CostModel::step_time`] is a handful of multiply-adds: it runs once per
//! simulated iteration, millions of times per run.

use engine::{BatchStats, Dur};

use super::coefficients::{kv_bytes_per_token_per_rank, weight_bytes_per_gpu, Coefficients};
use super::decode_table::DecodeTable;
use super::error::CostError;
use super::gpu::GpuSpec;
use super::model::ModelSpec;
use super::params::{CostParams, CpMode, Deployment};

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
    /// Decode-only steps as a profile measured them ([`DecodeTable`]), when one was given.
    decode_table: Option<DecodeTable>,
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

/// One layer of a long prefill under context parallelism, on one replica
/// ([`CostModel::cp_prefill_layer`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpPrefillLayer {
    /// The replica's attention compute for the layer: `1/cp` of the chunk's pairs.
    pub attention_s: f64,
    /// K/V bytes one GPU receives for the layer from the other replicas.
    pub transfer_bytes: f64,
    /// Those bytes over the GPU's NVLink bandwidth.
    pub transfer_s: f64,
    /// The part of the exchange (transfer and latency) that no compute hides.
    pub exposed_s: f64,
    /// K/V of the layer one GPU holds at once for the exchange: the whole layer's under
    /// all-gather (and at `cp = 1`), two blocks under ring.
    pub peak_kv_bytes: f64,
}

/// A step's terms but those that grow with its decodes' context ([`CostModel::step_breakdown`]
/// in two parts, so that a run of decode steps works the rest out once).
struct ContextFreeTerms {
    /// Everything but compute, memory and their attention parts.
    terms: StepBreakdown,
    compute_but_attention_s: f64,
    weights_s: f64,
    prefill_pairs: u64,
    prefill_read: f64,
    tokens: f64,
    cp: f64,
    rank_share: f64,
    attention_s_per_pair: f64,
    kv_s_per_token: f64,
}

impl ContextFreeTerms {
    /// The step's terms when its decodes' contexts sum to `decode_context_tokens`.
    #[inline]
    fn at_context(&self, decode_context_tokens: u64) -> StepBreakdown {
        self.at_counts((self.prefill_pairs + decode_context_tokens) as f64, decode_context_tokens as f64)
    }

    /// [`ContextFreeTerms::at_context`] given the attention's (query, key) pairs,
    /// `prefill_pairs + decode_context_tokens`, and `decode_context_tokens`, as `f64`s.
    #[inline]
    fn at_counts(&self, pairs: f64, decode_context_tokens: f64) -> StepBreakdown {
        let pairs = pairs / self.cp;
        let attention_compute_s = self.attention_s_per_pair * pairs * self.rank_share;
        // KV read: a decode step reads its whole context (see `context_free_terms` for the
        // prefill's part); KV written: one entry per new token.
        let kv_tokens = decode_context_tokens + self.prefill_read + self.tokens;
        let attention_memory_s = self.kv_s_per_token * kv_tokens / self.cp * self.rank_share;
        StepBreakdown {
            compute_s: self.compute_but_attention_s + attention_compute_s,
            memory_s: self.weights_s + attention_memory_s,
            attention_compute_s,
            attention_memory_s,
            ..self.terms
        }
    }
}

/// The terms of one step's time, in seconds. [`StepBreakdown::total_s`] is the step time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepBreakdown {
    pub compute_s: f64,
    pub memory_s: f64,
    /// The attention kernels' part of `compute_s` (their FLOPs) and of `memory_s` (the KV
    /// read and written).
    pub attention_compute_s: f64,
    pub attention_memory_s: f64,
    /// Attention runs after the GEMMs rather than under them ([`CostParams::serial_attention`]).
    pub serial_attention: bool,
    pub comm_s: f64,
    pub overhead_s: f64,
    /// Loading cached KV from L2 and L3 into GPU memory.
    pub load_s: f64,
    /// The part of `load_s` no compute hides: the first layer's share, and the L3 latency.
    pub load_exposed_s: f64,
    /// Loading KV ahead of the turns that will use it (`BatchStats::prefetch_l2_tokens`): on
    /// the same links as `load_s`, behind it, with nothing waiting for it.
    pub prefetch_s: f64,
}

impl StepBreakdown {
    /// Compute and memory traffic overlap (the slower one bounds the step); communication
    /// and the fixed overhead do not. KV loads overlap layer by layer, as engines with
    /// layer-wise loading do (LMCache, SGLang HiCache): layer l + 1 loads while layer l
    /// computes, so only the first layer's load (and the store's latency) is exposed.
    pub fn total_s(&self) -> f64 {
        let hidden_load = self.load_s - self.load_exposed_s + self.prefetch_s;
        let body = if self.serial_attention {
            let gemms = (self.compute_s - self.attention_compute_s).max(self.memory_s - self.attention_memory_s);
            gemms + self.attention_compute_s.max(self.attention_memory_s)
        } else {
            self.compute_s.max(self.memory_s)
        };
        self.overhead_s + self.load_exposed_s + body.max(hidden_load) + self.comm_s
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
        let usable_bytes = (gpu.memory_bytes as f64 * params.memory_utilization).floor() as u64;
        let available_bytes = usable_bytes.saturating_sub(params.activation_reserve_bytes);
        let weight_bytes_per_gpu = weight_bytes_per_gpu(model, deployment);
        if weight_bytes_per_gpu >= available_bytes {
            return Err(CostError::WeightsDoNotFit {
                model: model.name,
                gpu: gpu.name,
                deployment: deployment.to_string(),
                needed_bytes: weight_bytes_per_gpu,
                available_bytes,
                memory_bytes: gpu.memory_bytes,
                memory_utilization: params.memory_utilization,
                activation_reserve_bytes: params.activation_reserve_bytes,
            });
        }
        let kv_bytes_per_token = kv_bytes_per_token_per_rank(model, deployment.tp);
        // Every GPU of a DP rank holds the same share of the rank's requests' KV, so a rank
        // holds what one of its GPUs does, and the instance the sum over its DP ranks.
        let per_rank_tokens = (available_bytes - weight_bytes_per_gpu) / kv_bytes_per_token;
        // Context parallelism shards every sequence's KV over its `cp` replicas, each with the
        // same free memory, so they hold `cp` times what one does.
        let replicas = u64::from(deployment.dp_attention) * u64::from(deployment.cp);
        let k = Coefficients::derive(model, gpu, deployment, &params, kv_bytes_per_token)
            .with_capacity(per_rank_tokens * replicas);
        Ok(CostModel { model, gpu, deployment, params, links: TierLinks::default(), k, decode_table: None })
    }

    /// The same model with other links to the lower KV tiers.
    pub fn with_links(self, links: TierLinks) -> CostModel {
        CostModel { links, ..self }
    }

    /// Prices the decode-only steps `table` covers from its measurements (see [`DecodeTable`]).
    pub fn with_decode_table(self, table: Option<DecodeTable>) -> CostModel {
        CostModel { decode_table: table, ..self }
    }

    pub fn decode_table(&self) -> Option<&DecodeTable> {
        self.decode_table.as_ref()
    }

    pub fn links(&self) -> TierLinks {
        self.links
    }

    /// Bytes of KV one token occupies on one GPU of the DP rank that owns it (all GPUs of the
    /// instance under plain TP).
    pub fn kv_bytes_per_token_per_gpu(&self) -> u64 {
        kv_bytes_per_token_per_rank(self.model, self.deployment.tp)
    }

    /// Bytes of weights on one GPU under the deployment.
    pub fn weight_bytes_per_gpu(&self) -> u64 {
        weight_bytes_per_gpu(self.model, self.deployment)
    }

    /// How much more attention work than the mean the busiest of `dp` attention ranks has in
    /// a batch of `seqs` sequences:
    ///
    /// `f(n) = min(dp, max(dp / n, 1 + c·√(dp / n)))`, and 1 under plain TP,
    ///
    /// with `c` = [`CostParams::dp_imbalance`]. With fewer sequences than ranks some ranks
    /// idle and the busiest holds a whole sequence (`dp / n`: one prefill alone runs on one
    /// rank, `dp` times the mean); with many, the excess of the busiest rank falls as the
    /// spread of a sum of `n / dp` sequences does, `1/√(n / dp)`. It assumes each rank's
    /// scheduler takes a share of the batch's token budget (SGLang divides
    /// `chunked_prefill_size` by the DP size), so a long prompt's chunks spread over ranks
    /// when many requests are waiting.
    pub fn dp_imbalance_factor(&self, seqs: u32) -> f64 {
        if self.deployment.dp_attention <= 1 || seqs == 0 {
            return 1.0;
        }
        let (dp, n) = (f64::from(self.deployment.dp_attention), f64::from(seqs));
        (dp / n).max(1.0 + self.params.dp_imbalance * (dp / n).sqrt()).min(dp)
    }

    /// Seconds to load `l2_tokens` from host memory and `l3_tokens` from the shared store
    /// (on the busiest rank), and the part of it no compute can hide.
    fn load_time(&self, l2_tokens: f64, l3_tokens: f64) -> (f64, f64) {
        if l2_tokens == 0.0 && l3_tokens == 0.0 {
            return (0.0, 0.0);
        }
        let latency = if l3_tokens > 0.0 { self.links.l3_latency_s } else { 0.0 };
        let transfer = self.transfer_time(l2_tokens, l3_tokens);
        (transfer + latency, transfer / f64::from(self.model.layers) + latency)
    }

    /// Moving KV of `l2_tokens` from host memory and `l3_tokens` from the shared store.
    fn transfer_time(&self, l2_tokens: f64, l3_tokens: f64) -> f64 {
        let bytes = self.kv_bytes_per_token_per_gpu() as f64;
        l2_tokens * bytes / self.links.l2_bytes_per_s + l3_tokens * bytes / self.links.l3_bytes_per_s
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
        if let Some(s) = self.decode_table.as_ref().and_then(|t| t.price(stats)) {
            return Dur::from_secs_f64(s);
        }
        Dur::from_secs_f64(self.step_breakdown(stats).total_s())
    }

    /// [`CostModel::step_time`] of `stats` and of the `steps - 1` batches after it that are
    /// the same decodes one token further each (`decode_context_tokens` grown by
    /// `decode_seqs` a step), in order: the same durations, with the terms that do not
    /// depend on the context worked out once.
    pub fn decode_step_times(&self, stats: &BatchStats, steps: u32, mut each: impl FnMut(Dur)) {
        let grow = u64::from(stats.decode_seqs);
        let at =
            |j: u32| BatchStats { decode_context_tokens: stats.decode_context_tokens + grow * u64::from(j), ..*stats };
        if self.decode_table.is_some() || stats.is_empty() {
            (0..steps).for_each(|j| each(self.step_time(&at(j))));
            return;
        }
        let terms = self.context_free_terms(stats);
        let first = stats.decode_context_tokens;
        let last =
            grow.checked_mul(u64::from(steps)).and_then(|g| g.checked_add(first)?.checked_add(terms.prefill_pairs));
        if last.is_some_and(|last| last < 1 << f64::MANTISSA_DIGITS) {
            // Below 2^53 the counts are exact in `f64`, and so are their sums: the contexts
            // grow by an addition a step, with no conversion.
            let (mut pairs, mut context, grow) = ((terms.prefill_pairs + first) as f64, first as f64, grow as f64);
            for _ in 0..steps {
                each(Dur::from_secs_f64(terms.at_counts(pairs, context).total_s()));
                pairs += grow;
                context += grow;
            }
            return;
        }
        for j in 0..steps {
            each(Dur::from_secs_f64(terms.at_context(first + grow * u64::from(j)).total_s()));
        }
    }

    /// The terms of [`CostModel::step_time`]; all zero for an empty batch.
    pub fn step_breakdown(&self, s: &BatchStats) -> StepBreakdown {
        if s.is_empty() {
            return StepBreakdown::default();
        }
        self.context_free_terms(s).at_context(s.decode_context_tokens)
    }

    /// The terms of a non-empty batch's step that do not depend on its decodes' context,
    /// and what finishes them for a context ([`ContextFreeTerms::at_context`]).
    fn context_free_terms(&self, s: &BatchStats) -> ContextFreeTerms {
        let k = &self.k;
        // Context parallelism: each of the `cp` replicas runs its shard of every prefill chunk
        // and every decode token, and attends, reads and loads its shard of the KV. Dividing
        // by 1.0 is exact, so `cp = 1` gives the same numbers as before.
        let cp = f64::from(self.deployment.cp);
        let tokens = if self.deployment.cp > 1 {
            s.prefill_tokens as f64 / cp + f64::from(s.decode_seqs)
        } else {
            s.tokens() as f64
        };
        let samples = f64::from(s.prefill_seqs) + f64::from(s.decode_seqs);
        // The busiest attention rank's share of the batch: exactly 1 under plain TP.
        let rank_share =
            self.dp_imbalance_factor(s.prefill_seqs + s.decode_seqs) / f64::from(self.deployment.dp_attention);
        let rank_tokens = tokens * rank_share;
        // All but the attention, which `at_context` adds last (the same sum, in the same order).
        let compute_but_attention_s =
            k.attention_gemm_s_per_token * rank_tokens + k.gemm_s_per_token * tokens + k.lm_head_s_per_sample * samples;

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

        // Most steps load nothing: their zeros need no conversions (the same numbers).
        let (load_s, load_exposed_s) = if s.load_l2_tokens == 0 && s.load_l3_tokens == 0 {
            (0.0, 0.0)
        } else {
            self.load_time(s.load_l2_tokens as f64 * rank_share / cp, s.load_l3_tokens as f64 * rank_share / cp)
        };
        // Nobody waits for a prefetch's first layer or the store's latency: only the transfer counts.
        let prefetch_s = if s.prefetch_l2_tokens == 0 && s.prefetch_l3_tokens == 0 {
            self.transfer_time(0.0, 0.0)
        } else {
            self.transfer_time(
                s.prefetch_l2_tokens as f64 * rank_share / cp,
                s.prefetch_l3_tokens as f64 * rank_share / cp,
            )
        };
        let mut comm_s = k.comm_s_per_step
            + k.comm_s_per_rank_token * rank_tokens
            + k.comm_s_per_token * tokens
            + k.alltoall_s_per_rank_token * rank_tokens;
        if self.deployment.cp > 1 {
            comm_s += self.context_parallel_comm_s(s, rank_share);
        }
        let step_overhead_s = if s.prefill_tokens > 0 { k.overhead_s + k.prefill_overhead_s } else { k.overhead_s };
        let overhead_s = step_overhead_s + k.sequence_overhead_s * samples;
        ContextFreeTerms {
            terms: StepBreakdown {
                serial_attention: self.params.serial_attention,
                comm_s,
                overhead_s,
                load_s,
                load_exposed_s,
                prefetch_s,
                ..StepBreakdown::default()
            },
            compute_but_attention_s,
            weights_s,
            prefill_pairs: s.prefill_attention_pairs,
            prefill_read,
            tokens: s.tokens() as f64,
            cp,
            rank_share,
            attention_s_per_pair: k.attention_s_per_pair,
            kv_s_per_token: k.kv_s_per_token,
        }
    }

    /// Exposed communication of context parallelism in one step, over all layers, on the
    /// busiest replica:
    ///
    /// - decode: each replica attends its shard of the context, and the partial outputs of
    ///   the rank's decode tokens (`hidden / tp` bf16 values each, with the softmax statistics
    ///   neglected) are combined by a ring all-reduce over the `cp` replicas, per layer;
    /// - prefill: the K/V exchange of [`CostModel::cp_prefill_layer`], per layer. The aggregates
    ///   do not keep each chunk's context, so the K/V a chunk attends to is taken as
    ///   `pairs / (tokens / seqs) + (tokens − seqs) / 2`, which is `context + chunk` exactly for
    ///   one sequence.
    fn context_parallel_comm_s(&self, s: &BatchStats, rank_share: f64) -> f64 {
        let d = self.deployment;
        let (cp, layers) = (f64::from(d.cp), f64::from(self.model.layers));
        let latency_s = self.params.allreduce_latency_us * 1e-6;
        let mut comm_s = 0.0;
        if s.decode_seqs > 0 {
            let bytes =
                2.0 * (cp - 1.0) / cp * f64::from(s.decode_seqs) * rank_share * 2.0 * f64::from(self.model.hidden)
                    / f64::from(d.tp);
            comm_s += layers * (bytes / self.gpu.link_bytes_per_s + latency_s);
        }
        if s.prefill_tokens > 0 {
            let (seqs, n) = (f64::from(s.prefill_seqs), s.prefill_tokens as f64);
            let kv_tokens = s.prefill_attention_pairs as f64 / (n / seqs) + (n - seqs) / 2.0;
            let layer = self.cp_layer(kv_tokens * rank_share, s.prefill_attention_pairs as f64 * rank_share);
            comm_s += layers * layer.exposed_s;
        }
        comm_s
    }

    /// One layer of a prefill chunk of `new_tokens` after `context_tokens` cached ones of one
    /// sequence, under the instance's context parallelism: each replica's attention time, the
    /// K/V it receives, the part of that transfer no compute hides, and the peak K/V working
    /// set per GPU. All zero but the attention at `cp = 1`.
    pub fn cp_prefill_layer(&self, context_tokens: u64, new_tokens: u64) -> CpPrefillLayer {
        let pairs = new_tokens * context_tokens + new_tokens * (new_tokens + 1) / 2;
        self.cp_layer((context_tokens + new_tokens) as f64, pairs as f64)
    }

    /// [`CostModel::cp_prefill_layer`] for `kv_tokens` of K/V attended over `pairs` (query,
    /// key) pairs. The chunk's tokens and the KV are sharded zig-zag (each replica takes one
    /// block from each end of the sequence), so each replica does `1/cp` of the causal pairs.
    /// On one GPU a layer's whole K/V is `W = kv_tokens × KV bytes per token per GPU / layers`
    /// and a replica's block `W / cp`:
    ///
    /// - **all-gather**: the replica receives the `cp − 1` other blocks before its attention
    ///   starts, `(cp − 1)/cp × W / link + one collective latency`, all exposed, and holds the
    ///   whole `W` while the layer runs;
    /// - **ring**: `cp − 1` steps; in each the replica computes its queries against the block
    ///   it holds (`attention / cp`) while the next block arrives (`W / cp / link` + a
    ///   latency), so only `max(0, transfer − compute)` per step is exposed. The first step
    ///   computes the replica's own block, which needs no transfer. It holds two blocks (the
    ///   one computed and the one arriving), `2 W / cp`.
    fn cp_layer(&self, kv_tokens: f64, pairs: f64) -> CpPrefillLayer {
        let d = self.deployment;
        let (cp, layers) = (f64::from(d.cp), f64::from(self.model.layers));
        let attention_s = self.k.attention_s_per_pair * pairs / cp / layers;
        let whole_bytes = kv_tokens * self.kv_bytes_per_token_per_gpu() as f64 / layers;
        if d.cp == 1 {
            return CpPrefillLayer { attention_s, peak_kv_bytes: whole_bytes, ..CpPrefillLayer::default() };
        }
        let link = self.gpu.link_bytes_per_s;
        let latency_s = self.params.allreduce_latency_us * 1e-6;
        let block_bytes = whole_bytes / cp;
        let transfer_bytes = (cp - 1.0) * block_bytes;
        let (exposed_s, peak_kv_bytes) = match d.cp_mode {
            CpMode::AllGather => (transfer_bytes / link + latency_s, whole_bytes),
            CpMode::Ring => {
                let step_exposed_s = (block_bytes / link + latency_s - attention_s / cp).max(0.0);
                ((cp - 1.0) * step_exposed_s, 2.0 * block_bytes)
            }
        };
        CpPrefillLayer { attention_s, transfer_bytes, transfer_s: transfer_bytes / link, exposed_s, peak_kv_bytes }
    }

    /// Tokens of KV the instance can hold. Under pure TP every rank stores its shard of every
    /// token, so the ranks are identical and one rank's free memory over its per-token bytes
    /// is the instance's capacity (not multiplied by `tp`). Under attention DP each rank keeps
    /// only its own requests' KV, so the instance holds the sum over its `dp_attention` ranks.
    /// The engine sees one pool of that size: it does not model a rank filling up while
    /// another has room (a request larger than one rank's share would not fit on a real one).
    pub fn kv_capacity_tokens(&self) -> u64 {
        self.k.kv_capacity_tokens
    }

    /// Whole KV blocks of `block_size` tokens the instance can hold.
    pub fn kv_blocks(&self, block_size: u32) -> u32 {
        assert!(block_size > 0, "block size must be positive");
        u32::try_from(self.k.kv_capacity_tokens / u64::from(block_size)).unwrap_or(u32::MAX)
    }

    /// GPUs one instance occupies: `tp × dp_attention`.
    pub fn gpus(&self) -> u32 {
        self.deployment.gpus()
    }

    /// Assumed price of one instance per hour in USD.
    pub fn price_per_hour(&self) -> f64 {
        f64::from(self.gpus()) * self.gpu.usd_per_hour
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::gpu_by_name;
    use crate::model::model_by_name;
    use engine::{BatchEntry, RequestId};

    fn cost(model: &str, gpu: &str, tp: u32) -> CostModel {
        let (m, g) = (model_by_name(model), gpu_by_name(gpu));
        CostModel::new(m.expect("model"), g.expect("gpu"), Deployment::tensor_parallel(tp), CostParams::default())
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
        BatchEntry::new(RequestId(u64::from(i)), context_tokens, new_tokens, is_prefill)
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

    fn layout(model: &str, gpu: &str, tp: u32, dp_attention: u32, ep: u32) -> CostModel {
        let (m, g) = (model_by_name(model), gpu_by_name(gpu));
        let d = Deployment { tp, dp_attention, ep, ..Deployment::default() };
        CostModel::new(m.expect("model"), g.expect("gpu"), d, CostParams::default()).expect("deployment fits")
    }

    #[test]
    fn gqa_capacity_under_tp_2_by_attention_dp_4_matches_hand_calculation() {
        let c = layout("llama-3.1-70b", "h100", 2, 4, 1);
        // Attention side, replicated on each of the 4 DP ranks and split over its 2 GPUs:
        //   projections 80 × 150_994_944 = 12_079_595_520 + embedding 128_256 × 8192 =
        //   1_050_673_152 → 13_130_268_672 params. The other 57_423_437_824 params are split
        //   over all 8 GPUs. Bytes per GPU: (13_130_268_672 × 4 + 57_423_437_824) × 2 / 8
        //   = 27_486_128_128 (vs 17_638_426_624 under TP 8).
        assert_eq!(c.weight_bytes_per_gpu(), 27_486_128_128);
        assert_eq!(c.gpus(), 8);
        // Free: 77_309_411_328 usable − 2 GiB reserve − 27_486_128_128 = 47_675_799_552.
        // Per token per GPU: 8 kv heads / tp 2 = 4 heads: 2 × 80 × 4 × 128 × 2 = 163_840 bytes.
        // One rank: 47_675_799_552 / 163_840 = 290_989.0 tokens; 4 ranks hold 1_163_956.
        assert_eq!(c.kv_bytes_per_token_per_gpu(), 163_840);
        assert_eq!(c.kv_capacity_tokens(), 4 * 290_989);
        // GQA already splits its KV under TP, so attention DP loses capacity: TP 8 holds
        // 1_404_382 tokens (`kv_capacity_of_llama_70b_on_8_h100_matches_hand_calculation`).
        assert!(c.kv_capacity_tokens() < cost("llama-3.1-70b", "h100", 8).kv_capacity_tokens());
    }

    #[test]
    fn mla_capacity_on_8_h200_grows_from_tp_8_to_attention_dp_8_with_ep_8() {
        let tp8 = cost("deepseek-v3", "h200", 8);
        let dp8 = layout("deepseek-v3", "h200", 1, 8, 8);
        // TP 8: 671e9 fp8 bytes / 8 = 83_875_000_000 per GPU, 40_877_516_352 free, the whole
        // latent (70_272 bytes per token) on every GPU: 581_704 tokens for the node.
        assert_eq!((tp8.weight_bytes_per_gpu(), tp8.kv_capacity_tokens()), (83_875_000_000, 581_704));
        // DP 8 + EP 8: attention projections 61 × 187_105_280 = 11_413_422_080 + embedding
        // 129_280 × 7168 = 926_679_040 → 12_340_101_120 params on every GPU; the other
        // 658_659_898_880 (routed experts by EP, dense and shared FFN and LM head by TP) / 8.
        // (12_340_101_120 × 8 + 658_659_898_880) × 1 byte / 8 = 94_672_588_480 per GPU.
        assert_eq!(dp8.weight_bytes_per_gpu(), 94_672_588_480);
        // Free per GPU: 126_900_000_000 − 2_147_483_648 − 94_672_588_480 = 30_079_927_872;
        // / 70_272 = 428_049.5 → 428_049 tokens of each rank's own requests; × 8 ranks.
        assert_eq!(dp8.kv_bytes_per_token_per_gpu(), 70_272);
        assert_eq!(dp8.kv_capacity_tokens(), 8 * 428_049);
        // 3_424_392 / 581_704 = 5.89×: 8× the GPUs' KV, less the 10.8 GB of attention
        // weights each GPU now keeps whole, out of the 40.9 GB TP 8 left free.
        let ratio = dp8.kv_capacity_tokens() as f64 / tp8.kv_capacity_tokens() as f64;
        assert!((5.88..5.89).contains(&ratio), "{ratio}");
        assert_eq!((dp8.gpus(), dp8.price_per_hour()), (8, tp8.price_per_hour()));
    }

    #[test]
    fn dp_imbalance_factor_follows_its_formula_and_is_one_without_dp() {
        let tp8 = cost("deepseek-v3", "h200", 8);
        let dp8 = layout("deepseek-v3", "h200", 1, 8, 8);
        for n in [0, 1, 3, 8, 64, 4096] {
            assert_eq!(tp8.dp_imbalance_factor(n), 1.0);
        }
        // f(n) = min(8, max(8 / n, 1 + 0.5 √(8 / n))).
        let f = |n| dp8.dp_imbalance_factor(n);
        assert_eq!(f(1), 8.0, "a lone sequence runs on one rank");
        assert_eq!(f(4), 2.0, "four ranks busy, four idle");
        assert!((f(8) - (1.0 + 0.5)).abs() < 1e-12);
        assert!((f(512) - (1.0 + 0.5 / 8.0)).abs() < 1e-12);
        let no_skew = layout_with(1, 8, 8, CostParams { dp_imbalance: 0.0, ..CostParams::default() });
        assert_eq!(no_skew.dp_imbalance_factor(512), 1.0);
    }

    fn layout_with(tp: u32, dp_attention: u32, ep: u32, params: CostParams) -> CostModel {
        let (m, g) = (model_by_name("deepseek-v3"), gpu_by_name("h200"));
        let d = Deployment { tp, dp_attention, ep, ..Deployment::default() };
        CostModel::new(m.expect("model"), g.expect("gpu"), d, params).expect("fits")
    }

    #[test]
    fn plain_tp_steps_ignore_the_dp_and_expert_parallel_knobs() {
        let knobs = CostParams { dp_imbalance: 3.0, alltoall_latency_us: 1000.0, ..CostParams::default() };
        let (plain, tweaked) = (layout_with(8, 1, 1, CostParams::default()), layout_with(8, 1, 1, knobs));
        for stats in [decode(1, 1024), decode(256, 32768), prefill(8192, 0), prefill(2048, 65536)] {
            assert_eq!(plain.step_breakdown(&stats), tweaked.step_breakdown(&stats));
        }
        // TP 8 MoE: two all-reduces per layer, no all-to-all: 122 × 8 µs + 122 × 2 × 7/8 ×
        // 14_336 bytes per token over 450 GB/s.
        let b = plain.step_breakdown(&decode(64, 1024));
        let expected_s = 122.0 * 8e-6 + 64.0 * 122.0 * 1.75 * 14_336.0 / 450e9;
        assert!((b.comm_s - expected_s).abs() < 1e-12, "{b:?}");
    }

    #[test]
    fn expert_parallel_all_to_all_of_a_dp_8_decode_matches_hand_calculation() {
        let c = layout("deepseek-v3", "h200", 1, 8, 8);
        let b = c.step_breakdown(&decode(64, 1024));
        // The busiest rank has f(64) / 8 of the 64 tokens: f = 1 + 0.5 √(1/8) = 1.1768.
        let rank_tokens = 64.0 * (1.0 + 0.5 * (8.0f64 / 64.0).sqrt()) / 8.0;
        // tp 1: no all-reduce inside a rank. All 61 layers have an FFN split over the 8 GPUs
        // (3 dense, 58 with a shared expert): all-gather + reduce-scatter of the 64 tokens,
        // 2 × 7/8 × 14_336 bytes each, and two 8 µs latencies.
        let gathered_s = 61.0 * 2.0 * 8e-6 + 64.0 * 61.0 * 1.75 * 14_336.0 / 450e9;
        // 58 MoE layers × (dispatch + combine): each token goes to 7 × (1 − (7/8)^8) = 4.59
        // other GPUs, 14_336 bytes each way, plus two 20 µs latencies.
        let remote = 7.0 * (1.0 - 0.875f64.powi(8));
        let alltoall_s = 58.0 * 2.0 * 20e-6 + rank_tokens * 58.0 * 2.0 * remote * 14_336.0 / 450e9;
        assert!((b.comm_s - (gathered_s + alltoall_s)).abs() < 1e-12, "{b:?}");
        // Without EP the MoE layers are TP over all 8 GPUs: no all-to-all.
        let no_ep = layout("deepseek-v3", "h200", 1, 8, 1).step_breakdown(&decode(64, 1024));
        assert!((no_ep.comm_s - gathered_s).abs() < 1e-12, "{no_ep:?}");
    }

    #[test]
    fn attention_dp_splits_decode_attention_but_not_a_lone_prefill() {
        let (tp8, dp8) = (cost("deepseek-v3", "h200", 8), layout("deepseek-v3", "h200", 1, 8, 8));
        // A lone 8K prompt runs its attention on one GPU under DP 8 instead of eight.
        let lone = prefill(8192, 0);
        assert!(dp8.step_time(&lone) > tp8.step_time(&lone));
        // 256 decodes of 8K context (2.1M tokens: only DP 8 holds them, but the step is
        // priced either way): each rank reads only its own requests' latents (1/8 × 1.09 of
        // the batch's, 4.6 ms) where every TP rank reads all of them (34 ms), on top of
        // about 20 ms of weights.
        let (t, d) = (tp8.step_breakdown(&decode(256, 8192)), dp8.step_breakdown(&decode(256, 8192)));
        assert!(d.memory_s < 0.6 * t.memory_s, "{t:?} {d:?}");
        assert!(d.total_s() < t.total_s(), "{t:?} {d:?}");
    }

    fn context_parallel(cp: u32, cp_mode: CpMode) -> CostModel {
        let (m, g) = (model_by_name("llama-3.1-70b"), gpu_by_name("h200"));
        let d = Deployment { tp: 2, cp, cp_mode, ..Deployment::default() };
        CostModel::new(m.expect("model"), g.expect("gpu"), d, CostParams::default()).expect("fits")
    }

    #[test]
    fn cp_one_leaves_every_step_unchanged_whatever_the_mode() {
        let (ring, gather) = (context_parallel(1, CpMode::Ring), context_parallel(1, CpMode::AllGather));
        let plain = cost("llama-3.1-70b", "h200", 2);
        for stats in [decode(1, 1024), decode(64, 32768), prefill(8192, 0), prefill(8192, 516_096)] {
            assert_eq!(ring.step_breakdown(&stats), plain.step_breakdown(&stats));
            assert_eq!(gather.step_breakdown(&stats), plain.step_breakdown(&stats));
        }
        assert_eq!(ring.kv_capacity_tokens(), plain.kv_capacity_tokens());
        let layer = gather.cp_prefill_layer(516_096, 8192);
        assert_eq!((layer.transfer_bytes, layer.exposed_s), (0.0, 0.0));
    }

    #[test]
    fn context_parallel_exchange_and_peak_memory_of_a_512k_prompt_match_hand_calculation() {
        let (ring, gather) = (context_parallel(4, CpMode::Ring), context_parallel(4, CpMode::AllGather));
        // Last 8K chunk of a 512K prompt: 524_288 tokens of K/V, 2_048 bytes per token per layer
        // on one GPU (4 of 8 kv heads under tp 2: 2 × 4 × 128 × 2 bytes), so the layer's whole
        // K/V is 1_073_741_824 bytes per GPU and a replica's block a quarter of it.
        let g = gather.cp_prefill_layer(516_096, 8192);
        assert_eq!(g.transfer_bytes, 805_306_368.0, "3 of 4 blocks");
        assert!((g.exposed_s - (805_306_368.0 / 450e9 + 8e-6)).abs() < 1e-12, "{g:?}");
        assert_eq!(g.peak_kv_bytes, 1_073_741_824.0, "all-gather materialises the whole layer");
        let r = ring.cp_prefill_layer(516_096, 8192);
        assert_eq!(r.transfer_bytes, g.transfer_bytes, "the same bytes move either way");
        assert_eq!(r.peak_kv_bytes, 2.0 * 268_435_456.0, "two blocks");
        // The replica's attention: 8_192 × 516_096 + 8_192 × 8_193 / 2 = 4_261_416_960 pairs, a
        // quarter of them, at 4 × 64 heads × 128 FLOPs per pair per layer over tp 2 × 989e12 ×
        // 0.65: 27.2 ms per layer, 6.8 ms per ring step against 0.6 ms for a block's transfer.
        let attention_s = 4_261_416_960.0 / 4.0 * 4.0 * 64.0 * 128.0 / (2.0 * 989e12 * 0.65);
        assert!((r.attention_s - attention_s).abs() < 1e-12, "{r:?}");
        assert_eq!(r.exposed_s, 0.0, "every block arrives while the previous one is computed");
        // In a step, all-gather pays the exchange on all 80 layers on top of ring's time.
        let chunk = prefill(8192, 516_096);
        let (rb, gb) = (ring.step_breakdown(&chunk), gather.step_breakdown(&chunk));
        assert!((gb.comm_s - rb.comm_s - 80.0 * g.exposed_s).abs() < 1e-9, "{rb:?} {gb:?}");
        // The KV of every sequence is sharded over the 4 replicas: (126_900_000_000 − 2 GiB −
        // 70_553_706_496 bytes of weights) / 163_840 = 330_803 tokens per GPU, × 4.
        assert_eq!(ring.kv_capacity_tokens(), 4 * 330_803);
        assert_eq!((ring.gpus(), ring.weight_bytes_per_gpu()), (8, 70_553_706_496));
    }

    #[test]
    fn ring_prefills_long_prompts_at_least_as_fast_as_all_gather() {
        let (ring, gather) = (context_parallel(4, CpMode::Ring), context_parallel(4, CpMode::AllGather));
        for chunk in [2048, 8192, 32768] {
            let mut done = 0;
            let (mut ring_s, mut gather_s) = (0.0, 0.0);
            while done < 524_288 {
                let stats = prefill(chunk, done);
                let (r, g) = (ring.step_time(&stats).as_secs_f64(), gather.step_time(&stats).as_secs_f64());
                // A short context is latency-bound: ring's cp − 1 hops per layer, each too
                // short to hide behind attention, cost more than one all-gather.
                if done >= 65_536 {
                    assert!(r <= g, "chunk {chunk} after {done}: ring {r} s, all-gather {g} s");
                }
                (ring_s, gather_s, done) = (ring_s + r, gather_s + g, done + chunk);
            }
            assert!(ring_s < gather_s, "chunk {chunk}: ring {ring_s} s, all-gather {gather_s} s");
        }
        // CP 4 prefills a 512K prompt much faster than the same TP 2 alone, and a 512K decode
        // reads a quarter of the KV per replica.
        let (alone, cp4) = (cost("llama-3.1-70b", "h200", 2), ring);
        assert!(cp4.step_time(&prefill(8192, 516_096)) < alone.step_time(&prefill(8192, 516_096)));
        assert!(cp4.step_time(&decode(1, 524_288)) < alone.step_time(&decode(1, 524_288)));
    }

    #[test]
    fn llama_70b_does_not_fit_on_one_a100() {
        let (m, g) = (model_by_name("llama-3.1-70b"), gpu_by_name("a100"));
        let err =
            CostModel::new(m.expect("model"), g.expect("gpu"), Deployment::tensor_parallel(1), CostParams::default())
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

    proptest::proptest! {
        /// A run of decode steps priced at once costs what each step priced alone does, to
        /// the microsecond, on plain TP, attention DP with experts, context parallelism and
        /// a serial-attention GPU.
        #[test]
        fn decode_step_times_are_each_steps_own_time(
            layout_at in 0usize..4,
            seqs in 1u32..300,
            context in 0u32..200_000,
            steps in 1u32..20,
        ) {
            let c = match layout_at {
                0 => cost("llama-3.1-8b", "h100", 1),
                1 => layout("deepseek-v3", "h200", 1, 8, 8),
                2 => context_parallel(4, CpMode::Ring),
                _ => {
                    let (m, g) = (model_by_name("llama-3.1-8b").expect("model"), gpu_by_name("h100").expect("gpu"));
                    let params = CostParams { serial_attention: true, ..CostParams::default() };
                    CostModel::new(m, g, Deployment::tensor_parallel(1), params).expect("fits")
                }
            };
            let first = decode(seqs, context);
            let mut priced = Vec::new();
            c.decode_step_times(&first, steps, |d| priced.push(d));
            let one_by_one: Vec<Dur> = (0..steps)
                .map(|j| {
                    let grown = u64::from(seqs) * u64::from(j);
                    c.step_time(&BatchStats { decode_context_tokens: first.decode_context_tokens + grown, ..first })
                })
                .collect();
            proptest::prop_assert_eq!(priced, one_by_one);
        }
    }
}
