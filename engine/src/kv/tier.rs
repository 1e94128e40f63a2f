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
use crate::slots;
use serde::{Deserialize, Serialize};
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

/// End of the LRU list.
const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Entry {
    hash: BlockHash,
    prev: u32,
    next: u32,
}

/// A set of block hashes with a capacity, evicting the least recently used: the L2 and L3
/// stores. Only hashes are kept: the simulator needs to know what is there, not its bytes.
/// The L3 store holds millions of blocks, so the hash-to-entry map is a [`BlockMap`]: one
/// cache miss a probe where a SwissTable takes two.
#[derive(Clone, Debug, Default)]
pub struct BlockLru {
    capacity: u32,
    slots: BlockMap<u32>,
    entries: Vec<Entry>,
    free: Vec<u32>,
    /// Least recently used (evicted first), and most recently used.
    head: u32,
    tail: u32,
}

impl BlockLru {
    pub fn new(capacity: u32) -> BlockLru {
        BlockLru { capacity, head: NIL, tail: NIL, ..BlockLru::default() }
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn len(&self) -> u32 {
        self.slots.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.slots.get(hash).is_some()
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
        let vacancy = match self.slots.probe(hash) {
            Probe::Found(s) => {
                self.unlink(s);
                self.push_back(s);
                return Put::Refreshed;
            }
            Probe::Vacant(v) => v,
        };
        // Making room moves entries of the map (removal shifts them back): probe again then,
        // the lines just read still in the cache.
        let (evicted, vacancy) = if self.len() >= self.capacity {
            let evicted = self.pop_front();
            match self.slots.probe(hash) {
                Probe::Vacant(v) => (evicted, v),
                Probe::Found(_) => unreachable!("{hash:?} was not in the store"),
            }
        } else {
            (None, vacancy)
        };
        let s = slots::place(&mut self.entries, &mut self.free, Entry { hash, prev: NIL, next: NIL });
        self.slots.fill(vacancy, hash, s);
        self.push_back(s);
        Put::Added { evicted }
    }

    /// Loads the map entry where `hash` would be found, so that its cache miss overlaps with
    /// other work; returns what it read, for the caller to keep (a prefetch in safe code).
    pub fn prefetch(&self, hash: BlockHash) -> u64 {
        self.slots.touch(hash)
    }

    /// Marks `hash` as just used; false when it is not here.
    pub fn touch(&mut self, hash: BlockHash) -> bool {
        let Some(s) = self.slots.get(hash) else { return false };
        self.unlink(s);
        self.push_back(s);
        true
    }

    pub fn remove(&mut self, hash: BlockHash) -> bool {
        let Some(s) = self.slots.remove(hash) else { return false };
        self.unlink(s);
        self.free.push(s);
        true
    }

    /// The hashes held, least recently used first.
    pub fn iter(&self) -> impl Iterator<Item = BlockHash> + '_ {
        let mut s = self.head;
        std::iter::from_fn(move || {
            let e = self.entries.get(s as usize)?;
            s = e.next;
            Some(e.hash)
        })
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.slots.clear();
        self.entries.clear();
        self.free.clear();
        self.head = NIL;
        self.tail = NIL;
    }

    fn pop_front(&mut self) -> Option<BlockHash> {
        if self.head == NIL {
            return None;
        }
        let s = self.head;
        let hash = self.entries[s as usize].hash;
        self.unlink(s);
        self.slots.remove(hash);
        self.free.push(s);
        Some(hash)
    }

    fn push_back(&mut self, s: u32) {
        let tail = self.tail;
        let e = &mut self.entries[s as usize];
        e.prev = tail;
        e.next = NIL;
        if tail == NIL {
            self.head = s;
        } else {
            self.entries[tail as usize].next = s;
        }
        self.tail = s;
    }

    fn unlink(&mut self, s: u32) {
        let Entry { prev, next, .. } = self.entries[s as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.entries[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.entries[next as usize].prev = prev;
        }
    }

    /// Checks that the map and the list agree; panics naming the broken rule.
    pub fn check_invariants(&self) {
        assert!(self.len() <= self.capacity, "store holds {} blocks, capacity {}", self.len(), self.capacity);
        let mut listed = 0u32;
        let mut s = self.head;
        let mut prev = NIL;
        while s != NIL {
            let e = &self.entries[s as usize];
            assert_eq!(e.prev, prev, "LRU list back link");
            assert_eq!(self.slots.get(e.hash), Some(s), "listed hash not in the map");
            listed += 1;
            prev = s;
            s = e.next;
        }
        assert_eq!(prev, self.tail, "LRU list tail");
        assert_eq!(listed, self.len(), "LRU list length");
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
