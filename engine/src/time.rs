//! Virtual and live time as integer microseconds.
//!
//! The engine and the policies never read a clock: every entry point takes `now: Time`.
//! Integers (not floats) keep the simulator exact and deterministic across machines.

use serde::{Deserialize, Serialize};
use std::ops::{Add, AddAssign, Sub};

/// A point in time, in microseconds since the start of a run (virtual) or of the process (live).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Time(pub u64);

/// A length of time in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Dur(pub u64);

impl Time {
    pub const ZERO: Time = Time(0);

    pub fn from_millis(ms: u64) -> Time {
        Time(ms.saturating_mul(1_000))
    }

    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }

    pub fn as_millis_f64(self) -> f64 {
        self.0 as f64 / 1e3
    }

    /// Time elapsed since `earlier`, or zero when `earlier` is later.
    pub fn since(self, earlier: Time) -> Dur {
        Dur(self.0.saturating_sub(earlier.0))
    }
}

impl Dur {
    pub const ZERO: Dur = Dur(0);

    pub fn from_millis(ms: u64) -> Dur {
        Dur(ms.saturating_mul(1_000))
    }

    /// Rounds to the nearest microsecond; negative and NaN inputs give zero.
    pub fn from_secs_f64(secs: f64) -> Dur {
        if secs.is_finite() && secs > 0.0 {
            Dur((secs * 1e6).round() as u64)
        } else {
            Dur(0)
        }
    }

    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }

    pub fn as_millis_f64(self) -> f64 {
        self.0 as f64 / 1e3
    }
}

impl Add<Dur> for Time {
    type Output = Time;
    fn add(self, d: Dur) -> Time {
        Time(self.0.saturating_add(d.0))
    }
}

impl AddAssign<Dur> for Time {
    fn add_assign(&mut self, d: Dur) {
        self.0 = self.0.saturating_add(d.0);
    }
}

impl Add for Dur {
    type Output = Dur;
    fn add(self, d: Dur) -> Dur {
        Dur(self.0.saturating_add(d.0))
    }
}

impl AddAssign for Dur {
    fn add_assign(&mut self, d: Dur) {
        self.0 = self.0.saturating_add(d.0);
    }
}

/// Saturates at zero, like [`Time::since`].
impl Sub for Dur {
    type Output = Dur;
    fn sub(self, d: Dur) -> Dur {
        Dur(self.0.saturating_sub(d.0))
    }
}

impl Sub for Time {
    type Output = Dur;
    fn sub(self, earlier: Time) -> Dur {
        self.since(earlier)
    }
}
