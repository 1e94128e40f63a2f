//! `cache-aware`: the instance with the lowest predicted cost of the request to the SLO, both
//! sides of it: its time to first token, and what it does to the time per output token of the
//! requests decoding there and sees of it itself.
//!
//! For each candidate instance `i`, from the global prefix index (KV events only), the last
//! load report and the requests routed since:
//!
//! ```text
//! queue_s(i)  = (prefill tokens left in i's report + prefill routed to i since) / R
//! suffix_s(i) = (prompt − cached prefix on i, all tiers) / R
//! load_s(i)   = L2 tokens on i / R_L2 + L3 tokens / R_L3
//! copy_s(i)   = COPY_WEIGHT × (prompt − prefix held by i in L1 or L2) / R
//! ttft(i)     = queue_s(i) + max(suffix_s(i), load_s(i)) + copy_s(i)
//! step_s(i)   = D(in flight on i + 1, KV on i + prompt)
//! stall_s(i)  = STALL_WEIGHT × suffix_s(i) × running(i) × requests(i) / decode tokens left(i)
//! own_s(i)    = OWN_WEIGHT × step_s(i)
//! kv_s(i)     = KV_WEIGHT × max(0, KV on i + decode tokens left(i) + prompt − KV capacity(i)) / R
//! left_s(i)   = LEFT_WEIGHT × (decode tokens left(i) + output routed to i since) / R
//! score(i)    = ttft(i) + stall_s(i) + own_s(i) + kv_s(i) + left_s(i)
//! ```
//!
//! `decode tokens left(i)` is what i's report counts (each request's tokens to its bound, the
//! client's `max_tokens`: no router knows an output's length before it ends) times the share
//! of their bounds the outputs that ended lately used ([`FleetView::output_share`]); the
//! output routed since the report counts the same way. Where outputs run to their bounds the
//! share is 1.
//!
//! `R` is the instance's prefill rate, `R_L2`, `R_L3` its load rates from the lower tiers and
//! `D(seqs, kv tokens)` its decode step ([`CostHints`]); the load overlaps the suffix's
//! compute (layer-wise loading), hence the max. The prefill routed since the report counts
//! only the uncached tokens this router predicted.
//!
//! `copy_s` is not time the request waits: it is what placing the prompt away from its prefix
//! costs the fleet later. L1 and L2 are per instance; a prompt sent where its prefix sits only
//! in L3 (or nowhere) makes one more copy of it in that instance's GPU and host memory, so the
//! fleet's per-instance tiers hold fewer distinct prefixes, later requests load more from L3
//! (longer steps) and KV fills sooner. Without it, the router spread a hot prefix over every
//! instance whenever queues differed by a few hundred milliseconds (docs/KV-TIERS.md).
//!
//! `stall_s` is the decode side of the placement. The prompt's uncached tokens are computed
//! in chunks inside the iterations of the requests decoding on `i`, so each of them waits
//! `suffix_s` longer for its next tokens, and its time per output token grows by `suffix_s`
//! over its remaining tokens: the term is `suffix_s × Σ 1 / remaining tokens` over i's
//! running requests, the sum estimated from the report as `running / mean remaining` (mean
//! remaining = decode tokens left / requests). It is what balancing by requests in flight
//! gets right where TPOT is the limit (short outputs, long prompts), and it vanishes for a
//! prompt found cached. `own_s` is what the request will see itself: its predicted time per
//! output token, the decode step it would join (more sequences and more KV: longer steps).
//!
//! `kv_s` is the KV side. An instance's KV at its fullest, if every request it holds reached
//! its last token, is what it holds now (the report's blocks in use plus what was routed
//! since) plus the tokens its requests have still to generate; what the prompt adds beyond
//! the capacity waits for others to finish or makes the engine preempt one, which computes
//! its tokens again: priced as prefill tokens. It is zero wherever the KV can take the
//! request, so it only speaks where memory, not compute, is the limit (long outputs).
//! `left_s` is the same quantity before the capacity is reached: the tokens i's requests
//! have still to generate are KV it will hold, and decode steps it will run, for a while yet
//! (what `least-outstanding` balances). The requests routed since the report count with
//! their output, which the report cannot know yet (without it, the requests arriving within
//! one step all saw the same instance emptying soonest). Weighted at a prompt token's
//! prefill, it moves placements between instances the other terms find alike towards the one
//! that empties sooner.
//!
//! Triage (off unless `lost_cap` is set): a request whose first token, with the predicted
//! queue taken `LOST_QUEUE_FACTOR` times longer (`queue_s × factor + max(suffix_s, load_s)`),
//! comes after its class's TTFT target on every instance misses its SLO wherever it goes, so
//! it goes where it delays the fewest requests that can still meet theirs, among the
//! instances whose predicted queue is below `lost_cap` TTFT targets: the longest queue (the
//! rule above sends nothing else there while it is long) less the prompt's uncached prefill
//! and copy term there (`queue_s − suffix_s − copy_s`, highest wins: the work it brings, and
//! on sessions the next turns' prefix). The factor is above 1 because the queue is a lower
//! bound (as last reported, no waiting for KV); the cap bounds how long a lost request waits.
//! Uncapped, a fleet driven past saturation starves the lost requests (minutes) to keep the
//! rest within target; with no queue below the cap (sustained overload), lost requests are
//! placed as the others. Only where the fleet has targets (`FleetView::ttft_left_s`).
//!
//! Guard against piling onto one hot instance: the prediction does not see the decode batch a
//! popular prefix draws until it runs. An instance whose requests in flight exceed
//! `HOT_FACTOR` × the fleet's mean plus `HOT_SLACK` is passed over (unless every candidate
//! is). Ties go to the lower id.
//!
//! A fleet of 64 instances or more is not scored whole for every request: the instances the
//! query found a prefix on are scored, then the others in order of their predicted queues,
//! until one's predicted first token alone exceeds the best score (every other term is >= 0,
//! so none after it can win). The pick is the one scoring every candidate would make
//! (property-tested); triage, which needs every instance's first token, scores them all.
//!
//! The parameters, the terms tried and dropped, and the runs that chose them are in
//! docs/ROUTERS.md.

use super::queue_order::QueueOrder;
use super::{CostHints, Pick, Router, RouterFactory, Why};
use crate::event::FleetEvent;
use crate::prefix_index::{PrefixMatches, TierMatch};
use crate::view::{CandidateRule, FleetView, InstanceView};
use engine::Request;

/// In-flight requests above this multiple of the mean (plus the slack) make an instance hot.
pub const HOT_FACTOR: f64 = 2.0;
pub const HOT_SLACK: f64 = 8.0;
/// Weight of the prompt tokens an instance would newly hold (not in its L1 or L2), in
/// prefill-seconds per token.
pub const COPY_WEIGHT: f64 = 8.0;
/// Seconds of score per second of TPOT added to the running requests, summed over them.
pub const STALL_WEIGHT: f64 = 2.0;
/// Seconds of score per second of the request's own predicted TPOT.
pub const OWN_WEIGHT: f64 = 4.0;
/// Prefill-seconds of score per token the instance's KV would be over-committed by.
pub const KV_WEIGHT: f64 = 0.5;
/// Prefill-seconds of score per token the instance's requests have still to generate.
pub const LEFT_WEIGHT: f64 = 1.0;
/// How much longer than predicted the queue is taken to be when deciding that a request is
/// lost (the prediction is a lower bound: the queue as last reported, no waiting for KV).
pub const LOST_QUEUE_FACTOR: f64 = 1.5;
/// The longest queue a lost request may join, in TTFT targets; 0: no triage.
pub const LOST_CAP: f64 = 0.0;

/// The rule's weights; [`Default`] is the rule as documented.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheAwareConfig {
    pub copy_weight: f64,
    pub stall_weight: f64,
    pub own_weight: f64,
    pub hot_factor: f64,
    pub hot_slack: f64,
    pub kv_weight: f64,
    pub left_weight: f64,
    pub lost_queue_factor: f64,
    pub lost_cap: f64,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        CacheAwareConfig {
            copy_weight: COPY_WEIGHT,
            stall_weight: STALL_WEIGHT,
            own_weight: OWN_WEIGHT,
            hot_factor: HOT_FACTOR,
            hot_slack: HOT_SLACK,
            kv_weight: KV_WEIGHT,
            left_weight: LEFT_WEIGHT,
            lost_queue_factor: LOST_QUEUE_FACTOR,
            lost_cap: LOST_CAP,
        }
    }
}

crate::params!(CacheAwareConfig, "cache-aware", {
    copy_weight: float from 0.0 ..= 64.0, "prefill-seconds of score per prompt token the instance would newly hold (not in its L1 or L2)";
    stall_weight: float from 0.0 ..= 16.0, "seconds of score per second of TPOT added to the requests running there";
    own_weight: float from 0.0 ..= 16.0, "seconds of score per second of the request's own predicted TPOT";
    hot_factor: float from 1.0 ..= 64.0, "an instance with more requests in flight than this times the mean (plus hot_slack) is hot";
    hot_slack: float from 0.0 ..= 1024.0, "requests in flight above hot_factor times the mean before an instance is hot";
    kv_weight: float from 0.0 ..= 16.0, "prefill-seconds of score per token the instance's KV would be over-committed by (held plus still to generate, beyond capacity)";
    left_weight: float from 0.0 ..= 16.0, "prefill-seconds of score per token the instance's requests have still to generate";
    lost_queue_factor: float from 1.0 ..= 16.0, "a request is lost when, with its predicted queue taken this many times longer, its first token comes after its TTFT target on every instance";
    lost_cap: float from 0.0 ..= 64.0, "a lost request goes to a predicted queue shorter than this many TTFT targets, the longest net of the work it brings (0: no triage; none that short: placed as the others)";
});

impl RouterFactory for CacheAwareConfig {
    fn build(&self, _seed: u64, hints: &CostHints) -> Box<dyn Router> {
        Box::new(CacheAware::new(*self, *hints))
    }
}

/// Fleets of at least this many instances are scored in order of their queues, stopping at
/// the first instance no later one can beat (below it scoring every candidate costs less than
/// keeping the order).
const ORDERED_FROM: usize = 64;

#[derive(Debug)]
pub struct CacheAware {
    config: CacheAwareConfig,
    hints: CostHints,
    matches: PrefixMatches,
    /// Uncached prompt tokens routed to each instance since its last load report.
    pending: Vec<u64>,
    /// The instances by prefill tokens queued (`queue_s`'s numerator).
    order: QueueOrder,
    /// Fleets this large or larger are searched in `order` ([`CacheAware::pick_in_order`]).
    ordered_from: usize,
    /// Instances the current query found a prefix on, stamped with `query`.
    held: Vec<u32>,
    query: u32,
}

/// One candidate's terms, in seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Estimate {
    m: TierMatch,
    queue_s: f64,
    prefill_s: f64,
    load_s: f64,
    /// The new-copy term: see the module doc.
    copy_s: f64,
    /// The decode step the request would join: its own predicted TPOT.
    step_s: f64,
    /// The step the running batch would see while the prompt's chunks are computed (for the
    /// explanation; the score counts the stall instead).
    batch_step_s: f64,
    /// The decode-side term: see the module doc.
    stall_s: f64,
    own_s: f64,
    /// The KV-side term: see the module doc.
    kv_s: f64,
    /// The decode-tokens-left term: see the module doc.
    left_s: f64,
    uncached_tokens: u64,
}

impl Estimate {
    /// The time to the first token with the queue taken `queue_factor` times longer, without
    /// the copy term (which is not waited).
    fn first_token_s(&self, queue_factor: f64) -> f64 {
        self.queue_s * queue_factor + self.prefill_s.max(self.load_s)
    }

    /// Where a lost request does least harm ranks highest: a long queue (no request that can
    /// still make its target is sent there) less the work it brings (its uncached prefill)
    /// and the copy it makes (away from its prefix, later turns pay for it).
    fn lost_rank_s(&self) -> f64 {
        self.queue_s - self.prefill_s - self.copy_s
    }

    fn ttft_s(&self) -> f64 {
        self.first_token_s(1.0) + self.copy_s
    }

    fn score_s(&self) -> f64 {
        self.ttft_s() + self.stall_s + self.own_s + self.kv_s + self.left_s
    }
}

/// The best candidates so far: `[0]` among those not hot, `[1]` among the hot ones.
type Best<'a> = [Option<(&'a InstanceView, Estimate)>; 2];

/// Offers `v`, estimated `e`, to `best`: it takes its slot with a lower score, or an equal
/// one and a lower id (what scoring in id order, keeping the first of equals, gives).
fn keep_best<'a>(best: &mut Best<'a>, v: &'a InstanceView, e: Estimate, hot_above: f64) {
    let slot = &mut best[usize::from(f64::from(v.in_flight) > hot_above)];
    if slot.is_none_or(|(b, be)| e.score_s() < be.score_s() || (e.score_s() == be.score_s() && v.id < b.id)) {
        *slot = Some((v, e));
    }
}

impl CacheAware {
    pub fn new(config: CacheAwareConfig, hints: CostHints) -> CacheAware {
        let c = &config;
        let d = &hints.decode;
        // The search in queue order needs every term after the first token's to be >= 0.
        let terms_nonnegative = [c.copy_weight, c.stall_weight, c.own_weight, c.kv_weight, c.left_weight]
            .into_iter()
            .chain([d.base_us, d.per_seq_us, d.per_kv_token_us])
            .all(|x| x >= 0.0);
        CacheAware {
            config,
            hints,
            matches: PrefixMatches::default(),
            pending: Vec::new(),
            order: QueueOrder::default(),
            ordered_from: if terms_nonnegative { ORDERED_FROM } else { usize::MAX },
            held: Vec::new(),
            query: 0,
        }
    }

    /// The same router, searching fleets of `n` instances or more in queue order (tests
    /// compare both searches).
    #[cfg(test)]
    pub(super) fn ordered_from(mut self, n: usize) -> CacheAware {
        self.ordered_from = n;
        self
    }

    fn pending(&self, v: &InstanceView) -> u64 {
        self.pending.get(v.id.0 as usize).copied().unwrap_or(0)
    }

    /// Prefill tokens queued on `v` as this router predicts them: `queue_s`'s numerator.
    fn queued(&self, v: &InstanceView) -> u64 {
        v.load.prefill_tokens_left + self.pending(v)
    }

    /// `queued` prefill tokens in seconds.
    fn queue_s(&self, queued: u64) -> f64 {
        queued as f64 / self.hints.prefill_tokens_per_s
    }

    /// The terms up to the first token's (queue, prefill, load, copy) of a request whose
    /// prefix `m` is cached where `queued` prefill tokens wait; the rest zero.
    fn first_token_terms(&self, request: &Request, m: TierMatch, queued: u64) -> Estimate {
        let h = &self.hints;
        let bs = u64::from(h.block_size);
        // The last prompt token is always computed.
        let prompt = u64::from(request.prompt_tokens);
        let cached = (u64::from(m.total()) * bs).min(prompt.saturating_sub(1));
        let uncached_tokens = prompt - cached;
        let held = (u64::from(m.l1 + m.l2) * bs).min(prompt);
        Estimate {
            m,
            queue_s: self.queue_s(queued),
            prefill_s: uncached_tokens as f64 / h.prefill_tokens_per_s,
            load_s: (u64::from(m.l2) * bs) as f64 / h.l2_tokens_per_s
                + (u64::from(m.l3) * bs) as f64 / h.l3_tokens_per_s,
            copy_s: (prompt - held) as f64 / h.prefill_tokens_per_s * self.config.copy_weight,
            uncached_tokens,
            ..Estimate::default()
        }
    }

    fn estimate(&self, request: &Request, v: &InstanceView, share: f64) -> Estimate {
        let h = &self.hints;
        let c = &self.config;
        let bs = u64::from(h.block_size);
        let first = self.first_token_terms(request, self.matches.get(v.id), self.queued(v));
        let prompt = u64::from(request.prompt_tokens);
        let (prefill_s, uncached_tokens) = (first.prefill_s, first.uncached_tokens);
        // The batch as far as the router knows: requests in flight (routed, not finished) and
        // the KV of the last report plus what was routed since.
        let in_flight = f64::from(v.in_flight);
        let kv_tokens = (u64::from(v.load.kv_used_blocks) * bs + v.routed_since_report) as f64;
        let step_s = h.decode.step_us(in_flight + 1.0, kv_tokens + prompt as f64) / 1e6;
        let chunk = uncached_tokens.min(u64::from(h.max_batch_tokens)) as f64;
        let batch_step_s = h.decode.step_us(in_flight, kv_tokens) / 1e6 + chunk / h.prefill_tokens_per_s;
        // Tokens still to generate, as reported (counted to the requests' bounds) and scaled by
        // the share of their bounds outputs use.
        let decode_left = v.load.decode_tokens_left as f64 * share;
        // Σ 1 / remaining tokens over the running requests, as running / mean remaining (by
        // Jensen a lower bound: a few nearly done requests count more than this).
        let requests = f64::from(v.load.running + v.load.waiting);
        let left = decode_left.max(requests).max(1.0);
        let stalled = f64::from(v.load.running) * requests / left;
        let capacity = (u64::from(v.load.kv_total_blocks) * bs) as f64;
        // Tokens to generate: as last reported, and those of the requests routed since.
        let to_generate = decode_left + v.routed_since_report.saturating_sub(v.prompt_since_report) as f64 * share;
        let fullest = kv_tokens + decode_left + prompt as f64;
        Estimate {
            step_s,
            batch_step_s,
            stall_s: c.stall_weight * prefill_s * stalled,
            own_s: c.own_weight * step_s,
            kv_s: c.kv_weight * (fullest - capacity).max(0.0) / h.prefill_tokens_per_s,
            left_s: c.left_weight * to_generate / h.prefill_tokens_per_s,
            ..first
        }
    }

    /// The best candidates (`best[0]` among those not hot, `best[1]` among the hot ones) of a
    /// large fleet without scoring every one: the instances the query found a prefix on
    /// first, then the others in order of their queues, stopping at the first whose predicted
    /// first token, the score's first term and the same on all of them but for the queue, is
    /// later than the best score so far (every other term is >= 0, and rounding is monotone,
    /// so no instance after it scores lower). The same choice as scoring every candidate: the
    /// lowest score, the lower id on a tie.
    fn pick_in_order<'a>(
        &mut self,
        request: &Request,
        fleet: &'a FleetView,
        rule: CandidateRule,
        hot_above: f64,
        share: f64,
        best: &mut Best<'a>,
    ) {
        let mut order = std::mem::take(&mut self.order);
        order.sync(fleet.all(), |v| self.queued(v));
        let mut held = std::mem::take(&mut self.held);
        self.query = self.query.wrapping_add(1);
        if self.query == 0 {
            held.iter_mut().for_each(|q| *q = 0);
            self.query = 1;
        }
        held.resize(fleet.all().len(), 0);
        let views = fleet.all();
        for (id, _) in self.matches.iter() {
            let Some(v) = views.get(id.0 as usize) else { continue };
            held[id.0 as usize] = self.query;
            if rule.admits(v) {
                keep_best(best, v, self.estimate(request, v, share), hot_above);
            }
        }
        // Every other instance's first token but for its queue: the prefix they all share.
        let shared = self.first_token_terms(request, self.matches.shared(), 0);
        for (queued, i) in order.iter() {
            if let Some((_, b)) = &best[0] {
                if (Estimate { queue_s: self.queue_s(queued), ..shared }).ttft_s() > b.score_s() {
                    break;
                }
            }
            if held[i] != self.query && rule.admits(&views[i]) {
                keep_best(best, &views[i], self.estimate(request, &views[i], share), hot_above);
            }
        }
        self.order = order;
        self.held = held;
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
        let rule = fleet.candidate_rule(request);
        let candidates = || fleet.admitted(rule);
        let (count, in_flight) = candidates().fold((0u32, 0u64), |(n, f), v| (n + 1, f + u64::from(v.in_flight)));
        if count == 0 {
            return None;
        }
        let hot_above = self.config.hot_factor * in_flight as f64 / f64::from(count) + self.config.hot_slack;
        fleet.index().match_prefix(&request.block_hashes, &mut self.matches);
        // Best among the instances that pass the guards; failing that, among all. The place
        // for a lost request and the soonest first token, for triage.
        let mut best: Best = [None, None];
        let mut for_lost: Option<(&InstanceView, Estimate)> = None;
        let mut soonest_s = f64::INFINITY;
        let cap_s = fleet.ttft_target_s(request).unwrap_or(0.0) * self.config.lost_cap;
        let share = fleet.output_share();
        if cap_s <= 0.0 && fleet.all().len() >= self.ordered_from {
            // No triage (no request has a queue below a cap of 0): only the best counts.
            self.pick_in_order(request, fleet, rule, hot_above, share, &mut best);
        } else {
            for v in candidates() {
                let e = self.estimate(request, v, share);
                keep_best(&mut best, v, e, hot_above);
                if e.queue_s < cap_s && for_lost.is_none_or(|(_, l)| e.lost_rank_s() > l.lost_rank_s()) {
                    for_lost = Some((v, e));
                }
                soonest_s = soonest_s.min(e.first_token_s(self.config.lost_queue_factor));
            }
        }
        let lost = for_lost.filter(|_| fleet.ttft_left_s(request).is_some_and(|left_s| soonest_s > left_s));
        let (v, e) = lost.or(best[0]).or(best[1])?;
        let lost = lost.is_some();
        let guarded = !lost && best[0].is_none();
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
                copy_ms: ms(e.copy_s),
                predicted_ttft_ms: ms(e.ttft_s()),
                step_ms: ms(e.step_s),
                batch_step_ms: ms(e.batch_step_s),
                stall_ms: ms(e.stall_s),
                own_ms: ms(e.own_s),
                kv_ms: ms(e.kv_s),
                left_ms: ms(e.left_s),
                score_ms: ms(e.score_s()),
                output_share: (share * 1e3).round() / 1e3,
                all_guarded: guarded,
                lost,
            },
        })
    }
}
