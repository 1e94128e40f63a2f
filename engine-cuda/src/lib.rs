//! The CUDA executor: a Llama-family decoder in bf16 on one GPU, behind the engine's
//! [`Executor`](engine::Executor) trait, so the scheduler, paged KV and prefix cache are the
//! same code as in the simulator.
//!
//! Built on cudarc with dynamic loading: this module compiles on machines without CUDA, and
//! the driver, NVRTC and cuBLAS are looked up at run time ([`libraries_present`]).
//!
//! | file | purpose |
//! | --- | --- |
//! | `error.rs` | [`CudaError`] |
//! | `config.rs` | [`LlamaConfig`]: `config.json`, presets, RoPE frequencies |
//! | `context.rs` | [`Gpu`]: context, stream, cuBLAS, the row-major GEMM |
//! | `kernels.rs`, `kernels/*.cu` | NVRTC-compiled kernels |
//! | `weights.rs` | safetensors loading in the Hugging Face layout |
//! | `synth.rs` | random models written in that layout (`fleetplane make-model`) |
//! | `kv.rs` | the paged KV pool, and a batch flattened into kernel arguments |
//! | `model.rs` | the forward pass |
//! | `graph.rs` | CUDA graphs of decode steps, one per batch-size bucket |
//! | `timeline.rs` | a decode step's launches timed one by one ([`LaunchTimes`]) |
//! | `profile.rs` | the step profile: measured times over a grid of batch shapes ([`sweep`]) |
//! | `sampling.rs` | greedy, temperature and top-p sampling |
//! | `transfer.rs` | the bytes of a KV hand-off (P/D): header, token-major body, checks |
//! | `executor.rs` | [`CudaExecutor`] and its contract with the engine process |
//!
//! Guardrails: KV lives on the GPU only (the instance must have no L2 tier; a P/D hand-off
//! copies it out through host memory between steps); everything runs
//! on one stream; a step synchronises before it returns, so buffers are reused safely;
//! CUDA graphs capture only device addresses that never change (a reallocated buffer drops
//! them).

mod config;
mod context;
mod error;
mod executor;
mod graph;
pub mod kernels;
mod kv;
mod model;
mod profile;
mod sampling;
pub mod synth;
mod timeline;
pub mod transfer;
mod weights;

pub use config::{Llama3RopeScaling, LlamaConfig};
pub use context::{gpu_available, libraries_present, Gpu};
pub use engine::ids::block_hashes;
pub use error::CudaError;
pub use executor::{CudaExecutor, CudaExecutorConfig, ModelSource};
pub use graph::DecodeGraphs;
pub use kv::{plan_prefill_tiles, KvCopy, KvPool, StepLayout, PREFILL_TILE_ROWS};
pub use model::{gemv_bound, Attention, SMALL_STEP_ROWS};
pub use profile::{serving_shapes, sweep, Shape, RUNS};
pub use sampling::{sample, sample_with, Sampling};
pub use timeline::{LaunchTimes, NameTotal};
pub use transfer::{KvDtype, KvHeader, KvPayloadError, KvShape};
pub use weights::{safetensors_files, tensor_shapes, ModelFiles};

#[cfg(test)]
mod tests;
