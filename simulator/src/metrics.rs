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

use engine::{Dur, Finished, Request, Time};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Largest latency the histograms resolve (about 11.6 days); larger values saturate to it.
pub const MAX_TRACKABLE_US: u64 = 1_000_000_000_000;

/// Significant decimal digits the histograms keep (0.1% relative error).
const SIGNIFICANT_DIGITS: u8 = 3;

/// Quantile steps in a CDF from [`Metrics::ttft_cdf`]; the CDF has one more point than this.
const CDF_STEPS: usize = 200;

/// Latency targets a request must meet to count towards goodput.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Time to first token, from arrival at the fleet.
    pub ttft_ms: f64,
    /// Mean time per output token after the first.
    pub tpot_ms: f64,
}

impl Slo {
    /// Whether a finished request met both targets (the rule of [`Metrics::record`]: the
    /// TPOT target is compared without dividing, and one output token always meets it).
    pub fn met_by(&self, f: &Finished) -> bool {
        let ttft_met = f.first_token_at.since(f.request.arrival).0 as f64 <= self.ttft_ms * 1e3;
        let tpot_met = f.output_tokens < 2 || {
            let gaps = f64::from(f.output_tokens - 1);
            f.finished_at.since(f.first_token_at).0 as f64 <= self.tpot_ms * 1e3 * gaps
        };
        f.ended.is_none() && ttft_met && tpot_met
    }
}

/// Prompts of at least this many tokens are long in the per-class TTFT (the long requests of
/// the long-input experiments are 32K to 256K tokens).
pub const LONG_PROMPT_TOKENS: u32 = 32_768;

/// Requests asking for at least this many output tokens have a long output in the
/// per-class metrics (the long outputs of the long-output experiments are 8K tokens and
/// more; ordinary chat outputs stay under 2K).
pub const LONG_OUTPUT_TOKENS: u32 = 4_096;

/// What the fleet costs to run: GPU count times the hourly price, over the run's span.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct FleetCost {
    pub gpus: u32,
    pub price_per_gpu_hour: f64,
}

/// Mean and tail of one latency distribution, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
}

/// Tokens per second over the run's span.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenThroughput {
    /// Prompt tokens, cached or computed.
    pub input: f64,
    /// Generated tokens.
    pub output: f64,
}

/// The end-of-run numbers of one run.
///
/// The serialized keys up to `output_tokens` are a documented format (pinned by the test
/// `summary_json_has_the_documented_keys`); new fields go after them. Every float is finite:
/// empty runs give 0.0, never NaN.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests that finished.
    pub requests: u64,
    /// Requests the fleet turned away.
    pub rejected: u64,
    pub ttft_ms: Percentiles,
    /// TTFT of prompts under [`LONG_PROMPT_TOKENS`] tokens, and of the long ones.
    pub ttft_ms_short: Percentiles,
    pub ttft_ms_long: Percentiles,
    /// Finished requests with long prompts.
    pub long_requests: u64,
    /// Over requests with at least two output tokens.
    pub tpot_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub queue_ms: Percentiles,
    /// Requests that met the SLO over all requests, finished or rejected (0.0 to 1.0).
    pub slo_attainment: f64,
    /// Requests that met the SLO per second of span.
    pub goodput_rps: f64,
    pub throughput_tok_s: TokenThroughput,
    /// Prompt tokens served from the prefix cache over all prompt tokens (token-weighted).
    pub cache_hit_rate: f64,
    /// `cache_hit_rate` split by the tier the cached tokens came from (the three add up to it).
    pub hit_rate_by_tier: HitRateByTier,
    /// The hit rate an infinite cache shared by the whole fleet would reach on the same
    /// arrivals: the bound no placement can beat (absent when not measured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_hit_rate: Option<f64>,
    /// GPUs times the span in hours.
    pub gpu_hours: f64,
    /// Dollars per million tokens, input and output together.
    pub cost_per_mtok: f64,
    /// The span: first arrival to last finish.
    pub duration_s: f64,
    pub preemptions: u64,
    /// Times prefills yielded at a chunk boundary (fair prefill).
    pub yields: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Requests that met the SLO.
    pub slo_met: u64,
    /// The targets the attainment was measured against.
    pub slo: Slo,
    /// TTFT of requests asking for fewer than [`LONG_OUTPUT_TOKENS`] output tokens, and
    /// their SLO attainment (over those finished or rejected).
    #[serde(default)]
    pub ttft_ms_short_output: Percentiles,
    #[serde(default)]
    pub slo_attainment_short_output: f64,
    /// Requests (finished or rejected) asking for at least [`LONG_OUTPUT_TOKENS`].
    #[serde(default)]
    pub long_output_requests: u64,
    /// Requests evicted from an instance by the KV high-water protection (a request evicted
    /// twice counts twice), and evicted requests placed again.
    #[serde(default)]
    pub evictions: u64,
    #[serde(default)]
    pub reroutes: u64,
    /// Requests ended early as runaways (the `end` policy).
    #[serde(default)]
    pub ended_runaway: u64,
    /// Time instances spent with admission paused, summed over instances.
    #[serde(default)]
    pub admission_paused_s: f64,
    /// Per request, time queued while admission was paused (zero for most).
    #[serde(default)]
    pub paused_wait_ms: Percentiles,
    /// Disaggregated or autoscaled fleets: pools, scaling decisions and time series (absent
    /// for a fixed colocated fleet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pools: Option<crate::pools::PoolsReport>,
    /// Speculative decoding: the drafter and what it accepted (absent: no speculation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculation: Option<SpeculationReport>,
    /// Seconds instances spent computing steps, summed over instances, and the share of it
    /// that prefill chunks added to the steps their decodes alone would take (what cache hits
    /// can save, with decode work held fixed; see `cost::GpuTime`).
    #[serde(default)]
    pub gpu_busy_s: f64,
    #[serde(default)]
    pub prefill_time_share: f64,
}

/// What speculative decoding did in a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpeculationReport {
    /// The drafter preset (`simulator::cost::Drafter`).
    pub drafter: String,
    /// Decode steps of one sequence that verified drafts.
    pub verify_steps: u64,
    /// Drafts accepted per such step, as drawn; below `expected_accepted` when steps near the
    /// end of an output verify fewer drafts than the drafter's `verified`.
    pub accepted_per_step: f64,
    /// The acceptance profile's expectation with every draft verified.
    pub expected_accepted: f64,
}

/// Token-weighted shares of prompt tokens served from each tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HitRateByTier {
    pub l1: f64,
    pub l2: f64,
    pub l3: f64,
}

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
        }
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

    /// Takes one finished request into account. Allocates nothing.
    pub fn record(&mut self, f: &Finished) {
        let arrival = f.request.arrival;
        let ttft_us = f.first_token_at.since(arrival).0;
        self.ttft.record(ttft_us as f64);
        if f.request.prompt_tokens >= LONG_PROMPT_TOKENS {
            self.ttft_long.record(ttft_us as f64);
        } else {
            self.ttft_short.record(ttft_us as f64);
        }
        let short_output = f.request.max_output_tokens < LONG_OUTPUT_TOKENS;
        if short_output {
            self.ttft_short_output.record(ttft_us as f64);
        } else {
            self.long_output += 1;
        }
        self.e2e.record(f.finished_at.since(arrival).0 as f64);
        self.queue.record(f.admitted_at.since(arrival).0 as f64);
        self.paused_wait.record(f.paused_wait.0 as f64);

        let ttft_met = ttft_us as f64 <= self.slo.ttft_ms * 1e3;
        let tpot_met = if f.output_tokens >= 2 {
            let gaps = f64::from(f.output_tokens - 1);
            let decode_us = f.finished_at.since(f.first_token_at).0 as f64;
            self.tpot.record(decode_us / gaps);
            // Compared without dividing, so that a TPOT exactly on target is not lost to
            // rounding.
            decode_us <= self.slo.tpot_ms * 1e3 * gaps
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
        self.rejected += 1;
        if request.max_output_tokens < LONG_OUTPUT_TOKENS {
            self.rejected_short_output += 1;
        } else {
            self.long_output += 1;
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use engine::{CutShort, RequestId};

    const SLO: Slo = Slo { ttft_ms: 200.0, tpot_ms: 50.0 };

    const COST: FleetCost = FleetCost { gpus: 8, price_per_gpu_hour: 2.0 };

    /// A finished request; every time is in ms since the start of the run.
    struct Spec {
        arrival_ms: u64,
        admitted_ms: u64,
        first_token_ms: u64,
        finished_ms: u64,
        prompt_tokens: u32,
        output_tokens: u32,
        cached_tokens: u32,
        preemptions: u32,
    }

    fn finished(id: u64, s: Spec) -> Finished {
        Finished {
            request: Request {
                id: RequestId(id),
                arrival: Time::from_millis(s.arrival_ms),
                prompt_tokens: s.prompt_tokens,
                max_output_tokens: s.output_tokens,
                block_hashes: Vec::new(),
                resume: None,
                model: Default::default(),
            },
            admitted_at: Time::from_millis(s.admitted_ms),
            first_token_at: Time::from_millis(s.first_token_ms),
            finished_at: Time::from_millis(s.finished_ms),
            output_tokens: s.output_tokens,
            cached_tokens: [s.cached_tokens, 0, 0],
            preemptions: s.preemptions,
            yields: 0,
            paused_wait: Dur::ZERO,
            evictions: 0,
            ended: None,
        }
    }

    /// A request turned away, asking for `output_tokens`.
    fn refused(output_tokens: u32) -> Request {
        Request {
            id: RequestId(99),
            arrival: Time::ZERO,
            prompt_tokens: 10,
            max_output_tokens: output_tokens,
            block_hashes: Vec::new(),
            resume: None,
            model: Default::default(),
        }
    }

    /// Four requests and one rejection; the expected numbers in the tests are worked out by
    /// hand from this table.
    ///
    /// | req | TTFT | TPOT | E2E | queue | SLO (200 ms, 50 ms) |
    /// | --- | --- | --- | --- | --- | --- |
    /// | 0 | 100 | 200/4 = 50 | 300 | 10 | met (TPOT exactly on target) |
    /// | 1 | 300 | 100/2 = 50 | 400 | 0 | missed (TTFT) |
    /// | 2 | 200 | none (1 token) | 200 | 50 | met (TTFT exactly on target) |
    /// | 3 | 50 | 950/10 = 95 | 1000 | 0 | missed (TPOT) |
    fn four_requests_and_a_rejection() -> Metrics {
        let mut m = Metrics::new(SLO);
        let specs = [
            Spec {
                arrival_ms: 0,
                admitted_ms: 10,
                first_token_ms: 100,
                finished_ms: 300,
                prompt_tokens: 1000,
                output_tokens: 5,
                cached_tokens: 500,
                preemptions: 0,
            },
            Spec {
                arrival_ms: 1000,
                admitted_ms: 1000,
                first_token_ms: 1300,
                finished_ms: 1400,
                prompt_tokens: 2000,
                output_tokens: 3,
                cached_tokens: 1000,
                preemptions: 0,
            },
            Spec {
                arrival_ms: 2000,
                admitted_ms: 2050,
                first_token_ms: 2200,
                finished_ms: 2200,
                prompt_tokens: 500,
                output_tokens: 1,
                cached_tokens: 0,
                preemptions: 0,
            },
            Spec {
                arrival_ms: 3000,
                admitted_ms: 3000,
                first_token_ms: 3050,
                finished_ms: 4000,
                prompt_tokens: 500,
                output_tokens: 11,
                cached_tokens: 500,
                preemptions: 2,
            },
        ];
        for (id, spec) in specs.into_iter().enumerate() {
            m.record(&finished(id as u64, spec));
        }
        m.record_rejected(&refused(1));
        m
    }

    /// Percentiles come from a 3-significant-digit histogram: within 0.1% and never below.
    fn assert_percentile(actual: f64, expected: f64) {
        assert!(
            actual >= expected && actual <= expected * 1.001,
            "percentile {actual} is not within 0.1% above {expected}"
        );
    }

    #[test]
    fn summary_of_hand_made_requests_gives_the_hand_computed_numbers() {
        let s = four_requests_and_a_rejection().summary(&COST);

        assert_eq!(s.requests, 4);
        assert_eq!(s.rejected, 1);
        assert_eq!(s.slo_met, 2);
        assert_eq!(s.preemptions, 2);
        assert_eq!(s.input_tokens, 4000);
        assert_eq!(s.output_tokens, 20);
        assert_eq!(s.cached_tokens, 2000);

        // TTFT 100, 300, 200, 50.
        assert_eq!(s.ttft_ms.mean, 162.5);
        assert_percentile(s.ttft_ms.p50, 100.0);
        assert_eq!(s.ttft_ms.p99, 300.0);
        // TPOT 50, 50, 95 (the one-token request has none).
        assert_eq!(s.tpot_ms.mean, 65.0);
        assert_percentile(s.tpot_ms.p50, 50.0);
        assert_eq!(s.tpot_ms.p99, 95.0);
        // E2E 300, 400, 200, 1000; queue 10, 0, 50, 0.
        assert_eq!(s.e2e_ms.mean, 475.0);
        assert_eq!(s.e2e_ms.p99, 1000.0);
        assert_eq!(s.queue_ms.mean, 15.0);
        assert_eq!(s.queue_ms.p99, 50.0);

        // Span 0 → 4000 ms.
        assert_eq!(s.duration_s, 4.0);
        // 2 met out of 4 finished + 1 rejected.
        assert_eq!(s.slo_attainment, 0.4);
        assert_eq!(s.goodput_rps, 0.5);
        assert_eq!(s.throughput_tok_s.input, 1000.0);
        assert_eq!(s.throughput_tok_s.output, 5.0);
        // 2000 cached of 4000 prompt tokens.
        assert_eq!(s.cache_hit_rate, 0.5);
        // 8 GPUs × 4 s; $2 per GPU-hour over 4020 tokens.
        let gpu_hours = 8.0 * 4.0 / 3600.0;
        assert_eq!(s.gpu_hours, gpu_hours);
        assert_eq!(s.cost_per_mtok, gpu_hours * 2.0 / (4020.0 / 1e6));
        assert_eq!(s.slo, SLO);
    }

    #[test]
    fn ended_runaways_miss_the_slo_and_short_outputs_are_measured_apart() {
        let mut m = Metrics::new(SLO);
        let spec = |first_token_ms, finished_ms, output_tokens| Spec {
            arrival_ms: 0,
            admitted_ms: 0,
            first_token_ms,
            finished_ms,
            prompt_tokens: 100,
            output_tokens,
            cached_tokens: 0,
            preemptions: 0,
        };
        // A short output within the SLO, after 30 ms of paused admission.
        let mut short = finished(0, spec(100, 200, 3));
        short.paused_wait = Dur::from_millis(30);
        m.record(&short);
        // A long output within the SLO, evicted once on the way.
        let mut long = finished(1, spec(100, 100 + 40 * (LONG_OUTPUT_TOKENS as u64 - 1), LONG_OUTPUT_TOKENS));
        long.evictions = 1;
        m.record(&long);
        // A long output ended early: within the targets, yet it misses the SLO.
        let mut ended = finished(2, spec(50, 1_050, LONG_OUTPUT_TOKENS));
        ended.output_tokens = 101;
        ended.ended = Some(CutShort::Runaway { generated_here: 101, limit: 100 });
        m.record(&ended);
        // And a short one refused.
        m.record_rejected(&refused(10));
        m.record_eviction();
        m.record_reroute();
        m.record_admission_paused(Dur::from_millis(1_500));
        let s = m.summary(&COST);
        assert_eq!((s.requests, s.rejected, s.slo_met, s.ended_runaway), (3, 1, 2, 1));
        assert_eq!((s.evictions, s.reroutes, s.long_output_requests), (1, 1, 2));
        assert_eq!(s.slo_attainment_short_output, 0.5, "one met of one finished and one refused");
        assert_eq!(s.ttft_ms_short_output.p99, 100.0);
        assert_eq!(s.admission_paused_s, 1.5);
        assert_eq!(s.paused_wait_ms.p99, 30.0);
        assert_eq!(s.paused_wait_ms.p50, 0.0);
    }

    #[test]
    fn an_empty_run_summarizes_to_zeros_and_serializes() {
        let s = Metrics::new(SLO).summary(&COST);
        assert_eq!(s.requests, 0);
        assert_eq!(s.ttft_ms, Percentiles::default());
        assert_eq!(s.tpot_ms, Percentiles::default());
        for x in [
            s.slo_attainment,
            s.goodput_rps,
            s.throughput_tok_s.input,
            s.throughput_tok_s.output,
            s.cache_hit_rate,
            s.gpu_hours,
            s.cost_per_mtok,
            s.duration_s,
        ] {
            assert_eq!(x, 0.0);
        }
        let json = serde_json::to_string(&s).expect("an empty summary serializes");
        assert!(!json.contains("null"), "{json}");
        let back: Summary = serde_json::from_str(&json).expect("and reads back");
        assert_eq!(back, s);
    }

    #[test]
    fn rejections_alone_give_zero_attainment_and_no_nan() {
        let mut m = Metrics::new(SLO);
        m.record_rejected(&refused(1));
        m.record_rejected(&refused(1));
        let s = m.summary(&COST);
        assert_eq!(s.rejected, 2);
        assert_eq!(s.slo_attainment, 0.0);
        assert_eq!(s.goodput_rps, 0.0);
        assert!(m.ttft_cdf().is_empty());
    }

    #[test]
    fn a_nan_price_gives_zero_cost_instead_of_nan() {
        let cost = FleetCost { gpus: 1, price_per_gpu_hour: f64::NAN };
        let s = four_requests_and_a_rejection().summary(&cost);
        assert_eq!(s.cost_per_mtok, 0.0);
    }

    #[test]
    fn summary_json_has_the_documented_keys() {
        let s = four_requests_and_a_rejection().summary(&COST);
        let json = serde_json::to_value(&s).expect("summary serializes");
        let keys: Vec<&str> = json.as_object().expect("summary is an object").keys().map(String::as_str).collect();
        // The documented keys, in order; fields added later come after them.
        let documented = [
            "requests",
            "rejected",
            "ttft_ms",
            "tpot_ms",
            "e2e_ms",
            "queue_ms",
            "slo_attainment",
            "goodput_rps",
            "throughput_tok_s",
            "cache_hit_rate",
            "gpu_hours",
            "cost_per_mtok",
            "duration_s",
            "preemptions",
            "input_tokens",
            "output_tokens",
        ];
        // serde_json without `preserve_order` sorts keys, so compare as sets.
        for key in documented {
            assert!(keys.contains(&key), "missing `{key}` in {keys:?}");
        }
        for latency in ["ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"] {
            let mut fields: Vec<&str> =
                json[latency].as_object().expect("percentiles are an object").keys().map(String::as_str).collect();
            fields.sort_unstable();
            assert_eq!(fields, ["mean", "p50", "p90", "p95", "p99"], "{latency}");
        }
        let mut throughput: Vec<&str> =
            json["throughput_tok_s"].as_object().expect("throughput is an object").keys().map(String::as_str).collect();
        throughput.sort_unstable();
        assert_eq!(throughput, ["input", "output"]);

        // The serialized text (what lands in report files) keeps the declared order.
        let text = serde_json::to_string(&s).expect("summary serializes");
        let positions: Vec<usize> =
            documented.iter().map(|key| text.find(&format!("\"{key}\":")).expect("key present")).collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{text}");
    }

    #[test]
    fn cdfs_rise_from_the_fastest_to_the_slowest_request() {
        let m = four_requests_and_a_rejection();
        let cdf = m.ttft_cdf();
        assert_eq!(cdf.len(), CDF_STEPS + 1);
        assert_eq!(cdf.first(), Some(&(50.0, 0.0)));
        assert_eq!(cdf.last(), Some(&(300.0, 1.0)));
        assert!(cdf.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
        let tpot = m.tpot_cdf();
        assert_eq!(tpot.first(), Some(&(50.0, 0.0)));
        assert_eq!(tpot.last(), Some(&(95.0, 1.0)));
    }

    #[test]
    fn a_latency_beyond_the_histogram_range_saturates_instead_of_panicking() {
        let mut m = Metrics::new(SLO);
        let huge_ms = 2 * MAX_TRACKABLE_US / 1000;
        m.record(&finished(
            0,
            Spec {
                arrival_ms: 0,
                admitted_ms: 0,
                first_token_ms: huge_ms,
                finished_ms: huge_ms,
                prompt_tokens: 1,
                output_tokens: 1,
                cached_tokens: 0,
                preemptions: 0,
            },
        ));
        let s = m.summary(&COST);
        assert_eq!(s.ttft_ms.mean, huge_ms as f64);
        assert!(s.ttft_ms.p99 > 0.0 && s.ttft_ms.p99.is_finite());
    }
}
