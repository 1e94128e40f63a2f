//! The stores below GPU memory: host DRAM (L2, one per instance) and the store shared by the
//! whole fleet (L3): LRU sets of blocks with a capacity, kept by page.
//!
//! # Pages
//!
//! A chain's blocks are grouped in *pages* of [`PAGE_BLOCKS`] positions (depths `0..32`,
//! `32..64`, ...), and a page is named by the hash of its first block: since hashes are
//! chained, that one hash names the whole prefix up to the page, so the blocks of a page are
//! the continuations of one prefix. Every caller knows a block's page: the prompt's hashes
//! give it at admission, the prefix tree at eviction ([`PageKey`]). The stores are keyed by
//! page: one map probe finds all of a page's blocks, side by side in memory, and a prompt's
//! walk, a run's demotion and the eviction of a run each touch a page once, not each block
//! (on stores of millions of blocks every map probe is a cache miss: the map per block this
//! replaces spent ~70% of a tiered simulation waiting on memory).
//!
//! # LRU order
//!
//! Each use stamps the block with the next number and appends it to a queue; a queue entry is
//! live while its stamp is the block's latest, so the live entries, oldest first, are the
//! exact LRU order, block by block. Blocks are named in the queue by their page's slot and
//! their position there (a block taken out leaves a hole in its page), so that consecutive
//! uses of a page's blocks, a demoted run or a prompt's load, are one queue entry, and the
//! victim at the queue's front is found without a lookup. Stale entries are skipped when they
//! reach the front, and dropped all at once (with the holes, when they are many) when they
//! outnumber twice the live ones. Stamps are compared only for equality, so 32 bits wrapping
//! around suffice: a stale entry is dropped within three store capacities of uses, long before
//! its stamp comes round again.

use super::page_runs::PageRuns;
use crate::block_map::{BlockMap, HashEntry, HashFilter, Probe};
use crate::ids::BlockHash;
use std::cell::Cell;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

/// Positions of a chain in one page (tests use small pages, so that short prompts cross
/// them).
pub const PAGE_BLOCKS: usize = if cfg!(test) { 4 } else { 32 };

/// A block as the stores key it: its hash, and its page's (the hash of its chain's block at
/// the last depth that is a multiple of [`PAGE_BLOCKS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageKey {
    pub hash: BlockHash,
    pub page: BlockHash,
}

impl PageKey {
    /// The key of the block at position `i` of a prompt's chained `hashes` (from its start).
    pub fn at(hashes: &[BlockHash], i: usize) -> PageKey {
        PageKey { hash: hashes[i], page: hashes[i / PAGE_BLOCKS * PAGE_BLOCKS] }
    }

    /// The blocks at positions `range` of a prompt's chained `hashes`, a page at a time: the
    /// page's name and its blocks in the range.
    pub fn pages(hashes: &[BlockHash], range: Range<usize>) -> impl Iterator<Item = (BlockHash, &[BlockHash])> {
        let mut at = range.start;
        std::iter::from_fn(move || {
            (at < range.end).then(|| {
                let first = at / PAGE_BLOCKS * PAGE_BLOCKS;
                let end = (first + PAGE_BLOCKS).min(range.end);
                let page = (hashes[first], &hashes[at..end]);
                at = end;
                page
            })
        })
    }
}

/// What [`BlockLru::put`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Put {
    /// The block was there: now the most recently used.
    Refreshed,
    /// The block is new; `evicted` made room for it.
    Added { evicted: Option<PageKey> },
}

/// The stamp of a page position whose block was taken out (a hole, kept until the next
/// compaction so that queue entries can name blocks by position); never handed out.
const HOLE: u32 = u32::MAX;

/// The blocks of one page held by a store, in the order they were added, each with its
/// latest stamp; a block taken out leaves a hole. The positions are kept inside the page,
/// beside its header, for a page of up to [`PAGE_BLOCKS`] of them (all but a few): a cold
/// page's header and blocks are then two loads side by side, where a buffer of its own made
/// them a chain of two misses (the header, then the blocks it points to), on every victim at
/// a full store's queue front, a demotion's look in its page and a prompt's walk.
#[derive(Clone, Debug)]
#[repr(C)]
struct Page {
    /// The page's name (its first position's hash), while it holds blocks.
    name: BlockHash,
    /// Blocks held (positions that are not holes).
    live: u32,
    /// Positions in `inline`, or [`SPILLED`]: they are all in `spill`.
    len: u32,
    /// The hashes ever pushed since the page was emptied: most lookups of a block the page
    /// lacks (every new block's) end here.
    filter: HashFilter,
    /// Positions of the held blocks, for the rare page with many blocks (the continuations
    /// of a prefix many prompts share end to end): looked up instead of scanned.
    lookup: Option<Box<BlockMap<u32>>>,
    /// Every position, once a page has more than [`PAGE_BLOCKS`] (boxed: 8 bytes in every
    /// page's header, not a vector's 24, for the rare page that needs it).
    #[allow(clippy::box_collection)]
    spill: Option<Box<Vec<HashEntry>>>,
    /// Each position's hash and latest stamp (`value`), while they fit.
    inline: [HashEntry; PAGE_BLOCKS],
}

// A page is seven cache lines' worth: a 64-byte header, then its positions.
const _: () = assert!(cfg!(test) || std::mem::size_of::<Page>() == 7 * 64);

/// `Page::len` of a page whose positions are in its `spill`.
const SPILLED: u32 = u32::MAX;

impl Default for Page {
    fn default() -> Page {
        Page {
            name: BlockHash(0),
            live: 0,
            len: 0,
            filter: HashFilter::default(),
            lookup: None,
            spill: None,
            inline: [HashEntry::new(BlockHash(0), HOLE); PAGE_BLOCKS],
        }
    }
}

/// The slot `BlockLru::last` names for a page the store lacks.
const ABSENT: u32 = u32::MAX;

/// Pages with more positions than this are looked up, not scanned.
const SCAN_BLOCKS: usize = 3 * PAGE_BLOCKS;

impl Page {
    /// The positions, in order.
    #[inline(always)]
    fn entries(&self) -> &[HashEntry] {
        match self.len {
            SPILLED => self.spill.as_deref().map_or(&[], Vec::as_slice),
            len => &self.inline[..len as usize],
        }
    }

    #[inline(always)]
    fn entries_mut(&mut self) -> &mut [HashEntry] {
        self.entries_and_lookup_mut().0
    }

    /// The positions and the lookup, both to change at once.
    #[inline(always)]
    fn entries_and_lookup_mut(&mut self) -> (&mut [HashEntry], Option<&mut BlockMap<u32>>) {
        let entries = match self.len {
            SPILLED => self.spill.as_deref_mut().map_or(&mut [][..], Vec::as_mut_slice),
            len => &mut self.inline[..len as usize],
        };
        (entries, self.lookup.as_deref_mut())
    }

    /// Moves the positions to `spill`, for more than [`PAGE_BLOCKS`] of them.
    #[cold]
    #[inline(never)]
    fn spill(&mut self) -> &mut Vec<HashEntry> {
        if self.len != SPILLED {
            self.spill = Some(Box::new(self.inline[..self.len as usize].to_vec()));
            self.len = SPILLED;
        }
        self.spill.get_or_insert_default()
    }

    /// Empties the page (its slot freed), keeping no spill.
    fn clear(&mut self) {
        self.len = 0;
        self.spill = None;
        self.filter = HashFilter::default();
        self.lookup = None;
    }

    /// Where `hash` is held, trying the positions beside `near` and `near` itself first: a
    /// walk goes along a page's blocks in the order they were added (a prompt's first load)
    /// or against it (a prompt's walk over blocks a demotion added, leaf first).
    #[inline]
    fn find(&self, hash: BlockHash, near: usize) -> Option<usize> {
        let holds = |e: &HashEntry| e.hash() == hash && e.value != HOLE;
        for i in [near + 1, near.wrapping_sub(1), near] {
            if self.entries().get(i).is_some_and(holds) {
                return Some(i);
            }
        }
        if !self.filter.may_hold(hash) {
            return None;
        }
        match &self.lookup {
            Some(lookup) => lookup.get(hash).map(|i| i as usize),
            None => self.entries().iter().position(holds),
        }
    }

    /// Whether position `i` holds a block last used at `stamp`.
    fn used_at(&self, i: usize, stamp: u32) -> bool {
        self.entries().get(i).is_some_and(|e| e.value == stamp)
    }

    #[inline]
    fn push(&mut self, hash: BlockHash, stamp: u32) -> usize {
        let entry = HashEntry::new(hash, stamp);
        let i = match self.len as usize {
            len if len < PAGE_BLOCKS => {
                self.inline[len] = entry;
                self.len += 1;
                len
            }
            _ => {
                let spill = self.spill();
                spill.push(entry);
                spill.len() - 1
            }
        };
        self.live += 1;
        self.filter.add(hash);
        match &mut self.lookup {
            Some(lookup) => lookup.insert(hash, i as u32),
            None if i >= SCAN_BLOCKS => self.index(),
            None => {}
        }
        i
    }

    /// Appends the blocks `hashes` (of this page), stamped `stamp`, `stamp + 1`, ... (no stamp
    /// among them wraps round); returns the first one's position (the rest follow it).
    fn push_run(&mut self, hashes: &[BlockHash], stamp: u32) -> usize {
        if self.len as usize + hashes.len() > PAGE_BLOCKS {
            self.spill();
        }
        // A copy of known length, written without a check a block, the filter noting each
        // hash on the way (one pass over the run, not two).
        let filter = &mut self.filter;
        let entry = |(j, &hash): (usize, &BlockHash)| {
            filter.add(hash);
            HashEntry::new(hash, stamp + j as u32)
        };
        let first = match self.len {
            SPILLED => {
                let spill = self.spill.get_or_insert_default();
                let first = spill.len();
                spill.extend(hashes.iter().enumerate().map(entry));
                first
            }
            len => {
                let len = len as usize;
                let to = &mut self.inline[len..len + hashes.len()];
                to.iter_mut().zip(hashes.iter().enumerate().map(entry)).for_each(|(to, e)| *to = e);
                self.len += hashes.len() as u32;
                len
            }
        };
        self.live += hashes.len() as u32;
        let positions = self.entries().len();
        match &mut self.lookup {
            Some(lookup) => {
                for (&hash, i) in hashes.iter().zip(first as u32..) {
                    lookup.insert(hash, i);
                }
            }
            None if positions > SCAN_BLOCKS => self.index(),
            None => {}
        }
        first
    }

    /// Builds the lookup of held blocks' positions.
    #[cold]
    #[inline(never)]
    fn index(&mut self) {
        let mut lookup = Box::<BlockMap<u32>>::default();
        for (j, e) in self.entries().iter().enumerate() {
            if e.value != HOLE {
                lookup.insert(e.hash(), j as u32);
            }
        }
        self.lookup = Some(lookup);
    }

    fn remove_at(&mut self, i: usize) {
        let e = &mut self.entries_mut()[i];
        let hash = e.hash();
        e.value = HOLE;
        self.live -= 1;
        if let Some(lookup) = &mut self.lookup {
            lookup.remove(hash);
        }
    }

    /// Drops the holes, the held blocks keeping their order.
    fn retain_held(&mut self) {
        match self.len {
            SPILLED => self.spill.iter_mut().for_each(|s| s.retain(|e| e.value != HOLE)),
            len => {
                let mut kept = 0;
                for i in 0..len as usize {
                    if self.inline[i].value != HOLE {
                        self.inline[kept] = self.inline[i];
                        kept += 1;
                    }
                }
                self.len = kept as u32;
            }
        }
    }

    /// Takes out the blocks whose latest use is one of `u`'s (live uses), oldest first, up
    /// to `n` of them (at least one), handing each hash to `out`; returns how many uses it
    /// went through and how many blocks it took. The uses' positions are one stretch of the
    /// page, read in one direction with no bounds check a block (positions past the page's
    /// end are stale uses of a page since emptied): a victim costs a stamp comparison, and
    /// the hash when taken.
    #[inline(always)]
    fn take_live(&mut self, u: Uses, n: u32, mut out: impl FnMut(BlockHash)) -> (u32, u32) {
        debug_assert!(n > 0, "at least one block taken");
        let (len, end) = (u32::from(u.len), self.entries().len() as u32);
        let (mut gone, mut found) = (len, 0);
        let (entries, mut lookup) = self.entries_and_lookup_mut();
        // The `j`th use's block, if still last used by it: taken; true once `n` are.
        let mut take = |j: u32, e: &mut HashEntry| {
            if e.value != u.stamp.wrapping_add(j) {
                return false;
            }
            let hash = e.hash();
            e.value = HOLE;
            if let Some(lookup) = lookup.as_deref_mut() {
                lookup.remove(hash);
            }
            out(hash);
            found += 1;
            found == n
        };
        if u.down {
            // Positions `first`, `first - 1`, ... (`first + 1 >= len`, as `Uses::extend`
            // keeps it): those from `end` on are past the end, the first `skip` uses.
            let hi = (u.first + 1).min(end);
            let skip = u.first + 1 - hi;
            let stretch = &mut entries[(u.first + 1 - len).min(hi) as usize..hi as usize];
            for (e, j) in stretch.iter_mut().rev().zip(skip..) {
                if take(j, e) {
                    gone = j + 1;
                    break;
                }
            }
        } else {
            let stretch = &mut entries[u.first.min(end) as usize..(u.first + len).min(end) as usize];
            for (e, j) in stretch.iter_mut().zip(0..) {
                if take(j, e) {
                    gone = j + 1;
                    break;
                }
            }
        }
        self.live -= found;
        (gone, found)
    }
}

/// Consecutive uses in the LRU queue: `len` blocks of the page in `slot`, at positions
/// `first`, `first ± 1`, ... (`down`: decreasing), stamped `stamp`, `stamp + 1`, ...
/// A demotion, a prompt's load or a refresh uses a page's blocks one after another, so one
/// entry stands for a run of them (a page's blocks were added in the order a run arrived).
#[derive(Clone, Copy, Debug)]
struct Uses {
    slot: u32,
    first: u32,
    stamp: u32,
    len: u16,
    down: bool,
}

impl Uses {
    /// The position and stamp of the `k`th use.
    fn at(&self, k: u32) -> (usize, u32) {
        let pos = if self.down { self.first - k } else { self.first + k };
        (pos as usize, self.stamp.wrapping_add(k))
    }

    /// Appends a use of position `pos` of the page in `slot`, stamped `stamp`, to `order`:
    /// the last entry's next use, or a new entry.
    #[inline(always)]
    fn append(order: &mut VecDeque<Uses>, slot: u32, pos: u32, stamp: u32) {
        if !order.back_mut().is_some_and(|u| u.extend(slot, pos, stamp)) {
            if order.len() == order.capacity() {
                Uses::grow(order);
            }
            order.push_back(Uses { slot, first: pos, stamp, len: 1, down: false });
        }
    }

    /// Appends uses of positions `first`, `first + 1`, ... (`n` of them) of the page in
    /// `slot`, stamped `stamp`, `stamp + 1`, ... (no stamp among them wraps round): as
    /// [`Uses::append`] one by one, a run of them at once.
    #[inline]
    fn append_run(order: &mut VecDeque<Uses>, slot: u32, first: u32, stamp: u32, n: u32) {
        let mut k = 0;
        while k < n {
            Uses::append(order, slot, first + k, stamp + k);
            k += 1;
            let back = order.back_mut().expect("a use was just appended");
            if !back.down && back.len > 1 || back.len == 1 {
                // Going up from the use just appended: the rest continue it, as far as fits.
                let more = (n - k).min(u32::from(u16::MAX - back.len));
                if more > 0 {
                    back.down = false;
                    back.len += more as u16;
                    k += more;
                }
            }
        }
    }

    /// Makes room in a full queue as a slab grows, not doubling (L3's queue holds a hundred
    /// thousand runs).
    #[cold]
    #[inline(never)]
    fn grow(order: &mut VecDeque<Uses>) {
        order.reserve_exact(crate::slots::growth(order.len()));
    }

    /// Extends the run by a use of position `pos` stamped `stamp`, if it is the next one.
    fn extend(&mut self, slot: u32, pos: u32, stamp: u32) -> bool {
        if self.slot != slot || self.len == u16::MAX || stamp != self.stamp.wrapping_add(u32::from(self.len)) {
            return false;
        }
        let len = u32::from(self.len);
        let next = if self.len == 1 {
            // The second use sets the direction.
            if pos == self.first + 1 {
                self.down = false;
                true
            } else if pos + 1 == self.first {
                self.down = true;
                true
            } else {
                false
            }
        } else if self.down {
            self.first >= len && pos == self.first - len
        } else {
            pos == self.first + len
        };
        if next {
            self.len += 1;
        }
        next
    }
}

/// A set of blocks with a capacity, evicting the least recently used: the L2 and L3 stores.
/// Only hashes are kept: the simulator needs to know what is there, not its bytes.
#[derive(Clone, Debug, Default)]
pub struct BlockLru {
    capacity: u32,
    len: u32,
    /// Page name to its slot in `pages`.
    slots: BlockMap<u32>,
    /// The page last looked up or placed, with its slot (`ABSENT`: not here): a run of blocks
    /// goes to one page, and the next block's lookup skips the map probe (a run checked
    /// against a store that lacks its page, as a commit's is against L2, probes once).
    last: Cell<Option<(BlockHash, u32)>>,
    /// The position last found or placed, in any page: where the next lookup looks first.
    near: Cell<u32>,
    /// Pages in slots; an empty page is a free slot (listed in `free`).
    pages: Vec<Page>,
    free: Vec<u32>,
    /// Uses, oldest first.
    order: VecDeque<Uses>,
    /// Uses in `order`, live and stale.
    queued: usize,
    /// Holes in pages.
    holes: usize,
    /// The next use's stamp.
    next_stamp: u32,
}

/// Stale uses tolerated besides the live ones before a compaction: twice as many, plus
/// this (tests compact sooner, to go through it often). A compaction checks every use in
/// the queue, a cache miss per run; the queue holds runs, so stale ones cost little memory.
const STALE_SLACK: usize = if cfg!(test) { 4 } else { 64 };

/// The most uses the queue may hold with `live` blocks held.
fn most_queued(live: usize) -> usize {
    3 * live + STALE_SLACK
}

impl BlockLru {
    pub fn new(capacity: u32) -> BlockLru {
        BlockLru { capacity, ..BlockLru::default() }
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where `key` is: its page's slot and its position there.
    fn find(&self, key: PageKey) -> Option<(u32, usize)> {
        let slot = self.slot(key.page)?;
        Some((slot, self.find_in(slot, key.hash)?))
    }

    /// Where `hash` is in the page in `slot`, looked for first beside the last position found,
    /// which it becomes.
    fn find_in(&self, slot: u32, hash: BlockHash) -> Option<usize> {
        let i = self.pages[slot as usize].find(hash, self.near.get() as usize)?;
        self.near.set(i as u32);
        Some(i)
    }

    /// What `last` says of `page`, if it names it: its slot, or `None` when the store lacks it.
    fn remembered(&self, page: BlockHash) -> Option<Option<u32>> {
        match self.last.get() {
            Some((name, slot)) if name == page => Some((slot != ABSENT).then_some(slot)),
            _ => None,
        }
    }

    /// The slot of `page`, if it holds blocks.
    fn slot(&self, page: BlockHash) -> Option<u32> {
        self.remembered(page).unwrap_or_else(|| {
            let slot = self.slots.get(page);
            self.last.set(Some((page, slot.unwrap_or(ABSENT))));
            slot
        })
    }

    pub fn contains(&self, key: PageKey) -> bool {
        self.find(key).is_some()
    }

    /// The blocks of `page` here, for [`PageHolder::holds`] to answer as
    /// [`BlockLru::contains`] does, the page looked up once for all of them.
    pub fn page(&self, page: BlockHash) -> PageHolder<'_> {
        PageHolder { lru: self, slot: self.slot(page) }
    }

    /// Adds `key` as the most recently used (or refreshes it). When the store is full, the
    /// least recently used block makes room and is returned. A store of capacity zero keeps
    /// nothing and hands the block straight back.
    pub fn insert(&mut self, key: PageKey) -> Option<PageKey> {
        match self.put(key) {
            Put::Refreshed => None,
            Put::Added { evicted } => evicted,
        }
    }

    /// Like [`BlockLru::insert`], telling a refresh from an addition (only an addition is news
    /// for an index).
    #[inline(always)]
    pub fn put(&mut self, key: PageKey) -> Put {
        if self.capacity == 0 {
            return Put::Added { evicted: Some(key) };
        }
        // One probe of the page map for the lookup and, usually, the placement (none on the
        // page of the last block).
        let mut found = self.remembered(key.page).unwrap_or_else(|| match self.slots.probe(key.page) {
            Probe::Found(slot) => Some(slot),
            Probe::Vacant(_) => None,
        });
        if let Some(slot) = found {
            if let Some(i) = self.find_in(slot, key.hash) {
                self.use_at(slot, i);
                return Put::Refreshed;
            }
        }
        // Making room first: the victim may be the last block of this very page.
        let evicted = if self.len >= self.capacity { self.pop_front() } else { None };
        if evicted.is_some_and(|e| e.page == key.page) && self.slots.get(key.page).is_none() {
            found = None;
        }
        let probe = found.map_or_else(|| self.slots.probe(key.page), Probe::Found);
        let slot = self.place(key.page, probe);
        let stamp = self.next_stamp;
        let i = self.pages[slot as usize].push(key.hash, stamp);
        self.near.set(i as u32);
        self.len += 1;
        self.used(slot, i, stamp);
        Put::Added { evicted }
    }

    /// Puts `keys` in order, as [`BlockLru::put`] one by one, listing the blocks added in
    /// `added` and the victims that made room for them in `victims`, each in order (not
    /// cleared first). At most `capacity` keys, all distinct (a demotion's are L1's blocks): a
    /// victim is then never a block just added, so the two lists lose nothing of the order
    /// that matters.
    ///
    /// A demotion puts runs of one page: a run the store lacks entirely (always so in L2,
    /// which never holds what L1 holds) is added in one go, its victims popped first (the
    /// same ones, since none of the run can be among them), one page lookup and one queue
    /// entry for the run; a run with a block already here goes block by block.
    pub fn put_all(&mut self, keys: &PageRuns, added: &mut PageRuns, victims: &mut PageRuns) {
        self.put_runs(keys, added, victims, false);
    }

    /// [`BlockLru::put_all`] for `keys` none of which is here, as L2's demotions are (within an
    /// instance a block is in at most one of L1 and L2): each run is added in one go, with no
    /// look for its blocks in their page first.
    pub fn add_all(&mut self, keys: &PageRuns, added: &mut PageRuns, victims: &mut PageRuns) {
        self.put_runs(keys, added, victims, true);
    }

    /// [`BlockLru::put_all`], or [`BlockLru::add_all`] when `absent`.
    #[inline(always)]
    fn put_runs(&mut self, keys: &PageRuns, added: &mut PageRuns, victims: &mut PageRuns, absent: bool) {
        assert!(
            keys.len() <= self.capacity as usize,
            "{} blocks put at once in a store of {}",
            keys.len(),
            self.capacity
        );
        debug_assert!(
            keys.keys().enumerate().all(|(i, k)| !keys.keys().take(i).any(|j| j == k)),
            "keys put at once are distinct"
        );
        for (page, hashes) in keys.runs() {
            debug_assert!(!absent || self.lacks_all(page, hashes), "blocks added are not here");
            if absent || self.lacks_all(page, hashes) {
                self.add_run(page, hashes, victims);
                added.extend_run(page, hashes);
                continue;
            }
            for &hash in hashes {
                let key = PageKey { hash, page };
                if let Put::Added { evicted } = self.put(key) {
                    added.push(key);
                    if let Some(victim) = evicted {
                        victims.push(victim);
                    }
                }
            }
        }
    }

    /// Whether none of `hashes` (blocks of `page`) is here.
    fn lacks_all(&self, page: BlockHash, hashes: &[BlockHash]) -> bool {
        let Some(slot) = self.slot(page) else { return true };
        let page = &self.pages[slot as usize];
        let near = self.near.get() as usize;
        hashes.iter().all(|&h| page.find(h, near).is_none())
    }

    /// Adds `hashes`, blocks of `page` none of which is here, as the most recently used,
    /// after taking out the victims that make room for them.
    fn add_run(&mut self, page: BlockHash, hashes: &[BlockHash], victims: &mut PageRuns) {
        let pops = (self.len as usize + hashes.len()).saturating_sub(self.capacity as usize);
        self.pop_front_n(pops as u32, victims);
        // Looked up after the victims: they may have emptied this very page (and then
        // `last` no longer names it).
        let probe = match self.remembered(page) {
            Some(Some(slot)) => Probe::Found(slot),
            _ => self.slots.probe(page),
        };
        let slot = self.place(page, probe);
        let (n, stamp) = (hashes.len() as u32, self.next_stamp);
        if u64::from(stamp) + u64::from(n) < u64::from(HOLE) {
            let first = self.pages[slot as usize].push_run(hashes, stamp) as u32;
            Uses::append_run(&mut self.order, slot, first, stamp, n);
            self.next_stamp = stamp + n;
            self.queued += n as usize;
            self.near.set(first + n - 1);
        } else {
            // The stamps wrap round within the run (once in four billion uses).
            for &hash in hashes {
                let stamp = self.next_stamp;
                let i = self.pages[slot as usize].push(hash, stamp);
                self.note_use(slot, i, stamp);
                self.near.set(i as u32);
            }
        }
        self.len += n;
        self.compact_if_stale();
    }

    /// The slot of `page`, as `probe` found it or given a free one where it was vacant; the
    /// page last looked up from now on.
    fn place(&mut self, page: BlockHash, probe: Probe<u32>) -> u32 {
        let slot = match probe {
            Probe::Found(slot) => slot,
            Probe::Vacant(vacancy) => {
                let slot = crate::slots::reuse(&mut self.pages, &mut self.free);
                self.pages[slot as usize].name = page;
                self.slots.fill(vacancy, page, slot);
                slot
            }
        };
        self.last.set(Some((page, slot)));
        slot
    }

    /// Marks `key` as just used; false when it is not here.
    pub fn touch(&mut self, key: PageKey) -> bool {
        let Some((slot, i)) = self.find(key) else { return false };
        self.use_at(slot, i);
        true
    }

    /// Marks the block at position `i` of the page in `slot` as just used.
    fn use_at(&mut self, slot: u32, i: usize) {
        self.note_use_at(slot, i);
        self.compact_if_stale();
    }

    /// [`BlockLru::use_at`] without the check for stale uses (one check after a run of uses).
    fn note_use_at(&mut self, slot: u32, i: usize) {
        let stamp = self.next_stamp;
        self.pages[slot as usize].entries_mut()[i].value = stamp;
        self.note_use(slot, i, stamp);
    }

    pub fn remove(&mut self, key: PageKey) -> bool {
        let Some((slot, i)) = self.find(key) else { return false };
        self.take(slot, i);
        self.compact_if_stale();
        true
    }

    /// Removes the blocks `pages` gives (a prompt's, a page at a time: [`PageKey::pages`]), as
    /// [`BlockLru::remove`] one by one, handing each page's blocks to `each` at most 64 at a
    /// time with a mask of those that were here (bit `k` for `hashes[k]`: removed now), for
    /// the caller to publish them as one run: a page looked up once for its blocks, none of
    /// them looked for when the store lacks it.
    pub fn remove_all<'a>(
        &mut self,
        pages: impl IntoIterator<Item = (BlockHash, &'a [BlockHash])>,
        mut each: impl FnMut(BlockHash, &'a [BlockHash], u64),
    ) {
        for (page, hashes) in pages {
            let Some(slot) = self.slot(page) else {
                hashes.chunks(64).for_each(|hashes| each(page, hashes, 0));
                continue;
            };
            // The blocks taken are counted once for the page (its slot freed then if it
            // holds no more): a page left with holes only finds none of the rest.
            let mut taken = 0;
            for hashes in hashes.chunks(64) {
                let mut removed = 0u64;
                for (k, &hash) in hashes.iter().enumerate() {
                    if let Some(i) = self.find_in(slot, hash) {
                        self.pages[slot as usize].remove_at(i);
                        removed |= 1 << k;
                    }
                }
                taken += removed.count_ones();
                each(page, hashes, removed);
            }
            if taken > 0 {
                self.taken(slot, taken);
            }
        }
        self.compact_if_stale();
    }

    /// Marks `keys` (a prompt's blocks, page after page) as just used, in order, as
    /// [`BlockLru::touch`] one by one: a page looked up once for its run of keys, and one
    /// check for stale uses at the end.
    pub fn touch_all(&mut self, keys: &PageRuns) {
        for (page, hashes) in keys.runs() {
            let Some(slot) = self.slot(page) else { continue };
            for &hash in hashes {
                let Some(i) = self.find_in(slot, hash) else { continue };
                self.note_use_at(slot, i);
            }
        }
        self.compact_if_stale();
    }

    /// Loads what putting `keys` will read (their pages' map entries) and what the victims
    /// they push out will (the pages at the queue's front, and the map entry of a page they
    /// may empty, which is then removed), so that the cache misses overlap; returns what it
    /// read, for the caller to keep (a prefetch in safe code). A store with room for the keys
    /// pushes nothing out, and nothing of its queue is read.
    pub fn prefetch(&self, keys: &PageRuns) -> u64 {
        let mut sink = 0;
        for (page, _) in keys.runs() {
            sink ^= self.slots.touch(page);
        }
        let pops = (self.len as usize + keys.len()).saturating_sub(self.capacity as usize);
        let mut victims = 0;
        for u in &self.order {
            if victims >= pops {
                break;
            }
            victims += usize::from(u.len);
            let (pos, _) = u.at(0);
            let page = &self.pages[u.slot as usize];
            sink ^= page.entries().get(pos).map_or(0, |e| u64::from(e.value));
            if page.live <= u32::from(u.len) {
                sink ^= self.slots.touch(page.name);
            }
        }
        sink
    }

    /// The blocks held, least recently used first.
    pub fn iter(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.live_uses().map(|(slot, pos)| self.pages[slot as usize].entries()[pos].hash())
    }

    /// The live uses in the queue, oldest first: (slot, position).
    fn live_uses(&self) -> impl Iterator<Item = (u32, usize)> + '_ {
        self.order.iter().flat_map(move |u| {
            (0..u32::from(u.len)).filter_map(move |k| {
                let (pos, stamp) = u.at(k);
                self.pages[u.slot as usize].used_at(pos, stamp).then_some((u.slot, pos))
            })
        })
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        *self = BlockLru::new(self.capacity);
    }

    /// Takes the block at position `i` of the page in `slot` out of the store.
    fn take(&mut self, slot: u32, i: usize) {
        self.pages[slot as usize].remove_at(i);
        self.taken(slot, 1);
    }

    /// Counts `n` blocks just taken out of the page in `slot`: the page's slot is freed when
    /// it holds no more, its positions count as holes otherwise.
    fn taken(&mut self, slot: u32, n: u32) {
        self.len -= n;
        let p = &mut self.pages[slot as usize];
        if p.live > 0 {
            self.holes += n as usize;
            return;
        }
        // The slot is free.
        self.holes -= p.entries().len() - n as usize;
        let name = p.name;
        p.clear();
        self.slots.remove(name);
        if self.last.get().is_some_and(|(last, _)| last == name) {
            self.last.set(None);
        }
        self.free.push(slot);
    }

    /// Records a use of position `pos` of the page at `slot`, stamped `stamp`.
    #[inline(always)]
    fn used(&mut self, slot: u32, pos: usize, stamp: u32) {
        self.note_use(slot, pos, stamp);
        self.compact_if_stale();
    }

    /// [`BlockLru::used`] without the check for stale uses (one check after a run of uses).
    #[inline(always)]
    fn note_use(&mut self, slot: u32, pos: usize, stamp: u32) {
        self.next_stamp = match stamp.wrapping_add(1) {
            HOLE => 0,
            next => next,
        };
        self.queued += 1;
        Uses::append(&mut self.order, slot, pos as u32, stamp);
    }

    fn pop_front(&mut self) -> Option<PageKey> {
        while let Some(&u) = self.order.front() {
            let page = self.pages[u.slot as usize].name;
            let mut victim = None;
            if self.pop_front_entry(u, 1, |hash| victim = Some(PageKey { hash, page })) > 0 {
                return victim;
            }
        }
        None
    }

    /// Takes out the `n` least recently used blocks (all, if fewer), appending them to
    /// `victims`, oldest first: the queue's front entry's uses read on its page in one go, and
    /// its blocks appended as a run of that page.
    #[inline]
    fn pop_front_n(&mut self, mut n: u32, victims: &mut PageRuns) {
        while n > 0 {
            let Some(&u) = self.order.front() else { break };
            let page = self.pages[u.slot as usize].name;
            n -= victims.push_with(page, |hashes| self.pop_front_entry(u, n, |hash| hashes.push(hash)));
        }
    }

    /// Takes out the blocks of the queue's front entry `u` that are live, up to `n` of them,
    /// handing each hash to `out`, oldest first; returns how many. The entry is dropped, or
    /// shortened by the uses gone through.
    #[inline(always)]
    fn pop_front_entry(&mut self, u: Uses, n: u32, out: impl FnMut(BlockHash)) -> u32 {
        let (k, found) = self.pages[u.slot as usize].take_live(u, n, out);
        if k == u32::from(u.len) {
            self.order.pop_front();
        } else if let Some(front) = self.order.front_mut() {
            front.len -= k as u16;
            front.stamp = front.stamp.wrapping_add(k);
            front.first = if front.down { front.first - k } else { front.first + k };
        }
        self.queued -= k as usize;
        if found > 0 {
            self.taken(u.slot, found);
        }
        found
    }

    /// Drops the stale uses once they outnumber twice the live ones (checked at every use:
    /// inlined, the compaction itself not).
    #[inline]
    fn compact_if_stale(&mut self) {
        if self.queued > most_queued(self.len as usize) {
            self.compact();
        }
    }

    /// Drops the stale uses, and the pages' holes with them once they are many (the queue
    /// names blocks by position, so both are renumbered at once).
    #[inline(never)]
    fn compact(&mut self) {
        let live = self.len as usize;
        // New positions, when holes go: each held block's rank among its page's held blocks,
        // at `base[slot] + position`.
        let renumber = self.holes > live / 4 + STALE_SLACK;
        let mut base = Vec::new();
        let mut ranks = Vec::new();
        if renumber {
            base.reserve_exact(self.pages.len());
            for page in &self.pages {
                base.push(ranks.len() as u32);
                let mut next = 0;
                ranks.extend(page.entries().iter().map(|e| {
                    let rank = next;
                    next += u32::from(e.value != HOLE);
                    rank
                }));
            }
        }
        let mut order = VecDeque::with_capacity(self.order.len());
        let mut queued = 0;
        for (slot, pos) in self.live_uses() {
            let stamp = self.pages[slot as usize].entries()[pos].value;
            let pos = if renumber { ranks[base[slot as usize] as usize + pos] } else { pos as u32 };
            queued += 1;
            Uses::append(&mut order, slot, pos, stamp);
        }
        if renumber {
            for page in self.pages.iter_mut().filter(|p| p.live as usize != p.entries().len()) {
                page.retain_held();
                if page.lookup.is_some() {
                    page.index();
                }
            }
            self.holes = 0;
        }
        self.order = order;
        self.queued = queued;
    }

    /// Checks that the map, the pages and the queue agree; panics naming the broken rule.
    pub fn check_invariants(&self) {
        assert!(self.len <= self.capacity, "store holds {} blocks, capacity {}", self.len, self.capacity);
        let held: usize = self.pages.iter().map(|p| p.live as usize).sum();
        assert_eq!(held, self.len as usize, "pages hold the store's blocks");
        assert!(
            self.pages.iter().all(|p| p.live as usize == p.entries().iter().filter(|e| e.value != HOLE).count()),
            "a page's count of held blocks is right"
        );
        let holes: usize = self.pages.iter().map(|p| p.entries().len() - p.live as usize).sum();
        assert_eq!(holes, self.holes, "holes counted");
        assert_eq!(self.slots.len() + self.free.len(), self.pages.len(), "every slot is named or free");
        if let Some((name, _)) = self.last.get() {
            let slot = self.remembered(name).flatten();
            assert_eq!(self.slots.get(name), slot, "the last page looked up is where the map says");
        }
        assert!(self.free.iter().all(|&s| self.pages[s as usize].entries().is_empty()), "free slots are empty");
        assert!(
            self.slots.iter().all(|(name, s)| self.pages[s as usize].name == name && self.pages[s as usize].live > 0),
            "named pages hold blocks"
        );
        let stamps = || self.order.iter().flat_map(|u| (0..u32::from(u.len)).map(move |k| u.at(k).1));
        assert!(stamps().zip(stamps().skip(1)).all(|(a, b)| b.wrapping_sub(a) < 1 << 31), "queue stamps increase");
        assert!(
            stamps().all(|s| s != HOLE && self.next_stamp.wrapping_sub(s).wrapping_sub(1) < 1 << 31),
            "queue stamps were handed out"
        );
        assert_eq!(self.order.iter().map(|u| usize::from(u.len)).sum::<usize>(), self.queued, "uses counted");
        assert_eq!(self.iter().count(), self.len as usize, "one live use per held block");
        let live = self.len as usize;
        assert!(self.queued <= most_queued(live), "stale uses compacted");
    }
}

/// A store's blocks of one page ([`BlockLru::page`]).
pub struct PageHolder<'a> {
    lru: &'a BlockLru,
    slot: Option<u32>,
}

impl PageHolder<'_> {
    /// Whether the block `hash` of the page is here.
    #[inline]
    pub fn holds(&self, hash: BlockHash) -> bool {
        self.slot.is_some_and(|slot| self.lru.find_in(slot, hash).is_some())
    }
}

/// The L3 store, shared by every instance of a fleet (each holds a handle).
#[derive(Clone, Debug, Default)]
pub struct SharedStore(Arc<Mutex<BlockLru>>);

impl SharedStore {
    pub fn new(capacity_blocks: u32) -> SharedStore {
        SharedStore(Arc::new(Mutex::new(BlockLru::new(capacity_blocks))))
    }

    /// The store, locked. A panic while it was held poisons nothing here: the LRU's state
    /// is consistent between calls, so the lock is taken back.
    pub fn lock(&self) -> MutexGuard<'_, BlockLru> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block `i`, in page `i / 4` (or, for `i` from 100, all in one page of many blocks).
    fn k(i: u64) -> PageKey {
        let page = if i >= 100 { 1_000 } else { 10_000 + i / 4 };
        PageKey { hash: BlockHash(i), page: BlockHash(page) }
    }

    #[test]
    fn evicts_least_recently_used_first() {
        let mut lru = BlockLru::new(2);
        assert_eq!(lru.insert(k(1)), None);
        assert_eq!(lru.insert(k(2)), None);
        assert!(lru.touch(k(1)));
        assert_eq!(lru.insert(k(3)), Some(k(2)));
        assert!(lru.contains(k(1)) && lru.contains(k(3)) && !lru.contains(k(2)));
        assert!(lru.remove(k(1)));
        assert!(!lru.remove(k(1)));
        assert_eq!(lru.insert(k(4)), None);
        assert_eq!(lru.insert(k(5)), Some(k(3)));
        lru.check_invariants();
    }

    /// The obvious LRU: a vector, least recently used first.
    #[derive(Default)]
    struct Model {
        capacity: usize,
        order: Vec<PageKey>,
    }

    impl Model {
        fn put(&mut self, key: PageKey) -> Put {
            if self.capacity == 0 {
                return Put::Added { evicted: Some(key) };
            }
            if self.touch(key) {
                return Put::Refreshed;
            }
            let evicted = (self.order.len() >= self.capacity).then(|| self.order.remove(0));
            self.order.push(key);
            Put::Added { evicted }
        }

        fn touch(&mut self, key: PageKey) -> bool {
            let Some(i) = self.order.iter().position(|&k| k == key) else { return false };
            self.order.remove(i);
            self.order.push(key);
            true
        }

        fn remove(&mut self, key: PageKey) -> bool {
            let Some(i) = self.order.iter().position(|&k| k == key) else { return false };
            self.order.remove(i);
            true
        }
    }

    proptest::proptest! {
        /// Whatever the uses, the store answers as the obvious LRU does: the same evictions,
        /// refreshes, removals and order, with pages of a few blocks and one page of many
        /// (looked up, not scanned).
        #[test]
        fn the_store_answers_as_a_plain_lru(
            capacity in 0usize..200,
            ops in proptest::collection::vec(
                (0u8..6, proptest::prop_oneof![0u64..24, 100u64..300], 1u64..12, proptest::bool::ANY),
                0..600,
            ),
        ) {
            let mut lru = BlockLru::new(capacity as u32);
            let mut model = Model { capacity, ..Model::default() };
            // Each op goes over a run of keys, up or down, as demotions and loads do.
            for (op, first, run, down) in ops {
                let mut keys: Vec<PageKey> =
                    (0..run).map(|j| k(if down { first.saturating_sub(j) } else { first + j })).collect();
                keys.dedup();
                if op == 5 {
                    // The whole run's removal at once, as a commit removes superseded copies.
                    let mut answers = Vec::new();
                    let runs: PageRuns = keys.iter().copied().collect();
                    lru.remove_all(runs.runs(), |page, hashes, removed| {
                        for (k, &hash) in hashes.iter().enumerate() {
                            answers.push((PageKey { hash, page }, removed >> k & 1 == 1));
                        }
                    });
                    let want: Vec<(PageKey, bool)> = keys.iter().map(|&key| (key, model.remove(key))).collect();
                    proptest::prop_assert_eq!(answers, want);
                    lru.check_invariants();
                    continue;
                }
                if op == 2 && down {
                    // The whole run's touches at once, as a promotion's from L3.
                    lru.touch_all(&keys.iter().copied().collect());
                    for &key in &keys {
                        model.touch(key);
                    }
                    proptest::prop_assert_eq!(lru.len() as usize, model.order.len());
                    lru.check_invariants();
                    continue;
                }
                if op == 4 && keys.len() <= capacity {
                    // The whole run at once, as a demotion puts it.
                    let (mut added, mut victims) = (PageRuns::new(), PageRuns::new());
                    let runs = keys.iter().copied().collect();
                    if down && keys.iter().all(|key| !model.order.contains(key)) {
                        // Blocks the store lacks, as L2's demotions are, added without a look.
                        lru.add_all(&runs, &mut added, &mut victims);
                    } else {
                        lru.put_all(&runs, &mut added, &mut victims);
                    }
                    let (added, victims): (Vec<PageKey>, Vec<PageKey>) = (added.keys().collect(), victims.keys().collect());
                    let (mut want_added, mut want_victims) = (Vec::new(), Vec::new());
                    for &key in &keys {
                        if let Put::Added { evicted } = model.put(key) {
                            want_added.push(key);
                            want_victims.extend(evicted);
                        }
                    }
                    proptest::prop_assert_eq!(added, want_added);
                    proptest::prop_assert_eq!(victims, want_victims);
                    proptest::prop_assert_eq!(lru.len() as usize, model.order.len());
                    lru.check_invariants();
                    continue;
                }
                for j in 0..run {
                    let key = k(if down { first.saturating_sub(j) } else { first + j });
                    match op {
                        0 | 1 | 4 => proptest::prop_assert_eq!(lru.put(key), model.put(key)),
                        2 => proptest::prop_assert_eq!(lru.touch(key), model.touch(key)),
                        _ => proptest::prop_assert_eq!(lru.remove(key), model.remove(key)),
                    }
                    proptest::prop_assert_eq!(lru.contains(key), model.order.contains(&key));
                    proptest::prop_assert_eq!(lru.len() as usize, model.order.len());
                }
                lru.check_invariants();
            }
            proptest::prop_assert_eq!(lru.iter().collect::<Vec<_>>(), model.order.iter().map(|k| k.hash).collect::<Vec<_>>());
            lru.clear();
            proptest::prop_assert!(lru.is_empty() && lru.iter().next().is_none());
        }
    }

    /// A page emptied and its slot taken by the next page: the new page's first use can
    /// continue the queue's last entry (the next stamp, the position before), which then
    /// names a position past the new page's end before the one it holds. Its block is still
    /// the victim in its turn.
    #[test]
    fn an_entry_running_past_its_pages_end_still_gives_its_victim() {
        let mut lru = BlockLru::new(4);
        lru.insert(k(0));
        lru.insert(k(1));
        assert!(lru.touch(k(1)));
        assert!(lru.remove(k(0)) && lru.remove(k(1)));
        // Page 10,001 takes the freed slot; its use at position 0 continues the touch's entry
        // (position 1) downwards.
        for i in [4, 8, 12, 16] {
            assert_eq!(lru.insert(k(i)), None);
        }
        assert_eq!(lru.insert(k(20)), Some(k(4)));
        lru.check_invariants();
    }

    #[test]
    fn a_store_of_no_capacity_keeps_nothing() {
        let mut lru = BlockLru::new(0);
        assert_eq!(lru.insert(k(1)), Some(k(1)));
        assert!(lru.is_empty());
    }

    #[test]
    fn a_prompts_blocks_go_a_page_at_a_time() {
        let hashes: Vec<BlockHash> = (0..10).map(BlockHash).collect();
        let pages: Vec<(BlockHash, &[BlockHash])> = PageKey::pages(&hashes, 3..9).collect();
        assert_eq!(pages, [(hashes[0], &hashes[3..4]), (hashes[4], &hashes[4..8]), (hashes[8], &hashes[8..9])]);
        assert_eq!(PageKey::pages(&hashes, 5..5).count(), 0);
    }

    #[test]
    fn a_page_is_named_by_its_first_position() {
        let hashes: Vec<BlockHash> = (0..10).map(BlockHash).collect();
        assert_eq!(PageKey::at(&hashes, 0), PageKey { hash: BlockHash(0), page: BlockHash(0) });
        assert_eq!(PageKey::at(&hashes, PAGE_BLOCKS - 1).page, BlockHash(0));
        assert_eq!(PageKey::at(&hashes, PAGE_BLOCKS).page, BlockHash(PAGE_BLOCKS as u64));
        assert_eq!(PageKey::at(&hashes, 9), PageKey { hash: BlockHash(9), page: BlockHash(8) });
    }
}
