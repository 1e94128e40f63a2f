//! A workload whose shape shifts: phases of Poisson arrivals, each with its own rate and its
//! own scaling of prompt and output lengths, the (prompt, output) pairs drawn from a length
//! table read from a trace (the Azure conversation trace's `ContextTokens,GeneratedTokens`,
//! or any CSV whose first two columns are prompt and output tokens).
//!
//! ```toml
//! [workload.phased]
//! lengths = "../traces/azure-llm-2023-conv.csv"   # relative to the scenario
//! phases = [
//!   { name = "base",        duration_s = 900, rate_rps = 10, input_scale = 1, output_scale = 1 },
//!   { name = "long inputs", duration_s = 900, rate_rps = 10, input_scale = 4, output_scale = 1 },
//! ]
//! ```
//!
//! Or the phases come from the ServeGen aggregate's windows (see [`super::servegen`]): the
//! rate and the length scales follow a slice of one model's 10-minute windows, while the
//! (prompt, output) pairs still come from the table:
//!
//! ```toml
//! [workload.phased]
//! lengths = "../traces/azure-llm-2023-conv.csv"
//! servegen = { path = "../traces/servegen-aggregate.csv", model = "m-large", from_s = 0, to_s = 14400, rate_rps = 60, window_s = 120 }
//! ```
//!
//! Each request draws one row of the table uniformly (keeping the trace's joint distribution
//! of prompt and output) and multiplies each length by its phase's scale, rounded, clamped
//! to `[1, max_tokens]`. Prompts share no prefix (every block hash is unique). The table is
//! held in memory (8 bytes a row: the Azure trace's 19,366 rows take 155 KB); arrivals are
//! drawn one at a time. All draws come from ChaCha streams derived from the seed.

use super::lines::Lines;
use super::servegen::ServeGenShape;
use super::{Arrival, Workload, WorkloadError, WorkloadOptions};
use engine::ids::{derive_seed, mix64};
use engine::{BlockHash, Time};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Rows of a length table read at most (a bound on memory for a mistaken path).
const MAX_ROWS: usize = 10_000_000;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhasedConfig {
    /// CSV of (prompt tokens, output tokens) rows, with a header line; a timestamp first
    /// column (Azure's layout) is skipped.
    pub lengths: PathBuf,
    /// Written phases; or, from `servegen`, one per window of its slice ([`PhasedConfig::resolve`]).
    #[serde(default)]
    pub phases: Vec<Phase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub servegen: Option<ServeGenShape>,
    /// Longest prompt or output after scaling [default: 32768].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Phase {
    #[serde(default)]
    pub name: String,
    pub duration_s: f64,
    /// 0 is a quiet phase, without arrivals.
    pub rate_rps: f64,
    #[serde(default = "one")]
    pub input_scale: f64,
    #[serde(default = "one")]
    pub output_scale: f64,
}

fn one() -> f64 {
    1.0
}

impl PhasedConfig {
    /// Start of every phase after the first, in seconds at the configured rates.
    pub fn shifts_s(&self) -> Vec<f64> {
        let mut t = 0.0;
        let mut out = Vec::new();
        for p in &self.phases {
            out.push(t);
            t += p.duration_s;
        }
        out.into_iter().skip(1).collect()
    }

    /// What the workload is, in a few words, for the line a run starts with.
    pub fn describe(&self) -> String {
        let shape = match &self.servegen {
            Some(g) => format!(" from {} `{}` [{}, {}) s", g.path.display(), g.model, g.from_s, g.to_s),
            None => String::new(),
        };
        format!("phased ({} phases{shape} over {})", self.phases.len(), self.lengths.display())
    }

    /// Takes relative paths as relative to `base` (the scenario file's folder).
    pub fn relative_to(&mut self, base: &Path) {
        let paths = [Some(&mut self.lengths), self.servegen.as_mut().map(|s| &mut s.path)];
        for path in paths.into_iter().flatten().filter(|p| p.is_relative()) {
            *path = base.join(&*path);
        }
    }

    /// The config with its phases written out: a ServeGen slice becomes one phase per window
    /// (reading the aggregate and the length table for its means); then validated.
    pub fn resolve(&self) -> Result<PhasedConfig, WorkloadError> {
        let mut out = self.clone();
        if let Some(shape) = &self.servegen {
            if !self.phases.is_empty() {
                return Err(invalid("servegen", "replaces `phases`: give one of them"));
            }
            out.phases = shape.phases(mean_lengths(&read_lengths(&self.lengths)?))?;
        }
        out.validate()?;
        Ok(out)
    }

    pub fn validate(&self) -> Result<(), WorkloadError> {
        if self.phases.is_empty() {
            return Err(invalid("phases", "name at least one phase"));
        }
        for (i, p) in self.phases.iter().enumerate() {
            let checks = [
                ("duration_s", p.duration_s, false),
                ("rate_rps", p.rate_rps, true),
                ("input_scale", p.input_scale, false),
                ("output_scale", p.output_scale, false),
            ];
            for (key, v, zero_ok) in checks {
                if !(v.is_finite() && (v > 0.0 || zero_ok && v == 0.0)) {
                    let bound = if zero_ok { ">= 0" } else { "> 0" };
                    return Err(invalid(format!("phases[{i}].{key}"), format!("must be finite and {bound} (got {v})")));
                }
            }
        }
        if self.max_tokens == Some(0) {
            return Err(invalid("max_tokens", "must be at least 1"));
        }
        Ok(())
    }
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> WorkloadError {
    WorkloadError::Config { key: format!("phased.{}", key.into()), reason: reason.into() }
}

/// Reads the (prompt, output) rows of a length table.
fn read_lengths(path: &Path) -> Result<Vec<(u32, u32)>, WorkloadError> {
    let mut lines = Lines::open(path)?;
    let mut rows = Vec::new();
    let mut header = true;
    while let Some((n, line)) = lines.next_line()? {
        if header {
            header = false;
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        let cols: Vec<&str> = line.split(',').map(str::trim).collect();
        // Azure's layout has a timestamp first; lengths-only tables start with the prompt.
        let start = usize::from(cols.first().is_some_and(|c| c.contains(['-', ':'])));
        let parse = |k: usize, what: &str| -> Result<u32, String> {
            let c = cols.get(start + k).ok_or_else(|| format!("missing the {what} column"))?;
            c.parse::<u32>().map_err(|_| format!("{what} `{c}` is not a token count"))
        };
        let row = parse(0, "prompt tokens").and_then(|p| Ok((p, parse(1, "output tokens")?)));
        let row = match row {
            Ok(row) if rows.len() < MAX_ROWS => row,
            Ok(_) => return Err(lines.error(n, format!("more than {MAX_ROWS} rows"))),
            Err(reason) => return Err(lines.error(n, reason)),
        };
        rows.push((row.0.max(1), row.1));
    }
    if rows.is_empty() {
        return Err(WorkloadError::Unsupported { path: path.to_path_buf(), reason: "no length rows".into() });
    }
    Ok(rows)
}

/// Mean prompt and output tokens of a length table.
fn mean_lengths(rows: &[(u32, u32)]) -> (f64, f64) {
    let n = rows.len().max(1) as f64;
    let sum = |f: fn(&(u32, u32)) -> u32| rows.iter().map(|r| f64::from(f(r))).sum::<f64>() / n;
    (sum(|r| r.0), sum(|r| r.1))
}

struct Phased {
    rows: Vec<(u32, u32)>,
    phases: Vec<Phase>,
    max_tokens: u32,
    phase: usize,
    /// Seconds since the start (before rate scaling), and the current phase's end.
    t_s: f64,
    phase_end_s: f64,
    rate_scale: f64,
    block_size: u32,
    seed: u64,
    index: u64,
    gaps: ChaCha8Rng,
    draws: ChaCha8Rng,
}

/// Opens a phased workload (see the module doc).
pub fn phased(cfg: &PhasedConfig, opts: &WorkloadOptions) -> Result<Box<dyn Workload>, WorkloadError> {
    opts.validate()?;
    cfg.validate()?;
    let rows = read_lengths(&cfg.lengths)?;
    Ok(Box::new(Phased {
        rows,
        phases: cfg.phases.clone(),
        max_tokens: cfg.max_tokens.unwrap_or(32_768),
        phase: 0,
        t_s: 0.0,
        phase_end_s: cfg.phases[0].duration_s,
        rate_scale: opts.rate_scale,
        block_size: opts.block_size,
        seed: opts.seed,
        index: 0,
        gaps: ChaCha8Rng::seed_from_u64(derive_seed(opts.seed, "phased-gaps", 0)),
        draws: ChaCha8Rng::seed_from_u64(derive_seed(opts.seed, "phased-draws", 0)),
    }))
}

impl Workload for Phased {
    fn next_arrival(&mut self, mut buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        // A gap is drawn at the current phase's rate; one that crosses into the next phase is
        // redrawn from the boundary at the new rate (memoryless, so this is exact for Poisson).
        loop {
            let Some(p) = self.phases.get(self.phase) else { return Ok(None) };
            let gap = match p.rate_rps {
                0.0 => f64::INFINITY,
                rate => Exp::new(rate).map_err(|e| invalid("rate_rps", e.to_string()))?.sample(&mut self.gaps),
            };
            if self.t_s + gap < self.phase_end_s {
                self.t_s += gap;
                break;
            }
            self.t_s = self.phase_end_s;
            self.phase += 1;
            if let Some(next) = self.phases.get(self.phase) {
                self.phase_end_s += next.duration_s;
            }
        }
        let p = &self.phases[self.phase];
        let (prompt, output) = self.rows[self.draws.random_range(0..self.rows.len())];
        let scale = |n: u32, s: f64| ((f64::from(n) * s).round() as u32).clamp(1, self.max_tokens);
        let prompt_tokens = scale(prompt, p.input_scale);
        let output_tokens = if output == 0 { 0 } else { scale(output, p.output_scale) };
        buf.clear();
        let mut h = BlockHash::ROOT;
        let key = mix64(self.seed ^ mix64(self.index.wrapping_add(0x9e37_79b9_7f4a_7c15)));
        for i in 0..prompt_tokens / self.block_size {
            h = h.chain(key ^ u64::from(i));
            buf.push(h);
        }
        self.index += 1;
        Ok(Some(Arrival {
            at: Time((self.t_s / self.rate_scale * 1e6).round() as u64),
            prompt_tokens,
            output_tokens,
            block_hashes: buf,
            service: Default::default(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::test_util;
    use engine::Dur;

    fn config(phases: Vec<Phase>) -> PhasedConfig {
        PhasedConfig { lengths: test_util::AZURE_CONVERSATION.into(), phases, servegen: None, max_tokens: None }
    }

    fn phase(duration_s: f64, rate_rps: f64, input_scale: f64, output_scale: f64) -> Phase {
        Phase { name: String::new(), duration_s, rate_rps, input_scale, output_scale }
    }

    fn drain(cfg: &PhasedConfig) -> Vec<Arrival> {
        let mut w = phased(cfg, &WorkloadOptions { seed: 3, ..WorkloadOptions::default() }).unwrap();
        let mut out = Vec::new();
        while let Some(a) = w.next_arrival(Vec::new()).unwrap() {
            out.push(a);
        }
        out
    }

    #[test]
    fn phases_change_rate_and_lengths_at_their_boundaries() {
        let cfg = config(vec![phase(100.0, 10.0, 1.0, 1.0), phase(100.0, 30.0, 4.0, 1.0)]);
        let a = drain(&cfg);
        let (first, second): (Vec<_>, Vec<_>) = a.iter().partition(|a| a.at < Time::from_millis(100_000));
        assert!((800..1200).contains(&first.len()), "{} arrivals at 10/s", first.len());
        assert!((2600..3400).contains(&second.len()), "{} arrivals at 30/s", second.len());
        let mean = |v: &[&Arrival]| v.iter().map(|a| f64::from(a.prompt_tokens)).sum::<f64>() / v.len() as f64;
        assert!(mean(&second) > 3.0 * mean(&first), "inputs grow fourfold");
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
        assert_eq!(cfg.shifts_s(), vec![100.0]);
    }

    #[test]
    fn the_same_seed_gives_the_same_arrivals() {
        let cfg = config(vec![phase(50.0, 20.0, 1.0, 2.0)]);
        assert_eq!(drain(&cfg), drain(&cfg));
    }

    #[test]
    fn bad_phases_and_tables_are_errors_naming_the_key_or_line() {
        let err = config(vec![phase(10.0, -1.0, 1.0, 1.0)]).validate().unwrap_err();
        assert_eq!(err.to_string(), "synthetic workload: `phased.phases[0].rate_rps` must be finite and >= 0 (got -1)");
        let f = test_util::TempTrace::new("phased-bad.csv", "a,b\n10,x\n");
        let cfg = PhasedConfig { lengths: f.path().to_path_buf(), ..config(vec![phase(1.0, 1.0, 1.0, 1.0)]) };
        let err = test_util::first_error(phased(&cfg, &WorkloadOptions::default()));
        assert!(err.contains("line 2: output tokens `x` is not a token count"), "{err}");
    }

    #[test]
    fn a_quiet_phase_has_no_arrivals_and_the_next_starts_on_time() {
        let a =
            drain(&config(vec![phase(10.0, 5.0, 1.0, 1.0), phase(20.0, 0.0, 1.0, 1.0), phase(10.0, 5.0, 1.0, 1.0)]));
        assert!(!a.iter().any(|a| (Time::from_millis(10_000)..Time::from_millis(30_000)).contains(&a.at)));
        assert!(a.iter().any(|a| a.at >= Time::from_millis(30_000)), "the last phase has arrivals");
    }

    #[test]
    fn servegen_phases_carry_its_mean_lengths_over_the_tables_pairs() {
        // Three windows of m-large where its mean prompt grows from 1,112 to 1,305 tokens.
        let servegen = ServeGenShape {
            path: test_util::SERVEGEN_AGGREGATE.into(),
            model: "m-large".into(),
            from_s: 72 * 3600,
            to_s: 72 * 3600 + 2400,
            rate_rps: 100.0,
            window_s: Some(100.0),
        };
        let cfg = PhasedConfig { servegen: Some(servegen), ..config(Vec::new()) }.resolve().expect("resolves");
        assert_eq!(cfg.phases.len(), 4);
        assert_eq!(cfg.shifts_s(), vec![100.0, 200.0, 300.0]);
        let a = drain(&cfg);
        for (k, expected) in [(0, 1112.3), (3, 1305.2)] {
            let start = Time::from_millis(100_000 * k);
            let phase: Vec<_> =
                a.iter().filter(|a| a.at >= start && a.at < start + Dur::from_millis(100_000)).collect();
            let mean = phase.iter().map(|a| f64::from(a.prompt_tokens)).sum::<f64>() / phase.len() as f64;
            assert!((mean / expected - 1.0).abs() < 0.1, "window {k}: mean prompt {mean}, ServeGen {expected}");
        }
        let written = PhasedConfig { phases: vec![phase(1.0, 1.0, 1.0, 1.0)], ..cfg };
        let err = written.resolve().unwrap_err().to_string();
        assert_eq!(err, "synthetic workload: `phased.servegen` replaces `phases`: give one of them");
    }
}
