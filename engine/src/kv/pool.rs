//! Free physical blocks of one instance.

use crate::ids::BlockId;

/// The blocks nobody holds and the prefix tree does not cache.
#[derive(Clone, Debug)]
pub struct BlockPool {
    free: Vec<BlockId>,
    total: u32,
}

impl BlockPool {
    pub fn new(total: u32) -> BlockPool {
        // Reversed so that blocks are handed out from id 0 upwards (easier to read in tests).
        BlockPool { free: (0..total).rev().map(BlockId).collect(), total }
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }

    pub fn pop(&mut self) -> Option<BlockId> {
        self.free.pop()
    }

    pub fn push(&mut self, b: BlockId) {
        debug_assert!(b.0 < self.total, "block {b:?} out of range");
        self.free.push(b);
    }
}
