//! What the `fleetplane` binary shares with its developer tool `fleetplane-bench` (`bench/`):
//! the engine protocol and the engine token on it, starting `fleetplane` child processes, exit
//! codes, and the measures both report (latency quantiles, peak memory, a simulator run's size).

pub mod child;
pub mod engine_auth;
pub mod proto;

use std::process::ExitCode;

/// Exit codes: 1 for a failure while running, 2 for bad input (flags, scenario, trace),
/// 3 for an output that could not be written.
pub enum Failure {
    Input(anyhow::Error),
    Run(anyhow::Error),
    Output(anyhow::Error),
}

impl Failure {
    /// Prints the error with its causes on stderr; the exit code.
    pub fn report(self) -> ExitCode {
        let (code, err) = match self {
            Failure::Input(e) => (2, e),
            Failure::Run(e) => (1, e),
            Failure::Output(e) => (3, e),
        };
        eprintln!("error: {}", describe(&*err));
        ExitCode::from(code)
    }

    /// The error and its causes in one line, whatever the kind ([`describe`]).
    pub fn describe(&self) -> String {
        let (Failure::Input(e) | Failure::Run(e) | Failure::Output(e)) = self;
        describe(&**e)
    }
}

/// The error and its causes joined by `: `, as `{:#}` prints them, without the causes an error's
/// own message already ends with (most of ours put their source in their message, and
/// `{:#}` would print it again). An `anyhow::Error` `e` is `&*e`.
pub fn describe(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = String::new();
    for cause in std::iter::successors(Some(err), |e| e.source()) {
        let cause = cause.to_string();
        if text.is_empty() {
            text = cause;
        } else if !text.ends_with(&cause) {
            text = format!("{text}: {cause}");
        }
    }
    text
}

/// The `q` quantile of `v` (sorted in place), the sample nearest to rank q × (n − 1); NaN for
/// none.
pub fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// The size of a simulator benchmark run (`fleetplane bench`, and the cases of
/// `fleetplane-bench suite`).
#[derive(clap::Args, Debug)]
pub struct BenchSize {
    /// Requests to simulate (per case).
    #[arg(long, default_value_t = 1_000_000)]
    pub requests: u64,

    /// Engine instances (of the tiered cases).
    #[arg(long, default_value_t = 64)]
    pub instances: u32,
}

/// Peak resident set size of this process (Linux's VmHWM), in KiB.
pub fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::describe;

    #[derive(Debug, thiserror::Error)]
    #[error("policy p: {source}")]
    struct Outer {
        source: Inner,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("no parameter `x`")]
    struct Inner;

    #[test]
    fn a_cause_an_error_already_says_is_printed_once() {
        let err = anyhow::Error::new(Outer { source: Inner }).context("simulate");
        assert_eq!(describe(&*err), "simulate: policy p: no parameter `x`");
        assert_eq!(format!("{err:#}"), "simulate: policy p: no parameter `x`: no parameter `x`");
    }
}
