//! The KV events an instance publishes, in the shape of vLLM's: blocks stored in a tier,
//! removed from one, or everything cleared. One event names one block ([`KvEvent`]); a batch
//! of them ([`KvEvents`]) keeps consecutive events of the same kind, tier and page as one run
//! of hashes ([`KvRun`]), as vLLM's `BlockStored` carries a list of hashes: an instance
//! demotes, loads and caches whole runs of a chain, and a reader (the prefix index) goes
//! along a run with no per-block decoding, at 8 bytes a block instead of 24.

use super::page_runs::PageRuns;
use super::store::PageKey;
use super::tier::Tier;
use crate::ids::BlockHash;

/// A change to the set of cached blocks, in the shape of vLLM's KV events (stored with its
/// parent, removed, all cleared) with the tier as the medium. An instance publishes the
/// events of its L1 and L2, and of the L3 changes it causes.
///
/// Each block also names its page (see [`super::PageKey`]: the hash of its chain's block at
/// the last depth that is a multiple of [`super::PAGE_BLOCKS`]), which the global prefix
/// index is keyed by: one map entry per page instead of one per block. A stored block's parent
/// (vLLM's events carry it) is not kept: hashes are chained, so a block's hash names its
/// prefix, and nothing here reads the parent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEvent {
    Stored {
        tier: Tier,
        hash: BlockHash,
        page: BlockHash,
    },
    Removed {
        tier: Tier,
        hash: BlockHash,
        page: BlockHash,
    },
    /// The instance dropped everything in its own tiers (L1 and L2).
    Cleared,
}

/// Consecutive events of one kind, tier and page: the blocks `hashes`, in the order they
/// happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvRun<'a> {
    Stored { tier: Tier, page: BlockHash, hashes: &'a [BlockHash] },
    Removed { tier: Tier, page: BlockHash, hashes: &'a [BlockHash] },
    Cleared,
}

impl<'a> KvRun<'a> {
    /// The run's events, block by block.
    pub fn events(self) -> impl Iterator<Item = KvEvent> + 'a {
        let (op, page, hashes) = self.parts();
        let cleared = (op == Op::Cleared).then_some(KvEvent::Cleared);
        cleared.into_iter().chain(hashes.iter().map(move |&hash| op.event(hash, page)))
    }

    /// What the run does, its page and its blocks (none for `Cleared`).
    fn parts(self) -> (Op, BlockHash, &'a [BlockHash]) {
        match self {
            KvRun::Stored { tier, page, hashes } => (Op::Stored(tier), page, hashes),
            KvRun::Removed { tier, page, hashes } => (Op::Removed(tier), page, hashes),
            KvRun::Cleared => (Op::Cleared, BlockHash(0), &[]),
        }
    }
}

/// What a run does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Stored(Tier),
    Removed(Tier),
    Cleared,
}

impl Op {
    /// Whether a run of this op removes blocks from L2 or L3.
    fn removes_below_l1(self) -> bool {
        matches!(self, Op::Removed(Tier::L2 | Tier::L3))
    }

    /// Whether a run of this op removes blocks from L1.
    fn removes_from_l1(self) -> bool {
        self == Op::Removed(Tier::L1)
    }

    fn event(self, hash: BlockHash, page: BlockHash) -> KvEvent {
        match self {
            Op::Stored(tier) => KvEvent::Stored { tier, hash, page },
            Op::Removed(tier) => KvEvent::Removed { tier, hash, page },
            Op::Cleared => KvEvent::Cleared,
        }
    }
}

/// A run: what it does, its page, and where its hashes start in [`KvEvents::hashes`] (they
/// end where the next run's start: pushing a block touches no head unless it starts a run).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Head {
    op: Op,
    page: BlockHash,
    start: u32,
}

/// Events in order, kept as runs (see the module documentation). Pushing the same events
/// always gives the same runs: a batch is compared, cleared and reused like a vector.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvEvents {
    heads: Vec<Head>,
    hashes: Vec<BlockHash>,
    /// `Cleared` runs among `heads`: almost every batch has none, and a reader looking for
    /// the next one then need not look.
    cleared: u32,
    /// Runs among `heads` removing blocks from L2 or L3: most batches have none or one, and
    /// a reader loading their pages ahead then need not look.
    lower_removals: u32,
    /// Runs among `heads` removing blocks from L1 (an allocation's evictions, a demotion's
    /// last runs), counted for the same readers.
    l1_removals: u32,
}

/// The hashes of `hashes` (64 at most) whose bit in `mask` is set (bit `k` for `hashes[k]`,
/// as [`super::BlockLru::remove_all`] marks the blocks it removed).
#[inline]
pub(crate) fn marked(hashes: &[BlockHash], mask: u64) -> impl Iterator<Item = BlockHash> + '_ {
    hashes.iter().enumerate().filter(move |&(k, _)| mask >> k & 1 == 1).map(|(_, &hash)| hash)
}

impl KvEvents {
    pub fn new() -> KvEvents {
        KvEvents::default()
    }

    /// Appends one block's event (to the last run when it continues it).
    #[inline(always)]
    pub fn push(&mut self, event: KvEvent) {
        match event {
            KvEvent::Stored { tier, hash, page } => self.push_block(Op::Stored(tier), hash, page),
            KvEvent::Removed { tier, hash, page } => self.push_block(Op::Removed(tier), hash, page),
            KvEvent::Cleared => {
                self.heads.push(Head { op: Op::Cleared, page: BlockHash(0), start: self.start() });
                self.cleared += 1;
            }
        }
    }

    /// Appends that block `hash` of `page` was stored in `tier` (`push` without the decoding).
    #[inline(always)]
    pub fn stored(&mut self, tier: Tier, hash: BlockHash, page: BlockHash) {
        self.push_block(Op::Stored(tier), hash, page);
    }

    /// Appends that block `hash` of `page` was removed from `tier`.
    #[inline(always)]
    pub fn removed(&mut self, tier: Tier, hash: BlockHash, page: BlockHash) {
        self.push_block(Op::Removed(tier), hash, page);
    }

    /// Appends that the blocks `keys` were stored in `tier`, in order.
    #[inline]
    pub fn stored_all<I: IntoIterator<Item = PageKey, IntoIter: Clone>>(&mut self, tier: Tier, keys: I) {
        self.push_keys(Op::Stored(tier), keys);
    }

    /// Appends that the blocks `keys` were removed from `tier`, in order.
    #[inline]
    pub fn removed_all<I: IntoIterator<Item = PageKey, IntoIter: Clone>>(&mut self, tier: Tier, keys: I) {
        self.push_keys(Op::Removed(tier), keys);
    }

    /// Appends that the blocks `runs` lists were stored in `tier`, in order.
    #[inline]
    pub fn stored_runs(&mut self, tier: Tier, runs: &PageRuns) {
        self.push_runs(Op::Stored(tier), runs);
    }

    /// Appends that the blocks `runs` lists were removed from `tier`, in order.
    #[inline]
    pub fn removed_runs(&mut self, tier: Tier, runs: &PageRuns) {
        self.push_runs(Op::Removed(tier), runs);
    }

    /// Appends blocks' events of one kind given as page runs: a head a run (the first one
    /// joining the batch's last run when it continues it), the hashes in one copy.
    #[inline]
    fn push_runs(&mut self, op: Op, runs: &PageRuns) {
        let mut start = self.start();
        for (page, hashes) in runs.runs() {
            self.push_head(op, page, start);
            start += hashes.len() as u32;
        }
        self.hashes.extend_from_slice(runs.hashes());
    }

    /// Appends that the blocks `hashes`, all of `page`, were stored in `tier`, in order (one
    /// head at most, one copy).
    #[inline]
    pub fn stored_run(&mut self, tier: Tier, page: BlockHash, hashes: &[BlockHash]) {
        if !hashes.is_empty() {
            self.push_head(Op::Stored(tier), page, self.start());
            self.hashes.extend_from_slice(hashes);
        }
    }

    /// Appends that the blocks of `hashes` (of `page`, 64 at most) that `removed` marks (bit `k` for
    /// `hashes[k]`, as [`super::BlockLru::remove_all`] gives them) were removed from `tier`,
    /// in order: one run, the hashes in one copy when all are marked.
    #[inline]
    pub fn removed_some(&mut self, tier: Tier, page: BlockHash, hashes: &[BlockHash], removed: u64) {
        debug_assert!(hashes.len() <= 64 && (hashes.len() == 64 || removed >> hashes.len() == 0));
        if removed == 0 {
            return;
        }
        self.push_head(Op::Removed(tier), page, self.start());
        if removed.count_ones() as usize == hashes.len() {
            self.hashes.extend_from_slice(hashes);
        } else {
            self.hashes.extend(marked(hashes, removed));
        }
    }

    /// Starts a run of `op` on `page` at `start` (where the next hash goes), unless the
    /// batch's last run is of that kind and page and goes on there.
    #[inline(always)]
    fn push_head(&mut self, op: Op, page: BlockHash, start: u32) {
        if !self.heads.last().is_some_and(|h| h.op == op && h.page == page) {
            self.heads.push(Head { op, page, start });
            self.count(op);
        }
    }

    /// Appends blocks' events of one kind in two passes: the runs' heads where the page
    /// changes (the first key's checked against the run it may extend), then the hashes in
    /// one copy of known length.
    #[inline(always)]
    fn push_keys<I: IntoIterator<Item = PageKey, IntoIter: Clone>>(&mut self, op: Op, keys: I) {
        let keys = keys.into_iter();
        let mut rest = keys.clone();
        let Some(first) = rest.next() else { return };
        let start = self.start();
        self.push_head(op, first.page, start);
        let mut page = first.page;
        for (key, at) in rest.zip(start + 1..) {
            if key.page != page {
                self.heads.push(Head { op, page: key.page, start: at });
                self.count(op);
                page = key.page;
            }
        }
        self.hashes.extend(keys.map(|key| key.hash));
    }

    /// Counts a run of `op` just started among the kinds readers ask for.
    #[inline(always)]
    fn count(&mut self, op: Op) {
        self.lower_removals += u32::from(op.removes_below_l1());
        self.l1_removals += u32::from(op.removes_from_l1());
    }

    #[inline(always)]
    fn push_block(&mut self, op: Op, hash: BlockHash, page: BlockHash) {
        self.push_head(op, page, self.start());
        self.hashes.push(hash);
    }

    /// Where a run started now would start.
    fn start(&self) -> u32 {
        self.hashes.len() as u32
    }

    /// Appends `other`'s events, emptying it.
    pub fn append(&mut self, other: &mut KvEvents) {
        for run in other.runs() {
            match run.parts() {
                (Op::Cleared, ..) => self.push(KvEvent::Cleared),
                (op, page, hashes) => {
                    if let Some((&first, rest)) = hashes.split_first() {
                        self.push_block(op, first, page);
                        self.hashes.extend_from_slice(rest);
                    }
                }
            }
        }
        other.clear();
    }

    /// No events.
    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }

    /// Events, counted block by block.
    pub fn len(&self) -> usize {
        self.hashes.len() + self.cleared as usize
    }

    /// Blocks' events the buffers hold room for.
    pub fn capacity(&self) -> usize {
        self.hashes.capacity()
    }

    /// Empties the batch, keeping its buffers.
    pub fn clear(&mut self) {
        self.cleared = 0;
        self.lower_removals = 0;
        self.l1_removals = 0;
        self.heads.clear();
        self.hashes.clear();
    }

    /// The runs, in order.
    pub fn runs(&self) -> impl Iterator<Item = KvRun<'_>> + '_ {
        let ends = self.heads.iter().skip(1).map(|h| h.start as usize).chain([self.hashes.len()]);
        self.heads.iter().zip(ends).map(move |(h, end)| self.run_of(h, end))
    }

    /// How many runs the batch holds.
    pub fn run_count(&self) -> usize {
        self.heads.len()
    }

    /// Run `i` of [`KvEvents::runs`] (a reader looking ahead in the batch).
    #[inline]
    pub fn run(&self, i: usize) -> KvRun<'_> {
        let end = self.heads.get(i + 1).map_or(self.hashes.len(), |h| h.start as usize);
        self.run_of(&self.heads[i], end)
    }

    /// The page of run `i` (page 0 for a `Cleared`): a look ahead that reads no hashes.
    #[inline]
    pub fn run_page(&self, i: usize) -> BlockHash {
        self.heads[i].page
    }

    /// How many runs remove blocks from L2 or L3.
    pub fn lower_removal_runs(&self) -> u32 {
        self.lower_removals
    }

    /// How many runs remove blocks from L1.
    pub fn l1_removal_runs(&self) -> u32 {
        self.l1_removals
    }

    /// The first `Cleared` run from run `from` on (the run count when none).
    pub fn next_cleared(&self, from: usize) -> usize {
        if self.cleared == 0 {
            return self.heads.len();
        }
        let heads = self.heads.get(from..).unwrap_or_default();
        heads.iter().position(|h| h.op == Op::Cleared).map_or(self.heads.len(), |k| from + k)
    }

    #[inline(always)]
    fn run_of(&self, h: &Head, end: usize) -> KvRun<'_> {
        let hashes = &self.hashes[h.start as usize..end];
        match h.op {
            Op::Stored(tier) => KvRun::Stored { tier, page: h.page, hashes },
            Op::Removed(tier) => KvRun::Removed { tier, page: h.page, hashes },
            Op::Cleared => KvRun::Cleared,
        }
    }

    /// The events, block by block.
    pub fn iter(&self) -> impl Iterator<Item = KvEvent> + '_ {
        self.runs().flat_map(KvRun::events)
    }
}

impl Extend<KvEvent> for KvEvents {
    #[inline]
    fn extend<I: IntoIterator<Item = KvEvent>>(&mut self, events: I) {
        for event in events {
            self.push(event);
        }
    }
}

impl FromIterator<KvEvent> for KvEvents {
    fn from_iter<I: IntoIterator<Item = KvEvent>>(events: I) -> KvEvents {
        let mut batch = KvEvents::new();
        batch.extend(events);
        batch
    }
}

impl From<Vec<KvEvent>> for KvEvents {
    fn from(events: Vec<KvEvent>) -> KvEvents {
        events.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: u8, tier: u8, hash: u64, page: u64) -> KvEvent {
        let (tier, hash, page) = (Tier::ALL[tier as usize], BlockHash(hash), BlockHash(page));
        match kind {
            0 => KvEvent::Stored { tier, hash, page },
            1 => KvEvent::Removed { tier, hash, page },
            _ => KvEvent::Cleared,
        }
    }

    #[test]
    fn consecutive_events_of_one_kind_tier_and_page_are_one_run() {
        let events: KvEvents = [event(0, 0, 1, 1), event(0, 0, 2, 1), event(0, 1, 1, 1), event(0, 1, 9, 9)]
            .into_iter()
            .chain([event(2, 0, 0, 0), event(2, 0, 0, 0), event(1, 1, 9, 9)])
            .collect();
        let runs: Vec<KvRun> = events.runs().collect();
        let h = |hs: &[u64]| hs.iter().map(|&h| BlockHash(h)).collect::<Vec<_>>();
        assert_eq!(runs.len(), 6);
        assert_eq!(runs[0], KvRun::Stored { tier: Tier::L1, page: BlockHash(1), hashes: &h(&[1, 2]) });
        assert_eq!(runs[1], KvRun::Stored { tier: Tier::L2, page: BlockHash(1), hashes: &h(&[1]) });
        assert_eq!(runs[3], KvRun::Cleared);
        assert_eq!(runs[4], KvRun::Cleared);
        assert_eq!(events.len(), 7);
    }

    /// Whether two events are of one kind and tier.
    fn same_op(a: &KvEvent, b: &KvEvent) -> bool {
        match (*a, *b) {
            (KvEvent::Stored { tier: s, .. }, KvEvent::Stored { tier: t, .. }) => s == t,
            (KvEvent::Removed { tier: s, .. }, KvEvent::Removed { tier: t, .. }) => s == t,
            (KvEvent::Cleared, KvEvent::Cleared) => true,
            _ => false,
        }
    }

    proptest::proptest! {
        /// Whatever the events, a batch gives them back in order, block by block; appending
        /// one batch to another, or giving them a stretch of one kind and tier at a time, gives
        /// the runs pushing all the events to one would.
        #[test]
        fn a_batch_gives_back_its_events(
            events in proptest::collection::vec((0u8..3, 0u8..3, 0u64..6, 0u64..3), 0..60),
            split in 0usize..60,
        ) {
            let events: Vec<KvEvent> = events.into_iter().map(|(k, t, h, p)| event(k, t, h, p)).collect();
            let batch: KvEvents = events.iter().copied().collect();
            proptest::prop_assert_eq!(batch.iter().collect::<Vec<_>>(), events.clone());
            proptest::prop_assert_eq!(batch.len(), events.len());
            let split = split.min(events.len());
            let mut first: KvEvents = events[..split].iter().copied().collect();
            let mut second: KvEvents = events[split..].iter().copied().collect();
            first.append(&mut second);
            proptest::prop_assert!(second.is_empty());
            proptest::prop_assert_eq!(&first, &batch);
            // The same events given a stretch of one kind and tier at a time.
            let mut by_stretch = KvEvents::new();
            for stretch in events.chunk_by(same_op) {
                let keys = stretch.iter().filter_map(|e| match *e {
                    KvEvent::Stored { hash, page, .. } | KvEvent::Removed { hash, page, .. } => Some(PageKey { hash, page }),
                    KvEvent::Cleared => None,
                });
                match stretch[0] {
                    KvEvent::Stored { tier, .. } => by_stretch.stored_all(tier, keys),
                    KvEvent::Removed { tier, .. } => by_stretch.removed_all(tier, keys),
                    KvEvent::Cleared => by_stretch.extend(stretch.iter().copied()),
                }
            }
            proptest::prop_assert_eq!(&by_stretch, &batch);
            // Each run's next `Cleared` is the one a scan of the runs finds; a batch cleared
            // and used again counts only its new events.
            let runs: Vec<KvRun<'_>> = batch.runs().collect();
            for from in 0..=runs.len() {
                let want = (from..runs.len()).find(|&i| runs[i] == KvRun::Cleared).unwrap_or(runs.len());
                proptest::prop_assert_eq!(batch.next_cleared(from), want);
            }
            let lower = |runs: &[KvRun<'_>]| {
                runs.iter().filter(|r| matches!(r, KvRun::Removed { tier: Tier::L2 | Tier::L3, .. })).count() as u32
            };
            proptest::prop_assert_eq!(batch.lower_removal_runs(), lower(&runs));
            proptest::prop_assert_eq!(by_stretch.lower_removal_runs(), lower(&runs));
            let mut reused = batch.clone();
            reused.clear();
            reused.extend(events[split..].iter().copied());
            proptest::prop_assert_eq!(reused.len(), events.len() - split);
            let fresh: KvEvents = events[split..].iter().copied().collect();
            proptest::prop_assert_eq!(reused.next_cleared(0), fresh.next_cleared(0));
            proptest::prop_assert_eq!(reused.lower_removal_runs(), lower(&fresh.runs().collect::<Vec<_>>()));
            let l1 = |runs: &[KvRun<'_>]| runs.iter().filter(|r| matches!(r, KvRun::Removed { tier: Tier::L1, .. })).count() as u32;
            let fresh_runs: Vec<KvRun<'_>> = fresh.runs().collect();
            for (b, name) in [(&batch, "batch"), (&by_stretch, "by stretch")] {
                proptest::prop_assert_eq!(b.l1_removal_runs(), l1(&runs), "{}", name);
            }
            proptest::prop_assert_eq!(reused.l1_removal_runs(), l1(&fresh_runs));
        }

        /// A page's removals given with a mask (a store's `remove_all`) are the runs pushing
        /// the marked blocks' events one by one gives, after whatever came before (a run of
        /// the same page and tier extended, none started for an empty mask).
        #[test]
        fn a_page_s_removals_by_mask_are_its_blocks_removed_one_by_one(
            before in proptest::collection::vec((0u8..3, 0u8..3, 0u64..6, 0u64..3), 0..8),
            pages in proptest::collection::vec((0u64..3, 1usize..70, proptest::num::u64::ANY, 0u8..3), 0..6),
        ) {
            let before: Vec<KvEvent> = before.into_iter().map(|(k, t, h, p)| event(k, t, h, p)).collect();
            let mut by_mask: KvEvents = before.iter().copied().collect();
            let mut one_by_one = by_mask.clone();
            for (page, n, mask, full) in pages {
                let n = n.min(64);
                let hashes: Vec<BlockHash> = (0..n as u64).map(|h| BlockHash(h * 7 % 5)).collect();
                // Every block, none or some (the mask's bits past the blocks cleared).
                let mask = match full {
                    0 => u64::MAX,
                    1 => 0,
                    _ => mask,
                } & (u64::MAX >> (64 - n));
                let (tier, page) = (Tier::L2, BlockHash(page));
                by_mask.removed_some(tier, page, &hashes, mask);
                for (k, &hash) in hashes.iter().enumerate() {
                    if mask >> k & 1 == 1 {
                        one_by_one.removed(tier, hash, page);
                    }
                }
            }
            proptest::prop_assert_eq!(by_mask, one_by_one);
        }
    }
}
