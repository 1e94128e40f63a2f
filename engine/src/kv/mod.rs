//! The paged KV cache of one instance: a pool of fixed-size blocks, a prefix tree that keeps
//! full prompt blocks for reuse, and a per-sequence cursor ([`SeqKv`]).
//!
//! | file | purpose |
//! | --- | --- |
//! | `pool.rs` | free physical blocks |
//! | `prefix_tree.rs` | radix tree of cached block runs keyed by chained hashes, reference counts, LRU leaf eviction |
//! | `mod.rs` | [`KvCache`]: allocation, prefix matching and insertion through a sequence's cursor |
//!
//! A sequence's block table is split in two at `SeqKv::tree_blocks`: the blocks before it
//! are tree nodes the sequence holds a reference on (matched from the cache, or its own full
//! blocks already inserted); the blocks after it are private (being filled, or decode blocks).
//! Matching and insertion both start from the cursor (`SeqKv::node`), so prefill chunk k
//! touches only the blocks chunk k adds, never the prompt before them.
//!
//! Capacity: every block is in exactly one of three places: the free pool, the tree, or a
//! sequence's private tail. Unreferenced tree blocks count as available, since eviction
//! reclaims them on demand.

mod pool;
mod prefix_tree;

pub use pool::BlockPool;
pub use prefix_tree::{KvEvent, NodeId, PrefixTree};

use crate::ids::{BlockHash, BlockId};
use crate::time::Time;

/// A sequence's block table and its position in the prefix tree.
#[derive(Clone, Debug, Default)]
pub struct SeqKv {
    pub blocks: Vec<BlockId>,
    /// `blocks[..tree_blocks]` are tree nodes held by this sequence.
    pub tree_blocks: u32,
    /// The deepest tree node this sequence holds (`NodeId::ROOT` when none): the cursor.
    pub node: Option<NodeId>,
}

impl SeqKv {
    fn cursor(&self) -> NodeId {
        self.node.unwrap_or(NodeId::ROOT)
    }

    pub fn private_blocks(&self) -> u32 {
        self.blocks.len() as u32 - self.tree_blocks
    }
}

#[derive(Clone, Debug)]
pub struct KvCache {
    pool: BlockPool,
    tree: PrefixTree,
    block_size: u32,
}

impl KvCache {
    pub fn new(total_blocks: u32, block_size: u32) -> KvCache {
        assert!(block_size > 0, "block size must be positive");
        KvCache { pool: BlockPool::new(total_blocks), tree: PrefixTree::new(), block_size }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn total_blocks(&self) -> u32 {
        self.pool.total()
    }

    /// Blocks an allocation can get now: free ones plus evictable cached ones.
    pub fn available_blocks(&self) -> u32 {
        self.pool.free_count() + self.tree.unreferenced()
    }

    /// Blocks held by running sequences (what vLLM reports as KV usage).
    pub fn used_blocks(&self) -> u32 {
        self.total_blocks() - self.available_blocks()
    }

    pub fn cached_blocks(&self) -> u32 {
        self.tree.len()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.block_size)
    }

    pub fn tree_mut(&mut self) -> &mut PrefixTree {
        &mut self.tree
    }

    /// Extends the sequence's cached prefix from its cursor along `hashes`, taking at most
    /// `max_blocks` blocks in all. Only a sequence with no private blocks can match (a private
    /// block already occupies the next position). Returns the number of blocks newly matched.
    pub fn match_more(&mut self, now: Time, seq: &mut SeqKv, hashes: &[BlockHash], max_blocks: u32) -> u32 {
        if seq.private_blocks() > 0 {
            return 0;
        }
        let limit = (max_blocks as usize).min(hashes.len());
        let from = seq.tree_blocks as usize;
        if from >= limit {
            return 0;
        }
        let (cursor, matched) = self.tree.match_path(now, seq.cursor(), &hashes[from..limit], &mut seq.blocks);
        seq.tree_blocks += matched;
        if matched > 0 {
            seq.node = Some(cursor);
        }
        matched
    }

    /// Appends `n` private blocks to the sequence, evicting cached blocks if needed.
    /// All or nothing: returns false, changing nothing, when fewer than `n` are available.
    pub fn allocate(&mut self, seq: &mut SeqKv, n: u32) -> bool {
        if n > self.available_blocks() {
            return false;
        }
        for _ in 0..n {
            let b = match self.pool.pop() {
                Some(b) => b,
                None => self.tree.evict_one().expect("available blocks counted an unevictable node"),
            };
            seq.blocks.push(b);
        }
        true
    }

    /// Inserts the sequence's private blocks that are now full and have a hash into the tree,
    /// from the cursor up to `full_blocks` (blocks whose every token has KV). A block already
    /// cached by another sequence is shared instead, and the private copy freed.
    pub fn commit(&mut self, now: Time, seq: &mut SeqKv, hashes: &[BlockHash], full_blocks: u32) {
        let upto = (full_blocks as usize).min(hashes.len()).min(seq.blocks.len());
        let from = seq.tree_blocks as usize;
        if from >= upto {
            return;
        }
        let cursor =
            self.tree.commit(now, seq.cursor(), &hashes[from..upto], &mut seq.blocks[from..upto], &mut self.pool);
        seq.tree_blocks = upto as u32;
        seq.node = Some(cursor);
    }

    /// Gives back everything the sequence holds: private blocks to the pool, references on its
    /// tree path (the blocks stay cached until evicted).
    pub fn release(&mut self, now: Time, seq: &mut SeqKv) {
        for &b in &seq.blocks[seq.tree_blocks as usize..] {
            self.pool.push(b);
        }
        if let Some(n) = seq.node {
            self.tree.release_path(now, n);
        }
        seq.blocks.clear();
        seq.tree_blocks = 0;
        seq.node = None;
    }

    /// Checks that no block is leaked or double-counted, given the private blocks all
    /// sequences hold.
    pub fn check_invariants(&self, private_blocks: u32) {
        self.tree.check_invariants();
        assert_eq!(
            self.pool.free_count() + self.tree.len() + private_blocks,
            self.pool.total(),
            "blocks leaked or double-counted: free {} + cached {} + private {} != total {}",
            self.pool.free_count(),
            self.tree.len(),
            private_blocks,
            self.pool.total()
        );
    }
}

#[cfg(test)]
mod tests;
