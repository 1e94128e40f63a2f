//! `cache-aware`: the instance with the lowest predicted time to first token.
//!
//! For each candidate instance `i`, from the global prefix index (KV events only) and the
//! last load report:
//!
//! ```text
//! queue_s(i)  = (prefill tokens left in i's report + prefill routed to i since) / R
//! suffix_s(i) = (prompt − cached prefix on i, all tiers) / R
//! load_s(i)   = L2 tokens on i / R_L2 + L3 tokens / R_L3
//! kv_s(i)     = KV_WEIGHT × tokens of KV i's requests hold / R
//! copy_s(i)   = COPY_WEIGHT × (prompt − prefix held by i in L1 or L2) / R
//! ttft(i)     = queue_s(i) + max(suffix_s(i), load_s(i)) + kv_s(i) + copy_s(i)
//! ```
//!
//! `R` is the instance's prefill rate and `R_L2`, `R_L3` its load rates from the lower tiers
//! ([`CostHints`]); the load overlaps the suffix's compute (layer-wise loading), hence the max.
//! The prefill routed since the report counts only the uncached tokens this router predicted.
//! `kv_s` is not time the request waits but the load the instance has taken on: without it,
//! an instance holding a hot conversation keeps winning on prefix until its decodes fill
//! its KV and preempt (measured on the Mooncake trace: docs/KV-TIERS.md).
//!
//! `copy_s` is not time the request waits either: it is what placing the prompt away from
//! its prefix costs the fleet later. L1 and L2 are per instance; a prompt sent where its
//! prefix sits only in L3 (or nowhere) makes one more copy of it in that instance's GPU and
//! host memory, so the fleet's per-instance tiers hold fewer distinct prefixes, later
//! requests load more from L3 (longer steps) and KV fills sooner. Without it, the router
//! spread a hot prefix over every instance whenever queues differed by a few hundred
//! milliseconds (docs/KV-TIERS.md has the numbers).
//!
//! Guard against piling onto one hot instance: the prediction only sees prefill. An
//! instance whose requests in flight exceed `HOT_FACTOR` × the fleet's mean plus
//! `HOT_SLACK` is passed over (unless every candidate is). Ties go to the lower id. (A
//! second guard, passing over instances whose KV would be 95% full, was dropped: near
//! saturation it sent requests away from their prefix into the same KV pressure elsewhere,
//! and cost 1 to 30 points of SLO attainment on the Mooncake trace; `kv_s` weighs KV in.)
//!
//! The parameters and their reasons are in docs/ROUTERS.md.

use super::{CostHints, Pick, Router, Why};
use crate::fleet::FleetEvent;
use crate::prefix_index::{PrefixMatches, TierMatch};
use crate::view::{FleetView, InstanceView};
use engine::Request;

/// In-flight requests above this multiple of the mean (plus the slack) make an instance hot.
pub const HOT_FACTOR: f64 = 2.0;
pub const HOT_SLACK: f64 = 8.0;
/// Weight of the KV held by an instance's requests, in prefill-seconds per token.
pub const KV_WEIGHT: f64 = 0.25;
/// Weight of the prompt tokens an instance would newly hold (not in its L1 or L2), in
/// prefill-seconds per token.
pub const COPY_WEIGHT: f64 = 4.0;

#[derive(Debug)]
pub struct CacheAware {
    hints: CostHints,
    matches: PrefixMatches,
    /// Uncached prompt tokens routed to each instance since its last load report.
    pending: Vec<u64>,
}

/// One candidate's terms, in seconds.
#[derive(Clone, Copy, Debug)]
struct Estimate {
    m: TierMatch,
    queue_s: f64,
    prefill_s: f64,
    load_s: f64,
    /// The KV-held term: see the module doc.
    kv_s: f64,
    /// The new-copy term: see the module doc.
    copy_s: f64,
    uncached_tokens: u64,
}

impl Estimate {
    fn ttft_s(&self) -> f64 {
        self.queue_s + self.prefill_s.max(self.load_s) + self.kv_s + self.copy_s
    }
}

impl CacheAware {
    pub fn new(hints: CostHints) -> CacheAware {
        CacheAware { hints, matches: PrefixMatches::default(), pending: Vec::new() }
    }

    fn pending(&self, v: &InstanceView) -> u64 {
        self.pending.get(v.id.0 as usize).copied().unwrap_or(0)
    }

    fn estimate(&self, request: &Request, v: &InstanceView) -> Estimate {
        let h = &self.hints;
        let bs = u64::from(h.block_size);
        let m = self.matches.get(v.id);
        // The last prompt token is always computed.
        let prompt = u64::from(request.prompt_tokens);
        let cached = (u64::from(m.total()) * bs).min(prompt.saturating_sub(1));
        let uncached_tokens = prompt - cached;
        let queued = v.load.prefill_tokens_left + self.pending(v);
        // The KV its requests hold, as prefill-seconds: they are work the instance has taken
        // on (Dynamo counts them as decode blocks, beside prefill blocks), and what drives it
        // to preemption if it keeps winning on prefix.
        let kv_s = (u64::from(v.load.kv_used_blocks) * bs) as f64 / h.prefill_tokens_per_s * KV_WEIGHT;
        let held = (u64::from(m.l1 + m.l2) * bs).min(prompt);
        let copy_s = (prompt - held) as f64 / h.prefill_tokens_per_s * COPY_WEIGHT;
        Estimate {
            m,
            queue_s: queued as f64 / h.prefill_tokens_per_s,
            prefill_s: uncached_tokens as f64 / h.prefill_tokens_per_s,
            load_s: (u64::from(m.l2) * bs) as f64 / h.l2_tokens_per_s
                + (u64::from(m.l3) * bs) as f64 / h.l3_tokens_per_s,
            kv_s,
            copy_s,
            uncached_tokens,
        }
    }
}

impl Router for CacheAware {
    fn name(&self) -> &'static str {
        "cache-aware"
    }

    fn wants_kv_events(&self) -> bool {
        true
    }

    fn on_event(&mut self, event: &FleetEvent) {
        if let FleetEvent::Load { instance, .. } = *event {
            if let Some(p) = self.pending.get_mut(instance.0 as usize) {
                *p = 0;
            }
        }
    }

    fn pick(&mut self, request: &Request, fleet: &FleetView) -> Option<Pick> {
        let (count, in_flight) =
            fleet.candidates(request).fold((0u32, 0u64), |(n, f), v| (n + 1, f + u64::from(v.in_flight)));
        if count == 0 {
            return None;
        }
        let hot_above = HOT_FACTOR * in_flight as f64 / f64::from(count) + HOT_SLACK;
        fleet.index().match_prefix(&request.block_hashes, &mut self.matches);
        // Best among the instances that pass the guards; failing that, among all.
        let mut best: [Option<(&InstanceView, Estimate)>; 2] = [None, None];
        for v in fleet.candidates(request) {
            let e = self.estimate(request, v);
            let guarded = f64::from(v.in_flight) > hot_above;
            let slot = &mut best[usize::from(guarded)];
            if slot.is_none_or(|(_, b)| e.ttft_s() < b.ttft_s()) {
                *slot = Some((v, e));
            }
        }
        let (v, e) = best[0].or(best[1])?;
        let guarded = best[0].is_none();
        let id = v.id;
        if self.pending.len() <= id.0 as usize {
            self.pending.resize(id.0 as usize + 1, 0);
        }
        self.pending[id.0 as usize] += e.uncached_tokens;
        let bs = self.hints.block_size;
        let ms = |s: f64| (s * 1e4).round() / 10.0;
        Some(Pick {
            instance: id,
            why: Why::CacheAware {
                l1_tokens: e.m.l1 * bs,
                l2_tokens: e.m.l2 * bs,
                l3_tokens: e.m.l3 * bs,
                queue_ms: ms(e.queue_s),
                prefill_ms: ms(e.prefill_s),
                load_ms: ms(e.load_s),
                kv_ms: ms(e.kv_s),
                copy_ms: ms(e.copy_s),
                predicted_ttft_ms: ms(e.ttft_s()),
                all_guarded: guarded,
            },
        })
    }
}
