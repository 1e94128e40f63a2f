//! The paged KV cache of one instance: a pool of fixed-size blocks, a prefix tree that keeps
//! full prompt blocks for reuse (L1), the lower tiers blocks are demoted to (L2 host memory,
//! L3 shared store), and a per-sequence cursor ([`SeqKv`]).
//!
//! | file | purpose |
//! | --- | --- |
//! | `pool.rs` | free physical blocks |
//! | `prefix_tree.rs` | radix tree of cached block runs keyed by chained hashes, reference counts, LRU leaf eviction |
//! | `tier.rs` | [`Tier`] |
//! | `events.rs` | [`KvEvent`], and [`KvEvents`]: a batch of them kept as runs of a page's blocks |
//! | `store.rs` | the LRU stores of L2 and L3, keyed by page (runs of a chain's blocks) |
//! | `page_runs.rs` | [`PageRuns`]: blocks as runs of one page, a demotion's shape from eviction to events |
//! | `mod.rs` | [`KvCache`]: allocation, prefix matching, insertion, demotion and promotion |
//!
//! # Tiers
//!
//! A block evicted from L1 is demoted to L2 (or straight to L3 when L2 is off), and from L2
//! to L3. A prefix continues past L1 into blocks found in L2 or L3 ([`KvCache::peek_lower`]);
//! admitting them ([`KvCache::promote`]) takes L1 blocks for them, moves them out of L2 and
//! back into the tree, and the caller charges their load to the next iteration.
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

mod events;
mod page_runs;
mod pool;
mod prefix_tree;
mod store;
mod tier;

pub use events::{KvEvent, KvEvents, KvRun};
pub use page_runs::PageRuns;
pub use pool::BlockPool;
pub use prefix_tree::{NodeId, PrefixTree};
pub use store::{BlockLru, PageHolder, PageKey, Put, SharedStore, PAGE_BLOCKS};
pub use tier::Tier;

use crate::ids::{BlockHash, BlockId};
use crate::time::Time;
use std::ops::Range;

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

/// Blocks of a prefix found below L1, in order: `l2` then `l3` is a count per tier, not a
/// split point (the two may interleave).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LowerHit {
    pub l2: u32,
    pub l3: u32,
}

impl LowerHit {
    pub fn blocks(&self) -> u32 {
        self.l2 + self.l3
    }
}

/// The most blocks an allocation's scratch lists keep room for between allocations: a prefill
/// chunk's worth (8,192 tokens of 16-token blocks is 512); a larger allocation, rarer and far
/// costlier than allocating its lists, gives them back (40 bytes a block kept on every
/// instance otherwise).
const KEPT_SCRATCH: usize = 1024;

#[derive(Clone, Debug)]
pub struct KvCache {
    pool: BlockPool,
    tree: PrefixTree,
    block_size: u32,
    l2: BlockLru,
    l3: Option<SharedStore>,
    /// Blocks of one entry of L2 and L3 (see [`KvCache::offload_chunks`]); 1: single blocks.
    chunk: u32,
    /// Scratch: the blocks an allocation evicted (and those a promotion found in L3), as
    /// page runs from the tree's eviction to the events published.
    evicting: PageRuns,
    /// Scratch, with offload chunks: the evicted blocks that end a chunk (what L2 and L3
    /// store), and the chunks a promotion found in L3.
    chunk_ends: PageRuns,
    /// Scratch: what putting `evicting` in a store added and pushed out.
    scratch: Scratch,
}

impl KvCache {
    /// An L1-only cache.
    pub fn new(total_blocks: u32, block_size: u32) -> KvCache {
        KvCache::with_tiers(total_blocks, block_size, 0, None)
    }

    /// A cache with `l2_blocks` of host memory (0: no L2) and, when given, the fleet's shared
    /// L3 store.
    pub fn with_tiers(total_blocks: u32, block_size: u32, l2_blocks: u32, l3: Option<SharedStore>) -> KvCache {
        assert!(block_size > 0, "block size must be positive");
        KvCache {
            pool: BlockPool::new(total_blocks),
            tree: PrefixTree::new(),
            block_size,
            l2: BlockLru::new(l2_blocks),
            l3,
            chunk: 1,
            evicting: PageRuns::new(),
            chunk_ends: PageRuns::new(),
            scratch: Scratch::default(),
        }
    }

    /// Keeps L2 and L3 in offload chunks of `blocks` blocks of a chain (vLLM's offloading
    /// connector's offloaded block size, LMCache's chunk of 256 tokens) instead of single
    /// blocks: L2 then holds `l2_blocks / blocks` chunks, and the shared L3 store's capacity
    /// counts chunks too (its maker sizes it so). A chunk is copied down when its last block
    /// leaves L1 (its other blocks, its ancestors in the tree, are still in L1 then, or leave
    /// with it); the blocks past a chain's last full chunk are not kept below L1. A chunk is
    /// named by its last block (key and events: [`chunk_key`]), and a prefix goes on
    /// below L1 a chunk at a time, from the one its L1 part ends in. `blocks` divides
    /// [`PAGE_BLOCKS`] (a chunk is within one page); 1 leaves the tiers as they were.
    pub fn offload_chunks(mut self, blocks: u32) -> KvCache {
        assert!(offload_chunk_fits(blocks), "an offload chunk divides a page of {PAGE_BLOCKS} blocks, not {blocks}");
        self.l2 = BlockLru::new(self.l2.capacity() / blocks);
        self.chunk = blocks;
        self
    }

    /// Blocks of one entry of L2 and L3.
    pub fn chunk_blocks(&self) -> u32 {
        self.chunk
    }

    /// Starts recording [`KvEvent`]s of every tier; collect them with [`KvCache::drain_events`].
    pub fn record_events(&mut self) {
        self.tree.record_events();
    }

    /// Moves the recorded events into `out`, in the order they happened across tiers. An
    /// empty `out` trades buffers with the cache: pass a spare one to keep its capacity.
    pub fn drain_events(&mut self, out: &mut KvEvents) {
        self.tree.drain_events(out);
    }

    /// Blocks held in host memory (L2).
    pub fn l2_blocks(&self) -> u32 {
        self.l2.len() * self.chunk
    }

    pub fn l2(&self) -> &BlockLru {
        &self.l2
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
        let free = self.pool.free_count().min(n);
        for _ in 0..free {
            seq.blocks.push(self.pool.pop().expect("free blocks were counted"));
        }
        if free == n {
            return true;
        }
        self.evicting.clear();
        self.chunk_ends.clear();
        let chunks = (self.chunk > 1).then_some((self.chunk, &mut self.chunk_ends));
        self.tree.evict(n - free, &mut seq.blocks, &mut self.evicting, chunks);
        self.demote_evicted();
        true
    }

    /// Keeps the blocks just evicted from L1 (`evicting`) in this instance's host memory (L2)
    /// and writes them through to the shared store (L3), so that every instance can find them
    /// there at once, not only after they age out of this host's memory. L2's victims are
    /// simply dropped. Published as copied down, then freed: each tier's events in a run
    /// (L2's, L3's, then L1's removals), so that an index goes along each run once per tier
    /// and never sees a demoted block held by no one.
    fn demote_evicted(&mut self) {
        // The shared store is locked once for all the demotions, not once a block.
        let shared = self.l3.clone();
        let mut l3 = shared.as_ref().map(SharedStore::lock);
        self.prefetch_demotions(l3.as_deref());
        // What the stores keep: every block evicted, or with offload chunks the chunks' ends.
        let demoted = if self.chunk > 1 { &self.chunk_ends } else { &self.evicting };
        if self.l2.capacity() > 0 {
            demote(&mut self.l2, Tier::L2, demoted, &mut self.scratch, self.tree.events_mut());
        }
        if let Some(l3) = l3.as_deref_mut() {
            demote(l3, Tier::L3, demoted, &mut self.scratch, self.tree.events_mut());
        }
        if let Some(events) = self.tree.events_mut() {
            events.removed_runs(Tier::L1, &self.evicting);
        }
        self.drop_large_scratch();
    }

    /// Lets go of scratch lists grown past [`KEPT_SCRATCH`]: a rare allocation of most of L1
    /// (a long prompt loaded from below) would leave every instance's scratch that large for
    /// good.
    fn drop_large_scratch(&mut self) {
        if self.evicting.capacity() > KEPT_SCRATCH {
            self.evicting = PageRuns::new();
            self.chunk_ends = PageRuns::new();
            self.scratch = Scratch::default();
        }
    }

    /// Loads the L2 and L3 map entries that demoting `evicting` will probe, all at once: in
    /// stores of millions of blocks each probe is a cache miss, and loads issued back to back
    /// wait for memory together instead of one after another.
    fn prefetch_demotions(&self, l3: Option<&BlockLru>) {
        let demoted = if self.chunk > 1 { &self.chunk_ends } else { &self.evicting };
        if demoted.len() < 2 {
            return;
        }
        // The demoted blocks' entries, and those of the victims they will push out.
        let mut sink = 0u64;
        if self.l2.capacity() > 0 {
            sink ^= self.l2.prefetch(demoted);
        }
        if let Some(l3) = l3 {
            sink ^= l3.prefetch(demoted);
        }
        std::hint::black_box(sink);
    }

    /// How far the sequence's prefix continues below L1, from its cursor: blocks found in L2
    /// or L3, in order, up to `max_blocks` blocks of prefix in all. Nothing when the sequence
    /// has private blocks (as for [`KvCache::match_more`]).
    pub fn peek_lower(&self, seq: &SeqKv, hashes: &[BlockHash], max_blocks: u32) -> LowerHit {
        let mut hit = LowerHit::default();
        if seq.private_blocks() > 0 || (self.l2.is_empty() && self.l3.is_none()) {
            return hit;
        }
        let limit = (max_blocks as usize).min(hashes.len());
        let from = seq.tree_blocks as usize;
        if from >= limit {
            return hit;
        }
        if self.chunk > 1 {
            return self.peek_chunks(hashes, from, limit);
        }
        let l3 = self.l3.as_ref().map(SharedStore::lock);
        // A page at a time: each store's page looked up once (L3's at the first block L2
        // lacks).
        for (page, hashes) in PageKey::pages(hashes, from..limit) {
            let in_l2 = self.l2.page(page);
            let mut in_l3 = None;
            for &hash in hashes {
                if in_l2.holds(hash) {
                    hit.l2 += 1;
                } else if l3.as_deref().is_some_and(|s| in_l3.get_or_insert_with(|| s.page(page)).holds(hash)) {
                    hit.l3 += 1;
                } else {
                    return hit;
                }
            }
        }
        hit
    }

    /// [`KvCache::peek_lower`] with offload chunks: a chunk at a time, from the one the
    /// prefix's L1 part ends in (its blocks from there on), each whole in `hashes`.
    fn peek_chunks(&self, hashes: &[BlockHash], from: usize, limit: usize) -> LowerHit {
        let mut hit = LowerHit::default();
        let l3 = self.l3.as_ref().map(SharedStore::lock);
        let c = self.chunk as usize;
        let mut at = from;
        while at < limit {
            let k = at / c;
            let Some(key) = chunk_key(self.chunk, hashes, k) else { break };
            let n = (((k + 1) * c).min(limit) - at) as u32;
            if self.l2.contains(key) {
                hit.l2 += n;
            } else if l3.as_deref().is_some_and(|s| s.contains(key)) {
                hit.l3 += n;
            } else {
                break;
            }
            at = (k + 1) * c;
        }
        hit
    }

    /// The stores' part of [`KvCache::promote`] with offload chunks: a chunk whose last block
    /// the promotion brings into L1 moves up out of L2; one it loads only the front of stays
    /// there (used), as L3's do.
    fn take_chunks(&mut self, hashes: &[BlockHash], from: usize, to: usize) {
        let c = self.chunk as usize;
        let mut events = self.tree.events_mut();
        let in_l3 = &mut self.chunk_ends;
        in_l3.clear();
        for k in from / c..to.div_ceil(c) {
            let Some(key) = chunk_key(self.chunk, hashes, k) else { break };
            let whole = (k + 1) * c <= to;
            let in_l2 = if whole { self.l2.remove(key) } else { self.l2.touch(key) };
            if !in_l2 {
                in_l3.push(key);
            } else if let (true, Some(events)) = (whole, events.as_deref_mut()) {
                events.removed(Tier::L2, key.hash, key.page);
            }
        }
        if let Some(l3) = &self.l3 {
            l3.lock().touch_all(in_l3);
        }
    }

    /// Loads the `hit` found by [`KvCache::peek_lower`] (nothing having changed since) into
    /// L1: L1 blocks are taken for them, L2's copies are moved up, L3's stay shared, and the
    /// blocks join the tree on the sequence's path. False, changing nothing, when L1 lacks
    /// the blocks.
    pub fn promote(&mut self, now: Time, seq: &mut SeqKv, hashes: &[BlockHash], hit: LowerHit) -> bool {
        let n = hit.blocks();
        if n == 0 {
            return true;
        }
        if n > self.available_blocks() {
            return false;
        }
        let from = seq.tree_blocks as usize;
        // Out of L2 first, so that the demotions `allocate` causes cannot push them out; the
        // blocks found in L3 instead are used there. Each store goes over the blocks a page
        // at a time (its order of uses is its own: the two need not interleave).
        if self.chunk > 1 {
            self.take_chunks(hashes, from, from + n as usize);
        } else {
            let pages = PageKey::pages(hashes, from..from + n as usize);
            let mut events = self.tree.events_mut();
            let in_l3 = &mut self.evicting;
            in_l3.clear();
            self.l2.remove_all(pages, |page, hashes, removed| {
                if removed.count_ones() as usize != hashes.len() {
                    for hash in events::marked(hashes, !removed) {
                        in_l3.push(PageKey { hash, page });
                    }
                }
                if let Some(events) = events.as_deref_mut() {
                    events.removed_some(Tier::L2, page, hashes, removed);
                }
            });
            if let Some(l3) = &self.l3 {
                l3.lock().touch_all(in_l3);
            }
        }
        self.drop_large_scratch();
        let ok = self.allocate(seq, n);
        debug_assert!(ok, "available blocks were checked");
        // No copy of them is left in L2 for `commit` to supersede: L2's were just moved up,
        // and a block found in L3 was looked for in L2 first.
        let upto = self.insert(now, seq, hashes, from as u32 + n).1;
        debug_assert!((from..upto).all(|i| !self.l2.contains(PageKey::at(hashes, i))));
        true
    }

    /// The keys of the chunks of `chunk` blocks whose last block is at a position in `range`
    /// of `hashes`.
    fn chunk_ends_in(chunk: u32, hashes: &[BlockHash], range: Range<usize>) -> impl Iterator<Item = PageKey> + '_ {
        let c = chunk as usize;
        ((range.start + 1).div_ceil(c) - 1..range.end / c).filter_map(move |k| chunk_key(chunk, hashes, k))
    }

    /// Inserts the sequence's private blocks that are now full and have a hash into the tree,
    /// from the cursor up to `full_blocks` (blocks whose every token has KV). A block already
    /// cached by another sequence is shared instead, and the private copy freed.
    pub fn commit(&mut self, now: Time, seq: &mut SeqKv, hashes: &[BlockHash], full_blocks: u32) {
        let (new, upto) = self.insert(now, seq, hashes, full_blocks);
        // A block newly cached in L1 while an old copy sits in L2 (it was computed again: L1
        // lacked room to load it then) supersedes that copy, so that no block is in both
        // tiers. Shared blocks were in L1 already, hence not in L2. With offload chunks, a
        // chunk's copy is superseded when its last block is cached.
        if self.chunk > 1 && !self.l2.is_empty() {
            let mut events = self.tree.events_mut();
            for key in Self::chunk_ends_in(self.chunk, hashes, new..upto) {
                if self.l2.remove(key) {
                    if let Some(events) = events.as_deref_mut() {
                        events.removed(Tier::L2, key.hash, key.page);
                    }
                }
            }
        } else if !self.l2.is_empty() {
            let mut events = self.tree.events_mut();
            self.l2.remove_all(PageKey::pages(hashes, new..upto), |page, hashes, removed| {
                if let Some(events) = events.as_deref_mut() {
                    events.removed_some(Tier::L2, page, hashes, removed);
                }
            });
        }
    }

    /// The tree part of [`KvCache::commit`]: returns the positions of the blocks it newly
    /// cached in L1 (`new..upto`; those before `new` were there already, and shared).
    fn insert(&mut self, now: Time, seq: &mut SeqKv, hashes: &[BlockHash], full_blocks: u32) -> (usize, usize) {
        let upto = (full_blocks as usize).min(hashes.len()).min(seq.blocks.len());
        let from = seq.tree_blocks as usize;
        if from >= upto {
            return (upto, upto);
        }
        let rest = hashes.len() - upto;
        let (cursor, shared) =
            self.tree.commit(now, seq.cursor(), &hashes[from..upto], &mut seq.blocks[from..upto], rest, &mut self.pool);
        seq.tree_blocks = upto as u32;
        seq.node = Some(cursor);
        (from + shared, upto)
    }

    /// Gives back everything the sequence holds: private blocks to the pool, references on its
    /// tree path (the blocks stay cached until evicted).
    pub fn release(&mut self, now: Time, seq: &mut SeqKv) {
        if let Some(n) = self.release_private(seq) {
            self.tree.release_path(now, n);
        }
    }

    /// Gives the sequence's private blocks back to the pool and empties it; returns the end
    /// of the tree path it held references on (still held), if any.
    fn release_private(&mut self, seq: &mut SeqKv) -> Option<NodeId> {
        for &b in &seq.blocks[seq.tree_blocks as usize..] {
            self.pool.push(b);
        }
        seq.blocks.clear();
        seq.tree_blocks = 0;
        seq.node.take()
    }

    /// Gives back the sequence's private blocks but keeps its references on its tree path
    /// (a program's hold, `crate::programs`): returns the path's deepest node and its
    /// blocks, or `None` when it held no tree blocks (everything is then released).
    pub fn release_keeping_path(&mut self, seq: &mut SeqKv) -> Option<(NodeId, u32)> {
        let tree_blocks = seq.tree_blocks;
        self.release_private(seq).map(|node| (node, tree_blocks))
    }

    /// Blocks that dropping the reference kept on `deepest` would make evictable.
    pub fn sole_blocks(&self, deepest: NodeId) -> u32 {
        self.tree.sole_blocks(deepest)
    }

    /// Drops a reference kept by [`KvCache::release_keeping_path`].
    pub fn release_path(&mut self, now: Time, deepest: NodeId) {
        self.tree.release_path(now, deepest);
    }

    /// Checks that no block is leaked or double-counted, given the private blocks all
    /// sequences hold.
    pub fn check_invariants(&self, private_blocks: u32) {
        self.tree.check_invariants();
        self.l2.check_invariants();
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

/// Whether L2 and L3 can keep offload chunks of `blocks` blocks: a chunk lies within one
/// page (the stores and the index are keyed by page), so `blocks` divides [`PAGE_BLOCKS`].
pub fn offload_chunk_fits(blocks: u32) -> bool {
    blocks > 0 && (PAGE_BLOCKS as u32).is_multiple_of(blocks)
}

/// The key L2 and L3 keep chunk `k` of `chunk` blocks of `hashes` by: its last block's
/// (`None` when the chunk is not whole in `hashes`).
fn chunk_key(chunk: u32, hashes: &[BlockHash], k: usize) -> Option<PageKey> {
    let last = (k + 1) * chunk as usize - 1;
    (last < hashes.len()).then(|| PageKey::at(hashes, last))
}

/// What a store's puts of a demotion added, and the victims they pushed out.
#[derive(Clone, Debug, Default)]
struct Scratch {
    added: PageRuns,
    victims: PageRuns,
}

/// Puts `keys`, evicted from L1, in `store` (of `tier`), and records in `events`, when given,
/// what that did: the victims, then the blocks added, each a run an index goes along in one
/// pass (put by put, the two alternate and break both runs); a block already there is news
/// to nobody. The order of events on one block is kept: a block added can be pushed out by
/// the same demotion only when it demotes more than the store holds, and is then published
/// put by put.
fn demote(store: &mut BlockLru, tier: Tier, keys: &PageRuns, scratch: &mut Scratch, events: Option<&mut KvEvents>) {
    if keys.len() > store.capacity() as usize {
        let mut events = events;
        for key in keys.keys() {
            // A store of no capacity hands a block straight back: it keeps nothing.
            let Put::Added { evicted } = store.put(key) else { continue };
            if let Some(events) = events.as_deref_mut().filter(|_| evicted != Some(key)) {
                events.stored(tier, key.hash, key.page);
                if let Some(victim) = evicted {
                    events.removed(tier, victim.hash, victim.page);
                }
            }
        }
        return;
    }
    let Scratch { added, victims } = scratch;
    added.clear();
    victims.clear();
    if tier == Tier::L2 {
        // L2 never holds what L1 held: the blocks are added without a look for them.
        store.add_all(keys, added, victims);
    } else {
        store.put_all(keys, added, victims);
    }
    if let Some(events) = events {
        events.removed_runs(tier, victims);
        events.stored_runs(tier, added);
    }
}

#[cfg(test)]
mod tests;
