//! Per-run service metrics: latency distributions, SLO attainment, goodput, token throughput,
//! prefix-cache hit rate and cost.
//!
//! A [`Metrics`] hears every finished request once ([`Metrics::record`]) and every request the
//! fleet turned away ([`Metrics::record_rejected`]); at the end of the run
//! [`Metrics::summary`] turns the counters into a serializable [`Summary`].
//!
//! **Invariant:** memory does not grow with the number of requests. Latencies go into
//! HDR histograms with fixed bounds (1 µs to [`MAX_TRACKABLE_US`], 3 significant digits), so a
//! percentile is within 0.1% of the true value and never below it (HDR reports the highest
//! value equivalent to the bucket; we then clamp to the exact extremes seen). Means are exact:
//! they come from running sums, not from the histogram. Recording allocates nothing.
//!
//! Per request, with every time in integer µs (see [`engine::Time`]):
//!
//! | metric | formula |
//! | --- | --- |
//! | TTFT | `first_token_at − arrival` |
//! | TPOT | `(finished_at − first_token_at) / (output_tokens − 1)`, only when `output_tokens ≥ 2` |
//! | E2E | `finished_at − arrival` |
//! | queue | `admitted_at − arrival` |
//! | paused wait | time queued while its instance had paused admission (KV high water) |
//!
//! A request evicted from one instance and placed on another is one request: its TTFT ends
//! at the first token it ever produced, its TPOT spans the eviction and the recompute.
//!
//! A request meets the SLO when its TTFT and its TPOT are both within target; one with fewer
//! than two output tokens has no inter-token gap and meets the TPOT target by definition.
//! Rejected requests never meet it, nor do requests ended early (runaways under the
//! `end` policy), whose latencies are still recorded. The run's span is first arrival to last finish among
//! finished requests; rates (goodput, throughput) and GPU-hours are taken over that span.

use crate::slo::Slo;
use engine::{Class, Dur, Finished, Request, Time};
use hdrhistogram::Histogram;

/// Largest latency the histograms resolve (about 11.6 days); larger values saturate to it.
pub const MAX_TRACKABLE_US: u64 = 1_000_000_000_000;

/// Significant decimal digits the histograms keep (0.1% relative error).
const SIGNIFICANT_DIGITS: u8 = 3;

/// Quantile steps in a CDF from [`Metrics::ttft_cdf`]; the CDF has one more point than this.
const CDF_STEPS: usize = 200;

/// Prompts of at least this many tokens are long in the per-class TTFT (the long requests of
/// the long-input experiments are 32K to 256K tokens).
pub const LONG_PROMPT_TOKENS: u32 = 32_768;

/// Requests asking for at least this many output tokens have a long output in the
/// per-class metrics (the long outputs of the long-output experiments are 8K tokens and
/// more; ordinary chat outputs stay under 2K).
pub const LONG_OUTPUT_TOKENS: u32 = 4_096;

mod summary;
#[cfg(test)]
mod tests;

pub use summary::{
    FleetCost, GroupSummary, HitRateByTier, Percentiles, SessionsSummary, SpeculationReport, Summary, TokenThroughput,
};

/// Collects one run's metrics in fixed memory; see the module doc for the definitions.
#[derive(Clone, Debug)]
pub struct Metrics {
    slo: Slo,
    ttft: Distribution,
    ttft_short: Distribution,
    ttft_long: Distribution,
    ttft_short_output: Distribution,
    tpot: Distribution,
    e2e: Distribution,
    queue: Distribution,
    paused_wait: Distribution,
    finished: u64,
    rejected: u64,
    slo_met: u64,
    /// Short-output requests that met the SLO, and those rejected; long-output ones.
    slo_met_short_output: u64,
    rejected_short_output: u64,
    long_output: u64,
    evictions: u64,
    reroutes: u64,
    ended_runaway: u64,
    admission_paused: Dur,
    input_tokens: u64,
    output_tokens: u64,
    cached_tokens: u64,
    cached_by_tier: [u64; 3],
    preemptions: u64,
    yields: u64,
    /// Earliest arrival among finished requests; `None` until the first one.
    first_arrival: Option<Time>,
    /// Latest finish among finished requests; `None` until the first one.
    last_finish: Option<Time>,
    /// Requests flow control shed (they count as rejected too).
    shed: u64,
    /// Each class's SLO, when requests are held to their class's targets.
    class_slos: Option<[Slo; 3]>,
    /// The same metrics per class and per tenant (runs with classes only).
    groups: Option<Box<Groups>>,
}

/// Metrics of each class and each tenant apart.
#[derive(Clone, Debug)]
struct Groups {
    classes: [Metrics; 3],
    tenants: Vec<(String, Metrics)>,
}

impl Metrics {
    pub fn new(slo: Slo) -> Metrics {
        Metrics {
            slo,
            ttft: Distribution::new(),
            ttft_short: Distribution::new(),
            ttft_long: Distribution::new(),
            ttft_short_output: Distribution::new(),
            tpot: Distribution::new(),
            e2e: Distribution::new(),
            queue: Distribution::new(),
            paused_wait: Distribution::new(),
            finished: 0,
            rejected: 0,
            slo_met: 0,
            slo_met_short_output: 0,
            rejected_short_output: 0,
            long_output: 0,
            evictions: 0,
            reroutes: 0,
            ended_runaway: 0,
            admission_paused: Dur::ZERO,
            input_tokens: 0,
            output_tokens: 0,
            cached_tokens: 0,
            cached_by_tier: [0; 3],
            preemptions: 0,
            yields: 0,
            first_arrival: None,
            last_finish: None,
            shed: 0,
            class_slos: None,
            groups: None,
        }
    }

    /// Metrics that hold each request to its class's SLO (by [`engine::Class::index`]) and
    /// also report each class and each of `tenants` (names by id) apart.
    pub fn with_classes(slo: Slo, class_slos: [Slo; 3], tenants: &[String]) -> Metrics {
        let groups = Groups {
            classes: class_slos.map(Metrics::new),
            tenants: tenants
                .iter()
                .map(|name| {
                    let mut m = Metrics::new(slo);
                    m.class_slos = Some(class_slos);
                    (name.clone(), m)
                })
                .collect(),
        };
        Metrics { class_slos: Some(class_slos), groups: Some(Box::new(groups)), ..Metrics::new(slo) }
    }

    /// The groups' metrics a request counts in: its class's and its tenant's.
    fn groups_of(&mut self, request: &Request) -> impl Iterator<Item = &mut Metrics> {
        let (class, tenant) = (request.service.class.index(), request.service.tenant.0 as usize);
        self.groups.as_deref_mut().into_iter().flat_map(move |g| {
            let Groups { classes, tenants } = g;
            std::iter::once(&mut classes[class]).chain(tenants.get_mut(tenant).map(|(_, m)| m))
        })
    }

    pub fn slo(&self) -> Slo {
        self.slo
    }

    /// Requests recorded so far, finished and rejected.
    pub fn len(&self) -> u64 {
        self.finished + self.rejected
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a run of `requests` requests can no longer reach `attainment`: even if every
    /// request not yet recorded met the SLO, fewer than that share would (the summary's
    /// `slo_attainment`, computed the same way).
    pub fn cannot_reach(&self, attainment: f64, requests: u64) -> bool {
        let missed = self.len() - self.slo_met;
        ratio(requests.saturating_sub(missed) as f64, requests as f64) < attainment
    }

    /// Takes one finished request into account. Allocates nothing.
    /// The targets a request of `class` is held to.
    pub fn slo_of(&self, class: engine::Class) -> Slo {
        match self.class_slos {
            Some(slos) => slos[class.index()],
            None => self.slo,
        }
    }

    pub fn record(&mut self, f: &Finished) {
        for g in self.groups_of(&f.request) {
            g.record(f);
        }
        let slo = self.slo_of(f.request.service.class);
        let arrival = f.request.arrival;
        let ttft_us = f.first_token_at.since(arrival).0;
        self.ttft.record(ttft_us as f64);
        if f.request.prompt_tokens >= LONG_PROMPT_TOKENS {
            self.ttft_long.record(ttft_us as f64);
        } else {
            self.ttft_short.record(ttft_us as f64);
        }
        let short_output = f.request.output_len() < LONG_OUTPUT_TOKENS;
        if short_output {
            self.ttft_short_output.record(ttft_us as f64);
        } else {
            self.long_output += 1;
        }
        self.e2e.record(f.finished_at.since(arrival).0 as f64);
        self.queue.record(f.admitted_at.since(arrival).0 as f64);
        self.paused_wait.record(f.paused_wait.0 as f64);

        let ttft_met = ttft_us as f64 <= slo.ttft_ms * 1e3;
        let tpot_met = if f.output_tokens >= 2 {
            let gaps = f64::from(f.output_tokens - 1);
            let decode_us = f.finished_at.since(f.first_token_at).0 as f64;
            self.tpot.record(decode_us / gaps);
            // Compared without dividing, so that a TPOT exactly on target is not lost to
            // rounding.
            decode_us <= slo.tpot_ms * 1e3 * gaps
        } else {
            true
        };
        if f.ended.is_some() {
            self.ended_runaway += 1;
        } else if ttft_met && tpot_met {
            self.slo_met += 1;
            self.slo_met_short_output += u64::from(short_output);
        }

        self.finished += 1;
        self.input_tokens += u64::from(f.request.prompt_tokens);
        self.output_tokens += u64::from(f.output_tokens);
        self.cached_tokens += u64::from(f.cached_total());
        for (sum, &t) in self.cached_by_tier.iter_mut().zip(&f.cached_tokens) {
            *sum += u64::from(t);
        }
        self.preemptions += u64::from(f.preemptions);
        self.yields += u64::from(f.yields);
        self.first_arrival = Some(self.first_arrival.map_or(arrival, |t| t.min(arrival)));
        self.last_finish = Some(self.last_finish.map_or(f.finished_at, |t| t.max(f.finished_at)));
    }

    /// Counts a request the fleet turned away; it never meets the SLO.
    pub fn record_rejected(&mut self, request: &Request) {
        for g in self.groups_of(request) {
            g.record_rejected(request);
        }
        self.rejected += 1;
        if request.output_len() < LONG_OUTPUT_TOKENS {
            self.rejected_short_output += 1;
        } else {
            self.long_output += 1;
        }
    }

    /// Counts a request flow control shed: rejected, and counted apart.
    pub fn record_shed(&mut self, request: &Request) {
        for g in self.groups_of(request) {
            g.shed += 1;
        }
        self.shed += 1;
        self.record_rejected(request);
    }

    /// Counts a request evicted from an instance (placed again or not).
    pub fn record_eviction(&mut self) {
        self.evictions += 1;
    }

    /// Counts an evicted request placed on an instance again.
    pub fn record_reroute(&mut self) {
        self.reroutes += 1;
    }

    /// Adds time an instance spent with admission paused.
    pub fn record_admission_paused(&mut self, paused: Dur) {
        self.admission_paused += paused;
    }

    /// First arrival to last finish, in seconds; 0.0 before any request finished.
    pub fn duration_s(&self) -> f64 {
        match (self.first_arrival, self.last_finish) {
            (Some(first), Some(last)) => last.since(first).as_secs_f64(),
            _ => 0.0,
        }
    }

    pub fn summary(&self, cost: &FleetCost) -> Summary {
        let duration_s = self.duration_s();
        let gpu_hours = finite(f64::from(cost.gpus) * duration_s / 3600.0);
        let total_mtok = (self.input_tokens + self.output_tokens) as f64 / 1e6;
        Summary {
            requests: self.finished,
            rejected: self.rejected,
            ttft_ms: self.ttft.percentiles(),
            ttft_ms_short: self.ttft_short.percentiles(),
            ttft_ms_long: self.ttft_long.percentiles(),
            long_requests: self.ttft_long.count(),
            tpot_ms: self.tpot.percentiles(),
            e2e_ms: self.e2e.percentiles(),
            queue_ms: self.queue.percentiles(),
            slo_attainment: ratio(self.slo_met as f64, self.len() as f64),
            goodput_rps: ratio(self.slo_met as f64, duration_s),
            throughput_tok_s: TokenThroughput {
                input: ratio(self.input_tokens as f64, duration_s),
                output: ratio(self.output_tokens as f64, duration_s),
            },
            cache_hit_rate: ratio(self.cached_tokens as f64, self.input_tokens as f64),
            hit_rate_by_tier: HitRateByTier {
                l1: ratio(self.cached_by_tier[0] as f64, self.input_tokens as f64),
                l2: ratio(self.cached_by_tier[1] as f64, self.input_tokens as f64),
                l3: ratio(self.cached_by_tier[2] as f64, self.input_tokens as f64),
            },
            max_hit_rate: None,
            gpu_busy_s: 0.0,
            prefill_time_share: 0.0,
            gpu_hours,
            cost_per_mtok: ratio(gpu_hours * cost.price_per_gpu_hour, total_mtok),
            duration_s,
            preemptions: self.preemptions,
            yields: self.yields,
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            cached_tokens: self.cached_tokens,
            slo_met: self.slo_met,
            slo: self.slo,
            ttft_ms_short_output: self.ttft_short_output.percentiles(),
            slo_attainment_short_output: ratio(
                self.slo_met_short_output as f64,
                (self.ttft_short_output.count() + self.rejected_short_output) as f64,
            ),
            long_output_requests: self.long_output,
            evictions: self.evictions,
            reroutes: self.reroutes,
            ended_runaway: self.ended_runaway,
            admission_paused_s: self.admission_paused.as_secs_f64(),
            paused_wait_ms: self.paused_wait.percentiles(),
            pools: None,
            speculation: None,
            shed: self.shed,
            classes: self.groups.as_ref().map_or_else(Vec::new, |g| {
                let named = Class::ALL.iter().map(|c| c.name().to_string()).zip(&g.classes);
                named.filter(|(_, m)| !m.is_empty()).map(|(n, m)| m.group(n, Some(m.slo), duration_s)).collect()
            }),
            tenants: self.groups.as_ref().map_or_else(Vec::new, |g| {
                g.tenants
                    .iter()
                    .filter(|(_, m)| !m.is_empty())
                    .map(|(n, m)| m.group(n.clone(), None, duration_s))
                    .collect()
            }),
            sessions: None,
        }
    }

    /// One group's numbers, with goodput over the whole run's span (`duration_s`) so that
    /// groups and runs compare.
    fn group(&self, name: String, slo: Option<Slo>, duration_s: f64) -> GroupSummary {
        GroupSummary {
            name,
            slo,
            requests: self.finished,
            rejected: self.rejected,
            shed: self.shed,
            slo_met: self.slo_met,
            slo_attainment: ratio(self.slo_met as f64, self.len() as f64),
            goodput_rps: ratio(self.slo_met as f64, duration_s),
            ttft_ms: self.ttft.percentiles(),
            tpot_ms: self.tpot.percentiles(),
            queue_ms: self.queue.percentiles(),
            output_tokens: self.output_tokens,
        }
    }

    /// The TTFT distribution as `(ms, cumulative fraction)` points, for plotting; empty when
    /// nothing finished.
    pub fn ttft_cdf(&self) -> Vec<(f64, f64)> {
        self.ttft.cdf()
    }

    /// The TPOT distribution as `(ms, cumulative fraction)` points, for plotting; empty when no
    /// request generated two tokens.
    pub fn tpot_cdf(&self) -> Vec<(f64, f64)> {
        self.tpot.cdf()
    }
}

/// One latency distribution in µs: a fixed-size histogram for quantiles, exact sum and
/// extremes for the mean and for clamping the histogram's bucket-rounded answers.
#[derive(Clone, Debug)]
struct Distribution {
    hist: Histogram<u64>,
    sum_us: f64,
    min_us: f64,
    max_us: f64,
}

impl Distribution {
    fn new() -> Distribution {
        // Fixed bounds rather than auto-resize: recording then never allocates.
        let hist = Histogram::new_with_bounds(1, MAX_TRACKABLE_US, SIGNIFICANT_DIGITS)
            .expect("constant histogram bounds are valid");
        Distribution { hist, sum_us: 0.0, min_us: f64::INFINITY, max_us: 0.0 }
    }

    fn record(&mut self, value_us: f64) {
        debug_assert!(value_us.is_finite() && value_us >= 0.0, "latency {value_us} µs");
        self.hist.saturating_record(value_us.round() as u64);
        self.sum_us += value_us;
        self.min_us = self.min_us.min(value_us);
        self.max_us = self.max_us.max(value_us);
    }

    fn count(&self) -> u64 {
        self.hist.len()
    }

    /// The value at `quantile`, in µs; only called when non-empty.
    fn quantile_us(&self, quantile: f64) -> f64 {
        (self.hist.value_at_quantile(quantile) as f64).clamp(self.min_us, self.max_us)
    }

    fn percentiles(&self) -> Percentiles {
        if self.count() == 0 {
            return Percentiles::default();
        }
        let ms = |us: f64| finite(us / 1e3);
        Percentiles {
            mean: ms(self.sum_us / self.count() as f64),
            p50: ms(self.quantile_us(0.50)),
            p90: ms(self.quantile_us(0.90)),
            p95: ms(self.quantile_us(0.95)),
            p99: ms(self.quantile_us(0.99)),
        }
    }

    fn cdf(&self) -> Vec<(f64, f64)> {
        if self.count() == 0 {
            return Vec::new();
        }
        (0..=CDF_STEPS)
            .map(|i| {
                let quantile = i as f64 / CDF_STEPS as f64;
                (finite(self.quantile_us(quantile) / 1e3), quantile)
            })
            .collect()
    }
}

/// `num / den`, or 0.0 when the denominator is zero or the result is not finite (JSON has no
/// NaN, and an empty run has no rate).
pub(crate) fn ratio(num: f64, den: f64) -> f64 {
    if den == 0.0 {
        0.0
    } else {
        finite(num / den)
    }
}

fn finite(x: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}
