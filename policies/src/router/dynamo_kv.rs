//! `dynamo-kv`: NVIDIA Dynamo's KV-aware router (its default worker selector), as a named
//! baseline.
//!
//! # Rule
//!
//! For each candidate, with `B` tokens per block and `overlap` the request's leading blocks
//! the instance holds on its GPU (from the global prefix index, fed by KV events):
//!
//! ```text
//! prefill_blocks = (prefill tokens in flight + prompt_tokens − overlap × B) / B
//! decode_blocks  = blocks in flight + (request_blocks − overlap)
//! cost           = overlap_score_weight × prefill_blocks + decode_blocks     (weight 1 by default)
//! ```
//!
//! The lowest cost wins (temperature 0: argmin, no sampling). Ties go to the instance caching
//! fewer blocks, then to the lowest id.
//!
//! # Where it comes from
//!
//! ai-dynamo/dynamo: `DefaultWorkerSelector::select_worker` (`lib/llm/src/kv_router/scheduler.rs`,
//! now `lib/kv-router/src/scheduling/selector`): `logit = overlap_weight ×
//! potential_prefill_block + decode_block`, where `potential_prefill_block = prefill_tokens /
//! block_size`, `prefill_tokens` = the worker's active (not yet prefilled) tokens plus the
//! request's `isl − overlap × block_size`, and `decode_block` = the worker's active blocks plus
//! the request's blocks not already active there; `softmax_sample` at temperature 0 returns
//! the minimum, and ties go to the smallest indexer tree. Defaults from `KvRouterConfig` and
//! the router docs (`docs/router/kv_cache_routing.md`, `docs/design_docs/router_design.md`):
//! `--kv-overlap-score-weight 1`, `--router-temperature 0`, KV events on.
//!
//! # Mapping onto what our controller knows
//!
//! Dynamo's router counts active blocks and tokens itself (its "slot manager": add on route,
//! mark prefill done on first token, free on completion). Ours has load reports instead, plus
//! what this router routed since each report:
//!
//! - *prefill tokens in flight* = the report's `prefill_tokens_left` (prompt tokens still to
//!   compute, queued or running) + the new prefill tokens (`prompt − overlap × B`) of the
//!   requests this router sent there since that report.
//! - *blocks in flight* = the report's `kv_used_blocks` (blocks held by running requests) +
//!   `ceil(prefill_tokens_left / B)` (the blocks the not yet prefilled prompts will take, which
//!   Dynamo counts from routing on) + the new blocks of the requests sent since the report.
//! - the request's new blocks are `request_blocks − overlap`, with `request_blocks =
//!   ceil(prompt_tokens / B)`: Dynamo subtracts the blocks shared with requests *active* on the
//!   worker; we subtract the GPU overlap (as Dynamo's earlier `process_worker_selection` did).
//! - the tie-break's "tree size" is the report's `kv_cached_blocks`, what the instance's prefix
//!   tree holds, which is what Dynamo's indexer holds for it.
//!
//! # Which tiers count
//!
//! Only L1 (GPU). Dynamo's indexer is fed by the engines' GPU KV events; host and disk tiers
//! (KVBM) are offload targets its default cost does not credit. In our engine L1 is a prefix
//! tree, so the L1 blocks of a prefix are always its first blocks: the overlap is the
//! [`TierMatch::l1`](crate::TierMatch) count.

use super::{CostHints, Pick, Router, RouterFactory, Why};
use crate::event::FleetEvent;
use crate::prefix_index::PrefixMatches;
use crate::view::FleetView;
use engine::{InstanceId, Request};

/// Dynamo's selector settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DynamoKvConfig {
    /// Weight of the prefill term against the decode term (`--kv-overlap-score-weight`).
    pub overlap_score_weight: f64,
}

impl Default for DynamoKvConfig {
    fn default() -> Self {
        DynamoKvConfig { overlap_score_weight: 1.0 }
    }
}

crate::params!(DynamoKvConfig, "dynamo-kv", {
    overlap_score_weight: float from 0.0 ..= 16.0, "weight of the prefill blocks against the decode blocks in the cost";
});

impl RouterFactory for DynamoKvConfig {
    fn build(&self, _seed: u64, hints: &CostHints) -> Box<dyn Router> {
        Box::new(DynamoKv::new(*self, hints.block_size))
    }
}

/// What this router sent to one instance since its last load report (the report cannot know).
#[derive(Clone, Copy, Debug, Default)]
struct SinceReport {
    prefill_tokens: u64,
    blocks: u64,
}

#[derive(Debug)]
pub struct DynamoKv {
    config: DynamoKvConfig,
    /// Tokens per block.
    block_size: u32,
    /// Indexed by instance id; cleared by each load report.
    since_report: Vec<SinceReport>,
    /// Result of the current match, kept to avoid allocating per request.
    matches: PrefixMatches,
    /// What the last pick added to `since_report`, to take back if it is not taken.
    last: SinceReport,
}

impl DynamoKv {
    pub fn new(config: DynamoKvConfig, block_size: u32) -> DynamoKv {
        assert!(block_size > 0, "block size must be positive");
        DynamoKv {
            config,
            block_size,
            since_report: Vec::new(),
            matches: PrefixMatches::default(),
            last: SinceReport::default(),
        }
    }
}

impl Router for DynamoKv {
    fn name(&self) -> &'static str {
        "dynamo-kv"
    }

    fn wants_kv_events(&self) -> bool {
        true
    }

    fn pick(&mut self, request: &Request, fleet: &FleetView) -> Option<Pick> {
        fleet.index().match_prefix(&request.block_hashes, &mut self.matches);
        let b = u64::from(self.block_size);
        let isl = u64::from(request.prompt_tokens);
        let request_blocks = isl.div_ceil(b);

        // (cost, cached blocks, id) of the best candidate so far, its new work, and why.
        let mut best: Option<((f64, u32, u32), SinceReport, Why)> = None;
        for v in fleet.candidates(request) {
            let overlap = u64::from(self.matches.get(v.id).l1).min(request_blocks);
            let sent = self.since_report.get(v.id.0 as usize).copied().unwrap_or_default();
            let new = SinceReport { prefill_tokens: isl.saturating_sub(overlap * b), blocks: request_blocks - overlap };
            let prefill_tokens = v.load.prefill_tokens_left + sent.prefill_tokens + new.prefill_tokens;
            let prefill_blocks = prefill_tokens as f64 / b as f64;
            let decode_blocks =
                u64::from(v.load.kv_used_blocks) + v.load.prefill_tokens_left.div_ceil(b) + sent.blocks + new.blocks;
            let cost = self.config.overlap_score_weight * prefill_blocks + decode_blocks as f64;
            let key = (cost, v.load.kv_cached_blocks, v.id.0);
            let better = best
                .as_ref()
                .is_none_or(|(k, ..)| key.0.total_cmp(&k.0).then(key.1.cmp(&k.1)).then(key.2.cmp(&k.2)).is_lt());
            if better {
                let why = Why::DynamoKv { overlap_blocks: overlap as u32, prefill_blocks, decode_blocks, cost };
                best = Some((key, new, why));
            }
        }
        let ((_, _, id), new, why) = best?;
        let i = id as usize;
        if self.since_report.len() <= i {
            self.since_report.resize(i + 1, SinceReport::default());
        }
        let sent = &mut self.since_report[i];
        sent.prefill_tokens += new.prefill_tokens;
        sent.blocks += new.blocks;
        self.last = new;
        Some(Pick { instance: engine::InstanceId(id), why })
    }

    fn unpick(&mut self, _request: &Request, instance: InstanceId) {
        if let Some(sent) = self.since_report.get_mut(instance.0 as usize) {
            sent.prefill_tokens -= self.last.prefill_tokens;
            sent.blocks -= self.last.blocks;
        }
        self.last = SinceReport::default();
    }

    fn on_event(&mut self, event: &FleetEvent) {
        let instance = match *event {
            FleetEvent::Load { instance, .. }
            | FleetEvent::InstanceUp { instance, .. }
            | FleetEvent::InstanceDown { instance } => instance,
            _ => return,
        };
        if let Some(sent) = self.since_report.get_mut(instance.0 as usize) {
            *sent = SinceReport::default();
        }
    }
}
