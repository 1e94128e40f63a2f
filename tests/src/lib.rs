//! Helpers for the end-to-end tests of every crate.

use std::path::{Path, PathBuf};

/// The folder of public traces (`shared/traces`, beside the repository), found by walking up
/// from this crate, or named by `FLEETPLANE_TRACES`. Panics with the places it looked: the
/// trace tests cannot run without it and must not pass silently.
pub fn traces_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FLEETPLANE_TRACES") {
        return PathBuf::from(dir);
    }
    let start = Path::new(env!("CARGO_MANIFEST_DIR"));
    start
        .ancestors()
        .map(|a| a.join("shared").join("traces"))
        .find(|p| p.join("mooncake-conversation.jsonl").is_file())
        .unwrap_or_else(|| panic!("no shared/traces above {}; set FLEETPLANE_TRACES", start.display()))
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
