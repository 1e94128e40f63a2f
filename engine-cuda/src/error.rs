//! The CUDA executor's one error type: every failure names what was being done and why.

use std::path::PathBuf;

/// Why the CUDA executor could not start or run a step.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA library could not be loaded (no driver, or no toolkit libraries on the loader's
    /// path). Checked before any CUDA call, since cudarc panics on a missing libcuda.
    #[error(
        "CUDA library {0} not found (is the NVIDIA driver installed and the CUDA 13 libraries on the loader's path?)"
    )]
    LibraryMissing(&'static str),
    /// A CUDA driver, NVRTC or cuBLAS call failed.
    #[error("{what}: {detail}")]
    Call { what: String, detail: String },
    /// NVRTC rejected a kernel source (the log holds the compiler's messages).
    #[error("compiling kernel file {file} for {arch}: {log}")]
    Compile { file: &'static str, arch: String, log: String },
    /// A model file could not be read or written.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// config.json is malformed or describes an unsupported model.
    #[error("model config {path}: {msg}")]
    Config { path: PathBuf, msg: String },
    /// A weight is missing, has the wrong shape or dtype, or a safetensors file is malformed.
    #[error("weights in {path}: {msg}")]
    Weights { path: PathBuf, msg: String },
    /// The memory budget cannot hold the weights, the working buffers and at least one KV
    /// block per sequence.
    #[error("memory budget: {0}")]
    Budget(String),
    /// The batch asks for something the executor was not set up for (an unknown request, too
    /// many tokens, KV that is not on the GPU).
    #[error("batch: {0}")]
    Batch(String),
    /// A KV hand-off payload is malformed or was made for another model's KV shape.
    #[error("KV hand-off: {0}")]
    Transfer(#[from] super::transfer::KvPayloadError),
}

impl CudaError {
    /// Wraps a lower-level error with what was being attempted.
    pub(crate) fn call(what: impl Into<String>, err: impl std::fmt::Debug) -> CudaError {
        CudaError::Call { what: what.into(), detail: format!("{err:?}") }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> CudaError {
        CudaError::Io { path: path.into(), source }
    }
}
