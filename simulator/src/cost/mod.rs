//! The roofline cost model: how long one engine iteration takes on a given model, GPU type
//! and tensor-parallel degree, and how many tokens of KV cache an instance holds.
//!
//! It replaces the GPU's forward pass in the simulator through [`CostModelExecutor`]; the
//! scheduler, KV cache and policies above it are the real code.
//!
//! | file | purpose |
//! | --- | --- |
//! | `model.rs` | [`ModelSpec`]: shapes, parameter counts, attention kind (GQA / MLA), MoE layout, dtypes; the model catalog |
//! | `gpu.rs` | [`GpuSpec`]: memory, HBM and NVLink bandwidth, BF16 / FP8 peaks, assumed price; the GPU catalog |
//! | `params.rs` | [`CostParams`] (efficiencies, overheads, memory reserve) and [`Deployment`] (TP degree), with validation |
//! | `roofline.rs` | [`CostModel`]: step time and its [`StepBreakdown`], KV capacity, GPUs and price per instance |
//! | `executor.rs` | [`CostModelExecutor`]: the cost model as an [`engine::Executor`] |
//! | `error.rs` | [`UnknownName`] (bad catalog name, lists the valid ones) and [`CostError`] |
//!
//! The formulas, in words (all per GPU of an instance with tensor parallelism `tp`):
//!
//! - **step time** = fixed overhead + the larger of compute time and memory time + TP
//!   communication; an empty batch takes no time.
//! - **compute** = 2 FLOPs per active non-embedding parameter per token, plus the LM head
//!   (2 × hidden × vocab) per sequence that samples, plus attention FLOPs per (query, key)
//!   pair; divided by `tp` × peak (FP8 peak for FP8 weights) × compute efficiency.
//! - **memory** = weights / `tp` read once per step (an MoE reads only the routed experts the
//!   batch's tokens are expected to touch, `E × (1 − (1 − k/E)^N)`), plus each sequence's KV
//!   context read once, plus the new tokens' KV written; divided by HBM bandwidth × memory
//!   efficiency.
//! - **communication** = two ring all-reduces of tokens × hidden bf16 activations per layer,
//!   each `2(tp − 1)/tp × bytes / NVLink bandwidth + latency`; zero at `tp` = 1.
//! - **KV load-back** from L2 / L3 = tokens × KV bytes per token per GPU / link bandwidth
//!   (+ the store's latency for L3), overlapped layer by layer with the step's compute: only
//!   the first layer's share and the latency are exposed.
//! - **KV capacity** = (GPU memory × utilization − weights / `tp` − activation reserve) /
//!   KV bytes per token on one rank. GQA splits KV heads over ranks (one replicated head per
//!   rank when there are fewer heads than ranks); MLA's latent is replicated on every rank,
//!   so TP does not grow MLA's capacity.
//!
//! Guardrails: constructing a [`CostModel`] validates everything that could make a step time
//! meaningless (TP degree, head split, parameter ranges, weights that do not fit), so
//! [`CostModel::step_time`] cannot fail; it does no allocation and no string work because it
//! runs once per simulated iteration.

mod error;
mod executor;
mod gpu;
mod model;
mod params;
mod roofline;

pub use error::{CostError, UnknownName};
pub use executor::CostModelExecutor;
pub use gpu::{gpu_by_name, gpu_names, GpuSpec};
pub use model::{model_by_name, model_names, Attention, ModelSpec, MoeSpec};
pub use params::{CostParams, Deployment};
pub use roofline::{CostModel, StepBreakdown, TierLinks};
