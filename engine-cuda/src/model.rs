//! The Llama forward pass over one step's tokens: embeddings, then per layer RMSNorm, fused
//! QKV GEMM, RoPE and KV write, paged attention, output projection, residual add fused into
//! the next RMSNorm, fused gate/up GEMM, SiLU-mul, down projection; then the final norm on the
//! rows that sample, the LM head and a greedy argmax.
//!
//! Prefill chunks and decode tokens of many sequences run in one pass: GEMMs see all the
//! step's tokens as rows, and only attention needs to know which sequence a token belongs to
//! (through [`StepLayout`]).
//!
//! Steps of at most 4 tokens (batch-1 decode, small batches) take the GEMV path instead
//! ([`gemv_bound`], `kernels/gemv.cu`): bandwidth-bound matrix-vector kernels of ours that
//! also do the work of the small kernels around the products (RMSNorm in their prologue;
//! RoPE and the KV write, SiLU-mul, the residual add and the greedy argmax in their
//! epilogue), so a layer is five launches instead of ten.
#![allow(unsafe_code)] // Kernel launches; the invariants each relies on are stated at `launch`.

use super::config::LlamaConfig;
use super::context::Gpu;
use super::error::CudaError;
use super::kernels::{Kernels, GEMV_ROW_BOUNDS};
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
    /// Per sampled row, the GEMV LM head's best (logit, index) key so far; zero between steps.
    argmax_best: CudaSlice<u64>,
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
    /// Per (token, KV head): how many split blocks have finished; the last one merges the
    /// splits and puts it back to zero (`paged_attention_split`).
    split_done: CudaSlice<u32>,
    /// The step's prefill attention tiles (`StepLayout::prefill_tiles`), `tiles_cap` pairs.
    tiles: CudaSlice<i32>,
    tiles_cap: usize,
}

impl Scratch {
    /// Device bytes of the buffers for these limits (for the memory budget).
    pub fn bytes(cfg: &LlamaConfig, max_tokens: usize, max_rows: usize, sms: usize) -> u64 {
        let per_token = 2 * (3 * cfg.hidden_size + cfg.qkv_dim() + cfg.q_dim() + 3 * cfg.intermediate_size) + 4 * 8;
        let per_row = 2 * cfg.hidden_size + 6 * cfg.vocab_size + 28;
        let partial = 4 * partial_elems(cfg, max_tokens, sms);
        let tiles = 8 * max_tiles(max_tokens, max_rows);
        let split_done = 4 * max_tokens * cfg.num_key_value_heads;
        (max_tokens * per_token + max_rows * per_row + partial + tiles + split_done) as u64
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
            argmax_best: gpu.zeros(r, "argmax keys")?,
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
            split_done: gpu.zeros(t * cfg.num_key_value_heads, "split attention counters")?,
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
    /// Steps of at most this many tokens run the fused GEMV path ([`gemv_bound`]); 0 runs
    /// every step through cuBLAS and the separate small kernels.
    pub small_step_rows: usize,
}

/// The default of [`Llama::small_step_rows`]: the largest GEMV row bound.
pub const SMALL_STEP_ROWS: usize = GEMV_ROW_BOUNDS[GEMV_ROW_BOUNDS.len() - 1];

/// The GEMV row bound (`kernels/gemv.cu`) a step of `rows` tokens runs its layers with, or
/// `None` for cuBLAS and the separate small kernels.
///
/// Few rows make a projection a matrix-vector product: cuBLAS streams the weights below the
/// memory's rate there, and the norm, RoPE, SiLU and residual kernels around the products
/// each cost a launch for a few microseconds of work. The GEMV path needs at most `limit`
/// rows (the executor's setting; the kernels go up to the largest bound), widths that its
/// 16-byte loads divide (hidden, attention and MLP widths multiples of 8) and the widest
/// staged input (bound rows of the widest K) within `smem_limit` bytes of shared memory.
pub fn gemv_bound(cfg: &LlamaConfig, rows: usize, limit: usize, smem_limit: usize) -> Option<usize> {
    if rows == 0 || rows > limit {
        return None;
    }
    let bound = GEMV_ROW_BOUNDS.iter().copied().find(|&b| b >= rows)?;
    let widths = [cfg.hidden_size, cfg.q_dim(), cfg.intermediate_size];
    if widths.iter().any(|w| !w.is_multiple_of(8)) || !cfg.head_dim.is_multiple_of(2) {
        return None;
    }
    let widest = widths.iter().copied().max().unwrap_or(0);
    (bound * widest * 2 <= smem_limit).then_some(bound)
}

/// Blocks of a GEMV launch over `n` weight rows: one per `warps` row pairs, at most
/// `resident` (as many as the GPU holds at once; at least one).
pub fn gemv_blocks(n: usize, warps: usize, resident: usize) -> usize {
    (n / 2).div_ceil(warps).min(resident.max(1)).max(1)
}

/// One GEMV launch's operands (`gemv.cu`'s arguments, the RoPE ones aside): `y[m][n]` from
/// `src` rows (picked by `rows` where non-zero), `g` the RMSNorm weight of the norm prologue.
struct GemvCall {
    src: u64,
    rows: u64,
    g: u64,
    w: u64,
    y: u64,
    m: usize,
    n: usize,
    k: usize,
    /// This layer's K and V caches, for the QKV projection's epilogue.
    caches: (u64, u64),
    /// The argmax keys of the LM head's epilogue.
    best: u64,
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
        unsafe { b.launch($cfg) }
            .map(|_| ())
            .map_err(|e| CudaError::call(format!("launching {}", $what), e))
            .and_then(|()| $gpu.mark($what))
    }};
}

impl Llama {
    pub fn new(gpu: &Gpu, cfg: LlamaConfig, weights: Weights) -> Result<Llama, CudaError> {
        let freqs = cfg.rope_inv_freq();
        let mut inv_freq = gpu.zeros::<f32>(freqs.len(), "RoPE frequencies")?;
        gpu.upload(&freqs, &mut inv_freq, "RoPE frequencies")?;
        Ok(Llama { cfg, weights, inv_freq, attention: Attention::Tiled, small_step_rows: SMALL_STEP_ROWS })
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

        let split_done = gpu.ptr(&s.split_done, 0);
        // Few tokens: the fused GEMV path, whose projections also normalise, rotate, write KV
        // and add into the residual stream (so `residual` is always the whole stream there).
        let gemv = gemv_bound(cfg, t, self.small_step_rows, k.gemv_smem_limit)
            .and_then(|b| GEMV_ROW_BOUNDS.iter().position(|&x| x == b))
            .map(|i| (&k.gemv[i], GEMV_ROW_BOUNDS[i]));
        let at = |ptr: u64| GemvCall { src: ptr, rows: 0, g: 0, w: 0, y: 0, m: t, n: 0, k: 0, caches: (0, 0), best: 0 };

        let embed = p(&w.embed);
        launch!(gpu, &k.embed, grid(t, 1, 256), "embed"; &ids, &embed, &residual, &hidden)?;
        for (l, lw) in w.layers.iter().enumerate() {
            let (kc, vc) = kv.layer_ptrs(gpu, l);
            if let Some((g, bound)) = gemv {
                let c = GemvCall {
                    g: p(&lw.input_norm),
                    w: p(&lw.qkv),
                    y: qkv,
                    n: cfg.qkv_dim(),
                    k: h,
                    caches: (kc, vc),
                    ..at(residual)
                };
                self.gemv(gpu, &g.qkv_rope, "gemv qkv+norm+rope", bound, c, pos, slots)?;
            } else {
                // Layer 0 only normalises; later layers first add the previous MLP's output.
                let add = i32::from(l > 0);
                self.norm(gpu, &k.add_rmsnorm, t, residual, proj, p(&lw.input_norm), normed, eps, add)?;
                gpu.linear("gemm qkv", normed, p(&lw.qkv), qkv, t, cfg.qkv_dim(), h)?;
                launch!(gpu, &k.rope_kv_write, grid(t, 1, 256), "rope_kv_write";
                    &qkv, &inv_freq, &pos, &slots, &kc, &vc, &nh, &nkv)?;
            }
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
                        &qkv, &kc, &vc, &pos, &tok_seq, &table_start, &tables, &attn, &partial, &split_done,
                        &nh, &nkv, &scale, &splits_i, &first_i)?;
                }
            }
            if let Some((g, bound)) = gemv {
                let c = GemvCall { w: p(&lw.o), y: residual, n: h, k: cfg.q_dim(), ..at(attn) };
                self.gemv(gpu, &g.residual, "gemv o+residual", bound, c, pos, slots)?;
                let c = GemvCall { g: p(&lw.post_norm), w: p(&lw.gate_up), y: act, n: 2 * inter, k: h, ..at(residual) };
                self.gemv(gpu, &g.gate_up, "gemv gate_up+norm+silu", bound, c, pos, slots)?;
                let c = GemvCall { w: p(&lw.down), y: residual, n: h, k: inter, ..at(act) };
                self.gemv(gpu, &g.residual, "gemv down+residual", bound, c, pos, slots)?;
                continue;
            }
            gpu.linear("gemm o", attn, p(&lw.o), proj, t, h, cfg.q_dim())?;
            self.norm(gpu, &k.add_rmsnorm, t, residual, proj, p(&lw.post_norm), normed, eps, 1)?;
            gpu.linear("gemm gate_up", normed, p(&lw.gate_up), gate_up, t, 2 * inter, h)?;
            let total = (t * inter) as i64;
            let inter_i = inter as i32;
            launch!(gpu, &k.silu_mul, grid((t * inter).div_ceil(256), 1, 256), "silu_mul";
                &gate_up, &act, &inter_i, &total)?;
            gpu.linear("gemm down", act, p(&lw.down), proj, t, h, inter)?;
        }
        let (last, logits, argmax) = (p(&s.last), p(&s.logits), gpu.ptr(&s.argmax, 0));
        let vocab = cfg.vocab_size as i32;
        match gemv {
            // The LM head normalises the sampled rows of the (whole) residual stream itself;
            // its row pairs need an even vocabulary.
            Some((g, bound)) if cfg.vocab_size.is_multiple_of(2) => {
                if r == 0 {
                    return Ok(());
                }
                let c = GemvCall {
                    rows,
                    g: p(&w.final_norm),
                    w: p(w.lm_head()),
                    y: logits,
                    m: r,
                    n: cfg.vocab_size,
                    k: h,
                    best: gpu.ptr(&s.argmax_best, 0),
                    ..at(residual)
                };
                self.gemv(gpu, &g.lm_head, "gemv lm_head+norm+argmax", bound, c, pos, slots)?;
                let r_i = r as i32;
                let best = gpu.ptr(&s.argmax_best, 0);
                return launch!(gpu, &k.argmax_finalize, grid(r.div_ceil(256), 1, 256), "argmax_finalize";
                    &best, &argmax, &r_i);
            }
            _ => {
                // On the GEMV path the stream is whole already: normalise without an add.
                let add = i32::from(gemv.is_none());
                self.norm(gpu, &k.add_rmsnorm, t, residual, proj, p(&w.final_norm), normed, eps, add)?;
                if r == 0 {
                    return Ok(());
                }
                launch!(gpu, &k.gather_rows, grid(r, 1, 256), "gather_rows"; &normed, &rows, &last, &hidden)?;
                gpu.linear("gemm lm_head", last, p(w.lm_head()), logits, r, cfg.vocab_size, h)?;
            }
        }
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

    /// Launches GEMV kernel `f` (built for up to `bound` rows) on `c`: a block per 8 row
    /// pairs, `bound` staged input rows of `c.k` bf16 in dynamic shared memory.
    #[allow(clippy::too_many_arguments)] // The call, its kernel and the RoPE inputs.
    fn gemv(
        &self,
        gpu: &Gpu,
        f: &CudaFunction,
        what: &'static str,
        bound: usize,
        c: GemvCall,
        pos: u64,
        slots: u64,
    ) -> Result<(), CudaError> {
        const WARPS: usize = 8;
        let smem = bound * c.k * 2;
        // No more blocks than fit at once: each stages its input rows once and its warps
        // then take row pairs in turn.
        let resident = f
            .occupancy_max_active_blocks_per_multiprocessor(32 * WARPS as u32, smem, None)
            .map_err(|e| CudaError::call(format!("reading the occupancy of {what}"), e))?;
        let blocks = gemv_blocks(c.n, WARPS, resident as usize * gpu.sms);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (32 * WARPS as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (m, n, k) = (c.m as i32, c.n as i32, c.k as i32);
        let (nh, nkv) = (self.cfg.num_attention_heads as i32, self.cfg.num_key_value_heads as i32);
        let (eps, inv_freq) = (self.cfg.rms_norm_eps, gpu.ptr(&self.inv_freq, 0));
        launch!(gpu, f, cfg, what; &c.src, &c.rows, &c.g, &eps, &c.w, &c.y, &m, &n, &k, &inv_freq, &pos, &slots,
            &c.caches.0, &c.caches.1, &nh, &nkv, &c.best)
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

/// Queues a kernel that keeps the GPU busy for `ns` nanoseconds (one thread), so launches
/// queued behind it run back to back when timed one by one.
pub fn delay_gpu(gpu: &Gpu, k: &Kernels, ns: i64) -> Result<(), CudaError> {
    launch!(gpu, &k.delay, grid(1, 1, 1), "delay"; &ns)
}

/// Random weights drawn on the GPU (the `fill_uniform` kernel), for speed runs that need no
/// model files: same shapes and spread as `make-model`, not the same values.
pub fn random_weights(gpu: &Gpu, k: &Kernels, cfg: &LlamaConfig, seed: u64) -> Result<Weights, CudaError> {
    let mut counter = 0u64;
    let mut fill = |n: usize, scale: f32, what: &str| -> Result<CudaSlice<u16>, CudaError> {
        let d = gpu.zeros::<u16>(n, what)?;
        counter += 1;
        let tensor_seed = engine::ids::derive_seed(seed, "gpu-weights", counter);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_of_up_to_four_tokens_take_the_gemv_path_at_the_next_row_bound() {
        let cfg = LlamaConfig::preset("llama-8b").unwrap();
        let h200 = 227 << 10;
        let bounds: Vec<_> = (0..=6).map(|rows| gemv_bound(&cfg, rows, SMALL_STEP_ROWS, h200)).collect();
        assert_eq!(bounds, [None, Some(1), Some(2), Some(4), Some(4), None, None]);
        // The executor's setting caps it; 0 turns the path off.
        assert_eq!(gemv_bound(&cfg, 2, 1, h200), None);
        assert_eq!(gemv_bound(&cfg, 1, 1, h200), Some(1));
        assert_eq!(gemv_bound(&cfg, 1, 0, h200), None);
        // Rows of the MLP's width (14336 bf16, 28 KiB) staged per block: two need 56 KiB,
        // more than a device without the opt-in limit gives.
        assert_eq!(gemv_bound(&cfg, 1, SMALL_STEP_ROWS, 48 << 10), Some(1));
        assert_eq!(gemv_bound(&cfg, 2, SMALL_STEP_ROWS, 48 << 10), None);
        // 16-byte loads need widths that are multiples of 8.
        let odd = LlamaConfig { intermediate_size: 14340, ..cfg.clone() };
        assert_eq!(gemv_bound(&odd, 1, SMALL_STEP_ROWS, h200), None);
        let tiny = LlamaConfig::preset("tiny").unwrap();
        assert_eq!(gemv_bound(&tiny, 3, SMALL_STEP_ROWS, 48 << 10), Some(4));
    }

    #[test]
    fn a_gemv_launch_has_a_block_per_eight_row_pairs_up_to_what_the_gpu_holds() {
        // Llama 3 8B on 132 multiprocessors holding 4 blocks each: the output projection
        // (4096 rows) fits in one pass, gate/up (28672) and the LM head (128256) loop.
        assert_eq!(gemv_blocks(4096, 8, 4 * 132), 256);
        assert_eq!(gemv_blocks(28672, 8, 4 * 132), 528);
        assert_eq!(gemv_blocks(128256, 8, 4 * 132), 528);
        assert_eq!(gemv_blocks(6, 8, 528), 1);
        assert_eq!(gemv_blocks(4096, 8, 0), 1);
    }
}
