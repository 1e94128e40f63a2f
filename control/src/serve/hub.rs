//! The control plane's one point of decision: the same [`Controller`] the simulator runs,
//! fed by the live fleet, behind a mutex that is never held across an await.

use super::live_fleet::{LiveFleet, MAX_ATTEMPTS};
use super::metrics::Metrics;
use super::news::{Delta, News, Payload};
use engine::{Class, Dur, TenantId};
use engine::{Request, RequestId, Time};
use policies::flow::ShedReason;
use policies::{
    Command, Controller, ControllerConfig, Fleet, FleetEvent, Flow, FlowConfig, PdConfig, PlaceError, Released,
    ScalingEvent, Targets, Unplaced,
};
use simulator::slo::Slo;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

pub struct Hub {
    /// The prompt prefixes recent requests share (the console's cache page).
    pub prefixes: super::prefixes::SharedPrefixes,
    /// The router's latest decisions with their reasons.
    pub decisions: super::decisions::RecentDecisions,
    pub controller: Controller,
    pub fleet: LiveFleet,
    pub config: ControllerConfig,
    /// The engine a colocated fleet's routers price steps as (its cost shape and block size),
    /// once one has registered (see `registry::price_as`).
    pub priced_as: Option<(crate::proto::CostShape, u32)>,
    /// The pools of a disaggregated fleet (`serve --mode pd`); `None`: colocated.
    pub pools: Option<PdConfig>,
    /// Whether this replica leads, and so sizes the pools.
    leading: bool,
    /// Scaling decisions of the controller already handed out to be stored.
    scaling_taken: usize,
    pub metrics: Arc<Metrics>,
    clock: Instant,
    /// High bits: this replica's nonce, so that two replicas never send one engine the same id.
    id_base: u64,
    next_request: u64,
    scratch: Vec<FleetEvent>,
    commands: Vec<Command>,
    /// Requests waiting for room (flow control; none while its rule is `none`).
    pub flow: Flow<Payload>,
    flow_config: FlowConfig,
    /// The fleet's SLO and the classes' own targets, which flow control sizes by.
    slo: Slo,
    class_slo: BTreeMap<Class, Slo>,
    /// Tenants by name, numbered as they first come.
    tenants: HashMap<String, TenantId>,
    released: Vec<Released<Payload>>,
}

/// What became of a request the gateway handed in.
pub enum Admitted {
    Placed,
    /// Waiting for room: its first delta says when it was placed or shed.
    Queued,
}

/// Why a request was not taken.
pub enum Refused {
    Place(PlaceError),
    Shed { reason: ShedReason, retry_after: Dur },
}

/// Tenants the hub numbers at most; later names share the last id (their requests are
/// served, fair-shared as one tenant).
pub const MAX_TENANTS: usize = 10_000;

impl Hub {
    pub fn new(
        config: ControllerConfig,
        pools: Option<PdConfig>,
        mut fleet: LiveFleet,
        metrics: Arc<Metrics>,
        replica_nonce: u32,
    ) -> Hub {
        let mut controller = build(&config, pools, false);
        fleet.configure(controller.wants_latencies(), pools.map(|p| p.transfer));
        let clock = fleet.clock();
        let slo = Slo { ttft_ms: super::DEFAULT_SLO.0, tpot_ms: super::DEFAULT_SLO.1 };
        let targets = targets(slo, &BTreeMap::new());
        controller.set_targets(targets);
        let flow = Flow::new(&FlowConfig::None, &config.hints, targets);
        Hub {
            flow,
            flow_config: FlowConfig::None,
            slo,
            class_slo: BTreeMap::new(),
            tenants: HashMap::new(),
            released: Vec::new(),
            prefixes: Default::default(),
            decisions: Default::default(),
            controller,
            fleet,
            config,
            priced_as: None,
            pools,
            leading: false,
            scaling_taken: 0,
            metrics,
            clock,
            id_base: u64::from(replica_nonce) << 40,
            next_request: 0,
            scratch: Vec::new(),
            commands: Vec::new(),
        }
    }

    pub fn now(&self) -> Time {
        Time(self.clock.elapsed().as_micros() as u64)
    }

    pub fn next_request_id(&mut self) -> RequestId {
        self.next_request += 1;
        RequestId(self.id_base | (self.next_request & ((1 << 40) - 1)))
    }

    /// Puts a new policy in force: the router of `config` and the autoscaler of `pools`.
    /// What the controller knows of the fleet (loads, requests in flight, the prefix index,
    /// hand-offs waiting for a decode engine) stays.
    pub fn set_policy(&mut self, config: ControllerConfig, pools: Option<PdConfig>) {
        if config.router != self.config.router {
            self.controller.set_router(&config);
        }
        if let Some(p) = pools.filter(|p| self.pools.is_none_or(|old| old.autoscaler != p.autoscaler)) {
            self.controller.set_autoscaler(p.autoscaler);
        }
        self.config = config;
        self.pools = pools;
    }

    /// Leading (with an actuator to carry out its decisions), this replica's controller sizes
    /// the pools; otherwise it only pairs hand-offs and computes the loads.
    pub fn set_leading(&mut self, leading: bool) {
        self.leading = leading;
        let on = self.sizes_pools();
        self.controller.set_autoscaling(on);
    }

    fn sizes_pools(&self) -> bool {
        self.leading && self.fleet.actuator().is_some()
    }

    /// Puts stored SLO targets in force for the pools' loads (a colocated fleet has none)
    /// and for flow control's sizing.
    pub fn set_slo(&mut self, ttft_ms: f64, tpot_ms: f64) {
        let slo = Slo { ttft_ms, tpot_ms };
        if slo != self.slo {
            self.slo = slo;
            let (flow, class_slo) = (self.flow_config, self.class_slo.clone());
            self.rebuild_flow(flow, class_slo);
        }
        let Some(p) = &mut self.pools else { return };
        if (p.slo.ttft_target_ms, p.slo.tpot_target_ms) != (ttft_ms, tpot_ms) {
            (p.slo.ttft_target_ms, p.slo.tpot_target_ms) = (ttft_ms, tpot_ms);
            self.controller.set_slo_targets(ttft_ms, tpot_ms);
            tracing::info!(ttft_ms, tpot_ms, "SLO targets in force for the pools' loads");
        }
    }

    /// The flow control rule in force, with its parameters that differ from the defaults.
    pub fn flow_label(&self) -> String {
        self.flow_config.label()
    }

    /// Puts a flow control rule in force, with the classes' own targets; the requests
    /// waiting are offered to it in turn (none is lost).
    pub fn set_flow(&mut self, flow: FlowConfig, class_slo: BTreeMap<Class, Slo>) {
        if flow != self.flow_config || class_slo != self.class_slo {
            tracing::info!(flow = flow.label(), ?class_slo, "flow control in force");
            self.rebuild_flow(flow, class_slo);
        }
    }

    fn rebuild_flow(&mut self, flow: FlowConfig, class_slo: BTreeMap<Class, Slo>) {
        let targets = targets(self.slo, &class_slo);
        self.controller.set_targets(targets);
        let fresh = Flow::new(&flow, &self.config.hints, targets);
        let waiting = std::mem::replace(&mut self.flow, fresh).remove_where(|_| true);
        (self.flow_config, self.class_slo) = (flow, class_slo);
        let now = self.now();
        for (request, payload) in waiting {
            let r = self.controller.offer(&mut self.flow, &mut self.fleet, now, request, payload);
            self.settle(r);
        }
    }

    /// The classes' targets flow control sizes by, and the cap of lower classes' chunks its
    /// rule asks engines with class priority for.
    pub fn lower_class_step_tokens(&self) -> Option<u32> {
        self.flow_config.lower_class_step_tokens(&self.config.hints, &targets(self.slo, &self.class_slo))
    }

    /// The tenant named `name`, numbered the first time it comes.
    pub fn tenant(&mut self, name: &str) -> TenantId {
        if let Some(&id) = self.tenants.get(name) {
            return id;
        }
        let id = TenantId(self.tenants.len().min(MAX_TENANTS) as u32);
        if self.tenants.len() < MAX_TENANTS {
            self.tenants.insert(name.to_string(), id);
        }
        id
    }

    /// A new request from the gateway, through flow control: placed now, queued, or refused
    /// (the payload comes back, boxed: it is large and refusals are rare).
    pub fn admit(&mut self, request: Request, payload: Payload) -> Result<Admitted, (Refused, Box<Payload>)> {
        self.pump();
        let now = self.now();
        let started = Instant::now();
        let (id, class) = (request.id, request.service.class);
        let r = self.controller.offer(&mut self.flow, &mut self.fleet, now, request, payload);
        self.metrics.route_seconds.observe(started.elapsed().as_secs_f64());
        let outcome = match r {
            Released::Placed { route, .. } => {
                tracing::debug!(request = %id, instance = %route.prefill, why = ?route.why, "routed");
                self.decisions.record(now, id, &route);
                Ok(Admitted::Placed)
            }
            Released::Queued => Ok(Admitted::Queued),
            Released::Unplaced(Unplaced { error, payload, .. }) => Err((Refused::Place(error), Box::new(payload))),
            Released::Shed(shed) => {
                let refused = Refused::Shed { reason: shed.reason, retry_after: shed.retry_after };
                Err((refused, Box::new(shed.payload)))
            }
        };
        self.metrics.flow(
            class,
            match &outcome {
                Ok(Admitted::Placed) => "placed",
                Ok(Admitted::Queued) => "queued",
                Err((Refused::Shed { reason, .. }, _)) => reason.code(),
                Err((Refused::Place(_), _)) => "refused",
            },
        );
        self.metrics.set_queued(self.flow.queued());
        outcome
    }

    /// Places what flow control holds while there is room; sheds what waited too long and
    /// drops what nobody waits for any more.
    fn release(&mut self) {
        if self.flow.is_empty() {
            return;
        }
        let now = self.now();
        let mut released = std::mem::take(&mut self.released);
        self.controller.release(&mut self.flow, &mut self.fleet, now, &mut released);
        for r in released.drain(..) {
            self.settle(r);
        }
        self.released = released;
        self.metrics.set_queued(self.flow.queued());
    }

    /// Drops the queued requests whose client went away (called now and then: it walks
    /// the whole queue).
    pub fn sweep_flow(&mut self) {
        let gone = self.flow.remove_where(|p| p.out.is_closed());
        if !gone.is_empty() {
            tracing::debug!(requests = gone.len(), "queued requests whose client went away dropped");
            self.metrics.set_queued(self.flow.queued());
        }
    }

    /// A released or re-offered request's outcome, told to its client.
    fn settle(&mut self, r: Released<Payload>) {
        match r {
            Released::Placed { id, route, .. } => {
                tracing::debug!(request = %id, instance = %route.prefill, "released by flow control");
                let now = self.now();
                self.decisions.record(now, id, &route);
            }
            Released::Queued => {}
            Released::Unplaced(Unplaced { error, payload, request }) => {
                self.metrics.flow(request.service.class, "refused");
                let _ = payload.out.send(Delta::Failed(format!("waited for room, then {error}")));
            }
            Released::Shed(shed) => {
                self.metrics.flow(shed.request.service.class, shed.reason.code());
                let _ = shed.payload.out.send(Delta::Shed { reason: shed.reason, retry_after: shed.retry_after });
            }
        }
    }

    /// Scaling decisions taken since the last call, to be stored.
    pub fn new_scaling_events(&mut self) -> Vec<ScalingEvent> {
        let all = self.controller.scaling_events();
        let new = all.get(self.scaling_taken..).unwrap_or_default().to_vec();
        self.scaling_taken = all.len();
        new
    }

    /// Feeds the fleet's pending events to the controller, then lets flow control place
    /// what they made room for.
    pub fn pump(&mut self) {
        self.fleet.poll_events(&mut self.scratch);
        let mut events = std::mem::take(&mut self.scratch);
        for e in events.drain(..) {
            self.feed(e);
        }
        self.scratch = events;
        self.release();
    }

    /// One fleet event to the controller; a load report also refreshes the engine's record.
    fn feed(&mut self, e: FleetEvent) {
        if let FleetEvent::Load { instance, load } = e {
            if let Some(m) = self.fleet.member_mut(instance) {
                m.load = load;
                m.last_seen = Instant::now();
            }
        }
        let now = self.now();
        self.controller.on_event(now, &e);
    }

    /// Takes in what the fleet's tasks learned.
    pub fn handle(&mut self, news: News) {
        match news {
            News::Event(e) => self.feed(e),
            News::EngineBack { instance } => {
                if self.fleet.revive(instance) {
                    tracing::info!(%instance, "engine answers again: serving (its cache taken as empty)");
                }
            }
            News::EngineLost { instance, why } => {
                tracing::warn!(%instance, "engine lost: {why}");
                self.fleet.lose(instance);
            }
            News::Replace { from, request, payload, why } => self.replace(from, request, payload, why),
            News::Parked(p) => self.fleet.park(p),
            News::Drained { instance } => {
                tracing::info!(%instance, "drained: holds no request");
                self.fleet.retire(instance);
            }
            News::Scheduling { instance, scheduling } => {
                if let Some(m) = self.fleet.member_mut(instance) {
                    m.scheduling = Some(scheduling);
                }
            }
        }
        self.pump();
        // A prefill that ended is paired at once, not at the driver's next tick.
        self.tick();
    }

    /// Places a request again after its engine vanished or evicted it; it resumes after the
    /// tokens its client already has.
    fn replace(&mut self, from: engine::InstanceId, request: Request, payload: Payload, why: String) {
        self.metrics.replaced.inc();
        if payload.attempts >= MAX_ATTEMPTS {
            let _ = payload.out.send(Delta::Failed(format!("{why}; gave up after {} placements", payload.attempts)));
            return;
        }
        if payload.out.is_closed() {
            return; // Nobody is listening any more.
        }
        tracing::info!(request = %request.id, %from, "placing again: {why}");
        self.pump();
        let now = self.now();
        match self.controller.place(&mut self.fleet, now, request, payload, Some(from)) {
            Ok(_) => {}
            Err(Unplaced { error: PlaceError::Reject(e), payload, .. }) => {
                let _ = payload.out.send(Delta::Failed(format!("{why}; no other engine can take it: {e}")));
            }
            Err(Unplaced { error, payload, .. }) => {
                let _ = payload.out.send(Delta::Failed(format!("{why}; then {error}")));
            }
        }
    }

    /// Runs the controller's periodic decisions (pairing hand-offs, sizing pools), when it
    /// wants them.
    pub fn tick(&mut self) {
        let now = self.now();
        if self.controller.next_deadline().is_some_and(|t| t <= now) {
            self.controller.tick(now, &mut self.commands);
            for c in std::mem::take(&mut self.commands) {
                self.fleet.apply(now, &c);
            }
            self.pump();
        }
    }
}

/// Each class's targets: its own where the policy gives them, else the fleet's SLO.
fn targets(slo: Slo, class_slo: &BTreeMap<Class, Slo>) -> [Targets; 3] {
    Class::ALL.map(|c| class_slo.get(&c).copied().unwrap_or(slo).targets())
}

/// The controller for `config`, with the pools of a disaggregated fleet.
fn build(config: &ControllerConfig, pools: Option<PdConfig>, leading: bool) -> Controller {
    let mut controller = Controller::new(config);
    if let Some(p) = pools {
        controller = controller.with_pools(p);
    }
    controller.set_autoscaling(leading);
    controller
}
