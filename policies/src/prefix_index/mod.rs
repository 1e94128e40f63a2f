//! The global prefix index: which instance holds which block in which tier, built only from
//! the instances' KV events, and the longest cached prefix of a request on every instance.
//!
//! A prefix on instance `i` runs as long as each next block is held by `i` (in L1 or L2) or
//! by the shared L3 store; each of its blocks counts in the best tier `i` has it in
//! (L1 > L2 > L3).
//!
//! # Structure
//!
//! ```text
//!  slots:   page name ─▶ page slot                   one entry per page, not per block
//!  pages:   p0  name a  hashes [a  b  c  d ]          a page's blocks, in the order stored
//!                       states [7  7  9  0 ]
//!           p1  name e  hashes [e  f  g  x  y]        continuations of one prefix share a page
//!  states:  7 = {inst-3 L1, inst-8 L1, inst-8 L2}     interned holder sets (+ "in L3"),
//!           9 = {inst-3 L1} + L3,   0 = {}            bitmaps for large ones
//! ```
//!
//! Block hashes are chained from the root, so the hash of a chain's block at depth `32k`
//! names the prefix up to it, and with it the *page* of the chain's next 32 depths (the
//! stores below L1 are kept by page too: `engine::kv::PageKey`). Every event names its
//! block's page, and a prompt gives the page of each of its blocks, so the map from hash to
//! place holds one entry per page: a few hundred thousand entries where blocks number in the
//! millions, small enough to stay in the caches. An event costs a probe of that map (skipped
//! when it is on the page of the event before, as the events of a run are) and a look at a
//! page; a query reads a prompt's blocks page by page, in sequence. Each block carries the id
//! of its holder set, interned, so that a run of blocks held alike is visited once per
//! holder, not once per block and holder.
//!
//! | identifier | why |
//! | --- | --- |
//! | `slots` | events and prompts name pages by hash; one map probe a page, not a block |
//! | `Page` | 12 bytes a block (hash, state id), stored runs in order, read in order by queries |
//! | `State` | one holder set per run of equally held blocks; `Meta` keeps the fields each event touches dense |
//! | `transitions` | events doing the same thing (instance 3 stores in L1) to blocks in the same state cost one cache probe each |
//! | `Step`, `apply_batch` | a batch comes as runs (`engine::kv::KvRun`: one stream, one page, a list of hashes); a run's next block beside the last and in the same state takes the run's transition without decoding, a search or a lookup; the holder-set counts move once |
//! | `fuse` | a demotion publishes "stored in L2", "stored in L3", "removed from L1" over the same blocks, other pages' runs between: the later runs are taken into the first (found by page, checked block by block), its blocks found once and moved to their last holder set in one transition |
//! | `link_runs` | each run of a batch linked to the batch's next run on its page, once, so that `fuse` visits a page's runs only (a demotion of `k` pages has each page's runs `k` runs apart: a scan was `O(k²)` a demotion) |
//! | `dormant` | a holder set no block has any more stays interned, its transitions cached, until 256 pile up: blocks come back to the same sets over and over |
//! | `prefetch_removals` | a full L2's or L3's victims, and L1's (an allocation's evictions), are on pages no event has touched for long: a batch's removals' map entries, then their pages, then their blocks are loaded before it is applied, each level's misses side by side (a gathered list of slots between), instead of three in a row a run; L1's take every line of a small page (an evicted leaf is taken down the page from its deepest block), and in chunk mode a demotion's new chunks' map entries are loaded too |
//! | `store_new_page` | a run storing on a page the index lacks (a prompt's blocks past what is cached fill new pages) is appended as one copy in one state, its counts moved once: no look for each block, nor a first block stored apart |
//! | `Page::run_start` | a run's first block is looked for where the page's last run started (a demotion is published tier by tier over the same blocks) before a scan |
//! | tombstones | a block nobody holds keeps its place (state `EMPTY`) until its page is mostly tombstones: a demotion published as "removed here, stored there" finds it again, and a run of blocks leaving (a full L3's victims) takes the run path, the page freed or compacted once after it |
//! | `Base` | a query's first run, when held by many (a fleet-wide system prompt), is recorded whole, not per holder |
//! | `chunks`, `ChunkWalk` | in chunk mode (below), the lower tiers' chunks: one map entry and one holder set a chunk, walked after the pages |
//!
//! # Chunk mode
//!
//! [`PrefixIndex::with_chunk_blocks`] makes an index for engines whose L2 and L3 keep KV in
//! chunks of `c` blocks of a chain (vLLM's offloaded blocks, LMCache's chunks). Their events
//! name chunks by the hash of their last block (chunk `k` spans depths `kc..(k+1)c`), and are
//! kept in a map of their own, chunk hash to holder set (L2 holders, in L3 or not): lower-tier
//! work costs per chunk, and the pages hold L1 only. An instance's prefix is then its L1
//! prefix, continued chunk by chunk from the chunk it ends in (from its end within that
//! chunk) while each chunk's last block is in the prompt and the instance holds the chunk in
//! L2 (counted in L2) or it is in L3 (counted in L3). With `c` = 1 the index is the one above,
//! by the same code path.
//!
//! # Cost
//!
//! | operation | cost |
//! | --- | --- |
//! | `apply` (Stored, Removed) | a page-map probe (none on the page of the event before), a page access; O(holders) only when a new holder set is formed |
//! | `match_prefix` | one page-map probe per page of the prompt, 12 sequential bytes per block, O(holders) per run after the first |
//! | `PrefixMatches::get` | O(1) |
//! | `remove_instance`, `Cleared` | O(states × holders), plus one pass over the pages (and the chunks) if blocks (or chunks) lost their last holder |
//! | chunk mode: an L2 or L3 event | a chunk-map probe; O(holders) only when a new holder set is formed |
//! | chunk mode: `match_prefix` | the page walk, then a chunk-map probe per chunk of the prompt, O(holders in L2) per chunk; O(log chunks) an instance met first |
//! | memory | 12 bytes a block in pages plus growth slack, the page map (16 bytes a page at 40-81% load) |
//!
//! Measured by `fleetplane-bench index` (docs/BENCHMARKS.md).
//!
//! # Exactness
//!
//! Prompts and events must be chains from the root (as engines, the gateway and the trace
//! readers make them) with pages named as `engine::kv::PageKey` names them: a prompt that
//! starts mid-chain finds nothing. Within that, nothing is assumed of the order of events or
//! of which tiers hold what: holes anywhere are matched exactly, a page's order is only a
//! guess at where the next block is (checked by comparing hashes), and interning is only an
//! optimisation (two ids with equal sets split a run in two, with the same result).

use engine::block_map::{BlockMap, Probe};
use engine::kv::{KvEvent, KvEvents, KvRun, Tier, PAGE_BLOCKS};
use engine::{BlockHash, InstanceId};
use rustc_hash::FxHashMap;
use std::ops::Range;

/// Blocks of a prefix matched on one instance, by the tier they would come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierMatch {
    pub l1: u32,
    pub l2: u32,
    pub l3: u32,
}

impl TierMatch {
    pub fn total(&self) -> u32 {
        self.l1 + self.l2 + self.l3
    }
}

/// The state id of a block nobody holds (a tombstone, until its page is compacted).
const EMPTY: u32 = 0;
/// No state: what an unused transition cache slot starts from.
const NO_STATE: u32 = u32::MAX;
/// Slots of the direct-mapped transition cache.
const TRANSITION_BITS: u32 = 12;
/// Runs a batch's run storing in L2 or L3 looks ahead for runs over the same blocks.
const FUSE_WINDOW: usize = 128;
/// Slots of the table [`link_runs`] finds the next run on a page with.
const LINK_BITS: u32 = 10;
/// No later run on the page (past any batch's end).
const NO_RUN: u32 = u32::MAX;
/// Page entries a cache line holds, at least (64 bytes, 12 an entry).
const LINE_ENTRIES: usize = 5;
/// Pages [`PrefixIndex::prefetch_removals`] gathers before loading them.
const PREFETCH_PAGES: usize = 32;
/// Holder sets kept dormant, at most, before they are freed.
const DORMANT_STATES: usize = if cfg!(test) { 4 } else { 256 };

#[cfg(test)]
mod chunk_tests;
mod chunks;
mod holders;
mod matches;
mod page;
#[cfg(test)]
mod tests;

use holders::{holder, holder_fp, Change, Meta, State, Transition, L3_FP, NO_TRANSITION};
pub use matches::PrefixMatches;
use page::Page;

/// Takes into run `runs.start` of `events` (`change` on its page's blocks, storing in L2 or
/// L3) the later runs of the batch before `runs.end` (a window with no `Cleared` in it) that
/// go over the same blocks in the same order in other tiers (a demotion publishes "stored in
/// L2", "stored in L3", "removed from L1" over the blocks of a page, other pages' runs and
/// the stores' victims between): their blocks are found once and moved from their first
/// state to their last in one transition. The runs on the page are followed by `next` (see
/// [`link_runs`]). Returns the joint change, marks the runs taken in `fused` and lists their
/// streams in `partners`.
///
/// Exact: a run taken is applied before the runs it came after, which are other pages'
/// (other blocks) or this page's in other tiers than its own (other holders: the two
/// commute). A run of this page in a tier already touched, by the runs taken or skipped,
/// is never taken past.
fn fuse(
    events: &KvEvents,
    runs: Range<usize>,
    next: &[u32],
    fused: &mut [bool],
    instance: InstanceId,
    mut change: Change,
    partners: &mut [Option<usize>; 2],
) -> Change {
    let KvRun::Stored { tier, hashes, .. } = events.run(runs.start) else { return change };
    let mut touched = 1u8 << tier.index();
    let mut taken = 0;
    let mut j = next[runs.start] as usize;
    while j < runs.end {
        let (tier, more, stream, run) = match events.run(j) {
            KvRun::Stored { tier, hashes, .. } => (tier, Change::stored(instance, tier), tier.index(), hashes),
            KvRun::Removed { tier, hashes, .. } => (tier, Change::removed(instance, tier), 3 + tier.index(), hashes),
            KvRun::Cleared => break,
        };
        let bit = 1u8 << tier.index();
        // A run taken by an earlier one counts as touching its tier (it was applied first:
        // the runs taken now must not pass it either way).
        if touched & bit == 0 && !fused[j] && same(run, hashes) {
            change = change.and(more);
            fused[j] = true;
            partners[taken] = Some(stream);
            taken += 1;
        }
        touched |= bit;
        // A demotion's L1 removal is its last run: nothing more to take.
        if touched & 1 != 0 {
            break;
        }
        j = next[j] as usize;
    }
    change
}

/// Sets `next[i]` to the batch's next run on run `i`'s page, for the runs from `from` on,
/// going through them backwards with `recent`, the last run seen of each page by a few bits
/// of its name: so a look ahead for a page visits that page's runs only, not every run
/// between (a demotion of `k` pages publishes each page's runs `k` runs apart). `NO_RUN` when
/// there is none, or when another page's run took the slot between the two (the look ahead
/// then stops short, as at the end of its window: never wrong). Runs are numbered from
/// `base`, the runs of the batches linked before, so that an entry left by one of them is
/// told by its number.
fn link_runs(events: &KvEvents, from: usize, next: &mut Vec<u32>, recent: &mut [(BlockHash, u64)], base: u64) {
    let n = events.run_count();
    next.clear();
    next.resize(n, NO_RUN);
    for i in (from..n).rev() {
        let page = events.run_page(i);
        let slot = &mut recent[link_slot(page, recent.len())];
        let (seen, j) = *slot;
        if seen == page && j >= base {
            next[i] = (j - base) as u32;
        }
        *slot = (page, base + i as u64);
    }
}

/// The entry of a table of `len` (a power of two, at least 2) that [`link_runs`] keeps
/// `page`'s last run in: the top bits of the name times `2^64/φ`.
fn link_slot(page: BlockHash, len: usize) -> usize {
    (page.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - len.trailing_zeros())) as usize
}

/// Whether two runs hold the same blocks (or-ing the differences: no branch a block).
#[inline]
fn same(a: &[BlockHash], b: &[BlockHash]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |d, (x, y)| d | (x.0 ^ y.0)) == 0
}

/// What an event did to a block: its stream (stored or removed, by tier), page and place,
/// and its state before and after.
#[derive(Clone, Copy, Debug)]
struct Step {
    stream: usize,
    page: BlockHash,
    loc: Loc,
    from: u32,
    to: u32,
}

/// Where a block is: `pages[slot]`, position `idx`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Loc {
    slot: u32,
    idx: u32,
}

/// Which instance holds which block in which tier, from KV events (see the module
/// documentation for the structure and its costs).
#[derive(Clone, Debug)]
pub struct PrefixIndex {
    /// Blocks a page spans ([`PAGE_BLOCKS`], what the engines name pages by).
    page_blocks: u32,
    /// Page name to its slot in `pages`.
    slots: BlockMap<u32>,
    /// Pages in slots; an empty page is a free slot (listed in `free_pages`).
    pages: Vec<Page>,
    free_pages: Vec<u32>,
    /// Blocks held by someone (tombstones not counted).
    blocks: usize,
    /// Holder sets by id; `states[EMPTY]` is the empty set and is never freed.
    states: Vec<State>,
    /// Reference counts and generations of `states`, by the same id.
    meta: Vec<Meta>,
    free_states: Vec<u32>,
    /// States no position has any more, kept as they were (interned, their cached
    /// transitions valid) until [`DORMANT_STATES`] of them pile up: blocks leave a holder set
    /// and come back to it over and over (a demotion goes through the same sets every time),
    /// and a set kept is found again instead of formed. Names an id once at most
    /// (`State::dormant`); one may be in use again by the time they are freed.
    dormant: Vec<u32>,
    /// Fingerprint to state id, for the states that are interned (a fingerprint collision
    /// leaves the newer state out: duplicates only split runs, they do not change results).
    intern: FxHashMap<u64, u32>,
    transitions: Box<[Transition]>,
    /// For each stream of events (stored or removed, by tier), the page of its last event and
    /// the block's place there: the next event of a stream is usually on the same page, next
    /// to it. An engine's events interleave streams (evicting one block from L1 stores it in
    /// L2 and L3 and pushes other blocks out of both), each running along its own pages.
    cursors: [Option<(BlockHash, Loc)>; 6],
    /// The stream of the last event (a demotion's next event names the same block).
    last_stream: usize,
    /// Scratch for forming holder sets.
    scratch: Vec<u32>,
    /// Scratch of `apply_batch`: the runs of the batch already applied with an earlier one.
    fused: Vec<bool>,
    /// Scratch of `apply_batch`: each run's next run on its page ([`link_runs`]), the table
    /// that finds them (kept from batch to batch: never cleared) and the number the next
    /// batch's runs start from there.
    next: Vec<u32>,
    recent: Box<[(BlockHash, u64)]>,
    linked_runs: u64,
    /// One more than the largest instance id ever stored as a holder: the size of a query's
    /// per-instance table.
    instances: u32,
    /// Blocks a chunk of the lower tiers spans: 1 keeps L2 and L3 by block, in the pages;
    /// more keeps them by chunk, in `chunks` (see the `chunks` module).
    chunk_blocks: u32,
    /// In chunk mode, each chunk held in L2 or L3, by the hash of its last block, to its
    /// holder set (L2 holders and L3; interned with the blocks' own).
    chunks: BlockMap<u32>,
}

impl Default for PrefixIndex {
    fn default() -> PrefixIndex {
        PrefixIndex::new()
    }
}

impl PrefixIndex {
    pub fn new() -> PrefixIndex {
        PrefixIndex::with_page_blocks(PAGE_BLOCKS as u32)
    }

    /// An index of pages of `page_blocks` blocks: the engines' [`PAGE_BLOCKS`], except in
    /// tests that want short prompts to span pages.
    pub fn with_page_blocks(page_blocks: u32) -> PrefixIndex {
        assert!(page_blocks > 0, "pages must hold blocks");
        PrefixIndex {
            page_blocks,
            slots: BlockMap::default(),
            pages: Vec::new(),
            free_pages: Vec::new(),
            blocks: 0,
            states: vec![State::default()],
            meta: vec![Meta::default()],
            free_states: Vec::new(),
            dormant: Vec::new(),
            intern: FxHashMap::default(),
            transitions: vec![NO_TRANSITION; 1 << TRANSITION_BITS].into_boxed_slice(),
            cursors: [None; 6],
            last_stream: 0,
            scratch: Vec::new(),
            fused: Vec::new(),
            next: Vec::new(),
            // Numbered from 1: the table's first entries name no run.
            recent: vec![(BlockHash(0), 0); 1 << LINK_BITS].into_boxed_slice(),
            linked_runs: 1,
            instances: 0,
            chunk_blocks: 1,
            chunks: BlockMap::default(),
        }
    }

    /// An index whose lower tiers (L2, L3) keep KV in chunks of `chunk_blocks` blocks of a
    /// chain, their events naming chunks by their last block's hash: a power of two dividing
    /// [`PAGE_BLOCKS`], 1 being an index of blocks ([`PrefixIndex::new`]). Panics otherwise.
    pub fn with_chunk_blocks(chunk_blocks: u32) -> PrefixIndex {
        PrefixIndex::new().chunked(chunk_blocks)
    }

    /// This index with chunks of `chunk_blocks` blocks (tests: on pages of their own size).
    fn chunked(mut self, chunk_blocks: u32) -> PrefixIndex {
        assert!(
            chunk_blocks.is_power_of_two() && self.page_blocks.is_multiple_of(chunk_blocks),
            "a chunk of {chunk_blocks} blocks does not divide a page of {}",
            self.page_blocks
        );
        self.chunk_blocks = chunk_blocks;
        self
    }

    /// Blocks a chunk of the lower tiers spans (1: they are kept by block).
    pub fn chunk_blocks(&self) -> u32 {
        self.chunk_blocks
    }

    /// Chunks of the lower tiers indexed (none with chunks of 1 block).
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// Blocks indexed: the distinct blocks in the pages (any tier; in chunk mode L1 only),
    /// plus the blocks of the chunks held in L2 or L3 (a block both in L1 and in a chunk
    /// counts twice: a chunk's blocks are not told apart).
    pub fn blocks(&self) -> usize {
        self.blocks + self.chunks.len() * self.chunk_blocks as usize
    }

    /// Heap bytes held, estimated from capacities (the page map, the pages, the chunk map,
    /// holder sets and their bitmaps, the intern map and the transition cache).
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        let pages = self.slots.bytes()
            + self.pages.capacity() * size_of::<Page>()
            + self.pages.iter().map(Page::heap_bytes).sum::<usize>();
        let states = self.states.capacity() * size_of::<State>()
            + self.meta.capacity() * size_of::<Meta>()
            + self
                .states
                .iter()
                .map(|s| s.holders.capacity() * 4 + s.bits.as_ref().map_or(0, |b| b.len() * 8))
                .sum::<usize>();
        let intern = self.intern.capacity() * (size_of::<(u64, u32)>() + 1);
        pages + self.chunks.bytes() + states + intern + self.transitions.len() * size_of::<Transition>()
    }

    /// Applies one event published by `instance`. L3 events describe the shared store,
    /// whichever instance published them. In chunk mode, L2 and L3 events name chunks.
    pub fn apply(&mut self, instance: InstanceId, event: &KvEvent) {
        self.apply_one(instance, event);
    }

    /// [`PrefixIndex::apply`], telling what it did to a block (for [`PrefixIndex::apply_batch`]'s
    /// runs).
    fn apply_one(&mut self, instance: InstanceId, event: &KvEvent) -> Option<Step> {
        match *event {
            KvEvent::Stored { tier, hash, .. } if self.by_chunk(tier) => {
                self.apply_chunk(hash, Change::stored(instance, tier), true);
                None
            }
            KvEvent::Removed { tier, hash, .. } if self.by_chunk(tier) => {
                self.apply_chunk(hash, Change::removed(instance, tier), false);
                None
            }
            KvEvent::Stored { tier, hash, page } => {
                Some(self.store(std::slice::from_ref(&hash), page, tier.index(), Change::stored(instance, tier)).0)
            }
            KvEvent::Removed { tier, hash, page } => {
                self.unstore(hash, page, 3 + tier.index(), Change::removed(instance, tier))
            }
            KvEvent::Cleared => {
                self.remove_instance(instance);
                None
            }
        }
    }

    /// Whether `tier`'s events name chunks (in chunk mode, L2's and L3's).
    #[inline(always)]
    fn by_chunk(&self, tier: Tier) -> bool {
        self.chunk_blocks > 1 && tier != Tier::L1
    }

    /// Applies a batch's events in order, as [`PrefixIndex::apply`] does one by one, a run of
    /// the batch at a time (one stream, one page). Within a run, a block beside the one before
    /// and in the same state takes that block's transition directly (no search, no transition
    /// lookup, the holder sets' counts moved once for all of them); any other goes the general
    /// way and starts a new stretch. A run storing in L2 or L3 takes with it the later runs
    /// of the batch over the same blocks in other tiers (see [`PrefixIndex::fuse`]).
    pub fn apply_batch(&mut self, instance: InstanceId, events: &KvEvents) {
        std::hint::black_box(self.prefetch_removals(events));
        let mut fused = std::mem::take(&mut self.fused);
        fused.clear();
        fused.resize(events.run_count(), false);
        // Linked when a run first looks ahead (most batches, a commit's, never do).
        let mut linked = false;
        // Where the look ahead stops: the next `Cleared`.
        let mut cleared = events.next_cleared(0);
        for i in 0..events.run_count() {
            if i == cleared {
                cleared = events.next_cleared(i + 1);
            }
            if fused[i] {
                continue;
            }
            let (tier, page, hashes, stored) = match events.run(i) {
                KvRun::Stored { tier, page, hashes } => (tier, page, hashes, true),
                KvRun::Removed { tier, page, hashes } => (tier, page, hashes, false),
                KvRun::Cleared => {
                    self.remove_instance(instance);
                    continue;
                }
            };
            let (stream, mut change) = if stored {
                (tier.index(), Change::stored(instance, tier))
            } else {
                (3 + tier.index(), Change::removed(instance, tier))
            };
            if self.by_chunk(tier) {
                // Chunks: one map entry each, nothing to fuse with (a demotion's L1 run
                // names blocks, not chunks).
                for &hash in hashes {
                    self.apply_chunk(hash, change, stored);
                }
                continue;
            }
            let mut partners = [None; 2];
            if stored && tier != Tier::L1 {
                if !linked {
                    link_runs(events, i, &mut self.next, &mut self.recent, self.linked_runs);
                    self.linked_runs += events.run_count() as u64;
                    linked = true;
                }
                let end = cleared.min(i + 1 + FUSE_WINDOW);
                change = fuse(events, i..end, &self.next, &mut fused, instance, change, &mut partners);
            }
            let mut rest = hashes;
            while let Some(&hash) = rest.first() {
                let (step, applied) = if stored {
                    let (step, n) = self.store(rest, page, stream, change);
                    (Some(step), n)
                } else {
                    (self.unstore(hash, page, stream, change), 1)
                };
                rest = &rest[applied..];
                if let Some(run) = step.filter(|s| s.to != s.from) {
                    rest = &rest[self.extend_run(run, rest)..];
                }
            }
            // The partners' streams end where their runs would have.
            for partner in partners.into_iter().flatten() {
                self.cursors[partner] = self.cursors[stream];
            }
        }
        self.fused = fused;
    }

    /// Loads what the batch's removals (and in chunk mode its stored chunks) will read
    /// first, all at once, so that their cache misses overlap: a full tier's victims are its oldest blocks, on pages an
    /// event has not touched for long, and each run's start otherwise waits on three misses
    /// in a row (the page's map entry, the page, its blocks where the run's first is looked
    /// for). Level by level, with no dependence from a run to the next, for the processor to
    /// run ahead through the misses; returns what it read (a prefetch in safe code).
    fn prefetch_removals(&self, events: &KvEvents) -> u64 {
        // L1's removals too (an allocation's evictions, leaf first: L1's oldest blocks; a
        // demotion's by block, whose L1 runs name the pages its stores' runs are taken into).
        let l1 = events.l1_removal_runs();
        // One run has nothing to overlap with (and most batches, a commit's, have none).
        if events.lower_removal_runs() + l1 < 2 {
            return 0;
        }
        let mut sink = 0;
        // The runs' slots, gathered first: the map entries' misses side by side, then the
        // pages', then their blocks', instead of three in a row a run.
        let mut slots = [0u32; PREFETCH_PAGES];
        let mut n = 0;
        for run in events.runs() {
            let (tier, page, hashes, removed) = match run {
                KvRun::Removed { tier, page, hashes } => (tier, page, hashes, true),
                KvRun::Stored { tier, page, hashes } => (tier, page, hashes, false),
                KvRun::Cleared => continue,
            };
            if self.by_chunk(tier) {
                // Chunks are found by their own map entries, one a chunk, anywhere in a map
                // of every chunk held: a demotion's new chunks too.
                sink ^= hashes.iter().fold(0, |sink, &h| sink ^ self.chunks.touch(h));
                continue;
            }
            if !removed {
                continue;
            }
            if tier == Tier::L1 && l1 == 0 {
                continue;
            }
            let Some(slot) = self.slots.get(page) else { continue };
            // Small pages' L1 runs take every line (the top bit marks them).
            slots[n] = slot | u32::from(tier == Tier::L1) << 31;
            n += 1;
            if n == slots.len() {
                sink ^= self.load_removal_pages(&slots);
                n = 0;
            }
        }
        sink ^= self.load_removal_pages(&slots[..n]);
        sink
    }

    /// Loads the pages in `slots` (found by [`PrefixIndex::prefetch_removals`]), their headers
    /// all first, then the blocks at each one's `run_start`, and every line of a small page
    /// whose slot has the top bit set (an evicted leaf's blocks are taken down the page from
    /// its deepest, a stretch of lines the processor does not see coming).
    fn load_removal_pages(&self, slots: &[u32]) -> u64 {
        let page = |slot: u32| &self.pages[(slot & !(1 << 31)) as usize];
        let mut sink = slots.iter().fold(0, |sink, &slot| sink ^ page(slot).len());
        for &slot in slots {
            let p = page(slot);
            sink ^= p.entries.get(p.run_start as usize).map_or(0, |e| e.value as usize);
            if slot >> 31 != 0 && p.len() <= 2 * self.page_blocks as usize {
                sink ^= p.entries.iter().step_by(LINE_ENTRIES).fold(0, |sink, e| sink ^ e.value as usize);
            }
        }
        sink as u64
    }

    /// Applies the blocks at the start of `hashes` (on the page and stream of `run`) that
    /// continue `run`: each on a block beside the one before, in the state the run changes, or
    /// a block new to the page stored after the run's last, the page's last. Returns how many
    /// it applied.
    fn extend_run(&mut self, mut run: Step, hashes: &[BlockHash]) -> usize {
        let grow = run.from == EMPTY && run.stream < 3;
        let p = &mut self.pages[run.loc.slot as usize];
        let (applied, at) =
            p.extend_run(run.loc.idx as usize, hashes, (run.from, run.to), grow, self.page_blocks as usize);
        if applied > 0 {
            run.loc.idx = at as u32;
            // The cursor first: freeing the page (its last block leaving) clears it.
            self.move_cursor(run.stream, run.page, run.loc);
            if run.from == EMPTY {
                self.blocks += applied;
            }
            if run.to == EMPTY {
                // Blocks left to nobody: tombstones, the page freed or compacted once for
                // all of them (where it is in the page is only a guess for later lookups).
                self.blocks -= applied;
            } else {
                self.meta[run.to as usize].refs += applied as u32;
            }
            self.release_n(run.from, applied as u32);
            if run.to == EMPTY {
                self.tidy(run.loc.slot);
            }
        }
        applied
    }

    /// Applies `change` (a store) to the first block of `hashes` (not empty), found or added
    /// at the end of `page`; on a page new to the index, to as many of them as
    /// [`Page::push_new`] takes, appended at once. Returns the step of the last block applied
    /// and how many it applied.
    fn store(&mut self, hashes: &[BlockHash], page: BlockHash, stream: usize, change: Change) -> (Step, usize) {
        let loc = match self.find_or_add(hashes[0], page, stream) {
            Ok(loc) => loc,
            Err(vacancy) => return self.store_new_page(vacancy, hashes, page, stream, change),
        };
        self.pages[loc.slot as usize].run_start = loc.idx;
        let (from, to) = self.change_at(loc, change);
        self.move_cursor(stream, page, loc);
        (Step { stream, page, loc, from, to }, 1)
    }

    /// [`PrefixIndex::store`] on a page the index lacks: a prompt's blocks past what is
    /// cached come as runs filling new pages, appended as one copy, in one state, the counts
    /// moved once (as a run found block by block and extended would, without the looks).
    fn store_new_page(
        &mut self,
        vacancy: usize,
        hashes: &[BlockHash],
        page: BlockHash,
        stream: usize,
        change: Change,
    ) -> (Step, usize) {
        let slot = engine::slots::reuse(&mut self.pages, &mut self.free_pages);
        self.slots.fill(vacancy, page, slot);
        let to = self.transition(EMPTY, change);
        debug_assert_ne!(to, EMPTY, "a store holds its blocks");
        let p = &mut self.pages[slot as usize];
        p.name = page;
        // A new page holds nothing: the run's first block at least goes in.
        let n = p.push_new(hashes, to, self.page_blocks as usize);
        p.run_start = 0;
        self.blocks += n;
        self.meta[to as usize].refs += n as u32;
        let loc = Loc { slot, idx: n as u32 - 1 };
        self.move_cursor(stream, page, loc);
        (Step { stream, page, loc, from: EMPTY, to }, n)
    }

    fn unstore(&mut self, hash: BlockHash, page: BlockHash, stream: usize, change: Change) -> Option<Step> {
        let loc = self.find(hash, page, stream)?;
        self.pages[loc.slot as usize].run_start = loc.idx;
        // The cursor first: freeing the page (its last block leaving) clears it.
        self.move_cursor(stream, page, loc);
        let (from, to) = self.change_at(loc, change);
        Some(Step { stream, page, loc, from, to })
    }

    /// Puts stream `stream`'s cursor, and the last event's, on the block at `loc` of `page`.
    #[inline(always)]
    fn move_cursor(&mut self, stream: usize, page: BlockHash, loc: Loc) {
        self.cursors[stream] = Some((page, loc));
        self.last_stream = stream;
    }

    /// The slot of `page` and the position of the block an event of the same page was on,
    /// when the stream's last event, or the last event, was on it: no map probe needed.
    #[inline]
    fn cursor(&self, page: BlockHash, stream: usize) -> Option<(u32, usize)> {
        let on_page = |cursor: &Option<(BlockHash, Loc)>| match cursor {
            Some((p, loc)) if *p == page => {
                debug_assert_eq!(self.pages[loc.slot as usize].name, page);
                Some((loc.slot, loc.idx as usize))
            }
            _ => None,
        };
        on_page(&self.cursors[stream]).or_else(|| on_page(&self.cursors[self.last_stream]))
    }

    fn find(&self, hash: BlockHash, page: BlockHash, stream: usize) -> Option<Loc> {
        let (slot, near) = self.cursor(page, stream).or_else(|| self.slots.get(page).map(|slot| (slot, 0)))?;
        let idx = self.pages[slot as usize].find(hash, near)?;
        Some(Loc { slot, idx: idx as u32 })
    }

    /// Where `hash` is, added (nobody holding it yet) at the end of its page if new to the
    /// page; when the page itself is new to the index, its vacancy in the page map (nothing
    /// added).
    fn find_or_add(&mut self, hash: BlockHash, page: BlockHash, stream: usize) -> Result<Loc, usize> {
        let (slot, hint) = match self.cursor(page, stream) {
            Some(found) => found,
            None => match self.slots.probe(page) {
                Probe::Found(slot) => (slot, 0),
                Probe::Vacant(vacancy) => return Err(vacancy),
            },
        };
        let p = &mut self.pages[slot as usize];
        let idx = match p.find(hash, hint) {
            Some(idx) => idx,
            None => p.push(hash, EMPTY, self.page_blocks as usize),
        };
        Ok(Loc { slot, idx: idx as u32 })
    }

    /// Applies `change` to the block at `loc`; returns its states before and after.
    fn change_at(&mut self, loc: Loc, change: Change) -> (u32, u32) {
        let from = self.pages[loc.slot as usize].state(loc.idx as usize);
        let to = self.transition(from, change);
        if to != from {
            self.set(loc, from, to);
        }
        (from, to)
    }

    /// Moves the block at `loc` from state `from` to `to` (they differ): reference counts and
    /// the count of blocks held; a block left to nobody becomes a tombstone.
    #[inline(always)]
    fn set(&mut self, loc: Loc, from: u32, to: u32) {
        self.pages[loc.slot as usize].set_state(loc.idx as usize, from, to);
        if from == EMPTY {
            self.blocks += 1;
        }
        if to != EMPTY {
            self.meta[to as usize].refs += 1;
        }
        self.release(from);
        if to == EMPTY {
            self.tombstone(loc.slot);
        }
    }

    /// A block of the page in `slot` became a tombstone: see [`PrefixIndex::tidy`].
    #[inline(never)]
    fn tombstone(&mut self, slot: u32) {
        self.blocks -= 1;
        self.tidy(slot);
    }

    /// Blocks of the page in `slot` became tombstones: a page left with tombstones only is
    /// freed, one mostly of them compacted.
    fn tidy(&mut self, slot: u32) {
        let p = &mut self.pages[slot as usize];
        if p.live() == 0 {
            self.free_page(slot);
        } else if p.mostly_dead() {
            p.retain(|_, state| state != EMPTY);
        }
    }

    /// The state `change` turns `from` into, from the cache or formed and interned.
    fn transition(&mut self, from: u32, change: Change) -> u32 {
        let code = change.code();
        let slot = (u64::from(from) << 32 ^ code).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - TRANSITION_BITS);
        let t = self.transitions[slot as usize];
        if t.from == from
            && t.change == code
            && self.meta[from as usize].gen == t.from_gen
            && self.meta[t.to as usize].gen == t.to_gen
        {
            return t.to;
        }
        let to = self.form(from, change);
        let (from_gen, to_gen) = (self.meta[from as usize].gen, self.meta[to as usize].gen);
        self.transitions[slot as usize] = Transition { from, to, change: code, from_gen, to_gen };
        to
    }

    fn form(&mut self, from: u32, change: Change) -> u32 {
        let s = &self.states[from as usize];
        let (mut in_l3, mut fp) = (s.in_l3, s.fp);
        self.scratch.clear();
        self.scratch.extend_from_slice(&s.holders);
        // A change touches a tier once at most, so its parts apply in any order.
        let mut changed = false;
        for tier in [Tier::L1, Tier::L2] {
            let Some(store) = change.on(tier) else { continue };
            let h = change.holder(tier);
            match (self.scratch.binary_search(&h), store) {
                (Err(p), true) => {
                    self.scratch.insert(p, h);
                    fp = fp.wrapping_add(holder_fp(h));
                    self.instances = self.instances.max((h >> 1) + 1);
                    changed = true;
                }
                (Ok(p), false) => {
                    self.scratch.remove(p);
                    fp = fp.wrapping_sub(holder_fp(h));
                    changed = true;
                }
                _ => {}
            }
        }
        if let Some(store) = change.on(Tier::L3).filter(|&store| store != in_l3) {
            in_l3 = store;
            fp = if store { fp.wrapping_add(L3_FP) } else { fp.wrapping_sub(L3_FP) };
            changed = true;
        }
        if !changed {
            return from;
        }
        if self.scratch.is_empty() && !in_l3 {
            return EMPTY;
        }
        if let Some(&id) = self.intern.get(&fp) {
            let s = &self.states[id as usize];
            if s.in_l3 == in_l3 && s.holders == self.scratch {
                return id;
            }
        }
        let holders = self.scratch.clone();
        let id = match self.free_states.pop() {
            Some(id) => id,
            None => {
                self.states.push(State::default());
                self.meta.push(Meta::default());
                self.states.len() as u32 - 1
            }
        };
        let s = &mut self.states[id as usize];
        s.set_holders(holders, in_l3);
        debug_assert_eq!(self.meta[id as usize].refs, 0);
        debug_assert_eq!(s.fp, fp);
        self.intern.entry(fp).or_insert(id);
        id
    }

    /// One position fewer has state `id` (inlined: every event releases a state; freeing one
    /// is rare).
    #[inline]
    fn release(&mut self, id: u32) {
        self.release_n(id, 1);
    }

    /// `n` positions fewer have state `id`.
    #[inline]
    fn release_n(&mut self, id: u32, n: u32) {
        if id == EMPTY {
            return;
        }
        let m = &mut self.meta[id as usize];
        m.refs -= n;
        if m.refs == 0 {
            self.rest(id);
        }
    }

    /// State `id` is no position's any more: kept dormant, the dormant ones freed once they
    /// are many (those not in use again).
    #[inline(never)]
    fn rest(&mut self, id: u32) {
        let s = &mut self.states[id as usize];
        if !s.dormant {
            s.dormant = true;
            self.dormant.push(id);
        }
        if self.dormant.len() > DORMANT_STATES {
            let mut dormant = std::mem::take(&mut self.dormant);
            for id in dormant.drain(..) {
                self.states[id as usize].dormant = false;
                if self.meta[id as usize].refs == 0 {
                    self.free_state(id);
                }
            }
            self.dormant = dormant;
        }
    }

    /// Frees state `id`, which no position has any more.
    #[inline(never)]
    fn free_state(&mut self, id: u32) {
        let m = &mut self.meta[id as usize];
        m.gen = m.gen.wrapping_add(1);
        let s = &mut self.states[id as usize];
        if self.intern.get(&s.fp) == Some(&id) {
            self.intern.remove(&s.fp);
        }
        s.set_holders(Vec::new(), false);
        self.free_states.push(id);
    }

    /// Frees the slot of a page left empty.
    fn free_page(&mut self, slot: u32) {
        let page = &mut self.pages[slot as usize];
        self.slots.remove(page.name);
        page.clear(self.page_blocks as usize);
        self.free_pages.push(slot);
        for cursor in &mut self.cursors {
            if cursor.is_some_and(|(_, loc)| loc.slot == slot) {
                *cursor = None;
            }
        }
    }

    /// Forgets everything `instance` held in its own tiers (it went down or was cleared).
    /// Holder sets change in place, so this costs O(states), plus one pass over the pages
    /// and the chunks when some blocks or chunks were held by the instance alone.
    pub fn remove_instance(&mut self, instance: InstanceId) {
        let (l1, l2) = (holder(instance, Tier::L1), holder(instance, Tier::L2));
        let mut emptied = vec![false; self.states.len()];
        let mut any_emptied = false;
        for (id, (s, m)) in self.states.iter_mut().zip(&mut self.meta).enumerate().skip(1) {
            if m.refs == 0 || !(s.holders.binary_search(&l1).is_ok() || s.holders.binary_search(&l2).is_ok()) {
                continue;
            }
            if self.intern.get(&s.fp) == Some(&(id as u32)) {
                self.intern.remove(&s.fp);
            }
            let mut holders = std::mem::take(&mut s.holders);
            holders.retain(|&h| h != l1 && h != l2);
            s.set_holders(holders, s.in_l3);
            m.gen = m.gen.wrapping_add(1);
            if s.is_empty() {
                emptied[id] = true;
                any_emptied = true;
            } else {
                self.intern.entry(s.fp).or_insert(id as u32);
            }
        }
        if !any_emptied {
            return;
        }
        self.cursors = [None; 6];
        let mut dropped = vec![0u32; self.states.len()];
        // Chunks held by the instance alone (in its L2, not in L3) leave the chunk map.
        let gone: Vec<BlockHash> = self.chunks.iter().filter(|&(_, id)| emptied[id as usize]).map(|(h, _)| h).collect();
        for h in gone {
            if let Some(id) = self.chunks.remove(h) {
                dropped[id as usize] += 1;
            }
        }
        for slot in 0..self.pages.len() as u32 {
            let page = &mut self.pages[slot as usize];
            if page.len() == 0 {
                continue;
            }
            let before = page.live();
            page.retain(|_, state| {
                let gone = emptied[state as usize];
                dropped[state as usize] += u32::from(gone);
                !gone && state != EMPTY
            });
            self.blocks -= before - page.live();
            if page.len() == 0 {
                self.free_page(slot);
            }
        }
        for (id, &n) in dropped.iter().enumerate() {
            for _ in 0..n {
                self.release(id as u32);
            }
        }
    }

    /// Checks the structure: every named page in its slot and holding blocks, free slots
    /// empty, every block in one place, reference counts equal to blocks, interned states
    /// live with their fingerprint. For tests; O(blocks).
    pub fn check_invariants(&self) {
        let mut refs = vec![0u32; self.states.len()];
        let chunked = self.chunk_blocks > 1;
        let mut seen = std::collections::HashSet::new();
        let mut live = 0;
        assert_eq!(self.slots.len() + self.free_pages.len(), self.pages.len(), "every slot is named or free");
        for &slot in &self.free_pages {
            assert_eq!(self.pages[slot as usize].len(), 0, "free slot {slot} is empty");
        }
        for (name, slot) in self.slots.iter() {
            let page = &self.pages[slot as usize];
            assert_eq!(page.name, name, "slot {slot} holds the page its name maps to");
            assert!(page.live() > 0, "named page {name:?} holds blocks");
            assert!(!page.mostly_dead(), "page {name:?} compacted");
            page.check_invariants();
            for (h, state) in page.entries.iter().map(|e| (e.hash(), e.value)) {
                assert!(seen.insert(h), "{h:?} indexed twice");
                refs[state as usize] += 1;
                live += usize::from(state != EMPTY);
                let s = &self.states[state as usize];
                assert!(!s.is_empty() || state == EMPTY, "{h:?}: a non-empty id holds nothing");
                assert!(
                    !chunked || (!s.in_l3 && s.holders.iter().all(|&h| h & 1 == 0)),
                    "{h:?}: in chunk mode, pages hold L1 only"
                );
            }
        }
        assert_eq!(live, self.blocks, "block count");
        assert!(chunked || self.chunks.is_empty(), "chunks only in chunk mode");
        for (h, id) in self.chunks.iter() {
            let s = &self.states[id as usize];
            assert!(id != EMPTY && !s.is_empty(), "chunk {h:?} is held");
            assert!(s.holders.iter().all(|&h| h & 1 == 1), "chunk {h:?} has L2 holders only");
            refs[id as usize] += 1;
        }
        for (id, s) in self.states.iter().enumerate().skip(1) {
            assert_eq!(self.meta[id].refs, refs[id], "state {id} reference count");
            assert!(s.holders.windows(2).all(|w| w[0] < w[1]), "state {id} holders sorted");
            let fp = s.holders.iter().fold(if s.in_l3 { L3_FP } else { 0 }, |fp, &h| fp.wrapping_add(holder_fp(h)));
            assert_eq!(s.fp, fp, "state {id} fingerprint");
            assert_eq!(s.twice, s.holders.windows(2).any(|w| w[0] >> 1 == w[1] >> 1), "state {id} twice");
        }
        for (&fp, &id) in &self.intern {
            assert!(
                self.meta[id as usize].refs > 0 || self.states[id as usize].dormant,
                "interned state {id} is live or dormant"
            );
            assert_eq!(self.states[id as usize].fp, fp, "interned state {id} fingerprint");
        }
    }
}
