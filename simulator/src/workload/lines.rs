//! A line reader for trace files: one reused buffer, 1-based line numbers, a bound on the
//! length of a line, and errors that name the file and the line.
//!
//! The bound matters because a file with no newlines (a binary file, a JSON array on one line)
//! would otherwise be read whole into memory, breaking the streaming promise.

use super::WorkloadError;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// Longest line accepted, in bytes. A Mooncake line for a 2M-token prompt (about 4,000 ids)
/// is some 40 KB; this leaves two orders of magnitude of room.
pub(super) const MAX_LINE_BYTES: u64 = 4 << 20;

pub(super) struct Lines {
    /// Kept for error messages.
    path: PathBuf,
    reader: BufReader<File>,
    /// The current line's bytes, reused from line to line.
    buf: Vec<u8>,
    /// 1-based number of the line in `buf`; 0 before the first.
    line: u64,
}

impl Lines {
    pub(super) fn open(path: &Path) -> Result<Lines, WorkloadError> {
        let file = File::open(path).map_err(|reason| WorkloadError::Open { path: path.to_path_buf(), reason })?;
        Ok(Lines { path: path.to_path_buf(), reader: BufReader::new(file), buf: Vec::new(), line: 0 })
    }

    /// A parse error at `line` of this file.
    pub(super) fn error(&self, line: u64, reason: impl Into<String>) -> WorkloadError {
        WorkloadError::Parse { path: self.path.clone(), line, reason: reason.into() }
    }

    /// The next line, without its `\n` or `\r\n` (and without a UTF-8 byte-order mark on the
    /// first line), with its 1-based number; `None` at the end of the file.
    pub(super) fn next_line(&mut self) -> Result<Option<(u64, &str)>, WorkloadError> {
        self.buf.clear();
        self.line += 1;
        let read = (&mut self.reader).take(MAX_LINE_BYTES + 1).read_until(b'\n', &mut self.buf);
        let n = read.map_err(|reason| WorkloadError::Read { path: self.path.clone(), line: self.line, reason })?;
        if n == 0 {
            return Ok(None);
        }
        if self.buf.last() == Some(&b'\n') {
            self.buf.pop();
            if self.buf.last() == Some(&b'\r') {
                self.buf.pop();
            }
        } else if self.buf.len() as u64 > MAX_LINE_BYTES {
            return Err(self.error(self.line, format!("line is longer than {MAX_LINE_BYTES} bytes")));
        }
        let mut text = match std::str::from_utf8(&self.buf) {
            Ok(text) => text,
            Err(e) => {
                let reason = format!("line is not valid UTF-8 (byte {})", e.valid_up_to() + 1);
                return Err(WorkloadError::Parse { path: self.path.clone(), line: self.line, reason });
            }
        };
        if self.line == 1 {
            text = text.strip_prefix('\u{feff}').unwrap_or(text);
        }
        Ok(Some((self.line, text)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::test_util::TempTrace;

    #[test]
    fn lines_are_numbered_from_one_and_lose_their_line_endings() {
        let trace = TempTrace::new("lines.txt", "\u{feff}a\r\n\nb");
        let mut lines = Lines::open(trace.path()).expect("exists");
        let mut got = Vec::new();
        while let Some((n, text)) = lines.next_line().expect("valid") {
            got.push((n, text.to_string()));
        }
        assert_eq!(got, [(1, "a".to_string()), (2, String::new()), (3, "b".to_string())]);
    }

    #[test]
    fn invalid_utf8_names_the_line() {
        let trace = TempTrace::new_bytes("utf8.txt", b"ok\nbad\xff\n");
        let mut lines = Lines::open(trace.path()).expect("exists");
        assert!(lines.next_line().is_ok());
        let err = lines.next_line().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(err, format!("parsing trace {}: line 2: line is not valid UTF-8 (byte 4)", trace.path().display()));
    }
}
