//! Choosing the next token from logits: greedy on the GPU (argmax kernel), temperature and
//! top-p on the host from the row's logits, with a seed so a request's output replays.

use crate::ids::{derive_seed, mix64};

/// How a request's tokens are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0: greedy (argmax). Otherwise logits are divided by it before the softmax.
    pub temperature: f32,
    /// Nucleus sampling: draw from the smallest set of most likely tokens whose probability
    /// reaches `top_p` (1: from all).
    pub top_p: f32,
    /// Seed of the request's draws; draw `k` uses a sub-seed of (seed, k), so the output does
    /// not depend on which batch the request ran in.
    pub seed: u64,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling { temperature: 0.0, top_p: 1.0, seed: 0 };

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || !self.temperature.is_finite()
    }
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling::GREEDY
    }
}

/// Draws a token from `logits` for draw number `draw` of a request.
pub fn sample(logits: &[f32], s: &Sampling, draw: u64) -> u32 {
    if s.is_greedy() || logits.is_empty() {
        return argmax(logits);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let inv_t = 1.0 / s.temperature;
    let probs: Vec<f64> = logits.iter().map(|&x| f64::from(((x - max) * inv_t).exp())).collect();
    let u = (mix64(derive_seed(s.seed, "sample", draw)) >> 11) as f64 / (1u64 << 53) as f64;
    if s.top_p >= 1.0 {
        let total: f64 = probs.iter().sum();
        return pick(probs.iter().enumerate().map(|(i, &p)| (i, p)), u * total, probs.len() - 1);
    }
    // Most likely first; ties by index so the order is total and reproducible.
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_unstable_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let total: f64 = probs.iter().sum();
    let want = f64::from(s.top_p.max(0.0)) * total;
    let mut kept = 0;
    let mut mass = 0.0;
    for &i in &order {
        mass += probs[i];
        kept += 1;
        if mass >= want {
            break;
        }
    }
    pick(order[..kept].iter().map(|&i| (i, probs[i])), u * mass, order[kept - 1])
}

/// The first index whose cumulative weight passes `target` (the last one, or `fallback` for
/// no items, when rounding leaves the sum short).
fn pick(items: impl Iterator<Item = (usize, f64)>, target: f64, fallback: usize) -> u32 {
    let mut acc = 0.0;
    let mut last = fallback;
    for (i, p) in items {
        acc += p;
        last = i;
        if acc > target {
            return i as u32;
        }
    }
    last as u32
}

/// Index of the largest value, the lowest on ties (as the GPU kernel and torch.argmax).
pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest_logit() {
        assert_eq!(sample(&[0.5, 2.0, 2.0, -1.0], &Sampling::GREEDY, 0), 1);
    }

    #[test]
    fn sampling_replays_from_the_seed_and_varies_with_the_draw() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let s = Sampling { temperature: 1.0, top_p: 1.0, seed: 42 };
        let draws: Vec<u32> = (0..20).map(|k| sample(&logits, &s, k)).collect();
        assert_eq!(draws, (0..20).map(|k| sample(&logits, &s, k)).collect::<Vec<_>>());
        assert!(draws.iter().any(|&d| d != draws[0]));
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Probabilities ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.7 keeps the first two.
        let logits = [3.0, 2.0, 1.0, 0.0];
        let s = Sampling { temperature: 1.0, top_p: 0.7, seed: 1 };
        let mut seen = [0; 4];
        for k in 0..2000 {
            seen[sample(&logits, &s, k) as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
        assert!(seen[0] > seen[1] && seen[1] > 0, "{seen:?}");
    }

    #[test]
    fn low_temperature_approaches_greedy() {
        let logits = [1.0, 1.5, 0.2];
        let s = Sampling { temperature: 0.01, top_p: 1.0, seed: 9 };
        assert!((0..100).all(|k| sample(&logits, &s, k) == 1));
    }
}
