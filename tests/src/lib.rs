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
