//! Test helpers: temporary trace files and draining a workload.

use super::{Arrival, Workload, WorkloadError};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Paths of the public traces, shipped in the repository (traces/README.md).
pub(super) const MOONCAKE_CONVERSATION: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../traces/mooncake-conversation.jsonl");
pub(super) const AZURE_CONVERSATION: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../traces/azure-llm-2023-conv.csv");
pub(super) const SERVEGEN_AGGREGATE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../traces/servegen-aggregate.csv");

/// A file in the temporary directory with a name unique to this process and test, removed on
/// drop.
pub(super) struct TempTrace {
    path: PathBuf,
}

impl TempTrace {
    pub(super) fn new(name: &str, contents: &str) -> TempTrace {
        TempTrace::new_bytes(name, contents.as_bytes())
    }

    pub(super) fn new_bytes(name: &str, contents: &[u8]) -> TempTrace {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("fleetplane-workload-{}-{n}-{name}", std::process::id()));
        std::fs::write(&path, contents).expect("the temporary directory is writable");
        TempTrace { path }
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempTrace {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Every arrival of a workload that must open and read without error.
pub(super) fn drain(w: Result<Box<dyn Workload>, WorkloadError>) -> Vec<Arrival> {
    let mut w = w.unwrap_or_else(|e| panic!("opening failed: {e}"));
    let mut out = Vec::new();
    loop {
        match w.next_arrival(Vec::new()) {
            Ok(Some(a)) => out.push(a),
            Ok(None) => return out,
            Err(e) => panic!("reading failed: {e}"),
        }
    }
}

/// The message of the first error a workload gives, opening or reading; panics if none.
pub(super) fn first_error(w: Result<Box<dyn Workload>, WorkloadError>) -> String {
    let mut w = match w {
        Ok(w) => w,
        Err(e) => return e.to_string(),
    };
    loop {
        match w.next_arrival(Vec::new()) {
            Ok(Some(_)) => {}
            Ok(None) => panic!("expected an error, the workload ended"),
            Err(e) => return e.to_string(),
        }
    }
}
