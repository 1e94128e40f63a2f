//! Chunk mode: the lower tiers (L2 per instance, the shared L3) keep KV in chunks of `c`
//! consecutive blocks of a chain (vLLM's offloaded block size, LMCache's chunks), and their
//! events name chunks by the hash of their last block. The index keeps them apart from the
//! per-block pages, in a map from chunk hash to a holder set (L2 holders, in L3 or not,
//! interned like the blocks'), so that lower-tier events and queries cost per chunk.
//!
//! A query walks the prompt's pages for the L1 prefixes (as without chunks: the pages then
//! hold L1 only), then its chunks: instance `X`'s prefix goes on from chunk `l1 / c`, a chunk
//! at a time, while `X` holds the chunk in L2 or the chunk is in L3. As the page walk does
//! with runs, the chunk walk lists the chunks not in L3 (*misses*) and counts for each
//! instance the misses it survived: an instance no L2 chunk of the prompt touched survived
//! none past its start, and its depth is the first miss from there (a binary search).

use super::holders::{Change, State};
use super::matches::PrefixMatches;
use super::{PrefixIndex, EMPTY};
use engine::block_map::Probe;
use engine::BlockHash;

/// Chunk entries of a prompt [`PrefixIndex::walk_chunks`] loads ahead.
const LOAD_CHUNKS: usize = 64;

impl PrefixIndex {
    /// Applies `change` (a store or removal in L2 or L3) to the chunk whose last block is
    /// `hash`.
    pub(super) fn apply_chunk(&mut self, hash: BlockHash, change: Change, stored: bool) {
        if stored {
            // One probe finds the chunk or the place for it.
            match self.chunks.probe(hash) {
                Probe::Found(from) => self.move_chunk(hash, from, change),
                Probe::Vacant(vacancy) => {
                    let to = self.transition(EMPTY, change);
                    if to != EMPTY {
                        self.chunks.fill(vacancy, hash, to);
                        self.meta[to as usize].refs += 1;
                    }
                }
            }
        } else if let Some(from) = self.chunks.get(hash) {
            self.move_chunk(hash, from, change);
        }
    }

    /// Moves the indexed chunk `hash` from state `from` by `change`, out of the map when
    /// nobody holds it any more.
    fn move_chunk(&mut self, hash: BlockHash, from: u32, change: Change) {
        let to = self.transition(from, change);
        if to == from {
            return;
        }
        if to == EMPTY {
            self.chunks.remove(hash);
        } else {
            self.chunks.set(hash, to);
            self.meta[to as usize].refs += 1;
        }
        self.release(from);
    }

    /// The chunk part of [`PrefixIndex::match_prefix`], after the page walk found the L1
    /// prefixes: every chunk whose last block is in the prompt, in order, until no
    /// instance's prefix can go on.
    pub(super) fn walk_chunks(&self, hashes: &[BlockHash], out: &mut PrefixMatches) {
        let c = self.chunk_blocks as usize;
        let lasts = || hashes.iter().skip(c - 1).step_by(c);
        std::hint::black_box(lasts().take(LOAD_CHUNKS).fold(0, |sink, &h| sink ^ self.chunks.touch(h)));
        // Every instance's L1 prefix ends where the page walk stopped: from that chunk on,
        // a chunk nobody survives ends every prefix.
        let last_start = out.l1_end() as usize / c;
        let empty = &self.states[EMPTY as usize];
        for (k, &h) in lasts().enumerate() {
            let state = self.chunks.get(h).map_or(empty, |id| &self.states[id as usize]);
            if !out.visit_chunk(k as u32, state) && k >= last_start {
                out.chunks.end = k as u32;
                return;
            }
        }
        out.chunks.end = (hashes.len() / c) as u32;
    }
}

/// What a query's chunk walk keeps for one instance (valid in the query it is stamped with).
#[derive(Clone, Copy, Debug, Default)]
struct ChunkSlot {
    epoch: u32,
    /// Misses (chunks not in L3) this instance survived, counted from the prompt's first
    /// chunk (those before its L1 prefix's end count as survived): it is alive while this
    /// equals the misses so far.
    confirmed: u32,
    /// Its L1 prefix.
    l1: u32,
    /// Blocks from L2.
    l2: u32,
}

/// A query's chunk walk (part of [`PrefixMatches`], reused from query to query).
#[derive(Clone, Debug, Default)]
pub(super) struct ChunkWalk {
    /// Blocks a chunk spans; 0 when the index is not in chunk mode (no walk).
    pub(super) blocks: u32,
    slots: Vec<ChunkSlot>,
    /// Instances that took a chunk from L2, in the order the walk met them.
    pub(super) touched: Vec<u32>,
    /// The chunks not in L3, in order.
    misses: Vec<u32>,
    /// The chunk the walk stopped at (past the last one when it went through).
    pub(super) end: u32,
}

impl ChunkWalk {
    /// Starts a query (`blocks` 0 outside chunk mode), with slots for `instances`.
    pub(super) fn start(&mut self, blocks: u32, instances: u32) {
        self.blocks = blocks;
        if blocks > 0 && self.slots.len() < instances as usize {
            self.slots.resize(instances as usize, ChunkSlot::default());
        }
        self.touched.clear();
        self.misses.clear();
        self.end = 0;
    }

    /// Forgets every slot's stamp (the query epoch wrapped around).
    pub(super) fn reset_epochs(&mut self) {
        self.slots.iter_mut().for_each(|s| s.epoch = 0);
    }

    /// Walks chunk `k`, held as `state` says (L2 holders, in L3 or not), in query `epoch`;
    /// `l1` gives an instance's L1 prefix. Returns whether some instance's prefix goes on
    /// past it (always, for a chunk in L3).
    pub(super) fn visit(&mut self, k: u32, state: &State, epoch: u32, l1: impl Fn(u32) -> u32) -> bool {
        let c = self.blocks;
        let misses = self.misses.len() as u32;
        let mut survived = false;
        for &h in &state.holders {
            debug_assert_eq!(h & 1, 1, "chunks have L2 holders only");
            let instance = h >> 1;
            let slot = &mut self.slots[instance as usize];
            if slot.epoch != epoch {
                let l1 = l1(instance);
                if k < l1 / c {
                    continue; // within its L1 prefix
                }
                let confirmed = self.misses.partition_point(|&m| m < l1 / c) as u32;
                if confirmed != misses {
                    continue; // its prefix ended at a miss before
                }
                *slot = ChunkSlot { epoch, confirmed, l1, l2: 0 };
                self.touched.push(instance);
            } else if slot.confirmed != misses {
                continue;
            }
            slot.l2 += (k + 1) * c - slot.l1.max(k * c);
            slot.confirmed += u32::from(!state.in_l3);
            survived = true;
        }
        if state.in_l3 {
            return true;
        }
        self.misses.push(k);
        survived
    }

    /// Whether the walk of query `epoch` took a chunk from `instance`'s L2.
    pub(super) fn met(&self, instance: u32, epoch: u32) -> bool {
        self.slots.get(instance as usize).is_some_and(|s| s.epoch == epoch)
    }

    /// The blocks `instance`, with an L1 prefix of `l1`, finds in L2 and in all (in query
    /// `epoch`).
    pub(super) fn prefix(&self, instance: u32, l1: u32, epoch: u32) -> (u32, u32) {
        let (confirmed, l2) = match self.slots.get(instance as usize) {
            Some(s) if s.epoch == epoch => (s.confirmed as usize, s.l2),
            // It took nothing from L2: it survived no miss from its start on.
            _ => (self.misses.partition_point(|&m| m < l1 / self.blocks), 0),
        };
        let depth = self.misses.get(confirmed).copied().unwrap_or(self.end) * self.blocks;
        (l2, depth.max(l1))
    }

    /// The prefix any instance finds in L3 alone.
    pub(super) fn shared(&self) -> u32 {
        self.misses.first().copied().unwrap_or(self.end) * self.blocks
    }
}
