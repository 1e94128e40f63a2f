//! SLO load: how close each pool of a disaggregated fleet is to missing its latency target.
//!
//! ```text
//! Load_P = max(TTFT_pred, TTFT_actual) / TTFT_target
//! Load_D = max(TPOT_pred, TPOT_actual) / TPOT_target
//! ```
//!
//! A load of 1 means the pool is at its target; above 1 it misses it.
//!
//! - **Actuals** are a high quantile ([`SloLoadConfig::quantile`]) of the latencies observed
//!   over a sliding window ([`SloLoadConfig::window`]): TTFT when a prefill ends, TPOT when a
//!   request finishes. They say what already happened, so they lag.
//! - **Predictions** look at the queues now, so that a burst shows before it hurts (an
//!   autoscaler blind to queueing, like Dynamo's Planner, reacts only once latency has
//!   already gone up):
//!   - `TTFT_pred` = prompt tokens waiting or being computed on the prefill pool, per serving
//!     instance, over one instance's service rate. The rate is measured (prompt tokens
//!     completed per second over the window, per instance) when the pool stayed busy for the
//!     whole window, since only then does throughput equal capacity; otherwise it is the
//!     cost model's nominal rate ([`crate::CostHints::prefill_tokens_per_s`]).
//!   - `TPOT_pred` = the step time of the mean decode batch from [`DecodeModel`], counting
//!     the requests handed off and still waiting for a decode instance, stretched by the KV
//!     demand over the pool's KV capacity when demand exceeds it (requests beyond capacity
//!     wait, or are preempted and recomputed, which costs their tokens as much as a slower
//!     step).
//!
//! The tracker is pure: it hears observations with their time and answers at `now`.

use engine::{Dur, Time};
use std::collections::VecDeque;

/// Latency samples kept per window at most; beyond it the oldest go first (the bound keeps
/// memory fixed under any rate; at 50,000 samples the quantile is still exact enough).
const MAX_SAMPLES: usize = 50_000;

/// How a decode step's time grows with its batch, from the cost model: what the controller
/// needs to predict TPOT without knowing the hardware.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DecodeModel {
    /// A step of one sequence with almost no context (weights read once).
    pub base_us: f64,
    /// Added per sequence in the batch.
    pub per_seq_us: f64,
    /// Added per token of KV the batch attends over.
    pub per_kv_token_us: f64,
}

impl DecodeModel {
    /// Predicted step time of a batch of `seqs` sequences holding `kv_tokens` tokens of KV.
    pub fn step_us(&self, seqs: f64, kv_tokens: f64) -> f64 {
        if seqs <= 0.0 {
            return 0.0;
        }
        self.base_us + self.per_seq_us * seqs + self.per_kv_token_us * kv_tokens
    }
}

impl Default for DecodeModel {
    /// Llama-3.1-8B on one H100, roughly: 6 ms to read the weights, a little per sequence,
    /// and the KV read per token.
    fn default() -> Self {
        DecodeModel { base_us: 6_000.0, per_seq_us: 20.0, per_kv_token_us: 0.04 }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SloLoadConfig {
    pub ttft_target_ms: f64,
    pub tpot_target_ms: f64,
    /// The sliding window of actual latencies and measured rates.
    pub window: Dur,
    /// The quantile of the window's latencies taken as the actual (0.95: the SLO must hold
    /// for nearly all requests, not the median).
    pub quantile: f64,
    pub decode: DecodeModel,
    /// Prompt tokens one prefill instance computes per second at a full batch.
    pub nominal_prefill_tokens_per_s: f64,
}

/// What the tracker needs to know of the fleet at `now`, from the controller's view.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PoolState {
    pub prefill_serving: u32,
    /// Prompt tokens waiting or being computed on the prefill pool (reported plus routed since).
    pub prefill_backlog_tokens: u64,
    pub decode_serving: u32,
    /// Sequences running or waiting on the decode pool, plus handoffs waiting for a place.
    pub decode_seqs: u64,
    /// KV tokens held on the decode pool plus those of handoffs waiting for a place.
    pub decode_kv_tokens: u64,
    /// KV tokens the serving decode instances hold in all.
    pub decode_capacity_tokens: u64,
}

/// The loads and the terms they come from, as recorded with every scaling decision.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Loads {
    pub load_p: f64,
    pub load_d: f64,
    pub ttft_pred_ms: f64,
    pub ttft_actual_ms: f64,
    pub tpot_pred_ms: f64,
    pub tpot_actual_ms: f64,
    /// Prefill utilization: prompt tokens computed per second over the window, per serving
    /// instance, over the nominal rate. What a pool could shed, which latency cannot tell.
    pub util_p: f64,
    /// Decode utilization: `TPOT_pred / TPOT_target`.
    pub util_d: f64,
}

/// One window of timed samples.
#[derive(Clone, Debug, Default)]
struct Window {
    samples: VecDeque<(Time, f64)>,
}

impl Window {
    fn push(&mut self, at: Time, value: f64) {
        if self.samples.len() == MAX_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((at, value));
    }

    fn expire(&mut self, now: Time, window: Dur) {
        while self.samples.front().is_some_and(|&(t, _)| now.since(t) > window) {
            self.samples.pop_front();
        }
    }

    fn quantile(&self, q: f64, scratch: &mut Vec<f64>) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        scratch.clear();
        scratch.extend(self.samples.iter().map(|&(_, v)| v));
        let k = ((scratch.len() - 1) as f64 * q).round() as usize;
        let (_, v, _) = scratch.select_nth_unstable_by(k, f64::total_cmp);
        *v
    }

    fn sum(&self) -> f64 {
        self.samples.iter().map(|&(_, v)| v).sum()
    }
}

/// Tracks the inputs of `Load_P` and `Load_D` (see the module doc).
#[derive(Clone, Debug)]
pub struct SloLoad {
    config: SloLoadConfig,
    ttft_ms: Window,
    tpot_ms: Window,
    /// Prompt tokens whose prefill ended, by time: the measured prefill throughput.
    prefilled_tokens: Window,
    /// When the prefill pool last had no backlog (per instance below one batch's worth is
    /// counted as idle); `None` before the first observation.
    prefill_idle_at: Option<Time>,
    scratch: Vec<f64>,
}

impl SloLoad {
    /// New targets, from the next evaluation on (the windows' samples are kept: they are
    /// latencies, not loads).
    pub fn set_targets(&mut self, ttft_target_ms: f64, tpot_target_ms: f64) {
        self.config.ttft_target_ms = ttft_target_ms;
        self.config.tpot_target_ms = tpot_target_ms;
    }

    pub fn new(config: SloLoadConfig) -> SloLoad {
        SloLoad {
            config,
            ttft_ms: Window::default(),
            tpot_ms: Window::default(),
            prefilled_tokens: Window::default(),
            prefill_idle_at: None,
            scratch: Vec::new(),
        }
    }

    pub fn config(&self) -> &SloLoadConfig {
        &self.config
    }

    /// A prefill of `prompt_tokens` tokens ended at `now`, its first token `ttft` after arrival.
    pub fn on_prefill_done(&mut self, now: Time, prompt_tokens: u64, ttft: Dur) {
        self.ttft_ms.push(now, ttft.as_millis_f64());
        self.prefilled_tokens.push(now, prompt_tokens as f64);
    }

    /// A request finished at `now` with mean time per output token `tpot`.
    pub fn on_finished(&mut self, now: Time, tpot: Dur) {
        self.tpot_ms.push(now, tpot.as_millis_f64());
    }

    /// The loads at `now` given the pools' state.
    pub fn loads(&mut self, now: Time, pools: &PoolState) -> Loads {
        let c = self.config;
        for w in [&mut self.ttft_ms, &mut self.tpot_ms, &mut self.prefilled_tokens] {
            w.expire(now, c.window);
        }
        // Busy for the whole window: throughput over it is the pool's capacity.
        let prefill_instances = f64::from(pools.prefill_serving.max(1));
        let backlog_per_instance = pools.prefill_backlog_tokens as f64 / prefill_instances;
        if backlog_per_instance < 1.0 || self.prefill_idle_at.is_none() {
            self.prefill_idle_at = Some(now);
        }
        let busy_window = self.prefill_idle_at.is_some_and(|t| now.since(t) >= c.window);
        let measured = self.prefilled_tokens.sum() / c.window.as_secs_f64().max(1e-6) / prefill_instances;
        let rate = if busy_window && measured > 0.0 { measured } else { c.nominal_prefill_tokens_per_s };
        let ttft_pred_ms = backlog_per_instance / rate.max(1.0) * 1e3;

        let decode_instances = f64::from(pools.decode_serving.max(1));
        let seqs = pools.decode_seqs as f64 / decode_instances;
        let kv = pools.decode_kv_tokens as f64 / decode_instances;
        let oversubscribed = if pools.decode_capacity_tokens > 0 {
            (pools.decode_kv_tokens as f64 / pools.decode_capacity_tokens as f64).max(1.0)
        } else {
            1.0
        };
        let tpot_pred_ms = c.decode.step_us(seqs, kv) / 1e3 * oversubscribed;

        let ttft_actual_ms = self.ttft_ms.quantile(c.quantile, &mut self.scratch);
        let tpot_actual_ms = self.tpot_ms.quantile(c.quantile, &mut self.scratch);
        Loads {
            load_p: ttft_pred_ms.max(ttft_actual_ms) / c.ttft_target_ms,
            load_d: tpot_pred_ms.max(tpot_actual_ms) / c.tpot_target_ms,
            ttft_pred_ms,
            ttft_actual_ms,
            tpot_pred_ms,
            tpot_actual_ms,
            util_p: measured / c.nominal_prefill_tokens_per_s.max(1.0),
            util_d: tpot_pred_ms / c.tpot_target_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SloLoadConfig {
        SloLoadConfig {
            ttft_target_ms: 1000.0,
            tpot_target_ms: 50.0,
            window: Dur::from_millis(10_000),
            quantile: 0.9,
            decode: DecodeModel { base_us: 10_000.0, per_seq_us: 100.0, per_kv_token_us: 0.0 },
            nominal_prefill_tokens_per_s: 10_000.0,
        }
    }

    #[test]
    fn an_idle_fleet_has_no_load() {
        let mut s = SloLoad::new(config());
        let l = s.loads(Time::ZERO, &PoolState { prefill_serving: 2, decode_serving: 2, ..PoolState::default() });
        assert_eq!((l.load_p, l.load_d), (0.0, 0.0));
    }

    #[test]
    fn a_backlog_raises_load_p_before_any_request_is_late() {
        let mut s = SloLoad::new(config());
        // 40,000 prompt tokens queued on 2 instances of 10,000 tokens/s: 2 s to clear.
        let pools = PoolState { prefill_serving: 2, prefill_backlog_tokens: 40_000, ..PoolState::default() };
        let l = s.loads(Time::ZERO, &pools);
        assert_eq!(l.ttft_actual_ms, 0.0);
        assert_eq!(l.ttft_pred_ms, 2000.0);
        assert_eq!(l.load_p, 2.0);
    }

    #[test]
    fn actual_latencies_count_within_the_window_only() {
        let mut s = SloLoad::new(config());
        for i in 0..10 {
            s.on_prefill_done(Time::from_millis(i * 100), 100, Dur::from_millis(1500));
            s.on_finished(Time::from_millis(i * 100), Dur::from_millis(100));
        }
        let pools = PoolState { prefill_serving: 1, decode_serving: 1, ..PoolState::default() };
        let l = s.loads(Time::from_millis(2_000), &pools);
        assert_eq!((l.load_p, l.load_d), (1.5, 2.0));
        let l = s.loads(Time::from_millis(20_000), &pools);
        assert_eq!((l.load_p, l.load_d), (0.0, 0.0), "samples older than the window are gone");
    }

    #[test]
    fn decode_prediction_grows_with_the_batch_and_with_kv_oversubscription() {
        let mut s = SloLoad::new(config());
        let mut pools =
            PoolState { decode_serving: 2, decode_seqs: 200, decode_capacity_tokens: 1_000, ..PoolState::default() };
        // 100 sequences per instance: 10 ms + 100 × 0.1 ms = 20 ms.
        assert_eq!(s.loads(Time::ZERO, &pools).tpot_pred_ms, 20.0);
        pools.decode_kv_tokens = 3_000;
        assert_eq!(s.loads(Time::ZERO, &pools).tpot_pred_ms, 60.0);
    }

    #[test]
    fn a_pool_busy_for_a_whole_window_is_judged_by_its_measured_rate() {
        let mut s = SloLoad::new(config());
        let pools = PoolState { prefill_serving: 1, prefill_backlog_tokens: 5_000, ..PoolState::default() };
        s.loads(Time::ZERO, &pools);
        // Busy for 10 s while completing only 5,000 tokens/s: half the nominal rate.
        for i in 1..=10 {
            s.on_prefill_done(Time::from_millis(i * 1000), 5_000, Dur::from_millis(10));
        }
        let l = s.loads(Time::from_millis(10_000), &pools);
        assert_eq!(l.ttft_pred_ms, 1000.0);
    }
}
