//! `least-outstanding`: the instance with the fewest outstanding tokens.
//!
//! Outstanding tokens are the prompt tokens still to compute plus the tokens still to
//! generate, as last reported, plus what was routed since (see
//! [`InstanceView::outstanding_tokens`](crate::InstanceView::outstanding_tokens)). Ties go to
//! the lowest id, so the choice is deterministic.

use super::{CostHints, Pick, Router, RouterFactory, Why};
use crate::view::FleetView;
use engine::Request;

/// `least-outstanding` has no parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LeastOutstandingConfig;

crate::params!(LeastOutstandingConfig, "least-outstanding", {});

impl RouterFactory for LeastOutstandingConfig {
    fn build(&self, _seed: u64, _hints: &CostHints) -> Box<dyn Router> {
        Box::new(LeastOutstanding)
    }
}

#[derive(Debug, Default)]
pub struct LeastOutstanding;

impl Router for LeastOutstanding {
    fn name(&self) -> &'static str {
        "least-outstanding"
    }

    fn pick(&mut self, request: &Request, fleet: &FleetView) -> Option<Pick> {
        fleet
            .candidates(request)
            .min_by_key(|v| (v.outstanding_tokens(), v.id))
            .map(|v| Pick { instance: v.id, why: Why::LeastOutstanding { outstanding_tokens: v.outstanding_tokens() } })
    }
}
