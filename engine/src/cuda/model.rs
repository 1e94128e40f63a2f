//! The Llama forward pass over one step's tokens: embeddings, then per layer RMSNorm, fused
//! QKV GEMM, RoPE and KV write, paged attention, output projection, residual add fused into
//! the next RMSNorm, fused gate/up GEMM, SiLU-mul, down projection; then the final norm on the
//! rows that sample, the LM head and a greedy argmax.
//!
//! Prefill chunks and decode tokens of many sequences run in one pass: GEMMs see all the
//! step's tokens as rows, and only attention needs to know which sequence a token belongs to
//! (through [`StepLayout`]).
#![allow(unsafe_code)] // Kernel launches; the invariants each relies on are stated at `launch`.

use super::config::LlamaConfig;
use super::context::Gpu;
use super::error::CudaError;
use super::kernels::Kernels;
use super::kv::{KvPool, StepLayout, PREFILL_TILE_ROWS};
use super::weights::Weights;
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

/// Working buffers sized for the largest step (`max_tokens` tokens, `max_rows` sampled rows),
/// allocated once so a step allocates nothing.
pub struct Scratch {
    pub max_tokens: usize,
    pub max_rows: usize,
    residual: CudaSlice<u16>,
    normed: CudaSlice<u16>,
    qkv: CudaSlice<u16>,
    attn: CudaSlice<u16>,
    proj: CudaSlice<u16>,
    gate_up: CudaSlice<u16>,
    act: CudaSlice<u16>,
    last: CudaSlice<u16>,
    logits: CudaSlice<u16>,
    pub logits_f32: CudaSlice<f32>,
    pub argmax: CudaSlice<u32>,
    /// Per sampled row: temperature, top-p and the row's uniform draw (`sample_rows`).
    sample_params: CudaSlice<f32>,
    ids: CudaSlice<u32>,
    pos: CudaSlice<i32>,
    slots: CudaSlice<i64>,
    tok_seq: CudaSlice<i32>,
    table_start: CudaSlice<i32>,
    rows: CudaSlice<u32>,
    /// Grown on demand: a batch's tables may repeat shared prefix blocks.
    tables: CudaSlice<i32>,
    tables_cap: usize,
    /// Bumped when `tables` is reallocated: CUDA graphs captured before hold its old address.
    pub tables_gen: u64,
    /// Per-split attention results (`[token][head][split][head_dim + 2]` f32) for steps few
    /// enough tokens to split their attention over the context.
    partial: CudaSlice<f32>,
    /// The step's prefill attention tiles (`StepLayout::prefill_tiles`), `tiles_cap` pairs.
    tiles: CudaSlice<i32>,
    tiles_cap: usize,
}

impl Scratch {
    /// Device bytes of the buffers for these limits (for the memory budget).
    pub fn bytes(cfg: &LlamaConfig, max_tokens: usize, max_rows: usize, sms: usize) -> u64 {
        let per_token = 2 * (3 * cfg.hidden_size + cfg.qkv_dim() + cfg.q_dim() + 3 * cfg.intermediate_size) + 4 * 8;
        let per_row = 2 * cfg.hidden_size + 6 * cfg.vocab_size + 20;
        let partial = 4 * partial_elems(cfg, max_tokens, sms);
        let tiles = 8 * max_tiles(max_tokens, max_rows);
        (max_tokens * per_token + max_rows * per_row + partial + tiles) as u64
    }

    pub fn new(
        gpu: &Gpu,
        cfg: &LlamaConfig,
        max_tokens: usize,
        max_rows: usize,
        sms: usize,
    ) -> Result<Scratch, CudaError> {
        let (t, r, h) = (max_tokens, max_rows, cfg.hidden_size);
        let tables_cap = 4 * t.max(r);
        Ok(Scratch {
            max_tokens,
            max_rows,
            residual: gpu.zeros(t * h, "the residual stream")?,
            normed: gpu.zeros(t * h, "normed activations")?,
            qkv: gpu.zeros(t * cfg.qkv_dim(), "QKV activations")?,
            attn: gpu.zeros(t * cfg.q_dim(), "attention output")?,
            proj: gpu.zeros(t * h, "projection output")?,
            gate_up: gpu.zeros(t * 2 * cfg.intermediate_size, "gate/up activations")?,
            act: gpu.zeros(t * cfg.intermediate_size, "MLP activations")?,
            last: gpu.zeros(r * h, "sampled rows")?,
            logits: gpu.zeros(r * cfg.vocab_size, "logits")?,
            logits_f32: gpu.zeros(r * cfg.vocab_size, "f32 logits")?,
            argmax: gpu.zeros(r, "argmax")?,
            sample_params: gpu.zeros(3 * r, "sampling parameters")?,
            ids: gpu.zeros(t, "token ids")?,
            pos: gpu.zeros(t, "positions")?,
            slots: gpu.zeros(t, "KV slots")?,
            tok_seq: gpu.zeros(t, "token sequences")?,
            table_start: gpu.zeros(r, "table starts")?,
            rows: gpu.zeros(r, "row indices")?,
            tables: gpu.zeros(tables_cap, "block tables")?,
            tables_cap,
            tables_gen: 0,
            partial: gpu.zeros(partial_elems(cfg, max_tokens, sms), "split attention results")?,
            tiles: gpu.zeros(2 * max_tiles(t, r), "prefill attention tiles")?,
            tiles_cap: max_tiles(t, r),
        })
    }
}

/// The most prefill attention tiles a step of `max_tokens` tokens and `max_rows` entries
/// can have: each entry's tokens make whole tiles and at most one partial one.
fn max_tiles(max_tokens: usize, max_rows: usize) -> usize {
    max_tokens / PREFILL_TILE_ROWS + max_rows
}

/// Into how many ranges of the context the split attention kernel cuts each token's keys,
/// for a step of `tokens` tokens: enough blocks (token × KV head × split) to give each
/// multiprocessor about four, at most 64 splits. It depends on the token count only, so a
/// CUDA graph captured for a batch size stays right for any context length.
pub fn attention_splits(tokens: usize, kv_heads: usize, sms: usize) -> usize {
    let target = 4 * sms;
    let have = (tokens * kv_heads).max(1);
    target.div_ceil(have).clamp(1, 64)
}

/// f32 elements of the split attention buffer: the largest `tokens × splits` over every
/// step size up to `max_tokens` that splits at all.
fn partial_elems(cfg: &LlamaConfig, max_tokens: usize, sms: usize) -> usize {
    let most = (1..=max_tokens)
        .map(|t| (t, attention_splits(t, cfg.num_key_value_heads, sms)))
        .take_while(|&(_, s)| s > 1)
        .map(|(t, s)| t * s)
        .max()
        .unwrap_or(0);
    most * cfg.num_attention_heads * (cfg.head_dim + 2)
}

/// Which attention kernels a step runs (checks compare them on the same requests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// `paged_attention`, a block per token and query head: the simple reference.
    Reference,
    /// `paged_attention_split` for every token: decode tokens split over their contexts,
    /// prompt-chunk tokens unsplit, a block per token and KV head, on CUDA cores.
    Split,
    /// The default: decode tokens as in `Split`, prompt-chunk tokens through the tiled
    /// tensor-core kernel `prefill_attention_tc`, 64 query rows a block (as `Split` where
    /// the kernel is not built: head_dim 256).
    Tiled,
}

/// The sizes [`Llama::launch`] builds a step's grids from: everything a step's launches
/// depend on besides the contents of the buffers [`Llama::upload`] fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    pub tokens: usize,
    /// The leading decode tokens (attention splits their contexts).
    pub decodes: usize,
    /// Sampled rows.
    pub rows: usize,
    /// Prefill attention tiles, covering the tokens after the leading decodes.
    pub tiles: usize,
}

impl StepShape {
    pub fn of(layout: &StepLayout) -> StepShape {
        StepShape {
            tokens: layout.tokens(),
            decodes: layout.leading_decodes,
            rows: layout.logit_rows.len(),
            tiles: layout.prefill_tiles.len() / 2,
        }
    }

    /// A (padded) decode-only step of `rows` rows: every token decodes and samples.
    pub fn decode(rows: usize) -> StepShape {
        StepShape { tokens: rows, decodes: rows, rows, tiles: 0 }
    }
}

/// The model on the GPU: weights and RoPE frequencies.
pub struct Llama {
    pub cfg: LlamaConfig,
    pub weights: Weights,
    inv_freq: CudaSlice<f32>,
    pub attention: Attention,
}

/// A grid of `x × y` blocks of `threads` threads.
fn grid(x: usize, y: usize, threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (x as u32, y as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// Launches `f` on the GPU's stream with `args` pushed in order.
///
/// SAFETY (for every caller): each `u64` argument is the address of a live device allocation
/// owned by `Scratch`, `Weights` or `KvPool` (which outlive the stream's work, since the
/// executor synchronises before returning from a step), sized for the grid: rows of the step's
/// token count `T <= max_tokens`, sampled rows `R <= max_rows`; every index a kernel reads
/// from device memory (token ids, block ids, slots) was checked on the host by
/// [`StepLayout::build`] and the executor (ids < vocab, blocks < pool size).
macro_rules! launch {
    ($gpu:expr, $f:expr, $cfg:expr, $what:expr; $($arg:expr),* $(,)?) => {{
        let mut b = $gpu.stream.launch_builder($f);
        $( b.arg($arg); )*
        unsafe { b.launch($cfg) }.map(|_| ()).map_err(|e| CudaError::call(format!("launching {}", $what), e))
    }};
}

impl Llama {
    pub fn new(gpu: &Gpu, cfg: LlamaConfig, weights: Weights) -> Result<Llama, CudaError> {
        let freqs = cfg.rope_inv_freq();
        let mut inv_freq = gpu.zeros::<f32>(freqs.len(), "RoPE frequencies")?;
        gpu.upload(&freqs, &mut inv_freq, "RoPE frequencies")?;
        Ok(Llama { cfg, weights, inv_freq, attention: Attention::Tiled })
    }

    /// Runs the step described by `layout` (whose KV goes into `kv`), leaving bf16 logits of
    /// the sampled rows in `s.logits` and their argmax in `s.argmax`. Asynchronous: the caller
    /// synchronises when it reads results.
    pub fn forward(
        &self,
        gpu: &Gpu,
        k: &Kernels,
        kv: &KvPool,
        s: &mut Scratch,
        layout: &StepLayout,
    ) -> Result<(), CudaError> {
        self.upload(gpu, s, layout)?;
        self.launch(gpu, k, kv, s, StepShape::of(layout))
    }

    /// Checks `layout` against the buffers' limits and copies it into them: the host-to-device
    /// half of a step, which a CUDA graph replay needs done before it launches.
    pub fn upload(&self, gpu: &Gpu, s: &mut Scratch, layout: &StepLayout) -> Result<(), CudaError> {
        let cfg = &self.cfg;
        let t = layout.tokens();
        let r = layout.logit_rows.len();
        if t == 0 {
            return Ok(());
        }
        let tiles = layout.prefill_tiles.len() / 2;
        if t > s.max_tokens || r > s.max_rows || layout.table_start.len() > s.max_rows || tiles > s.tiles_cap {
            return Err(CudaError::Batch(format!(
                "{t} tokens and {r} sequences exceed the executor's limits ({} tokens, {} sequences)",
                s.max_tokens, s.max_rows
            )));
        }
        if let Some(bad) = layout.token_ids.iter().find(|&&id| id as usize >= cfg.vocab_size) {
            return Err(CudaError::Batch(format!("token id {bad} is outside the vocabulary of {}", cfg.vocab_size)));
        }
        if layout.block_tables.len() > s.tables_cap {
            s.tables_cap = layout.block_tables.len().next_power_of_two();
            s.tables = gpu.zeros(s.tables_cap, "block tables")?;
            s.tables_gen += 1;
        }
        gpu.upload(&layout.token_ids, &mut s.ids, "token ids")?;
        gpu.upload(&layout.positions, &mut s.pos, "positions")?;
        gpu.upload(&layout.slots, &mut s.slots, "KV slots")?;
        gpu.upload(&layout.tok_seq, &mut s.tok_seq, "token sequences")?;
        gpu.upload(&layout.table_start, &mut s.table_start, "table starts")?;
        gpu.upload(&layout.block_tables, &mut s.tables, "block tables")?;
        gpu.upload(&layout.prefill_tiles, &mut s.tiles, "prefill attention tiles")?;
        gpu.upload(&layout.logit_rows, &mut s.rows, "sampled rows")
    }

    /// Enqueues the kernels and GEMMs of a step of `shape` whose inputs [`Llama::upload`]
    /// put in `s`. Touches only device memory whose addresses stay fixed and reads every
    /// step-dependent value (ids, positions, tables, tiles) from it, so the same calls can be
    /// captured into a CUDA graph and replayed for any step of that shape.
    pub fn launch(&self, gpu: &Gpu, k: &Kernels, kv: &KvPool, s: &Scratch, shape: StepShape) -> Result<(), CudaError> {
        let cfg = &self.cfg;
        let StepShape { tokens: t, decodes, rows: r, tiles } = shape;
        if t == 0 {
            return Ok(());
        }
        // The launches below size their grids from the shape: keep them inside the buffers.
        if t > s.max_tokens || r > s.max_rows || r > t || decodes > t || tiles > s.tiles_cap {
            return Err(CudaError::Batch(format!("a step of {shape:?} exceeds the buffers")));
        }
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let (nh, nkv) = (cfg.num_attention_heads as i32, cfg.num_key_value_heads as i32);
        let hidden = h as i32;
        let eps = cfg.rms_norm_eps;
        let scale = 1.0f32 / (cfg.head_dim as f32).sqrt();
        let p = |x: &CudaSlice<u16>| gpu.ptr(x, 0);
        let (residual, normed, qkv, attn, proj) = (p(&s.residual), p(&s.normed), p(&s.qkv), p(&s.attn), p(&s.proj));
        let (gate_up, act) = (p(&s.gate_up), p(&s.act));
        let (ids, pos, slots, tok_seq) =
            (gpu.ptr(&s.ids, 0), gpu.ptr(&s.pos, 0), gpu.ptr(&s.slots, 0), gpu.ptr(&s.tok_seq, 0));
        let (table_start, tables, rows) = (gpu.ptr(&s.table_start, 0), gpu.ptr(&s.tables, 0), gpu.ptr(&s.rows, 0));
        let inv_freq = gpu.ptr(&self.inv_freq, 0);
        let w = &self.weights;
        let group = cfg.num_attention_heads / cfg.num_key_value_heads;
        let partial = gpu.ptr(&s.partial, 0);
        let tiles_ptr = gpu.ptr(&s.tiles, 0);
        let tiled = match self.attention {
            Attention::Tiled => k.prefill_attention_tc.as_ref(),
            Attention::Reference | Attention::Split => None,
        };

        let embed = p(&w.embed);
        launch!(gpu, &k.embed, grid(t, 1, 256), "embed"; &ids, &embed, &residual, &hidden)?;
        for (l, lw) in w.layers.iter().enumerate() {
            // Layer 0 only normalises; later layers first add the previous MLP's output.
            let add = i32::from(l > 0);
            self.norm(gpu, &k.add_rmsnorm, t, residual, proj, p(&lw.input_norm), normed, eps, add)?;
            gpu.linear(normed, p(&lw.qkv), qkv, t, cfg.qkv_dim(), h)?;
            let (kc, vc) = kv.layer_ptrs(gpu, l);
            launch!(gpu, &k.rope_kv_write, grid(t, 1, 256), "rope_kv_write";
                &qkv, &inv_freq, &pos, &slots, &kc, &vc, &nh, &nkv)?;
            if self.attention == Attention::Reference {
                launch!(gpu, &k.paged_attention, grid(t, cfg.num_attention_heads, 128), "paged_attention";
                    &qkv, &kc, &vc, &pos, &tok_seq, &table_start, &tables, &attn, &nh, &nkv, &scale)?;
            } else {
                // Decode tokens split their contexts over the GPU; in a step that also has a
                // prefill chunk they get a launch of their own (the chunk's tokens are many
                // enough to fill the GPU unsplit), and the chunk's tokens go to the tiled
                // kernel where it is built (its tiles cover every token after the decodes).
                let split_at = if decodes > 0 || tiled.is_some() { decodes } else { t };
                let unsplit_end = if tiled.is_some() { split_at } else { t };
                if let (Some(f), true) = (tiled, tiles > 0) {
                    let tc_grid = LaunchConfig {
                        grid_dim: (cfg.num_attention_heads as u32, tiles as u32, 1),
                        block_dim: (128, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    launch!(gpu, f, tc_grid, "prefill_attention_tc";
                        &qkv, &kc, &vc, &pos, &tok_seq, &table_start, &tables, &tiles_ptr, &attn, &nh, &nkv, &scale)?;
                }
                for (first, end) in [(0, split_at), (split_at, unsplit_end)] {
                    let n = end - first;
                    if n == 0 {
                        continue;
                    }
                    let splits = if first == 0 { attention_splits(n, cfg.num_key_value_heads, gpu.sms) } else { 1 };
                    let (splits_i, first_i) = (splits as i32, first as i32);
                    let split_grid = LaunchConfig {
                        grid_dim: (n as u32, cfg.num_key_value_heads as u32, splits as u32),
                        block_dim: (32 * group as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    launch!(gpu, &k.paged_attention_split, split_grid, "paged_attention_split";
                        &qkv, &kc, &vc, &pos, &tok_seq, &table_start, &tables, &attn, &partial, &nh, &nkv, &scale,
                        &splits_i, &first_i)?;
                    if splits > 1 {
                        launch!(gpu, &k.attention_combine, grid(n, cfg.num_attention_heads, cfg.head_dim as u32),
                            "attention_combine"; &partial, &attn, &nh, &splits_i)?;
                    }
                }
            }
            gpu.linear(attn, p(&lw.o), proj, t, h, cfg.q_dim())?;
            self.norm(gpu, &k.add_rmsnorm, t, residual, proj, p(&lw.post_norm), normed, eps, 1)?;
            gpu.linear(normed, p(&lw.gate_up), gate_up, t, 2 * inter, h)?;
            let total = (t * inter) as i64;
            let inter_i = inter as i32;
            launch!(gpu, &k.silu_mul, grid((t * inter).div_ceil(256), 1, 256), "silu_mul";
                &gate_up, &act, &inter_i, &total)?;
            gpu.linear(act, p(&lw.down), proj, t, h, inter)?;
        }
        self.norm(gpu, &k.add_rmsnorm, t, residual, proj, p(&w.final_norm), normed, eps, 1)?;
        if r == 0 {
            return Ok(());
        }
        let (last, logits, argmax) = (p(&s.last), p(&s.logits), gpu.ptr(&s.argmax, 0));
        launch!(gpu, &k.gather_rows, grid(r, 1, 256), "gather_rows"; &normed, &rows, &last, &hidden)?;
        gpu.linear(last, p(w.lm_head()), logits, r, cfg.vocab_size, h)?;
        let vocab = cfg.vocab_size as i32;
        launch!(gpu, &k.argmax_rows, grid(r, 1, 1024), "argmax_rows"; &logits, &vocab, &argmax)
    }

    /// Replaces the argmax of the sampled rows whose temperature is positive with a draw
    /// from their softmax (top-p applied): `params` holds (temperature, top-p, uniform draw)
    /// per row, for the first `params.len() / 3` rows.
    pub fn sample_rows(&self, gpu: &Gpu, k: &Kernels, s: &mut Scratch, params: &[f32]) -> Result<(), CudaError> {
        let rows = params.len() / 3;
        if rows == 0 {
            return Ok(());
        }
        gpu.upload(params, &mut s.sample_params, "sampling parameters")?;
        let (logits, p, out) = (gpu.ptr(&s.logits, 0), gpu.ptr(&s.sample_params, 0), gpu.ptr(&s.argmax, 0));
        let vocab = self.cfg.vocab_size as i32;
        launch!(gpu, &k.sample_rows, grid(rows, 1, 1024), "sample_rows"; &logits, &vocab, &p, &out)
    }

    /// Widens the bf16 logits of the first `rows` sampled rows into `s.logits_f32`.
    pub fn widen_logits(&self, gpu: &Gpu, k: &Kernels, s: &Scratch, rows: usize) -> Result<(), CudaError> {
        let n = (rows * self.cfg.vocab_size) as i64;
        if n == 0 {
            return Ok(());
        }
        let (src, dst) = (gpu.ptr(&s.logits, 0), gpu.ptr(&s.logits_f32, 0));
        launch!(gpu, &k.widen, grid((n as usize).div_ceil(256), 1, 256), "widen"; &src, &dst, &n)
    }

    #[allow(clippy::too_many_arguments)] // One kernel's arguments, passed straight through.
    fn norm(
        &self,
        gpu: &Gpu,
        f: &CudaFunction,
        t: usize,
        residual: u64,
        x: u64,
        w: u64,
        out: u64,
        eps: f32,
        add: i32,
    ) -> Result<(), CudaError> {
        let hidden = self.cfg.hidden_size as i32;
        launch!(gpu, f, grid(t, 1, 512), "add_rmsnorm"; &residual, &x, &w, &out, &hidden, &eps, &add)
    }
}

/// Random weights drawn on the GPU (the `fill_uniform` kernel), for speed runs that need no
/// model files: same shapes and spread as `make-model`, not the same values.
pub fn random_weights(gpu: &Gpu, k: &Kernels, cfg: &LlamaConfig, seed: u64) -> Result<Weights, CudaError> {
    let mut counter = 0u64;
    let mut fill = |n: usize, scale: f32, what: &str| -> Result<CudaSlice<u16>, CudaError> {
        let d = gpu.zeros::<u16>(n, what)?;
        counter += 1;
        let tensor_seed = crate::ids::derive_seed(seed, "gpu-weights", counter);
        let (ptr, len) = (gpu.ptr(&d, 0), n as i64);
        launch!(gpu, &k.fill_uniform, grid(n.div_ceil(256), 1, 256), "fill_uniform";
            &ptr, &len, &tensor_seed, &scale)?;
        Ok(d)
    };
    let a = 0.02 * 3f32.sqrt();
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let embed = fill(cfg.vocab_size * h, a, "embeddings")?;
    let mut layers = Vec::new();
    for _ in 0..cfg.num_hidden_layers {
        layers.push(super::weights::LayerWeights {
            // Norm weights of ±0.1 rather than ~1: speed does not depend on the values, and
            // the kernel draws around zero.
            input_norm: fill(h, 0.1, "norm")?,
            qkv: fill(cfg.qkv_dim() * h, a, "qkv")?,
            o: fill(h * cfg.q_dim(), a, "o")?,
            post_norm: fill(h, 0.1, "norm")?,
            gate_up: fill(2 * i * h, a, "gate_up")?,
            down: fill(h * i, a, "down")?,
        });
    }
    let final_norm = fill(h, 0.1, "norm")?;
    let lm_head = if cfg.tie_word_embeddings { None } else { Some(fill(cfg.vocab_size * h, a, "lm_head")?) };
    gpu.sync()?;
    Ok(Weights { embed, layers, final_norm, lm_head })
}
