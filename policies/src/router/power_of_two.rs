//! `power-of-two`: draw two distinct candidates at random, send to the one with fewer
//! outstanding tokens (Mitzenmacher's power of two choices: most of the balance of
//! least-outstanding, at O(1) cost and without herding onto one stale minimum).
//!
//! The draw comes from a ChaCha generator seeded from the run's seed. With one candidate,
//! it is chosen.

use super::{CostHints, Pick, Router, RouterFactory, Why};
use crate::view::{FleetView, InstanceView};
use engine::Request;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `power-of-two` has no parameters (its draws derive from the run's seed).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PowerOfTwoConfig;

crate::params!(PowerOfTwoConfig, "power-of-two", {});

impl RouterFactory for PowerOfTwoConfig {
    fn build(&self, seed: u64, _hints: &CostHints) -> Box<dyn Router> {
        Box::new(PowerOfTwo::new(engine::ids::derive_seed(seed, "power-of-two", 0)))
    }
}

#[derive(Debug)]
pub struct PowerOfTwo {
    rng: ChaCha8Rng,
    /// Candidates of the current pick (kept to avoid allocating per request).
    scratch: Vec<u32>,
}

impl PowerOfTwo {
    pub fn new(seed: u64) -> PowerOfTwo {
        PowerOfTwo { rng: ChaCha8Rng::seed_from_u64(seed), scratch: Vec::new() }
    }
}

impl Router for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power-of-two"
    }

    fn pick(&mut self, request: &Request, fleet: &FleetView) -> Option<Pick> {
        self.scratch.clear();
        self.scratch.extend(fleet.candidates(request).map(|v| v.id.0));
        let n = self.scratch.len();
        let view = |k: usize| -> &InstanceView { &fleet.all()[self.scratch[k] as usize] };
        match n {
            0 => None,
            1 => {
                let v = view(0);
                Some(Pick {
                    instance: v.id,
                    why: Why::PowerOfTwo { drawn: [v.id; 2], outstanding_tokens: [v.outstanding_tokens(); 2] },
                })
            }
            _ => {
                let a = self.rng.random_range(0..n);
                let mut b = self.rng.random_range(0..n - 1);
                if b >= a {
                    b += 1;
                }
                let (va, vb) = (view(a), view(b));
                let (oa, ob) = (va.outstanding_tokens(), vb.outstanding_tokens());
                let chosen = if ob < oa { vb } else { va };
                Some(Pick {
                    instance: chosen.id,
                    why: Why::PowerOfTwo { drawn: [va.id, vb.id], outstanding_tokens: [oa, ob] },
                })
            }
        }
    }
}
