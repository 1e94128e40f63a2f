//! `fleetplane` child processes: `demo` and `fleetplane-bench gateway` start serve and
//! engines this way.

use anyhow::{anyhow, Context};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Starts `exe` (a `fleetplane`) with `args` in a process group of its own, to die with this
/// process, and waits for the line (on its stdout) that says it is up; returns the child
/// (killed when dropped) and that line.
#[allow(unsafe_code)]
pub async fn start(
    exe: &Path,
    what: &str,
    args: &[String],
    envs: &[(&str, &str)],
    ready: &str,
) -> anyhow::Result<(Child, String)> {
    let mut command = Command::new(exe);
    command.args(args).envs(envs.iter().copied()).stdout(Stdio::piped()).kill_on_drop(true).process_group(0);
    // SAFETY: the closure runs in the forked child before exec and makes one
    // async-signal-safe call.
    unsafe {
        command.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let mut child = command.spawn().with_context(|| format!("cannot start {what}"))?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("{what} has no stdout"))?;
    let mut lines = BufReader::new(stdout).lines();
    let wait = async {
        while let Some(line) = lines.next_line().await? {
            if line.contains(ready) {
                return Ok::<_, anyhow::Error>(line);
            }
        }
        Err(anyhow!("{what} exited before it was ready (its log is above)"))
    };
    let line = tokio::time::timeout(Duration::from_secs(60), wait)
        .await
        .map_err(|_| anyhow!("{what} not ready after 60 s"))??;
    // Keep draining its stdout so it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, line))
}

/// The HTTP base URL and gRPC address in `fleetplane serve`'s ready line.
pub fn serve_addresses(line: &str) -> anyhow::Result<(String, String)> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let http = words.iter().find(|w| w.starts_with("http://")).ok_or_else(|| anyhow!("no HTTP address in `{line}`"))?;
    let grpc = words.last().filter(|w| !w.starts_with("http")).ok_or_else(|| anyhow!("no gRPC address in `{line}`"))?;
    Ok((http.to_string(), grpc.to_string()))
}
