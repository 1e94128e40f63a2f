//! `round-robin`: each request goes to the next candidate instance in id order.
//!
//! Blind to load and cache: the baseline every other router must beat.

use super::{CostHints, Pick, Router, RouterFactory, Why};
use crate::view::FleetView;
use engine::Request;

/// `round-robin` has no parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RoundRobinConfig;

crate::params!(RoundRobinConfig, "round-robin", {});

impl RouterFactory for RoundRobinConfig {
    fn build(&self, _seed: u64, _hints: &CostHints) -> Box<dyn Router> {
        Box::new(RoundRobin::default())
    }
}

#[derive(Debug, Default)]
pub struct RoundRobin {
    /// Position in the instance list where the next search starts.
    next: usize,
}

impl Router for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn pick(&mut self, request: &Request, fleet: &FleetView) -> Option<Pick> {
        let all = fleet.all();
        let n = all.len();
        let start = self.next;
        let rule = fleet.candidate_rule(request);
        let i = (0..n).map(|k| (start + k) % n).find(|&i| rule.admits(&all[i]))?;
        self.next = i + 1;
        Some(Pick { instance: all[i].id, why: Why::Turn })
    }
}
