//! Choosing the next token from logits, on the GPU: greedy by the argmax kernel, temperature
//! and top-p by `sample_rows` (kernels/sample.cu), each row with a uniform draw made here from
//! the request's seed and draw number, so a request's output replays whatever batch it ran
//! in. [`sample`] is the same rule on the host: the reference the kernel is tested against.

use engine::ids::{derive_seed, mix64};

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

    /// The uniform number in [0, 1) of draw `draw` (24 bits, an exact f32).
    pub fn uniform(&self, draw: u64) -> f32 {
        (mix64(derive_seed(self.seed, "sample", draw)) >> 40) as f32 / (1u32 << 24) as f32
    }
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling::GREEDY
    }
}

/// Draws a token from `logits` for draw number `draw` of a request, by the kernel's rule: with
/// `w_i = exp((x_i − max) / T)`, the nucleus is every token whose weight is at least that of
/// the least likely token needed to reach `top_p` of the mass (ties at the edge stay in), and
/// the token is the first whose cumulative weight passes `u × kept mass`.
pub fn sample(logits: &[f32], s: &Sampling, draw: u64) -> u32 {
    sample_with(logits, s, s.uniform(draw))
}

/// [`sample`] with the uniform draw `u` given.
pub fn sample_with(logits: &[f32], s: &Sampling, u: f32) -> u32 {
    if s.is_greedy() || logits.is_empty() {
        return argmax(logits);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let inv_t = 1.0 / s.temperature;
    let weights: Vec<f64> = logits.iter().map(|&x| f64::from(((x - max) * inv_t).exp())).collect();
    let total: f64 = weights.iter().sum();
    let mut threshold = 0.0;
    if s.top_p < 1.0 {
        let mut sorted = weights.clone();
        sorted.sort_unstable_by(|a, b| b.total_cmp(a));
        let want = f64::from(s.top_p.max(0.0)) * total;
        let mut mass = 0.0;
        for w in sorted {
            mass += w;
            threshold = w;
            if mass >= want {
                break;
            }
        }
    }
    let target = f64::from(u) * weights.iter().filter(|&&w| w >= threshold).sum::<f64>();
    let last = weights.iter().rposition(|&w| w >= threshold).unwrap_or(0);
    pick(weights.iter().enumerate().filter(|(_, &w)| w >= threshold).map(|(i, &w)| (i, w)), target, last)
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
