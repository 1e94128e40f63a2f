//! The router's latest decisions with their reasons, for `GET /api/decisions`: why a request
//! went where it went (the same explanation the simulator's report samples), live.

use engine::{RequestId, Time};
use policies::Route;
use serde_json::{json, Value};
use std::collections::VecDeque;

/// Decisions kept, the oldest dropped first.
pub const KEPT: usize = 256;

/// Kept as routed (a copy of the route, under the hub's lock on every placement); made JSON
/// only when asked for.
#[derive(Debug, Default)]
pub struct RecentDecisions {
    kept: VecDeque<(Time, RequestId, Route)>,
}

impl RecentDecisions {
    /// `request` placed at `now` (on the hub's clock) as `route` says.
    pub fn record(&mut self, now: Time, request: RequestId, route: &Route) {
        if self.kept.len() == KEPT {
            self.kept.pop_front();
        }
        self.kept.push_back((now, request, route.clone()));
    }

    /// The latest `n` at most, oldest first.
    pub fn latest(&self, n: usize) -> Vec<Value> {
        let skip = self.kept.len().saturating_sub(n);
        self.kept
            .iter()
            .skip(skip)
            .map(|(at, request, route)| {
                json!({
                    "request": request.to_string(),
                    "at_s": at.as_secs_f64(),
                    "prefill": route.prefill.0,
                    "decode": route.decode.0,
                    "why": serde_json::to_value(&route.why).unwrap_or(Value::Null),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::InstanceId;
    use policies::Why;

    #[test]
    fn it_keeps_the_latest_decisions_oldest_first() {
        let mut d = RecentDecisions::default();
        let route = Route { prefill: InstanceId(1), decode: InstanceId(1), why: Why::Turn };
        for i in 0..KEPT as u64 + 5 {
            d.record(Time(i * 1_000_000), RequestId(i), &route);
        }
        let all = d.latest(usize::MAX);
        assert_eq!(all.len(), KEPT);
        assert_eq!(all[0]["request"], format!("req-{}", 5));
        let last = d.latest(2);
        assert_eq!((last.len(), last[1]["at_s"].as_f64()), (2, Some((KEPT + 4) as f64)));
        assert_eq!(last[1]["prefill"], 1);
        assert_eq!(last[1]["why"]["rule"], "turn");
    }
}
