//! The controller's part in a disaggregated (P/D) fleet: placing each request's decode when
//! its prefill ends, tracking the SLO load, and sizing the two pools.
//!
//! The controller owns a [`Pd`] when built with [`crate::Controller::with_pools`]; this
//! module holds everything that only a P/D fleet needs, so that a colocated controller does
//! exactly what it did before.
//!
//! - **Handoffs.** `PrefillDone` queues the request; at the next tick (the deadline is `now`)
//!   each queued request is paired with a decode instance ([`crate::pairing`]) and sent with
//!   `Command::Transfer`, in arrival order; when none has room the queue waits for a decode
//!   instance's next load report. A refused transfer goes back to the head of the queue.
//! - **Scaling.** Every `tick`, the loads are computed ([`crate::slo_load`]) and the
//!   autoscaler asked; growth becomes `Command::Start` within the GPU budget (instances
//!   starting, serving and draining all hold GPUs), shrinking becomes `Command::Drain` of the
//!   instances with the fewest requests in flight (the newest on ties). Every change is
//!   recorded as a [`ScalingEvent`] with the loads that caused it.

use crate::autoscaler::{Autoscaler, AutoscalerConfig, PoolSize, Scale, ScaleInput};
use crate::fleet::Command;
use crate::pairing::{pick_decode, KvNeed, Reserved, TransferHints};
use crate::slo_load::{Loads, PoolState, SloLoad, SloLoadConfig};
use crate::view::{FleetView, InstanceState, Role};
use engine::{Dur, InstanceId, RequestId, Time};
use std::collections::VecDeque;

/// Scaling decisions kept at most (the log is part of a run's output).
const MAX_SCALING_EVENTS: usize = 10_000;

/// How the controller runs a disaggregated fleet.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PdConfig {
    pub slo: SloLoadConfig,
    pub autoscaler: AutoscalerConfig,
    /// GPUs the fleet may hold at once.
    pub gpu_budget: u32,
    pub gpus_per_instance: u32,
    /// Fewest serving instances per pool.
    pub min_per_pool: u32,
    /// Period of the scaling decisions (and of the loads' evaluation).
    pub tick: Dur,
    pub transfer: TransferHints,
    pub block_size: u32,
}

/// One scaling decision: a pool went from `from` to `to` planned instances.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScalingEvent {
    pub at_s: f64,
    pub pool: Role,
    pub from: u32,
    pub to: u32,
    pub autoscaler: String,
    pub reason: String,
    /// The loads when it was decided.
    pub loads: Loads,
}

/// The pools and loads as of the last tick.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PdStatus {
    pub loads: Loads,
    pub prefill: PoolSize,
    pub decode: PoolSize,
    /// Requests whose prefill ended, waiting for a decode instance.
    pub waiting_handoffs: u32,
}

#[derive(Clone, Copy, Debug)]
struct Handoff {
    request: RequestId,
    from: InstanceId,
    need: KvNeed,
    output_tokens: u32,
}

pub(crate) struct Pd {
    config: PdConfig,
    slo: SloLoad,
    scaler: Box<dyn Autoscaler>,
    /// Prefills ended, waiting for a decode instance, in order.
    waiting: VecDeque<Handoff>,
    /// Transfers under way (to recover a refused one).
    moving: Vec<(Handoff, InstanceId)>,
    /// When the waiting queue should be tried again (something changed); `None`: not before
    /// the next change.
    retry_at: Option<Time>,
    next_tick: Time,
    /// Instances asked for and not up yet, by role (prefill, decode).
    starting: [u32; 2],
    reserved: Vec<Reserved>,
    status: PdStatus,
    log: Vec<ScalingEvent>,
    /// Whether this controller sizes the pools (of several live replicas only the leader
    /// does); the loads are computed either way.
    autoscaling: bool,
}

fn pool_index(role: Role) -> Option<usize> {
    match role {
        Role::Prefill => Some(0),
        Role::Decode => Some(1),
        Role::Colocated => None,
    }
}

impl Pd {
    pub(crate) fn new(config: PdConfig) -> Pd {
        Pd {
            slo: SloLoad::new(config.slo),
            scaler: config.autoscaler.build(),
            config,
            waiting: VecDeque::new(),
            moving: Vec::new(),
            retry_at: None,
            next_tick: Time::ZERO,
            starting: [0; 2],
            reserved: Vec::new(),
            status: PdStatus::default(),
            log: Vec::new(),
            autoscaling: true,
        }
    }

    pub(crate) fn set_slo_targets(&mut self, ttft_ms: f64, tpot_ms: f64) {
        self.config.slo.ttft_target_ms = ttft_ms;
        self.config.slo.tpot_target_ms = tpot_ms;
        self.slo.set_targets(ttft_ms, tpot_ms);
    }

    pub(crate) fn set_autoscaler(&mut self, autoscaler: AutoscalerConfig) {
        self.config.autoscaler = autoscaler;
        self.scaler = autoscaler.build();
    }

    pub(crate) fn set_autoscaling(&mut self, on: bool) {
        self.autoscaling = on;
    }

    pub(crate) fn status(&self) -> PdStatus {
        self.status
    }

    pub(crate) fn scaling_events(&self) -> &[ScalingEvent] {
        &self.log
    }

    pub(crate) fn next_deadline(&self) -> Option<Time> {
        Some(self.retry_at.map_or(self.next_tick, |r| r.min(self.next_tick)))
    }

    /// An instance announced its role: if it was one the controller asked for, it is up now.
    pub(crate) fn on_role(&mut self, role: Role, new: bool) {
        if let (Some(i), true) = (pool_index(role), new) {
            self.starting[i] = self.starting[i].saturating_sub(1);
        }
    }

    /// An instance asked for will not come: the pool may ask again.
    pub(crate) fn on_start_failed(&mut self, role: Role) {
        if let Some(i) = pool_index(role) {
            self.starting[i] = self.starting[i].saturating_sub(1);
        }
    }

    /// Whether prefills wait for a decode instance (a decode instance's load retries them).
    pub(crate) fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    pub(crate) fn on_load(&mut self, now: Time, instance: InstanceId, role: Role) {
        if let Some(r) = self.reserved.get_mut(instance.0 as usize) {
            *r = Reserved::default();
        }
        if role == Role::Decode && !self.waiting.is_empty() {
            self.retry_at.get_or_insert(now);
        }
    }

    pub(crate) fn on_prefill_done(
        &mut self,
        now: Time,
        from: InstanceId,
        request: RequestId,
        kv_tokens: u64,
        output_tokens: u32,
        ttft: Dur,
    ) {
        self.slo.on_prefill_done(now, kv_tokens, output_tokens, ttft);
        // The peak: the prompt plus every output token but the last.
        let need = KvNeed { now_tokens: kv_tokens, peak_tokens: kv_tokens + u64::from(output_tokens.max(1)) - 1 };
        self.waiting.push_back(Handoff { request, from, need, output_tokens });
        self.retry_at.get_or_insert(now);
    }

    /// A request entered the prefill pool.
    pub(crate) fn on_routed(&mut self, now: Time, prompt_tokens: u32) {
        self.slo.on_routed(now, prompt_tokens);
    }

    /// The request last routed to the prefill pool was not taken after all.
    pub(crate) fn on_unrouted(&mut self, prompt_tokens: u32) {
        self.slo.on_unrouted(prompt_tokens);
    }

    /// A transfer ended; returns the prefill instance it left.
    pub(crate) fn on_transfer_done(&mut self, request: RequestId) -> Option<InstanceId> {
        let pos = self.moving.iter().position(|(h, _)| h.request == request)?;
        Some(self.moving.swap_remove(pos).0.from)
    }

    pub(crate) fn on_transfer_refused(&mut self, now: Time, request: RequestId) -> Option<InstanceId> {
        let pos = self.moving.iter().position(|(h, _)| h.request == request)?;
        let (h, to) = self.moving.swap_remove(pos);
        self.waiting.push_front(h);
        self.retry_at.get_or_insert(now);
        Some(to)
    }

    pub(crate) fn on_latency(&mut self, now: Time, tpot: Option<Dur>) {
        if let Some(t) = tpot {
            self.slo.on_finished(now, t);
        }
    }

    pub(crate) fn tick(&mut self, now: Time, fleet: &mut FleetView, out: &mut Vec<Command>) {
        if self.retry_at.is_some_and(|t| t <= now) {
            self.retry_at = None;
            self.place_waiting(fleet, out);
        }
        if now >= self.next_tick {
            self.next_tick = now + self.config.tick;
            self.scale(now, fleet, out);
        }
    }

    fn place_waiting(&mut self, fleet: &mut FleetView, out: &mut Vec<Command>) {
        let c = &self.config;
        while let Some(&h) = self.waiting.front() {
            // A decode instance of the model its prefill instance serves.
            let model = fleet.get(h.from).map(|v| v.model).unwrap_or_default();
            let Some(pick) =
                pick_decode(fleet, model, &self.reserved, h.need, c.block_size, &c.slo.decode, &c.transfer)
            else {
                break;
            };
            self.waiting.pop_front();
            let to = pick.instance;
            let idx = to.0 as usize;
            if self.reserved.len() <= idx {
                self.reserved.resize(idx + 1, Reserved::default());
            }
            self.reserved[idx].kv_tokens += h.need.now_tokens;
            self.reserved[idx].seqs += 1;
            if let Some(v) = fleet.get_mut(to) {
                v.in_flight += 1;
                v.routed_since_report += u64::from(h.output_tokens);
            }
            out.push(Command::Transfer { request: h.request, from: h.from, to });
            self.moving.push((h, to));
        }
    }

    fn sizes(&self, fleet: &FleetView) -> [PoolSize; 2] {
        let mut sizes = [PoolSize::default(); 2];
        for v in fleet.all() {
            let Some(i) = pool_index(v.role) else { continue };
            match v.state {
                InstanceState::Serving => sizes[i].serving += 1,
                InstanceState::Draining => sizes[i].draining += 1,
                InstanceState::Down => {}
            }
        }
        sizes[0].starting = self.starting[0];
        sizes[1].starting = self.starting[1];
        sizes
    }

    fn pool_state(&self, fleet: &FleetView, sizes: &[PoolSize; 2]) -> PoolState {
        let block = u64::from(self.config.block_size);
        let mut p =
            PoolState { prefill_serving: sizes[0].serving, decode_serving: sizes[1].serving, ..PoolState::default() };
        for v in fleet.all().iter().filter(|v| v.is_serving()) {
            match v.role {
                Role::Prefill => p.prefill_backlog_tokens += v.load.prefill_tokens_left + v.routed_since_report,
                Role::Decode => {
                    let r = self.reserved.get(v.id.0 as usize).copied().unwrap_or_default();
                    p.decode_seqs += u64::from(v.load.running + v.load.waiting + r.seqs);
                    p.decode_kv_tokens += u64::from(v.load.kv_used_blocks) * block + r.kv_tokens;
                    p.decode_capacity_tokens += v.capacity_tokens;
                }
                Role::Colocated => {}
            }
        }
        p.decode_seqs += self.waiting.len() as u64;
        p.decode_kv_tokens += self.waiting.iter().map(|h| h.need.now_tokens).sum::<u64>();
        p
    }

    fn scale(&mut self, now: Time, fleet: &mut FleetView, out: &mut Vec<Command>) {
        let sizes = self.sizes(fleet);
        let loads = self.slo.loads(now, &self.pool_state(fleet, &sizes));
        let held: u32 = sizes.iter().map(|s| s.planned() + s.draining).sum();
        let max_instances = self.config.gpu_budget / self.config.gpus_per_instance.max(1);
        let input = ScaleInput {
            now,
            loads,
            prefill: sizes[0],
            decode: sizes[1],
            headroom: max_instances.saturating_sub(held),
            min_per_pool: self.config.min_per_pool,
            waiting_handoffs: self.waiting.len() as u32,
        };
        let mut scale = if self.autoscaling { self.scaler.decide(&input) } else { Scale::default() };
        // A pool below its minimum (an empty fleet at start, an instance lost) is refilled
        // first, whatever the policy says: no load can be measured on a pool with no instance.
        let short = |size: PoolSize| self.config.min_per_pool.saturating_sub(size.planned()) as i32;
        if self.autoscaling && (short(sizes[0]) > 0 || short(sizes[1]) > 0) {
            scale.prefill = scale.prefill.max(short(sizes[0]));
            scale.decode = scale.decode.max(short(sizes[1]));
            scale.reason = "pool below its minimum";
        }
        // The budget is spent and one pool must grow: the other gives what it can spare (its
        // instances drain; the growth follows once they are down and their GPUs free).
        let pairs = [(scale.decode, scale.prefill, Role::Prefill), (scale.prefill, scale.decode, Role::Decode)];
        for (grow, give, role) in pairs {
            let short = (grow.max(0) as u32).saturating_sub(input.headroom);
            if short > 0 && give <= 0 && self.scaler.can_spare(&input, role, short) {
                match role {
                    Role::Prefill => scale.prefill -= short as i32,
                    _ => scale.decode -= short as i32,
                }
            }
        }
        let mut headroom = input.headroom;
        let mut sizes_after = sizes;
        for (i, role, delta) in [(0, Role::Prefill, scale.prefill), (1, Role::Decode, scale.decode)] {
            let from = sizes[i].planned();
            if delta > 0 {
                let n = (delta as u32).min(headroom);
                headroom -= n;
                for _ in 0..n {
                    out.push(Command::Start { role });
                }
                self.starting[i] += n;
                sizes_after[i].starting += n;
            } else if delta < 0 {
                let n = self.drain(fleet, role, delta.unsigned_abs(), out);
                sizes_after[i].serving -= n;
                sizes_after[i].draining += n;
            }
            let to = sizes_after[i].planned();
            if to != from && self.log.len() < MAX_SCALING_EVENTS {
                self.log.push(ScalingEvent {
                    at_s: now.as_secs_f64(),
                    pool: role,
                    from,
                    to,
                    autoscaler: self.scaler.name().to_string(),
                    reason: scale.reason.to_string(),
                    loads,
                });
            }
        }
        self.status = PdStatus {
            loads,
            prefill: sizes_after[0],
            decode: sizes_after[1],
            waiting_handoffs: self.waiting.len() as u32,
        };
    }

    /// Drains up to `n` serving instances of `role`, keeping `min_per_pool`: those with the
    /// fewest requests in flight, the newest first on ties. Returns how many.
    fn drain(&self, fleet: &FleetView, role: Role, n: u32, out: &mut Vec<Command>) -> u32 {
        let mut serving: Vec<(u32, std::cmp::Reverse<u32>)> = fleet
            .all()
            .iter()
            .filter(|v| v.is_serving() && v.role == role)
            .map(|v| (v.in_flight, std::cmp::Reverse(v.id.0)))
            .collect();
        let n = n.min((serving.len() as u32).saturating_sub(self.config.min_per_pool));
        serving.sort_unstable();
        for &(_, std::cmp::Reverse(id)) in &serving[..n as usize] {
            out.push(Command::Drain { instance: InstanceId(id) });
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autoscaler::Knobs;
    use crate::event::FleetEvent;
    use crate::slo_load::DecodeModel;
    use crate::{Controller, ControllerConfig, CostHints, RouterConfig};
    use engine::{Load, Request};

    fn controller(autoscaler: AutoscalerConfig, gpu_budget: u32) -> Controller {
        let config = PdConfig {
            slo: SloLoadConfig {
                ttft_target_ms: 1000.0,
                tpot_target_ms: 50.0,
                window: Dur::from_millis(10_000),
                quantile: 0.99,
                decode: DecodeModel::default(),
                nominal_prefill_tokens_per_s: 10_000.0,
                inflow_window: Dur::from_millis(5_000),
            },
            autoscaler,
            gpu_budget,
            gpus_per_instance: 1,
            min_per_pool: 1,
            tick: Dur::from_millis(1_000),
            transfer: TransferHints { bytes_per_token: 1.0, bytes_per_s: 1e9, latency: Dur::ZERO },
            block_size: 16,
        };
        let hints = CostHints::default();
        let mut c = Controller::new(&ControllerConfig {
            router: RouterConfig::LeastOutstanding(Default::default()),
            seed: 1,
            hints,
        })
        .with_pools(config);
        for (i, role) in [Role::Prefill, Role::Decode].into_iter().enumerate() {
            let instance = InstanceId(i as u32);
            c.on_event(Time::ZERO, &FleetEvent::InstanceRole { instance, role });
            c.on_event(Time::ZERO, &FleetEvent::InstanceUp { instance, capacity_tokens: 100_000 });
        }
        c
    }

    fn request(id: u64) -> Request {
        Request {
            id: RequestId(id),
            arrival: Time::ZERO,
            prompt_tokens: 100,
            max_output_tokens: 10,
            ends_after: None,
            block_hashes: Vec::new(),
            resume: None,
            service: Default::default(),
            model: Default::default(),
        }
    }

    #[test]
    fn requests_go_to_the_prefill_pool_and_their_kv_to_the_decode_pool() {
        let mut c = controller(AutoscalerConfig::None, 2);
        let route = c.route(Time::ZERO, &request(7)).expect("a prefill instance serves");
        assert_eq!(route.prefill, InstanceId(0));
        let now = Time::from_millis(50);
        let done = FleetEvent::PrefillDone {
            instance: InstanceId(0),
            request: RequestId(7),
            kv_tokens: 100,
            output_tokens: 10,
            ttft: Dur::from_millis(50),
        };
        c.on_event(now, &done);
        assert_eq!(c.next_deadline(), Some(Time::ZERO), "the handoff is due at once (with the first scaling tick)");
        let mut out = Vec::new();
        c.tick(now, &mut out);
        assert_eq!(out, vec![Command::Transfer { request: RequestId(7), from: InstanceId(0), to: InstanceId(1) }]);
        // Refused: placed again at the next tick.
        c.on_event(now, &FleetEvent::TransferRefused { request: RequestId(7), from: InstanceId(0), to: InstanceId(1) });
        out.clear();
        c.tick(now, &mut out);
        assert_eq!(out, vec![Command::Transfer { request: RequestId(7), from: InstanceId(0), to: InstanceId(1) }]);
    }

    #[test]
    fn a_queue_on_the_prefill_pool_starts_instances_within_the_budget_and_records_why() {
        let mut c = controller(AutoscalerConfig::SloLoad { knobs: Knobs::for_startup(Dur::ZERO) }, 4);
        // 100,000 prompt tokens queued on one 10,000 tokens/s instance: TTFT_pred 10 s.
        let load = Load { prefill_tokens_left: 100_000, ..Load::default() };
        let mut out = Vec::new();
        for s in 0..3 {
            let now = Time::from_millis(s * 1000);
            c.on_event(now, &FleetEvent::Load { instance: InstanceId(0), load });
            c.tick(now, &mut out);
        }
        // Two GPUs of the four are free: two prefill instances, no more.
        assert_eq!(out, vec![Command::Start { role: Role::Prefill }, Command::Start { role: Role::Prefill }]);
        let [e] = c.scaling_events() else { panic!("one decision: {:?}", c.scaling_events()) };
        assert_eq!((e.pool, e.from, e.to), (Role::Prefill, 1, 3));
        assert_eq!(e.loads.ttft_pred_ms, 10_000.0);
        assert_eq!(c.pools().expect("pd").prefill.starting, 2);
    }

    #[test]
    fn an_inflow_of_long_prompts_grows_the_decode_pool_before_its_batch_holds_them() {
        let mut c = controller(AutoscalerConfig::SloLoad { knobs: Knobs::for_startup(Dur::ZERO) }, 10);
        let mut out = Vec::new();
        // 100 requests/s of 4,000-token prompts and 500-token outputs: one decode instance of
        // the default model would need 100 × 500 × (20 µs + 0.04 µs × 4,250) per second of
        // steps, more than a second: overload. The first ten prefills end and move; the
        // decode instance reports nothing, so its batch looks empty.
        for ms in (0..3000).step_by(10) {
            let now = Time::from_millis(ms);
            let id = ms / 10;
            let request = Request { prompt_tokens: 4000, max_output_tokens: 500, ..request(id) };
            c.route(now, &request).expect("the prefill instance takes it");
            if id < 10 {
                let done = FleetEvent::PrefillDone {
                    instance: InstanceId(0),
                    request: RequestId(id),
                    kv_tokens: 4000,
                    output_tokens: 500,
                    ttft: Dur::from_millis(100),
                };
                c.on_event(now, &done);
            }
            c.tick(now, &mut out);
        }
        assert!(out.contains(&Command::Start { role: Role::Decode }), "{out:?}");
        let e = c.scaling_events().iter().find(|e| e.pool == Role::Decode).expect("the decode pool grew");
        assert!(e.to > e.from, "{e:?}");
        assert!(e.loads.tpot_pred_ms < 25.0 && e.loads.tpot_actual_ms == 0.0, "the batch said nothing: {e:?}");
        assert_eq!(e.loads.tpot_inflow_ms, 10.0 * 50.0, "the inflow is an overload: {e:?}");
    }

    #[test]
    fn an_engine_that_registers_after_a_higher_id_still_counts_as_arrived() {
        // Engines started together register in any order: the slot of a lower id exists once
        // a higher one is heard of, but its instance has not arrived until it announces itself.
        let mut c = controller(AutoscalerConfig::None, 4);
        c.on_event(Time::ZERO, &FleetEvent::InstanceDown { instance: InstanceId(1) });
        c.set_autoscaling(true);
        let mut out = Vec::new();
        c.tick(Time::from_millis(1000), &mut out);
        assert_eq!(out, vec![Command::Start { role: Role::Decode }]);
        let at = Time::from_millis(1500);
        c.on_event(at, &FleetEvent::InstanceRole { instance: InstanceId(6), role: Role::Prefill });
        c.on_event(at, &FleetEvent::InstanceUp { instance: InstanceId(6), capacity_tokens: 100_000 });
        c.on_event(at, &FleetEvent::InstanceRole { instance: InstanceId(5), role: Role::Decode });
        c.on_event(at, &FleetEvent::InstanceUp { instance: InstanceId(5), capacity_tokens: 100_000 });
        out.clear();
        c.tick(Time::from_millis(2000), &mut out);
        let decode = c.pools().expect("pd").decode;
        assert_eq!((decode.serving, decode.starting), (1, 0), "the decode engine asked for has arrived");
        assert_eq!(out, vec![], "so nothing more is asked for");
    }

    #[test]
    fn a_pool_below_its_minimum_is_refilled_only_by_a_controller_that_scales() {
        let mut c = controller(AutoscalerConfig::None, 4);
        c.on_event(Time::ZERO, &FleetEvent::InstanceDown { instance: InstanceId(1) });
        c.set_autoscaling(false);
        let mut out = Vec::new();
        c.tick(Time::ZERO, &mut out);
        assert_eq!(out, vec![], "a replica that does not lead starts nothing");
        assert_eq!(c.pools().expect("pd").decode.serving, 0, "but it knows the pools");
        c.set_autoscaling(true);
        c.tick(Time::from_millis(1000), &mut out);
        assert_eq!(out, vec![Command::Start { role: Role::Decode }]);
        let [e] = c.scaling_events() else { panic!("one decision: {:?}", c.scaling_events()) };
        assert_eq!((e.pool, e.from, e.to, e.reason.as_str()), (Role::Decode, 0, 1, "pool below its minimum"));
        out.clear();
        c.tick(Time::from_millis(2000), &mut out);
        assert_eq!(out, vec![], "the instance asked for is counted as starting");
        c.on_event(Time::from_millis(2500), &FleetEvent::StartFailed { role: Role::Decode });
        c.tick(Time::from_millis(3000), &mut out);
        assert_eq!(out, vec![Command::Start { role: Role::Decode }], "one that failed is asked for again");
    }

    #[test]
    fn new_slo_targets_rescale_the_loads_from_the_next_tick() {
        let mut c = controller(AutoscalerConfig::None, 2);
        let load = Load { prefill_tokens_left: 10_000, ..Load::default() };
        c.on_event(Time::ZERO, &FleetEvent::Load { instance: InstanceId(0), load });
        let mut out = Vec::new();
        c.tick(Time::ZERO, &mut out);
        // 10,000 tokens at 10,000 tokens/s: TTFT_pred 1 s against 1 s.
        assert_eq!(c.pools().expect("pd").loads.load_p, 1.0);
        c.set_slo_targets(250.0, 50.0);
        c.tick(Time::from_millis(1000), &mut out);
        assert_eq!(c.pools().expect("pd").loads.load_p, 4.0);
    }
}
