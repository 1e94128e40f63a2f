//! The sans-IO controller: the one place where fleet decisions are made.
//!
//! # Contract
//!
//! A driver (the simulator's event loop or the live service) owns the controller and a
//! [`Fleet`](crate::Fleet), and with `now` never moving backwards:
//!
//! - feeds every [`FleetEvent`] it polls from the fleet to [`Controller::on_event`];
//! - hands each arriving request to [`Controller::place`], which routes it, dispatches it
//!   to the fleet and, if the fleet does not take it, undoes the routing and gives it back;
//! - hands each request an instance evicted (after feeding the events of the step that
//!   evicted it) to `place` again, with the instance it left: none is dropped;
//! - calls [`Controller::tick`] at [`Controller::next_deadline`] and applies the commands.
//!
//! The controller reads no clock, socket or thread-local random source; its routers draw from
//! ChaCha generators seeded from the run's seed. The same inputs give the same decisions.

use crate::event::FleetEvent;
use crate::fleet::{Command, Fleet, Reject, Route, Unplaced};
use crate::flow::{Flow, Offer, Shed, Targets};
use crate::pd::{Pd, PdConfig, PdStatus, ScalingEvent};
use crate::router::{CostHints, Router, RouterConfig};
use crate::view::{FleetView, InstanceState, Role};
use engine::{InstanceId, Request, RequestId, Time};

/// What became of a request offered to or released by flow control.
#[derive(Debug)]
pub enum Released<P> {
    /// Placed on the fleet.
    Placed {
        id: RequestId,
        prompt_tokens: u32,
        route: Route,
    },
    /// Waiting for room.
    Queued,
    /// No instance takes it, or the fleet refused it.
    Unplaced(Unplaced<P>),
    Shed(Shed<P>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ControllerConfig {
    pub router: RouterConfig,
    /// The run's seed; every random choice derives from it.
    pub seed: u64,
    pub hints: CostHints,
}

pub struct Controller {
    router: Box<dyn Router>,
    fleet: FleetView,
    /// Pairing, SLO load and pool sizing of a disaggregated fleet (see [`crate::pd`]);
    /// `None` for a colocated one.
    pd: Option<Pd>,
    unmatched_ends: u64,
}

impl Controller {
    pub fn new(config: &ControllerConfig) -> Controller {
        Controller {
            router: config.router.build(config.seed, &config.hints),
            fleet: FleetView::default(),
            pd: None,
            unmatched_ends: 0,
        }
    }

    /// The controller of a disaggregated fleet: requests go to the prefill pool, each is
    /// paired with a decode instance when its prefill ends, and the pools are sized by
    /// `pools.autoscaler` (see [`crate::pd`]).
    pub fn with_pools(mut self, pools: PdConfig) -> Controller {
        self.pd = Some(Pd::new(pools));
        self
    }

    /// The controller of a fleet whose L2 and L3 keep offload chunks of `blocks` blocks: its
    /// prefix index reads their KV events as chunks (see
    /// [`crate::prefix_index::PrefixIndex::with_chunk_blocks`]); 1 changes nothing.
    pub fn with_offload_chunks(mut self, blocks: u32) -> Controller {
        *self.fleet.index_mut() = crate::prefix_index::PrefixIndex::with_chunk_blocks(blocks);
        self
    }

    /// Puts a new router in force (an operator changed the policy). What the controller
    /// knows of the fleet stays: loads, requests in flight, the prefix index, the pools and
    /// their hand-offs; the new router's own memory starts empty.
    pub fn set_router(&mut self, config: &ControllerConfig) {
        self.router = config.router.build(config.seed, &config.hints);
    }

    /// Puts a new autoscaler in force for the pools of a disaggregated fleet, keeping their
    /// hand-offs, SLO windows and scaling log (a colocated fleet has none: no-op).
    pub fn set_autoscaler(&mut self, autoscaler: crate::autoscaler::AutoscalerConfig) {
        if let Some(pd) = &mut self.pd {
            pd.set_autoscaler(autoscaler);
        }
    }

    /// Whether the fleet should report each finished request's latencies
    /// ([`FleetEvent::RequestLatency`]): the SLO load needs them.
    pub fn wants_latencies(&self) -> bool {
        self.pd.is_some()
    }

    /// Whether [`Controller::tick`] sizes the pools (default: yes). Off, it still pairs
    /// hand-offs and computes the loads: a live replica that does not lead runs this way.
    pub fn set_autoscaling(&mut self, on: bool) {
        if let Some(pd) = &mut self.pd {
            pd.set_autoscaling(on);
        }
    }

    /// New SLO targets for the loads of a disaggregated fleet (an operator changed them).
    pub fn set_slo_targets(&mut self, ttft_ms: f64, tpot_ms: f64) {
        if let Some(pd) = &mut self.pd {
            pd.set_slo_targets(ttft_ms, tpot_ms);
        }
    }

    /// Each class's latency targets (by [`engine::Class::index`]), which routers may place by
    /// (see [`FleetView::ttft_left_s`]); a fleet without them has none.
    pub fn set_targets(&mut self, targets: [Targets; 3]) {
        self.fleet.targets = Some(targets);
    }

    /// The pools and their SLO loads as of the last tick (disaggregated fleets only).
    pub fn pools(&self) -> Option<PdStatus> {
        self.pd.as_ref().map(Pd::status)
    }

    /// Every scaling decision so far, with the loads that caused it.
    pub fn scaling_events(&self) -> &[ScalingEvent] {
        self.pd.as_ref().map_or(&[], Pd::scaling_events)
    }

    /// Whether the fleet should publish KV events (the router reads the prefix index).
    pub fn wants_kv_events(&self) -> bool {
        self.router.wants_kv_events()
    }

    pub fn router_name(&self) -> &'static str {
        self.router.name()
    }

    pub fn fleet(&self) -> &FleetView {
        &self.fleet
    }

    /// Whether a load report must reach the controller when it is made: while prefills wait
    /// for a decode instance, a decode instance's report schedules their retry at its time.
    /// Otherwise a report only replaces the instance's last one (and resets what was routed
    /// since), which nothing reads before the next decision, so a driver may hold reports
    /// back and deliver each instance's latest just before it routes, ticks or samples.
    pub fn wants_loads_at_once(&self) -> bool {
        self.pd.as_ref().is_some_and(Pd::has_waiting)
    }

    pub fn on_event(&mut self, now: Time, event: &FleetEvent) {
        match *event {
            FleetEvent::InstanceUp { instance, capacity_tokens } => self.fleet.up(instance, capacity_tokens),
            FleetEvent::InstanceDraining { instance } => self.set_state(instance, InstanceState::Draining),
            FleetEvent::InstanceDown { instance } => {
                self.set_state(instance, InstanceState::Down);
                self.fleet.index_mut().remove_instance(instance);
            }
            FleetEvent::Load { instance, load } => {
                if let Some(v) = self.fleet.get_mut(instance) {
                    v.load = load;
                    v.routed_since_report = 0;
                    v.prompt_since_report = 0;
                    let role = v.role;
                    if let Some(pd) = &mut self.pd {
                        pd.on_load(now, instance, role);
                    }
                }
            }
            FleetEvent::RequestFinished { instance, output, .. } => {
                if let Some(end) = output {
                    self.fleet.outputs.record(end);
                }
                self.request_left(instance);
            }
            FleetEvent::RequestEvicted { instance, .. } | FleetEvent::RequestLost { instance, .. } => {
                self.request_left(instance);
            }
            FleetEvent::Kv { instance, ref events } => self.fleet.index_mut().apply_batch(instance, events),
            FleetEvent::InstanceModel { instance, model } => self.fleet.set_model(instance, model),
            FleetEvent::InstanceRole { instance, role } => {
                let new = self.fleet.set_role(instance, role);
                if let Some(pd) = &mut self.pd {
                    pd.on_role(role, new);
                }
            }
            FleetEvent::PrefillDone { instance, request, kv_tokens, output_tokens, ttft } => {
                if let Some(pd) = &mut self.pd {
                    pd.on_prefill_done(now, instance, request, kv_tokens, output_tokens, ttft);
                }
            }
            FleetEvent::TransferDone { request, from, .. } => {
                if let Some(pd) = &mut self.pd {
                    pd.on_transfer_done(request);
                }
                self.request_left(from);
            }
            FleetEvent::TransferRefused { request, to, .. } => {
                if let Some(pd) = &mut self.pd {
                    pd.on_transfer_refused(now, request);
                }
                self.request_left(to);
            }
            FleetEvent::StartFailed { role } => {
                if let Some(pd) = &mut self.pd {
                    pd.on_start_failed(role);
                }
            }
            FleetEvent::RequestLatency { tpot, .. } => {
                if let Some(pd) = &mut self.pd {
                    pd.on_latency(now, tpot);
                }
            }
        }
        self.router.on_event(event);
    }

    /// A request routed to `instance` left it. One that was never counted there is a broken
    /// fleet contract: counted in [`Controller::unmatched_ends`] rather than hidden.
    fn request_left(&mut self, instance: InstanceId) {
        match self.fleet.get_mut(instance).filter(|v| v.in_flight > 0) {
            Some(v) => v.in_flight -= 1,
            None => self.unmatched_ends += 1,
        }
    }

    /// How many times a fleet reported a request leaving an instance that held none as far
    /// as the controller knew (zero while the fleet keeps the [`Fleet`] contract; the
    /// simulator's tests check it after every event).
    pub fn unmatched_ends(&self) -> u64 {
        self.unmatched_ends
    }

    fn set_state(&mut self, instance: InstanceId, state: InstanceState) {
        if let Some(v) = self.fleet.get_mut(instance) {
            v.state = state;
        }
    }

    /// Chooses the instances for `request` and accounts for it as routed.
    pub fn route(&mut self, now: Time, request: &Request) -> Result<Route, Reject> {
        self.fleet.now = now;
        let Some(pick) = self.router.pick(request, &self.fleet) else {
            // Of the request's model: another model's engines are no place for it.
            let largest_tokens =
                self.fleet.serving().filter(|i| i.model == request.model).map(|i| i.capacity_tokens).max();
            return Err(match largest_tokens {
                None => Reject::NoInstance,
                Some(largest_tokens) => Reject::TooLarge { needed_tokens: request.peak_kv_tokens(), largest_tokens },
            });
        };
        let v = self.fleet.get_mut(pick.instance).expect("router picked an unknown instance");
        debug_assert!(v.is_serving() && request.peak_kv_tokens() <= v.capacity_tokens);
        if let (Role::Prefill, Some(pd)) = (v.role, &mut self.pd) {
            pd.on_routed(now, request.prompt_tokens);
        }
        v.routed_since_report += routed_tokens(request, v.role);
        v.prompt_since_report += u64::from(request.prompt_tokens);
        v.in_flight += 1;
        Ok(Route { prefill: pick.instance, decode: pick.instance, why: pick.why })
    }

    /// Routes `request` (away from `evicted_from`, the instance that evicted it, when another
    /// admits: see [`Controller::reroute`]) and dispatches it to `fleet`. If the fleet does not
    /// take it, the routing is undone ([`Controller::unroute`]) and the request comes back
    /// with its payload and why. The one path from a decision to a fleet, for both drivers.
    pub fn place<F: Fleet + ?Sized>(
        &mut self,
        fleet: &mut F,
        now: Time,
        request: Request,
        payload: F::Payload,
        evicted_from: Option<InstanceId>,
    ) -> Result<Route, Unplaced<F::Payload>> {
        let routed = match evicted_from {
            Some(from) => self.reroute(now, &request, from),
            None => self.route(now, &request),
        };
        let route = match routed {
            Ok(route) => route,
            Err(e) => return Err(Unplaced { error: e.into(), request, payload }),
        };
        match fleet.dispatch(now, request, payload, &route) {
            Ok(()) => Ok(route),
            Err((e, request, payload)) => {
                self.unroute(&request, &route);
                Err(Unplaced { error: e.into(), request, payload })
            }
        }
    }

    /// Offers an arriving request to flow control ([`Flow`]): placed now (as
    /// [`Controller::place`]) when it may go, else queued or shed.
    pub fn offer<F: Fleet + ?Sized>(
        &mut self,
        flow: &mut Flow<F::Payload>,
        fleet: &mut F,
        now: Time,
        request: Request,
        payload: F::Payload,
    ) -> Released<F::Payload> {
        match flow.offer(now, request, payload, &self.fleet) {
            Offer::Place(request, payload) => self.place_released(fleet, now, request, payload),
            Offer::Queued => Released::Queued,
            Offer::Shed(shed) => Released::Shed(shed),
        }
    }

    /// Places queued requests while the fleet has room for them, and sheds those whose time
    /// is up. A driver calls it after each step that may have made room (the fleet's news
    /// fed) and at [`Flow::next_deadline`].
    pub fn release<F: Fleet + ?Sized>(
        &mut self,
        flow: &mut Flow<F::Payload>,
        fleet: &mut F,
        now: Time,
        out: &mut Vec<Released<F::Payload>>,
    ) {
        let mut shed = Vec::new();
        flow.expire(now, &self.fleet, &mut shed);
        out.extend(shed.into_iter().map(Released::Shed));
        while let Some((request, payload)) = flow.next(now, &self.fleet) {
            out.push(self.place_released(fleet, now, request, payload));
        }
    }

    fn place_released<F: Fleet + ?Sized>(
        &mut self,
        fleet: &mut F,
        now: Time,
        request: Request,
        payload: F::Payload,
    ) -> Released<F::Payload> {
        let (id, prompt_tokens) = (request.id, request.prompt_tokens);
        match self.place(fleet, now, request, payload, None) {
            Ok(route) => Released::Placed { id, prompt_tokens, route },
            Err(unplaced) => Released::Unplaced(unplaced),
        }
    }

    /// Takes back the accounting of the [`Controller::route`] just made for `request` (no
    /// other call in between): its instance's in-flight count and routed tokens, the prefill
    /// pool's inflow, and whatever the router remembered of the pick.
    fn unroute(&mut self, request: &Request, route: &Route) {
        let v = self.fleet.get_mut(route.prefill).expect("unroute of a route to an unknown instance");
        let routed = routed_tokens(request, v.role);
        v.routed_since_report -= routed;
        v.prompt_since_report -= u64::from(request.prompt_tokens);
        v.in_flight -= 1;
        if let (Role::Prefill, Some(pd)) = (v.role, &mut self.pd) {
            pd.on_unrouted(request.prompt_tokens);
        }
        self.router.unpick(request, route.prefill);
    }

    /// Places again a request that `from` evicted (its `resume` says how far it got): as
    /// [`Controller::route`], with `from` the last choice among the instances that admit (see
    /// [`FleetView::candidates`]).
    pub fn reroute(&mut self, now: Time, request: &Request, from: InstanceId) -> Result<Route, Reject> {
        self.fleet.avoid = Some(from);
        let route = self.route(now, request);
        self.fleet.avoid = None;
        route
    }

    /// Periodic decisions: in a disaggregated fleet, sending the KV of finished prefills to
    /// decode instances and sizing the pools (see [`crate::pd`]). The routers need none.
    pub fn tick(&mut self, now: Time, out: &mut Vec<Command>) {
        if let Some(pd) = &mut self.pd {
            pd.tick(now, &mut self.fleet, out);
        }
    }

    /// When [`Controller::tick`] wants to be called next, if ever. A disaggregated fleet's
    /// controller always has a next scaling tick: a driver stops calling once it has no
    /// arrivals and no fleet events left.
    pub fn next_deadline(&self) -> Option<Time> {
        self.pd.as_ref().and_then(Pd::next_deadline)
    }
}

/// The tokens a request brings to an instance of `role`: its prompt and output, of which a
/// prefill instance generates only the first token (the rest is the decode pool's).
fn routed_tokens(request: &Request, role: Role) -> u64 {
    let output = if role == Role::Prefill { 1 } else { request.max_output_tokens };
    u64::from(request.prompt_tokens) + u64::from(output)
}
