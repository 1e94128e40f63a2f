//! The write-behind queue's copy on disk. Every queued write is appended to this replica's
//! spool file and synced before it is queued, and the file is emptied whenever the queue is,
//! so a replica that dies with writes queued (the database down) leaves them on disk. The
//! next replica of the same database to start on this machine (its own restart, or another)
//! takes them over and queues them first: they reach the database with the times of their
//! actions, once each (audit rows and scaling events carry their write's id, unique in the
//! database; an instance's state is written only over an older one).
//!
//! Files: `DIR/writes-KEY-OWNER.jsonl`, one JSON [`Spooled`] a line, KEY naming the database
//! (a hash of its host, port and name), OWNER the replica (its process id and nonce). The live replica that owns a file holds an exclusive
//! `flock` on it, so a file whose lock can be taken belongs to a replica that is gone.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write as _};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// A write the serving path queues (the store applies it; this file keeps it meanwhile).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub enum Write {
    InstanceState {
        id: i32,
        state: String,
    },
    /// A pool's size changed, with why (the loads that caused it).
    Scaling {
        pool: String,
        action: String,
        reason: Value,
        replica: String,
    },
    Audit {
        actor: String,
        action: String,
        detail: Value,
    },
}

/// A queued write as the spool holds it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Spooled {
    /// Unique across replicas and restarts: the replica's random nonce and a sequence number.
    pub id: String,
    /// When the action happened, in microseconds since the Unix epoch.
    pub at_us: u64,
    pub write: Write,
}

/// This replica's spool file, locked while it lives.
pub struct Spool {
    file: File,
    path: PathBuf,
}

/// The spool folder when `serve --spool-dir` names none: the user's state folder.
pub fn default_dir() -> PathBuf {
    let state = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".local/state")));
    state.map_or_else(|| std::env::temp_dir().join("fleetplane-spool"), |s| s.join("fleetplane/spool"))
}

/// The part of a spool file's name that names the database.
pub fn database_key(host: &str, port: u16, database: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(format!("{host}:{port}/{database}").as_bytes());
    hex::encode(&digest[..8])
}

/// Takes `file`'s exclusive lock without waiting; false when another process holds it.
#[allow(unsafe_code)]
fn try_lock(file: &File) -> bool {
    // SAFETY: flock(2) takes a descriptor this File owns and no pointers.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

impl Spool {
    /// Opens this replica's spool in `dir` for the database `key`, and takes over the spools
    /// of that database's replicas that are gone: their writes move into this replica's file
    /// (synced) before theirs are removed, and are returned, oldest first, to be queued.
    /// Empty spools that nobody holds, of any database, are removed.
    pub fn open(dir: &Path, key: &str, owner: &str) -> Result<(Spool, Vec<Spooled>)> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot make the spool folder {}", dir.display()))?;
        let path = dir.join(format!("writes-{key}-{owner}.jsonl"));
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(&path)
            .with_context(|| format!("cannot open the spool {}", path.display()))?;
        anyhow::ensure!(try_lock(&file), "the spool {} is held by another process", path.display());
        file.set_len(0).with_context(|| format!("cannot empty the spool {}", path.display()))?;
        let mut spool = Spool { file, path };
        let entries =
            std::fs::read_dir(dir).with_context(|| format!("cannot read the spool folder {}", dir.display()))?;
        for entry in entries.filter_map(|e| e.ok()) {
            let other = entry.path();
            let name = entry.file_name().to_string_lossy().to_string();
            if other == spool.path || !name.starts_with("writes-") || !name.ends_with(".jsonl") {
                continue;
            }
            let Ok(f) = OpenOptions::new().read(true).write(true).open(&other) else { continue };
            if !try_lock(&f) {
                continue; // a live replica's
            }
            let ours = name.starts_with(&format!("writes-{key}-"));
            if ours || f.metadata().is_ok_and(|m| m.len() == 0) {
                let theirs = if ours { read(&f, &other) } else { Vec::new() };
                // Moved into this spool before theirs goes, so a crash now loses nothing.
                spool.append_all(&theirs)?;
                let _ = std::fs::remove_file(&other);
                if !theirs.is_empty() {
                    tracing::info!(spool = %other.display(), writes = theirs.len(), "took over the writes of a replica that is gone");
                }
            }
        }
        let mut adopted = read(&spool.file, &spool.path);
        adopted.sort_by_key(|s| s.at_us);
        Ok((spool, adopted))
    }

    /// Appends `w` and syncs it to disk.
    pub fn append(&mut self, w: &Spooled) -> Result<()> {
        self.append_all(std::slice::from_ref(w))
    }

    fn append_all(&mut self, ws: &[Spooled]) -> Result<()> {
        if ws.is_empty() {
            return Ok(());
        }
        let mut text = String::new();
        for w in ws {
            text.push_str(&serde_json::to_string(w)?);
            text.push('\n');
        }
        self.file
            .write_all(text.as_bytes())
            .with_context(|| format!("cannot write to the spool {}", self.path.display()))?;
        self.file.sync_data().with_context(|| format!("cannot sync the spool {}", self.path.display()))
    }

    /// Empties the spool: every write in it reached the database.
    pub fn clear(&mut self) -> Result<()> {
        self.file.set_len(0).with_context(|| format!("cannot empty the spool {}", self.path.display()))
    }

    /// Removes the spool (a clean shutdown with nothing queued).
    pub fn remove(self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The writes in a spool file; a line cut short by a crash mid-append is skipped.
fn read(file: &File, path: &Path) -> Vec<Spooled> {
    let Ok(f) = file.try_clone() else { return Vec::new() };
    let mut reader = BufReader::new(f);
    let _ = std::io::Seek::rewind(&mut reader);
    let mut out = Vec::new();
    for (n, line) in reader.lines().map_while(Result::ok).enumerate() {
        match serde_json::from_str::<Spooled>(&line) {
            Ok(w) => out.push(w),
            Err(e) => tracing::warn!(spool = %path.display(), line = n + 1, "spooled write skipped: {e}"),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn audit(id: &str, at_us: u64) -> Spooled {
        Spooled {
            id: id.into(),
            at_us,
            write: Write::Audit {
                actor: "admin".into(),
                action: "instance.drain".into(),
                detail: json!({"instance": 1}),
            },
        }
    }

    #[test]
    fn a_spool_nobody_holds_is_taken_over_once_and_a_torn_line_is_skipped() {
        let dir = std::env::temp_dir().join(format!("fleetplane-spool-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        // A gone replica's spool (no lock held), with a line cut short at its end.
        let gone = dir.join("writes-k-1.jsonl");
        let lines = [
            serde_json::to_string(&audit("a-2", 20)).expect("json"),
            serde_json::to_string(&audit("a-1", 10)).expect("json"),
        ];
        std::fs::write(&gone, format!("{}\n{}\n{{\"id\": \"a-3\", \"at_us", lines[0], lines[1])).expect("write");
        // Another database's spool and an empty one of a third stay, and go.
        std::fs::write(dir.join("writes-other-1.jsonl"), format!("{}\n", lines[0])).expect("write");
        std::fs::write(dir.join("writes-third-1.jsonl"), "").expect("write");

        let (mut spool, adopted) = Spool::open(&dir, "k", "2-a").expect("open");
        let ids: Vec<_> = adopted.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["a-1", "a-2"], "oldest first, the torn line skipped");
        assert!(
            !gone.exists() && dir.join("writes-other-1.jsonl").exists() && !dir.join("writes-third-1.jsonl").exists()
        );
        // Held: a second replica does not take them again.
        let (second, again) = Spool::open(&dir, "k", "3-b").expect("open");
        assert!(again.is_empty(), "{again:?}");
        spool.append(&audit("b-1", 30)).expect("append");
        spool.clear().expect("clear");
        spool.remove();
        second.remove();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
