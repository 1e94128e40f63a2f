//! Calibration: the roofline's efficiency factors fitted to an engine's measured profile.
//!
//! The roofline's shape (what each step reads and computes) comes from the model and the
//! GPU; how close an engine gets to the peaks does not. Given a [`StepProfile`] measured on
//! that engine, [`calibrate`] picks the seven numbers that turn peaks into times —
//! `compute_efficiency` (GEMMs), `attention_efficiency`, `memory_efficiency` (weights),
//! `kv_memory_efficiency`,
//! `step_overhead_us`, `prefill_step_overhead_us` and `sequence_overhead_us` — and the
//! roofline's form (`serial_attention`: attention under the GEMMs or after them) that
//! minimise the squared log error of the predicted step times over the samples (so a 1 ms
//! decode step weighs as much as a 1 s prefill). The fit is a deterministic pattern search in
//! log space: seven parameters, a few dozen samples, a few thousand cheap evaluations per form;
//! the loss is not smooth (the roofline takes a max of compute and memory), which rules out
//! gradient methods and costs a pattern search nothing. Parameters the profile says nothing
//! about (memory utilization, collectives) keep the values they had.

use engine::{StepProfile, PROFILE_FORMAT};

use super::decode_table::DecodeTable;
use super::error::CostError;
use super::gpu::GpuSpec;
use super::model::ModelSpec;
use super::params::{CostParams, Deployment};
use super::roofline::CostModel;

/// Efficiencies are kept above this share (a profile cannot make a term vanish).
const MIN_EFFICIENCY: f64 = 1e-3;
/// Overhead is kept below this (a step slower than a second is not overhead).
const MAX_OVERHEAD_US: f64 = 1e6;
/// The search stops when its step in log space is this small (0.01%).
const TOLERANCE: f64 = 1e-4;
/// Worst-fitting samples a [`Calibration`] lists (a step log has tens of thousands).
pub const FITS_KEPT: usize = 200;
/// Per-sequence overhead is kept below this (10 ms).
const MAX_SEQUENCE_OVERHEAD_US: f64 = 1e4;
/// Where the searches start per sequence, in µs.
const START_SEQUENCE_OVERHEAD_US: f64 = 1.0;
/// Where the searches start: (step overhead, prefill step overhead) in µs.
const START_OVERHEADS_US: [(f64, f64); 4] = [(10.0, 10.0), (10.0, 3000.0), (1000.0, 10.0), (1000.0, 3000.0)];

/// The fitted parameters and how well they reproduce the profile.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Calibration {
    /// The profile's `source`, to say where the numbers come from.
    pub source: String,
    pub samples: usize,
    pub compute_efficiency: f64,
    pub attention_efficiency: f64,
    pub memory_efficiency: f64,
    pub step_overhead_us: f64,
    pub prefill_step_overhead_us: f64,
    #[serde(default)]
    pub sequence_overhead_us: f64,
    #[serde(default)]
    pub kv_memory_efficiency: f64,
    /// Whether the profile fits better with attention after the GEMMs than under them
    /// ([`CostParams::serial_attention`]).
    #[serde(default)]
    pub serial_attention: bool,
    /// `|predicted / measured − 1|` over the samples, with the fitted parameters.
    pub median_error: f64,
    pub p90_error: f64,
    pub max_error: f64,
    /// The same with the parameters the fit started from (what calibration bought).
    pub uncalibrated_median_error: f64,
    /// The samples with the fitted prediction, worst first (at most [`FITS_KEPT`]): where the
    /// roofline's shape and the engine part ways.
    pub fits: Vec<SampleFit>,
    #[serde(skip)]
    pub params: CostParams,
    /// The profile's decode-only samples, which price decode steps in place of the fitted
    /// roofline ([`CostModel::with_decode_table`]); the errors above are the roofline's.
    #[serde(skip)]
    pub decode_table: Option<DecodeTable>,
}

/// One profile sample against the calibrated prediction.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SampleFit {
    pub prefill_seqs: u32,
    pub prefill_tokens: u64,
    pub decode_seqs: u32,
    pub decode_context_tokens: u64,
    pub measured_ms: f64,
    pub predicted_ms: f64,
}

impl SampleFit {
    /// `predicted / measured − 1`.
    pub fn error(&self) -> f64 {
        self.predicted_ms / self.measured_ms - 1.0
    }
}

/// Why a profile cannot calibrate a cost model.
#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    #[error("profile format {found} is not supported (this build reads format {PROFILE_FORMAT})")]
    Format { found: u32 },
    #[error("the profile was measured on {what} `{profile}`, not `{expected}`")]
    Mismatch { what: &'static str, profile: String, expected: String },
    #[error("the profile has no samples")]
    Empty,
    #[error("profile sample {index}: {reason}")]
    Sample { index: usize, reason: &'static str },
    #[error(transparent)]
    Cost(#[from] CostError),
}

/// Fits `base`'s efficiencies and overhead to `profile`, measured on `model` and `gpu` with
/// plain tensor parallelism `deployment.tp`.
pub fn calibrate(
    model: &'static ModelSpec,
    gpu: &'static GpuSpec,
    deployment: Deployment,
    base: &CostParams,
    profile: &StepProfile,
) -> Result<Calibration, CalibrationError> {
    check(model, gpu, deployment, profile)?;
    let samples: Vec<(engine::BatchStats, f64)> = profile.samples.iter().map(|s| (s.stats(), s.seconds)).collect();
    let predict = |p: &CostParams| -> Result<Vec<f64>, CostError> {
        let cost = CostModel::new(model, gpu, deployment, p.clone())?;
        Ok(samples.iter().map(|(stats, _)| cost.step_time(stats).as_secs_f64()).collect())
    };
    let loss = |p: &CostParams| -> Result<f64, CostError> {
        let predicted = predict(p)?;
        Ok(samples.iter().zip(&predicted).map(|((_, measured), t)| (t / measured).ln().powi(2)).sum())
    };

    // Coordinates: ln of each efficiency (≤ 0) and ln(1 + µs) of each overhead; and the
    // roofline's form (attention under the GEMMs or after them).
    let to_params = |x: &[f64; 7], serial_attention: bool| CostParams {
        compute_efficiency: x[0].exp(),
        attention_efficiency: Some(x[1].exp()),
        memory_efficiency: x[2].exp(),
        step_overhead_us: x[3].exp() - 1.0,
        prefill_step_overhead_us: x[4].exp() - 1.0,
        sequence_overhead_us: x[5].exp() - 1.0,
        kv_memory_efficiency: Some(x[6].exp()),
        serial_attention,
        ..base.clone()
    };
    let max_overhead = (1.0 + MAX_OVERHEAD_US).ln();
    let bounds = [
        (MIN_EFFICIENCY.ln(), 0.0),
        (MIN_EFFICIENCY.ln(), 0.0),
        (MIN_EFFICIENCY.ln(), 0.0),
        (0.0, max_overhead),
        (0.0, max_overhead),
        (0.0, (1.0 + MAX_SEQUENCE_OVERHEAD_US).ln()),
        (MIN_EFFICIENCY.ln(), 0.0),
    ];
    let clamp = |x: &mut [f64; 7]| {
        for (v, (lo, hi)) in x.iter_mut().zip(bounds) {
            *v = v.clamp(lo, hi);
        }
    };
    // The loss has kinks (compute against memory), so the search starts from several
    // overheads — none, small, large — in each form, and keeps the best end point.
    let mut found: Option<([f64; 7], bool, f64)> = None;
    for ((step_us, prefill_us), serial) in START_OVERHEADS_US.into_iter().flat_map(|o| [(o, false), (o, true)]) {
        let mut x = [
            base.compute_efficiency.ln(),
            base.attention_efficiency().ln(),
            base.memory_efficiency.ln(),
            (1.0 + step_us).ln(),
            (1.0 + prefill_us).ln(),
            (1.0 + START_SEQUENCE_OVERHEAD_US).ln(),
            base.kv_memory_efficiency().ln(),
        ];
        clamp(&mut x);
        let f = |x: &[f64; 7]| loss(&to_params(x, serial));
        let mut best = f(&x)?;
        // Hooke and Jeeves: coordinate moves find a better point; a pattern move then
        // follows the direction they took, so the search runs along a valley that no
        // coordinate points down (memory efficiency against step overhead, say).
        let mut step = 0.5;
        while step > TOLERANCE {
            let (y, l) = explore(&f, x, best, step, &clamp)?;
            if l >= best {
                step /= 2.0;
                continue;
            }
            (x, best) = (y, l);
            let mut previous = x;
            loop {
                let mut jump = x;
                for i in 0..jump.len() {
                    jump[i] += x[i] - previous[i];
                }
                clamp(&mut jump);
                let (z, lz) = explore(&f, jump, f(&jump)?, step, &clamp)?;
                if lz >= best {
                    break;
                }
                (previous, x, best) = (x, z, lz);
            }
        }
        if found.is_none_or(|(_, _, l)| best < l) {
            found = Some((x, serial, best));
        }
    }
    let (x, serial_attention, _) = found.expect("at least one start");
    let params = to_params(&x, serial_attention);
    let predicted = predict(&params)?;
    let fitted = errors(&predicted, &samples);
    let mut fits: Vec<SampleFit> = profile
        .samples
        .iter()
        .zip(&predicted)
        .map(|(s, t)| SampleFit {
            prefill_seqs: s.prefill_seqs,
            prefill_tokens: s.prefill_tokens,
            decode_seqs: s.decode_seqs,
            decode_context_tokens: s.decode_context_tokens,
            measured_ms: s.seconds * 1e3,
            predicted_ms: t * 1e3,
        })
        .collect();
    fits.sort_by(|a, b| b.error().abs().total_cmp(&a.error().abs()));
    fits.truncate(FITS_KEPT);
    let unfitted = errors(&predict(base)?, &samples);
    Ok(Calibration {
        source: profile.source.clone(),
        samples: samples.len(),
        compute_efficiency: params.compute_efficiency,
        attention_efficiency: params.attention_efficiency(),
        memory_efficiency: params.memory_efficiency,
        step_overhead_us: params.step_overhead_us,
        prefill_step_overhead_us: params.prefill_step_overhead_us,
        sequence_overhead_us: params.sequence_overhead_us,
        kv_memory_efficiency: params.kv_memory_efficiency(),
        serial_attention,
        median_error: fitted[fitted.len() / 2],
        p90_error: fitted[(fitted.len() * 9 / 10).min(fitted.len() - 1)],
        max_error: fitted[fitted.len() - 1],
        uncalibrated_median_error: unfitted[unfitted.len() / 2],
        fits,
        params,
        decode_table: DecodeTable::from_profile(profile),
    })
}

fn check(
    model: &ModelSpec,
    gpu: &GpuSpec,
    deployment: Deployment,
    profile: &StepProfile,
) -> Result<(), CalibrationError> {
    if profile.format != PROFILE_FORMAT {
        return Err(CalibrationError::Format { found: profile.format });
    }
    let mismatch = |what, profile: &str, expected: &str| CalibrationError::Mismatch {
        what,
        profile: profile.to_string(),
        expected: expected.to_string(),
    };
    if profile.model != model.name {
        return Err(mismatch("model", &profile.model, model.name));
    }
    if profile.gpu != gpu.name {
        return Err(mismatch("gpu", &profile.gpu, gpu.name));
    }
    let plain = Deployment::tensor_parallel(deployment.tp);
    if profile.tp != deployment.tp || deployment != plain {
        let layout = format!(
            "tp {}, dp-attention {}, ep {}, cp {}",
            deployment.tp, deployment.dp_attention, deployment.ep, deployment.cp
        );
        return Err(mismatch("layout", &format!("tp {}", profile.tp), &layout));
    }
    if profile.samples.is_empty() {
        return Err(CalibrationError::Empty);
    }
    for (index, s) in profile.samples.iter().enumerate() {
        if !(s.seconds.is_finite() && s.seconds > 0.0) {
            return Err(CalibrationError::Sample { index, reason: "seconds must be a positive number" });
        }
        if s.stats().is_empty() {
            return Err(CalibrationError::Sample { index, reason: "the batch computes no token" });
        }
        if (s.prefill_seqs == 0) != (s.prefill_tokens == 0) {
            return Err(CalibrationError::Sample { index, reason: "prefill_seqs and prefill_tokens disagree" });
        }
    }
    Ok(())
}

/// How a cost model's step times compare with steps an engine served (`engine --step-log`),
/// for decode-only steps and for steps with prompt tokens apart.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepCheck {
    pub source: String,
    pub all: StepClassCheck,
    pub decode_only: StepClassCheck,
    pub with_prefill: StepClassCheck,
}

/// One class of steps against the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepClassCheck {
    pub steps: usize,
    /// Their summed time, measured and predicted: what a replay's timings add up from.
    pub measured_s: f64,
    pub predicted_s: f64,
    /// `predicted / measured − 1` per step: the median (bias) and the median of its absolute value.
    pub median_error: f64,
    pub median_abs_error: f64,
}

/// Checks `cost`'s step times against the steps of `log` (see [`StepCheck`]).
pub fn check_steps(cost: &CostModel, log: &StepProfile) -> Result<StepCheck, CalibrationError> {
    check(cost.model(), cost.gpu(), cost.deployment(), log)?;
    let mut classes: [Vec<(f64, f64)>; 2] = [Vec::new(), Vec::new()];
    for s in &log.samples {
        let predicted = cost.step_time(&s.stats()).as_secs_f64();
        classes[usize::from(s.prefill_seqs > 0)].push((s.seconds, predicted));
    }
    let summarize = |steps: &[(f64, f64)]| {
        if steps.is_empty() {
            return StepClassCheck::default();
        }
        let mut errors: Vec<f64> = steps.iter().map(|(m, p)| p / m - 1.0).collect();
        errors.sort_by(f64::total_cmp);
        let mut abs: Vec<f64> = errors.iter().map(|e| e.abs()).collect();
        abs.sort_by(f64::total_cmp);
        StepClassCheck {
            steps: steps.len(),
            measured_s: steps.iter().map(|s| s.0).sum(),
            predicted_s: steps.iter().map(|s| s.1).sum(),
            median_error: errors[errors.len() / 2],
            median_abs_error: abs[abs.len() / 2],
        }
    };
    let all: Vec<(f64, f64)> = classes.concat();
    Ok(StepCheck {
        source: log.source.clone(),
        all: summarize(&all),
        decode_only: summarize(&classes[0]),
        with_prefill: summarize(&classes[1]),
    })
}

/// One sweep of coordinate moves of `step` from `x` (whose loss is `at_x`), each kept when it
/// lowers the loss: the point reached and its loss.
fn explore(
    f: &impl Fn(&[f64; 7]) -> Result<f64, CostError>,
    mut x: [f64; 7],
    mut at_x: f64,
    step: f64,
    clamp: &impl Fn(&mut [f64; 7]),
) -> Result<([f64; 7], f64), CostError> {
    for i in 0..x.len() {
        for dir in [1.0, -1.0] {
            let mut y = x;
            y[i] += dir * step;
            clamp(&mut y);
            let l = f(&y)?;
            if l < at_x {
                (x, at_x) = (y, l);
            }
        }
    }
    Ok((x, at_x))
}

/// `|predicted / measured − 1|` per sample, sorted.
fn errors(predicted: &[f64], samples: &[(engine::BatchStats, f64)]) -> Vec<f64> {
    let mut e: Vec<f64> = predicted.iter().zip(samples).map(|(t, (_, m))| (t / m - 1.0).abs()).collect();
    e.sort_by(f64::total_cmp);
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{gpu_by_name, model_by_name};
    use engine::{BatchEntry, BatchStats, RequestId, StepSample};

    fn shapes() -> Vec<BatchStats> {
        let mut out = Vec::new();
        // Decode batches over sizes and contexts, as `fleetplane profile` measures them: what
        // tells the weights' bandwidth, the KV's and the per-sequence cost apart.
        for context in [128, 1024, 4096] {
            for batch in [1, 4, 16, 64, 256] {
                let mut s = BatchStats::default();
                for i in 0..batch {
                    s.add(&BatchEntry::new(RequestId(i), context, 1, false));
                }
                out.push(s);
            }
        }
        for (context, chunk) in [(0, 16), (0, 64), (0, 256), (0, 2048), (4096, 2048), (0, 8192)] {
            let mut s = BatchStats::default();
            s.add(&BatchEntry::new(RequestId(0), context, chunk, true));
            out.push(s);
        }
        for (chunk, decodes) in [(1024, 32), (256, 16), (2048, 64)] {
            let mut mixed = BatchStats::default();
            mixed.add(&BatchEntry::new(RequestId(0), 0, chunk, true));
            for i in 1..=decodes {
                mixed.add(&BatchEntry::new(RequestId(i), 4096, 1, false));
            }
            out.push(mixed);
        }
        out
    }

    fn profile_of(truth: &CostParams) -> StepProfile {
        let (m, g) = (model_by_name("llama-3.1-8b").expect("model"), gpu_by_name("h200").expect("gpu"));
        let cost = CostModel::new(m, g, Deployment::tensor_parallel(1), truth.clone()).expect("fits");
        StepProfile {
            format: PROFILE_FORMAT,
            model: m.name.into(),
            gpu: g.name.into(),
            tp: 1,
            block_size: 16,
            source: "synthetic".into(),
            samples: shapes().iter().map(|s| StepSample::new(s, cost.step_time(s).as_secs_f64())).collect(),
        }
    }

    #[test]
    fn the_fit_recovers_the_parameters_a_profile_was_made_with() {
        for serial_attention in [false, true] {
            let truth = CostParams {
                compute_efficiency: 0.4,
                attention_efficiency: Some(0.05),
                memory_efficiency: 0.7,
                kv_memory_efficiency: Some(0.45),
                step_overhead_us: 400.0,
                prefill_step_overhead_us: 2000.0,
                sequence_overhead_us: 5.0,
                serial_attention,
                ..CostParams::default()
            };
            let (m, g) = (model_by_name("llama-3.1-8b").expect("model"), gpu_by_name("h200").expect("gpu"));
            let c = calibrate(m, g, Deployment::tensor_parallel(1), &CostParams::default(), &profile_of(&truth))
                .expect("calibrates");
            assert!(c.max_error < 0.01, "{c:?}");
            assert!(c.uncalibrated_median_error > 0.2, "the defaults were far off: {c:?}");
            assert_eq!(c.serial_attention, serial_attention, "{c:?}");
            for (fitted, true_value) in [
                (c.compute_efficiency, 0.4),
                (c.attention_efficiency, 0.05),
                (c.memory_efficiency, 0.7),
                (c.kv_memory_efficiency, 0.45),
                (c.step_overhead_us, 400.0),
                (c.prefill_step_overhead_us, 2000.0),
                (c.sequence_overhead_us, 5.0),
            ] {
                assert!((fitted / true_value - 1.0).abs() < 0.05, "{fitted} vs {true_value}: {c:?}");
            }
            assert_eq!(c.params.attention_efficiency, Some(c.attention_efficiency));
            assert_eq!(c.params.memory_utilization, CostParams::default().memory_utilization);
        }
    }

    #[test]
    fn a_profile_of_another_machine_or_a_bad_sample_is_refused() {
        let (m, g) = (model_by_name("llama-3.1-8b").expect("model"), gpu_by_name("h200").expect("gpu"));
        let good = profile_of(&CostParams::default());
        let tp1 = Deployment::tensor_parallel(1);
        let fit =
            |p: &StepProfile| calibrate(m, g, tp1, &CostParams::default(), p).map(|_| ()).map_err(|e| e.to_string());
        assert_eq!(fit(&good), Ok(()));
        let h100 = gpu_by_name("h100").expect("gpu");
        assert_eq!(
            calibrate(m, h100, tp1, &CostParams::default(), &good).map(|_| ()).map_err(|e| e.to_string()),
            Err("the profile was measured on gpu `h200`, not `h100`".into())
        );
        let mut bad = good.clone();
        bad.samples[3].seconds = 0.0;
        assert_eq!(fit(&bad), Err("profile sample 3: seconds must be a positive number".into()));
        let mut empty = good.clone();
        empty.samples.clear();
        assert_eq!(fit(&empty), Err("the profile has no samples".into()));
        let newer = StepProfile { format: 2, ..good };
        assert_eq!(fit(&newer), Err("profile format 2 is not supported (this build reads format 1)".into()));
    }
}
