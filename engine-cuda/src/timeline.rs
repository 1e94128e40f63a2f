//! Where a decode step's time goes: the launches of one step timed one by one
//! ([`super::CudaExecutor::time_decode_launches`]), and the replay of its CUDA graph.
//!
//! The launches are queued behind a spin kernel with a timing event after each, so they run
//! back to back and each event pair measures one kernel or GEMM plus the gap to the next
//! (and the event's own cost, well under a microsecond): the sum is a little above the
//! step's time in a graph, whose replay is timed separately.

/// One decode step's launches, timed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaunchTimes {
    /// Per launch in order: its name (`gemm qkv`, `paged_attention_split`, ...) and its
    /// time in microseconds.
    pub launches: Vec<(&'static str, f64)>,
    /// The step's CUDA graph replayed back to back, microseconds per replay (when graphs are
    /// on and the step's bucket has one).
    pub graph_us: Option<f64>,
}

/// One launch name's share of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct NameTotal {
    pub name: &'static str,
    pub launches: usize,
    pub total_us: f64,
}

impl LaunchTimes {
    /// Totals per launch name, in the order each name first launched.
    pub fn by_name(&self) -> Vec<NameTotal> {
        let mut out: Vec<NameTotal> = Vec::new();
        for &(name, us) in &self.launches {
            match out.iter_mut().find(|t| t.name == name) {
                Some(t) => {
                    t.launches += 1;
                    t.total_us += us;
                }
                None => out.push(NameTotal { name, launches: 1, total_us: us }),
            }
        }
        out
    }

    /// Every launch's time together, microseconds.
    pub fn total_us(&self) -> f64 {
        self.launches.iter().map(|(_, us)| us).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_add_up_per_name_in_first_launch_order() {
        let t = LaunchTimes {
            launches: vec![("embed", 2.0), ("gemm qkv", 10.0), ("rope", 1.5), ("gemm qkv", 12.0), ("rope", 0.5)],
            graph_us: None,
        };
        let names: Vec<_> = t.by_name().iter().map(|n| (n.name, n.launches, n.total_us)).collect();
        assert_eq!(names, [("embed", 1, 2.0), ("gemm qkv", 2, 22.0), ("rope", 2, 2.0)]);
        assert_eq!(t.total_us(), 26.0);
        assert!(LaunchTimes::default().by_name().is_empty());
    }
}
