//! Tenants' recent service: the weighted tokens flow control gave each tenant, decayed with a
//! half-life. Least attained service orders tenants by it, and a tenant over an equal share
//! of it gets less room (`slo`: it leaves room to the others, so that their requests find
//! short queues and short steps).
//!
//! Decay rather than a running total: a tenant that was idle for a few half-lives counts as
//! new, one that keeps the fleet busy stays ahead of the others however long it has been
//! sending, and nothing grows with the length of the run.

use engine::{Dur, Request, TenantId, Time};
use std::collections::BTreeMap;

/// Tenants whose decayed service falls below this share of the total are forgotten.
const FORGET_SHARE: f64 = 1e-9;
/// How far from an equal share a tenant must be to count as over or under it: tenants
/// with about equal loads are treated alike, not in turns as their shares cross.
const SHARE_MARGIN: f64 = 1.5;
/// Tenants below this share of the recent total do not count as active when equal shares
/// are worked out (a tenant that sent one request an hour ago does not halve the others').
const ACTIVE_SHARE: f64 = 0.01;

#[derive(Clone, Copy, Debug)]
struct Decayed {
    value: f64,
    at: Time,
}

impl Decayed {
    fn at(self, now: Time, half_life_s: f64) -> f64 {
        self.value * 0.5f64.powf(now.since(self.at).as_secs_f64() / half_life_s)
    }
}

#[derive(Debug)]
pub struct Usage {
    half_life_s: f64,
    /// An output token's weight against a prompt token.
    output_weight: f64,
    tenants: BTreeMap<TenantId, Decayed>,
}

impl Usage {
    pub fn new(half_life: Dur, output_weight: f64) -> Usage {
        Usage { half_life_s: half_life.as_secs_f64().max(1e-6), output_weight, tenants: BTreeMap::new() }
    }

    fn decayed(&self, d: Decayed, now: Time) -> f64 {
        d.at(now, self.half_life_s)
    }

    /// `tenant`'s recent service at `now`.
    pub fn of(&self, now: Time, tenant: TenantId) -> f64 {
        self.tenants.get(&tenant).map_or(0.0, |&d| self.decayed(d, now))
    }

    /// Counts `request`, given to its tenant at `now`: its prompt tokens plus its output
    /// tokens at their weight.
    pub fn add_request(&mut self, now: Time, request: &Request) {
        let tokens = f64::from(request.prompt_tokens) + self.output_weight * f64::from(request.max_output_tokens);
        self.add(now, request.service.tenant, tokens);
    }

    /// Counts `tokens` of service given to `tenant` at `now`.
    pub fn add(&mut self, now: Time, tenant: TenantId, tokens: f64) {
        let value = self.of(now, tenant) + tokens;
        self.tenants.insert(tenant, Decayed { value, at: now });
        let forget = FORGET_SHARE * self.total(now);
        let half_life_s = self.half_life_s;
        self.tenants.retain(|_, d| d.at(now, half_life_s) >= forget);
    }

    fn total(&self, now: Time) -> f64 {
        self.tenants.values().map(|&d| self.decayed(d, now)).sum()
    }

    /// `tenant`'s recent service over an equal share of it among the active tenants (itself
    /// counted as one); `None` when no other tenant is active.
    fn share_ratio(&self, now: Time, tenant: TenantId) -> Option<f64> {
        let total = self.total(now);
        let others =
            self.tenants.iter().filter(|&(&t, &d)| t != tenant && self.decayed(d, now) >= ACTIVE_SHARE * total).count();
        (others > 0).then(|| self.of(now, tenant) * (others + 1) as f64 / total)
    }

    /// Whether `tenant` had clearly more than an equal share of the recent service
    /// ([`SHARE_MARGIN`] times it).
    pub fn over_share(&self, now: Time, tenant: TenantId) -> bool {
        self.share_ratio(now, tenant).is_some_and(|r| r > SHARE_MARGIN)
    }

    /// Whether `tenant` had clearly less than an equal share of it, another tenant being
    /// active.
    pub fn under_share(&self, now: Time, tenant: TenantId) -> bool {
        self.share_ratio(now, tenant).is_some_and(|r| r < 1.0 / SHARE_MARGIN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_halves_every_half_life_and_shares_are_among_active_tenants() {
        let mut u = Usage::new(Dur::from_secs_f64(10.0), 4.0);
        let (heavy, light, idle) = (TenantId(1), TenantId(2), TenantId(3));
        u.add(Time::ZERO, idle, 1.0);
        u.add(Time::from_millis(100_000), heavy, 1000.0);
        assert!((u.of(Time::from_millis(110_000), heavy) - 500.0).abs() < 1e-9);
        // Alone (the idle tenant's 2^-10 is under 1% of the total): not over.
        let now = Time::from_millis(100_000);
        assert!(!u.over_share(now, heavy));
        assert!(!u.over_share(now, TenantId(9)), "a new tenant");
        u.add(now, light, 100.0);
        assert!(u.over_share(now, heavy));
        assert!(!u.over_share(now, light));
        assert!(u.under_share(now, light) && !u.under_share(now, heavy));
        // About equal: neither.
        u.add(now, light, 800.0);
        assert!(!u.over_share(now, heavy) && !u.under_share(now, light));
        // Long idle, a tenant is forgotten.
        u.add(Time::from_millis(2_000_000), light, 1.0);
        assert_eq!(u.of(Time::from_millis(2_000_000), idle), 0.0);
        assert!(u.tenants.len() <= 2);
    }
}
