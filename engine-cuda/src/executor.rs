//! [`CudaExecutor`]: the engine's [`Executor`] running a Llama model on one GPU.
//!
//! # Contract with the engine process
//!
//! The engine's requests carry token counts, not token ids, so the process hands the ids over
//! on a side channel:
//!
//! 1. build the executor ([`CudaExecutor::new`]) and size the instance from it
//!    ([`CudaExecutor::instance_config`]: its block size and the KV blocks its memory budget
//!    holds);
//! 2. before enqueueing request `id` on the instance, call [`CudaExecutor::set_request`] with
//!    its prompt ids and sampling parameters, and give the request the block hashes of those
//!    ids ([`engine::block_hashes`]), so that prefix sharing matches real content;
//! 3. each step's sampled tokens are in `StepOutput::tokens` (one per entry that completes its
//!    prompt or decodes, in entry order) and are also appended to the request's sequence,
//!    which is how the next decode step knows its input;
//! 4. once the instance reports the request finished (or evicted), call
//!    [`CudaExecutor::release`].
//!
//! P/D hand-offs (between steps): a prefill engine reads a parked request's KV with
//! [`CudaExecutor::export_kv`] (its block table from `Instance::parked_blocks`); a decode
//! engine writes it into the blocks `Instance::receive_transfer` reserved with
//! [`CudaExecutor::import_request`], which also registers the request's tokens and sampling in
//! place of `set_request`, then calls `Instance::finish_transfer`.
//!
//! Every step synchronises with the GPU before returning, so the returned duration is the
//! measured wall time of the step, host work included.

use super::config::LlamaConfig;
use super::context::Gpu;
use super::error::CudaError;
use super::graph::{DecodeGraphs, GraphCache};
use super::kernels::{KernelShape, Kernels};
use super::kv::{KvCopy, KvPool, StepLayout};
use super::model::{delay_gpu, random_weights, Attention, Llama, Scratch, StepShape};
use super::sampling::Sampling;
use super::timeline::LaunchTimes;
use super::transfer::{chunks, row_offset, KvDtype, KvHeader, KvShape};
use super::weights::{ModelFiles, Weights};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use engine::batch::Batch;
use engine::executor::{Executor, ExecutorError, StepOutput};
use engine::ids::{BlockId, RequestId};
use engine::instance::InstanceConfig;
use engine::time::Dur;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

/// Where the weights come from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A Hugging Face model folder (`config.json` and safetensors).
    Dir(PathBuf),
    /// Random weights drawn on the GPU for this shape (speed runs; no files needed).
    Random { config: LlamaConfig, seed: u64 },
}

/// How to build a [`CudaExecutor`].
#[derive(Clone, Debug)]
pub struct CudaExecutorConfig {
    pub model: ModelSource,
    /// CUDA device ordinal.
    pub device: usize,
    /// Device memory this executor may use, weights, buffers and KV together, so that several
    /// engine processes can share a GPU. `None`: 90% of the memory free at start-up.
    pub gpu_memory_bytes: Option<u64>,
    /// Tokens per KV block (the instance's `block_size`).
    pub block_size: u32,
    /// Most tokens one step computes (the instance's `max_batch_tokens`).
    pub max_batch_tokens: u32,
    /// Most sequences in one step (the instance's `max_seqs`).
    pub max_seqs: u32,
    /// Whether decode steps replay CUDA graphs (see [`DecodeGraphs`]).
    pub decode_graphs: DecodeGraphs,
}

impl CudaExecutorConfig {
    /// Defaults for serving: 16-token blocks, 8192-token steps, 256 sequences.
    pub fn new(model: ModelSource) -> CudaExecutorConfig {
        CudaExecutorConfig {
            model,
            device: 0,
            gpu_memory_bytes: None,
            block_size: 16,
            max_batch_tokens: 8192,
            max_seqs: 256,
            decode_graphs: DecodeGraphs::On,
        }
    }
}

/// Device memory kept out of the budget for the CUDA context's and cuBLAS's own use.
const RESERVED_BYTES: u64 = 1 << 30;

/// The device buffer KV hand-offs move through, a chunk of tokens at a time (at least one
/// token's KV of every layer).
const STAGING_BYTES: usize = 16 << 20;

/// A request's token ids and how to sample it.
struct Sequence {
    tokens: Vec<u32>,
    prompt_len: usize,
    sampling: Sampling,
}

/// Runs batches of the engine's scheduler on the GPU.
pub struct CudaExecutor {
    gpu: Gpu,
    kernels: Kernels,
    model: Llama,
    kv: KvPool,
    scratch: Scratch,
    graphs: GraphCache,
    seqs: HashMap<RequestId, Sequence>,
    /// When on, the f32 logits each sampled row came from, per request (tests and checks).
    captured: Option<HashMap<RequestId, Vec<Vec<f32>>>>,
    max_batch_tokens: u32,
    max_seqs: u32,
    /// Host copies reused across steps.
    argmax_host: Vec<u32>,
    logits_host: Vec<f32>,
    sample_params: Vec<f32>,
    /// KV hand-offs go through this buffer, `staging_tokens` tokens at a time.
    staging: CudaSlice<u8>,
    staging_tokens: u32,
}

impl CudaExecutor {
    /// Opens the GPU, compiles the kernels, loads the model and carves the KV pool out of what
    /// is left of the memory budget.
    pub fn new(config: CudaExecutorConfig) -> Result<CudaExecutor, CudaError> {
        if config.block_size == 0 || config.max_batch_tokens == 0 || config.max_seqs == 0 {
            return Err(CudaError::Budget("block_size, max_batch_tokens and max_seqs must be positive".into()));
        }
        let gpu = Gpu::open(config.device)?;
        let (cfg, files) = match &config.model {
            ModelSource::Dir(dir) => (LlamaConfig::load(dir)?, Some(ModelFiles::open(dir)?)),
            ModelSource::Random { config, .. } => {
                config.validate().map_err(|msg| CudaError::Config { path: "<random model>".into(), msg })?;
                (config.clone(), None)
            }
        };
        let (free, _) = gpu.memory()?;
        let budget = config.gpu_memory_bytes.unwrap_or(free as u64 / 10 * 9);
        let (max_tokens, max_rows) = (config.max_batch_tokens as usize, config.max_seqs as usize);
        let token_bytes = kv_shape(&cfg).token_bytes();
        let staging_tokens = (STAGING_BYTES / token_bytes).max(1);
        let staging_bytes = staging_tokens * token_bytes;
        let fixed = Weights::bytes(&cfg)
            + Scratch::bytes(&cfg, max_tokens, max_rows, gpu.sms)
            + staging_bytes as u64
            + RESERVED_BYTES;
        let per_block = KvPool::bytes_per_block(&cfg, config.block_size);
        // One block of the pool is the padding rows' (KvPool::pad_block), not the engine's.
        let blocks = (budget.saturating_sub(fixed) / per_block).saturating_sub(1);
        let blocks_per_seq = u64::from(config.max_batch_tokens.div_ceil(config.block_size));
        if blocks < blocks_per_seq {
            return Err(CudaError::Budget(format!(
                "{budget} bytes hold the weights and buffers ({fixed} bytes) but not {blocks_per_seq} KV blocks of {per_block} bytes"
            )));
        }
        if budget > free as u64 {
            return Err(CudaError::Budget(format!("{budget} bytes asked for but only {free} are free on the device")));
        }
        let shape = KernelShape {
            head_dim: cfg.head_dim,
            block_size: config.block_size as usize,
            group: cfg.num_attention_heads / cfg.num_key_value_heads,
        };
        let kernels = Kernels::load(&gpu.ctx, &gpu.arch, shape)?;
        let weights = match (&config.model, files) {
            (_, Some(files)) => Weights::load(&gpu, &cfg, &files)?,
            (ModelSource::Random { seed, .. }, None) => random_weights(&gpu, &kernels, &cfg, *seed)?,
            (ModelSource::Dir(_), None) => unreachable!("a model folder always has files"),
        };
        let num_blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
        let kv = KvPool::new(&gpu, &cfg, num_blocks, config.block_size)?;
        let scratch = Scratch::new(&gpu, &cfg, max_tokens, max_rows, gpu.sms)?;
        let staging = gpu.zeros(staging_bytes, "the KV hand-off buffer")?;
        let model = Llama::new(&gpu, cfg, weights)?;
        gpu.sync()?;
        Ok(CudaExecutor {
            gpu,
            kernels,
            model,
            kv,
            scratch,
            graphs: GraphCache::new(config.decode_graphs, max_rows.min(max_tokens)),
            seqs: HashMap::new(),
            captured: None,
            max_batch_tokens: config.max_batch_tokens,
            max_seqs: config.max_seqs,
            argmax_host: Vec::new(),
            logits_host: Vec::new(),
            sample_params: Vec::new(),
            staging,
            staging_tokens: u32::try_from(staging_tokens).unwrap_or(u32::MAX),
        })
    }

    /// The device's name as the driver reports it (e.g. `NVIDIA H200`).
    pub fn device_name(&self) -> Result<String, CudaError> {
        self.gpu.ctx.name().map_err(|e| CudaError::call("reading the device name", e))
    }

    /// The model's shape.
    pub fn model_config(&self) -> &LlamaConfig {
        &self.model.cfg
    }

    /// KV blocks the memory budget holds (the instance's `total_blocks`).
    pub fn kv_blocks(&self) -> u32 {
        self.kv.num_blocks
    }

    /// Tokens per KV block (the instance's `block_size`).
    pub fn block_size(&self) -> u32 {
        self.kv.block_size
    }

    /// An instance configuration that fits this executor: its block size, KV blocks, step
    /// limits, and no host-memory tier (this executor keeps KV on the GPU only). Scheduling
    /// policy fields keep their defaults for the process to override.
    pub fn instance_config(&self) -> InstanceConfig {
        InstanceConfig {
            block_size: self.kv.block_size,
            total_blocks: self.kv.num_blocks,
            max_batch_tokens: self.max_batch_tokens,
            max_seqs: self.max_seqs,
            l2_blocks: 0,
            offload_chunk_blocks: 1,
            ..InstanceConfig::default()
        }
    }

    /// Registers request `id`'s prompt ids and sampling before it is enqueued. Replaces an
    /// earlier registration of the same id.
    pub fn set_request(&mut self, id: RequestId, prompt: Vec<u32>, sampling: Sampling) {
        let prompt_len = prompt.len();
        self.seqs.insert(id, Sequence { tokens: prompt, prompt_len, sampling });
    }

    /// Forgets request `id`; returns its tokens generated here (after the prompt).
    pub fn release(&mut self, id: RequestId) -> Option<Vec<u32>> {
        if let Some(c) = self.captured.as_mut() {
            c.remove(&id);
        }
        self.seqs.remove(&id).map(|mut s| s.tokens.split_off(s.prompt_len))
    }

    /// Request `id`'s sequence so far: prompt, then generated tokens.
    pub fn tokens(&self, id: RequestId) -> Option<&[u32]> {
        self.seqs.get(&id).map(|s| &s.tokens[..])
    }

    /// The shape of this model's KV, as hand-off payloads state it.
    pub fn kv_shape(&self) -> KvShape {
        kv_shape(&self.model.cfg)
    }

    /// The KV of the first `tokens` tokens of a sequence whose block table is `table` (a
    /// parked request's, `Instance::parked_blocks`), every layer's K and V, as a hand-off
    /// payload ([`super::transfer`]: a header naming the KV's shape, then the KV token by
    /// token) for [`CudaExecutor::import_request`] on another executor of the same model.
    /// Between steps only.
    pub fn export_kv(&mut self, table: &[BlockId], tokens: u32) -> Result<Vec<u8>, CudaError> {
        let table_dev = self.upload_table(table, tokens)?;
        let shape = self.kv_shape();
        let header = KvHeader { shape, block_size: self.kv.block_size, tokens };
        let mut out = Vec::new();
        out.try_reserve_exact(header.payload_bytes()).map_err(|_| {
            CudaError::Batch(format!("no host memory for a KV payload of {} bytes", header.payload_bytes()))
        })?;
        header.encode(&mut out);
        out.resize(header.payload_bytes(), 0);
        for chunk in chunks(tokens, self.staging_tokens) {
            let copy = KvCopy { table: &table_dev, first: chunk.start, tokens: chunk.len() as u32 };
            self.kv.gather(&self.gpu, &self.kernels, &copy, &mut self.staging)?;
            let at = row_offset(&shape, chunk.start, 0, false);
            let bytes = chunk.len() * shape.token_bytes();
            self.gpu.download(&self.staging, &mut out[at..at + bytes], "the KV being exported")?;
        }
        Ok(out)
    }

    /// Takes request `id`, prefilled on another executor of the same model: writes the KV of
    /// `payload` (made by [`CudaExecutor::export_kv`]) into the blocks of `table` (reserved by
    /// `Instance::receive_transfer`) and registers the request as `set_request` would, with
    /// `generated` (the tokens sampled there) after its prompt, so its next decode step feeds
    /// the last of them and its draws continue where they stopped. The payload must hold the
    /// KV of every token but the last generated one, in this model's shape: otherwise nothing
    /// is written or registered and the error names the mismatch. Between steps only.
    pub fn import_request(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        generated: &[u32],
        sampling: Sampling,
        table: &[BlockId],
        payload: &[u8],
    ) -> Result<(), CudaError> {
        if prompt.is_empty() || generated.is_empty() {
            return Err(CudaError::Batch(format!(
                "{id}: a hand-off needs a prompt and a generated token (got {} and {})",
                prompt.len(),
                generated.len()
            )));
        }
        let needed = u32::try_from(prompt.len() + generated.len() - 1)
            .map_err(|_| CudaError::Batch(format!("{id}: the sequence is too long")))?;
        let header = KvHeader::decode(payload)?;
        header.check(&self.kv_shape(), needed)?;
        let vocab = self.model.cfg.vocab_size;
        if let Some(bad) = prompt.iter().chain(generated).find(|&&t| t as usize >= vocab) {
            return Err(CudaError::Batch(format!("{id}: token id {bad} is outside the vocabulary of {vocab}")));
        }
        let table_dev = self.upload_table(table, needed)?;
        let shape = header.shape;
        for chunk in chunks(needed, self.staging_tokens) {
            let at = row_offset(&shape, chunk.start, 0, false);
            let bytes = chunk.len() * shape.token_bytes();
            self.gpu.upload(&payload[at..at + bytes], &mut self.staging, "the imported KV")?;
            let copy = KvCopy { table: &table_dev, first: chunk.start, tokens: chunk.len() as u32 };
            self.kv.scatter(&self.gpu, &self.kernels, &copy, &self.staging)?;
            // The next chunk reuses the staging buffer.
            self.gpu.sync()?;
        }
        let prompt_len = prompt.len();
        let mut tokens = prompt;
        tokens.extend_from_slice(generated);
        self.seqs.insert(id, Sequence { tokens, prompt_len, sampling });
        Ok(())
    }

    /// Moves hand-offs `tokens` tokens at a time (fewer than the staging buffer holds), so
    /// that tests of a small model cross chunk boundaries.
    #[cfg(test)]
    pub(crate) fn set_staging_tokens(&mut self, tokens: u32) {
        self.staging_tokens = tokens.clamp(1, self.staging_tokens);
    }

    /// The KV pool on the host: K, V, elements per layer.
    #[cfg(test)]
    pub(crate) fn kv_to_host(&self) -> Result<(Vec<u16>, Vec<u16>, usize), CudaError> {
        self.kv.to_host(&self.gpu)
    }

    /// `table` on the device, after checking that it holds `tokens` tokens in this pool.
    fn upload_table(&self, table: &[BlockId], tokens: u32) -> Result<CudaSlice<i32>, CudaError> {
        let bs = self.kv.block_size;
        if tokens == 0 || (table.len() as u64) < u64::from(tokens.div_ceil(bs)) {
            return Err(CudaError::Batch(format!(
                "a KV hand-off of {tokens} tokens needs {} blocks of {bs} tokens; the table has {}",
                tokens.div_ceil(bs).max(1),
                table.len()
            )));
        }
        if let Some(b) = table.iter().find(|b| b.0 >= self.kv.num_blocks) {
            return Err(CudaError::Batch(format!("block {} is outside the pool of {}", b.0, self.kv.num_blocks)));
        }
        let host: Vec<i32> = table.iter().map(|b| b.0 as i32).collect();
        let mut dev = self.gpu.zeros::<i32>(host.len(), "a hand-off block table")?;
        self.gpu.upload(&host, &mut dev, "a hand-off block table")?;
        Ok(dev)
    }

    /// Keeps (or stops keeping) the f32 logits of every sampled row, per request: for
    /// correctness checks against a reference implementation. Costs a copy of the logits to
    /// the host each step.
    pub fn capture_logits(&mut self, on: bool) {
        self.captured = on.then(HashMap::new);
    }

    /// The logits captured for request `id`, one row per token sampled for it.
    pub fn captured_logits(&self, id: RequestId) -> Option<&[Vec<f32>]> {
        self.captured.as_ref()?.get(&id).map(|v| &v[..])
    }

    /// Switches how decode steps run (checks compare the modes on the same requests).
    pub fn set_decode_graphs(&mut self, mode: DecodeGraphs) {
        self.graphs.set_mode(mode);
    }

    /// Switches the attention kernels (checks compare them; [`Attention::Tiled`] serves).
    pub fn set_attention(&mut self, attention: Attention) {
        self.model.attention = attention;
        // Captured graphs hold the other kernel.
        self.graphs.clear();
    }

    /// Steps of at most `rows` tokens run the fused GEMV path (`gemv.cu`; 0: none, every step
    /// through cuBLAS and the separate small kernels). Checks and speed runs compare the two.
    pub fn set_small_step_rows(&mut self, rows: usize) {
        self.model.small_step_rows = rows;
        // Captured graphs hold the other path's launches.
        self.graphs.clear();
    }

    /// Times the launches of one decode step of `batch` (every entry decoding one token) one
    /// by one, then the replay of the step's CUDA graph where its bucket has one (`replays`
    /// times back to back). The step's inputs are uploaded as for a real step, padded to the
    /// bucket when graphs are on; it writes the step's KV as a real step would and samples
    /// nothing, so the requests are unchanged. See `timeline.rs`.
    pub fn time_decode_launches(&mut self, batch: &Batch, replays: usize) -> Result<LaunchTimes, CudaError> {
        if batch.entries.is_empty() || batch.entries.iter().any(|e| e.is_prefill) {
            return Err(CudaError::Batch("timing launches needs a decode-only step".into()));
        }
        let seqs = &self.seqs;
        let mut layout =
            StepLayout::build(batch, self.kv.block_size, self.kv.num_blocks, |id| seqs.get(&id).map(|s| &s.tokens[..]))
                .map_err(CudaError::Batch)?;
        let bucket = self.graphs.bucket(layout.tokens());
        let shape = match bucket {
            Some(b) => {
                layout.pad_decode(b, self.kv.pad_block(), self.kv.block_size).map_err(CudaError::Batch)?;
                StepShape::decode(b)
            }
            None => StepShape::of(&layout),
        };
        self.model.upload(&self.gpu, &mut self.scratch, &layout)?;
        self.gpu.sync()?;
        // Holds the GPU while the host queues the step's launches (a few ms of host calls).
        self.delay_gpu(20_000_000)?;
        self.gpu.start_timeline()?;
        let launched = self.model.launch(&self.gpu, &self.kernels, &self.kv, &self.scratch, shape);
        let marks = self.gpu.take_timeline();
        launched?;
        self.gpu.sync()?;
        let mut times = LaunchTimes::default();
        for pair in marks.windows(2) {
            let ms = pair[0].1.elapsed_ms(&pair[1].1).map_err(|e| CudaError::call("reading a timing event", e))?;
            times.launches.push((pair[1].0, f64::from(ms) * 1e3));
        }
        let gen = self.scratch.tables_gen;
        if let Some(b) = bucket.filter(|&b| replays > 0 && self.graphs.get(b, gen).is_some()) {
            self.delay_gpu(5_000_000)?;
            let event = || {
                self.gpu
                    .stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(|e| CudaError::call("recording a timing event", e))
            };
            let start = event()?;
            for _ in 0..replays {
                self.graphs.replay(b, gen)?;
            }
            let end = event()?;
            let ms = start.elapsed_ms(&end).map_err(|e| CudaError::call("reading a timing event", e))?;
            times.graph_us = Some(f64::from(ms) * 1e3 / replays as f64);
        }
        Ok(times)
    }

    fn delay_gpu(&self, ns: i64) -> Result<(), CudaError> {
        delay_gpu(&self.gpu, &self.kernels, ns)
    }

    /// CUDA graphs captured and replayed so far, and why capture failed if it did (graphs
    /// are then off and every step runs eagerly).
    pub fn graph_stats(&self) -> (u64, u64, Option<&str>) {
        (self.graphs.captured, self.graphs.replayed, self.graphs.failure())
    }

    fn step(&mut self, batch: &Batch, out: &mut StepOutput) -> Result<(), CudaError> {
        let seqs = &self.seqs;
        let mut layout =
            StepLayout::build(batch, self.kv.block_size, self.kv.num_blocks, |id| seqs.get(&id).map(|s| &s.tokens[..]))
                .map_err(CudaError::Batch)?;
        // Sampled rows that belong to real entries (padding rows come after them).
        let rows = layout.logit_rows.len();
        let decode_only = !batch.entries.is_empty() && batch.entries.iter().all(|e| !e.is_prefill);
        let bucket = if decode_only { self.graphs.bucket(layout.tokens()) } else { None };
        let mut capture = None;
        match bucket {
            Some(b) => {
                layout.pad_decode(b, self.kv.pad_block(), self.kv.block_size).map_err(CudaError::Batch)?;
                self.model.upload(&self.gpu, &mut self.scratch, &layout)?;
                let gen = self.scratch.tables_gen;
                if !self.graphs.replay(b, gen)? {
                    self.model.launch(&self.gpu, &self.kernels, &self.kv, &self.scratch, StepShape::decode(b))?;
                    if self.graphs.replays() {
                        capture = Some((b, gen));
                    }
                }
            }
            None => self.model.forward(&self.gpu, &self.kernels, &self.kv, &mut self.scratch, &layout)?,
        }
        self.read_tokens(batch, &layout, rows, out)?;
        if let Some((b, gen)) = capture {
            // After the eager run has finished (read_tokens waited for it): capture needs an
            // idle stream, and the eager run loaded every module and warmed cuBLAS.
            let (gpu, kernels, kv, scratch, model) = (&self.gpu, &self.kernels, &self.kv, &self.scratch, &self.model);
            self.graphs.capture(gpu, b, gen, || model.launch(gpu, kernels, kv, scratch, StepShape::decode(b)));
        }
        Ok(())
    }

    /// Draws the tokens of the rows that sample (greedy rows keep the argmax the forward
    /// pass left), copies the step's tokens to the host (and the logits where checks capture
    /// them) and appends each to its request. `rows`: the real sampled rows, in entry order.
    fn read_tokens(
        &mut self,
        batch: &Batch,
        layout: &StepLayout,
        rows: usize,
        out: &mut StepOutput,
    ) -> Result<(), CudaError> {
        if rows == 0 {
            return self.gpu.sync();
        }
        self.sample_params.clear();
        let mut any_sampled = false;
        for &e in &layout.emitting {
            let seq = &self.seqs[&batch.entries[e].request];
            let s = seq.sampling;
            let (temperature, u) = if s.is_greedy() {
                (0.0, 0.0)
            } else {
                any_sampled = true;
                (s.temperature, s.uniform((seq.tokens.len() - seq.prompt_len) as u64))
            };
            self.sample_params.extend([temperature, s.top_p, u]);
        }
        if any_sampled {
            self.model.sample_rows(&self.gpu, &self.kernels, &mut self.scratch, &self.sample_params)?;
        }
        self.argmax_host.resize(rows, 0);
        self.gpu.download(&self.scratch.argmax, &mut self.argmax_host, "sampled tokens")?;
        let vocab = self.model.cfg.vocab_size;
        if self.captured.is_some() {
            self.model.widen_logits(&self.gpu, &self.kernels, &self.scratch, rows)?;
            self.logits_host.resize(rows * vocab, 0.0);
            self.gpu.download(&self.scratch.logits_f32, &mut self.logits_host, "logits")?;
        }
        for (k, &e) in layout.emitting.iter().enumerate() {
            let id = batch.entries[e].request;
            let seq = self.seqs.get_mut(&id).expect("layout checked every request");
            let token = self.argmax_host[k];
            if let Some(c) = self.captured.as_mut() {
                c.entry(id).or_default().push(self.logits_host[k * vocab..(k + 1) * vocab].to_vec());
            }
            seq.tokens.push(token);
            out.tokens.push(token);
        }
        Ok(())
    }
}

/// The KV shape of a model: what two executors must share to hand a request over.
fn kv_shape(cfg: &LlamaConfig) -> KvShape {
    KvShape {
        layers: cfg.num_hidden_layers as u32,
        kv_heads: cfg.num_key_value_heads as u32,
        head_dim: cfg.head_dim as u32,
        dtype: KvDtype::Bf16,
    }
}

impl Executor for CudaExecutor {
    fn needs_block_tables(&self) -> bool {
        true
    }

    fn execute(&mut self, batch: &Batch, out: &mut StepOutput) -> Result<Dur, ExecutorError> {
        let start = Instant::now();
        let before = out.tokens.len();
        if let Err(e) = self.step(batch, out) {
            // The engine reschedules a failed step: leave no partial output behind.
            out.tokens.truncate(before);
            return Err(ExecutorError::Failed(e.to_string()));
        }
        Ok(Dur::from_secs_f64(start.elapsed().as_secs_f64()))
    }
}
