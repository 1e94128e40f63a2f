//! The ServeGen aggregate as the shape of a phased workload: per model and 10-minute window,
//! the request rate and the mean prompt and output lengths (alibaba/ServeGen, aggregated over
//! 14 days; `traces/servegen-aggregate.csv`).
//!
//! ```text
//! category,model,window_start_s,total_rate_rps,mean_input_tokens,mean_output_tokens,length_coverage_frac
//! language,m-large,0,212.78,355.4,292.5,0.675
//! ```
//!
//! The aggregate has no requests, only their shape, so [`ServeGenShape::phases`] turns a slice
//! of one model's windows into one phase per window, to be filled with (prompt, output) pairs
//! from a length table (the Azure trace's):
//!
//! - rate: the window's rate times `rate_rps / (the slice's mean rate)`, so that the slice
//!   keeps ServeGen's ups and downs at the mean rate the fleet is sized for;
//! - prompt and output scales: the window's mean lengths over the length table's, so that each
//!   window's mean lengths are ServeGen's while the spread around them is the table's;
//! - duration: `window_s` (600, real time, by default; less plays the shape faster).
//!
//! A window with no traffic has no lengths (empty cells) and becomes a quiet phase.
//! `length_coverage_frac` (the share of requests whose lengths ServeGen recorded) is not used.

use super::lines::Lines;
use super::phased::Phase;
use super::WorkloadError;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Seconds each row of the aggregate covers.
pub const SERVEGEN_WINDOW_S: u64 = 600;

/// Columns read, by header name (others are ignored, in any order).
const COLUMNS: [&str; 5] = ["model", "window_start_s", "total_rate_rps", "mean_input_tokens", "mean_output_tokens"];

/// Windows of one slice at most (14 days of 10-minute windows is 2,016).
const MAX_WINDOWS: usize = 100_000;

/// A slice of one model's windows, rescaled (see the module doc).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeGenShape {
    /// The aggregate CSV (relative to the scenario file).
    pub path: PathBuf,
    pub model: String,
    /// The slice: windows starting in `[from_s, to_s)`, seconds of ServeGen's time.
    pub from_s: u64,
    pub to_s: u64,
    /// Mean request rate over the slice after rescaling.
    pub rate_rps: f64,
    /// Seconds each 10-minute window lasts in the run [default: 600].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_s: Option<f64>,
}

/// One row of the aggregate, as read.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Window {
    start_s: u64,
    rate_rps: f64,
    /// `None` where the cells are empty (a window without traffic).
    input_tokens: Option<f64>,
    output_tokens: Option<f64>,
}

impl ServeGenShape {
    fn invalid(key: &str, reason: impl Into<String>) -> WorkloadError {
        WorkloadError::Config { key: format!("phased.servegen.{key}"), reason: reason.into() }
    }

    fn validate(&self) -> Result<(), WorkloadError> {
        if self.to_s <= self.from_s {
            return Err(Self::invalid("to_s", format!("must be after from_s ({} <= {})", self.to_s, self.from_s)));
        }
        for (key, v) in [("rate_rps", Some(self.rate_rps)), ("window_s", self.window_s)] {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(Self::invalid(key, format!("must be finite and > 0 (got {v})")));
            }
        }
        Ok(())
    }

    /// One phase per window of the slice, given the length table's mean prompt and output
    /// tokens.
    pub fn phases(&self, table_means: (f64, f64)) -> Result<Vec<Phase>, WorkloadError> {
        self.validate()?;
        let windows = read_windows(&self.path, &self.model, self.from_s, self.to_s)?;
        let mean_rate = windows.iter().map(|w| w.rate_rps).sum::<f64>() / windows.len() as f64;
        if mean_rate <= 0.0 {
            return Err(WorkloadError::Unsupported {
                path: self.path.clone(),
                reason: format!("model `{}` has no traffic in [{}, {}) s", self.model, self.from_s, self.to_s),
            });
        }
        let duration_s = self.window_s.unwrap_or(SERVEGEN_WINDOW_S as f64);
        let scale = |mean: Option<f64>, table: f64| mean.map_or(1.0, |m| m / table.max(1.0));
        Ok(windows
            .iter()
            .map(|w| Phase {
                name: format!("{}@{}s", self.model, w.start_s),
                duration_s,
                rate_rps: w.rate_rps * self.rate_rps / mean_rate,
                input_scale: scale(w.input_tokens, table_means.0),
                output_scale: scale(w.output_tokens, table_means.1),
            })
            .collect())
    }
}

/// The windows of `model` starting in `[from_s, to_s)`, checked to follow each other.
fn read_windows(path: &Path, model: &str, from_s: u64, to_s: u64) -> Result<Vec<Window>, WorkloadError> {
    let mut lines = Lines::open(path)?;
    let mut columns: Option<[usize; 5]> = None;
    let mut out: Vec<Window> = Vec::new();
    while let Some((n, line)) = lines.next_line()? {
        if line.trim().is_empty() {
            continue;
        }
        // `line` borrows `lines`, so errors are built from the path argument.
        let error = |reason: String| WorkloadError::Parse { path: path.to_path_buf(), line: n, reason };
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        let Some(cols) = columns else {
            let mut found = [0; 5];
            for (slot, name) in found.iter_mut().zip(COLUMNS) {
                *slot = cells
                    .iter()
                    .position(|c| *c == name)
                    .ok_or_else(|| error(format!("the header lacks the column `{name}` (found `{}`)", line.trim())))?;
            }
            columns = Some(found);
            continue;
        };
        let cell = |k: usize| -> Result<&str, WorkloadError> {
            cells.get(cols[k]).copied().ok_or_else(|| {
                error(format!("column {} (`{}`) is missing: {} columns", cols[k] + 1, COLUMNS[k], cells.len()))
            })
        };
        if cell(0)? != model {
            continue;
        }
        let number = |k: usize| -> Result<Option<f64>, WorkloadError> {
            let text = cell(k)?;
            if text.is_empty() {
                return Ok(None);
            }
            match text.parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => Ok(Some(v)),
                _ => Err(error(format!(
                    "column {} (`{}`): `{text}` is not a non-negative number",
                    cols[k] + 1,
                    COLUMNS[k]
                ))),
            }
        };
        let start = number(1)?;
        let start_s = match start {
            Some(s) if s.fract() == 0.0 => s as u64,
            _ => return Err(error(format!("column {} (`window_start_s`): not whole seconds", cols[1] + 1))),
        };
        if !(from_s..to_s).contains(&start_s) {
            continue;
        }
        let rate_rps =
            number(2)?.ok_or_else(|| error(format!("column {} (`total_rate_rps`) is empty", cols[2] + 1)))?;
        let (input_tokens, output_tokens) = (number(3)?, number(4)?);
        if rate_rps > 0.0 {
            for (k, v) in [(3, input_tokens), (4, output_tokens)] {
                if v.is_none_or(|v| v < 1.0) {
                    let reason =
                        format!("column {} (`{}`): a window with traffic needs a mean length", cols[k] + 1, COLUMNS[k]);
                    return Err(error(reason));
                }
            }
        }
        let expected = out
            .last()
            .map_or(from_s.div_ceil(SERVEGEN_WINDOW_S) * SERVEGEN_WINDOW_S, |w| w.start_s + SERVEGEN_WINDOW_S);
        if start_s != expected {
            let reason = format!("window_start_s {start_s} for `{model}`: expected {expected} (windows of {SERVEGEN_WINDOW_S} s, in order, none missing)");
            return Err(error(reason));
        }
        if out.len() == MAX_WINDOWS {
            return Err(error(format!("more than {MAX_WINDOWS} windows in the slice")));
        }
        out.push(Window { start_s, rate_rps, input_tokens, output_tokens });
    }
    if columns.is_none() {
        return Err(lines.error(1, format!("empty file, expected a header with `{}`", COLUMNS.join("`, `"))));
    }
    if out.is_empty() {
        return Err(WorkloadError::Unsupported {
            path: path.to_path_buf(),
            reason: format!("no window of model `{model}` starts in [{from_s}, {to_s}) s"),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::test_util::{TempTrace, SERVEGEN_AGGREGATE};

    const HEADER: &str =
        "category,model,window_start_s,total_rate_rps,mean_input_tokens,mean_output_tokens,length_coverage_frac\n";

    fn shape(path: &Path, from_s: u64, to_s: u64) -> ServeGenShape {
        ServeGenShape {
            path: path.to_path_buf(),
            model: "m".into(),
            from_s,
            to_s,
            rate_rps: 10.0,
            window_s: Some(60.0),
        }
    }

    #[test]
    fn each_window_is_a_phase_with_the_slice_rescaled_to_the_mean_rate() {
        let f = TempTrace::new(
            "sg.csv",
            &format!(
                "{HEADER}language,m,0,5,100,10,1\nlanguage,other,0,99,1,1,1\nlanguage,m,600,15,400,20,1\nlanguage,m,1200,0.0,,,\nlanguage,m,1800,40,1,1,1\n"
            ),
        );
        let phases = shape(f.path(), 0, 1800).phases((200.0, 10.0)).expect("valid slice");
        let got: Vec<_> =
            phases.iter().map(|p| (p.name.as_str(), p.duration_s, p.rate_rps, p.input_scale, p.output_scale)).collect();
        // Mean rate (5 + 15 + 0) / 3 = 6.67 becomes 10: × 1.5.
        assert_eq!(
            got,
            [("m@0s", 60.0, 7.5, 0.5, 1.0), ("m@600s", 60.0, 22.5, 2.0, 2.0), ("m@1200s", 60.0, 0.0, 1.0, 1.0)]
        );
    }

    #[test]
    fn bad_cells_name_the_file_line_and_column() {
        let cases = [
            ("language,m,0,x,1,1,1\n", "line 2: column 4 (`total_rate_rps`): `x` is not a non-negative number"),
            (
                "language,m,0,3,,1,1\n",
                "line 2: column 5 (`mean_input_tokens`): a window with traffic needs a mean length",
            ),
            ("language,m,0,3,1\n", "line 2: column 6 (`mean_output_tokens`) is missing: 5 columns"),
            ("language,m,0,3,1,1,1\nlanguage,m,1200,3,1,1,1\n", "line 3: window_start_s 1200 for `m`: expected 600"),
        ];
        for (rows, expected) in cases {
            let f = TempTrace::new("sg-bad.csv", &format!("{HEADER}{rows}"));
            let err = shape(f.path(), 0, 3600).phases((1.0, 1.0)).unwrap_err().to_string();
            assert!(err.starts_with(&format!("parsing trace {}: ", f.path().display())), "{err}");
            assert!(err.contains(expected), "{err}");
        }
        let f = TempTrace::new("sg-header.csv", "model,window_start_s\n");
        let err = shape(f.path(), 0, 600).phases((1.0, 1.0)).unwrap_err().to_string();
        assert!(err.contains("line 1: the header lacks the column `total_rate_rps`"), "{err}");
        let err = ServeGenShape { model: "none".into(), ..shape(Path::new(SERVEGEN_AGGREGATE), 0, 600) }
            .phases((1.0, 1.0))
            .unwrap_err()
            .to_string();
        assert!(err.ends_with("no window of model `none` starts in [0, 600) s"), "{err}");
    }

    #[test]
    fn the_public_aggregate_has_fourteen_days_of_ten_minute_windows_per_language_model() {
        for model in ["m-large", "m-mid", "m-small"] {
            let s = ServeGenShape { model: model.into(), ..shape(Path::new(SERVEGEN_AGGREGATE), 0, 14 * 86_400) };
            let phases = s.phases((1155.0, 211.0)).expect("the public aggregate reads");
            assert_eq!(phases.len(), 2016, "{model}");
            let mean = phases.iter().map(|p| p.rate_rps).sum::<f64>() / phases.len() as f64;
            assert!((mean - 10.0).abs() < 1e-9, "{model}: rescaled mean {mean}");
        }
    }
}
