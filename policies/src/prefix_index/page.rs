//! Pages: the blocks of one page of chains (depths `32k..32k+31` after one prefix), side by
//! side, in the order they were stored.

use super::EMPTY;
use engine::block_map::{push_page_entry, reserve_page_entries, BlockMap, HashEntry, HashFilter};
use engine::BlockHash;

/// Pages with more blocks than this many times the page size get a lookup map (the many
/// continuations of a prefix shared mid-page); smaller ones are scanned.
const SCAN_PAGES: usize = 3;

/// Tombstones a page keeps beyond twice its live blocks before it is compacted (tests
/// compact sooner, to go through it often).
const COMPACT_SLACK: usize = if cfg!(test) { 0 } else { 8 };

/// The blocks of one page and their holder-set ids. Small pages keep the order blocks were
/// stored in, which for a chain stored as a run is its order, so a query reads a run of a
/// prompt's blocks in sequence. A block nobody holds any more stays in its place (state
/// `EMPTY`, a tombstone) until the page is compacted: a demotion stores it again there, and
/// a run of blocks leaving goes along the page without shifting it.
#[derive(Clone, Debug, Default)]
pub(super) struct Page {
    /// The page's name (its first position's hash), while it holds blocks.
    pub(super) name: BlockHash,
    /// Each block's hash and state id (`value`), 12 bytes a block in one allocation.
    pub(super) entries: Vec<HashEntry>,
    /// Entries in the `EMPTY` state (tombstones), counted where states are written.
    dead: u32,
    /// Where the last run of events that found this page started: an engine publishes a
    /// demotion tier by tier, each a run over the same blocks, so the next run on the page
    /// usually starts there too (only a guess, checked by comparing hashes).
    pub(super) run_start: u32,
    /// Positions by hash, for a page past the scan limit.
    lookup: Option<Box<BlockMap<u32>>>,
    /// The hashes ever pushed since the page was emptied: a lookup of a block the page lacks
    /// (every new block's) usually ends here.
    filter: HashFilter,
}

impl Page {
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    #[inline]
    pub(super) fn state(&self, i: usize) -> u32 {
        self.entries[i].value
    }

    /// Moves position `i` from state `from` (its state now) to `to`, counting tombstones.
    #[inline(always)]
    pub(super) fn set_state(&mut self, i: usize, from: u32, to: u32) {
        debug_assert_eq!(self.entries[i].value, from);
        self.entries[i].value = to;
        if from == EMPTY {
            self.dead -= 1;
        } else if to == EMPTY {
            self.dead += 1;
        }
    }

    /// Blocks held by someone (entries that are not tombstones).
    pub(super) fn live(&self) -> usize {
        self.entries.len() - self.dead as usize
    }

    /// Whether the tombstones are many enough to be dropped (their positions go on costing
    /// scans and memory; dropping them moves the blocks after them).
    pub(super) fn mostly_dead(&self) -> bool {
        self.dead as usize > 2 * self.live() + COMPACT_SLACK
    }

    /// Whether position `i` holds `hash`.
    #[inline]
    pub(super) fn has_at(&self, i: usize, hash: BlockHash) -> bool {
        self.entries.get(i).is_some_and(|e| e.hash() == hash)
    }

    /// Where `hash` is, trying position `near` and its neighbours first (a run's next block
    /// follows the block before it when stored, and precedes it when evicted, leaf first, and
    /// a demotion names the same block twice), then where the page's last run started, then
    /// the page's last block (where a demotion, leaf first, starts on a page stored in order).
    #[inline]
    pub(super) fn find(&self, hash: BlockHash, near: usize) -> Option<usize> {
        for i in [near, near + 1, near.wrapping_sub(1), self.run_start as usize, self.entries.len().wrapping_sub(1)] {
            if self.has_at(i, hash) {
                return Some(i);
            }
        }
        if !self.filter.may_hold(hash) {
            return None;
        }
        self.position(hash)
    }

    /// Where `hash` is: its lookup, or a scan of a small page (no guesses, no filter).
    #[inline]
    fn position(&self, hash: BlockHash) -> Option<usize> {
        match &self.lookup {
            Some(lookup) => lookup.get(hash).map(|i| i as usize),
            None => self.entries.iter().position(|e| e.hash() == hash),
        }
    }

    /// Moves the blocks at the start of `hashes` that continue a run of blocks going from
    /// state `from` to `to` (they differ), the run's last at `at`: each beside the one before
    /// and in state `from`, or, when `grow`, new to the page and appended after its last
    /// block, the page's last. Returns how many it moved and where the last of them is.
    /// Blocks moved to `EMPTY` stay as tombstones: the caller frees or compacts the page.
    ///
    /// A run goes one way along the page (up as stored, down as evicted leaf first), so once
    /// a block is found beside the one before, the next ones are compared in a stretch that
    /// way. A hash is on one position only, so the other side needs no look.
    #[inline(always)]
    pub(super) fn extend_run(
        &mut self,
        mut at: usize,
        hashes: &[BlockHash],
        (from, to): (u32, u32),
        grow: bool,
        page_blocks: usize,
    ) -> (usize, usize) {
        debug_assert_ne!(from, to);
        debug_assert!(!grow || to != EMPTY, "blocks new to a page are stored");
        let (mut applied, mut moved) = (0, 0);
        while let Some(&hash) = hashes.get(applied) {
            let up = self.has_at(at + 1, hash);
            if up || self.has_at(at.wrapping_sub(1), hash) {
                let rest = &hashes[applied..];
                let n = if up {
                    stretch(self.entries[at + 1..].iter_mut(), rest, (from, to))
                } else {
                    stretch(self.entries[..at].iter_mut().rev(), rest, (from, to))
                };
                if n == 0 {
                    // The block beside is in another state.
                    break;
                }
                at = if up { at + n } else { at - n };
                (applied, moved) = (applied + n, moved + n);
                continue;
            }
            if !(grow && at + 1 == self.entries.len()) {
                break;
            }
            let n = self.push_new(&hashes[applied..], to, page_blocks);
            if n == 0 {
                break;
            }
            (at, applied) = (at + n, applied + n);
        }
        if from == EMPTY {
            self.dead -= moved as u32;
        } else if to == EMPTY {
            self.dead += moved as u32;
        }
        (applied, at)
    }

    /// Appends `hash` with state `state`; `page_blocks` sets when a lookup map is worth it.
    #[inline]
    pub(super) fn push(&mut self, hash: BlockHash, state: u32, page_blocks: usize) -> usize {
        let i = push_page_entry(&mut self.entries, hash, state, page_blocks);
        self.dead += u32::from(state == EMPTY);
        self.filter.add(hash);
        match &mut self.lookup {
            Some(lookup) => lookup.insert(hash, i as u32),
            None if i >= SCAN_PAGES * page_blocks => self.index(),
            None => {}
        }
        i
    }

    /// Appends the blocks at the start of `hashes` that the page lacks (up to the first it
    /// holds, or that comes twice), with state `state`, as [`Page::push`] would one by one;
    /// returns how many. A prompt's blocks cached for the first time come as such a run. The
    /// filter answers for most blocks; one it may hold (a false positive for one block in ten
    /// or so on a full page) is looked for in the page and among the blocks taken before it,
    /// so that the run goes on instead of starting again.
    pub(super) fn push_new(&mut self, hashes: &[BlockHash], state: u32, page_blocks: usize) -> usize {
        let mut n = 0;
        for &hash in hashes {
            // Noted on the way: a block that stops the run had its bit already.
            if self.filter.insert(hash) && (self.holds(hash) || hashes[..n].contains(&hash)) {
                break;
            }
            n += 1;
        }
        let first = self.entries.len();
        reserve_page_entries(&mut self.entries, n, page_blocks);
        self.entries.extend(hashes[..n].iter().map(|&hash| HashEntry::new(hash, state)));
        if state == EMPTY {
            self.dead += n as u32;
        }
        match &mut self.lookup {
            Some(lookup) => {
                for (&hash, i) in hashes[..n].iter().zip(first as u32..) {
                    lookup.insert(hash, i);
                }
            }
            None if self.entries.len() > SCAN_PAGES * page_blocks => self.index(),
            None => {}
        }
        n
    }

    /// Whether the page holds `hash`: out of line, as only the filter's false positives ask.
    #[inline(never)]
    fn holds(&self, hash: BlockHash) -> bool {
        self.position(hash).is_some()
    }

    /// Builds the lookup of positions by hash (again, after a compaction).
    #[cold]
    #[inline(never)]
    fn index(&mut self) {
        let mut lookup = Box::<BlockMap<u32>>::default();
        for (j, e) in self.entries.iter().enumerate() {
            lookup.insert(e.hash(), j as u32);
        }
        self.lookup = Some(lookup);
    }

    /// Keeps the blocks `keep` says yes to (the lookup rebuilt if any).
    pub(super) fn retain(&mut self, mut keep: impl FnMut(BlockHash, u32) -> bool) {
        self.entries.retain(|e| keep(e.hash(), e.value));
        self.dead = self.entries.iter().filter(|e| e.value == EMPTY).count() as u32;
        if self.lookup.is_some() {
            self.index();
        }
    }

    /// Empties the page for reuse, keeping small buffers.
    pub(super) fn clear(&mut self, page_blocks: usize) {
        if self.entries.capacity() > 2 * page_blocks || self.lookup.is_some() {
            *self = Page::default();
        } else {
            self.entries.clear();
            self.dead = 0;
            self.run_start = 0;
            self.filter = HashFilter::default();
        }
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<HashEntry>() + self.lookup.as_ref().map_or(0, |l| l.bytes())
    }

    /// Checks the lookup map against the positions.
    pub(super) fn check_invariants(&self) {
        let dead = self.entries.iter().filter(|e| e.value == EMPTY).count();
        assert_eq!(self.dead as usize, dead, "page {:?}: tombstones counted", self.name);
        if let Some(lookup) = &self.lookup {
            assert_eq!(lookup.len(), self.entries.len(), "page {:?}: lookup size", self.name);
            for (i, h) in self.entries.iter().map(HashEntry::hash).enumerate() {
                assert_eq!(lookup.get(h), Some(i as u32), "page {:?}: lookup of {h:?}", self.name);
            }
        }
    }
}

/// Moves the blocks of `entries` (a page's positions, from the one after a run's last, in
/// the run's direction) that hold `hashes` in order and are in state `from` to `to`, up to
/// the first that does not; returns how many.
#[inline(always)]
fn stretch<'a>(
    entries: impl Iterator<Item = &'a mut HashEntry>,
    hashes: &[BlockHash],
    (from, to): (u32, u32),
) -> usize {
    let mut n = 0;
    for (e, &hash) in entries.zip(hashes) {
        if e.hash() != hash || e.value != from {
            break;
        }
        e.value = to;
        n += 1;
    }
    n
}
