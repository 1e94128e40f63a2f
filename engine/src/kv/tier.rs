//! The tiers below GPU memory: host DRAM (L2, one per instance) and a store shared by the
//! whole fleet (L3), both hash-keyed LRU sets of blocks, and the KV events every tier
//! publishes.
//!
//! L1 is the prefix tree in GPU memory. A block evicted from L1 is demoted to L2 and written
//! through to L3 (the fleet's shared store, as in Mooncake's architecture: host memory caches
//! the store, it does not stand in front of it); L2's and L3's victims are gone. L1 and L2 of
//! one instance are exclusive (a hit in L2 moves the block up to L1). L3 is shared: loading a
//! block from it leaves it there for the other instances, so it is inclusive of what
//! instances hold.

use crate::block_map::{BlockMap, Probe};
use crate::ids::BlockHash;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

/// Where a cached block lives. Ordered from fastest to slowest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// GPU memory of the instance.
    L1,
    /// Host memory of the instance, loaded back over PCIe.
    L2,
    /// A store shared by all instances (SSD or a distributed pool), loaded over the network.
    L3,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::L1, Tier::L2, Tier::L3];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::L1 => "l1",
            Tier::L2 => "l2",
            Tier::L3 => "l3",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A change to the set of cached blocks, in the shape of vLLM's KV events (stored with its
/// parent, removed, all cleared) with the tier as the medium. An instance publishes the
/// events of its L1 and L2, and of the L3 changes it causes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEvent {
    Stored {
        tier: Tier,
        hash: BlockHash,
        parent: Option<BlockHash>,
    },
    Removed {
        tier: Tier,
        hash: BlockHash,
    },
    /// The instance dropped everything in its own tiers (L1 and L2).
    Cleared,
}

/// What [`BlockLru::put`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Put {
    /// The hash was there: now the most recently used.
    Refreshed,
    /// The hash is new; `evicted` made room for it.
    Added { evicted: Option<BlockHash> },
}

/// A set of block hashes with a capacity, evicting the least recently used: the L2 and L3
/// stores. Only hashes are kept: the simulator needs to know what is there, not its bytes.
///
/// Each use stamps the hash with the next number and appends (hash, stamp) to a queue; a
/// queue entry is live while its stamp is the hash's latest, so the live entries, oldest
/// first, are the exact LRU order. The next victims are then known ahead, at the queue's
/// front, and their map entries can be loaded before they are needed
/// ([`BlockLru::prefetch_victims`]); a linked list would have to be chased, one cache miss a
/// link. Stale entries are skipped when they reach the front, and dropped all at once when
/// they outnumber half the live ones. The map is a [`BlockMap`]: one cache miss a probe.
#[derive(Clone, Debug, Default)]
pub struct BlockLru {
    capacity: u32,
    /// Each held hash's latest stamp.
    stamps: BlockMap<u64>,
    /// Uses, oldest first.
    order: VecDeque<(BlockHash, u64)>,
    /// The next use's stamp.
    next_stamp: u64,
}

/// Stale queue entries tolerated besides the live ones before a compaction (a half of
/// them, plus this).
const STALE_SLACK: usize = 64;

impl BlockLru {
    pub fn new(capacity: u32) -> BlockLru {
        BlockLru { capacity, ..BlockLru::default() }
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn len(&self) -> u32 {
        self.stamps.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.stamps.is_empty()
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.stamps.get(hash).is_some()
    }

    /// Adds `hash` as the most recently used (or refreshes it). When the store is full, the
    /// least recently used hash makes room and is returned. A store of capacity zero keeps
    /// nothing and hands `hash` straight back.
    pub fn insert(&mut self, hash: BlockHash) -> Option<BlockHash> {
        match self.put(hash) {
            Put::Refreshed => None,
            Put::Added { evicted } => evicted,
        }
    }

    /// Like [`BlockLru::insert`], telling a refresh from an addition (only an addition is news
    /// for an index).
    pub fn put(&mut self, hash: BlockHash) -> Put {
        if self.capacity == 0 {
            return Put::Added { evicted: Some(hash) };
        }
        let stamp = self.next_stamp;
        let vacancy = match self.stamps.probe(hash) {
            Probe::Found(_) => {
                self.stamps.set(hash, stamp);
                self.used(hash, stamp);
                return Put::Refreshed;
            }
            Probe::Vacant(v) => v,
        };
        // Making room moves entries of the map (removal shifts them back): probe again then,
        // the lines just read still in the cache.
        let (evicted, vacancy) = if self.len() >= self.capacity {
            let evicted = self.pop_front();
            match self.stamps.probe(hash) {
                Probe::Vacant(v) => (evicted, v),
                Probe::Found(_) => unreachable!("{hash:?} was not in the store"),
            }
        } else {
            (None, vacancy)
        };
        self.stamps.fill(vacancy, hash, stamp);
        self.used(hash, stamp);
        Put::Added { evicted }
    }

    /// Marks `hash` as just used; false when it is not here.
    pub fn touch(&mut self, hash: BlockHash) -> bool {
        if self.stamps.get(hash).is_none() {
            return false;
        }
        let stamp = self.next_stamp;
        self.stamps.set(hash, stamp);
        self.used(hash, stamp);
        true
    }

    pub fn remove(&mut self, hash: BlockHash) -> bool {
        let removed = self.stamps.remove(hash).is_some();
        if removed {
            self.compact_if_stale();
        }
        removed
    }

    /// Loads the map entry where `hash` would be found, so that its cache miss overlaps with
    /// other work; returns what it read, for the caller to keep (a prefetch in safe code).
    pub fn prefetch(&self, hash: BlockHash) -> u64 {
        self.stamps.touch(hash)
    }

    /// [`BlockLru::prefetch`] for the next `n` victims (fewer if stale entries are among
    /// them).
    pub fn prefetch_victims(&self, n: usize) -> u64 {
        self.order.iter().take(n).fold(0, |sink, &(h, _)| sink ^ self.stamps.touch(h))
    }

    /// The hashes held, least recently used first.
    pub fn iter(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.order.iter().filter(|&&(h, s)| self.stamps.get(h) == Some(s)).map(|&(h, _)| h)
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.stamps.clear();
        self.order.clear();
    }

    /// Records a use of `hash` stamped `stamp` (already in the map).
    fn used(&mut self, hash: BlockHash, stamp: u64) {
        self.next_stamp = stamp + 1;
        let len = self.order.len();
        if len == self.order.capacity() {
            // Doubling a full store's queue would leave a quarter of it unused forever: it never
            // holds more than the compaction threshold.
            let most = self.capacity as usize + self.capacity as usize / 2 + STALE_SLACK + 1;
            self.order.reserve_exact(len.max(16).min(most.saturating_sub(len).max(1)));
        }
        self.order.push_back((hash, stamp));
        self.compact_if_stale();
    }

    fn pop_front(&mut self) -> Option<BlockHash> {
        while let Some((hash, stamp)) = self.order.pop_front() {
            if self.stamps.get(hash) == Some(stamp) {
                self.stamps.remove(hash);
                return Some(hash);
            }
        }
        None
    }

    /// Drops the stale queue entries once they outnumber half the live ones.
    fn compact_if_stale(&mut self) {
        let live = self.stamps.len();
        if self.order.len() > live + live / 2 + STALE_SLACK {
            let stamps = &self.stamps;
            self.order.retain(|&(h, s)| stamps.get(h) == Some(s));
        }
    }

    /// Checks that the map and the queue agree; panics naming the broken rule.
    pub fn check_invariants(&self) {
        assert!(self.len() <= self.capacity, "store holds {} blocks, capacity {}", self.len(), self.capacity);
        assert!(self.order.iter().zip(self.order.iter().skip(1)).all(|(a, b)| a.1 < b.1), "queue stamps increase");
        assert!(self.order.iter().all(|&(_, s)| s < self.next_stamp), "queue stamps were handed out");
        assert_eq!(self.iter().count(), self.stamps.len(), "one live queue entry per held hash");
        let live = self.stamps.len();
        assert!(self.order.len() <= live + live / 2 + STALE_SLACK, "stale entries compacted");
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

    fn h(i: u64) -> BlockHash {
        BlockHash(i)
    }

    #[test]
    fn evicts_least_recently_used_first() {
        let mut lru = BlockLru::new(2);
        assert_eq!(lru.insert(h(1)), None);
        assert_eq!(lru.insert(h(2)), None);
        assert!(lru.touch(h(1)));
        assert_eq!(lru.insert(h(3)), Some(h(2)));
        assert!(lru.contains(h(1)) && lru.contains(h(3)) && !lru.contains(h(2)));
        assert!(lru.remove(h(1)));
        assert!(!lru.remove(h(1)));
        assert_eq!(lru.insert(h(4)), None);
        assert_eq!(lru.insert(h(5)), Some(h(3)));
        lru.check_invariants();
    }

    /// The obvious LRU: a vector, least recently used first.
    #[derive(Default)]
    struct Model {
        capacity: usize,
        order: Vec<BlockHash>,
    }

    impl Model {
        fn put(&mut self, hash: BlockHash) -> Put {
            if self.capacity == 0 {
                return Put::Added { evicted: Some(hash) };
            }
            if self.touch(hash) {
                return Put::Refreshed;
            }
            let evicted = (self.order.len() >= self.capacity).then(|| self.order.remove(0));
            self.order.push(hash);
            Put::Added { evicted }
        }

        fn touch(&mut self, hash: BlockHash) -> bool {
            let Some(i) = self.order.iter().position(|&h| h == hash) else { return false };
            self.order.remove(i);
            self.order.push(hash);
            true
        }

        fn remove(&mut self, hash: BlockHash) -> bool {
            let Some(i) = self.order.iter().position(|&h| h == hash) else { return false };
            self.order.remove(i);
            true
        }
    }

    proptest::proptest! {
        /// Whatever the uses, the store answers as the obvious LRU does: the same evictions,
        /// refreshes, removals and order.
        #[test]
        fn the_store_answers_as_a_plain_lru(
            capacity in 0usize..12,
            ops in proptest::collection::vec((0u8..4, 0u64..24), 0..400),
        ) {
            let mut lru = BlockLru::new(capacity as u32);
            let mut model = Model { capacity, ..Model::default() };
            for (op, key) in ops {
                let hash = h(key);
                match op {
                    0 | 1 => proptest::prop_assert_eq!(lru.put(hash), model.put(hash)),
                    2 => proptest::prop_assert_eq!(lru.touch(hash), model.touch(hash)),
                    _ => proptest::prop_assert_eq!(lru.remove(hash), model.remove(hash)),
                }
                proptest::prop_assert_eq!(lru.contains(hash), model.order.contains(&hash));
                proptest::prop_assert_eq!(lru.len() as usize, model.order.len());
                lru.check_invariants();
            }
            proptest::prop_assert_eq!(lru.iter().collect::<Vec<_>>(), model.order);
            lru.clear();
            proptest::prop_assert!(lru.is_empty() && lru.iter().next().is_none());
        }
    }

    #[test]
    fn a_store_of_no_capacity_keeps_nothing() {
        let mut lru = BlockLru::new(0);
        assert_eq!(lru.insert(h(1)), Some(h(1)));
        assert!(lru.is_empty());
    }
}
