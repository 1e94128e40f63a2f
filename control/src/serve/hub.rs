//! The control plane's one point of decision: the same [`Controller`] the simulator runs,
//! fed by the live fleet, behind a mutex that is never held across an await.

use super::live_fleet::{LiveFleet, MAX_ATTEMPTS};
use super::metrics::Metrics;
use super::news::{Delta, News, Payload};
use engine::{Request, RequestId, Time};
use policies::{
    Command, Controller, ControllerConfig, Fleet, FleetEvent, PdConfig, PlaceError, Route, ScalingEvent, Unplaced,
};
use std::sync::Arc;
use std::time::Instant;

pub struct Hub {
    /// The prompt prefixes recent requests share (the console's cache page).
    pub prefixes: super::prefixes::SharedPrefixes,
    pub controller: Controller,
    pub fleet: LiveFleet,
    pub config: ControllerConfig,
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
}

impl Hub {
    pub fn new(
        config: ControllerConfig,
        pools: Option<PdConfig>,
        mut fleet: LiveFleet,
        metrics: Arc<Metrics>,
        replica_nonce: u32,
    ) -> Hub {
        let controller = build(&config, pools, false);
        fleet.configure(controller.wants_latencies(), pools.map(|p| p.transfer));
        let clock = fleet.clock();
        Hub {
            prefixes: Default::default(),
            controller,
            fleet,
            config,
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

    /// Puts stored SLO targets in force for the pools' loads (a colocated fleet has none).
    pub fn set_slo(&mut self, ttft_ms: f64, tpot_ms: f64) {
        let Some(p) = &mut self.pools else { return };
        if (p.slo.ttft_target_ms, p.slo.tpot_target_ms) != (ttft_ms, tpot_ms) {
            (p.slo.ttft_target_ms, p.slo.tpot_target_ms) = (ttft_ms, tpot_ms);
            self.controller.set_slo_targets(ttft_ms, tpot_ms);
            tracing::info!(ttft_ms, tpot_ms, "SLO targets in force for the pools' loads");
        }
    }

    /// Scaling decisions taken since the last call, to be stored.
    pub fn new_scaling_events(&mut self) -> Vec<ScalingEvent> {
        let all = self.controller.scaling_events();
        let new = all.get(self.scaling_taken..).unwrap_or_default().to_vec();
        self.scaling_taken = all.len();
        new
    }

    /// Feeds the fleet's pending events to the controller.
    pub fn pump(&mut self) {
        self.fleet.poll_events(&mut self.scratch);
        let mut events = std::mem::take(&mut self.scratch);
        for e in events.drain(..) {
            self.feed(e);
        }
        self.scratch = events;
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

    /// Routes and dispatches a request whose tokens are in `payload`.
    /// On failure the payload comes back (boxed: it is large, and failures are rare).
    pub fn place(&mut self, request: Request, payload: Payload) -> Result<Route, (PlaceError, Box<Payload>)> {
        self.pump();
        let now = self.now();
        let started = Instant::now();
        let id = request.id;
        let placed = self.controller.place(&mut self.fleet, now, request, payload, None);
        self.metrics.route_seconds.observe(started.elapsed().as_secs_f64());
        match placed {
            Ok(route) => {
                tracing::debug!(request = %id, instance = %route.prefill, why = ?route.why, "routed");
                Ok(route)
            }
            Err(Unplaced { error, payload, .. }) => Err((error, Box::new(payload))),
        }
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

/// The controller for `config`, with the pools of a disaggregated fleet.
fn build(config: &ControllerConfig, pools: Option<PdConfig>, leading: bool) -> Controller {
    let mut controller = Controller::new(config);
    if let Some(p) = pools {
        controller = controller.with_pools(p);
    }
    controller.set_autoscaling(leading);
    controller
}
