//! The knobs of the roofline ([`CostParams`]) and how a model is split over GPUs
//! ([`Deployment`]), with their validation.
//!
//! Both deserialize from a scenario's TOML; unknown fields are rejected so that a typo does
//! not silently fall back to a default.

use serde::{Deserialize, Serialize};

use super::error::CostError;
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
    /// Share of peak HBM bandwidth that weight and KV streaming reach.
    pub memory_efficiency: f64,
    /// Fixed cost of one iteration in microseconds: scheduling, input preparation, kernel
    /// launches and sampling not hidden by CUDA graphs.
    pub step_overhead_us: f64,
    /// Share of GPU memory the engine may allocate (vLLM's `gpu_memory_utilization`).
    pub memory_utilization: f64,
    /// Bytes per GPU kept for activations, CUDA graphs and workspace, not given to the KV cache.
    pub activation_reserve_bytes: u64,
    /// Latency of one all-reduce in microseconds (launch and synchronization), paid twice per
    /// layer under tensor parallelism regardless of the message size.
    pub allreduce_latency_us: f64,
}

impl Default for CostParams {
    fn default() -> Self {
        CostParams {
            compute_efficiency: 0.65,
            memory_efficiency: 0.9,
            step_overhead_us: 150.0,
            memory_utilization: 0.9,
            activation_reserve_bytes: 2 << 30,
            allreduce_latency_us: 8.0,
        }
    }
}

impl CostParams {
    /// Rejects values that would make times negative, infinite or meaningless.
    pub fn validate(&self) -> Result<(), CostError> {
        let share = "a share in (0, 1]";
        let micros = "a finite number of microseconds >= 0";
        let checks = [
            ("compute_efficiency", self.compute_efficiency, is_share(self.compute_efficiency), share),
            ("memory_efficiency", self.memory_efficiency, is_share(self.memory_efficiency), share),
            ("memory_utilization", self.memory_utilization, is_share(self.memory_utilization), share),
            ("step_overhead_us", self.step_overhead_us, is_micros(self.step_overhead_us), micros),
            ("allreduce_latency_us", self.allreduce_latency_us, is_micros(self.allreduce_latency_us), micros),
        ];
        match checks.into_iter().find(|c| !c.2) {
            Some((field, value, _, expected)) => Err(CostError::InvalidParam { field, value, expected }),
            None => Ok(()),
        }
    }
}

fn is_share(x: f64) -> bool {
    x > 0.0 && x <= 1.0
}

fn is_micros(x: f64) -> bool {
    x.is_finite() && x >= 0.0
}

/// How one engine instance spreads the model over GPUs. Only tensor parallelism within one
/// node is modelled: every rank holds `1/tp` of every weight matrix and the ranks all-reduce
/// activations twice per layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deployment {
    /// Tensor-parallel degree: 1, 2, 4 or 8 (GPUs of one NVLink node).
    pub tp: u32,
}

impl Default for Deployment {
    fn default() -> Self {
        Deployment { tp: 1 }
    }
}

impl Deployment {
    /// Checks that `model` can be split `tp` ways: query heads evenly, KV heads either evenly
    /// or, when there are fewer KV heads than ranks, replicated evenly.
    pub fn validate(&self, model: &ModelSpec) -> Result<(), CostError> {
        let tp = self.tp;
        if !matches!(tp, 1 | 2 | 4 | 8) {
            return Err(CostError::UnsupportedTp { tp });
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
    use crate::cost::model::{model_by_name, Attention};

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
        let err = Deployment { tp: 3 }.validate(m).expect_err("tp 3");
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
        let err = Deployment { tp: 8 }.validate(&odd).expect_err("12 heads over 8 ranks");
        assert_eq!(err.to_string(), "model `odd`: 12 query heads cannot be split over tp 8");
        let few_kv = ModelSpec { q_heads: 16, kv_heads: 3, ..odd };
        let err = Deployment { tp: 4 }.validate(&few_kv).expect_err("3 kv heads over 4 ranks");
        assert_eq!(err.to_string(), "model `odd`: 3 kv heads cannot be split over tp 4");
    }

    #[test]
    fn fewer_kv_heads_than_ranks_are_replicated() {
        let m = ModelSpec { kv_heads: 2, ..*model_by_name("llama-3.1-8b").expect("catalog model") };
        assert_eq!(Deployment { tp: 8 }.validate(&m), Ok(()));
    }
}
