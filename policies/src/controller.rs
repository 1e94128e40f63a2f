//! The sans-IO controller: the one place where fleet decisions are made.
//!
//! # Contract
//!
//! A driver (the simulator's event loop or the live service) owns the controller and a
//! [`Fleet`](crate::Fleet), and with `now` never moving backwards:
//!
//! - feeds every [`FleetEvent`] it polls from the fleet to [`Controller::on_event`];
//! - asks [`Controller::route`] where each arriving request goes, then dispatches it;
//! - asks [`Controller::reroute`] where each request an instance evicted goes next (after
//!   feeding the events of the step that evicted it), then dispatches it: none is dropped;
//! - calls [`Controller::tick`] at [`Controller::next_deadline`] and applies the commands.
//!
//! The controller reads no clock, socket or thread-local random source; its routers draw from
//! ChaCha generators seeded from the run's seed. The same inputs give the same decisions.

use crate::fleet::{Command, FleetEvent};
use crate::router::{CostHints, Router, RouterConfig, Why};
use crate::view::{FleetView, InstanceState};
use engine::{InstanceId, Request, Time};

#[derive(Clone, Debug, PartialEq)]
pub struct ControllerConfig {
    pub router: RouterConfig,
    /// The run's seed; every random choice derives from it.
    pub seed: u64,
    pub hints: CostHints,
}

/// Where a request goes and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// The instance that computes the prompt.
    pub prefill: InstanceId,
    /// The instance that generates the output (the same one in a colocated fleet).
    pub decode: InstanceId,
    pub why: Why,
}

/// Why a request could not be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    #[error("no instance is serving")]
    NoInstance,
    #[error("request needs {needed_tokens} tokens of KV, more than any serving instance holds ({largest_tokens})")]
    TooLarge { needed_tokens: u64, largest_tokens: u64 },
}

pub struct Controller {
    router: Box<dyn Router>,
    fleet: FleetView,
}

impl Controller {
    pub fn new(config: &ControllerConfig) -> Controller {
        Controller { router: config.router.build(config.seed, &config.hints), fleet: FleetView::default() }
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

    pub fn on_event(&mut self, _now: Time, event: &FleetEvent) {
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
                }
            }
            FleetEvent::RequestFinished { instance, .. } | FleetEvent::RequestEvicted { instance, .. } => {
                if let Some(v) = self.fleet.get_mut(instance) {
                    v.in_flight = v.in_flight.saturating_sub(1);
                }
            }
            FleetEvent::Kv { ref events } => self.fleet.index_mut().apply_batch(events),
        }
        self.router.on_event(event);
    }

    fn set_state(&mut self, instance: InstanceId, state: InstanceState) {
        if let Some(v) = self.fleet.get_mut(instance) {
            v.state = state;
        }
    }

    /// Chooses the instances for `request` and accounts for it as routed.
    pub fn route(&mut self, _now: Time, request: &Request) -> Result<Route, Reject> {
        let Some(pick) = self.router.pick(request, &self.fleet) else {
            let largest_tokens = self.fleet.serving().map(|i| i.capacity_tokens).max();
            return Err(match largest_tokens {
                None => Reject::NoInstance,
                Some(largest_tokens) => Reject::TooLarge { needed_tokens: request.peak_kv_tokens(), largest_tokens },
            });
        };
        let v = self.fleet.get_mut(pick.instance).expect("router picked an unknown instance");
        debug_assert!(v.is_serving() && request.peak_kv_tokens() <= v.capacity_tokens);
        v.routed_since_report += u64::from(request.prompt_tokens) + u64::from(request.max_output_tokens);
        v.in_flight += 1;
        Ok(Route { prefill: pick.instance, decode: pick.instance, why: pick.why })
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

    /// Periodic decisions. The routers of this version need none; scaling and protection
    /// policies add their commands here.
    pub fn tick(&mut self, _now: Time, _out: &mut Vec<Command>) {}

    /// When [`Controller::tick`] wants to be called next, if ever.
    pub fn next_deadline(&self) -> Option<Time> {
        None
    }
}
