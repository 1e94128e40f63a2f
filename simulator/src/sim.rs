//! The simulation driver: arrivals from a workload, routing by the real controller, a
//! simulated fleet, metrics.
//!
//! One loop, always the same short sequence: take the earliest of (next arrival, next fleet
//! event, controller deadline); deliver it; hand the fleet's news to the controller, its
//! finished requests to the metrics, and the requests it evicted back to the controller to be
//! placed again (away from the instance they left when another admits: see
//! [`policies::Controller::reroute`]). Arrivals win ties with fleet events, so requests that
//! arrive at the same microsecond share an iteration, as they would in a real engine.
//!
//! Most fleet events are decode steps that change nothing the controller reads before its
//! next decision. The fleet holds their load reports back ([`SimFleet::hold_loads`]; the
//! controller hears each instance's latest before it routes, ticks, places, releases or is
//! sampled) and steps on without coming back to the loop while it has nothing to hand over
//! and nothing else is due ([`SimFleet::step_on`]): the same events in the same order, without
//! a pass of the loop per step. An instance that only decodes goes further: it coasts through
//! its steps up to the next that matters on one queued event (`fleet::Coast`), and whatever
//! the driver does to it or reads of it before then finds it where the steps one by one would
//! have left it.
//!
//! An evicted request keeps its id, arrival and progress (`Request::resume`): the next
//! instance recomputes its prompt and output so far and generates the rest, and it is
//! recorded once, when it finishes (or counted as refused if no instance can take it).

use crate::fleet::{KvOptions, SimFleet};
use crate::infinite_cache::InfiniteCacheBound;
use crate::metrics::{FleetCost, Metrics, SessionsSummary, SpeculationReport, Summary};
use crate::phases::{NoStopwatch, Phase, PhaseTimes, Stopwatch};
use crate::pools::{direction_changes, PdRun, PoolsReport};
use crate::slo::Slo;
use crate::timeline::{restore_times_by_finish_s, restore_times_s, Sizes, Timeline};
use crate::workload::{Arrival, MaxTokens, SessionStats, TurnEnd, Workload, WorkloadError};
use cost::{CostModel, CostModelExecutor, Drafter};
use engine::{Dur, Finished, InstanceConfig, InstanceId, Request, RequestId, Time};
use policies::{Controller, ControllerConfig, Fleet, FleetEvent, Flow, FlowConfig, Released, RouterConfig, Unplaced};
use serde::{Deserialize, Serialize};

/// Everything one run needs besides its workload.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    /// The run's name in reports (the router's, or `router@tiers`).
    pub label: String,
    pub router: RouterConfig,
    pub instances: u32,
    pub instance: InstanceConfig,
    pub cost: CostModel,
    pub slo: Slo,
    /// Blocks of the fleet's shared L3 store; `None`: no L3 (L2 is in `instance`).
    pub l3_blocks: Option<u32>,
    /// How late KV events reach the controller.
    pub event_delay: Dur,
    /// Also measure the hit rate of an infinite shared cache (memory grows with the distinct
    /// blocks of the workload).
    pub infinite_cache_bound: bool,
    /// A disaggregated fleet (prefill and decode pools) instead of `instances` colocated ones.
    pub pd: Option<PdRun>,
    /// Window of the time series (`None`: no time series).
    pub timeline: Option<Dur>,
    /// When the workload shifts (seconds), for the time to restore the SLO after each.
    pub shifts_s: Vec<f64>,
    /// Speculative decoding's drafter (`None`: one token per decode step).
    pub drafter: Option<&'static Drafter>,
    /// The live path's latency per request outside the engines' steps (gateway, routing,
    /// gRPC both ways, streaming): a request reaches the router this long after it arrives,
    /// and its latencies count from its arrival. Measured on a live fleet by `fleetplane
    /// latency`; zero models an ideal path.
    pub dispatch: Dur,
    /// What clients ask as `max_tokens`: all the router and the load reports know of an
    /// output before it ends; the engine still ends it where the workload says.
    pub max_tokens: MaxTokens,
    /// Instances per GPU (1: each has its own); above 1 they share its time.
    pub instances_per_gpu: u32,
    /// The share of a shared GPU's time left to steps while several overlap (context switches
    /// cost the rest).
    pub gpu_share_efficiency: f64,
    /// Flow control at the controller (`None`: every request placed as it arrives).
    pub flow: FlowConfig,
    /// Each class's SLO, by [`engine::Class::index`]; `None`: one SLO for all, no per-class
    /// report.
    pub class_slos: Option<[Slo; 3]>,
    /// Tenants' names by id, for the per-tenant report (empty: none).
    pub tenants: Vec<String>,
    /// Stop as soon as the run cannot meet this SLO attainment (for a search, which needs
    /// only the verdict of a run that misses); `None`: run to the end.
    pub give_up: Option<GiveUp>,
}

/// A run's SLO attainment target over its known number of requests ([`SimConfig::give_up`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GiveUp {
    pub attainment: f64,
    /// The workload's requests (the same at every rate for a trace:
    /// [`crate::scenario::Settings::fixed_request_count`]).
    pub requests: u64,
}

/// Controller ticks in a row with no arrival and no fleet event left, after which a run with
/// requests still in flight is stuck (the controller cannot place them).
const MAX_IDLE_TICKS: u32 = 1_000_000;

/// Windows whose attainment is at least this meet the SLO (for restore times).
pub const RESTORE_ATTAINMENT: f64 = 0.99;

/// One routing decision, kept for explanation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub request: RequestId,
    pub at_s: f64,
    pub prompt_tokens: u32,
    pub instance: InstanceId,
    /// The router's reason ([`policies::Why`]), as JSON.
    pub why: serde_json::Value,
}

/// Requests between two sampled decisions, and the most kept.
const DECISION_EVERY: u64 = 500;
const DECISIONS_KEPT: usize = 24;

/// How far a run has come, for a progress display.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub arrivals: u64,
    pub now: Time,
}

/// What one run produced.
#[derive(Clone, Debug)]
pub struct RunOutput {
    pub router: String,
    pub summary: Summary,
    pub ttft_cdf: Vec<(f64, f64)>,
    pub tpot_cdf: Vec<(f64, f64)>,
    /// Why the first refused request was refused, if any was.
    pub first_rejection: Option<String>,
    /// A sample of routing decisions with their reasons.
    pub decisions: Vec<Decision>,
    /// The run stopped early: it could no longer meet [`SimConfig::give_up`]'s attainment
    /// (its summary covers the requests recorded until then).
    pub gave_up: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Workload(#[from] WorkloadError),
}

/// Arrivals between progress reports.
const PROGRESS_EVERY: u64 = 8192;

/// Runs `workload` through a fleet built from `config` until every request has finished.
pub fn run(
    config: &SimConfig,
    workload: Box<dyn Workload>,
    progress: &mut dyn FnMut(Progress),
) -> Result<RunOutput, SimError> {
    drive(config, workload, progress, &mut NoStopwatch)
}

/// [`run`], also measuring where its wall-clock time went (for benchmarks; the output is the
/// same as [`run`]'s).
pub fn run_timed(
    config: &SimConfig,
    workload: Box<dyn Workload>,
    progress: &mut dyn FnMut(Progress),
) -> Result<(RunOutput, PhaseTimes), SimError> {
    let mut times = PhaseTimes::default();
    let out = drive(config, workload, progress, &mut times)?;
    Ok((out, times))
}

fn drive<S: Stopwatch>(
    config: &SimConfig,
    mut workload: Box<dyn Workload>,
    progress: &mut dyn FnMut(Progress),
    watch: &mut S,
) -> Result<RunOutput, SimError> {
    let mut run = Run::new(config);
    run.closed_loop = workload.closed_loop();
    let mut next = workload.next_arrival(Vec::new())?;
    watch.lap(Phase::Workload);
    loop {
        // A request is routed `dispatch` after it arrives: a constant, so arrivals keep their order.
        let t_arrival = next.as_ref().map(|a| a.at + config.dispatch);
        let t_fleet = run.fleet.next_time();
        let t_tick = run.controller.next_deadline();
        let earliest = [t_arrival, t_fleet].into_iter().flatten().min();
        // Flow control sheds queued requests on time even when nothing else happens.
        let shed_due = run.flow.next_deadline().filter(|&t| earliest.is_none_or(|e| t <= e));
        // With nothing else to come, ticks matter only while requests wait in the fleet for
        // the controller (handoffs waiting for a decode instance).
        let tick_due = t_tick.filter(|&t| earliest.map_or(run.fleet.in_flight() > 0, |e| t <= e));
        if let Some(t) = tick_due {
            run.tick(t, earliest.is_none());
            watch.lap(Phase::Controller);
        } else if let Some(t) = shed_due {
            run.now = run.now.max(t);
            run.release(watch);
        } else if t_arrival.is_some_and(|a| t_fleet.is_none_or(|f| a <= f)) {
            let a = next.take().expect("an arrival is due");
            run.arrive(a, watch);
            if run.arrivals.is_multiple_of(PROGRESS_EVERY) {
                progress(Progress { arrivals: run.arrivals, now: run.now });
            }
            next = workload.next_arrival(Vec::new())?;
            watch.lap(Phase::Workload);
        } else if t_fleet.is_some() {
            run.fleet.hold_loads(quiet_steps() && !run.controller.wants_loads_at_once());
            let until = if quiet_steps() { run.quiet_until(t_arrival, t_tick) } else { Time::ZERO };
            run.now = run.fleet.step_on(until);
            watch.lap(Phase::Engine);
        } else {
            break;
        }
        run.settle(watch);
        if !run.turn_ends.is_empty() {
            // A closed-loop workload's next turns may now come before the arrival held.
            for end in run.turn_ends.drain(..) {
                workload.ended(end);
            }
            if let Some(a) = next.take() {
                workload.put_back(a);
            }
            next = workload.next_arrival(Vec::new())?;
            watch.lap(Phase::Workload);
        }
        if config.give_up.is_some_and(|g| run.metrics.cannot_reach(g.attainment, g.requests)) {
            progress(Progress { arrivals: run.arrivals, now: run.now });
            return Ok(run.finish(workload.sessions(), true));
        }
    }
    progress(Progress { arrivals: run.arrivals, now: run.now });
    assert!(run.flow.is_empty(), "the run ended with {} requests queued by flow control", run.flow.len());
    Ok(run.finish(workload.sessions(), false))
}

#[cfg(test)]
thread_local! {
    /// Every step's load reported at once and every step a pass of the loop (for the test
    /// that compares runs with and without held loads and `step_on`).
    static STEP_BY_STEP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether steps may hold their loads back and the fleet step on without the loop.
fn quiet_steps() -> bool {
    #[cfg(test)]
    return !STEP_BY_STEP.with(std::cell::Cell::get);
    #[cfg(not(test))]
    true
}

/// One run's state between the loop's steps: the controller, the fleet and what is measured.
struct Run<'c> {
    config: &'c SimConfig,
    controller: Controller,
    /// Requests waiting for room at the controller (flow control).
    flow: Flow<()>,
    released: Vec<Released<()>>,
    fleet: SimFleet,
    metrics: Metrics,
    timeline: Option<Timeline>,
    bound: Option<InfiniteCacheBound>,
    decisions: Vec<Decision>,
    first_rejection: Option<String>,
    transfers: u64,
    idle_ticks: u32,
    arrivals: u64,
    now: Time,
    gpus_per_instance: u32,
    // Buffers reused across steps.
    events: Vec<FleetEvent>,
    finished: Vec<Finished>,
    evicted: Vec<(InstanceId, Request)>,
    commands: Vec<policies::Command>,
    /// Whether the workload hears of its requests' ends, and those it has not heard yet.
    closed_loop: bool,
    turn_ends: Vec<TurnEnd>,
}

impl<'c> Run<'c> {
    /// The controller (with pools for P/D), the fleet it routes to, and the fleet's first news.
    fn new(config: &'c SimConfig) -> Run<'c> {
        let hints = cost::cost_hints(&config.cost, &config.instance);
        let targets = config.class_slos.unwrap_or([config.slo; 3]).map(|s| s.targets());
        let mut instance = config.instance.clone();
        if instance.class_priority {
            instance.lower_class_step_tokens = config.flow.lower_class_step_tokens(&hints, &targets);
        }
        let mut controller = Controller::new(&ControllerConfig { router: config.router, seed: config.seed, hints })
            .with_offload_chunks(config.instance.offload_chunk_blocks);
        controller.set_targets(targets);
        if let Some(pd) = &config.pd {
            let pools = pd.pd_config(&config.cost, config.slo, config.instance.block_size, hints.prefill_tokens_per_s);
            controller = controller.with_pools(pools);
        }
        let mut executor = CostModelExecutor::new(config.cost.clone());
        if let Some(d) = config.drafter {
            executor = executor.with_drafter(d, config.seed);
        }
        let kv = KvOptions {
            l3_blocks: config.l3_blocks,
            publish_events: controller.wants_kv_events(),
            event_delay: config.event_delay,
        };
        let mut fleet = match &config.pd {
            None => SimFleet::new(config.instances, &instance, executor, kv),
            Some(pd) => SimFleet::disaggregated(pd.pool_options(&config.cost), &instance, executor, kv),
        };
        fleet.share_gpus(config.instances_per_gpu, config.gpu_share_efficiency);
        let flow = Flow::new(&config.flow, &hints, targets);
        fleet.coast(quiet_steps() && !flow.is_on());
        if controller.wants_latencies() {
            fleet.report_latencies();
        }
        let mut run = Run {
            config,
            flow,
            released: Vec::new(),
            controller,
            fleet,
            metrics: match config.class_slos {
                Some(slos) => Metrics::with_classes(config.slo, slos, &config.tenants),
                None => Metrics::new(config.slo),
            },
            timeline: config.timeline.map(|w| Timeline::new(w, config.slo)),
            bound: config.infinite_cache_bound.then(InfiniteCacheBound::default),
            decisions: Vec::new(),
            first_rejection: None,
            transfers: 0,
            idle_ticks: 0,
            arrivals: 0,
            now: Time::ZERO,
            gpus_per_instance: config.cost.gpus(),
            events: Vec::new(),
            finished: Vec::new(),
            evicted: Vec::new(),
            commands: Vec::new(),
            closed_loop: false,
            turn_ends: Vec::new(),
        };
        run.fleet.poll_events(&mut run.events);
        for e in run.events.drain(..) {
            run.controller.on_event(run.now, &e);
        }
        run
    }

    /// The controller's deadline at `t`; `idle`: nothing else is to come.
    fn tick(&mut self, t: Time, idle: bool) {
        self.idle_ticks = if idle { self.idle_ticks + 1 } else { 0 };
        assert!(
            self.idle_ticks < MAX_IDLE_TICKS,
            "the controller cannot place the requests left in the fleet: {} in flight, pools {:?}, fleet {:?}",
            self.fleet.in_flight(),
            self.controller.pools(),
            self.fleet.pool_counts()
        );
        self.now = self.now.max(t);
        self.hear_loads();
        self.controller.tick(self.now, &mut self.commands);
        for c in self.commands.drain(..) {
            self.fleet.apply(self.now, &c);
        }
    }

    /// An arrival, routed `dispatch` after it arrives.
    fn arrive<S: Stopwatch>(&mut self, a: Arrival, watch: &mut S) {
        self.now = a.at + self.config.dispatch;
        let (max_output_tokens, ends_after) = self.config.max_tokens.apply(a.output_tokens);
        let request = Request {
            id: RequestId(self.arrivals),
            arrival: a.at,
            prompt_tokens: a.prompt_tokens,
            max_output_tokens,
            ends_after,
            block_hashes: a.block_hashes,
            resume: None,
            service: a.service,
            model: Default::default(),
        };
        self.arrivals += 1;
        if let Some(b) = &mut self.bound {
            b.observe(&request, self.config.instance.block_size);
        }
        watch.lap(Phase::Metrics);
        self.hear_loads();
        let r = self.controller.offer(&mut self.flow, &mut self.fleet, self.now, request, ());
        self.outcome(r);
        watch.lap(Phase::Routing);
    }

    /// What became of a request offered or released: a decision kept now and then, a
    /// refusal or a shed counted.
    fn outcome(&mut self, r: Released<()>) {
        match r {
            Released::Placed { id, prompt_tokens, route } => {
                if id.0.is_multiple_of(DECISION_EVERY) && self.decisions.len() < DECISIONS_KEPT {
                    self.decisions.push(Decision {
                        request: id,
                        at_s: self.now.as_secs_f64(),
                        prompt_tokens,
                        instance: route.prefill,
                        why: serde_json::to_value(&route.why).unwrap_or_default(),
                    });
                }
            }
            Released::Queued => {}
            Released::Unplaced(Unplaced { error, request, .. }) => self.refused(request, error.to_string(), None),
            Released::Shed(shed) => {
                self.metrics.record_shed(&shed.request);
                self.turn_failed(&shed.request);
            }
        }
    }

    /// Flow control's turn: queued requests placed while there is room, the expired shed.
    fn release<S: Stopwatch>(&mut self, watch: &mut S) {
        if !self.flow.is_on() {
            return;
        }
        self.hear_loads();
        let mut released = std::mem::take(&mut self.released);
        self.controller.release(&mut self.flow, &mut self.fleet, self.now, &mut released);
        for r in released.drain(..) {
            self.outcome(r);
        }
        self.released = released;
        watch.lap(Phase::Routing);
    }

    /// A request no instance takes: counted, and the first one's reason kept.
    fn refused(&mut self, request: Request, error: String, evicted_from: Option<InstanceId>) {
        self.metrics.record_rejected(&request);
        self.turn_failed(&request);
        self.first_rejection.get_or_insert_with(|| match evicted_from {
            None => format!("{}: {error}", request.id),
            Some(from) => format!("{} (evicted from {from}): {error}", request.id),
        });
    }

    /// After each step: the fleet's news to the controller, its finished requests to the
    /// metrics, the requests it evicted placed again.
    fn settle<S: Stopwatch>(&mut self, watch: &mut S) {
        let now = self.now;
        self.fleet.poll_events(&mut self.events);
        for e in self.events.drain(..) {
            self.transfers += u64::from(matches!(e, FleetEvent::TransferDone { .. }));
            self.controller.on_event(now, &e);
            match e {
                FleetEvent::Kv { events, .. } => {
                    self.fleet.recycle(events);
                    watch.lap(Phase::Index);
                }
                _ => watch.lap(Phase::Controller),
            }
        }
        if self.timeline.as_ref().is_some_and(|tl| tl.due(now)) {
            self.hear_loads();
            let sizes = Sizes::from_counts(&self.fleet.pool_counts(), self.fleet.holding(), self.gpus_per_instance);
            if let Some(tl) = &mut self.timeline {
                tl.sample(now, sizes, &self.controller);
            }
        }
        self.fleet.take_finished(&mut self.finished);
        for f in self.finished.drain(..) {
            if let Some(tl) = &mut self.timeline {
                tl.record(&f);
            }
            self.metrics.record(&f);
            if let Some(session) = f.request.service.session.filter(|_| self.closed_loop) {
                let within_slo = self.metrics.slo_of(f.request.service.class).met_by(&f);
                let finished = f.ended.is_none();
                self.turn_ends.push(TurnEnd { session, at: f.finished_at, finished, within_slo });
            }
        }
        watch.lap(Phase::Metrics);
        let mut evicted = std::mem::take(&mut self.evicted);
        self.fleet.take_evicted(&mut evicted);
        if !evicted.is_empty() {
            self.hear_loads();
        }
        for (from, request) in evicted.drain(..) {
            self.metrics.record_eviction();
            match self.controller.place(&mut self.fleet, now, request, (), Some(from)) {
                Ok(_) => self.metrics.record_reroute(),
                Err(Unplaced { error, request, .. }) => self.refused(request, error.to_string(), Some(from)),
            }
            watch.lap(Phase::Routing);
        }
        self.evicted = evicted;
        self.release(watch);
        if cfg!(any(test, feature = "invariants")) {
            self.fleet.check_view(self.controller.fleet());
            assert_eq!(
                self.controller.unmatched_ends(),
                0,
                "the fleet ended requests the controller never placed there"
            );
        }
    }

    /// Until when the fleet may step on without the driver ([`SimFleet::step_on`]): before
    /// the next arrival, tick, shedding or time-series window, whichever comes first; not at
    /// all with flow control, which may release requests after any step.
    fn quiet_until(&self, arrival: Option<Time>, tick: Option<Time>) -> Time {
        if self.flow.is_on() {
            return Time::ZERO;
        }
        let window = self.timeline.as_ref().map(Timeline::next_due);
        [arrival, tick, self.flow.next_deadline(), window].into_iter().flatten().min().unwrap_or(Time(u64::MAX))
    }

    /// Delivers the loads the fleet held back ([`SimFleet::hold_loads`]): the controller
    /// hears each instance's latest before it routes, ticks or is sampled.
    fn hear_loads(&mut self) {
        self.fleet.take_loads(self.now, &mut self.events);
        for e in self.events.drain(..) {
            self.controller.on_event(self.now, &e);
        }
    }

    /// A closed-loop session's request that will not finish: its session ends.
    fn turn_failed(&mut self, request: &Request) {
        if let Some(session) = request.service.session.filter(|_| self.closed_loop) {
            self.turn_ends.push(TurnEnd { session, at: self.now, finished: false, within_slo: false });
        }
    }

    /// The run's summary, CDFs and pools report, once every request has left the fleet (or
    /// once it `gave_up`: of the requests recorded so far).
    fn finish(mut self, sessions: Option<SessionStats>, gave_up: bool) -> RunOutput {
        self.hear_loads();
        self.fleet.end_coasts(self.now);
        let (config, now) = (self.config, self.now);
        assert!(gave_up || self.fleet.in_flight() == 0, "the fleet went idle with requests in flight");
        let mut metrics = self.metrics;
        metrics.record_admission_paused(self.fleet.admission_paused(now));
        let gpus = config.instances.div_ceil(config.instances_per_gpu.max(1)) * config.cost.gpus();
        let cost = FleetCost { gpus, price_per_gpu_hour: config.cost.price_per_hour() / f64::from(config.cost.gpus()) };
        let mut summary = metrics.summary(&cost);
        summary.max_hit_rate = self.bound.map(|b| b.hit_rate());
        let time = self.fleet.gpu_time();
        summary.gpu_busy_s = time.busy_s;
        summary.prefill_time_share = time.prefill_share();
        if let (Some(d), Some(tally)) = (config.drafter, self.fleet.speculation()) {
            summary.speculation = Some(SpeculationReport {
                drafter: d.name.to_string(),
                verify_steps: tally.verifications,
                accepted_per_step: tally.mean_accepted(),
                expected_accepted: d.expected_accepted(),
            });
        }
        let sizes = Sizes::from_counts(&self.fleet.pool_counts(), self.fleet.holding(), self.gpus_per_instance);
        let series = self.timeline.map(|tl| tl.finish(now, sizes, &self.controller));
        if config.pd.is_some() || series.is_some() {
            let (points, arrivals) = series.unwrap_or_default();
            let (mode, autoscaler, startup_s, gpu_budget) = match &config.pd {
                Some(pd) => {
                    // The fleet's size changed over the run: GPU time is integrated, from time zero.
                    summary.gpu_hours = self.fleet.instance_hours(now) * f64::from(self.gpus_per_instance);
                    let mtok = (summary.input_tokens + summary.output_tokens) as f64 / 1e6;
                    summary.cost_per_mtok =
                        if mtok > 0.0 { summary.gpu_hours * cost.price_per_gpu_hour / mtok } else { 0.0 };
                    ("pd", pd.autoscaler.name(), pd.startup.as_secs_f64(), pd.gpu_budget)
                }
                None => ("colocated", "none", 0.0, gpus),
            };
            let events = self.controller.scaling_events();
            summary.pools = Some(PoolsReport {
                mode: mode.to_string(),
                autoscaler: autoscaler.to_string(),
                startup_s,
                gpu_budget,
                scaling_events: events.len() as u64,
                scaling: events.to_vec(),
                transfers: self.transfers,
                shifts_s: config.shifts_s.clone(),
                restore_s: restore_times_s(&arrivals, &config.shifts_s, RESTORE_ATTAINMENT),
                restore_by_finish_s: restore_times_by_finish_s(&points, &config.shifts_s, RESTORE_ATTAINMENT),
                direction_changes: direction_changes(events, &config.shifts_s),
                timeline: points,
            });
        }
        summary.sessions = sessions.map(|s| SessionsSummary::new(&s, summary.gpu_hours));
        RunOutput {
            router: config.label.clone(),
            summary,
            ttft_cdf: metrics.ttft_cdf(),
            tpot_cdf: metrics.tpot_cdf(),
            first_rejection: self.first_rejection,
            decisions: self.decisions,
            gave_up,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Scenario;
    use crate::workload::Arrival;
    use engine::BlockHash;
    use std::collections::VecDeque;

    /// Arrivals given one by one.
    struct Given(VecDeque<Arrival>);

    impl Workload for Given {
        fn next_arrival(&mut self, _buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
            Ok(self.0.pop_front())
        }
    }

    fn arrival(at_ms: u64, prompt_tokens: u32) -> Arrival {
        Arrival {
            at: Time(at_ms * 1000),
            prompt_tokens,
            output_tokens: 8,
            block_hashes: Vec::new(),
            service: Default::default(),
        }
    }

    fn config(router: &str) -> SimConfig {
        let text = format!(
            "routers = [\"{router}\"]\n[fleet]\ninstances = 2\n[workload.synthetic]\nrequests = 1\n\
             arrival = {{ kind = \"poisson\", rate_rps = 1.0 }}\ninput = {{ kind = \"constant\", tokens = 100 }}\n\
             output = {{ kind = \"constant\", tokens = 10 }}"
        );
        let s: Scenario = toml::from_str(&text).expect("parses");
        let settings = s.resolve().expect("valid");
        settings.sim_config(&settings.routers[0])
    }

    /// A request the fleet refuses after the controller routed it (an empty prompt: only the
    /// engine checks) is undone in the controller, not left counted in flight on its
    /// instance. The run checks the controller's view against the fleet after every event.
    #[test]
    fn a_request_the_fleet_refuses_is_not_left_in_flight() {
        for router in RouterConfig::names() {
            let arrivals = [arrival(0, 0), arrival(1, 100), arrival(2, 0), arrival(3, 50)];
            let out = run(&config(router), Box::new(Given(arrivals.into())), &mut |_| {}).expect("runs");
            assert_eq!((out.summary.requests, out.summary.rejected), (2, 2), "{router}: {:?}", out.summary);
            let why = out.first_rejection.unwrap_or_default();
            assert!(why.contains("empty prompt"), "{router}: {why}");
        }
    }

    /// Runs `check` on every example scenario's runs (tiers, KV protection, P/D pools,
    /// drafters, flow control, closed-loop sessions) on their first `max_requests` arrivals;
    /// returns how many there were.
    fn every_example_run(max_requests: u64, mut check: impl FnMut(&str, &dyn Fn() -> RunOutput)) -> usize {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        let mut files: Vec<_> = std::fs::read_dir(&dir).expect("examples").flatten().map(|e| e.path()).collect();
        files.sort();
        let mut runs = 0;
        for path in files.iter().filter(|p| p.extension().is_some_and(|e| e == "toml")) {
            let mut s = Scenario::load(path).expect("loads");
            s.workload.max_requests = Some(max_requests);
            let settings = s.resolve().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            for spec in &settings.routers {
                let config = SimConfig { infinite_cache_bound: false, ..settings.sim_config(spec) };
                let once = || {
                    let workload = settings.open_workload(settings.rate_scale).expect("opens");
                    run(&config, workload, &mut |_| {}).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
                };
                check(&format!("{} {}", path.display(), config.label), &once);
                runs += 1;
            }
        }
        runs
    }

    /// Every example's runs with the controller's view checked after every event.
    #[test]
    fn the_controllers_view_matches_the_fleet_in_every_example() {
        let runs = every_example_run(300, |_, once| {
            once();
        });
        assert!(runs >= 40, "only {runs} runs");
    }

    /// Held loads, steps without the loop and coasting change nothing: every example's runs
    /// (P/D pools with waiting handoffs, flow control, time series, closed-loop sessions,
    /// drafters, shared GPUs) give the same report as runs that report every step's load at
    /// once, pass the loop after every step and never coast.
    #[test]
    fn held_loads_and_quiet_steps_change_no_result() {
        let report = |once: &dyn Fn() -> RunOutput, step_by_step: bool| {
            STEP_BY_STEP.with(|s| s.set(step_by_step));
            let out = once();
            STEP_BY_STEP.with(|s| s.set(false));
            serde_json::to_string(&(&out.summary, &out.ttft_cdf, &out.tpot_cdf, &out.decisions)).expect("JSON")
        };
        let runs = every_example_run(400, |name, once| {
            assert_eq!(report(once, false), report(once, true), "{name}");
        });
        assert!(runs >= 40, "only {runs} runs");
    }

    /// A closed-loop workload hears of every turn's end: each session runs to its end, every
    /// turn sent is a request finished or refused, and the same seed gives the same run.
    #[test]
    fn closed_loop_sessions_are_driven_to_their_end() {
        let text = "routers = [\"cache-aware\"]\n[fleet]\ninstances = 2\n[workload.agentic]\nsessions = 40\n\
             arrival = { kind = \"poisson\", rate_rps = 4.0 }\nturns = { kind = \"uniform\", min = 1, max = 6 }\n\
             task = { kind = \"uniform\", min = 100, max = 2000 }\noutput = { kind = \"uniform\", min = 10, max = 200 }\n\
             tool_output = { kind = \"uniform\", min = 0, max = 500 }\ntool_ms = { kind = \"uniform\", min = 0, max = 3000 }\n\
             system = { groups = 2, tokens = 1024, share = 0.5 }\n[workload.classes]\n\
             mix = [{ class = \"interactive\", share = 1.0 }, { class = \"batch\", share = 1.0 }]";
        let s: Scenario = toml::from_str(text).expect("parses");
        let settings = s.resolve().expect("valid");
        let once = || {
            let config = settings.sim_config(&settings.routers[0]);
            run(&config, settings.open_workload(1.0).expect("opens"), &mut |_| {}).expect("runs")
        };
        let out = once();
        let sessions = out.summary.sessions.expect("a closed-loop run reports its sessions");
        assert_eq!(sessions.started, 40);
        assert_eq!(sessions.completed + sessions.failed, 40, "{sessions:?}");
        assert_eq!(sessions.cut, 0);
        assert_eq!(sessions.turns, out.summary.requests + out.summary.rejected);
        assert!(sessions.turns > 40, "sessions have several turns");
        assert!(out.summary.cache_hit_rate > 0.3, "turns reuse their context: {}", out.summary.cache_hit_rate);
        assert_eq!(serde_json::to_string(&once().summary).ok(), serde_json::to_string(&out.summary).ok());
    }
}
