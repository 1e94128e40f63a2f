//! [`PageRuns`]: a list of blocks kept as runs of one page each, the shape a demotion has
//! from the tree's eviction (a leaf's blocks a page at a time) through the stores' puts to
//! the events published: each step takes a page's run whole instead of finding where the
//! page changes block by block.

use super::store::PageKey;
use crate::ids::BlockHash;

/// Blocks in order, as runs of consecutive blocks of one page (two runs side by side are of
/// different pages: a block of the last run's page joins it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageRuns {
    /// The blocks' hashes, in order.
    hashes: Vec<BlockHash>,
    /// Each run's page and the end of its blocks in `hashes` (a run starts where the one
    /// before ends).
    runs: Vec<(BlockHash, u32)>,
}

impl PageRuns {
    pub fn new() -> PageRuns {
        PageRuns::default()
    }

    /// Blocks listed.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// Blocks there is room for without growing (what a scratch list keeps).
    pub fn capacity(&self) -> usize {
        self.hashes.capacity()
    }

    pub fn clear(&mut self) {
        self.hashes.clear();
        self.runs.clear();
    }

    /// Appends `hashes`, blocks of `page`, in order.
    #[inline]
    pub fn push_run(&mut self, page: BlockHash, hashes: impl IntoIterator<Item = BlockHash>) {
        let start = self.hashes.len();
        self.hashes.extend(hashes);
        self.close_run(page, start);
    }

    /// Appends the blocks of `hashes`, of `page`, in order (one copy).
    #[inline]
    pub fn extend_run(&mut self, page: BlockHash, hashes: &[BlockHash]) {
        let start = self.hashes.len();
        self.hashes.extend_from_slice(hashes);
        self.close_run(page, start);
    }

    /// Appends the blocks `fill` pushes onto the hashes, of `page`, in order; returns what
    /// `fill` does.
    #[inline]
    pub fn push_with<R>(&mut self, page: BlockHash, fill: impl FnOnce(&mut Vec<BlockHash>) -> R) -> R {
        let start = self.hashes.len();
        let r = fill(&mut self.hashes);
        self.close_run(page, start);
        r
    }

    /// Appends one block.
    #[inline]
    pub fn push(&mut self, key: PageKey) {
        let start = self.hashes.len();
        self.hashes.push(key.hash);
        self.close_run(key.page, start);
    }

    /// Counts the blocks appended from `start` on, of `page`: they join the last run when it
    /// is of that page, and start one otherwise.
    #[inline(always)]
    fn close_run(&mut self, page: BlockHash, start: usize) {
        let end = self.hashes.len() as u32;
        match self.runs.last_mut() {
            _ if end as usize == start => {}
            Some((last, e)) if *last == page => *e = end,
            _ => self.runs.push((page, end)),
        }
    }

    /// The blocks' hashes, in order.
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// The runs in order: each page and its blocks.
    pub fn runs(&self) -> impl Iterator<Item = (BlockHash, &[BlockHash])> + '_ {
        let starts = std::iter::once(0).chain(self.runs.iter().map(|&(_, end)| end));
        self.runs.iter().zip(starts).map(|(&(page, end), start)| (page, &self.hashes[start as usize..end as usize]))
    }

    /// The blocks one by one.
    pub fn keys(&self) -> impl Iterator<Item = PageKey> + '_ {
        self.runs().flat_map(|(page, hashes)| hashes.iter().map(move |&hash| PageKey { hash, page }))
    }
}

impl FromIterator<PageKey> for PageRuns {
    fn from_iter<I: IntoIterator<Item = PageKey>>(keys: I) -> PageRuns {
        let mut runs = PageRuns::new();
        for key in keys {
            runs.push(key);
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the pushes, the runs give back the blocks in order, each run of one page
        /// and no two runs side by side of the same page.
        #[test]
        fn runs_keep_blocks_in_order(
            pushes in proptest::collection::vec((0u64..3, proptest::collection::vec(1u64..1000, 0..5)), 0..20),
        ) {
            let mut runs = PageRuns::new();
            let mut want = Vec::new();
            for (k, (page, hashes)) in pushes.iter().enumerate() {
                let page = BlockHash(*page);
                let hashes: Vec<BlockHash> = hashes.iter().map(|&h| BlockHash(h)).collect();
                want.extend(hashes.iter().map(|&hash| PageKey { hash, page }));
                match k % 4 {
                    0 => runs.push_run(page, hashes.iter().copied()),
                    1 => runs.extend_run(page, &hashes),
                    2 => runs.push_with(page, |out| out.extend_from_slice(&hashes)),
                    _ => hashes.iter().for_each(|&hash| runs.push(PageKey { hash, page })),
                }
            }
            prop_assert_eq!(runs.keys().collect::<Vec<_>>(), want.clone());
            prop_assert_eq!(runs.len(), want.len());
            prop_assert!(runs.runs().all(|(_, hashes)| !hashes.is_empty()));
            let pages: Vec<BlockHash> = runs.runs().map(|(page, _)| page).collect();
            prop_assert!(pages.windows(2).all(|w| w[0] != w[1]));
            prop_assert_eq!(want.into_iter().collect::<PageRuns>(), runs);
        }
    }
}
