//! CUDA graphs for decode steps, one per batch-size bucket.
//!
//! A decode step of an 8B model is ~300 launches (GEMMs and small kernels), and launching
//! them one by one from the host costs more than many of them take on the GPU. A CUDA graph
//! records a step's launches once and replays them in one call. Everything a step reads that
//! changes between steps (token ids, positions, KV slots, block tables) lives in device
//! buffers at fixed addresses ([`super::model::Llama::launch`]), so one graph serves every
//! decode step of its row count. A decode batch is padded up to the next bucket
//! ([`super::kv::StepLayout::pad_decode`]); prefill and mixed steps run eagerly.
//!
//! The first step of a bucket runs eagerly (which also warms up cuBLAS and loads modules, so
//! nothing is loaded during capture), then the same launches are captured for the next
//! steps. A failed capture turns graphs off for the executor's lifetime and keeps the reason;
//! the step it followed has already been computed eagerly, so it is not lost.
#![allow(unsafe_code)] // `Send` for the graph handle; see `OwnedGraph`.

use super::context::Gpu;
use super::error::CudaError;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode_enum};
use cudarc::driver::CudaGraph;
use std::collections::HashMap;

/// How decode steps run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeGraphs {
    /// Every step eagerly, batches unpadded.
    Off,
    /// Decode steps padded to a bucket and replayed from a CUDA graph (the default).
    On,
    /// Decode steps padded to a bucket but launched eagerly: exactly the work a graph replays,
    /// for checking that replay gives the same logits bit for bit.
    PaddedEager,
}

/// A captured graph, owned by one executor.
struct OwnedGraph(CudaGraph);

// SAFETY: cudarc leaves `CudaGraph` !Send because graph objects are not internally
// synchronised (CUDA's rule: no concurrent calls on one graph). An `OwnedGraph` is only
// reached through `&mut GraphCache`, so calls on it are serialised, and CUDA graph handles
// are not tied to the thread that made them (`launch` binds the context to the calling
// thread first). The engine process moves its executor to its step thread once.
unsafe impl Send for OwnedGraph {}

/// The captured graphs of one executor.
pub struct GraphCache {
    mode: DecodeGraphs,
    /// Bucket row counts, ascending: powers of two below the largest, then the largest.
    buckets: Vec<usize>,
    /// By bucket: the graph, and the block-table buffer generation it was captured with.
    graphs: HashMap<usize, (OwnedGraph, u64)>,
    /// Why capture failed, once it has (graphs are off from then on).
    failed: Option<String>,
    pub captured: u64,
    pub replayed: u64,
}

impl GraphCache {
    /// Buckets up to `max_rows` rows (the executor's most sequences per step, capped by its
    /// token budget: a padded step computes one token per row).
    pub fn new(mode: DecodeGraphs, max_rows: usize) -> GraphCache {
        let mut buckets = Vec::new();
        let mut b = 1;
        while b < max_rows {
            buckets.push(b);
            b *= 2;
        }
        if max_rows > 0 {
            buckets.push(max_rows);
        }
        GraphCache { mode, buckets, graphs: HashMap::new(), failed: None, captured: 0, replayed: 0 }
    }

    /// Switches mode, dropping every graph (they may have been captured for other kernels).
    pub fn set_mode(&mut self, mode: DecodeGraphs) {
        self.mode = mode;
        self.graphs.clear();
    }

    /// Drops every graph: what they captured (kernel choice, buffers) has changed.
    pub fn clear(&mut self) {
        self.graphs.clear();
    }

    /// Why graph capture failed, if it did.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// The row count a decode step of `rows` rows is padded to, or `None` when it runs
    /// unpadded (graphs off, or more rows than the largest bucket).
    pub fn bucket(&self, rows: usize) -> Option<usize> {
        if self.mode == DecodeGraphs::Off || rows == 0 {
            return None;
        }
        self.buckets.iter().copied().find(|&b| b >= rows)
    }

    /// Whether steps should be captured and replayed (not only padded).
    pub fn replays(&self) -> bool {
        self.mode == DecodeGraphs::On && self.failed.is_none()
    }

    /// The graph for `bucket`, if one was captured with block-table generation `gen`.
    pub fn get(&self, bucket: usize, gen: u64) -> Option<&CudaGraph> {
        if !self.replays() {
            return None;
        }
        self.graphs.get(&bucket).filter(|(_, g)| *g == gen).map(|(graph, _)| &graph.0)
    }

    /// Launches the graph for `bucket` (which [`GraphCache::get`] found).
    pub fn replay(&mut self, bucket: usize, gen: u64) -> Result<bool, CudaError> {
        let Some(graph) = self.get(bucket, gen) else { return Ok(false) };
        graph.launch().map_err(|e| CudaError::call(format!("replaying the CUDA graph of {bucket} rows"), e))?;
        self.replayed += 1;
        Ok(true)
    }

    /// Captures what `launch` enqueues as the graph of `bucket`. The stream must be idle.
    /// Errors are kept (and turn graphs off), not returned: the step itself already ran.
    pub fn capture(&mut self, gpu: &Gpu, bucket: usize, gen: u64, launch: impl FnOnce() -> Result<(), CudaError>) {
        if !self.replays() {
            return;
        }
        match Self::record(gpu, launch) {
            Ok(graph) => {
                self.graphs.insert(bucket, (OwnedGraph(graph), gen));
                self.captured += 1;
            }
            Err(e) => self.failed = Some(format!("capturing the decode graph of {bucket} rows: {e}")),
        }
    }

    fn record(gpu: &Gpu, launch: impl FnOnce() -> Result<(), CudaError>) -> Result<CudaGraph, CudaError> {
        // Thread-local capture: only this thread's CUDA calls are recorded or checked; the
        // engine process's other threads make none.
        gpu.stream
            .begin_capture(CUstreamCaptureMode_enum::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| CudaError::call("beginning CUDA graph capture", e))?;
        let launched = launch();
        // End the capture whatever happened, so the stream leaves capture mode.
        let ended = gpu.stream.end_capture(CUgraphInstantiate_flags(0));
        launched?;
        let graph = ended
            .map_err(|e| CudaError::call("ending CUDA graph capture", e))?
            .ok_or_else(|| CudaError::call("ending CUDA graph capture", "no graph was recorded"))?;
        graph.upload().map_err(|e| CudaError::call("uploading a CUDA graph", e))?;
        Ok(graph)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_batches_round_up_to_power_of_two_buckets_capped_at_the_largest() {
        let g = GraphCache::new(DecodeGraphs::On, 48);
        assert_eq!(g.buckets, [1, 2, 4, 8, 16, 32, 48]);
        assert_eq!(g.bucket(1), Some(1));
        assert_eq!(g.bucket(3), Some(4));
        assert_eq!(g.bucket(33), Some(48));
        assert_eq!(g.bucket(49), None);
        assert_eq!(g.bucket(0), None);
        assert_eq!(GraphCache::new(DecodeGraphs::Off, 48).bucket(3), None);
        assert_eq!(GraphCache::new(DecodeGraphs::PaddedEager, 48).bucket(3), Some(4));
        assert!(!GraphCache::new(DecodeGraphs::PaddedEager, 48).replays());
    }
}
