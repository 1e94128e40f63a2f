//! The simulated fleet: real engine instances whose iterations take the time the cost model
//! predicts, advanced by an event queue in virtual time.
//!
//! KV events, when the controller wants them, reach it `event_delay` after the iteration
//! that caused them (the time a real event bus takes); load reports, when the driver asks,
//! wait for it to take them before its next decision ([`SimFleet::hold_loads`]); every other
//! event is immediate.
//! Requests an instance evicts (KV high-water protection) wait in the fleet, counted in
//! flight, until the driver takes them to place them again.
//!
//! A disaggregated fleet ([`SimFleet::disaggregated`]) has a prefill pool and a decode pool.
//! A prefill instance runs each request's prefill only and parks it, KV held, reporting
//! `PrefillDone`; on `Command::Transfer` the decode instance reserves blocks for the KV at
//! once and the transfer takes `bytes per token × tokens / bandwidth + latency`, after which
//! the prefill side releases its copy and the decode side decodes (`TransferDone`). Instances
//! asked for with `Command::Start` serve after the start-up time; a draining instance goes
//! down once it holds no request, parked ones included. GPU time is integrated over every
//! instance that holds its GPUs: starting, serving or draining.

use crate::queue::EventQueue;
use cost::{CostModelExecutor, GpuTime, SpeculationTally};
use engine::kv::{KvEvents, SharedStore};
use engine::{Dur, Evicted, Finished, Handoff, Instance, InstanceConfig, InstanceId, Load, Request, RequestId, Time};
use policies::{
    Command, DispatchError, Fleet, FleetEvent, FleetView, InstanceState, OutputEnd, Role, Route, TransferHints,
};
use std::collections::VecDeque;

/// Something that happens to one instance at a point in virtual time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wake {
    /// Start an iteration (scheduled at the time of an arrival, after all arrivals at that time
    /// are queued, so that they share the iteration).
    Start,
    /// The running iteration ends.
    StepDone,
    /// On a shared GPU ([`SharedGpus`]), the step that ends first among those running: valid
    /// while the GPU's `generation` is still this one (a step started or ended since moves it).
    SharedDone { generation: u64 },
    /// The instance has started and serves from now on.
    Up,
    /// The KV of `request` has arrived from `from` on this instance.
    Arrived { request: RequestId, from: InstanceId },
    /// The last step of a coast ends ([`Coast`]): valid while the instance's coast
    /// `generation` is still this one (a coast cut short moves it).
    CoastDone { generation: u32 },
}

impl Wake {
    /// Where this event of instance `id` stands among the queue's events at the same time:
    /// by instance, then by kind (see [`EventQueue`]).
    fn tie(self, id: InstanceId) -> u64 {
        let kind = match self {
            Wake::Up => 0,
            Wake::Arrived { .. } => 1,
            Wake::Start => 2,
            // A coast's end stands for its last step's.
            Wake::StepDone | Wake::CoastDone { .. } => 3,
            Wake::SharedDone { .. } => 4,
        };
        u64::from(id.0) << 8 | kind
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Asked for, holding its GPUs, not serving yet.
    Starting,
    Serving,
    Draining,
    Down,
}

struct SimInstance {
    engine: Instance,
    state: State,
    /// An iteration is running or about to start.
    busy: bool,
    role: Role,
    /// The load its last step ended with, held back ([`SimFleet::hold_loads`]).
    held_load: Option<Load>,
    coast: Coast,
}

/// Steps an instance runs through with one queued event ([`engine::Instance::coast`]): while
/// it only decodes, with nothing finishing and no block needed, its step ends leave nothing
/// for anyone but a held load, so the fleet prices them all when the first begins, queues
/// the last one's end, and credits them then. Whatever reaches the instance before (a
/// request, a load taken) finds it as the steps one by one would have left it: the step ends
/// before that moment, in queue order ([`SimFleet::seen_below`]), are credited or heard then.
#[derive(Default)]
struct Coast {
    on: bool,
    /// End times of the coast's steps, the one in progress at its start first; the last is
    /// queued (`Wake::CoastDone`).
    ends: Vec<Time>,
    /// Step ends whose load has been held so far.
    held: u32,
    /// Bumped when a coast is cut short, which makes its queued end stale.
    generation: u32,
    /// Its place in `SimFleet::coasting` while on (ended without a search of a thousand).
    listed_at: u32,
}

/// How a disaggregated fleet runs: pool sizes, start-up time, KV transfers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolOptions {
    pub prefill: u32,
    pub decode: u32,
    /// Time from `Command::Start` to serving.
    pub startup: Dur,
    pub transfer: TransferHints,
}

/// How the fleet's KV tiers and events are set up.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KvOptions {
    /// Blocks of the shared L3 store; `None`: no L3.
    pub l3_blocks: Option<u32>,
    /// Publish KV events (only a router reading the prefix index needs them).
    pub publish_events: bool,
    pub event_delay: Dur,
}

pub struct SimFleet {
    instances: Vec<SimInstance>,
    /// The executor every instance shares when it holds no state (no drafter).
    executor: CostModelExecutor,
    /// With a drafter, one executor per instance, by id, each drawing acceptance from its own
    /// generator (see [`CostModelExecutor::for_instance`]); empty otherwise.
    drafting: Vec<CostModelExecutor>,
    queue: EventQueue<(InstanceId, Wake)>,
    events: Vec<FleetEvent>,
    finished: Vec<Finished>,
    /// Requests evicted and not yet taken by the driver, with the instance they left.
    evicted: Vec<(InstanceId, Request)>,
    evicted_scratch: Vec<Evicted>,
    kv: KvOptions,
    /// KV events on their way to the controller, in order of delivery time: each
    /// instance's batch, due at a time.
    kv_in_flight: VecDeque<(Time, InstanceId, KvEvents)>,
    /// Event buffers the driver gave back ([`SimFleet::recycle`]), for the engines to record into.
    kv_spare: Vec<KvEvents>,
    /// Instance settings and the shared L3 store, for instances started later.
    config: InstanceConfig,
    l3: Option<SharedStore>,
    /// Start-up time and transfer costs (a disaggregated fleet).
    pools: Option<PoolOptions>,
    /// Requests whose prefill ended, parked on their prefill instance until a transfer is
    /// commanded: (prefill instance, the handoff).
    handoffs: Vec<(InstanceId, Handoff)>,
    handoff_scratch: Vec<Handoff>,
    /// Report `RequestLatency` for every finished request.
    report_latencies: bool,
    /// Instances holding GPUs now, and the instance-time they held until `gpu_clock`.
    holding: u32,
    held_us: u128,
    gpu_clock: Time,
    /// Instances that share one GPU ([`SimFleet::share_gpus`]).
    shared: Option<SharedGpus>,
    /// Whether step ends hold their loads back ([`SimFleet::hold_loads`]), and the instances
    /// holding one, in the order they began to.
    hold_loads: bool,
    holding_loads: Vec<InstanceId>,
    /// Whether instances may coast ([`SimFleet::coast`]), and those coasting now.
    coast: bool,
    coasting: Vec<InstanceId>,
    /// Queue events ordered below this (time, tie) have happened: those popped, and at a
    /// driver's call at `now`, every one before `now` (it handles arrivals and ticks before
    /// fleet events at the same time). A coast's step ends below it have ended.
    seen_below: (Time, u64),
}

/// Engines sharing a GPU share its time: without MPS the driver time-slices their contexts
/// every few milliseconds, so steps that overlap progress together, each at `efficiency / n`
/// of the GPU while `n > 1` run (processor sharing; context switches cost the rest), and a
/// lone step runs at full speed. Each step's work is its predicted time alone on the GPU.
struct SharedGpus {
    per_gpu: u32,
    /// The share of the GPU's time left to steps while several engines' steps overlap.
    efficiency: f64,
    gpus: Vec<SharedGpu>,
}

#[derive(Default)]
struct SharedGpu {
    /// When `running` was last brought up to date.
    updated: Time,
    /// Steps on the GPU: (instance, µs of work left at full speed).
    running: Vec<(InstanceId, f64)>,
    /// Bumped at every change, which makes the completion event already queued stale.
    generation: u64,
}

impl SharedGpus {
    fn gpu(&mut self, id: InstanceId) -> (&mut SharedGpu, f64) {
        let g = (id.0 / self.per_gpu) as usize;
        if self.gpus.len() <= g {
            self.gpus.resize_with(g + 1, SharedGpu::default);
        }
        (&mut self.gpus[g], self.efficiency)
    }
}

impl SharedGpu {
    /// The speed of each running step: 1 alone, `efficiency / n` among `n`.
    fn speed(&self, efficiency: f64) -> f64 {
        match self.running.len() {
            0 | 1 => 1.0,
            n => efficiency / n as f64,
        }
    }

    /// Runs the steps on the GPU from `updated` to `now`.
    fn advance(&mut self, now: Time, efficiency: f64) {
        let worked = now.since(self.updated).0 as f64 * self.speed(efficiency);
        for (_, left) in &mut self.running {
            *left -= worked;
        }
        self.updated = now;
    }

    /// When the first running step ends at the present share, with the generation that event
    /// carries (`None`: nothing runs).
    fn next_done(&mut self, efficiency: f64) -> Option<(Time, InstanceId, u64)> {
        self.generation += 1;
        let speed = self.speed(efficiency);
        let &(id, left) = self.running.iter().min_by(|a, b| a.1.total_cmp(&b.1))?;
        let at = self.updated + Dur((left.max(0.0) / speed).ceil() as u64);
        Some((at, id, self.generation))
    }
}

impl SimFleet {
    /// A fleet of `count` identical instances, all serving from time zero.
    pub fn new(count: u32, config: &InstanceConfig, executor: CostModelExecutor, kv: KvOptions) -> SimFleet {
        let mut fleet = SimFleet {
            instances: Vec::with_capacity(count as usize),
            executor,
            drafting: Vec::new(),
            queue: EventQueue::default(),
            events: Vec::new(),
            finished: Vec::new(),
            evicted: Vec::new(),
            evicted_scratch: Vec::new(),
            kv,
            kv_in_flight: VecDeque::new(),
            kv_spare: Vec::new(),
            config: config.clone(),
            // A store of offload chunks holds as many chunks as its blocks make.
            l3: kv.l3_blocks.map(|blocks| SharedStore::new(blocks / config.offload_chunk_blocks)),
            pools: None,
            handoffs: Vec::new(),
            handoff_scratch: Vec::new(),
            report_latencies: false,
            holding: 0,
            held_us: 0,
            gpu_clock: Time::ZERO,
            shared: None,
            hold_loads: false,
            holding_loads: Vec::new(),
            coast: false,
            coasting: Vec::new(),
            seen_below: (Time::ZERO, 0),
        };
        for _ in 0..count {
            fleet.add_instance(Time::ZERO, Role::Colocated, true);
        }
        fleet
    }

    /// A disaggregated fleet: `pools.prefill` prefill and `pools.decode` decode instances,
    /// all serving from time zero.
    pub fn disaggregated(
        pools: PoolOptions,
        config: &InstanceConfig,
        executor: CostModelExecutor,
        kv: KvOptions,
    ) -> SimFleet {
        let mut fleet = SimFleet::new(0, config, executor, kv);
        fleet.pools = Some(pools);
        for _ in 0..pools.prefill {
            fleet.add_instance(Time::ZERO, Role::Prefill, true);
        }
        for _ in 0..pools.decode {
            fleet.add_instance(Time::ZERO, Role::Decode, true);
        }
        fleet
    }

    /// Reports `RequestLatency` after every `RequestFinished` (the SLO load needs them).
    pub fn report_latencies(&mut self) {
        self.report_latencies = true;
    }

    /// Adds an instance of `role`, serving now (`ready`) or after the start-up time.
    fn add_instance(&mut self, now: Time, role: Role, ready: bool) {
        let id = InstanceId(self.instances.len() as u32);
        let mut engine = Instance::with_shared_store(self.config.clone(), self.l3.clone());
        if self.kv.publish_events {
            engine.record_kv_events();
        }
        self.advance_gpu_clock(now);
        self.holding += 1;
        if self.executor.drafter().is_some() {
            self.drafting.push(self.executor.for_instance(id));
        }
        self.instances.push(SimInstance {
            engine,
            state: State::Starting,
            busy: false,
            role,
            held_load: None,
            coast: Coast::default(),
        });
        if ready {
            self.instance_up(id);
        } else {
            let startup = self.pools.map_or(Dur::ZERO, |p| p.startup);
            self.wake(now + startup, id, Wake::Up);
        }
    }

    fn instance_up(&mut self, id: InstanceId) {
        let inst = &mut self.instances[id.0 as usize];
        inst.state = State::Serving;
        if inst.role != Role::Colocated {
            self.events.push(FleetEvent::InstanceRole { instance: id, role: inst.role });
        }
        let capacity_tokens = inst.engine.capacity_tokens();
        self.events.push(FleetEvent::InstanceUp { instance: id, capacity_tokens });
    }

    fn advance_gpu_clock(&mut self, now: Time) {
        self.held_us += u128::from(self.holding) * u128::from(now.since(self.gpu_clock).0);
        self.gpu_clock = self.gpu_clock.max(now);
    }

    /// Instance-hours held (starting, serving or draining) from time zero to `now`.
    pub fn instance_hours(&mut self, now: Time) -> f64 {
        self.advance_gpu_clock(now);
        self.held_us as f64 / 3.6e9
    }

    /// Instances per role and lifecycle now: (role, starting, serving, draining).
    pub fn pool_counts(&self) -> Vec<(Role, u32, u32, u32)> {
        let mut out: Vec<(Role, u32, u32, u32)> = Vec::new();
        for inst in &self.instances {
            let k = match out.iter().position(|c| c.0 == inst.role) {
                Some(k) => k,
                None => {
                    out.push((inst.role, 0, 0, 0));
                    out.len() - 1
                }
            };
            match inst.state {
                State::Starting => out[k].1 += 1,
                State::Serving => out[k].2 += 1,
                State::Draining => out[k].3 += 1,
                State::Down => {}
            }
        }
        out.sort_by_key(|c| c.0);
        out
    }

    /// Instances holding GPUs now.
    pub fn holding(&self) -> u32 {
        self.holding
    }

    /// Queues `wake` for instance `id` at `at`.
    fn wake(&mut self, at: Time, id: InstanceId, wake: Wake) {
        self.queue.push(at, wake.tie(id), (id, wake));
    }

    /// Takes a draining instance down once it holds no request.
    fn maybe_down(&mut self, now: Time, id: InstanceId) {
        let inst = &mut self.instances[id.0 as usize];
        if inst.state == State::Draining && !inst.busy && inst.engine.in_flight() == 0 {
            inst.state = State::Down;
            if let Some(load) = inst.held_load.take() {
                self.events.push(FleetEvent::Load { instance: id, load });
            }
            self.events.push(FleetEvent::InstanceDown { instance: id });
            self.advance_gpu_clock(now);
            self.holding -= 1;
        }
    }

    /// Instances `per_gpu` at a time (by id) share one GPU ([`SharedGpus`]), overlapping
    /// steps getting `efficiency` of its time between them.
    pub fn share_gpus(&mut self, per_gpu: u32, efficiency: f64) {
        self.shared = (per_gpu > 1).then(|| SharedGpus { per_gpu, efficiency, gpus: Vec::new() });
    }

    /// Time of the next thing the fleet will do on its own.
    pub fn next_time(&mut self) -> Option<Time> {
        self.drop_stale_coasts();
        let kv = self.kv_in_flight.front().map(|&(t, _, _)| t);
        match (self.queue.peek_time(), kv) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Advances to the next fleet event; the caller checked that one is due at `next_time`.
    /// KV events due at the same time as an iteration are delivered first.
    pub fn step(&mut self) -> Time {
        if let Some(&(t, _, _)) = self.kv_in_flight.front() {
            if self.queue.peek_time().is_none_or(|q| t <= q) {
                while self.kv_in_flight.front().is_some_and(|&(d, _, _)| d == t) {
                    let (_, instance, events) = self.kv_in_flight.pop_front().expect("a front element");
                    self.events.push(FleetEvent::Kv { instance, events });
                }
                self.observe(t);
                return t;
            }
        }
        self.drop_stale_coasts();
        let ((now, tie, _), (id, wake)) = self.queue.pop().expect("step called on an idle fleet");
        self.seen_below = (now, tie + 1);
        match wake {
            Wake::Up => {
                self.instance_up(id);
                return now;
            }
            Wake::Arrived { request, from } => {
                self.transfer_arrived(now, request, from, id);
                return now;
            }
            Wake::SharedDone { generation } => {
                self.shared_done(now, id, generation);
                return now;
            }
            Wake::Start => {}
            Wake::StepDone => self.end_step(now, id),
            Wake::CoastDone { .. } => {
                self.end_coast(id);
                self.end_step(now, id);
            }
        }
        self.start_step(now, id);
        self.publish_kv(now, id);
        now
    }

    /// Steps as [`SimFleet::step`], and goes on stepping while its steps leave nothing for
    /// the driver (no event, nothing finished or evicted: with loads held back, most decode
    /// steps) and its next thing comes before `before`: the driver would only come back to it.
    /// Returns the time of the last step.
    pub fn step_on(&mut self, before: Time) -> Time {
        loop {
            let now = self.step();
            let quiet = self.events.is_empty() && self.finished.is_empty() && self.evicted.is_empty();
            if !quiet || self.next_time().is_none_or(|t| t >= before) {
                return now;
            }
        }
    }

    /// Ends the step of instance `id` at `now`: its finished, handed-off and evicted requests
    /// and its load go out as events.
    fn end_step(&mut self, now: Time, id: InstanceId) {
        let inst = &mut self.instances[id.0 as usize];
        let before = self.finished.len();
        inst.engine.end_step(now, &mut self.finished, &mut self.evicted_scratch);
        for f in &self.finished[before..] {
            let output =
                f.ended.is_none().then_some(OutputEnd { tokens: f.output_tokens, bound: f.request.max_output_tokens });
            self.events.push(FleetEvent::RequestFinished { instance: id, request: f.request.id, output });
            if self.report_latencies {
                let ttft = f.first_token_at.since(f.request.arrival);
                let tpot = (f.output_tokens >= 2)
                    .then(|| Dur(f.finished_at.since(f.first_token_at).0 / u64::from(f.output_tokens - 1)));
                self.events.push(FleetEvent::RequestLatency { instance: id, request: f.request.id, ttft, tpot });
            }
        }
        inst.engine.take_handoffs(&mut self.handoff_scratch);
        if !self.handoff_scratch.is_empty() {
            for h in self.handoff_scratch.drain(..) {
                let resume = h.request.resume.as_deref().expect("a handoff carries its first token");
                self.events.push(FleetEvent::PrefillDone {
                    instance: id,
                    request: h.request.id,
                    kv_tokens: u64::from(h.kv_tokens),
                    output_tokens: h.request.max_output_tokens,
                    ttft: resume.first_token_at.since(h.request.arrival),
                });
                self.handoffs.push((id, h));
            }
        }
        if !self.evicted_scratch.is_empty() {
            for e in self.evicted_scratch.drain(..) {
                self.events.push(FleetEvent::RequestEvicted { instance: id, request: e.request.id, reason: e.reason });
                self.evicted.push((id, e.request));
            }
        }
        let load = inst.engine.load();
        if !self.hold_loads {
            inst.held_load = None;
            self.events.push(FleetEvent::Load { instance: id, load });
        } else if inst.held_load.replace(load).is_none() {
            self.holding_loads.push(id);
        }
    }

    /// Lets step ends hold their loads back until [`SimFleet::take_loads`] (`on`), or report
    /// them at once. A load changes nothing until the controller next decides (routes,
    /// ticks, samples), so a driver that takes them before each decision sees what it would
    /// have seen, without a report per step: most steps change nothing else.
    pub fn hold_loads(&mut self, on: bool) {
        self.hold_loads = on;
    }

    /// The latest load at `now` of every instance holding one back, in the order they began
    /// to (coasting ones after those).
    pub fn take_loads(&mut self, now: Time, out: &mut Vec<FleetEvent>) {
        self.observe(now);
        for k in 0..self.coasting.len() {
            let id = self.coasting[k];
            self.hold_coasted_load(id, self.coasted(id));
        }
        for id in self.holding_loads.drain(..) {
            if let Some(load) = self.instances[id.0 as usize].held_load.take() {
                out.push(FleetEvent::Load { instance: id, load });
            }
        }
    }

    /// A shared GPU's first step is due to end (unless the event is stale): every step whose
    /// work is done ends, its instance starts its next, and the next completion is queued.
    fn shared_done(&mut self, now: Time, id: InstanceId, generation: u64) {
        let Some(gpus) = &mut self.shared else { return };
        let (gpu, efficiency) = gpus.gpu(id);
        if gpu.generation != generation {
            return;
        }
        gpu.advance(now, efficiency);
        // Within a microsecond of done (completion times are whole microseconds).
        let done: Vec<InstanceId> = gpu.running.iter().filter(|r| r.1 <= 1e-6).map(|r| r.0).collect();
        gpu.running.retain(|r| r.1 > 1e-6);
        for d in done {
            self.end_step(now, d);
            self.start_step(now, d);
            self.publish_kv(now, d);
        }
        self.queue_shared_done(id);
    }

    /// Queues the next completion on the GPU of instance `id`.
    fn queue_shared_done(&mut self, id: InstanceId) {
        let Some(gpus) = &mut self.shared else { return };
        let (gpu, efficiency) = gpus.gpu(id);
        if let Some((at, first, generation)) = gpu.next_done(efficiency) {
            self.wake(at, first, Wake::SharedDone { generation });
        }
    }

    /// Lets instances coast ([`Coast`]): where they can, and only while loads are held
    /// back (a coasted step's load is heard when the controller next decides). The driver
    /// asks for it only where nothing else looks at the fleet between its decisions (no flow
    /// control, which may release requests after any step).
    pub fn coast(&mut self, on: bool) {
        self.coast = on && self.shared.is_none() && self.drafting.is_empty() && self.pools.is_none();
    }

    /// The driver acts at `now`: every queue event before it has happened.
    fn observe(&mut self, now: Time) {
        self.seen_below = self.seen_below.max((now, 0));
    }

    /// Starts a coast of instance `id` whose step in progress ends at `first_end`, through
    /// `steps` more steps (none: the step's end is queued as usual).
    fn begin_coast(&mut self, id: InstanceId, first_end: Time, steps: u32) {
        if steps == 0 {
            self.wake(first_end, id, Wake::StepDone);
            return;
        }
        let inst = &mut self.instances[id.0 as usize];
        let coast = &mut inst.coast;
        coast.ends.clear();
        coast.ends.push(first_end);
        let mut at = first_end;
        // Priced as the executor prices each batch when it runs (no drafter here).
        self.executor.cost_model().decode_step_times(&inst.engine.coast_stats(1), steps, |d| {
            at += d;
            coast.ends.push(at);
        });
        coast.on = true;
        coast.held = 0;
        coast.listed_at = self.coasting.len() as u32;
        let generation = coast.generation;
        self.coasting.push(id);
        self.wake(at, id, Wake::CoastDone { generation });
    }

    /// The coast's step ends that have happened ([`SimFleet::seen_below`]), its last one
    /// excepted (a queued event).
    fn coasted(&self, id: InstanceId) -> u32 {
        let ends = &self.instances[id.0 as usize].coast.ends;
        let tie = Wake::StepDone.tie(id);
        ends[..ends.len() - 1].partition_point(|&t| (t, tie) < self.seen_below) as u32
    }

    /// Holds the load instance `id` reports after its latest coasted step end, if one ended
    /// since the last it held (`ended`: [`SimFleet::coasted`]).
    fn hold_coasted_load(&mut self, id: InstanceId, ended: u32) {
        let inst = &mut self.instances[id.0 as usize];
        if ended > inst.coast.held {
            inst.coast.held = ended;
            if inst.held_load.replace(inst.engine.load_after(ended)).is_none() {
                self.holding_loads.push(id);
            }
        }
    }

    /// Ends the coast of instance `id` where it has come to: the step ends that happened are
    /// credited, their GPU time counted and their load held; returns when the step in
    /// progress ends (its queued end, if later, goes stale).
    fn end_coast(&mut self, id: InstanceId) -> Time {
        let ended = self.coasted(id);
        self.hold_coasted_load(id, ended);
        let inst = &mut self.instances[id.0 as usize];
        let coast = &mut inst.coast;
        inst.engine.coast(ended);
        let ends = &coast.ends;
        // The steps begun since the coast's first: their time, as each begin would count it.
        self.executor.count_steps(ends[ended as usize].since(ends[0]));
        coast.on = false;
        coast.generation = coast.generation.wrapping_add(1);
        let (at, pos) = (coast.ends[ended as usize], coast.listed_at as usize);
        debug_assert_eq!(self.coasting[pos], id, "a coasting instance is listed where it says");
        self.coasting.swap_remove(pos);
        if let Some(&moved) = self.coasting.get(pos) {
            self.instances[moved.0 as usize].coast.listed_at = pos as u32;
        }
        at
    }

    /// Ends every coast where it has come to at `now` (a run that stops early counts the
    /// GPU time of the steps begun).
    pub fn end_coasts(&mut self, now: Time) {
        self.observe(now);
        while let Some(&id) = self.coasting.last() {
            let at = self.end_coast(id);
            self.wake(at, id, Wake::StepDone);
        }
    }

    /// Pops the queued ends of coasts cut short, where they come first.
    fn drop_stale_coasts(&mut self) {
        while let Some((_, &(id, Wake::CoastDone { generation }))) = self.queue.peek() {
            if self.instances[id.0 as usize].coast.generation == generation {
                return;
            }
            self.queue.pop();
        }
    }

    /// Sends the KV events instance `id` recorded on their way.
    fn publish_kv(&mut self, now: Time, id: InstanceId) {
        if !self.kv.publish_events {
            return;
        }
        // A spare buffer (the controller's last one) trades places with the engine's.
        let mut events = self.kv_spare.pop().unwrap_or_default();
        events.clear();
        self.instances[id.0 as usize].engine.drain_kv_events(&mut events);
        if events.is_empty() {
            self.kv_spare.push(events);
            return;
        }
        let at = now + self.kv.event_delay;
        if at == now {
            self.events.push(FleetEvent::Kv { instance: id, events });
        } else {
            self.kv_in_flight.push_back((at, id, events));
        }
    }

    fn start_step(&mut self, now: Time, id: InstanceId) {
        let inst = &mut self.instances[id.0 as usize];
        let exec = self.drafting.get_mut(id.0 as usize).unwrap_or(&mut self.executor);
        // The cost model never fails; an error here is a bug in it, not an input problem.
        match inst.engine.begin_step(now, exec).expect("cost model executor failed") {
            Some(d) => match &mut self.shared {
                None if self.coast && self.hold_loads => {
                    let steps = inst.engine.coastable_steps();
                    self.begin_coast(id, now + d, steps);
                }
                None => self.wake(now + d, id, Wake::StepDone),
                Some(gpus) => {
                    let (gpu, efficiency) = gpus.gpu(id);
                    gpu.advance(now, efficiency);
                    gpu.running.push((id, d.0 as f64));
                    self.queue_shared_done(id);
                }
            },
            None => {
                inst.busy = false;
                self.maybe_down(now, id);
            }
        }
    }

    /// Starts the transfer of `request`'s KV from `from` to `to`, or reports it refused.
    fn start_transfer(&mut self, now: Time, request: RequestId, from: InstanceId, to: InstanceId) {
        let Some(pos) = self.handoffs.iter().position(|(f, h)| *f == from && h.request.id == request) else {
            return;
        };
        let serving = self.instances.get(to.0 as usize).is_some_and(|i| i.state == State::Serving);
        if !serving {
            self.events.push(FleetEvent::TransferRefused { request, from, to });
            return;
        }
        let (_, h) = self.handoffs.swap_remove(pos);
        let kv_tokens = u64::from(h.kv_tokens);
        match self.instances[to.0 as usize].engine.receive_transfer(now, h.request) {
            Ok(()) => {
                let took = self.pools.map_or(Dur::ZERO, |p| p.transfer.time(kv_tokens));
                self.wake(now + took, to, Wake::Arrived { request, from });
            }
            Err((_, back)) => {
                self.handoffs.push((from, Handoff { request: back, kv_tokens: kv_tokens as u32 }));
                self.events.push(FleetEvent::TransferRefused { request, from, to });
            }
        }
    }

    /// The KV arrived: the prefill side lets go of it, the decode side decodes.
    fn transfer_arrived(&mut self, now: Time, request: RequestId, from: InstanceId, to: InstanceId) {
        let released = self.instances[from.0 as usize].engine.release_handoff(now, request);
        let received = self.instances[to.0 as usize].engine.finish_transfer(now, request);
        assert!(released && received, "{request}: transfer {from} -> {to} lost track of its KV");
        self.events.push(FleetEvent::TransferDone { request, from, to });
        // The prefill side may now admit prompts that were waiting for the blocks it freed.
        for id in [from, to] {
            let inst = &mut self.instances[id.0 as usize];
            if !inst.busy && inst.engine.has_work() {
                inst.busy = true;
                self.wake(now, id, Wake::Start);
            }
        }
        self.maybe_down(now, from);
    }

    /// Requests that finished since the last call, for the metrics.
    pub fn take_finished(&mut self, out: &mut Vec<Finished>) {
        out.append(&mut self.finished);
    }

    /// Requests evicted since the last call, with the instance each left, for the driver to
    /// place again.
    pub fn take_evicted(&mut self, out: &mut Vec<(InstanceId, Request)>) {
        out.append(&mut self.evicted);
    }

    /// Requests queued or running anywhere, or evicted and not yet taken.
    pub fn in_flight(&self) -> usize {
        self.instances.iter().map(|i| i.engine.in_flight()).sum::<usize>() + self.evicted.len()
    }

    /// Panics, naming the instance, where the controller's view of the fleet is not what the
    /// fleet is: each instance's state, role and requests in flight. Only KV events travel
    /// late, so after the driver fed every event and placed every evicted request, the rest
    /// must agree exactly.
    pub fn check_view(&self, view: &FleetView) {
        for (i, inst) in self.instances.iter().enumerate() {
            let id = InstanceId(i as u32);
            let v = view.get(id);
            let state = v.map_or(InstanceState::Down, |v| v.state);
            let expected = match inst.state {
                State::Starting | State::Down => InstanceState::Down,
                State::Serving => InstanceState::Serving,
                State::Draining => InstanceState::Draining,
            };
            assert_eq!(state, expected, "{id}: the controller's state is not the fleet's");
            let Some(v) = v.filter(|_| inst.state != State::Starting) else { continue };
            assert_eq!(v.role, inst.role, "{id}: the controller's role is not the fleet's");
            let held = inst.engine.in_flight();
            assert_eq!(
                v.in_flight as usize, held,
                "{id}: the controller counts {} requests in flight, the instance holds {held}",
                v.in_flight
            );
        }
    }

    /// Time admission was paused up to `now`, summed over instances.
    pub fn admission_paused(&self, now: Time) -> Dur {
        self.instances.iter().fold(Dur::ZERO, |sum, i| sum + i.engine.paused_clock(now))
    }

    /// Where the GPU time of every instance went.
    pub fn gpu_time(&self) -> GpuTime {
        if self.drafting.is_empty() {
            return self.executor.gpu_time();
        }
        let mut sum = GpuTime::default();
        for e in &self.drafting {
            sum.add(e.gpu_time());
        }
        sum
    }

    /// What speculative decoding did over every instance (`None` without a drafter).
    pub fn speculation(&self) -> Option<SpeculationTally> {
        self.executor.drafter()?;
        let mut sum = SpeculationTally::default();
        for e in &self.drafting {
            sum.add(e.tally().unwrap_or_default());
        }
        Some(sum)
    }
}

impl Fleet for SimFleet {
    /// A simulated request is all in its [`Request`].
    type Payload = ();

    fn dispatch(
        &mut self,
        now: Time,
        request: Request,
        (): (),
        route: &Route,
    ) -> Result<(), (DispatchError, Request, ())> {
        let id = route.prefill;
        let Some(inst) = self.instances.get(id.0 as usize).filter(|i| i.state == State::Serving) else {
            return Err((DispatchError::NotServing { instance: id }, request, ()));
        };
        if inst.coast.on {
            // The request joins the step in progress now, as one by one.
            self.observe(now);
            let at = self.end_coast(id);
            self.wake(at, id, Wake::StepDone);
        }
        let inst = &mut self.instances[id.0 as usize];
        let queued = match inst.role {
            Role::Prefill => inst.engine.enqueue_prefill_only(now, request),
            Role::Colocated | Role::Decode => inst.engine.enqueue(now, request),
        };
        queued.map_err(|(reason, r)| (DispatchError::Refused { instance: id, reason }, r, ()))?;
        if !inst.busy {
            inst.busy = true;
            self.wake(now, id, Wake::Start);
        }
        Ok(())
    }

    fn apply(&mut self, now: Time, command: &Command) {
        match *command {
            Command::Drain { instance } => {
                let Some(inst) = self.instances.get_mut(instance.0 as usize) else { return };
                if inst.state != State::Serving {
                    return;
                }
                inst.state = State::Draining;
                self.events.push(FleetEvent::InstanceDraining { instance });
                if !inst.busy {
                    inst.busy = true;
                    self.wake(now, instance, Wake::Start);
                }
            }
            Command::Start { role } => self.add_instance(now, role, false),
            Command::Transfer { request, from, to } => self.start_transfer(now, request, from, to),
        }
    }

    fn poll_events(&mut self, out: &mut Vec<FleetEvent>) {
        out.append(&mut self.events);
    }
}

impl SimFleet {
    /// Takes back the buffer of a KV event the controller has applied, for an engine to
    /// record into next (no buffer is allocated and grown again per step).
    ///
    /// A buffer grown past [`MAX_KEPT_EVENTS`] by a rare large batch (a long prompt loaded
    /// from below L1 evicts thousands of blocks) is dropped: kept, every buffer in circulation
    /// would end up that large (130 MB of 440 on 64 instances).
    pub fn recycle(&mut self, events: KvEvents) {
        if self.kv_spare.len() < MAX_SPARE_BUFFERS && events.capacity() <= MAX_KEPT_EVENTS {
            self.kv_spare.push(events);
        }
    }
}

/// Event buffers kept for reuse at most (one per instance publishing between two settles
/// is the most a run needs at once).
const MAX_SPARE_BUFFERS: usize = 1024;

/// The largest event buffer kept for reuse, in blocks' events (a step's are usually far fewer;
/// 96 KiB of hashes, as 4,096 events of 24 bytes took before events were kept as runs).
const MAX_KEPT_EVENTS: usize = 12288;

#[cfg(test)]
mod tests {
    use super::*;
    use cost::{gpu_by_name, model_by_name, CostModel, CostParams, Deployment};
    use engine::{BlockHash, RequestId};
    use policies::Why;

    /// Llama-3.1-8B on one H100, and instances of 1,024 blocks.
    fn cost_and_config() -> (CostModel, InstanceConfig) {
        let (m, g) = (model_by_name("llama-3.1-8b"), gpu_by_name("h100"));
        let cost =
            CostModel::new(m.expect("model"), g.expect("gpu"), Deployment::tensor_parallel(1), CostParams::default())
                .expect("fits");
        (cost, InstanceConfig { total_blocks: 1024, ..InstanceConfig::default() })
    }

    fn fleet(prefill: u32, decode: u32, startup: Dur) -> SimFleet {
        let (cost, config) = cost_and_config();
        let transfer = TransferHints { bytes_per_token: 131_072.0, bytes_per_s: 50e9, latency: Dur::from_millis(1) };
        let pools = PoolOptions { prefill, decode, startup, transfer };
        SimFleet::disaggregated(pools, &config, CostModelExecutor::new(cost), KvOptions::default())
    }

    fn request(id: u64, prompt: u32, output: u32) -> Request {
        let block_hashes = (0..prompt / 16).map(|i| BlockHash::ROOT.chain(id * 10_000 + u64::from(i))).collect();
        Request {
            id: RequestId(id),
            arrival: Time::ZERO,
            prompt_tokens: prompt,
            max_output_tokens: output,
            ends_after: None,
            block_hashes,
            resume: None,
            service: Default::default(),
            model: Default::default(),
        }
    }

    fn route(prefill: u32) -> Route {
        Route { prefill: InstanceId(prefill), decode: InstanceId(prefill), why: Why::Turn }
    }

    /// Steps until the fleet has nothing to do, answering each `PrefillDone` with a transfer
    /// to `to`; returns every event and, at each transfer's start and end, the KV blocks in
    /// use on the prefill and decode side.
    fn drive(f: &mut SimFleet, to: InstanceId) -> (Vec<FleetEvent>, Vec<(u32, u32)>) {
        let (mut all, mut kv) = (Vec::new(), Vec::new());
        let used = |f: &SimFleet| {
            (f.instances[0].engine.kv().used_blocks(), f.instances[to.0 as usize].engine.kv().used_blocks())
        };
        let mut events = Vec::new();
        for _ in 0..100_000 {
            let Some(_) = f.next_time() else { break };
            let now = f.step();
            f.poll_events(&mut events);
            for e in events.drain(..) {
                match e {
                    FleetEvent::PrefillDone { instance, request, .. } => {
                        f.apply(now, &Command::Transfer { request, from: instance, to });
                        kv.push(used(f));
                    }
                    FleetEvent::TransferDone { .. } => kv.push(used(f)),
                    _ => {}
                }
                all.push(e);
            }
        }
        (all, kv)
    }

    /// A second request dispatched at any moment of the first one's decode, also exactly as
    /// one of its steps ends (the driver handles an arrival before a step ending at the same
    /// microsecond), finds the instance where the steps one by one would have left it: the
    /// same load heard, the same finished requests at the same times, the same GPU time,
    /// with coasting as step by step.
    #[test]
    fn a_request_reaching_a_coasting_instance_finds_it_as_step_by_step() {
        let (cost, config) = cost_and_config();
        let run = |coast: bool, join_at: Option<Time>| {
            let mut f = SimFleet::new(1, &config, CostModelExecutor::new(cost.clone()), KvOptions::default());
            f.hold_loads(true);
            f.coast(coast);
            f.dispatch(Time::ZERO, request(1, 160, 120), (), &route(0)).expect("serving");
            let (mut ends, mut heard, mut pending) = (Vec::new(), Vec::new(), join_at);
            while let Some(t) = f.next_time() {
                if let Some(at) = pending.filter(|&at| at <= t) {
                    // As the driver does: loads heard, then the request placed.
                    f.take_loads(at, &mut heard);
                    f.dispatch(at, request(2, 48, 30), (), &route(0)).expect("serving");
                    pending = None;
                    continue;
                }
                ends.push(f.step());
            }
            let mut done = Vec::new();
            f.take_finished(&mut done);
            let done: Vec<_> = done.iter().map(|d| (d.request.id, d.first_token_at, d.finished_at)).collect();
            (ends, (heard, done, f.gpu_time().busy_s))
        };
        let (ends, _) = run(false, None);
        let (coasted_ends, _) = run(true, None);
        assert!(
            coasted_ends.len() * 4 < ends.len(),
            "the decode coasts: {} events for {} steps",
            coasted_ends.len(),
            ends.len()
        );
        for &end in &ends[4..ends.len() - 2] {
            for at in [end, end + Dur(1)] {
                assert_eq!(run(true, Some(at)).1, run(false, Some(at)).1, "second request at {at:?}");
            }
        }
    }

    #[test]
    fn a_transfer_holds_kv_on_both_sides_then_only_on_the_decode_side() {
        let mut f = fleet(1, 1, Dur::ZERO);
        f.dispatch(Time::ZERO, request(1, 160, 4), (), &route(0)).expect("serving");
        let (events, kv) = drive(&mut f, InstanceId(1));
        // 160 prompt tokens are 10 blocks: held on both sides while they travel, then the
        // prefill side lets go.
        assert_eq!(kv, vec![(10, 10), (0, 10)]);
        assert!(events.contains(&FleetEvent::TransferDone {
            request: RequestId(1),
            from: InstanceId(0),
            to: InstanceId(1)
        }));
        let mut done = Vec::new();
        f.take_finished(&mut done);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].output_tokens, 4);
        assert_eq!(f.in_flight(), 0);
        for inst in &f.instances {
            assert_eq!(inst.engine.kv().used_blocks(), 0, "no block stays held");
        }
    }

    #[test]
    fn a_started_instance_serves_after_the_startup_time_and_a_drained_one_finishes_its_requests() {
        let mut f = fleet(1, 1, Dur::from_millis(10_000));
        let mut events = Vec::new();
        f.poll_events(&mut events);
        events.clear();
        f.apply(Time::ZERO, &Command::Start { role: Role::Decode });
        assert_eq!(f.pool_counts(), vec![(Role::Prefill, 0, 1, 0), (Role::Decode, 1, 1, 0)]);
        assert_eq!(f.next_time(), Some(Time::from_millis(10_000)));
        f.step();
        f.poll_events(&mut events);
        assert_eq!(
            events,
            vec![
                FleetEvent::InstanceRole { instance: InstanceId(2), role: Role::Decode },
                FleetEvent::InstanceUp { instance: InstanceId(2), capacity_tokens: 1024 * 16 },
            ]
        );
        let now = Time::from_millis(10_000);
        f.dispatch(now, request(2, 64, 50), (), &route(0)).expect("serving");
        f.apply(now, &Command::Drain { instance: InstanceId(0) });
        assert!(f.dispatch(now, request(3, 64, 5), (), &route(0)).is_err(), "a draining instance takes nothing new");
        let (events, _) = drive(&mut f, InstanceId(2));
        assert!(events.contains(&FleetEvent::InstanceDown { instance: InstanceId(0) }));
        let mut done = Vec::new();
        f.take_finished(&mut done);
        assert_eq!(done.len(), 1, "the drained instance's request finished elsewhere");
        // Three instances held GPUs for the first 10 s (one of them starting).
        assert!(f.instance_hours(now) >= 3.0 * 10.0 / 3600.0);
    }
}
