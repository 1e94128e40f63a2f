//! Real vLLM for the tests that put fleetplane in front of it: the venv from
//! `scripts/vllm-venv.sh` (FLEETPLANE_VLLM_PYTHON; `.ci/run` makes it and sets
//! FLEETPLANE_REQUIRE_VLLM, so a test fails instead of skipping there), a tiny random-weight
//! Llama, and the flags and environment the servers run with on these CPUs.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The name the servers serve the tiny model under.
pub const MODEL_NAME: &str = "tiny";

/// The server's flags besides its ports and KV event settings.
pub const FLAGS: [&str; 13] = [
    "--served-model-name",
    MODEL_NAME,
    "--dtype",
    "float32",
    "--enforce-eager",
    "--block-size",
    "32",
    "--enable-prefix-caching",
    "--max-model-len",
    "512",
    "--enable-prompt-tokens-details",
    "--host",
    "127.0.0.1",
];

/// Its environment: offline, 1 GiB of KV, threads not pinned (the machine is shared).
pub const ENV: [(&str, &str); 3] =
    [("HF_HUB_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind")];

/// The venv's python, or `None` (the test skips) where there is none and none is required.
pub fn python() -> Option<PathBuf> {
    let found = std::env::var_os("FLEETPLANE_VLLM_PYTHON").map(PathBuf::from).or_else(|| {
        let home = std::env::var_os("HOME")?;
        let p = Path::new(&home).join(".cache/fleetplane/vllm-0.32.0/bin/python");
        p.exists().then_some(p)
    });
    if found.is_none() {
        assert!(
            std::env::var_os("FLEETPLANE_REQUIRE_VLLM").is_none(),
            "FLEETPLANE_REQUIRE_VLLM is set but there is no vLLM venv (scripts/vllm-venv.sh)"
        );
        eprintln!("skipped: no vLLM venv (run scripts/vllm-venv.sh, or .ci/run)");
    }
    found
}

/// Writes the tiny model folder under `dir` (`scripts/vllm-tiny-model.py`).
pub fn tiny_model(python: &Path, dir: &Path) -> PathBuf {
    let model = dir.join("tiny");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/vllm-tiny-model.py");
    let made = Command::new(python).arg(script).arg(&model).output().expect("the model script runs");
    assert!(made.status.success(), "tiny model: {}", String::from_utf8_lossy(&made.stderr));
    model
}

/// A free port below Linux's ephemeral range (32768 and up): a vLLM server starting while
/// another's ports are picked but not yet bound takes ephemeral ports for its own sockets.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let base = 8_000 + std::process::id() % 6_000;
    (0..2_000)
        .map(|_| base + NEXT.fetch_add(1, Ordering::Relaxed) % 6_000)
        .filter_map(|p| u16::try_from(p).ok())
        .find(|&p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        .expect("a free port below the ephemeral range")
}

/// The last 40 lines of a log.
pub fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
