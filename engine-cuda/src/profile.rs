//! The executor's step profile: measured iteration times over a grid of batch shapes, which
//! the simulator's cost model is calibrated on (`fleetplane profile`, then `simulate
//! --profile`).
//!
//! Batches are built by hand rather than by the scheduler so that each shape is exactly the
//! one named; their KV blocks hold whatever the pool held (the bytes read are the same as
//! real KV). Each shape runs a few times and keeps the median of the runs after the first
//! two (the first captures a CUDA graph or loads modules, the second settles clocks). Decode
//! steps run as they do when serving: replayed CUDA graphs by batch-size bucket, and every row
//! samples at temperature 1 (the OpenAI API's default) on the GPU.

use super::error::CudaError;
use super::executor::CudaExecutor;
use super::sampling::Sampling;
use engine::batch::{Batch, BatchEntry};
use engine::executor::{Executor, StepOutput};
use engine::ids::{BlockId, RequestId};
use engine::profile::StepSample;

/// How the profile's requests sample: as an OpenAI client does by default.
const SAMPLING: Sampling = Sampling { temperature: 1.0, top_p: 1.0, seed: 0 };

/// One batch shape: `decode_seqs` decode steps at `decode_context` tokens each, plus
/// `prefill_seqs` prompt chunks of `prefill_tokens` tokens after `prefill_context` cached ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub decode_seqs: u32,
    pub decode_context: u32,
    pub prefill_seqs: u32,
    pub prefill_tokens: u32,
    pub prefill_context: u32,
}

impl Shape {
    fn decode(seqs: u32, context: u32) -> Shape {
        Shape { decode_seqs: seqs, decode_context: context, prefill_seqs: 0, prefill_tokens: 0, prefill_context: 0 }
    }

    fn prefill(seqs: u32, tokens: u32, context: u32) -> Shape {
        Shape { prefill_seqs: seqs, prefill_tokens: tokens, prefill_context: context, ..Shape::decode(0, 0) }
    }

    fn tokens(&self) -> u32 {
        self.decode_seqs + self.prefill_seqs * self.prefill_tokens
    }
}

/// Runs per shape; the first [`WARMUP`] are not kept.
pub const RUNS: u32 = 6;
const WARMUP: usize = 2;

/// The grid a serving profile covers, limited to what one step of this executor takes:
/// decode batches from 1 to `max_seqs` at short, medium and long contexts; single prompts
/// from 64 tokens to the step budget, cold and after a cached prefix; several short prompts
/// in one chunk; and chunks from 64 to 2048 tokens mixed with 4 to 64 decodes, as chunked
/// prefill runs them.
pub fn serving_shapes(max_batch_tokens: u32, max_seqs: u32) -> Vec<Shape> {
    let mut shapes = Vec::new();
    for context in [128, 1024, 4096] {
        for seqs in [1, 2, 4, 8, 16, 32, 64, 128, 256] {
            shapes.push(Shape::decode(seqs, context));
        }
    }
    for tokens in [64, 256, 1024, 2048, 4096, 8192] {
        shapes.push(Shape::prefill(1, tokens, 0));
    }
    for context in [2048, 8192] {
        for tokens in [512, 2048] {
            shapes.push(Shape::prefill(1, tokens, context));
        }
    }
    shapes.push(Shape::prefill(4, 512, 0));
    shapes.push(Shape::prefill(16, 128, 0));
    // Most prompt tokens of a serving engine run beside decodes: mixed steps weigh as much
    // as the pure ones.
    for tokens in [64, 256, 1024, 2048] {
        for seqs in [4, 16, 64] {
            shapes.push(Shape { decode_seqs: seqs, decode_context: 1024, ..Shape::prefill(1, tokens, 0) });
        }
    }
    for seqs in [8, 32] {
        shapes.push(Shape { decode_seqs: seqs, decode_context: 4096, ..Shape::prefill(1, 512, 0) });
    }
    shapes.retain(|s| s.tokens() <= max_batch_tokens && s.decode_seqs + s.prefill_seqs <= max_seqs);
    shapes
}

/// Measures every shape that fits the executor's KV pool; shapes that do not fit are
/// skipped and returned apart, so the caller can say so.
pub fn sweep(exec: &mut CudaExecutor, shapes: &[Shape]) -> Result<(Vec<StepSample>, Vec<Shape>), CudaError> {
    let (mut samples, mut skipped) = (Vec::new(), Vec::new());
    let mut out = StepOutput::default();
    let mut next_id = 1u64 << 48;
    let block = exec.block_size();
    for &shape in shapes {
        let decode_blocks = (shape.decode_context + RUNS + 1).div_ceil(block);
        let prefill_blocks = (shape.prefill_context + shape.prefill_tokens).div_ceil(block);
        let needed = u64::from(shape.decode_seqs) * u64::from(decode_blocks)
            + u64::from(shape.prefill_seqs) * u64::from(prefill_blocks);
        if needed > u64::from(exec.kv_blocks()) {
            skipped.push(shape);
            continue;
        }
        // Sequences, each with its own run of blocks: decodes first, then prompts.
        let mut seqs = Vec::new();
        for i in 0..shape.decode_seqs + shape.prefill_seqs {
            next_id += 1;
            let prefill = i >= shape.decode_seqs;
            seqs.push((RequestId(next_id), prefill));
        }
        for &(id, prefill) in &seqs {
            if !prefill {
                exec.set_request(id, vec![7; shape.decode_context as usize + 1], SAMPLING);
            }
        }
        let mut times = Vec::with_capacity(RUNS as usize);
        let mut batch = Batch::default();
        for _ in 0..RUNS {
            batch.clear();
            let mut first = 0u32;
            for &(id, prefill) in &seqs {
                let (entry_blocks, entry) = if prefill {
                    // The same chunk each run: register the prompt afresh (a finished chunk
                    // appended its sampled token).
                    let len = shape.prefill_context + shape.prefill_tokens;
                    exec.set_request(id, vec![3; len as usize], SAMPLING);
                    (prefill_blocks, BatchEntry::new(id, shape.prefill_context, shape.prefill_tokens, true))
                } else {
                    let len = exec.tokens(id).map_or(0, <[u32]>::len) as u32;
                    (decode_blocks, BatchEntry::new(id, len.saturating_sub(1), 1, false))
                };
                let start = batch.block_tables.len() as u32;
                batch.block_tables.extend((first..first + entry_blocks).map(BlockId));
                first += entry_blocks;
                let entry = BatchEntry { blocks: (start, batch.block_tables.len() as u32), ..entry };
                batch.stats.add(&entry);
                batch.entries.push(entry);
            }
            out.tokens.clear();
            let d = exec.execute(&batch, &mut out).map_err(|e| CudaError::Batch(e.to_string()))?;
            times.push(d.as_secs_f64());
        }
        for &(id, _) in &seqs {
            exec.release(id);
        }
        // The decodes' contexts grew by one a run: record the middle run's shape.
        let mut kept = times.split_off(WARMUP);
        kept.sort_by(f64::total_cmp);
        let mut stats = batch.stats;
        let back = u64::from(RUNS) / 2;
        stats.decode_context_tokens = stats.decode_context_tokens.saturating_sub(back * u64::from(shape.decode_seqs));
        samples.push(StepSample::new(&stats, kept[kept.len() / 2]));
    }
    Ok((samples, skipped))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_serving_grid_stays_within_one_step() {
        let shapes = serving_shapes(8192, 256);
        assert!(shapes.len() > 50, "{}", shapes.len());
        assert!(shapes.iter().all(|s| s.tokens() <= 8192 && s.decode_seqs + s.prefill_seqs <= 256));
        let small = serving_shapes(2048, 64);
        assert!(small.iter().all(|s| s.tokens() <= 2048 && s.decode_seqs + s.prefill_seqs <= 64));
        assert!(small.iter().any(|s| s.prefill_seqs > 0 && s.decode_seqs > 0), "mixed shapes kept");
    }
}
