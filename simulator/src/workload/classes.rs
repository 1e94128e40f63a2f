//! Request classes and tenants drawn for any workload (`[workload.classes]`).
//!
//! ```toml
//! [workload.classes]
//! mix = [
//!   { class = "interactive", share = 0.3, ttft_ms = 1000, tpot_ms = 50 },
//!   { class = "batch", share = 0.7, ttft_ms = 60000, tpot_ms = 200, deadline_ms = 120000 },
//! ]
//! tenants = [{ name = "heavy", share = 10 }, { name = "light", share = 1 }]
//! only_tenant = "light"   # keep only its requests: its load alone, for comparison
//! ```
//!
//! Each request's class and tenant are drawn from its position in the workload and the
//! run's seed alone, so a request has the same class and tenant in every run, and
//! `only_tenant` keeps exactly the requests that tenant sends in the mixed run. Shares are
//! relative weights. A class's targets default to `[slo]`'s.

use super::{Arrival, SessionStats, TurnEnd, Workload, WorkloadError};
use engine::ids::mix64;
use engine::{BlockHash, Class, Service, TenantId};
use serde::{Deserialize, Serialize};
use std::num::NonZeroU32;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassesConfig {
    pub mix: Vec<ClassShare>,
    #[serde(default)]
    pub tenants: Vec<TenantShare>,
    #[serde(default)]
    pub only_tenant: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassShare {
    pub class: Class,
    pub share: f64,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    /// First token due this long after arrival at the latest (see [`Service::deadline_ms`]).
    pub deadline_ms: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantShare {
    pub name: String,
    pub share: f64,
}

impl ClassesConfig {
    /// Every share positive and finite, no class or tenant twice, `only_tenant` one of them.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |key: &str, reason: String| Err(WorkloadError::Config { key: format!("classes.{key}"), reason });
        if self.mix.is_empty() {
            return bad("mix", "needs at least one class".into());
        }
        for (i, c) in self.mix.iter().enumerate() {
            if !(c.share.is_finite() && c.share > 0.0) {
                return bad("mix", format!("share of `{}` must be finite and > 0 (got {})", c.class, c.share));
            }
            if self.mix[..i].iter().any(|o| o.class == c.class) {
                return bad("mix", format!("class `{}` is listed twice", c.class));
            }
            for (key, v) in [("ttft_ms", c.ttft_ms), ("tpot_ms", c.tpot_ms)] {
                if v.is_some_and(|v| !(v.is_finite() && v > 0.0)) {
                    return bad("mix", format!("`{key}` of `{}` must be finite and > 0", c.class));
                }
            }
            if c.deadline_ms == Some(0) {
                return bad("mix", format!("`deadline_ms` of `{}` must be at least 1", c.class));
            }
        }
        for (i, t) in self.tenants.iter().enumerate() {
            if !(t.share.is_finite() && t.share > 0.0) {
                return bad("tenants", format!("share of `{}` must be finite and > 0 (got {})", t.name, t.share));
            }
            if self.tenants[..i].iter().any(|o| o.name == t.name) {
                return bad("tenants", format!("tenant `{}` is listed twice", t.name));
            }
        }
        if let Some(only) = &self.only_tenant {
            if !self.tenants.iter().any(|t| &t.name == only) {
                let names: Vec<&str> = self.tenants.iter().map(|t| t.name.as_str()).collect();
                return bad("only_tenant", format!("`{only}` is not a tenant (tenants: {})", names.join(", ")));
            }
        }
        Ok(())
    }

    /// The tenants' names by [`TenantId`] (one unnamed tenant when none is given).
    pub fn tenant_names(&self) -> Vec<String> {
        match self.tenants.len() {
            0 => vec!["default".to_string()],
            _ => self.tenants.iter().map(|t| t.name.clone()).collect(),
        }
    }
}

/// Draws each arrival's class and tenant (see the module doc).
pub fn classify(inner: Box<dyn Workload>, config: &ClassesConfig, seed: u64) -> Box<dyn Workload> {
    let only = config.only_tenant.as_ref().and_then(|o| config.tenants.iter().position(|t| &t.name == o));
    Box::new(Classify {
        inner,
        classes: cumulative(config.mix.iter().map(|c| c.share)),
        mix: config.mix.iter().map(|c| (c.class, c.deadline_ms.and_then(NonZeroU32::new))).collect(),
        tenants: cumulative(config.tenants.iter().map(|t| t.share)),
        only: only.map(|i| TenantId(i as u32)),
        seed: engine::ids::derive_seed(seed, "classes", 0),
        index: 0,
    })
}

/// Cumulative shares normalised to end at 1.
fn cumulative(shares: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut acc = 0.0;
    let mut out: Vec<f64> = shares
        .map(|s| {
            acc += s;
            acc
        })
        .collect();
    out.iter_mut().for_each(|c| *c /= acc);
    out
}

/// The index whose cumulative share first exceeds `u` in [0, 1).
fn pick(cumulative: &[f64], u: f64) -> usize {
    cumulative.iter().position(|&c| u < c).unwrap_or(cumulative.len().saturating_sub(1))
}

fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

struct Classify {
    inner: Box<dyn Workload>,
    classes: Vec<f64>,
    mix: Vec<(Class, Option<NonZeroU32>)>,
    tenants: Vec<f64>,
    only: Option<TenantId>,
    seed: u64,
    /// Arrivals drawn so far, kept or not.
    index: u64,
}

impl Workload for Classify {
    fn next_arrival(&mut self, mut buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        loop {
            let Some(mut a) = self.inner.next_arrival(buf)? else {
                return Ok(None);
            };
            // A session's turns are one program: one class and tenant for all of them.
            let draw = match a.service.session {
                Some(s) => mix64(self.seed ^ SESSION_TAG ^ s.0.get()),
                None => mix64(self.seed ^ self.index),
            };
            self.index += 1;
            let (class, deadline_ms) = self.mix[pick(&self.classes, unit(draw))];
            let tenant = match self.tenants.len() {
                0 => TenantId(0),
                _ => TenantId(pick(&self.tenants, unit(mix64(draw))) as u32),
            };
            if self.only.is_some_and(|o| o != tenant) {
                buf = std::mem::take(&mut a.block_hashes);
                buf.clear();
                continue;
            }
            a.service = Service { class, tenant, deadline_ms, ..a.service };
            return Ok(Some(a));
        }
    }

    fn closed_loop(&self) -> bool {
        self.inner.closed_loop()
    }

    fn ended(&mut self, end: TurnEnd) {
        self.inner.ended(end)
    }

    fn put_back(&mut self, arrival: Arrival) {
        self.inner.put_back(arrival)
    }

    fn sessions(&self) -> Option<SessionStats> {
        self.inner.sessions()
    }
}

/// Keeps sessions' draws apart from requests' (ASCII `session`).
const SESSION_TAG: u64 = 0x7365_7373_696f_6e00;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{synthetic, test_util, SyntheticConfig, WorkloadOptions};

    fn config(only: Option<&str>) -> ClassesConfig {
        let share = |class, share| ClassShare { class, share, ttft_ms: None, tpot_ms: None, deadline_ms: None };
        ClassesConfig {
            mix: vec![share(Class::Interactive, 1.0), share(Class::Batch, 3.0)],
            tenants: vec![
                TenantShare { name: "heavy".into(), share: 10.0 },
                TenantShare { name: "light".into(), share: 1.0 },
            ],
            only_tenant: only.map(str::to_string),
        }
    }

    fn arrivals(only: Option<&str>) -> Vec<Arrival> {
        let w = synthetic(&SyntheticConfig::bench_default(), &WorkloadOptions::default()).expect("valid");
        test_util::drain(Ok(crate::workload::limit(classify(w, &config(only), 7), 4_000)))
    }

    #[test]
    fn classes_and_tenants_follow_their_shares() {
        let all = arrivals(None);
        let share = |f: &dyn Fn(&Arrival) -> bool| all.iter().filter(|a| f(a)).count() as f64 / all.len() as f64;
        let batch = share(&|a| a.service.class == Class::Batch);
        let light = share(&|a| a.service.tenant == TenantId(1));
        assert!((batch - 0.75).abs() < 0.03, "{batch}");
        assert!((light - 1.0 / 11.0).abs() < 0.02, "{light}");
    }

    /// A tenant alone gets exactly the requests it sends in the mix, at the same times.
    #[test]
    fn one_tenant_alone_keeps_its_own_requests() {
        let mixed: Vec<Arrival> = arrivals(None).into_iter().filter(|a| a.service.tenant == TenantId(1)).collect();
        let alone = arrivals(Some("light"));
        assert!(!mixed.is_empty());
        assert_eq!(mixed[..], alone[..mixed.len()]);
    }

    #[test]
    fn bad_mixes_are_refused_with_what_is_wrong() {
        let mut c = config(Some("nobody"));
        assert!(c.validate().unwrap_err().to_string().contains("`nobody` is not a tenant"));
        c.only_tenant = None;
        c.mix[1].class = Class::Interactive;
        assert!(c.validate().unwrap_err().to_string().contains("listed twice"));
        c.mix[1].class = Class::Batch;
        c.mix[0].share = 0.0;
        assert!(c.validate().unwrap_err().to_string().contains("must be finite and > 0"));
    }
}
