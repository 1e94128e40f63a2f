//! `llm-d`: the flow control of llm-d's endpoint picker (Gateway API Inference Extension),
//! as its documentation describes it, for side-by-side runs.
//!
//! - **Saturation** (its `SaturationDetector`): an instance is saturated when its waiting
//!   queue is deeper than `queue_depth` (5) or its KV utilisation is above `kv_util`
//!   (0.8), both from its last metrics report; the pool is saturated when every candidate
//!   is. It counts nothing routed since the report.
//! - **Order**: strict priority between bands, tenants of a band in turn (round robin),
//!   FCFS within a tenant.
//! - **Shedding**: a sheddable request (negative priority in llm-d, our batch class) that
//!   finds the pool saturated is refused at once (429), not queued.
//!
//! Adaptation: llm-d also ages queued requests out after a TTL; here they wait until
//! there is room (its default TTL is long against these runs).

use super::{Fairness, FlowRule};
use crate::view::FleetView;
use engine::{Request, Time};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlmDFlowConfig {
    pub queue_depth: u32,
    pub kv_util: f64,
    pub queue_limit: u32,
}

impl Default for LlmDFlowConfig {
    fn default() -> Self {
        LlmDFlowConfig { queue_depth: 5, kv_util: 0.8, queue_limit: 100_000 }
    }
}

crate::params!(LlmDFlowConfig, "llm-d", {
    queue_depth: integer from 0.0 ..= 100000.0, "waiting requests above which an instance is saturated";
    kv_util: float above 0.0 ..= 1.0, "KV utilisation above which an instance is saturated";
    queue_limit: integer from 1.0 ..= 10000000.0, "requests one band's queue holds at most";
});

#[derive(Debug)]
pub struct LlmDFlow {
    config: LlmDFlowConfig,
}

impl LlmDFlow {
    pub fn new(config: LlmDFlowConfig) -> LlmDFlow {
        LlmDFlow { config }
    }
}

impl FlowRule for LlmDFlow {
    fn name(&self) -> &'static str {
        "llm-d"
    }

    /// llm-d's detector does not tell tenants apart.
    fn has_room(&self, view: &FleetView, request: &Request, _over_share: bool) -> bool {
        view.candidates(request).any(|v| {
            let l = &v.load;
            let util =
                if l.kv_total_blocks == 0 { 0.0 } else { f64::from(l.kv_used_blocks) / f64::from(l.kv_total_blocks) };
            l.waiting <= self.config.queue_depth && util <= self.config.kv_util
        })
    }

    fn order(&self, request: &Request) -> i64 {
        request.arrival.0 as i64
    }

    fn late_at(&self, _request: &Request) -> Option<Time> {
        None
    }

    fn shed_at(&self, _request: &Request) -> Option<Time> {
        None
    }

    fn shed_when_full(&self) -> bool {
        true
    }

    fn fairness(&self) -> Fairness {
        Fairness::RoundRobin
    }

    fn queue_limit(&self) -> usize {
        self.config.queue_limit as usize
    }
}
