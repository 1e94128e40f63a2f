//! Where a simulation's wall-clock time goes, by phase of the driver loop: for benchmarks
//! only. The driver calls [`Stopwatch::lap`] after each piece of work, naming its phase; the
//! plain run's stopwatch does nothing (and compiles to nothing), so timing never changes
//! what a run computes.

use std::time::Instant;

/// A piece of the driver loop's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Reading or generating arrivals.
    Workload,
    /// The router's choice for arriving and evicted requests.
    Routing,
    /// KV events applied to the global prefix index.
    Index,
    /// Other fleet events the controller hears, and its ticks.
    Controller,
    /// Engine steps: scheduling, the KV tiers and the cost model (the split inside an engine
    /// step is a profiler's job: docs/BENCHMARKS.md).
    Engine,
    /// Metrics of finished requests, the time series and the infinite-cache bound.
    Metrics,
}

impl Phase {
    pub const ALL: [Phase; 6] =
        [Phase::Workload, Phase::Routing, Phase::Index, Phase::Controller, Phase::Engine, Phase::Metrics];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Workload => "workload",
            Phase::Routing => "routing",
            Phase::Index => "index",
            Phase::Controller => "controller",
            Phase::Engine => "engine",
            Phase::Metrics => "metrics",
        }
    }
}

/// Charges the time since the previous lap to a phase.
pub trait Stopwatch {
    fn lap(&mut self, phase: Phase);
}

/// The stopwatch of plain runs: measures nothing.
pub struct NoStopwatch;

impl Stopwatch for NoStopwatch {
    #[inline(always)]
    fn lap(&mut self, _: Phase) {}
}

/// Wall-clock seconds per phase.
#[derive(Clone, Debug)]
pub struct PhaseTimes {
    seconds: [f64; Phase::ALL.len()],
    last: Instant,
}

impl Default for PhaseTimes {
    fn default() -> PhaseTimes {
        PhaseTimes { seconds: [0.0; Phase::ALL.len()], last: Instant::now() }
    }
}

impl PhaseTimes {
    pub fn seconds(&self, phase: Phase) -> f64 {
        self.seconds[phase as usize]
    }

    pub fn total_s(&self) -> f64 {
        self.seconds.iter().sum()
    }

    /// `phase`'s share of the time measured (0 when none was).
    pub fn share(&self, phase: Phase) -> f64 {
        let total = self.total_s();
        if total > 0.0 {
            self.seconds(phase) / total
        } else {
            0.0
        }
    }
}

impl Stopwatch for PhaseTimes {
    fn lap(&mut self, phase: Phase) {
        let now = Instant::now();
        self.seconds[phase as usize] += now.duration_since(self.last).as_secs_f64();
        self.last = now;
    }
}
