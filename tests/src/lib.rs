//! Helpers for the end-to-end tests of every crate.

use std::path::{Path, PathBuf};

/// The folder of public traces: the repository's `traces/`, or the one `FLEETPLANE_TRACES`
/// names. Panics when the folder lacks the traces: the trace tests cannot run without them
/// and must not pass silently.
pub fn traces_dir() -> PathBuf {
    let dir = std::env::var_os("FLEETPLANE_TRACES")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces"), PathBuf::from);
    assert!(dir.join("mooncake-conversation.jsonl").is_file(), "no traces in {}; set FLEETPLANE_TRACES", dir.display());
    dir
}

pub fn trace(name: &str) -> PathBuf {
    traces_dir().join(name)
}

/// A fresh, empty folder under the system's temporary folder for one test.
pub fn scratch_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fleetplane-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

/// A finished process's standard output, as text.
pub fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A finished process's standard error, as text.
pub fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The Mooncake conversation trace's path, as a flag's value.
pub fn mooncake() -> String {
    trace("mooncake-conversation.jsonl").display().to_string()
}

/// Expects a bad-input failure (exit 2) whose message contains every `needle`, and no panic.
pub fn assert_input_error(o: &std::process::Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "exit code; stderr: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks `{n}`: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}
