//! Step profiles on disk, and the cost model calibrated on one: what the simulator, the
//! engine process and the control plane's pools each price steps with.

use crate::calibrate::{calibrate, Calibration, CalibrationError};
use crate::error::CostError;
use crate::gpu::GpuSpec;
use crate::model::ModelSpec;
use crate::params::{CostParams, Deployment};
use crate::roofline::CostModel;
use engine::StepProfile;
use std::path::{Path, PathBuf};

/// Why a step profile could not be read, or a cost model built or calibrated on it.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error(transparent)]
    Cost(#[from] CostError),
    #[error("reading profile {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("parsing profile {path}: {source}")]
    Parse { path: PathBuf, source: serde_json::Error },
    #[error("calibrating on profile {path}: {source}")]
    Calibration { path: PathBuf, source: Box<CalibrationError> },
}

/// The cost model of `model` on `gpu`, fitted to the step profile at `profile` when one is
/// given (the fit beside it, to report).
pub fn calibrated_cost(
    model: &'static ModelSpec,
    gpu: &'static GpuSpec,
    deployment: Deployment,
    params: CostParams,
    profile: Option<&Path>,
) -> Result<(CostModel, Option<Calibration>), ProfileError> {
    let calibration = match profile {
        Some(path) => {
            let measured = load_profile(path)?;
            Some(
                calibrate(model, gpu, deployment, &params, &measured)
                    .map_err(|source| ProfileError::Calibration { path: path.into(), source: Box::new(source) })?,
            )
        }
        None => None,
    };
    let params = calibration.as_ref().map_or(params, |c| c.params.clone());
    let cost = CostModel::new(model, gpu, deployment, params)?
        .with_decode_table(calibration.as_ref().and_then(|c| c.decode_table.clone()));
    Ok((cost, calibration))
}

/// Reads a step profile (JSON, or gzipped JSON when the name ends in `.gz`).
pub fn load_profile(path: &Path) -> Result<StepProfile, ProfileError> {
    use std::io::Read;
    let read = || -> std::io::Result<String> {
        let file = std::fs::File::open(path)?;
        let mut text = String::new();
        if path.extension().is_some_and(|e| e == "gz") {
            flate2::read::GzDecoder::new(file).read_to_string(&mut text)?;
        } else {
            std::io::BufReader::new(file).read_to_string(&mut text)?;
        }
        Ok(text)
    };
    let text = read().map_err(|source| ProfileError::Read { path: path.into(), source })?;
    serde_json::from_str(&text).map_err(|source| ProfileError::Parse { path: path.into(), source })
}
