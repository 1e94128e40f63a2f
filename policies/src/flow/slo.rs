//! `slo`: flow control sized by the SLO, in predicted seconds rather than request counts.
//!
//! **Room.** An instance has room for a request of class `c` when, with `h(c)` the class's
//! headroom (1 for interactive, `standard_headroom`, `batch_headroom`) and the tightest
//! targets among the classes:
//!
//! ```text
//! queue_s  = (prefill tokens left in its last report + prompt tokens routed since) / R
//!          ≤ h(c) × queue_share × TTFT target
//! kv_share = (KV in use + prompt and output tokens still to come + tokens routed since)
//!            / KV capacity ≤ h(c) × kv_share
//! step_s   = D(in flight + 1, KV tokens + prompt) ≤ h(c) × step_share × TPOT target
//!            (colocated and decode instances; a prefill instance decodes nothing)
//! ```
//!
//! and has not paused admission; an instance holding nothing of ours always has room (a
//! stale report cannot hold the queue forever). The fleet has room when one candidate
//! instance does. Lower headroom for lower classes keeps a margin free that only
//! interactive work can take, so a burst of it finds short queues and free KV although
//! batch work keeps the fleet busy. `R` and `D` are the cost model's (see
//! [`CostHints`]); routed-since counts are the controller's own, so a burst released
//! between two reports does not overrun the limits as a report-only rule would.
//!
//! **Order.** Least slack first: a request's latest start is its due time (its deadline,
//! else arrival + its class's TTFT target) less its predicted prefill (`prompt / R`).
//! Once that has passed it is late, and goes behind the band's requests that can still be
//! served in time (serving the late ones first would make every request late under a
//! sustained overload).
//!
//! **Fairness.** Least attained service over weighted tokens, decayed with
//! `usage_half_life`, between the tenants of a band (see [`Fairness::LeastAttained`]); a
//! request of a tenant that has had less than every tenant waiting in its band does not
//! wait behind them. A tenant clearly over an equal share of the recent service fills only
//! `over_share_queue` of the queue limit above (and `over_share_batch` of the KV and step
//! limits: 1 by default, since cutting them shrinks its batches and throughput more than it
//! helps the others), which keeps queues short for the others: a light tenant's requests are placed
//! at once onto short queues although a heavy one keeps the fleet busy. A tenant clearly
//! under its share has its requests lifted (`engine::Service::lift`): engines with class
//! priority serve them one class higher, so their prompts go first in the steps.
//!
//! **Shedding.** Sheddable (batch) requests wait at most `batch_max_wait_s`, and not past
//! their deadline's latest start; then they are shed with a retry-after.

use super::{Fairness, FlowRule, Targets};
use crate::router::CostHints;
use crate::view::{FleetView, Role};
use engine::{Class, Dur, Request, Time};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SloFlowConfig {
    /// Share of the TTFT target an instance's predicted queue may reach.
    pub queue_share: f64,
    /// Share of the TPOT target its predicted decode step may reach.
    pub step_share: f64,
    /// Share of its KV that may be in use.
    pub kv_share: f64,
    /// The limits' share standard requests may fill.
    pub standard_headroom: f64,
    /// The limits' share batch requests may fill.
    pub batch_headroom: f64,
    /// Longest a batch request waits for room before it is shed.
    pub batch_max_wait: Dur,
    /// An output token's weight against a prompt token in a tenant's attained service.
    pub output_weight: f64,
    /// Half-life of a tenant's attained service.
    pub usage_half_life: Dur,
    /// The share of the queue limit a tenant over its share of the recent service may fill.
    pub over_share_queue: f64,
    /// The share of the KV and decode step limits it may fill.
    pub over_share_batch: f64,
    /// Requests one band's queue holds at most.
    pub queue_limit: u32,
    /// While an interactive request decodes, an engine computes at most this share of the
    /// interactive TPOT target of lower classes' prompts per step (see
    /// `engine::InstanceConfig::lower_class_step_tokens`).
    pub lower_chunk_share: f64,
    /// Share of the candidates' GPU KV the contexts of agent sessions in progress may fill
    /// before a new session's first turn waits (0: no admission by program; see
    /// [`super::programs`]).
    pub program_kv_share: f64,
    /// A session with no turn placed for this long is no longer in progress.
    pub program_idle: Dur,
    /// 1: when the program at the head does not fit, the waiting one that best fits goes
    /// (best-fit-decreasing); 2: also, programs in progress that outgrow the share pause,
    /// shortest first; 0: neither (see [`super::programs`]).
    pub program_packing: u32,
}

impl Default for SloFlowConfig {
    fn default() -> Self {
        SloFlowConfig {
            queue_share: 0.05,
            step_share: 0.8,
            kv_share: 0.9,
            standard_headroom: 0.9,
            batch_headroom: 0.7,
            batch_max_wait: Dur::from_secs_f64(60.0),
            output_weight: 4.0,
            usage_half_life: Dur::from_secs_f64(10.0),
            over_share_queue: 0.3,
            over_share_batch: 1.0,
            queue_limit: 100_000,
            lower_chunk_share: 0.5,
            program_kv_share: 0.0,
            program_idle: Dur::from_secs_f64(30.0),
            program_packing: 0,
        }
    }
}

crate::params!(SloFlowConfig, "slo", {
    queue_share: float above 0.0 ..= 4.0, "share of the TTFT target an instance's predicted prefill queue may reach before it has no room";
    step_share: float above 0.0 ..= 4.0, "share of the TPOT target its predicted decode step may reach";
    kv_share: float above 0.0 ..= 1.0, "share of its KV that may be in use";
    standard_headroom: float above 0.0 ..= 1.0, "share of those limits standard requests may fill (interactive: all)";
    batch_headroom: float above 0.0 ..= 1.0, "share of those limits batch requests may fill";
    batch_max_wait: seconds from 0.0 ..= 86400.0, "longest a batch request waits for room before it is shed";
    output_weight: float from 0.0 ..= 64.0, "an output token's weight against a prompt token in a tenant's attained service";
    usage_half_life: seconds above 0.0 ..= 86400.0, "half-life of a tenant's attained service (what it had long ago stops counting)";
    over_share_queue: float above 0.0 ..= 1.0, "share of the queue limit a tenant over an equal share of the recent service may fill";
    over_share_batch: float above 0.0 ..= 1.0, "share of the KV and decode step limits a tenant over an equal share of the recent service may fill";
    queue_limit: integer from 1.0 ..= 10000000.0, "requests one band's queue holds at most";
    lower_chunk_share: float above 0.0 ..= 100.0, "while an interactive request decodes, lower classes' prompt tokens per engine step: this share of the interactive TPOT target at the prefill rate";
    program_kv_share: float from 0.0 ..= 4.0, "share of the GPU KV the contexts of agent sessions in progress may fill before a new session waits (0: off)";
    program_idle: seconds above 0.0 ..= 86400.0, "a session with no turn for this long is no longer in progress";
    program_packing: integer from 0 ..= 2, "1: when the session at the head does not fit program_kv_share, the waiting one that best fits starts (best-fit-decreasing); 2: also, sessions that outgrow it pause, shortest first";
});

impl SloFlowConfig {
    /// The engines' cap on lower classes' prompt tokens per step while an interactive
    /// request decodes: `lower_chunk_share × interactive TPOT target × R`, at least a block.
    pub fn lower_class_step_tokens(&self, hints: &CostHints, interactive: &Targets) -> u32 {
        let tokens = self.lower_chunk_share * interactive.tpot.as_secs_f64() * hints.prefill_tokens_per_s;
        (tokens.min(f64::from(u32::MAX)) as u32).max(hints.block_size)
    }
}

#[derive(Debug)]
pub struct SloFlow {
    config: SloFlowConfig,
    hints: CostHints,
    targets: [Targets; 3],
    /// The tightest targets among the classes, in seconds.
    ttft_s: f64,
    tpot_s: f64,
}

impl SloFlow {
    pub fn new(config: SloFlowConfig, hints: CostHints, targets: [Targets; 3]) -> SloFlow {
        let ttft_s = targets.iter().map(|t| t.ttft.as_secs_f64()).fold(f64::INFINITY, f64::min);
        let tpot_s = targets.iter().map(|t| t.tpot.as_secs_f64()).fold(f64::INFINITY, f64::min);
        SloFlow { config, hints, targets, ttft_s, tpot_s }
    }

    fn headroom(&self, class: Class) -> f64 {
        match class {
            Class::Interactive => 1.0,
            Class::Standard => self.config.standard_headroom,
            Class::Batch => self.config.batch_headroom,
        }
    }

    fn prefill(&self, request: &Request) -> Dur {
        Dur::from_secs_f64(f64::from(request.prompt_tokens) / self.hints.prefill_tokens_per_s)
    }

    /// The latest time its prefill may start and still meet its due time.
    fn latest_start(&self, request: &Request) -> Time {
        let due = request
            .service
            .deadline(request.arrival)
            .unwrap_or(request.arrival + self.targets[request.service.class.index()].ttft);
        Time(due.0.saturating_sub(self.prefill(request).0))
    }
}

impl FlowRule for SloFlow {
    fn name(&self) -> &'static str {
        "slo"
    }

    fn has_room(&self, view: &FleetView, request: &Request, over_share: bool) -> bool {
        let (c, h) = (&self.config, &self.hints);
        let share = self.headroom(request.service.class);
        // A tenant over its share leaves room to the others: queue room (their requests find
        // short queues) and, if `over_share_batch` is set below 1, KV and decode room (their
        // prompts' steps carry fewer of its sequences, but smaller batches lose throughput).
        let (queue_scale, batch_scale) = if over_share { (c.over_share_queue, c.over_share_batch) } else { (1.0, 1.0) };
        let queue_limit_s = share * queue_scale * c.queue_share * self.ttft_s;
        let step_limit_us = share * batch_scale * c.step_share * self.tpot_s * 1e6;
        let kv_limit = share * batch_scale * c.kv_share;
        let bs = u64::from(h.block_size);
        view.candidates(request).any(|v| {
            if v.in_flight == 0 {
                return true;
            }
            if v.admission_paused() {
                return false;
            }
            let queue_s = (v.load.prefill_tokens_left + v.prompt_since_report) as f64 / h.prefill_tokens_per_s;
            // What the requests there will hold: KV in use, the prompts and outputs still to
            // come (as reported), and what was routed since the report.
            let kv_tokens = u64::from(v.load.kv_used_blocks) * bs
                + v.load.prefill_tokens_left
                + v.load.decode_tokens_left
                + v.routed_since_report;
            let kv_capacity = match v.load.kv_total_blocks {
                0 => v.capacity_tokens,
                n => u64::from(n) * bs,
            };
            let kv_ok = kv_tokens as f64 <= kv_limit * kv_capacity as f64;
            let step_ok = v.role == Role::Prefill
                || h.decode
                    .step_us(f64::from(v.in_flight) + 1.0, (kv_tokens + u64::from(request.prompt_tokens)) as f64)
                    <= step_limit_us;
            queue_s <= queue_limit_s && kv_ok && step_ok
        })
    }

    fn order(&self, request: &Request) -> i64 {
        self.latest_start(request).0 as i64
    }

    fn late_at(&self, request: &Request) -> Option<Time> {
        Some(self.latest_start(request))
    }

    fn shed_at(&self, request: &Request) -> Option<Time> {
        if !request.service.class.sheddable() {
            return None;
        }
        let waited = request.arrival + self.config.batch_max_wait;
        Some(match request.service.deadline_ms {
            Some(_) => waited.min(self.latest_start(request)),
            None => waited,
        })
    }

    fn shed_when_full(&self) -> bool {
        false
    }

    fn fairness(&self) -> Fairness {
        Fairness::LeastAttained { output_weight: self.config.output_weight, half_life: self.config.usage_half_life }
    }

    fn queue_limit(&self) -> usize {
        self.config.queue_limit as usize
    }

    fn program_admission(&self) -> Option<(f64, Dur, super::programs::Packing)> {
        let c = &self.config;
        let packing = super::programs::Packing::of(c.program_packing);
        (c.program_kv_share > 0.0).then_some((c.program_kv_share, c.program_idle, packing))
    }
}
