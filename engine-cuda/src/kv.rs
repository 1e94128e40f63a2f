//! Paged KV memory on the GPU, and the translation of a batch's block tables into the
//! per-token arrays the kernels read.
//!
//! The pool holds `num_blocks` blocks of `block_size` token slots for every layer, indexed by
//! the engine's [`BlockId`]: the engine's KV manager decides which block holds which tokens
//! (prefix sharing included), and this module only stores them. Layout per layer and per
//! K or V: `[num_blocks * block_size][n_kv_heads][head_dim]` bf16, so slot `b * block_size + o`
//! is offset `o` of block `b`.

use super::config::LlamaConfig;
use super::context::Gpu;
use super::error::CudaError;
use super::kernels::Kernels;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use engine::batch::Batch;
use engine::ids::RequestId;

/// The KV cache of every layer.
pub struct KvPool {
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    /// Elements of one layer's K (or V) cache.
    layer_elems: usize,
    /// Layers, and KV heads per slot row (a row is `n_kv * head_dim` elements).
    layers: usize,
    n_kv: usize,
    pub num_blocks: u32,
    pub block_size: u32,
}

impl KvPool {
    /// Bytes one block takes over all layers, K and V.
    pub fn bytes_per_block(cfg: &LlamaConfig, block_size: u32) -> u64 {
        2 * 2 * cfg.num_hidden_layers as u64 * u64::from(block_size) * cfg.kv_dim() as u64
    }

    /// `num_blocks` blocks for the engine, plus the padding block (so `num_blocks + 1` are
    /// allocated: budget for them).
    pub fn new(gpu: &Gpu, cfg: &LlamaConfig, num_blocks: u32, block_size: u32) -> Result<KvPool, CudaError> {
        let layer_elems = (num_blocks as usize + 1) * block_size as usize * cfg.kv_dim();
        let total = layer_elems * cfg.num_hidden_layers;
        Ok(KvPool {
            k: gpu.zeros(total, "the K cache")?,
            v: gpu.zeros(total, "the V cache")?,
            layer_elems,
            layers: cfg.num_hidden_layers,
            n_kv: cfg.num_key_value_heads,
            num_blocks,
            block_size,
        })
    }

    /// The block padding rows write their KV to: never in an engine block table.
    pub fn pad_block(&self) -> u32 {
        self.num_blocks
    }

    /// Device addresses of layer `layer`'s K and V caches.
    pub fn layer_ptrs(&self, gpu: &Gpu, layer: usize) -> (u64, u64) {
        (gpu.ptr(&self.k, layer * self.layer_elems), gpu.ptr(&self.v, layer * self.layer_elems))
    }

    /// The whole K and V caches on the host, and the elements per layer (tests compare the
    /// copy kernels with the host layout).
    #[cfg(test)]
    pub(crate) fn to_host(&self, gpu: &Gpu) -> Result<(Vec<u16>, Vec<u16>, usize), CudaError> {
        let (mut k, mut v) = (vec![0; self.k.len()], vec![0; self.v.len()]);
        gpu.download(&self.k, &mut k, "the K cache")?;
        gpu.download(&self.v, &mut v, "the V cache")?;
        Ok((k, v, self.layer_elems))
    }

    /// Copies the KV of tokens `first..first + tokens` of a sequence whose block table (on the
    /// device) is `table`, every layer's K and V, into `buf` as hand-off rows
    /// ([`super::transfer`]'s body layout, from the chunk's first token). Queued on the stream;
    /// the caller checked the table against the pool and `buf`'s size.
    pub fn gather(
        &self,
        gpu: &Gpu,
        kernels: &Kernels,
        copy: &KvCopy,
        buf: &mut CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        let (cfg, args) = copy.launch(self)?;
        let mut b = gpu.stream.launch_builder(&kernels.kv_gather);
        b.arg(&self.k).arg(&self.v).arg(copy.table).arg(&args.0).arg(&args.1).arg(&args.2).arg(buf);
        // SAFETY: every slot the grid reads is in the pool (the tables were checked against
        // `num_blocks`) and `buf` holds the chunk's rows (checked by the caller).
        #[allow(unsafe_code)]
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| CudaError::call("launching kv_gather", e))
    }

    /// The reverse of [`KvPool::gather`]: writes hand-off rows from `buf` into the slots of
    /// tokens `first..first + tokens` of the sequence whose block table is `table`.
    pub fn scatter(
        &mut self,
        gpu: &Gpu,
        kernels: &Kernels,
        copy: &KvCopy,
        buf: &CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        let (cfg, args) = copy.launch(self)?;
        let mut b = gpu.stream.launch_builder(&kernels.kv_scatter);
        b.arg(&mut self.k).arg(&mut self.v).arg(copy.table).arg(&args.0).arg(&args.1).arg(&args.2).arg(buf);
        // SAFETY: as for `gather`; the slots written are the sequence's own blocks.
        #[allow(unsafe_code)]
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| CudaError::call("launching kv_scatter", e))
    }
}

/// One chunk of a KV hand-off copy: tokens `first..first + tokens` of the sequence whose
/// block table (on the device) is `table`.
pub struct KvCopy<'a> {
    pub table: &'a CudaSlice<i32>,
    pub first: u32,
    pub tokens: u32,
}

impl KvCopy<'_> {
    /// The grid (a block per token, layer and K or V; a thread per 16 bytes of a row, up to
    /// 256) and the kernels' scalar arguments: first token, elements per layer, KV heads.
    fn launch(&self, pool: &KvPool) -> Result<(LaunchConfig, (i32, i64, i32)), CudaError> {
        let first = i32::try_from(self.first)
            .map_err(|_| CudaError::Batch(format!("token {} is too far for a KV copy", self.first)))?;
        let layers = u32::try_from(pool.layers).ok().filter(|&l| l <= 65_535);
        let layers = layers.ok_or_else(|| CudaError::Batch(format!("{} layers exceed a grid", pool.layers)))?;
        let row_elems = pool.layer_elems / ((pool.num_blocks as usize + 1) * pool.block_size as usize);
        let threads = ((row_elems / 8).div_ceil(32) * 32).clamp(32, 256) as u32;
        let cfg = LaunchConfig { grid_dim: (self.tokens, layers, 2), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        Ok((cfg, (first, pool.layer_elems as i64, pool.n_kv as i32)))
    }
}

/// One step's batch flattened for the kernels: token `t` of the step belongs to entry
/// `tok_seq[t]` and sits at `positions[t]` of its sequence, its KV goes to `slots[t]`, and its
/// attention reads the entry's block table at `block_tables[table_start[tok_seq[t]]..]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepLayout {
    pub token_ids: Vec<u32>,
    pub positions: Vec<i32>,
    pub slots: Vec<i64>,
    pub tok_seq: Vec<i32>,
    pub table_start: Vec<i32>,
    pub block_tables: Vec<i32>,
    /// Step tokens whose logits are sampled: the last token of each entry that completes its
    /// prompt or decodes, in entry order (the order of `StepOutput::tokens`).
    pub logit_rows: Vec<u32>,
    /// The batch entry of each logit row.
    pub emitting: Vec<usize>,
    /// Tokens at the start of the step that are decode steps (the scheduler puts decodes
    /// first): attention splits their long contexts over the GPU even when a prefill chunk
    /// shares the step.
    pub leading_decodes: usize,
    /// The query tiles of the tiled prefill attention kernel, as (first step token, rows)
    /// pairs: every token after the leading decodes, each entry's tokens cut into runs of at
    /// most [`PREFILL_TILE_ROWS`], heaviest first ([`plan_prefill_tiles`]).
    pub prefill_tiles: Vec<i32>,
}

/// Query rows of one tile of the tiled prefill attention kernel (`prefill_attention_tc`:
/// four warps of 16 rows).
pub const PREFILL_TILE_ROWS: usize = 64;

/// Cuts runs of step tokens into the tiled prefill attention kernel's query tiles. Each run is
/// `(first, len, context)`: `len` consecutive step tokens of one sequence at positions
/// `context ..  context + len`. A tile is at most [`PREFILL_TILE_ROWS`] tokens of one run;
/// tiles come as flat (first, rows) pairs ordered by the keys they attend to, most first
/// (ties by token order), so the GPU starts the longest blocks first and ends on short ones.
pub fn plan_prefill_tiles(runs: &[(usize, usize, usize)]) -> Vec<i32> {
    let mut tiles: Vec<(usize, usize, usize)> = Vec::new();
    for &(first, len, context) in runs {
        for start in (0..len).step_by(PREFILL_TILE_ROWS) {
            let rows = PREFILL_TILE_ROWS.min(len - start);
            // Keys the tile's last row attends to: its position + 1.
            tiles.push((context + start + rows, first + start, rows));
        }
    }
    tiles.sort_by_key(|&(keys, first, _)| (std::cmp::Reverse(keys), first));
    tiles.iter().flat_map(|&(_, first, rows)| [first as i32, rows as i32]).collect()
}

impl StepLayout {
    /// Flattens `batch`. `tokens(id)` is the request's sequence so far (prompt, then every
    /// generated token): a prefill chunk computes `tokens[context..context + new]` and samples
    /// when it reaches the end of the sequence (the prompt, or after a preemption the prompt
    /// and the output so far); a decode step computes the last token.
    pub fn build<'a>(
        batch: &Batch,
        block_size: u32,
        num_blocks: u32,
        tokens: impl Fn(RequestId) -> Option<&'a [u32]>,
    ) -> Result<StepLayout, String> {
        let mut l = StepLayout::default();
        let bs = block_size as usize;
        let mut runs = Vec::new();
        for (s, e) in batch.entries.iter().enumerate() {
            let seq =
                tokens(e.request).ok_or_else(|| format!("{} has no token ids (set_request not called)", e.request))?;
            if e.load_tokens != [0, 0] {
                return Err(format!(
                    "{} needs KV loaded from host memory or the shared store, which this executor does not hold",
                    e.request
                ));
            }
            let (ctx, new) = (e.context_tokens as usize, e.new_tokens as usize);
            if new == 0 || ctx + new > seq.len() || (!e.is_prefill && (new != 1 || ctx + 1 != seq.len())) {
                return Err(format!(
                    "{}: entry computes tokens {ctx}..{} ({}) but the sequence has {} tokens",
                    e.request,
                    ctx + new,
                    if e.is_prefill { "prefill" } else { "decode" },
                    seq.len()
                ));
            }
            let table = batch.block_table(e);
            if table.len() * bs < ctx + new {
                return Err(format!("{}: {} blocks cannot hold {} tokens", e.request, table.len(), ctx + new));
            }
            if let Some(b) = table.iter().find(|b| b.0 >= num_blocks) {
                return Err(format!("{}: block {} is outside the pool of {num_blocks}", e.request, b.0));
            }
            l.table_start.push(l.block_tables.len() as i32);
            l.block_tables.extend(table.iter().map(|b| b.0 as i32));
            for p in ctx..ctx + new {
                l.token_ids.push(seq[p]);
                l.positions.push(p as i32);
                l.slots.push(i64::from(table[p / bs].0) * bs as i64 + (p % bs) as i64);
                l.tok_seq.push(s as i32);
            }
            if !e.is_prefill || ctx + new == seq.len() {
                l.logit_rows.push((l.token_ids.len() - 1) as u32);
                l.emitting.push(s);
            }
            if !e.is_prefill && l.leading_decodes + 1 == l.token_ids.len() {
                l.leading_decodes += 1;
            } else {
                runs.push((l.token_ids.len() - new, new, ctx));
            }
        }
        l.prefill_tiles = plan_prefill_tiles(&runs);
        Ok(l)
    }

    pub fn tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Rounds a decode-only layout (one token and one sampled row per entry) up to `rows`
    /// rows, so that a CUDA graph captured for `rows` can run it: each padding row is token 0
    /// at position 0 of a sequence of its own whose one-block table is `pad_block`, so it
    /// writes its KV there, attends only to itself and touches no real sequence's KV. Its
    /// sampled row comes after every real one, so `emitting` is unchanged.
    pub fn pad_decode(&mut self, rows: usize, pad_block: u32, block_size: u32) -> Result<(), String> {
        let n = self.tokens();
        if self.logit_rows.len() != n || self.table_start.len() != n || rows < n {
            return Err(format!("cannot pad a step of {n} tokens to {rows} decode rows"));
        }
        if rows == n {
            return Ok(());
        }
        let table = self.block_tables.len() as i32;
        self.block_tables.push(pad_block as i32);
        for k in n..rows {
            self.token_ids.push(0);
            self.positions.push(0);
            self.slots.push(i64::from(pad_block) * i64::from(block_size));
            self.tok_seq.push(k as i32);
            self.table_start.push(table);
            self.logit_rows.push(k as u32);
        }
        self.leading_decodes = rows;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::batch::BatchEntry;
    use engine::ids::BlockId;

    fn batch(entries: &[(u64, u32, u32, bool, &[u32])]) -> Batch {
        let mut b = Batch::default();
        for &(id, ctx, new, prefill, table) in entries {
            let start = b.block_tables.len() as u32;
            b.block_tables.extend(table.iter().map(|&x| BlockId(x)));
            let mut e = BatchEntry::new(RequestId(id), ctx, new, prefill);
            e.blocks = (start, b.block_tables.len() as u32);
            b.entries.push(e);
        }
        b
    }

    #[test]
    fn a_chunk_over_a_cached_prefix_and_a_decode_map_to_slots_through_their_tables() {
        // Request 1: 6 tokens, 4 cached in block 7, this chunk computes tokens 4 and 5 (block 3)
        // and ends the prompt. Request 2: decoding its 3rd token (position 2) in block 9.
        let seqs = [vec![10, 11, 12, 13, 14, 15], vec![20, 21, 22]];
        let b = batch(&[(1, 4, 2, true, &[7, 3]), (2, 2, 1, false, &[9])]);
        let l = StepLayout::build(&b, 4, 16, |id| Some(&seqs[id.0 as usize - 1][..])).unwrap();
        assert_eq!(l.token_ids, [14, 15, 22]);
        assert_eq!(l.positions, [4, 5, 2]);
        assert_eq!(l.slots, [12, 13, 38]);
        assert_eq!(l.tok_seq, [0, 0, 1]);
        assert_eq!(l.table_start, [0, 2]);
        assert_eq!(l.block_tables, [7, 3, 9]);
        assert_eq!(l.logit_rows, [1, 2]);
        assert_eq!(l.emitting, [0, 1]);
    }

    #[test]
    fn a_prefill_chunk_short_of_the_prompt_end_samples_nothing() {
        let seqs = [vec![1, 2, 3, 4, 5]];
        let b = batch(&[(1, 0, 3, true, &[0, 1])]);
        let l = StepLayout::build(&b, 2, 4, |_| Some(&seqs[0][..])).unwrap();
        assert!(l.logit_rows.is_empty());
        assert_eq!(l.slots, [0, 1, 2]);
    }

    #[test]
    fn prefill_tiles_cover_every_token_after_the_leading_decodes_longest_first() {
        // Two decodes lead; then a 150-token chunk over a 70-token cached prefix, a
        // non-leading decode and a 5-token prompt.
        let long: Vec<u32> = (0..220).collect();
        let seqs = [vec![1, 2, 3], vec![4, 5], long, vec![6; 9], vec![7; 5]];
        let b = batch(&[
            (1, 2, 1, false, &[0]),
            (2, 1, 1, false, &[1]),
            (3, 70, 150, true, &[2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]),
            (4, 8, 1, false, &[16]),
            (5, 0, 5, true, &[17]),
        ]);
        let l = StepLayout::build(&b, 16, 32, |id| Some(&seqs[id.0 as usize - 1][..])).unwrap();
        assert_eq!(l.leading_decodes, 2);
        // Tokens 2..152 are the chunk (positions 70..220), 152 the decode (position 8),
        // 153..158 the prompt. Keys per tile: 220, 198, 134, 9, 5.
        assert_eq!(l.prefill_tiles, [130, 22, 66, 64, 2, 64, 152, 1, 153, 5]);
        let rows: i32 = l.prefill_tiles.chunks(2).map(|t| t[1]).sum();
        assert_eq!(rows as usize, l.tokens() - l.leading_decodes);
        // A decode-only step has no prefill tiles.
        let d = batch(&[(1, 2, 1, false, &[0])]);
        assert!(StepLayout::build(&d, 16, 32, |_| Some(&seqs[0][..])).unwrap().prefill_tiles.is_empty());
    }

    #[test]
    fn prefill_tiles_of_an_exact_multiple_are_full() {
        assert_eq!(plan_prefill_tiles(&[(0, 128, 0)]), [64, 64, 0, 64]);
        assert_eq!(plan_prefill_tiles(&[(3, 1, 40), (4, 64, 0)]), [4, 64, 3, 1]);
        assert!(plan_prefill_tiles(&[]).is_empty());
    }

    #[test]
    fn padding_a_decode_step_adds_rows_that_touch_only_the_pad_block() {
        let seqs = [vec![1, 2, 3], vec![4, 5]];
        let b = batch(&[(1, 2, 1, false, &[5]), (2, 1, 1, false, &[6])]);
        let mut l = StepLayout::build(&b, 4, 16, |id| Some(&seqs[id.0 as usize - 1][..])).unwrap();
        l.pad_decode(4, 16, 4).unwrap();
        assert_eq!(l.token_ids, [3, 5, 0, 0]);
        assert_eq!(l.positions, [2, 1, 0, 0]);
        assert_eq!(l.slots, [22, 25, 64, 64]);
        assert_eq!(l.tok_seq, [0, 1, 2, 3]);
        assert_eq!(l.table_start, [0, 1, 2, 2]);
        assert_eq!(l.block_tables, [5, 6, 16]);
        assert_eq!(l.logit_rows, [0, 1, 2, 3]);
        assert_eq!(l.emitting, [0, 1]);
        assert_eq!(l.leading_decodes, 4);
        // A prefill chunk of several tokens is not a decode step.
        let p = batch(&[(1, 0, 3, true, &[5])]);
        let mut l = StepLayout::build(&p, 4, 16, |_| Some(&seqs[0][..])).unwrap();
        assert!(l.pad_decode(4, 16, 4).is_err());
    }

    #[test]
    fn inconsistent_entries_are_refused_with_the_request_named() {
        let seqs = [vec![1, 2, 3]];
        let check = |b: Batch, want: &str| {
            let err = StepLayout::build(&b, 2, 4, |id| (id.0 == 1).then(|| &seqs[0][..])).unwrap_err();
            assert!(err.contains(want), "{err:?} should mention {want:?}");
        };
        check(batch(&[(2, 0, 1, true, &[0])]), "req-2 has no token ids");
        check(batch(&[(1, 0, 4, true, &[0, 1])]), "sequence has 3 tokens");
        check(batch(&[(1, 1, 1, false, &[0])]), "decode");
        check(batch(&[(1, 0, 3, true, &[0])]), "1 blocks cannot hold 3 tokens");
        check(batch(&[(1, 0, 3, true, &[0, 4])]), "block 4 is outside the pool");
    }
}
