//! A workload tiled to any size: copies of one workload side by side (`width` at once, for a
//! fleet `width` times as large) and wave after wave, until a number of requests.
//!
//! Each copy is a different population of users: its block hashes are salted with the
//! copy's index, so that prompts share prefixes within a copy exactly as in the original and
//! never across copies. Copy 0 is unsalted, so the first tile of a trace is the trace itself.
//! A wave starts a millisecond after the previous wave's last arrival.

use super::{Arrival, Workload, WorkloadError};
use engine::ids::mix64;
use engine::{BlockHash, Dur, Time};

/// Opens a fresh copy of the workload being tiled.
pub type Opener = Box<dyn FnMut() -> Result<Box<dyn Workload>, WorkloadError> + Send>;

/// Gap between one wave's last arrival and the next wave's start.
const WAVE_GAP: Dur = Dur(1_000);

/// `requests` arrivals from copies of what `open` opens, `width` copies at a time.
pub fn tile(open: Opener, width: u32, requests: u64) -> Box<dyn Workload> {
    Box::new(Tile {
        open,
        width: width.max(1),
        left: requests,
        copies: 0,
        offset: Time::ZERO,
        last: Time::ZERO,
        wave: Vec::new(),
    })
}

struct Tile {
    open: Opener,
    width: u32,
    /// Arrivals still to produce.
    left: u64,
    /// Copies opened so far: the next copy's salt.
    copies: u64,
    /// Start of the current wave.
    offset: Time,
    /// The latest arrival produced.
    last: Time,
    /// The current wave's copies with each one's next arrival (`None`: that copy is done).
    wave: Vec<(Copy, Option<Arrival>)>,
}

struct Copy {
    workload: Box<dyn Workload>,
    salt: u64,
}

impl Copy {
    fn next(&mut self, buf: Vec<BlockHash>, offset: Time) -> Result<Option<Arrival>, WorkloadError> {
        let Some(mut a) = self.workload.next_arrival(buf)? else { return Ok(None) };
        a.at = offset + Dur(a.at.0);
        if self.salt != 0 {
            // Salting each chained hash keeps equal prefixes equal within the copy.
            for h in &mut a.block_hashes {
                *h = BlockHash(mix64(h.0 ^ self.salt));
            }
        }
        Ok(Some(a))
    }
}

impl Tile {
    /// Opens the next wave, after the previous wave's last arrival.
    fn open_wave(&mut self) -> Result<(), WorkloadError> {
        self.offset = if self.copies == 0 { Time::ZERO } else { self.last + WAVE_GAP };
        self.wave.clear();
        for _ in 0..self.width {
            let salt = if self.copies == 0 { 0 } else { mix64(self.copies) };
            self.copies += 1;
            let mut copy = Copy { workload: (self.open)()?, salt };
            let first = copy.next(Vec::new(), self.offset)?;
            self.wave.push((copy, first));
        }
        Ok(())
    }
}

impl Workload for Tile {
    fn next_arrival(&mut self, buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        if self.left == 0 {
            return Ok(None);
        }
        for round in 0..2 {
            // The earliest next arrival of the wave; ties go to the lower copy.
            let earliest = self.wave.iter().enumerate().filter_map(|(i, (_, a))| a.as_ref().map(|a| (a.at, i))).min();
            if let Some((_, i)) = earliest {
                let (copy, slot) = &mut self.wave[i];
                let next = copy.next(buf, self.offset)?;
                let a = std::mem::replace(slot, next).expect("the earliest copy has an arrival");
                self.left -= 1;
                self.last = a.at;
                return Ok(Some(a));
            }
            if round == 1 {
                break; // a fresh wave with no arrival at all: the workload is empty
            }
            self.open_wave()?;
        }
        self.left = 0;
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::test_util::{drain, TempTrace};
    use crate::workload::{open_trace, TraceFormat, WorkloadOptions};
    use std::sync::Arc;

    const TRACE: &str = concat!(
        r#"{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]}"#,
        "\n",
        r#"{"timestamp": 5, "input_length": 1536, "output_length": 4, "hash_ids": [1, 2, 3]}"#,
        "\n",
        r#"{"timestamp": 9, "input_length": 512, "output_length": 4, "hash_ids": [7]}"#,
        "\n",
    );

    fn tiled(trace: &Arc<TempTrace>, width: u32, requests: u64) -> Vec<Arrival> {
        let trace = Arc::clone(trace);
        let open: Opener =
            Box::new(move || open_trace(trace.path(), TraceFormat::Mooncake, &WorkloadOptions::default()));
        drain(Ok(tile(open, width, requests)))
    }

    #[test]
    fn the_first_copy_is_the_workload_itself_and_copies_share_no_block() {
        let trace = Arc::new(TempTrace::new("tile.jsonl", TRACE));
        let plain = drain(open_trace(trace.path(), TraceFormat::Mooncake, &WorkloadOptions::default()));
        let all = tiled(&trace, 2, 12);
        assert_eq!(all.len(), 12);
        assert!(all.windows(2).all(|w| w[0].at <= w[1].at), "arrivals in time order");
        // Ties go to the lower copy: the even arrivals of the first wave are copy 0's.
        let first: Vec<_> = all.iter().take(6).step_by(2).cloned().collect();
        assert_eq!(first, plain);
        let copy1: Vec<_> = all.iter().take(6).skip(1).step_by(2).collect();
        // Within a copy, a prefix is shared as in the trace; across copies never.
        assert_eq!(copy1[1].block_hashes[..64], copy1[0].block_hashes[..]);
        for (a, b) in first.iter().zip(&copy1) {
            assert_eq!((a.at, a.prompt_tokens), (b.at, b.prompt_tokens));
            assert!(a.block_hashes.iter().all(|h| !b.block_hashes.contains(h)));
        }
        // The second wave starts after the first wave's last arrival, with new salts.
        assert_eq!(all[6].at, Time::from_millis(9) + WAVE_GAP);
        assert!(all[6].block_hashes.iter().all(|h| !first[0].block_hashes.contains(h)));
    }

    #[test]
    fn a_tile_ends_at_its_request_count_or_with_an_empty_workload() {
        let trace = Arc::new(TempTrace::new("tile.jsonl", TRACE));
        assert_eq!(tiled(&trace, 1, 4).len(), 4);
        let empty = Arc::new(TempTrace::new("empty.jsonl", ""));
        assert!(tiled(&empty, 3, 10).is_empty());
    }
}
