//! Disaggregated (P/D) and autoscaled fleets in the simulator: a run's pool settings, the
//! controller configuration they resolve to (with the cost model's decode and transfer
//! rates), and what a run reports about its pools.

use crate::fleet::PoolOptions;
use crate::slo::Slo;
use crate::timeline::TimelinePoint;
use cost::CostModel;
use engine::Dur;
use policies::{AutoscalerConfig, PdConfig, Role, ScalingEvent, SloLoadConfig, TransferHints};
use serde::{Deserialize, Serialize};

/// Window over which the controller measures the requests entering the fleet (see
/// [`policies::SloLoadConfig::inflow_window`]).
pub const INFLOW_WINDOW: Dur = Dur(5_000_000);

/// The checks of a P/D run's settings, shared by scenarios (`[pools]`) and `serve`'s flags:
/// each says what is wrong with a value, and the caller names the setting in its own words.
pub mod check {
    use engine::Dur;

    /// A time of at least zero.
    pub fn seconds(v: f64) -> Result<Dur, String> {
        if v.is_finite() && v >= 0.0 {
            Ok(Dur::from_secs_f64(v))
        } else {
            Err(format!("{v} is not a number of seconds >= 0"))
        }
    }

    /// A time above zero (at the simulator's 1 µs resolution).
    pub fn positive_seconds(v: f64) -> Result<Dur, String> {
        match seconds(v) {
            Ok(d) if d > Dur::ZERO => Ok(d),
            _ => Err(format!("{v} is not a positive number of seconds")),
        }
    }

    /// A link's bandwidth in GB/s, as bytes per second.
    pub fn bandwidth_gb_s(v: f64) -> Result<f64, String> {
        if v.is_finite() && v > 0.0 {
            Ok(v * 1e9)
        } else {
            Err(format!("{v} is not a positive bandwidth"))
        }
    }

    /// A GPU budget that holds `instances` instances of `gpus_per_instance` GPUs (`what` they are).
    pub fn gpu_budget(budget: u32, instances: u32, gpus_per_instance: u32, what: &str) -> Result<(), String> {
        if budget >= instances * gpus_per_instance {
            Ok(())
        } else {
            Err(format!("{budget} GPUs cannot hold the {instances} {what} of {gpus_per_instance} GPUs"))
        }
    }
}

/// A disaggregated run's pools, as resolved from a scenario.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PdRun {
    pub prefill: u32,
    pub decode: u32,
    pub autoscaler: AutoscalerConfig,
    pub startup: Dur,
    /// GPUs the fleet may hold at once.
    pub gpu_budget: u32,
    pub min_per_pool: u32,
    /// Period of scaling decisions.
    pub tick: Dur,
    /// Sliding window of the SLO load.
    pub slo_window: Dur,
    /// Link between a prefill and a decode instance.
    pub transfer_bytes_per_s: f64,
    pub transfer_latency: Dur,
}

impl PdRun {
    /// The fleet's side: pool sizes, start-up time, transfer cost.
    pub fn pool_options(&self, cost: &CostModel) -> PoolOptions {
        PoolOptions { prefill: self.prefill, decode: self.decode, startup: self.startup, transfer: self.transfer(cost) }
    }

    fn transfer(&self, cost: &CostModel) -> TransferHints {
        TransferHints {
            bytes_per_token: (cost.kv_bytes_per_token_per_gpu() * u64::from(cost.gpus())) as f64,
            bytes_per_s: self.transfer_bytes_per_s,
            latency: self.transfer_latency,
        }
    }

    /// The controller's side.
    pub fn pd_config(&self, cost: &CostModel, slo: Slo, block_size: u32, prefill_tokens_per_s: f64) -> PdConfig {
        PdConfig {
            slo: SloLoadConfig {
                ttft_target_ms: slo.ttft_ms,
                tpot_target_ms: slo.tpot_ms,
                window: self.slo_window,
                quantile: 0.99,
                decode: cost::decode_model(cost),
                nominal_prefill_tokens_per_s: prefill_tokens_per_s,
                inflow_window: INFLOW_WINDOW,
            },
            autoscaler: self.autoscaler,
            gpu_budget: self.gpu_budget,
            gpus_per_instance: cost.gpus(),
            min_per_pool: self.min_per_pool,
            tick: self.tick,
            transfer: self.transfer(cost),
            block_size,
        }
    }
}

/// What a run with pools reports, inside its summary.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolsReport {
    /// `colocated` or `pd`.
    pub mode: String,
    pub autoscaler: String,
    pub startup_s: f64,
    pub gpu_budget: u32,
    /// Scaling decisions taken, and each with the loads that caused it.
    pub scaling_events: u64,
    pub scaling: Vec<ScalingEvent>,
    /// KV transfers completed from a prefill to a decode instance (one per request with more
    /// than one output token).
    pub transfers: u64,
    /// Per shift of the workload (its start, in seconds), the time until the SLO was met
    /// again, by arrival (see [`crate::timeline::restore_times_s`]), and as earlier measured,
    /// by finish in the time series' windows ([`crate::timeline::restore_times_by_finish_s`]).
    pub shifts_s: Vec<f64>,
    pub restore_s: Vec<f64>,
    pub restore_by_finish_s: Vec<f64>,
    /// Per phase of the workload (before the first shift, then after each), how often each
    /// pool's scaling turned around: `[prefill, decode]` (see [`direction_changes`]).
    pub direction_changes: Vec<[u32; 2]>,
    pub timeline: Vec<TimelinePoint>,
}

/// Per phase (split at `shifts_s`), the times each pool's scaling reversed direction (grew
/// after shrinking, or shrank after growing) within the phase: `[prefill, decode]`. A pool
/// that only grows, or only shrinks, in a phase has 0.
pub fn direction_changes(events: &[ScalingEvent], shifts_s: &[f64]) -> Vec<[u32; 2]> {
    let phase_of = |t: f64| shifts_s.iter().filter(|&&s| t >= s).count();
    let mut out = vec![[0u32; 2]; shifts_s.len() + 1];
    for (k, pool) in [Role::Prefill, Role::Decode].into_iter().enumerate() {
        let mut last: Option<(usize, bool)> = None;
        for e in events.iter().filter(|e| e.pool == pool && e.to != e.from) {
            let (phase, up) = (phase_of(e.at_s), e.to > e.from);
            if let Some((p, was_up)) = last {
                if p == phase && was_up != up {
                    out[phase][k] += 1;
                }
            }
            last = Some((phase, up));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(at_s: f64, pool: Role, from: u32, to: u32) -> ScalingEvent {
        ScalingEvent {
            at_s,
            pool,
            from,
            to,
            autoscaler: "slo-load".into(),
            reason: String::new(),
            loads: Default::default(),
        }
    }

    #[test]
    fn direction_changes_count_reversals_within_each_phase_only() {
        let events = [
            event(5.0, Role::Prefill, 2, 4),
            event(8.0, Role::Prefill, 4, 3),
            event(9.0, Role::Prefill, 3, 5),
            event(12.0, Role::Prefill, 5, 4),
            event(15.0, Role::Decode, 2, 1),
            event(25.0, Role::Decode, 1, 3),
        ];
        assert_eq!(direction_changes(&events, &[10.0, 20.0]), vec![[2, 0], [0, 0], [0, 0]]);
    }
}

/// Disaggregated runs end to end: every request finishes, each multi-token one is moved
/// once, scaling down loses nothing, and the same seed gives the same JSON.
#[cfg(test)]
mod run_tests {
    use crate::metrics::Summary;
    use crate::scenario::{FleetSection, PoolsSection, Scenario, SloSection, WorkloadSection};
    use crate::sim;
    use crate::workload::{ArrivalProcess, LengthDist, RateStep, SyntheticConfig};

    fn scenario(autoscaler: &str, rate_schedule: Vec<RateStep>, requests: u64) -> Scenario {
        let synthetic = SyntheticConfig {
            requests,
            arrival: ArrivalProcess::Poisson { rate_rps: 40.0 },
            rate_schedule,
            input: LengthDist::Lognormal { median: 1024.0, sigma: 0.8, min: 1, max: 8192 },
            output: LengthDist::Lognormal { median: 128.0, sigma: 0.8, min: 1, max: 1024 },
            prefix: None,
            long: None,
            long_output: None,
        };
        Scenario {
            fleet: FleetSection { instances: Some(8), ..FleetSection::default() },
            workload: WorkloadSection { synthetic: Some(synthetic), ..WorkloadSection::default() },
            slo: SloSection { ttft_ms: Some(1000.0), tpot_ms: Some(25.0) },
            pools: PoolsSection {
                mode: Some("pd".into()),
                prefill_instances: Some(2),
                decode_instances: Some(2),
                autoscaler: Some(autoscaler.into()),
                startup_s: Some(5.0),
                ..PoolsSection::default()
            },
            ..Scenario::default()
        }
    }

    fn run(s: &Scenario) -> Summary {
        let settings = s.resolve().expect("valid scenario");
        let spec = &settings.routers[0];
        let workload = settings.open_workload(settings.rate_scale).expect("workload opens");
        let config = sim::SimConfig { infinite_cache_bound: false, ..settings.sim_config(spec) };
        sim::run(&config, workload, &mut |_| {}).expect("run completes").summary
    }

    #[test]
    fn a_pd_run_moves_each_multi_token_request_once_and_finishes_all() {
        let s = run(&scenario("none", Vec::new(), 1500));
        let pools = s.pools.as_ref().expect("a pd run reports its pools");
        assert_eq!((s.requests, s.rejected), (1500, 0));
        assert_eq!(pools.mode, "pd");
        assert!(pools.transfers > 1000 && pools.transfers <= 1500, "{} transfers", pools.transfers);
        assert_eq!(pools.scaling_events, 0);
        assert!(s.slo_attainment > 0.9, "attainment {}", s.slo_attainment);
    }

    #[test]
    fn scaling_down_a_pool_loses_no_request() {
        // A busy minute, then a trickle: slo-load grows the pools, then drains instances
        // while they hold requests; every request still finishes.
        let steps = vec![RateStep { at_s: 0.0, scale: 3.0 }, RateStep { at_s: 60.0, scale: 0.1 }];
        let s = run(&scenario("slo-load", steps, 9000));
        let pools = s.pools.as_ref().expect("pools");
        assert_eq!((s.requests, s.rejected), (9000, 0));
        assert!(pools.scaling.iter().any(|e| e.to > e.from), "it grew");
        assert!(pools.scaling.iter().any(|e| e.to < e.from), "it drained");
    }

    #[test]
    fn requests_evicted_from_a_decode_instance_are_placed_again_through_the_prefill_pool() {
        let mut s = scenario("none", Vec::new(), 800);
        s.scheduler = crate::scenario::SchedulerSection {
            kv_high_water: Some(0.02),
            runaway_output_tokens: Some(16),
            max_evictions: Some(2),
            ..Default::default()
        };
        let summary = run(&s);
        assert_eq!((summary.requests, summary.rejected), (800, 0));
        assert!(summary.evictions > 0 && summary.reroutes == summary.evictions, "{summary:?}");
    }

    #[test]
    fn the_same_seed_gives_byte_identical_json() {
        let s = scenario("slo-load", vec![RateStep { at_s: 0.0, scale: 2.0 }], 3000);
        let a = serde_json::to_string(&run(&s)).expect("serializes");
        let b = serde_json::to_string(&run(&s)).expect("serializes");
        assert_eq!(a, b);
    }
}
