//! SLO load: how close each pool of a disaggregated fleet is to missing its latency target.
//!
//! ```text
//! Load_P = max(TTFT_pred, TTFT_actual) / TTFT_target
//! Load_D = max(TPOT_pred, TPOT_inflow, TPOT_actual) / TPOT_target
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
//!   - `TPOT_inflow` = the step time the decode pool will settle at under the requests
//!     entering the fleet now. The decode pool's batch lags its inflow by a prefill and a
//!     transfer, and a prefill pool that grows to clear a queue lets that queue through at
//!     once: sizing decode from its present batch alone starts its instances a start-up time
//!     too late. By Little's law a pool of `n` fed `λ` requests/s of `P` prompt and `O` output
//!     tokens holds `λ/n · O · t` sequences per instance, each with `P + O/2` tokens of KV, and
//!     its step `t = base + per_seq · seqs + per_kv · kv` then solves to
//!     `t = base / (1 − λ/n · O · (per_seq + per_kv · (P + O/2)))`: infinite (the pool
//!     cannot keep up; counted as [`OVERLOAD_LOAD`]) when the bracket reaches 1. `λ` and `P`
//!     are measured as requests are routed, over the short `inflow_window` (prompt lengths
//!     are known on arrival; a shift shows within seconds); `O` is the mean output of the
//!     prefills that ended over the window, as the pairing's KV peak uses it. Stretched by
//!     KV oversubscription like `TPOT_pred`.
//!
//! The tracker is pure: it hears observations with their time and answers at `now`.

use engine::{Dur, Time};
use std::collections::VecDeque;

/// The load counted for a pool whose inflow it cannot keep up with (an unbounded prediction
/// stays finite for the records; growth caps loads lower anyway).
pub const OVERLOAD_LOAD: f64 = 10.0;

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
    /// The window over which requests entering the fleet are counted for `TPOT_inflow`:
    /// short, since a mean length needs only some hundred samples, while a p99 latency needs
    /// thousands.
    pub inflow_window: Dur,
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
    /// The decode step the pool settles at under the present inflow (see the module doc).
    #[serde(default)]
    pub tpot_inflow_ms: f64,
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

    fn mean(&self) -> Option<f64> {
        (!self.samples.is_empty()).then(|| self.sum() / self.samples.len() as f64)
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
    /// Prompt tokens of the requests routed to the prefill pool, by time (over `inflow_window`).
    routed_prompts: Window,
    /// Output tokens of the requests whose prefill ended, by time.
    outputs: Window,
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
            routed_prompts: Window::default(),
            outputs: Window::default(),
            prefill_idle_at: None,
            scratch: Vec::new(),
        }
    }

    pub fn config(&self) -> &SloLoadConfig {
        &self.config
    }

    /// A request of `prompt_tokens` was routed to the prefill pool at `now`.
    pub fn on_routed(&mut self, now: Time, prompt_tokens: u32) {
        self.routed_prompts.push(now, f64::from(prompt_tokens));
    }

    /// Takes back the last [`SloLoad::on_routed`] (its request was not taken).
    pub fn on_unrouted(&mut self, prompt_tokens: u32) {
        let last = self.routed_prompts.samples.pop_back();
        debug_assert_eq!(last.map(|(_, v)| v), Some(f64::from(prompt_tokens)), "unrouted what was not routed last");
    }

    /// A prefill of `prompt_tokens` tokens ended at `now`, its first token `ttft` after
    /// arrival, for a request of `output_tokens`.
    pub fn on_prefill_done(&mut self, now: Time, prompt_tokens: u64, output_tokens: u32, ttft: Dur) {
        self.ttft_ms.push(now, ttft.as_millis_f64());
        self.prefilled_tokens.push(now, prompt_tokens as f64);
        self.outputs.push(now, f64::from(output_tokens));
    }

    /// A request finished at `now` with mean time per output token `tpot`.
    pub fn on_finished(&mut self, now: Time, tpot: Dur) {
        self.tpot_ms.push(now, tpot.as_millis_f64());
    }

    /// The loads at `now` given the pools' state.
    pub fn loads(&mut self, now: Time, pools: &PoolState) -> Loads {
        let c = self.config;
        for w in [&mut self.ttft_ms, &mut self.tpot_ms, &mut self.prefilled_tokens, &mut self.outputs] {
            w.expire(now, c.window);
        }
        self.routed_prompts.expire(now, c.inflow_window);
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
        let tpot_inflow_ms = self.inflow_step_ms(pools);

        let ttft_actual_ms = self.ttft_ms.quantile(c.quantile, &mut self.scratch);
        let tpot_actual_ms = self.tpot_ms.quantile(c.quantile, &mut self.scratch);
        Loads {
            load_p: ttft_pred_ms.max(ttft_actual_ms) / c.ttft_target_ms,
            load_d: tpot_pred_ms.max(tpot_inflow_ms).max(tpot_actual_ms) / c.tpot_target_ms,
            ttft_pred_ms,
            ttft_actual_ms,
            tpot_pred_ms,
            tpot_actual_ms,
            tpot_inflow_ms,
            util_p: measured / c.nominal_prefill_tokens_per_s.max(1.0),
            util_d: tpot_pred_ms / c.tpot_target_ms,
        }
    }

    /// `TPOT_inflow` (see the module doc); 0 before anything was routed and finished a prefill.
    fn inflow_step_ms(&self, pools: &PoolState) -> f64 {
        let c = &self.config;
        let (Some(prompt), Some(output)) = (self.routed_prompts.mean(), self.outputs.mean()) else { return 0.0 };
        let per_instance_rps = self.routed_prompts.samples.len() as f64
            / c.inflow_window.as_secs_f64().max(1e-6)
            / f64::from(pools.decode_serving.max(1));
        let kv_per_seq = prompt + output / 2.0;
        let busy = per_instance_rps * output * (c.decode.per_seq_us + c.decode.per_kv_token_us * kv_per_seq) * 1e-6;
        let overload_ms = OVERLOAD_LOAD * c.tpot_target_ms;
        if busy >= 1.0 {
            return overload_ms;
        }
        let step_us = c.decode.base_us / (1.0 - busy);
        let capacity = pools.decode_capacity_tokens as f64 / f64::from(pools.decode_serving.max(1));
        let kv = per_instance_rps * output * step_us * 1e-6 * kv_per_seq;
        let oversubscribed = if capacity > 0.0 { (kv / capacity).max(1.0) } else { 1.0 };
        (step_us / 1e3 * oversubscribed).min(overload_ms)
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
            inflow_window: Dur::from_millis(5_000),
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
            s.on_prefill_done(Time::from_millis(i * 100), 100, 1, Dur::from_millis(1500));
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
            s.on_prefill_done(Time::from_millis(i * 1000), 5_000, 1, Dur::from_millis(10));
        }
        let l = s.loads(Time::from_millis(10_000), &pools);
        assert_eq!(l.ttft_pred_ms, 1000.0);
    }

    #[test]
    fn decode_load_counts_the_inflow_before_the_batch_holds_it() {
        let mut s = SloLoad::new(config());
        // 10 ms base, 0.1 ms per sequence. Outputs of 900 tokens at 20 requests/s on 2
        // instances keep 10 × 900 × t sequences each: t = 10 ms / (1 − 10 × 900 × 0.1e-3) = 100 ms.
        let pools = PoolState { decode_serving: 2, ..PoolState::default() };
        for i in 0..100 {
            s.on_routed(Time::from_millis(i * 50), 1_000);
            s.on_prefill_done(Time::from_millis(i * 50), 1_000, 900, Dur::from_millis(10));
        }
        let l = s.loads(Time::from_millis(5_000), &pools);
        assert!((l.tpot_inflow_ms - 100.0).abs() < 1e-6, "{l:?}");
        assert_eq!(l.tpot_pred_ms, 0.0, "the batch is still empty");
        assert!((l.load_d - 2.0).abs() < 1e-6);
        // Twice the inflow is more than the pool can keep up with: counted as overload.
        for i in 0..100 {
            s.on_routed(Time::from_millis(i * 50), 1_000);
        }
        assert_eq!(s.loads(Time::from_millis(5_000), &pools).load_d, OVERLOAD_LOAD);
        // Requests routed before the inflow window no longer count.
        assert_eq!(s.loads(Time::from_millis(10_001), &pools).tpot_inflow_ms, 0.0);
    }
}
