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

/// 2^52: the `f64`s from here on are all whole numbers.
const EXACT_FRACTION: f64 = 4_503_599_627_370_496.0;

impl Dur {
    pub const ZERO: Dur = Dur(0);

    pub fn from_millis(ms: u64) -> Dur {
        Dur(ms.saturating_mul(1_000))
    }

    /// Rounds to the nearest microsecond (halves away from zero, as `f64::round`); negative
    /// and NaN inputs give zero.
    #[inline]
    pub fn from_secs_f64(secs: f64) -> Dur {
        if !(secs.is_finite() && secs > 0.0) {
            return Dur(0);
        }
        let us = secs * 1e6;
        // `f64::round` without its library call (a simulation prices millions of steps):
        // below 2^52 the fraction `us - whole` is exact; from there every `f64` is whole.
        let whole = us as u64;
        if us < EXACT_FRACTION && us - whole as f64 >= 0.5 {
            Dur(whole + 1)
        } else {
            Dur(whole)
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

#[cfg(test)]
mod tests {
    use super::Dur;

    /// What `Dur::from_secs_f64` must give: `f64::round` of the microseconds.
    fn rounded(secs: f64) -> Dur {
        Dur(if secs.is_finite() && secs > 0.0 { (secs * 1e6).round() as u64 } else { 0 })
    }

    #[test]
    fn seconds_round_to_microseconds_as_f64_round_does() {
        let halves = (0..2000u32).map(|k| (f64::from(k) + 0.5) * 1e-6);
        let edges = [
            0.0,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            1e-300,
            0.5e-6f64.next_down(),
            4.5e9,
            4.503599627370497e9,
            1e13,
            2e13,
            1e300,
        ];
        for secs in halves.chain(edges) {
            assert_eq!(Dur::from_secs_f64(secs), rounded(secs), "{secs:e}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_seconds_round_as_f64_round_does(bits in proptest::num::u64::ANY, small in 0.0f64..1e4) {
            let any = f64::from_bits(bits);
            proptest::prop_assert_eq!(Dur::from_secs_f64(any), rounded(any));
            proptest::prop_assert_eq!(Dur::from_secs_f64(small), rounded(small));
        }
    }
}
