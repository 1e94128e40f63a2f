//! The simulated fleet: real engine instances whose iterations take the time the cost model
//! predicts, advanced by an event queue in virtual time.
//!
//! KV events, when the controller wants them, reach it `event_delay` after the iteration
//! that caused them (the time a real event bus takes); every other event is immediate.
//! Requests an instance evicts (KV high-water protection) wait in the fleet, counted in
//! flight, until the driver takes them to place them again.

use crate::cost::CostModelExecutor;
use crate::queue::EventQueue;
use engine::kv::{KvEvent, SharedStore};
use engine::{Dur, Evicted, Finished, Instance, InstanceConfig, InstanceId, Request, Time};
use policies::{Command, DispatchError, Fleet, FleetEvent, Route};
use std::collections::VecDeque;

/// Something that happens to one instance at a point in virtual time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wake {
    /// Start an iteration (scheduled at the time of an arrival, after all arrivals at that time
    /// are queued, so that they share the iteration).
    Start,
    /// The running iteration ends.
    StepDone,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Serving,
    Draining,
    Down,
}

struct SimInstance {
    engine: Instance,
    state: State,
    /// An iteration is running or about to start.
    busy: bool,
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
    executor: CostModelExecutor,
    queue: EventQueue<(InstanceId, Wake)>,
    events: Vec<FleetEvent>,
    finished: Vec<Finished>,
    /// Requests evicted and not yet taken by the driver, with the instance they left.
    evicted: Vec<(InstanceId, Request)>,
    evicted_scratch: Vec<Evicted>,
    kv: KvOptions,
    /// KV events on their way to the controller, in order of delivery time.
    kv_in_flight: VecDeque<(Time, InstanceId, KvEvent)>,
    kv_scratch: Vec<KvEvent>,
}

impl SimFleet {
    /// A fleet of `count` identical instances, all serving from time zero.
    pub fn new(count: u32, config: &InstanceConfig, executor: CostModelExecutor, kv: KvOptions) -> SimFleet {
        let mut fleet = SimFleet {
            instances: Vec::with_capacity(count as usize),
            executor,
            queue: EventQueue::default(),
            events: Vec::new(),
            finished: Vec::new(),
            evicted: Vec::new(),
            evicted_scratch: Vec::new(),
            kv,
            kv_in_flight: VecDeque::new(),
            kv_scratch: Vec::new(),
        };
        let l3 = kv.l3_blocks.map(SharedStore::new);
        for i in 0..count {
            let mut engine = Instance::with_shared_store(config.clone(), l3.clone());
            if kv.publish_events {
                engine.record_kv_events();
            }
            let capacity_tokens = engine.capacity_tokens();
            fleet.instances.push(SimInstance { engine, state: State::Serving, busy: false });
            fleet.events.push(FleetEvent::InstanceUp { instance: InstanceId(i), capacity_tokens });
        }
        fleet
    }

    /// Time of the next thing the fleet will do on its own.
    pub fn next_time(&self) -> Option<Time> {
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
                let mut events = Vec::new();
                while self.kv_in_flight.front().is_some_and(|&(d, _, _)| d == t) {
                    let (_, id, e) = self.kv_in_flight.pop_front().expect("a front element");
                    events.push((id, e));
                }
                self.events.push(FleetEvent::Kv { events });
                return t;
            }
        }
        let (now, (id, wake)) = self.queue.pop().expect("step called on an idle fleet");
        let inst = &mut self.instances[id.0 as usize];
        if wake == Wake::StepDone {
            let before = self.finished.len();
            inst.engine.end_step(now, &mut self.finished, &mut self.evicted_scratch);
            for f in &self.finished[before..] {
                self.events.push(FleetEvent::RequestFinished { instance: id, request: f.request.id });
            }
            for e in self.evicted_scratch.drain(..) {
                self.events.push(FleetEvent::RequestEvicted { instance: id, request: e.request.id, reason: e.reason });
                self.evicted.push((id, e.request));
            }
            self.events.push(FleetEvent::Load { instance: id, load: inst.engine.load() });
        }
        self.start_step(now, id);
        self.publish_kv(now, id);
        now
    }

    /// Sends the KV events instance `id` recorded on their way.
    fn publish_kv(&mut self, now: Time, id: InstanceId) {
        if !self.kv.publish_events {
            return;
        }
        self.instances[id.0 as usize].engine.drain_kv_events(&mut self.kv_scratch);
        if self.kv_scratch.is_empty() {
            return;
        }
        let at = now + self.kv.event_delay;
        if at == now {
            let events = self.kv_scratch.drain(..).map(|e| (id, e)).collect();
            self.events.push(FleetEvent::Kv { events });
        } else {
            self.kv_in_flight.extend(self.kv_scratch.drain(..).map(|e| (at, id, e)));
        }
    }

    fn start_step(&mut self, now: Time, id: InstanceId) {
        let inst = &mut self.instances[id.0 as usize];
        // The cost model never fails; an error here is a bug in it, not an input problem.
        match inst.engine.begin_step(now, &mut self.executor).expect("cost model executor failed") {
            Some(d) => self.queue.push(now + d, (id, Wake::StepDone)),
            None => {
                inst.busy = false;
                if inst.state == State::Draining {
                    inst.state = State::Down;
                    self.events.push(FleetEvent::InstanceDown { instance: id });
                }
            }
        }
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

    /// Time admission was paused up to `now`, summed over instances.
    pub fn admission_paused(&self, now: Time) -> Dur {
        self.instances.iter().fold(Dur::ZERO, |sum, i| sum + i.engine.paused_clock(now))
    }
}

impl Fleet for SimFleet {
    fn dispatch(&mut self, now: Time, request: Request, route: &Route) -> Result<(), (DispatchError, Request)> {
        let id = route.prefill;
        let Some(inst) = self.instances.get_mut(id.0 as usize).filter(|i| i.state == State::Serving) else {
            return Err((DispatchError::NotServing { instance: id }, request));
        };
        inst.engine
            .enqueue(now, request)
            .map_err(|(reason, r)| (DispatchError::Refused { instance: id, reason }, r))?;
        if !inst.busy {
            inst.busy = true;
            self.queue.push(now, (id, Wake::Start));
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
                    self.queue.push(now, (instance, Wake::Start));
                }
            }
        }
    }

    fn poll_events(&mut self, out: &mut Vec<FleetEvent>) {
        out.append(&mut self.events);
    }
}
