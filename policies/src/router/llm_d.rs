//! `llm-d`: the llm-d inference scheduler's default scoring profile, as a named baseline.
//!
//! # Rule
//!
//! Each candidate gets three scores in [0, 1], and the highest weighted sum wins:
//!
//! ```text
//! score = 3 × prefix + 2 × queue + 2 × kv
//! prefix = matched prefix blocks / request blocks      (prefix-cache-scorer)
//! queue  = (max_waiting − waiting) / (max_waiting − min_waiting) over the candidates,
//!          1 when all wait equally                      (queue-scorer)
//! kv     = 1 − kv_used_blocks / kv_total_blocks         (kv-cache-utilization-scorer)
//! ```
//!
//! Equal top scores are broken at random (a ChaCha generator seeded from the run's seed).
//!
//! # Where it comes from
//!
//! - The weights: the default `EndpointPickerConfig` scheduling profile that llm-d deploys
//!   (`default-plugins.yaml` of the endpoint picker, rendered by the gateway-api-inference-
//!   extension `inferencepool` Helm chart): `queue-scorer` 2, `kv-cache-utilization-scorer` 2,
//!   `prefix-cache-scorer` 3, then `max-score-picker`.
//! - The scorers: kubernetes-sigs/gateway-api-inference-extension, `pkg/epp/scheduling/
//!   framework/plugins/scorer/queue.go` (min-max over `WaitingQueueSize`, vLLM's
//!   `num_requests_waiting`), `kvcache_utilization.go` (`1 − KVCacheUsagePercent`, vLLM's
//!   `kv_cache_usage_perc`: blocks held by running requests over all blocks), and
//!   `multi/prefix/plugin.go` (`matchLen / len(hashes)`). The profile clamps each score to
//!   [0, 1] and sums `score × weight`; `max-score-picker` shuffles before sorting, so ties go
//!   to a random endpoint.
//! - Tier weights: llm-d-kv-cache-manager's `DefaultKVCacheBackendConfig` (`gpu` 1.0, `cpu`
//!   0.8), the precise prefix scorer's weights for blocks held in each medium.
//!
//! # Adaptations
//!
//! - **The prefix index is the KV-event one.** llm-d's default `prefix-cache-scorer` guesses
//!   each pod's cache from its own routing decisions; its `precise-prefix-cache-scorer` reads
//!   vLLM KV events, as our global prefix index does. We keep the default scorer's
//!   normalization (fraction of the request's blocks) over the precise data; the precise
//!   scorer instead min-max normalizes block hits across pods, which turns any difference
//!   (one block against none) into 1 against 0. The default scorer caps a request at 256
//!   hashed blocks; we count all of the request's blocks.
//! - **Tiers.** Matched blocks are weighted by where the instance holds them: L1 (GPU) 1.0,
//!   L2 (host) 0.8, L3 0. Our L3 is a store every instance reads; llm-d's index attributes an
//!   offloaded block to the pod that wrote it, so it has no equivalent, and giving every
//!   instance the same credit would not tell them apart. Our index counts a prefix through
//!   positions only L3 holds; llm-d's longest-prefix walk would stop there, so an L2 block
//!   after such a gap counts here and not there (L1 blocks are always a prefix's first).
//! - **Staleness.** Queue and KV usage come from the last load report, as the endpoint picker
//!   reads the last metrics scrape; requests routed since are not counted by either.
//! - **No filters** of llm-d's own. The candidates are those of
//!   [`FleetView::candidates`]: serving instances that can hold the request, without those
//!   that paused admission unless all did.

use super::{CostHints, Pick, Router, RouterFactory, Why};
use crate::prefix_index::PrefixMatches;
use crate::view::{FleetView, InstanceView};
use engine::Request;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The scoring profile.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlmDConfig {
    pub prefix_weight: f64,
    pub queue_weight: f64,
    pub kv_weight: f64,
    /// Credit for a matched block held in L1, L2 and L3.
    pub l1_weight: f64,
    pub l2_weight: f64,
    pub l3_weight: f64,
}

impl Default for LlmDConfig {
    fn default() -> Self {
        LlmDConfig {
            prefix_weight: 3.0,
            queue_weight: 2.0,
            kv_weight: 2.0,
            l1_weight: 1.0,
            l2_weight: 0.8,
            l3_weight: 0.0,
        }
    }
}

crate::params!(LlmDConfig, "llm-d", {
    prefix_weight: float from 0.0 ..= 16.0, "weight of the prefix-cache scorer";
    queue_weight: float from 0.0 ..= 16.0, "weight of the queue scorer";
    kv_weight: float from 0.0 ..= 16.0, "weight of the KV-cache-utilization scorer";
    l1_weight: float from 0.0 ..= 1.0, "prefix credit of a matched block held in GPU memory (L1)";
    l2_weight: float from 0.0 ..= 1.0, "prefix credit of a matched block held in host memory (L2)";
    l3_weight: float from 0.0 ..= 1.0, "prefix credit of a matched block held only in the shared store (L3)";
});

impl RouterFactory for LlmDConfig {
    fn build(&self, seed: u64, _hints: &CostHints) -> Box<dyn Router> {
        Box::new(LlmD::new(*self, engine::ids::derive_seed(seed, "llm-d", 0)))
    }
}

#[derive(Debug)]
pub struct LlmD {
    config: LlmDConfig,
    /// Breaks ties between equal top scores.
    rng: ChaCha8Rng,
    /// Result of the current match, kept to avoid allocating per request.
    matches: PrefixMatches,
    /// Candidates sharing the top score (kept to avoid allocating per request).
    ties: Vec<(u32, Why)>,
}

impl LlmD {
    pub fn new(config: LlmDConfig, seed: u64) -> LlmD {
        LlmD { config, rng: ChaCha8Rng::seed_from_u64(seed), matches: PrefixMatches::default(), ties: Vec::new() }
    }
}

/// vLLM's KV usage: blocks held by running requests over all blocks; 0 before any report.
fn kv_usage(v: &InstanceView) -> f64 {
    match v.load.kv_total_blocks {
        0 => 0.0,
        total => f64::from(v.load.kv_used_blocks) / f64::from(total),
    }
}

impl Router for LlmD {
    fn name(&self) -> &'static str {
        "llm-d"
    }

    fn wants_kv_events(&self) -> bool {
        true
    }

    fn pick(&mut self, request: &Request, fleet: &FleetView) -> Option<Pick> {
        let (mut min_waiting, mut max_waiting) = (u32::MAX, 0);
        for v in fleet.candidates(request) {
            min_waiting = min_waiting.min(v.load.waiting);
            max_waiting = max_waiting.max(v.load.waiting);
        }
        let hashes = &request.block_hashes;
        fleet.index().match_prefix(hashes, &mut self.matches);
        let c = self.config;
        let mut best = f64::NEG_INFINITY;
        self.ties.clear();
        for v in fleet.candidates(request) {
            let m = self.matches.get(v.id);
            let prefix_score = match hashes.len() {
                0 => 0.0,
                n => {
                    (c.l1_weight * f64::from(m.l1) + c.l2_weight * f64::from(m.l2) + c.l3_weight * f64::from(m.l3))
                        / n as f64
                }
            }
            .clamp(0.0, 1.0);
            let queue_score = match max_waiting - min_waiting {
                0 => 1.0,
                spread => f64::from(max_waiting - v.load.waiting) / f64::from(spread),
            };
            let kv_usage = kv_usage(v);
            let kv_score = (1.0 - kv_usage).clamp(0.0, 1.0);
            let score = c.prefix_weight * prefix_score + c.queue_weight * queue_score + c.kv_weight * kv_score;
            if score < best {
                continue;
            }
            if score > best {
                best = score;
                self.ties.clear();
            }
            let why = Why::LlmD {
                matched_blocks: [m.l1, m.l2, m.l3],
                waiting: v.load.waiting,
                kv_usage,
                prefix_score,
                queue_score,
                kv_score,
                score,
            };
            self.ties.push((v.id.0, why));
        }
        let k = match self.ties.len() {
            0 => return None,
            1 => 0,
            n => self.rng.random_range(0..n),
        };
        let (id, why) = self.ties.swap_remove(k);
        Some(Pick { instance: engine::InstanceId(id), why })
    }
}
