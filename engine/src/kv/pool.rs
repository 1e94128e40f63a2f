//! Free physical blocks of one instance.

use crate::ids::BlockId;

/// The blocks nobody holds and the prefix tree does not cache: those handed back (the last
/// first), then those never handed out, from id 0 upwards. Blocks never handed out are a
/// count, not a list: once the cache fills, few blocks are free at a time, and a list of
/// every block would hold 4 bytes a block for the whole run.
#[derive(Clone, Debug)]
pub struct BlockPool {
    returned: Vec<BlockId>,
    /// Blocks `next..total` have never been handed out.
    next: u32,
    total: u32,
}

impl BlockPool {
    pub fn new(total: u32) -> BlockPool {
        BlockPool { returned: Vec::new(), next: 0, total }
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    pub fn free_count(&self) -> u32 {
        self.returned.len() as u32 + (self.total - self.next)
    }

    pub fn pop(&mut self) -> Option<BlockId> {
        self.returned.pop().or_else(|| {
            (self.next < self.total).then(|| {
                self.next += 1;
                BlockId(self.next - 1)
            })
        })
    }

    pub fn push(&mut self, b: BlockId) {
        debug_assert!(b.0 < self.next, "block {b:?} was not handed out");
        self.returned.push(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_handed_back_go_out_first_then_unused_ones_in_order() {
        let mut pool = BlockPool::new(4);
        assert_eq!((pool.pop(), pool.pop()), (Some(BlockId(0)), Some(BlockId(1))));
        pool.push(BlockId(0));
        assert_eq!(pool.free_count(), 3);
        assert_eq!(pool.pop(), Some(BlockId(0)));
        assert_eq!((pool.pop(), pool.pop(), pool.pop()), (Some(BlockId(2)), Some(BlockId(3)), None));
        assert_eq!(pool.free_count(), 0);
    }
}
