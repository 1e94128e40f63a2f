//! Synthetic workloads: an arrival process, a rate schedule, prompt and output length
//! distributions and shared system prompts, all drawn from the run's seed.
//!
//! ```toml
//! requests = 1000000
//! arrival = { kind = "poisson", rate_rps = 1500.0 }   # or { kind = "gamma", rate_rps = 1500.0, cv = 3.0 }
//! rate_schedule = [ { at_s = 0.0, scale = 1.0 }, { at_s = 60.0, scale = 2.0 } ]
//! input = { kind = "lognormal", median = 1024, sigma = 1.0, min = 1, max = 32768 }
//! output = { kind = "lognormal", median = 128, sigma = 0.8, min = 1, max = 4096 }
//! prefix = { groups = 16, tokens = 1024, share = 0.6 }
//! long = { share = 0.05, input = { kind = "uniform", min = 32768, max = 262144 } }
//! long_output = { share = 0.2, output = { kind = "uniform", min = 8192, max = 32768 }, from_s = 10.0, until_s = 40.0 }
//! ```
//!
//! How a request is drawn:
//!
//! - **Arrivals.** Inter-arrival gaps are exponential (Poisson) or gamma with shape `1/cv²`
//!   and mean `1/rate_rps` (cv > 1 is bursty). A gap is measured in work at the base rate and
//!   spent through the piecewise-constant `rate_schedule` (a time change): at scale s, one
//!   second of base-rate work takes `1/s` seconds, so a Poisson process stays Poisson with
//!   rate `rate_rps × s` in each piece. Before the first step the scale is 1; a scale of 0
//!   pauses arrivals, and a last step of scale 0 ends the workload early.
//! - **Lengths.** `input` is the request's own prompt part, `output` its output; lognormal
//!   draws are rounded and clamped to `[min, max]`. With `long`, a share of the requests
//!   draw their own part from `long.input` instead (a minority of very long prompts). With
//!   `long_output`, a share of the requests arriving in `[from_s, until_s)` (seconds of the
//!   schedule, before `rate_scale`; either bound may be left out) draw their output from
//!   `long_output.output` instead: a burst of long generations.
//! - **Shared system prompts.** With probability `share`, a request starts with one of
//!   `groups` shared prefixes of `tokens` tokens (group chosen uniformly), so its prompt is
//!   `tokens + input`. The prefix's full blocks hash from (group, block index) and match
//!   across the group; every other block is unique to the request.
//!
//! Arrival gaps and request contents use two ChaCha8 streams derived from the seed, so
//! changing the arrival process or the rate leaves the sequence of requests unchanged
//! (common random numbers when comparing runs). A request costs no allocation beyond the
//! caller's `buf` and no map lookup. Samplers call `exp`/`ln` from the platform's math
//! library, so sequences are identical on one platform and may differ in the last bit across
//! platforms.

use super::{Arrival, Workload, WorkloadError, WorkloadOptions};
use engine::ids::mix64;
use engine::{BlockHash, Time};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, Gamma, LogNormal};
use serde::{Deserialize, Serialize};

/// A synthetic workload's description, as written in a scenario's TOML.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyntheticConfig {
    /// How many requests to generate (fewer if a schedule ends with scale 0).
    pub requests: u64,
    pub arrival: ArrivalProcess,
    /// Piecewise-constant multipliers of the arrival rate, in increasing `at_s` order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rate_schedule: Vec<RateStep>,
    /// The request's own prompt tokens (after any shared prefix).
    pub input: LengthDist,
    /// Output tokens; 0 is allowed (the engine generates at least one).
    pub output: LengthDist,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<PrefixGroups>,
    /// A minority of long prompts: with probability `share`, the request's own prompt part is
    /// drawn from `input` instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long: Option<LongInputs>,
    /// Long outputs: with probability `share`, a request arriving in the window draws its
    /// output from `output` instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long_output: Option<LongOutputs>,
}

/// `long_output = { share = 0.2, output = { kind = "constant", tokens = 16384 }, from_s = 10.0, until_s = 40.0 }`
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LongOutputs {
    pub share: f64,
    pub output: LengthDist,
    /// The window of arrival times, in seconds before `rate_scale` (default: from the start,
    /// to the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_s: Option<f64>,
}

impl LongOutputs {
    fn covers(&self, t_s: f64) -> bool {
        self.from_s.is_none_or(|from| t_s >= from) && self.until_s.is_none_or(|until| t_s < until)
    }
}

/// `long = { share = 0.05, input = { kind = "uniform", min = 32768, max = 262144 } }`
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LongInputs {
    pub share: f64,
    pub input: LengthDist,
}

/// When requests arrive, at the base rate (before `rate_schedule` and `rate_scale`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ArrivalProcess {
    /// Exponential gaps with mean `1 / rate_rps`.
    Poisson { rate_rps: f64 },
    /// Gamma gaps with mean `1 / rate_rps` and coefficient of variation `cv` (1 is Poisson;
    /// larger is burstier).
    Gamma { rate_rps: f64, cv: f64 },
}

/// From `at_s` seconds on (until the next step), the arrival rate is multiplied by `scale`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateStep {
    pub at_s: f64,
    pub scale: f64,
}

/// A distribution of token counts.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LengthDist {
    Constant {
        tokens: u32,
    },
    /// Uniform over `min..=max`.
    Uniform {
        min: u32,
        max: u32,
    },
    /// `exp(ln(median) + sigma × N(0, 1))`, rounded and clamped to `[min, max]`.
    Lognormal {
        median: f64,
        sigma: f64,
        min: u32,
        max: u32,
    },
}

/// Shared system prompts: `share` of the requests start with one of `groups` prefixes of
/// `tokens` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefixGroups {
    pub groups: u32,
    pub tokens: u32,
    pub share: f64,
}

impl SyntheticConfig {
    /// The simulator benchmark's workload (64 instances of Llama-3.1-8B on H100): one million
    /// Poisson requests at 1,200 req/s, lognormal prompts (median 1,024) and outputs (median
    /// 128), half of them behind one of 32 shared 512-token system prompts.
    pub fn bench_default() -> SyntheticConfig {
        SyntheticConfig {
            requests: 1_000_000,
            arrival: ArrivalProcess::Poisson { rate_rps: 1_200.0 },
            rate_schedule: Vec::new(),
            input: LengthDist::Lognormal { median: 1_024.0, sigma: 1.0, min: 1, max: 16_384 },
            output: LengthDist::Lognormal { median: 128.0, sigma: 0.8, min: 1, max: 2_048 },
            prefix: Some(PrefixGroups { groups: 32, tokens: 512, share: 0.5 }),
            long: None,
            long_output: None,
        }
    }

    /// Checks every field; the error names the first bad key, like `arrival.rate_rps`.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        self.arrival.validate("arrival")?;
        let mut prev_at_s = None;
        for (i, step) in self.rate_schedule.iter().enumerate() {
            if !(step.at_s.is_finite() && step.at_s >= 0.0) {
                return Err(invalid(format!("rate_schedule[{i}].at_s"), format!("must be >= 0 (got {})", step.at_s)));
            }
            if let Some(prev) = prev_at_s {
                if step.at_s <= prev {
                    let reason = format!("must be after the previous step's {prev} (got {})", step.at_s);
                    return Err(invalid(format!("rate_schedule[{i}].at_s"), reason));
                }
            }
            if !(step.scale.is_finite() && step.scale >= 0.0) {
                let reason = format!("must be finite and >= 0 (got {})", step.scale);
                return Err(invalid(format!("rate_schedule[{i}].scale"), reason));
            }
            prev_at_s = Some(step.at_s);
        }
        self.input.validate("input", 1)?;
        if let Some(l) = &self.long {
            l.input.validate("long.input", 1)?;
            if !(0.0..=1.0).contains(&l.share) {
                return Err(invalid("long.share", format!("must be in [0, 1] (got {})", l.share)));
            }
        }
        self.output.validate("output", 0)?;
        if let Some(l) = &self.long_output {
            l.output.validate("long_output.output", 0)?;
            if !(0.0..=1.0).contains(&l.share) {
                return Err(invalid("long_output.share", format!("must be in [0, 1] (got {})", l.share)));
            }
            for (key, bound) in [("long_output.from_s", l.from_s), ("long_output.until_s", l.until_s)] {
                if let Some(s) = bound.filter(|s| !(s.is_finite() && *s >= 0.0)) {
                    return Err(invalid(key, format!("must be >= 0 (got {s})")));
                }
            }
            if let (Some(from), Some(until)) = (l.from_s, l.until_s) {
                if until <= from {
                    return Err(invalid("long_output.until_s", format!("must be after from_s {from} (got {until})")));
                }
            }
        }
        if let Some(p) = &self.prefix {
            if p.groups == 0 {
                return Err(invalid("prefix.groups", "must be at least 1".into()));
            }
            if p.tokens == 0 {
                return Err(invalid("prefix.tokens", "must be at least 1".into()));
            }
            if !(0.0..=1.0).contains(&p.share) {
                return Err(invalid("prefix.share", format!("must be in [0, 1] (got {})", p.share)));
            }
        }
        Ok(())
    }
}

impl LengthDist {
    pub(super) fn validate(&self, key: &str, least: u32) -> Result<(), WorkloadError> {
        let (min, max) = match *self {
            LengthDist::Constant { tokens } => (tokens, tokens),
            LengthDist::Uniform { min, max } => (min, max),
            LengthDist::Lognormal { median, sigma, min, max } => {
                if !(median.is_finite() && median > 0.0) {
                    return Err(invalid(format!("{key}.median"), format!("must be finite and > 0 (got {median})")));
                }
                if !(sigma.is_finite() && sigma >= 0.0) {
                    return Err(invalid(format!("{key}.sigma"), format!("must be finite and >= 0 (got {sigma})")));
                }
                (min, max)
            }
        };
        let min_key = if matches!(self, LengthDist::Constant { .. }) { "tokens" } else { "min" };
        if min < least {
            return Err(invalid(format!("{key}.{min_key}"), format!("must be at least {least} (got {min})")));
        }
        if min > max {
            return Err(invalid(format!("{key}.max"), format!("must be >= min {min} (got {max})")));
        }
        Ok(())
    }
}

fn positive(key: &str, value: f64) -> Result<(), WorkloadError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(invalid(key, format!("must be finite and > 0 (got {value})")))
    }
}

pub(super) fn invalid(key: impl Into<String>, reason: String) -> WorkloadError {
    WorkloadError::Config { key: key.into(), reason }
}

/// Builds the generator after validating `cfg` and `opts`.
pub fn synthetic(cfg: &SyntheticConfig, opts: &WorkloadOptions) -> Result<Box<dyn Workload>, WorkloadError> {
    opts.validate()?;
    cfg.validate()?;
    // The constructors below cannot fail on a validated config; the errors are kept anyway
    // rather than unwrapped.
    let gaps = Gaps::new(&cfg.arrival, "arrival")?;
    let mut steps: Vec<(f64, f64)> = cfg.rate_schedule.iter().map(|s| (s.at_s, s.scale)).collect();
    if steps.first().is_none_or(|&(at_s, _)| at_s > 0.0) {
        steps.insert(0, (0.0, 1.0));
    }
    Ok(Box::new(Synthetic {
        remaining: cfg.requests,
        index: 0,
        gaps,
        clock: Clock { steps, step: 0, t_s: 0.0 },
        input: Lengths::new(&cfg.input, "input")?,
        long: match &cfg.long {
            Some(l) => Some((l.share, Lengths::new(&l.input, "long.input")?)),
            None => None,
        },
        output: Lengths::new(&cfg.output, "output")?,
        long_output: match &cfg.long_output {
            Some(l) => Some((*l, Lengths::new(&l.output, "long_output.output")?)),
            None => None,
        },
        prefix: cfg.prefix,
        arrival_rng: ChaCha8Rng::seed_from_u64(mix64(opts.seed ^ ARRIVAL_TAG)),
        request_rng: ChaCha8Rng::seed_from_u64(mix64(opts.seed ^ REQUEST_TAG)),
        salt: mix64(opts.seed ^ HASH_TAG),
        block_size: opts.block_size,
        rate_scale: opts.rate_scale,
    }))
}

/// Tags separating the sub-seeds drawn from one seed (ASCII of their role).
const ARRIVAL_TAG: u64 = 0x7379_6e5f_6172_7276;
const REQUEST_TAG: u64 = 0x7379_6e5f_7265_7173;
const HASH_TAG: u64 = 0x7379_6e5f_6861_7368;
/// Keep group and request hash bases apart.
const GROUP_TAG: u64 = 0x6772_6f75_7000_0000;
const UNIQUE_TAG: u64 = 0x756e_6971_7565_0000;
/// Spreads consecutive indices over the 64 bits before mixing.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

struct Synthetic {
    /// Requests still to generate.
    remaining: u64,
    /// 0-based index of the next request; names its unique blocks.
    index: u64,
    gaps: Gaps,
    clock: Clock,
    input: Lengths,
    /// Share and lengths of the long prompts.
    long: Option<(f64, Lengths)>,
    output: Lengths,
    /// The long outputs' window and share, and their lengths.
    long_output: Option<(LongOutputs, Lengths)>,
    prefix: Option<PrefixGroups>,
    /// Draws inter-arrival gaps only.
    arrival_rng: ChaCha8Rng,
    /// Draws lengths and prefix groups only.
    request_rng: ChaCha8Rng,
    /// Seed-derived base of every block hash key.
    salt: u64,
    block_size: u32,
    rate_scale: f64,
}

impl Workload for Synthetic {
    fn next_arrival(&mut self, mut buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        if self.remaining == 0 {
            return Ok(None);
        }
        let work_s = self.gaps.sample(&mut self.arrival_rng);
        let Some(t_s) = self.clock.advance(work_s) else {
            self.remaining = 0;
            return Ok(None);
        };
        self.remaining -= 1;
        let index = self.index;
        self.index += 1;

        let rng = &mut self.request_rng;
        let mut own_tokens = self.input.sample(rng);
        if let Some((share, long)) = &self.long {
            if rng.random::<f64>() < *share {
                own_tokens = long.sample(rng);
            }
        }
        let mut output_tokens = self.output.sample(rng);
        if let Some((l, long)) = &self.long_output {
            // Both drawn for every request, in the window or not, so that the window and the
            // share change only the requests they turn long.
            let (u, long_tokens) = (rng.random::<f64>(), long.sample(rng));
            if u < l.share && l.covers(t_s) {
                output_tokens = long_tokens;
            }
        }
        let group = match self.prefix {
            Some(p) if rng.random::<f64>() < p.share => Some((rng.random_range(0..p.groups), p.tokens)),
            _ => None,
        };

        let prefix_tokens = group.map_or(0, |(_, tokens)| tokens);
        let prompt_tokens = prefix_tokens.saturating_add(own_tokens);
        let blocks = u64::from(prompt_tokens / self.block_size);
        let shared_blocks = u64::from(prefix_tokens / self.block_size);
        buf.clear();
        buf.reserve(blocks as usize);
        let mut hash = BlockHash::ROOT;
        if let Some((g, _)) = group {
            let base = mix64(self.salt ^ GROUP_TAG ^ u64::from(g).wrapping_mul(GOLDEN));
            for j in 0..shared_blocks {
                hash = hash.chain(mix64(base.wrapping_add(j)));
                buf.push(hash);
            }
        }
        let base = mix64(self.salt ^ UNIQUE_TAG ^ index.wrapping_mul(GOLDEN));
        for j in shared_blocks..blocks {
            hash = hash.chain(mix64(base.wrapping_add(j)));
            buf.push(hash);
        }

        // `as` saturates, so an unbounded time becomes the last representable one.
        let at = Time((t_s * 1e6 / self.rate_scale).round() as u64);
        Ok(Some(Arrival { at, prompt_tokens, output_tokens, block_hashes: buf, service: Default::default() }))
    }
}

/// Inter-arrival gaps in seconds at the base rate.
pub(super) enum Gaps {
    Exp(Exp<f64>),
    Gamma(Gamma<f64>),
}

impl Gaps {
    /// The gaps of a validated `process` (`key` names it in errors).
    pub(super) fn new(process: &ArrivalProcess, key: &str) -> Result<Gaps, WorkloadError> {
        Ok(match *process {
            ArrivalProcess::Poisson { rate_rps } => {
                Gaps::Exp(Exp::new(rate_rps).map_err(|e| invalid(format!("{key}.rate_rps"), e.to_string()))?)
            }
            ArrivalProcess::Gamma { rate_rps, cv } => {
                let shape = 1.0 / (cv * cv);
                let scale = cv * cv / rate_rps;
                Gaps::Gamma(Gamma::new(shape, scale).map_err(|e| invalid(format!("{key}.cv"), e.to_string()))?)
            }
        })
    }

    pub(super) fn sample(&self, rng: &mut ChaCha8Rng) -> f64 {
        match self {
            Gaps::Exp(d) => d.sample(rng),
            Gaps::Gamma(d) => d.sample(rng),
        }
    }
}

impl ArrivalProcess {
    /// Checks the rate (and burstiness); errors name `key.rate_rps` or `key.cv`.
    pub(super) fn validate(&self, key: &str) -> Result<(), WorkloadError> {
        match *self {
            ArrivalProcess::Poisson { rate_rps } => positive(&format!("{key}.rate_rps"), rate_rps),
            ArrivalProcess::Gamma { rate_rps, cv } => {
                positive(&format!("{key}.rate_rps"), rate_rps)?;
                // Beyond 100 the gamma shape (1/cv²) is so small that nearly all gaps are 0.
                if !(cv.is_finite() && cv > 0.0 && cv <= 100.0) {
                    return Err(invalid(format!("{key}.cv"), format!("must be in (0, 100] (got {cv})")));
                }
                Ok(())
            }
        }
    }
}

/// Virtual time through the rate schedule.
struct Clock {
    /// `(at_s, scale)` in increasing `at_s`, the first at 0.
    steps: Vec<(f64, f64)>,
    /// Index of the step `t_s` is in.
    step: usize,
    /// The last arrival's time in seconds, before `rate_scale`.
    t_s: f64,
}

impl Clock {
    /// Spends `work_s` seconds of base-rate work from the last arrival and returns the next
    /// arrival's time; `None` once a last step of scale 0 is reached.
    fn advance(&mut self, mut work_s: f64) -> Option<f64> {
        // Each pass either returns or moves to the next step: bounded by the schedule's length.
        while let Some(&(_, scale)) = self.steps.get(self.step) {
            let end_s = self.steps.get(self.step + 1).map_or(f64::INFINITY, |&(at_s, _)| at_s);
            if scale > 0.0 {
                let t_s = self.t_s + work_s / scale;
                if t_s <= end_s {
                    self.t_s = t_s;
                    return Some(t_s);
                }
                work_s = (work_s - (end_s - self.t_s) * scale).max(0.0);
            } else if end_s.is_infinite() {
                return None;
            }
            self.t_s = end_s;
            self.step += 1;
        }
        None
    }
}

/// A ready-to-sample [`LengthDist`].
pub(super) enum Lengths {
    Constant(u32),
    Uniform(u32, u32),
    Lognormal(LogNormal<f64>, u32, u32),
}

impl Lengths {
    pub(super) fn new(dist: &LengthDist, key: &str) -> Result<Lengths, WorkloadError> {
        Ok(match *dist {
            LengthDist::Constant { tokens } => Lengths::Constant(tokens),
            LengthDist::Uniform { min, max } => Lengths::Uniform(min, max),
            LengthDist::Lognormal { median, sigma, min, max } => {
                let d =
                    LogNormal::new(median.ln(), sigma).map_err(|e| invalid(format!("{key}.sigma"), e.to_string()))?;
                Lengths::Lognormal(d, min, max)
            }
        })
    }

    pub(super) fn sample(&self, rng: &mut ChaCha8Rng) -> u32 {
        match *self {
            Lengths::Constant(tokens) => tokens,
            Lengths::Uniform(min, max) => rng.random_range(min..=max),
            Lengths::Lognormal(ref d, min, max) => {
                let x = d.sample(rng).round();
                // Written so that a NaN lands on `min`.
                if x >= f64::from(max) {
                    max
                } else if x >= f64::from(min) {
                    x as u32
                } else {
                    min
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(seed: u64) -> WorkloadOptions {
        WorkloadOptions { seed, ..WorkloadOptions::default() }
    }

    fn generate(cfg: &SyntheticConfig, opts: &WorkloadOptions) -> Vec<Arrival> {
        let mut w = synthetic(cfg, opts).unwrap_or_else(|e| panic!("{e}"));
        let mut out = Vec::new();
        while let Some(a) = w.next_arrival(Vec::new()).unwrap_or_else(|e| panic!("{e}")) {
            out.push(a);
        }
        out
    }

    fn small(requests: u64) -> SyntheticConfig {
        SyntheticConfig { requests, ..SyntheticConfig::bench_default() }
    }

    fn config_error(cfg: &SyntheticConfig) -> String {
        cfg.validate().err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn the_documented_toml_parses() {
        let text = r#"
            requests = 1000000
            arrival = { kind = "gamma", rate_rps = 1500.0, cv = 3.0 }
            rate_schedule = [ { at_s = 0.0, scale = 1.0 }, { at_s = 60.0, scale = 2.0 } ]
            input = { kind = "lognormal", median = 1024, sigma = 1.0, min = 1, max = 32768 }
            output = { kind = "uniform", min = 1, max = 4096 }
            prefix = { groups = 16, tokens = 1024, share = 0.6 }
        "#;
        let cfg: SyntheticConfig = toml::from_str(text).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cfg.arrival, ArrivalProcess::Gamma { rate_rps: 1500.0, cv: 3.0 });
        assert_eq!(cfg.input, LengthDist::Lognormal { median: 1024.0, sigma: 1.0, min: 1, max: 32768 });
        assert_eq!(cfg.rate_schedule[1], RateStep { at_s: 60.0, scale: 2.0 });
        assert!(cfg.validate().is_ok());
        let round_trip: SyntheticConfig =
            toml::from_str(&toml::to_string(&cfg).unwrap_or_default()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(round_trip, cfg);

        let minimal = "requests = 5\narrival = { kind = \"poisson\", rate_rps = 10 }\n\
                       input = { kind = \"constant\", tokens = 512 }\noutput = { kind = \"constant\", tokens = 0 }\n";
        let cfg: SyntheticConfig = toml::from_str(minimal).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((cfg.rate_schedule.len(), cfg.prefix), (0, None));
    }

    #[test]
    fn unknown_keys_and_kinds_are_rejected() {
        let base = "requests = 5\ninput = { kind = \"constant\", tokens = 512 }\noutput = { kind = \"constant\", tokens = 1 }\n";
        let typo = format!("{base}arrival = {{ kind = \"poisson\", rate = 10.0 }}\n");
        let err = toml::from_str::<SyntheticConfig>(&typo).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("unknown field `rate`"), "{err}");
        let kind = format!("{base}arrival = {{ kind = \"weibull\", rate_rps = 10.0 }}\n");
        let err = toml::from_str::<SyntheticConfig>(&kind).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("unknown variant `weibull`"), "{err}");
        let top = format!("{base}arrival = {{ kind = \"poisson\", rate_rps = 10.0 }}\nseed = 3\n");
        let err = toml::from_str::<SyntheticConfig>(&top).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("unknown field `seed`"), "{err}");
    }

    #[test]
    fn invalid_configs_name_the_key() {
        let check = |edit: &dyn Fn(&mut SyntheticConfig), expected: &str| {
            let mut cfg = SyntheticConfig::bench_default();
            edit(&mut cfg);
            assert_eq!(config_error(&cfg), format!("synthetic workload: {expected}"));
        };
        check(
            &|c| c.arrival = ArrivalProcess::Poisson { rate_rps: 0.0 },
            "`arrival.rate_rps` must be finite and > 0 (got 0)",
        );
        check(
            &|c| c.arrival = ArrivalProcess::Gamma { rate_rps: 1.0, cv: 0.0 },
            "`arrival.cv` must be in (0, 100] (got 0)",
        );
        check(
            &|c| c.rate_schedule = vec![RateStep { at_s: 5.0, scale: 1.0 }, RateStep { at_s: 5.0, scale: 2.0 }],
            "`rate_schedule[1].at_s` must be after the previous step's 5 (got 5)",
        );
        check(
            &|c| c.rate_schedule = vec![RateStep { at_s: 0.0, scale: -1.0 }],
            "`rate_schedule[0].scale` must be finite and >= 0 (got -1)",
        );
        check(&|c| c.input = LengthDist::Uniform { min: 10, max: 5 }, "`input.max` must be >= min 10 (got 5)");
        check(&|c| c.input = LengthDist::Constant { tokens: 0 }, "`input.tokens` must be at least 1 (got 0)");
        check(
            &|c| c.output = LengthDist::Lognormal { median: 100.0, sigma: -1.0, min: 0, max: 10 },
            "`output.sigma` must be finite and >= 0 (got -1)",
        );
        check(
            &|c| c.output = LengthDist::Lognormal { median: f64::NAN, sigma: 1.0, min: 0, max: 10 },
            "`output.median` must be finite and > 0 (got NaN)",
        );
        check(
            &|c| c.prefix = Some(PrefixGroups { groups: 0, tokens: 1, share: 0.5 }),
            "`prefix.groups` must be at least 1",
        );
        check(
            &|c| c.prefix = Some(PrefixGroups { groups: 1, tokens: 1, share: 1.5 }),
            "`prefix.share` must be in [0, 1] (got 1.5)",
        );
        let bad_opts = WorkloadOptions { rate_scale: 0.0, ..WorkloadOptions::default() };
        assert!(synthetic(&SyntheticConfig::bench_default(), &bad_opts).is_err());
    }

    #[test]
    fn the_same_seed_gives_the_same_requests_and_another_seed_others() {
        let cfg = small(2_000);
        let a = generate(&cfg, &opts(7));
        assert_eq!(a, generate(&cfg, &opts(7)));
        let b = generate(&cfg, &opts(8));
        assert_eq!(a.len(), b.len());
        assert_ne!(a.iter().map(|r| r.at).collect::<Vec<_>>(), b.iter().map(|r| r.at).collect::<Vec<_>>());
        assert_ne!(
            a.iter().map(|r| r.prompt_tokens).collect::<Vec<_>>(),
            b.iter().map(|r| r.prompt_tokens).collect::<Vec<_>>()
        );
        // Shared prefixes are seed-specific too: no block hash is common to both runs.
        let hashes: std::collections::HashSet<_> = a.iter().flat_map(|r| r.block_hashes.iter().copied()).collect();
        assert!(b.iter().flat_map(|r| &r.block_hashes).all(|h| !hashes.contains(h)));
    }

    #[test]
    fn changing_the_arrival_process_keeps_the_requests() {
        let poisson = small(500);
        let gamma = SyntheticConfig { arrival: ArrivalProcess::Gamma { rate_rps: 300.0, cv: 2.0 }, ..small(500) };
        let contents = |cfg| {
            generate(cfg, &opts(3))
                .into_iter()
                .map(|a| (a.prompt_tokens, a.output_tokens, a.block_hashes))
                .collect::<Vec<_>>()
        };
        assert_eq!(contents(&poisson), contents(&gamma));
    }

    #[test]
    fn bench_default_arrives_at_about_1200_per_second_in_order() {
        let arrivals = generate(&small(100_000), &opts(1));
        assert_eq!(arrivals.len(), 100_000);
        assert!(arrivals.windows(2).all(|p| p[0].at <= p[1].at));
        let rate = 100_000.0 / arrivals[99_999].at.as_secs_f64();
        assert!((1_180.0..1_220.0).contains(&rate), "{rate}");
        for a in &arrivals {
            assert_eq!(a.block_hashes.len(), (a.prompt_tokens / 16) as usize);
            assert!((1..=2_048).contains(&a.output_tokens));
            assert!(a.prompt_tokens <= 16_384 + 512);
        }
        let mut prompts: Vec<u32> = arrivals.iter().map(|a| a.prompt_tokens).collect();
        prompts.sort_unstable();
        // Half the prompts carry a 512-token prefix on top of a median-1024 own part.
        assert!((1_200..1_500).contains(&prompts[50_000]), "{}", prompts[50_000]);
    }

    #[test]
    fn gamma_arrivals_have_the_configured_rate_and_burstiness() {
        let cfg = SyntheticConfig { arrival: ArrivalProcess::Gamma { rate_rps: 1_000.0, cv: 3.0 }, ..small(100_000) };
        let at: Vec<f64> = generate(&cfg, &opts(5)).iter().map(|a| a.at.as_secs_f64()).collect();
        let gaps: Vec<f64> = at.windows(2).map(|p| p[1] - p[0]).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean) * (g - mean)).sum::<f64>() / gaps.len() as f64;
        assert!((0.95e-3..1.05e-3).contains(&mean), "{mean}");
        let cv = var.sqrt() / mean;
        assert!((2.7..3.3).contains(&cv), "{cv}");
    }

    #[test]
    fn a_rate_schedule_step_doubles_the_arrival_rate() {
        let cfg = SyntheticConfig {
            arrival: ArrivalProcess::Poisson { rate_rps: 1_000.0 },
            rate_schedule: vec![RateStep { at_s: 10.0, scale: 2.0 }, RateStep { at_s: 20.0, scale: 0.0 }],
            ..small(1_000_000)
        };
        let arrivals = generate(&cfg, &opts(2));
        let before = arrivals.iter().filter(|a| a.at.as_secs_f64() < 10.0).count() as f64;
        let after = arrivals.len() as f64 - before;
        assert!((9_700.0..10_300.0).contains(&before), "{before}");
        assert!((19_500.0..20_500.0).contains(&after), "{after}");
        // The last step has scale 0: the workload ends at 20 s instead of after 1M requests.
        assert!(arrivals.iter().all(|a| a.at.as_secs_f64() <= 20.0));
    }

    #[test]
    fn a_schedule_starting_late_runs_at_scale_one_before_it() {
        let mut clock = Clock { steps: vec![(0.0, 1.0), (1.0, 0.0), (3.0, 4.0)], step: 0, t_s: 0.0 };
        assert_eq!(clock.advance(0.5), Some(0.5));
        // 0.5 s of work left at scale 1, then a pause, then 1 s of work at scale 4.
        assert_eq!(clock.advance(1.5), Some(3.25));
        assert_eq!(clock.advance(4.0), Some(4.25));
    }

    #[test]
    fn a_rate_scale_of_two_halves_synthetic_times() {
        let one = generate(&small(1_000), &opts(9));
        let two = generate(&small(1_000), &WorkloadOptions { rate_scale: 2.0, ..opts(9) });
        for (a, b) in one.iter().zip(&two) {
            assert!(a.at.0.abs_diff(b.at.0 * 2) <= 1, "{:?} {:?}", a.at, b.at);
            assert_eq!(a.block_hashes, b.block_hashes);
        }
    }

    #[test]
    fn shared_prefix_requests_share_the_prefix_blocks_of_their_group() {
        let cfg = SyntheticConfig {
            requests: 200,
            input: LengthDist::Constant { tokens: 100 },
            output: LengthDist::Constant { tokens: 1 },
            prefix: Some(PrefixGroups { groups: 2, tokens: 1_000, share: 1.0 }),
            ..SyntheticConfig::bench_default()
        };
        let arrivals = generate(&cfg, &opts(4));
        // 1,000 prefix tokens hold 62 full 16-token blocks; block 62 straddles into the own part.
        let firsts: std::collections::BTreeSet<_> = arrivals.iter().map(|a| a.block_hashes[61]).collect();
        assert_eq!(firsts.len(), 2);
        let own: std::collections::BTreeSet<_> = arrivals.iter().map(|a| a.block_hashes[62]).collect();
        assert_eq!(own.len(), 200);
        assert!(arrivals.iter().all(|a| a.prompt_tokens == 1_100 && a.block_hashes.len() == 68));

        let none = SyntheticConfig { prefix: Some(PrefixGroups { groups: 2, tokens: 1_000, share: 0.0 }), ..cfg };
        let arrivals = generate(&none, &opts(4));
        let firsts: std::collections::BTreeSet<_> = arrivals.iter().map(|a| a.block_hashes[0]).collect();
        assert_eq!(firsts.len(), 200);
    }

    #[test]
    fn lengths_stay_within_their_bounds() {
        let cfg = SyntheticConfig {
            input: LengthDist::Lognormal { median: 1_000.0, sigma: 3.0, min: 100, max: 2_000 },
            output: LengthDist::Uniform { min: 3, max: 5 },
            prefix: None,
            ..small(10_000)
        };
        let arrivals = generate(&cfg, &opts(6));
        assert!(arrivals.iter().all(|a| (100..=2_000).contains(&a.prompt_tokens)));
        assert!(arrivals.iter().any(|a| a.prompt_tokens == 100) && arrivals.iter().any(|a| a.prompt_tokens == 2_000));
        let outputs: std::collections::BTreeSet<_> = arrivals.iter().map(|a| a.output_tokens).collect();
        assert_eq!(outputs.into_iter().collect::<Vec<_>>(), [3, 4, 5]);
    }

    #[test]
    fn a_long_output_burst_changes_only_the_requests_in_its_window() {
        let mut cfg = small(2_000);
        cfg.arrival = ArrivalProcess::Poisson { rate_rps: 1_000.0 };
        cfg.output = LengthDist::Uniform { min: 1, max: 100 };
        let burst = LongOutputs {
            share: 0.5,
            output: LengthDist::Constant { tokens: 20_000 },
            from_s: Some(0.5),
            until_s: Some(1.0),
        };
        let base = generate(
            &SyntheticConfig { long_output: Some(LongOutputs { share: 0.0, ..burst }), ..cfg.clone() },
            &opts(3),
        );
        let with = generate(&SyntheticConfig { long_output: Some(burst), ..cfg.clone() }, &opts(3));
        assert_eq!(base.len(), with.len());
        let mut long = 0;
        for (a, b) in base.iter().zip(&with) {
            assert_eq!((a.at, a.prompt_tokens, &a.block_hashes), (b.at, b.prompt_tokens, &b.block_hashes));
            if b.output_tokens != a.output_tokens {
                assert_eq!(b.output_tokens, 20_000);
                assert!((500_000..1_000_000).contains(&b.at.0), "long only in the window: {:?}", b.at);
                long += 1;
            }
        }
        // About half of the ~500 requests in the window.
        assert!((150..350).contains(&long), "{long}");
        let bad = SyntheticConfig { long_output: Some(LongOutputs { until_s: Some(0.2), ..burst }), ..cfg };
        assert!(config_error(&bad).contains("long_output.until_s"), "{}", config_error(&bad));
    }

    #[test]
    fn zero_requests_is_an_empty_workload() {
        assert!(generate(&small(0), &opts(0)).is_empty());
    }
}
