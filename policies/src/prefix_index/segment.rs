//! Segments: blocks laid out in the order their `Stored` events chained them.

use super::EMPTY;
use engine::BlockHash;

/// Where a block is: `segments[seg]`, index `idx`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Loc {
    pub(super) seg: u32,
    pub(super) idx: u32,
}

/// Blocks laid out in the order their `Stored` events chained them. Positions only grow at
/// the end; a block leaving the index leaves a dead position, dropped from the end at once
/// and from the middle by compaction.
#[derive(Clone, Debug, Default)]
pub(super) struct Segment {
    pub(super) hashes: Vec<BlockHash>,
    /// State id of each position, or `DEAD`.
    pub(super) states: Vec<u32>,
    /// Dead positions.
    pub(super) dead: u32,
}

impl Segment {
    pub(super) fn push(&mut self, hash: BlockHash) -> u32 {
        let len = self.hashes.len();
        if len == self.hashes.capacity() {
            // 1.5x growth keeps the unused tail of long segments to a third at most.
            let extra = (len / 2).max(4);
            self.hashes.reserve_exact(extra);
            self.states.reserve_exact(extra);
        }
        self.hashes.push(hash);
        self.states.push(EMPTY);
        len as u32
    }
}
