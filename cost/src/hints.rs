//! What the controller and its routers may assume of an instance's speed, read off its cost
//! model: the simulator, `serve`'s pools and the live fleet's routers take them from here.

use crate::roofline::CostModel;
use engine::{BatchEntry, BatchStats, InstanceConfig, RequestId};
use policies::{CostHints, DecodeModel};

/// What routers may assume of an instance's speed, from the cost model: prefill throughput
/// at a full token budget, and KV load rates from the lower tiers.
pub fn cost_hints(cost: &CostModel, instance: &InstanceConfig) -> CostHints {
    let mut chunk = BatchStats::default();
    chunk.add(&BatchEntry::new(RequestId(0), 0, instance.max_batch_tokens, true));
    let bytes = cost.kv_bytes_per_token_per_gpu() as f64;
    let links = cost.links();
    CostHints {
        block_size: instance.block_size,
        prefill_tokens_per_s: f64::from(instance.max_batch_tokens) / cost.step_time(&chunk).as_secs_f64(),
        l2_tokens_per_s: links.l2_bytes_per_s / bytes,
        l3_tokens_per_s: links.l3_bytes_per_s / bytes,
        max_batch_tokens: instance.max_batch_tokens,
        decode: decode_model(cost),
    }
}

/// The decode step's growth with batch size and KV, read off the cost model at three points
/// (a lone short sequence, 64 short ones, one with 64K tokens of context).
pub fn decode_model(cost: &CostModel) -> DecodeModel {
    let step_us = |seqs: u32, context: u32| {
        let mut stats = BatchStats::default();
        for i in 0..seqs {
            stats.add(&BatchEntry::new(RequestId(u64::from(i)), context, 1, false));
        }
        cost.step_time(&stats).0 as f64
    };
    let base = step_us(1, 1);
    DecodeModel {
        base_us: base,
        per_seq_us: ((step_us(64, 1) - base) / 63.0).max(0.0),
        per_kv_token_us: ((step_us(1, 65_536) - base) / 65_535.0).max(0.0),
    }
}
