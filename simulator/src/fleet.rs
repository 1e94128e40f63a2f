//! The simulated fleet: real engine instances whose iterations take the time the cost model
//! predicts, advanced by an event queue in virtual time.

use crate::cost::CostModelExecutor;
use crate::queue::EventQueue;
use engine::{Finished, Instance, InstanceConfig, InstanceId, Request, Time};
use policies::{Command, DispatchError, Fleet, FleetEvent, Route};

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

pub struct SimFleet {
    instances: Vec<SimInstance>,
    executor: CostModelExecutor,
    queue: EventQueue<(InstanceId, Wake)>,
    events: Vec<FleetEvent>,
    finished: Vec<Finished>,
}

impl SimFleet {
    /// A fleet of `count` identical instances, all serving from time zero.
    pub fn new(count: u32, config: &InstanceConfig, executor: CostModelExecutor) -> SimFleet {
        let mut fleet = SimFleet {
            instances: Vec::with_capacity(count as usize),
            executor,
            queue: EventQueue::default(),
            events: Vec::new(),
            finished: Vec::new(),
        };
        for i in 0..count {
            let engine = Instance::new(config.clone());
            let capacity_tokens = engine.capacity_tokens();
            fleet.instances.push(SimInstance { engine, state: State::Serving, busy: false });
            fleet.events.push(FleetEvent::InstanceUp { instance: InstanceId(i), capacity_tokens });
        }
        fleet
    }

    /// Time of the next thing the fleet will do on its own.
    pub fn next_time(&self) -> Option<Time> {
        self.queue.peek_time()
    }

    /// Advances to the next fleet event; the caller checked that one is due at `next_time`.
    pub fn step(&mut self) -> Time {
        let (now, (id, wake)) = self.queue.pop().expect("step called on an idle fleet");
        let inst = &mut self.instances[id.0 as usize];
        if wake == Wake::StepDone {
            let before = self.finished.len();
            inst.engine.end_step(now, &mut self.finished);
            for f in &self.finished[before..] {
                self.events.push(FleetEvent::RequestFinished { instance: id, request: f.request.id });
            }
            self.events.push(FleetEvent::Load { instance: id, load: inst.engine.load() });
        }
        self.start_step(now, id);
        now
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

    /// Requests queued or running anywhere.
    pub fn in_flight(&self) -> usize {
        self.instances.iter().map(|i| i.engine.in_flight()).sum()
    }
}

impl Fleet for SimFleet {
    fn dispatch(&mut self, now: Time, request: Request, route: &Route) -> Result<(), (DispatchError, Request)> {
        let id = route.prefill;
        let Some(inst) = self.instances.get_mut(id.0 as usize).filter(|i| i.state == State::Serving) else {
            return Err((DispatchError::NotServing { instance: id }, request));
        };
        inst.engine.enqueue(request).map_err(|(reason, r)| (DispatchError::Refused { instance: id, reason }, r))?;
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
