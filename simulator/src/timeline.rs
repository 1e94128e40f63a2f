//! Time series of a run, one point per window: instances per pool, GPUs held, the SLO loads
//! and the SLO attainment of the requests that finished in the window; and how long the fleet
//! took to meet the SLO again after each shift of the workload.
//!
//! The time to meet the SLO again is measured on requests by their arrival, second by second
//! ([`ArrivalSeconds`], [`restore_times_s`]): the fleet has restored the SLO from the first
//! second whose arrivals, and those of every later 10 s window for a minute, meet it. Counting
//! requests where they finish, in the plot's 10 s windows ([`restore_times_by_finish_s`]), adds
//! each request's own duration (seconds of decoding for long outputs) and rounds up to the
//! window: both say more about the yardstick than about the fleet.
//!
//! Points are taken as the driver's clock passes each window's end, so memory grows with the
//! run's length over the window (a few thousand points), never with its requests; so do the
//! arrival seconds (8 bytes a second of the run).

use crate::slo::Slo;
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
    arrivals: ArrivalSeconds,
}

/// Requests and those that met the SLO, by the second of their arrival.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ArrivalSeconds {
    /// `[arrived, met]` for arrivals in `[i, i + 1)` s.
    seconds: Vec<[u32; 2]>,
}

/// Seconds of arrivals tracked at most (115 days, 80 MB): a bound on memory for any trace.
const MAX_ARRIVAL_SECONDS: usize = 10_000_000;

/// Width of the sliding window of arrivals whose attainment is judged, in seconds.
pub const ARRIVAL_WINDOW_S: usize = 10;

impl ArrivalSeconds {
    pub fn record(&mut self, arrival: Time, met: bool) {
        let i = (arrival.0 / 1_000_000) as usize;
        // A trace longer than the bound is measured over its first 115 days only.
        if i >= MAX_ARRIVAL_SECONDS {
            return;
        }
        if self.seconds.len() <= i {
            self.seconds.resize(i + 1, [0, 0]);
        }
        self.seconds[i][0] += 1;
        self.seconds[i][1] += u32::from(met);
    }

    /// Arrivals in seconds `[from, to)` that missed the SLO.
    fn misses(&self, from: usize, to: usize) -> u64 {
        let to = to.min(self.seconds.len());
        self.seconds.get(from..to).unwrap_or(&[]).iter().map(|s| u64::from(s[0] - s[1])).sum()
    }

    /// Whether the arrivals of the window starting at second `u` met the SLO at `threshold`
    /// (a window without arrivals does).
    fn window_meets(&self, u: usize, threshold: f64) -> bool {
        let end = (u + ARRIVAL_WINDOW_S).min(self.seconds.len());
        let [n, met] = self
            .seconds
            .get(u..end)
            .unwrap_or(&[])
            .iter()
            .fold([0u64; 2], |[n, m], s| [n + u64::from(s[0]), m + u64::from(s[1])]);
        n == 0 || met as f64 >= threshold * n as f64
    }
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
        Timeline {
            window,
            slo,
            next: Time(window.0),
            finished: 0,
            met: 0,
            points: Vec::new(),
            arrivals: ArrivalSeconds::default(),
        }
    }

    pub fn record(&mut self, f: &Finished) {
        let met = self.slo.met_by(f);
        self.finished += 1;
        self.met += u64::from(met);
        self.arrivals.record(f.request.arrival, met);
    }

    /// Whether `now` has passed the current window's end.
    pub fn due(&self, now: Time) -> bool {
        now >= self.next
    }

    /// The current window's end.
    pub fn next_due(&self) -> Time {
        self.next
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
    pub fn finish(mut self, now: Time, sizes: Sizes, controller: &Controller) -> (Vec<TimelinePoint>, ArrivalSeconds) {
        self.sample(now, sizes, controller);
        if self.finished > 0 {
            self.push(now, sizes, controller);
        }
        (self.points, self.arrivals)
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

/// How long after each shift (seconds from the start, in order) the SLO took to be met again,
/// by arrival: from the shift to the first second `R` such that the arrivals of every 10 s
/// window starting from `R` to `R` + [`RESTORED_FOR_S`] meet it at `threshold`; that is, to
/// the end of the last second starting a window that misses. 0 when no window starting in the
/// shift's phase misses through the phase's own arrivals; a fleet still failing when the next
/// phase begins keeps counting (the backlog of one shift is not the next shift's doing), up to
/// the end of the run.
pub fn restore_times_s(arrivals: &ArrivalSeconds, shifts_s: &[f64], threshold: f64) -> Vec<f64> {
    let restored_for = RESTORED_FOR_S as usize;
    let last = arrivals.seconds.len();
    let mut out = Vec::with_capacity(shifts_s.len());
    for (k, &shift) in shifts_s.iter().enumerate() {
        let first = shift.ceil() as usize;
        let phase_end = shifts_s.get(k + 1).map_or(usize::MAX, |s| s.ceil() as usize);
        let mut last_miss: Option<usize> = None;
        for u in first..last {
            if last_miss.is_none() && u >= phase_end {
                break;
            }
            // A window that misses only through arrivals after the next shift is that shift's.
            let own = last_miss.is_some() || arrivals.misses(u, (u + ARRIVAL_WINDOW_S).min(phase_end)) > 0;
            if own && !arrivals.window_meets(u, threshold) {
                last_miss = Some(u);
            } else if last_miss.is_some_and(|m| u - m > restored_for) {
                break;
            }
        }
        out.push(last_miss.map_or(0.0, |m| (m + 1) as f64 - shift));
    }
    out
}

/// The same, counting each request in the window it finished in ([`TimelinePoint`]s): from
/// the shift to the end of the last window below `threshold` before [`RESTORED_FOR_S`] of
/// windows that all meet it. Kept to compare with earlier measurements (see the module doc).
pub fn restore_times_by_finish_s(points: &[TimelinePoint], shifts_s: &[f64], threshold: f64) -> Vec<f64> {
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

    /// Arrivals second by second: `(arrived, met)` for seconds 0, 1, ...
    fn arrivals(per_second: &[(u32, u32)]) -> ArrivalSeconds {
        let mut a = ArrivalSeconds::default();
        for (i, &(n, met)) in per_second.iter().enumerate() {
            for k in 0..n {
                a.record(Time::from_millis(i as u64 * 1000 + 10), k < met);
            }
        }
        a
    }

    #[test]
    fn restore_by_arrival_ends_at_the_last_second_starting_a_missing_window() {
        // 100 arrivals a second over 300 s; seconds 105..=112 have misses.
        let mut s = vec![(100, 100); 300];
        for (i, sec) in s.iter_mut().enumerate().take(113).skip(105) {
            *sec = (100, if i == 112 { 95 } else { 0 });
        }
        // A window starting at 112 holds second 112's 5 misses among 1,000: 99.5%, met. The one
        // starting at 111 misses: the SLO holds for arrivals from 112 s on.
        assert_eq!(restore_times_s(&arrivals(&s), &[100.0], 0.99), vec![12.0]);
        // Twenty misses in second 220, 109 s after the last: past the minute of met windows,
        // so they do not belong to the shift at 100 s.
        let mut late = s.clone();
        late[220] = (100, 80);
        assert_eq!(restore_times_s(&arrivals(&late), &[100.0], 0.99), vec![12.0]);
        // Within the minute, they extend it.
        let mut near = s.clone();
        near[150] = (100, 80);
        assert_eq!(restore_times_s(&arrivals(&near), &[100.0], 0.99), vec![51.0]);
        // Nothing missed in the phase: 0; a failure outlasting its phase keeps counting.
        assert_eq!(restore_times_s(&arrivals(&s), &[0.0, 50.0, 200.0], 0.99), vec![0.0, 62.0, 0.0]);
        assert_eq!(restore_times_s(&arrivals(&s), &[0.0, 108.0, 200.0], 0.99), vec![112.0, 4.0, 0.0]);
        // The windows starting just before a shift that miss only through arrivals after it
        // are the next shift's.
        assert_eq!(restore_times_s(&arrivals(&s), &[30.0, 105.0], 0.99), vec![0.0, 7.0]);
    }

    #[test]
    fn arrivals_past_the_bound_are_not_tracked() {
        let mut a = ArrivalSeconds::default();
        a.record(Time(MAX_ARRIVAL_SECONDS as u64 * 1_000_000), false);
        assert!(a.seconds.is_empty());
        a.record(Time(2_500_000), false);
        assert_eq!(a.seconds, vec![[0, 0], [0, 0], [1, 0]]);
    }

    #[test]
    fn restore_by_finish_runs_to_the_last_miss_before_a_minute_of_met_windows() {
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
        assert_eq!(restore_times_by_finish_s(&points, &[15.0, 100.0, 190.0, 250.0], 0.99), vec![15.0, 0.0, 30.0, 50.0]);
        // A failure that outlasts its phase keeps counting into the next one.
        let points: Vec<_> = (1..=20).map(|k| point(f64::from(k) * 10.0, if k <= 12 { 0.0 } else { 1.0 })).collect();
        assert_eq!(restore_times_by_finish_s(&points, &[0.0, 50.0], 0.99), vec![120.0, 70.0]);
    }
}
