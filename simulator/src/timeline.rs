//! Time series of a run, one point per window: instances per pool, GPUs held, the SLO loads
//! and the SLO attainment of the requests that finished in the window; and, from them, how
//! long the fleet took to meet the SLO again after each shift of the workload.
//!
//! Points are taken as the driver's clock passes each window's end, so memory grows with the
//! run's length over the window (a few thousand points), never with its requests.

use crate::metrics::Slo;
use engine::{Dur, Finished, Time};
use policies::{Controller, Role};
use serde::{Deserialize, Serialize};

/// One window of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimelinePoint {
    /// End of the window.
    pub t_s: f64,
    /// Serving instances per pool (`colocated` for a colocated fleet).
    pub prefill: u32,
    pub decode: u32,
    pub colocated: u32,
    /// Instances starting and draining, over all pools.
    pub starting: u32,
    pub draining: u32,
    /// GPUs held (starting, serving, draining).
    pub gpus: u32,
    /// The SLO loads at the last scaling tick (disaggregated fleets only).
    pub load_p: Option<f64>,
    pub load_d: Option<f64>,
    /// Requests that finished in the window, and the share of them that met the SLO (1.0
    /// when none finished).
    pub finished: u64,
    pub slo_attainment: f64,
}

/// Collects [`TimelinePoint`]s.
#[derive(Clone, Debug)]
pub struct Timeline {
    window: Dur,
    slo: Slo,
    next: Time,
    finished: u64,
    met: u64,
    points: Vec<TimelinePoint>,
}

/// Fleet sizes as the driver reads them at a window's end.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sizes {
    pub serving: [u32; 3],
    pub starting: u32,
    pub draining: u32,
    pub gpus: u32,
}

impl Sizes {
    /// From [`crate::fleet::SimFleet::pool_counts`] rows.
    pub fn from_counts(counts: &[(Role, u32, u32, u32)], holding: u32, gpus_per_instance: u32) -> Sizes {
        let mut s = Sizes { gpus: holding * gpus_per_instance, ..Sizes::default() };
        for &(role, starting, serving, draining) in counts {
            let i = match role {
                Role::Colocated => 0,
                Role::Prefill => 1,
                Role::Decode => 2,
            };
            s.serving[i] += serving;
            s.starting += starting;
            s.draining += draining;
        }
        s
    }
}

impl Timeline {
    pub fn new(window: Dur, slo: Slo) -> Timeline {
        assert!(window.0 > 0, "a timeline window must be positive");
        Timeline { window, slo, next: Time(window.0), finished: 0, met: 0, points: Vec::new() }
    }

    pub fn record(&mut self, f: &Finished) {
        self.finished += 1;
        self.met += u64::from(self.slo.met_by(f));
    }

    /// Whether `now` has passed the current window's end.
    pub fn due(&self, now: Time) -> bool {
        now >= self.next
    }

    /// Closes every window that ended by `now` with the fleet as it is.
    pub fn sample(&mut self, now: Time, sizes: Sizes, controller: &Controller) {
        while now >= self.next {
            let at = self.next;
            self.push(at, sizes, controller);
            self.next = at + self.window;
        }
    }

    /// Closes the last, partial window at `now` (the end of the run).
    pub fn finish(mut self, now: Time, sizes: Sizes, controller: &Controller) -> Vec<TimelinePoint> {
        self.sample(now, sizes, controller);
        if self.finished > 0 {
            self.push(now, sizes, controller);
        }
        self.points
    }

    fn push(&mut self, at: Time, sizes: Sizes, controller: &Controller) {
        let loads = controller.pools().map(|p| p.loads);
        self.points.push(TimelinePoint {
            t_s: at.as_secs_f64(),
            colocated: sizes.serving[0],
            prefill: sizes.serving[1],
            decode: sizes.serving[2],
            starting: sizes.starting,
            draining: sizes.draining,
            gpus: sizes.gpus,
            load_p: loads.map(|l| l.load_p),
            load_d: loads.map(|l| l.load_d),
            finished: self.finished,
            slo_attainment: if self.finished == 0 { 1.0 } else { self.met as f64 / self.finished as f64 },
        });
        self.finished = 0;
        self.met = 0;
    }
}

/// How long the SLO must hold again before a shift counts as absorbed.
pub const RESTORED_FOR_S: f64 = 60.0;

/// How long after each shift (seconds from the start, in order) the SLO took to be met
/// again: from the shift to the end of the last window whose attainment was below
/// `threshold` before [`RESTORED_FOR_S`] of windows that all meet it. 0 when no window of the
/// shift's phase missed it; a fleet still failing when the next phase begins keeps counting
/// (the backlog of one shift is not the next shift's doing), up to the end of the run.
pub fn restore_times_s(points: &[TimelinePoint], shifts_s: &[f64], threshold: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(shifts_s.len());
    for (k, &shift) in shifts_s.iter().enumerate() {
        let phase_end = shifts_s.get(k + 1).copied().unwrap_or(f64::INFINITY);
        let mut last_miss: Option<f64> = None;
        for p in points.iter().filter(|p| p.t_s > shift) {
            if last_miss.is_none() && p.t_s > phase_end {
                break;
            }
            if p.slo_attainment < threshold {
                last_miss = Some(p.t_s);
            } else if last_miss.is_some_and(|m| p.t_s - m >= RESTORED_FOR_S) {
                break;
            }
        }
        out.push(last_miss.map_or(0.0, |t| t - shift));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(t_s: f64, slo_attainment: f64) -> TimelinePoint {
        TimelinePoint {
            t_s,
            prefill: 0,
            decode: 0,
            colocated: 0,
            starting: 0,
            draining: 0,
            gpus: 0,
            load_p: None,
            load_d: None,
            finished: 1,
            slo_attainment,
        }
    }

    #[test]
    fn restore_time_runs_to_the_last_miss_before_a_minute_of_met_windows() {
        let att = |t: f64| match t as u32 {
            20 | 30 => 0.5,
            200 | 210 | 220 => 0.1,
            300 => 0.9,
            _ => 1.0,
        };
        let points: Vec<_> = (1..=40).map(|k| f64::from(k) * 10.0).map(|t| point(t, att(t))).collect();
        // Shift 15: misses at 20 and 30, then a minute of met windows: 15 s. Shift 100:
        // nothing missed before the next shift: 0. Shift 190: misses up to 220, then more
        // than a minute met: 30 s. Shift 250: its own miss at 300: 50 s.
        assert_eq!(restore_times_s(&points, &[15.0, 100.0, 190.0, 250.0], 0.99), vec![15.0, 0.0, 30.0, 50.0]);
        // A failure that outlasts its phase keeps counting into the next one.
        let points: Vec<_> = (1..=20).map(|k| point(f64::from(k) * 10.0, if k <= 12 { 0.0 } else { 1.0 })).collect();
        assert_eq!(restore_times_s(&points, &[0.0, 50.0], 0.99), vec![120.0, 70.0]);
    }
}
