//! The knobs of the roofline ([`CostParams`]) and how a model is split over GPUs
//! ([`Deployment`]), with their validation.
//!
//! Both deserialize from a scenario's TOML; unknown fields are rejected so that a typo does
//! not silently fall back to a default.

use serde::{Deserialize, Serialize};

use super::error::{CostError, UnknownName};
use super::model::ModelSpec;

/// Efficiency factors and fixed costs that turn datasheet peaks into predicted step times.
///
/// The defaults are typical of a tuned engine (vLLM / SGLang class) on Hopper; calibrate them
/// against the CUDA engine's measured profile rather than trusting them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostParams {
    /// Share of peak tensor-core FLOP/s that large GEMMs and attention reach.
    pub compute_efficiency: f64,
    /// Share of peak tensor-core FLOP/s that attention (the query-key and value products)
    /// reaches, when it differs from the GEMMs' [default: `compute_efficiency`]. Engines
    /// whose attention kernels are less tuned than their GEMMs show it in their profile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention_efficiency: Option<f64>,
    /// Share of peak HBM bandwidth that weight and KV streaming reach.
    pub memory_efficiency: f64,
    /// Share of peak HBM bandwidth that the KV cache's reads and writes reach, when it
    /// differs from the weights' [default: `memory_efficiency`]: paged attention gathers
    /// blocks scattered over memory, which a profile with long-context decodes shows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_memory_efficiency: Option<f64>,
    /// Fixed cost of one iteration in microseconds: scheduling, input preparation, kernel
    /// launches and sampling not hidden by CUDA graphs.
    pub step_overhead_us: f64,
    /// Extra fixed cost in microseconds of an iteration that computes prompt tokens: engines
    /// replay CUDA graphs for decode-only steps, and a step with a prefill chunk launches its
    /// kernels one by one instead (0 for engines whose mixed steps are graphed too).
    pub prefill_step_overhead_us: f64,
    /// Fixed cost in microseconds per sequence in an iteration (sampling, logits processing,
    /// the scheduler's bookkeeping): what makes a step of 256 short decodes slower than its
    /// GEMMs and KV reads say.
    #[serde(skip_serializing_if = "is_zero")]
    pub sequence_overhead_us: f64,
    /// Attention runs as kernels of its own between the GEMMs, each bound by its own roofline
    /// (`max(GEMM FLOPs, weights) + max(attention FLOPs, KV traffic)`), rather than hidden
    /// under the slower of the step's compute and memory. An engine without fused or
    /// overlapped attention shows it in its profile: a prompt chunk beside long decodes costs
    /// about the sum of the two. Calibration picks the form that fits the profile.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub serial_attention: bool,
    /// Share of GPU memory the engine may allocate (vLLM's `gpu_memory_utilization`).
    pub memory_utilization: f64,
    /// Bytes per GPU kept for activations, CUDA graphs and workspace, not given to the KV cache.
    pub activation_reserve_bytes: u64,
    /// Latency of one all-reduce in microseconds (launch and synchronization), paid twice per
    /// layer under tensor parallelism regardless of the message size.
    pub allreduce_latency_us: f64,
    /// Latency of one all-to-all in microseconds (expert parallelism's dispatch or combine:
    /// layout of the routing metadata, launch and synchronization), paid twice per MoE layer
    /// when `ep` > 1 regardless of the message size. 20 µs is the order of DeepEP's
    /// intra-node kernels on small batches.
    pub alltoall_latency_us: f64,
    /// Load imbalance across attention-DP ranks: how much more attention work than the mean
    /// the busiest rank has when each rank runs one sequence. It shrinks as `1/√(sequences
    /// per rank)` (see [`crate::CostModel::dp_imbalance_factor`]); it is about the
    /// coefficient of variation of one sequence's attention work times the expected maximum
    /// of `dp` standard normals (≈ 1.4 at 8 ranks) once the DP scheduler has balanced ranks
    /// by tokens. Unused when `dp_attention` = 1.
    pub dp_imbalance: f64,
}

impl Default for CostParams {
    fn default() -> Self {
        CostParams {
            compute_efficiency: 0.65,
            attention_efficiency: None,
            memory_efficiency: 0.9,
            kv_memory_efficiency: None,
            step_overhead_us: 150.0,
            prefill_step_overhead_us: 0.0,
            sequence_overhead_us: 0.0,
            serial_attention: false,
            memory_utilization: 0.9,
            activation_reserve_bytes: 2 << 30,
            allreduce_latency_us: 8.0,
            alltoall_latency_us: 20.0,
            dp_imbalance: 0.5,
        }
    }
}

impl CostParams {
    /// Share of peak FLOP/s attention reaches.
    pub fn attention_efficiency(&self) -> f64 {
        self.attention_efficiency.unwrap_or(self.compute_efficiency)
    }

    /// Share of peak HBM bandwidth the KV cache's traffic reaches.
    pub fn kv_memory_efficiency(&self) -> f64 {
        self.kv_memory_efficiency.unwrap_or(self.memory_efficiency)
    }

    /// Rejects values that would make times negative, infinite or meaningless.
    pub fn validate(&self) -> Result<(), CostError> {
        let share = "a share in (0, 1]";
        let micros = "a finite number of microseconds >= 0";
        let excess = "a finite share >= 0";
        let checks = [
            ("compute_efficiency", self.compute_efficiency, is_share(self.compute_efficiency), share),
            ("memory_efficiency", self.memory_efficiency, is_share(self.memory_efficiency), share),
            ("attention_efficiency", self.attention_efficiency(), is_share(self.attention_efficiency()), share),
            ("kv_memory_efficiency", self.kv_memory_efficiency(), is_share(self.kv_memory_efficiency()), share),
            ("memory_utilization", self.memory_utilization, is_share(self.memory_utilization), share),
            ("step_overhead_us", self.step_overhead_us, is_finite_non_negative(self.step_overhead_us), micros),
            (
                "prefill_step_overhead_us",
                self.prefill_step_overhead_us,
                is_finite_non_negative(self.prefill_step_overhead_us),
                micros,
            ),
            (
                "sequence_overhead_us",
                self.sequence_overhead_us,
                is_finite_non_negative(self.sequence_overhead_us),
                micros,
            ),
            (
                "allreduce_latency_us",
                self.allreduce_latency_us,
                is_finite_non_negative(self.allreduce_latency_us),
                micros,
            ),
            ("alltoall_latency_us", self.alltoall_latency_us, is_finite_non_negative(self.alltoall_latency_us), micros),
            ("dp_imbalance", self.dp_imbalance, is_finite_non_negative(self.dp_imbalance), excess),
        ];
        match checks.into_iter().find(|c| !c.2) {
            Some((field, value, _, expected)) => Err(CostError::InvalidParam { field, value, expected }),
            None => Ok(()),
        }
    }
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

fn is_share(x: f64) -> bool {
    x > 0.0 && x <= 1.0
}

fn is_finite_non_negative(x: f64) -> bool {
    x.is_finite() && x >= 0.0
}

/// How one engine instance spreads the model over the GPUs of one node.
///
/// The instance has `gpus() = tp × dp_attention × cp` GPUs (at most
/// [`Deployment::MAX_GPUS`]); one copy of the weights is spread over `model_gpus() = tp ×
/// dp_attention` of them and replicated `cp` times:
///
/// - **Attention** runs data-parallel on `dp_attention` ranks, each a group of `tp` GPUs
///   that splits the heads (tensor parallelism inside the rank). A rank serves only its own
///   requests and keeps only their KV; attention weights (and the embedding table) are
///   replicated on every rank. With `dp_attention` = 1 this is plain TP.
/// - **Routed experts** are spread over all `gpus()`: sharded by expert when `ep` = `gpus()`
///   (expert parallelism, tokens move by all-to-all), or every expert split by TP when
///   `ep` = 1 (tokens are gathered to every GPU). Other `ep` values are refused.
/// - **The rest** (dense FFN layers, shared experts, the LM head) is split TP-style over all
///   `gpus()`, the seed's "dense / shared FFN keep TP" (SGLang with DeepEP instead
///   replicates the shared experts on every rank, which costs KV capacity).
///
/// - **Context parallelism** (`cp` > 1) runs `cp` replicas of that layout side by side, and
///   splits every prefill sequence's tokens and every sequence's KV over them (zig-zag by
///   position, so that each replica gets the same causal attention work). Before attention a
///   replica needs the other replicas' K/V of the layer: [`CpMode`] says how it gets them.
///   A decode token runs on every replica, each attends its own shard of the context, and
///   the partial outputs are combined by a small all-reduce per layer.
///
/// SGLang's `--tp 8 --dp 8 --enable-dp-attention --ep 8` is `tp = 1, dp_attention = 8,
/// ep = 8` here (SGLang's `--tp` counts the instance's GPUs; ours is the TP degree inside one
/// attention rank), and its `--tp 8` is `tp = 8`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deployment {
    /// Tensor-parallel degree inside one attention rank: 1, 2, 4 or 8.
    pub tp: u32,
    /// Attention data-parallel ranks: 1, 2, 4 or 8.
    #[serde(default = "one")]
    pub dp_attention: u32,
    /// Expert-parallel degree: 1 (experts split by TP) or `model_gpus()` (MoE models only).
    #[serde(default = "one")]
    pub ep: u32,
    /// Context-parallel replicas: 1, 2, 4 or 8.
    #[serde(default = "one")]
    pub cp: u32,
    /// How context-parallel replicas exchange K/V before attention; unused when `cp` = 1.
    #[serde(default)]
    pub cp_mode: CpMode,
}

/// How the `cp` replicas of a context-parallel instance see each other's K/V.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpMode {
    /// Ring attention: each replica keeps its queries; K/V blocks travel round the ring, the
    /// next one arriving while the current one is computed (online softmax across steps).
    #[default]
    Ring,
    /// All-gather CP: every replica gathers the layer's whole K/V before its attention starts.
    AllGather,
}

impl CpMode {
    pub fn name(self) -> &'static str {
        match self {
            CpMode::Ring => "ring",
            CpMode::AllGather => "allgather",
        }
    }
}

impl std::str::FromStr for CpMode {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<CpMode, UnknownName> {
        static MODES: [CpMode; 2] = [CpMode::Ring, CpMode::AllGather];
        UnknownName::lookup(&MODES, "cp mode", s, |m| m.name()).copied()
    }
}

fn one() -> u32 {
    1
}

impl Default for Deployment {
    fn default() -> Self {
        Deployment::tensor_parallel(1)
    }
}

impl std::fmt::Display for Deployment {
    /// `tp 8` for plain TP, `tp 1, dp-attention 8, ep 8` otherwise, and `, cp 4 ring` under
    /// context parallelism.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tp {}", self.tp)?;
        if self.dp_attention != 1 || self.ep != 1 {
            write!(f, ", dp-attention {}, ep {}", self.dp_attention, self.ep)?;
        }
        if self.cp != 1 {
            write!(f, ", cp {} {}", self.cp, self.cp_mode.name())?;
        }
        Ok(())
    }
}

impl Deployment {
    /// GPUs of one NVLink node, the most one instance spans.
    pub const MAX_GPUS: u32 = 8;

    /// Plain tensor parallelism over `tp` GPUs.
    pub fn tensor_parallel(tp: u32) -> Deployment {
        Deployment { tp, dp_attention: 1, ep: 1, cp: 1, cp_mode: CpMode::Ring }
    }

    /// GPUs one instance occupies: `tp × dp_attention × cp`.
    pub fn gpus(&self) -> u32 {
        self.model_gpus().saturating_mul(self.cp)
    }

    /// GPUs one copy of the weights is spread over: `tp × dp_attention` (context parallelism
    /// replicates it `cp` times).
    pub fn model_gpus(&self) -> u32 {
        self.tp.saturating_mul(self.dp_attention)
    }

    /// Checks that `model` can be laid out this way: degrees in range, at most one node, `ep`
    /// 1 or all the GPUs of an MoE whose experts it divides, and query heads split evenly
    /// over `tp`, KV heads either evenly or, when there are fewer KV heads than ranks,
    /// replicated evenly.
    pub fn validate(&self, model: &ModelSpec) -> Result<(), CostError> {
        let tp = self.tp;
        if !matches!(tp, 1 | 2 | 4 | 8) {
            return Err(CostError::UnsupportedTp { tp });
        }
        let invalid = |field, value, reason: String| CostError::InvalidLayout { field, value, reason };
        let dp = self.dp_attention;
        if !matches!(dp, 1 | 2 | 4 | 8) {
            return Err(invalid("dp_attention", dp, "must be 1, 2, 4 or 8".into()));
        }
        let cp = self.cp;
        if !matches!(cp, 1 | 2 | 4 | 8) {
            return Err(invalid("cp", cp, "must be 1, 2, 4 or 8".into()));
        }
        if self.model_gpus() <= Self::MAX_GPUS && self.gpus() > Self::MAX_GPUS {
            return Err(invalid(
                "cp",
                cp,
                format!(
                    "tp {tp} x dp_attention {dp} x cp {cp} = {} GPUs, more than one {}-GPU node",
                    self.gpus(),
                    Self::MAX_GPUS
                ),
            ));
        }
        let gpus = self.model_gpus();
        if gpus > Self::MAX_GPUS {
            return Err(invalid(
                "dp_attention",
                dp,
                format!(
                    "tp {tp} x dp_attention {dp} = {gpus} GPUs, more than one {}-GPU node (tp is the TP degree \
                     inside one attention rank: SGLang's --tp 8 --dp 8 is tp 1, dp_attention 8 here)",
                    Self::MAX_GPUS
                ),
            ));
        }
        let ep = self.ep;
        if ep != 1 {
            let Some(moe) = model.moe else {
                return Err(invalid(
                    "ep",
                    ep,
                    format!("model `{}` is dense; expert parallelism needs an MoE", model.name),
                ));
            };
            if ep != gpus {
                return Err(invalid(
                    "ep",
                    ep,
                    format!("must be 1 or the instance's GPUs (tp {tp} x dp_attention {dp} = {gpus})"),
                ));
            }
            if moe.experts % ep != 0 {
                return Err(invalid(
                    "ep",
                    ep,
                    format!("model `{}`: {} experts cannot be sharded {ep} ways", model.name, moe.experts),
                ));
            }
        }
        let not_divisible = |what, heads| CostError::HeadsNotDivisible { model: model.name, what, heads, tp };
        // `checked_rem` also answers "no" for zero heads instead of dividing by zero.
        let divides = |n: u32, d: u32| n.checked_rem(d) == Some(0);
        if !divides(model.q_heads, tp) {
            return Err(not_divisible("query heads", model.q_heads));
        }
        let kv = model.kv_heads;
        if kv == 0 || !(divides(kv, tp) || divides(tp, kv)) {
            return Err(not_divisible("kv heads", kv));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{model_by_name, Attention, MoeSpec};

    #[test]
    fn empty_toml_gives_the_default_params() {
        let p: CostParams = toml::from_str("").expect("empty table");
        assert_eq!(p, CostParams::default());
        assert_eq!(p.validate(), Ok(()));
    }

    #[test]
    fn a_misspelled_param_is_rejected() {
        let err = toml::from_str::<CostParams>("compute_eficiency = 0.5").expect_err("typo");
        assert!(err.to_string().contains("compute_eficiency"), "{err}");
    }

    #[test]
    fn an_efficiency_above_one_names_the_field() {
        let p = CostParams { memory_efficiency: 1.5, ..CostParams::default() };
        let err = p.validate().expect_err("1.5 is not a share");
        assert_eq!(err.to_string(), "cost parameter `memory_efficiency` = 1.5 is out of range: a share in (0, 1]");
    }

    #[test]
    fn tp_three_is_rejected() {
        let m = model_by_name("llama-3.1-8b").expect("catalog model");
        let err = Deployment::tensor_parallel(3).validate(m).expect_err("tp 3");
        assert_eq!(err.to_string(), "tensor parallelism 3 is not supported (valid: 1, 2, 4, 8)");
    }

    #[test]
    fn heads_that_do_not_split_over_tp_are_named() {
        let odd = ModelSpec {
            name: "odd",
            q_heads: 12,
            kv_heads: 12,
            attention: Attention::Gqa,
            ..*model_by_name("llama-3.1-8b").expect("catalog model")
        };
        let err = Deployment::tensor_parallel(8).validate(&odd).expect_err("12 heads over 8 ranks");
        assert_eq!(err.to_string(), "model `odd`: 12 query heads cannot be split over tp 8");
        let few_kv = ModelSpec { q_heads: 16, kv_heads: 3, ..odd };
        let err = Deployment::tensor_parallel(4).validate(&few_kv).expect_err("3 kv heads over 4 ranks");
        assert_eq!(err.to_string(), "model `odd`: 3 kv heads cannot be split over tp 4");
    }

    #[test]
    fn old_deployment_tables_parse_with_one_dp_rank_and_no_expert_parallelism() {
        let d: Deployment = toml::from_str("tp = 8").expect("tp only");
        assert_eq!(d, Deployment::tensor_parallel(8));
        let d: Deployment = toml::from_str("tp = 1\ndp_attention = 8\nep = 8").expect("dp and ep");
        assert_eq!((d.gpus(), d.to_string()), (8, "tp 1, dp-attention 8, ep 8".to_string()));
        assert!(toml::from_str::<Deployment>("tp = 1\ndp = 8")
            .expect_err("dp is not a field")
            .to_string()
            .contains("dp"));
    }

    #[test]
    fn impossible_layouts_name_the_field_and_the_rule() {
        let v3 = model_by_name("deepseek-v3").expect("catalog model");
        let llama = model_by_name("llama-3.1-8b").expect("catalog model");
        let layout = |tp, dp_attention, ep| Deployment { tp, dp_attention, ep, ..Deployment::default() };
        let check = |d: Deployment, m: &ModelSpec, expected: &str| {
            assert_eq!(d.validate(m).expect_err("invalid layout").to_string(), expected);
        };
        check(layout(1, 3, 1), v3, "invalid deployment: dp_attention = 3: must be 1, 2, 4 or 8");
        check(
            layout(8, 8, 8),
            v3,
            "invalid deployment: dp_attention = 8: tp 8 x dp_attention 8 = 64 GPUs, more than one 8-GPU node \
             (tp is the TP degree inside one attention rank: SGLang's --tp 8 --dp 8 is tp 1, dp_attention 8 here)",
        );
        check(
            layout(1, 8, 4),
            v3,
            "invalid deployment: ep = 4: must be 1 or the instance's GPUs (tp 1 x dp_attention 8 = 8)",
        );
        check(
            layout(8, 1, 8),
            llama,
            "invalid deployment: ep = 8: model `llama-3.1-8b` is dense; expert parallelism needs an MoE",
        );
        let odd_experts = ModelSpec { moe: v3.moe.map(|m| MoeSpec { experts: 100, ..m }), ..*v3 };
        check(
            layout(1, 8, 8),
            &odd_experts,
            "invalid deployment: ep = 8: model `deepseek-v3`: 100 experts cannot be sharded 8 ways",
        );
        for ok in [layout(1, 8, 8), layout(2, 4, 8), layout(8, 1, 8), layout(1, 8, 1), layout(4, 2, 1)] {
            assert_eq!(ok.validate(v3), Ok(()), "{ok}");
        }
        assert_eq!(layout(1, 8, 1).validate(llama), Ok(()), "attention DP also applies to a dense model");
    }

    #[test]
    fn context_parallel_tables_parse_and_impossible_cp_names_the_field() {
        let d: Deployment = toml::from_str("tp = 8").expect("tp only");
        assert_eq!((d.cp, d.cp_mode), (1, CpMode::Ring));
        let d: Deployment = toml::from_str("tp = 2\ncp = 4\ncp_mode = \"allgather\"").expect("cp");
        assert_eq!((d.gpus(), d.model_gpus(), d.to_string()), (8, 2, "tp 2, cp 4 allgather".to_string()));
        assert_eq!("ring".parse::<CpMode>(), Ok(CpMode::Ring));
        assert_eq!(
            "all-gather".parse::<CpMode>().expect_err("not a mode").to_string(),
            "unknown cp mode `all-gather` (valid: ring, allgather)"
        );
        let llama = model_by_name("llama-3.1-70b").expect("catalog model");
        let cp = |tp, cp| Deployment { tp, cp, ..Deployment::default() };
        assert_eq!(
            cp(1, 3).validate(llama).expect_err("cp 3").to_string(),
            "invalid deployment: cp = 3: must be 1, 2, 4 or 8"
        );
        assert_eq!(
            cp(4, 4).validate(llama).expect_err("16 GPUs").to_string(),
            "invalid deployment: cp = 4: tp 4 x dp_attention 1 x cp 4 = 16 GPUs, more than one 8-GPU node"
        );
        assert_eq!(cp(2, 4).validate(llama), Ok(()));
    }

    #[test]
    fn fewer_kv_heads_than_ranks_are_replicated() {
        let m = ModelSpec { kv_heads: 2, ..*model_by_name("llama-3.1-8b").expect("catalog model") };
        assert_eq!(Deployment::tensor_parallel(8).validate(&m), Ok(()));
    }
}
