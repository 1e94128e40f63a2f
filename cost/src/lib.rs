//! The roofline cost model: how long one engine iteration takes on a given model, GPU type
//! and deployment layout (tensor parallelism, attention data parallelism, expert
//! parallelism, context parallelism), and how many tokens of KV cache an instance holds.
//!
//! It replaces the GPU's forward pass in the simulator and in `fleetplane engine --executor
//! sim` through [`CostModelExecutor`]; the scheduler, KV cache and policies above it are the
//! real code. The live control plane prices its engines with it too ([`cost_hints`]).
//!
//! | file | purpose |
//! | --- | --- |
//! | `model.rs` | [`ModelSpec`]: shapes, parameter counts (attention projections from the shapes), attention kind (GQA / MLA), MoE layout, dtypes; the model catalog |
//! | `gpu.rs` | [`GpuSpec`]: memory, HBM and NVLink bandwidth, BF16 / FP8 peaks, assumed price; the GPU catalog |
//! | `params.rs` | [`CostParams`] (efficiencies, overheads, latencies, DP imbalance, memory reserve) and [`Deployment`] (TP, attention DP, EP, CP and its [`CpMode`]), with validation |
//! | `roofline.rs` | [`CostModel`]: step time and its [`StepBreakdown`], KV capacity, weights per GPU, GPUs and price per instance, a CP prefill layer's exchange ([`CpPrefillLayer`]) |
//! | `coefficients.rs` | the batch-independent factors a [`CostModel`] folds its model, GPU and layout into when built; weights and KV bytes per GPU |
//! | `speculative.rs` | [`Drafter`] presets (eagle3, dflash, dspark): one step's price ([`StepPrice`]) for both the engine and the TPOT calculation ([`SpeculativeStep`]), and acceptance sampling |
//! | `decode_table.rs` | [`DecodeTable`]: decode-only steps priced from a profile's measured grid (batch buckets by context) instead of the roofline |
//! | `calibrate.rs` | [`calibrate`]: the efficiencies and step overheads fitted to an engine's measured [`engine::StepProfile`] (`--profile`) |
//! | `profile_file.rs` | [`load_profile`] (JSON or gzipped) and [`calibrated_cost`], the cost model fitted to a profile when one is given ([`ProfileError`]) |
//! | `hints.rs` | [`cost_hints`]: the [`policies::CostHints`] routers get from a cost model, with its decode step ([`decode_model`]) |
//! | `executor.rs` | [`CostModelExecutor`]: the cost model as an [`engine::Executor`], speculating with an optional [`Drafter`] ([`SpeculationTally`]); where the GPU time went ([`GpuTime`]) |
//! | `error.rs` | [`UnknownName`] (bad catalog name, lists the valid ones) and [`CostError`] |
//!
//! **The layout.** An instance has `G = tp × dp_attention` GPUs of one node. Attention runs
//! on `dp_attention` ranks of `tp` GPUs each; a rank serves only its own requests. The
//! *attention side* (attention projections, embedding table, KV cache) is split by `tp`
//! inside a rank and replicated across ranks; the *expert / dense side* (routed experts,
//! shared experts, dense FFN, LM head) is spread over all `G` GPUs, the routed experts by
//! expert when `ep = G` and by TP when `ep = 1`. Plain TP is `dp_attention = ep = 1`, and
//! then every formula below reduces to the TP-only one. Context parallelism (`cp` > 1)
//! runs `cp` replicas of that layout, each with a whole copy of the weights and `1/cp` of
//! every sequence's tokens and KV (zig-zag); before attention the replicas exchange K/V by
//! ring (overlapped with the attention of the previous block) or all-gather (exposed), and
//! decode combines the replicas' partial attention by an all-reduce per layer
//! ([`CostModel::cp_prefill_layer`] has the formulas). docs/LAYOUTS.md has the worked
//! numbers.
//!
//! The formulas, in words (on the busiest GPU of an instance):
//!
//! - **step time** = fixed overhead + the larger of compute time and memory time +
//!   communication; an empty batch takes no time.
//! - **DP imbalance**: the busiest attention rank does `f(n)/dp` of the batch's attention
//!   work, `f(n) = min(dp, max(dp/n, 1 + c·√(dp/n)))` for `n` sequences with `c` =
//!   [`CostParams::dp_imbalance`] (0.5); `f = 1` when `dp_attention = 1`.
//! - **compute** = 2 FLOPs per active non-embedding parameter per token, plus the LM head
//!   (2 × hidden × vocab) per sequence that samples, plus attention FLOPs per (query, key)
//!   pair; attention-side work (projections, attention) is the busiest rank's share over
//!   `tp` GPUs, the rest the whole batch over `G`; each over peak (FP8 peak for FP8 weights)
//!   × compute efficiency.
//! - **memory** = the weights of one GPU read once per step (an MoE reads only the routed
//!   experts the batch's tokens are expected to touch, `E × (1 − (1 − k/E)^N)` for the
//!   batch's `N` tokens, `1/G` of each), plus the busiest rank's KV context read once and
//!   new tokens' KV written; divided by HBM bandwidth × memory efficiency.
//! - **communication**, bf16 activations of `hidden` values per token, over the GPU's NVLink
//!   bandwidth; a ring collective over `n` GPUs moves `2(n − 1)/n` of the message:
//!   - per layer, an all-reduce inside the rank's TP group of the rank's tokens (`tp > 1`);
//!   - per layer with an FFN spread TP-style (dense FFN or shared experts, or routed experts
//!     without EP), a collective over `G` of all the batch's tokens: the second all-reduce
//!     of plain TP, or an all-gather plus a reduce-scatter under attention DP (two
//!     latencies);
//!   - per MoE layer with `ep > 1`, a dispatch and a combine all-to-all: each of the rank's
//!     tokens (over its `tp` GPUs) goes to the `(ep − 1)(1 − (1 − 1/ep)^k)` other GPUs
//!     that host one of its top-k experts, `hidden × 2` bytes each way, plus
//!     [`CostParams::alltoall_latency_us`] per all-to-all;
//!   - each collective pays its latency ([`CostParams::allreduce_latency_us`]); all terms
//!     are zero at degree 1, and nothing overlaps communication with compute.
//! - **KV load-back** from L2 / L3 = the busiest rank's tokens × KV bytes per token per GPU /
//!   link bandwidth (+ the store's latency for L3), overlapped layer by layer with the step's
//!   compute: only the first layer's share and the latency are exposed.
//! - **KV capacity** = `dp_attention` × (GPU memory × utilization − weights per GPU −
//!   activation reserve) / KV bytes per token on one GPU. Weights per GPU = attention side
//!   / `tp` + the rest / `G`. GQA splits KV heads over the `tp` GPUs of a rank (one
//!   replicated head per GPU when there are fewer heads than GPUs); MLA's latent is
//!   replicated on every GPU of a rank, so TP does not grow MLA's capacity and attention DP
//!   does.
//!
//! Guardrails: constructing a [`CostModel`] validates everything that could make a step time
//! meaningless (layout degrees, head split, parameter ranges, weights that do not fit), so
//! [`CostModel::step_time`] cannot fail; it does no allocation and no string work because it
//! runs once per simulated iteration.

mod calibrate;
mod coefficients;
mod decode_table;
mod error;
mod executor;
mod gpu;
mod hints;
mod model;
mod params;
mod profile_file;
mod roofline;
mod speculative;

pub use calibrate::{calibrate, check_steps, Calibration, CalibrationError, SampleFit, StepCheck, StepClassCheck};
pub use decode_table::DecodeTable;
pub use error::{CostError, UnknownName};
pub use executor::{CostModelExecutor, GpuTime, SpeculationTally};
pub use gpu::{gpu_by_name, gpu_names, GpuSpec};
pub use hints::{cost_hints, decode_model};
pub use model::{model_by_name, model_names, Attention, ModelSpec, MoeSpec};
pub use params::{CostParams, CpMode, Deployment};
pub use profile_file::{calibrated_cost, load_profile, ProfileError};
pub use roofline::{CostModel, CpPrefillLayer, StepBreakdown, TierLinks};
pub use speculative::{
    drafter_by_name, drafter_names, drafter_or_none, Drafter, SpeculativeStep, StepPrice, NO_SPECULATION,
};
