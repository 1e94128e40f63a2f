//! The simulation driver: arrivals from a workload, routing by the real controller, a
//! simulated fleet, metrics.
//!
//! One loop, always the same short sequence: take the earliest of (next arrival, next fleet
//! event, controller deadline); deliver it; hand the fleet's news to the controller and its
//! finished requests to the metrics. Arrivals win ties with fleet events, so requests that
//! arrive at the same microsecond share an iteration, as they would in a real engine.

use crate::cost::{CostModel, CostModelExecutor};
use crate::fleet::SimFleet;
use crate::metrics::{FleetCost, Metrics, Slo, Summary};
use crate::workload::{Workload, WorkloadError};
use engine::{BlockHash, Finished, InstanceConfig, Request, RequestId, Time};
use policies::{Controller, ControllerConfig, Fleet, FleetEvent, RouterConfig};

/// Everything one run needs besides its workload.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    pub router: RouterConfig,
    pub instances: u32,
    pub instance: InstanceConfig,
    pub cost: CostModel,
    pub slo: Slo,
}

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
    mut workload: Box<dyn Workload>,
    progress: &mut dyn FnMut(Progress),
) -> Result<RunOutput, SimError> {
    let mut controller = Controller::new(&ControllerConfig { router: config.router, seed: config.seed, hints: policies::CostHints::default() });
    let executor = CostModelExecutor::new(config.cost.clone());
    let mut fleet = SimFleet::new(config.instances, &config.instance, executor);
    let mut metrics = Metrics::new(config.slo);
    let mut events: Vec<FleetEvent> = Vec::new();
    let mut finished: Vec<Finished> = Vec::new();
    let mut commands = Vec::new();
    // Hash buffers of finished requests, handed back to the workload to fill.
    let mut spare: Vec<Vec<BlockHash>> = Vec::new();
    let mut first_rejection = None;
    let mut arrivals = 0u64;
    let mut now = Time::ZERO;

    fleet.poll_events(&mut events);
    for e in events.drain(..) {
        controller.on_event(now, &e);
    }
    let mut next = workload.next_arrival(Vec::new())?;
    loop {
        let t_arrival = next.as_ref().map(|a| a.at);
        let t_fleet = fleet.next_time();
        let t_tick = controller.next_deadline();
        let earliest = [t_arrival, t_fleet].into_iter().flatten().min();
        if let Some(t) = t_tick.filter(|&t| earliest.is_none_or(|e| t <= e)) {
            now = now.max(t);
            controller.tick(now, &mut commands);
            for c in commands.drain(..) {
                fleet.apply(now, &c);
            }
        } else if t_arrival.is_some_and(|a| t_fleet.is_none_or(|f| a <= f)) {
            let a = next.take().expect("an arrival is due");
            now = a.at;
            let request = Request {
                id: RequestId(arrivals),
                arrival: a.at,
                prompt_tokens: a.prompt_tokens,
                max_output_tokens: a.output_tokens,
                block_hashes: a.block_hashes,
            };
            arrivals += 1;
            let refused = match controller.route(now, &request) {
                Ok(route) => fleet.dispatch(now, request, &route).err().map(|(e, r)| (e.to_string(), r)),
                Err(e) => Some((e.to_string(), request)),
            };
            if let Some((reason, request)) = refused {
                metrics.record_rejected();
                first_rejection.get_or_insert_with(|| format!("{}: {reason}", request.id));
                spare.push(request.block_hashes);
            }
            if arrivals.is_multiple_of(PROGRESS_EVERY) {
                progress(Progress { arrivals, now });
            }
            let mut buf = spare.pop().unwrap_or_default();
            buf.clear();
            next = workload.next_arrival(buf)?;
        } else if t_fleet.is_some() {
            now = fleet.step();
        } else {
            break;
        }
        fleet.poll_events(&mut events);
        for e in events.drain(..) {
            controller.on_event(now, &e);
        }
        fleet.take_finished(&mut finished);
        for f in finished.drain(..) {
            metrics.record(&f);
            spare.push(f.request.block_hashes);
        }
    }
    assert_eq!(fleet.in_flight(), 0, "the fleet went idle with requests in flight");
    progress(Progress { arrivals, now });
    let gpus = config.instances * config.cost.gpus();
    let cost = FleetCost { gpus, price_per_gpu_hour: config.cost.price_per_hour() / f64::from(config.cost.gpus()) };
    Ok(RunOutput {
        router: config.router.name().to_string(),
        summary: metrics.summary(&cost),
        ttft_cdf: metrics.ttft_cdf(),
        tpot_cdf: metrics.tpot_cdf(),
        first_rejection,
    })
}
