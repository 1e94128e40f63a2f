//! A map from block hash to a small value, for maps far larger than the caches: the global
//! prefix index's block locations and the KV tiers' stores. Keys are chained block hashes,
//! already well mixed; the value is copied in and out.

use crate::ids::BlockHash;

/// Block hash to a small value `V`: open addressing with linear probing over 12-byte entries
/// (with a `u32` value), so that a probe of a map far larger than the caches usually costs one
/// cache miss (hashbrown keeps control bytes and buckets apart: two dependent misses), and a
/// store probes once for both "is it there" and "where would it go".
#[derive(Clone, Debug)]
pub struct BlockMap<V> {
    /// A power of two long (or empty); a key of 0 marks a free entry.
    entries: Vec<Entry<V>>,
    /// Keys in `entries` (not counting `zero`).
    len: usize,
    /// The block whose hash is 0, which cannot be in `entries`.
    zero: Option<V>,
}

/// The key in two halves: with a `u32` value, 12 bytes an entry instead of 16 (the maps hold
/// one entry a page, hundreds of thousands of them).
#[derive(Clone, Copy, Debug, Default)]
struct Entry<V> {
    key: [u32; 2],
    val: V,
}

impl<V> Entry<V> {
    #[inline(always)]
    fn key(&self) -> u64 {
        u64::from(self.key[0]) | u64::from(self.key[1]) << 32
    }

    fn new(key: u64, val: V) -> Entry<V> {
        Entry { key: [key as u32, (key >> 32) as u32], val }
    }
}

/// Where a key is, or the free entry it would take.
pub enum Probe<V> {
    Found(V),
    Vacant(usize),
}

/// The entry used for the key 0 in [`Probe::Vacant`].
const ZERO_SLOT: usize = usize::MAX;

impl<V: Copy + Default> BlockMap<V> {
    pub fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&mut self) {
        *self = BlockMap::default();
    }

    pub fn bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry<V>>()
    }

    /// Fibonacci hashing: the top bits of `key × 2^64/φ`, well spread even for keys that are
    /// not hashes (small test values).
    fn home(&self, key: u64) -> usize {
        let bits = self.entries.len().trailing_zeros();
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - bits)) as usize
    }

    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.entries.is_empty() {
            return None;
        }
        let mask = self.entries.len() - 1;
        let mut i = self.home(key);
        loop {
            let k = self.entries[i].key();
            if k == key {
                return Some(i);
            }
            if k == 0 {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    pub fn get(&self, hash: BlockHash) -> Option<V> {
        if hash.0 == 0 {
            return self.zero;
        }
        self.find(hash.0).map(|i| self.entries[i].val)
    }

    /// Looks `hash` up, making room for one more key first so that a vacancy can be filled.
    pub fn probe(&mut self, hash: BlockHash) -> Probe<V> {
        if hash.0 == 0 {
            return self.zero.map_or(Probe::Vacant(ZERO_SLOT), Probe::Found);
        }
        // At most 5/8 full: a probe for an absent key (every new page's) scans
        // (1 + 1/(1 - load)^2)/2 entries, 14 at 13/16 full, 4 here; the maps are per page,
        // small beside the blocks.
        if (self.len + 1) * 8 > self.entries.len() * 5 {
            self.grow();
        }
        let mask = self.entries.len() - 1;
        let mut i = self.home(hash.0);
        loop {
            let e = self.entries[i];
            if e.key() == hash.0 {
                return Probe::Found(e.val);
            }
            if e.key() == 0 {
                return Probe::Vacant(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// Fills the vacancy [`BlockMap::probe`] returned for `hash` (nothing changed between).
    pub fn fill(&mut self, slot: usize, hash: BlockHash, val: V) {
        if slot == ZERO_SLOT {
            self.zero = Some(val);
        } else {
            debug_assert_eq!(self.entries[slot].key(), 0);
            self.entries[slot] = Entry::new(hash.0, val);
            self.len += 1;
        }
    }

    /// Sets `hash` to `val`, whether it was there or not.
    pub fn insert(&mut self, hash: BlockHash, val: V) {
        match self.probe(hash) {
            Probe::Found(_) => self.set(hash, val),
            Probe::Vacant(slot) => self.fill(slot, hash, val),
        }
    }

    pub fn set(&mut self, hash: BlockHash, val: V) {
        if hash.0 == 0 {
            self.zero = Some(val);
        } else {
            let i = self.find(hash.0).expect("set a key that is in the map");
            self.entries[i].val = val;
        }
    }

    /// Removes `hash`, shifting back the entries after it that probed past it (no tombstones,
    /// so probes never lengthen with churn).
    pub fn remove(&mut self, hash: BlockHash) -> Option<V> {
        if hash.0 == 0 {
            return self.zero.take();
        }
        let mut hole = self.find(hash.0)?;
        let val = self.entries[hole].val;
        let mask = self.entries.len() - 1;
        let mut j = (hole + 1) & mask;
        loop {
            let e = self.entries[j];
            if e.key() == 0 {
                break;
            }
            // `e` may fill the hole if the hole lies between its home and where it is.
            let home = self.home(e.key());
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.entries[hole] = e;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.entries[hole] = Entry::default();
        self.len -= 1;
        Some(val)
    }

    fn grow(&mut self) {
        let size = (self.entries.len() * 2).max(16);
        let old = std::mem::replace(&mut self.entries, vec![Entry::default(); size]);
        let mask = size - 1;
        for e in old.into_iter().filter(|e| e.key() != 0) {
            let mut i = self.home(e.key());
            while self.entries[i].key() != 0 {
                i = (i + 1) & mask;
            }
            self.entries[i] = e;
        }
    }

    /// Loads the entry `hash` would be probed at first, so that its cache miss overlaps with
    /// other work (a prefetch in safe code: the load's value is kept, and thrown away).
    pub fn touch(&self, hash: BlockHash) -> u64 {
        if self.entries.is_empty() {
            return 0;
        }
        self.entries[self.home(hash.0)].key()
    }

    pub fn iter(&self) -> impl Iterator<Item = (BlockHash, V)> + '_ {
        let zero = self.zero.map(|v| (BlockHash(0), v));
        self.entries.iter().filter(|e| e.key() != 0).map(|e| (BlockHash(e.key()), e.val)).chain(zero)
    }
}

impl<V> Default for BlockMap<V> {
    fn default() -> BlockMap<V> {
        BlockMap { entries: Vec::new(), len: 0, zero: None }
    }
}

/// A block's hash with a 32-bit value (a store's stamp, an index's holder-set id), in 12
/// bytes: the hash is kept as two halves, since a `u64` field would pad the pair to 16.
/// Pages of blocks are arrays of these, one allocation a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HashEntry {
    hash: [u32; 2],
    pub value: u32,
}

/// Appends `hash` with `value` to a page's `entries`; returns its position. A page fills up
/// to its size (`page_blocks`; a run is stored in order), so the first block reserves all of
/// it: one allocation, not three doublings up to it.
#[inline]
pub fn push_page_entry(entries: &mut Vec<HashEntry>, hash: BlockHash, value: u32, page_blocks: usize) -> usize {
    let i = entries.len();
    if i == entries.capacity() && i < page_blocks {
        entries.reserve_exact(page_blocks - i);
    }
    entries.push(HashEntry::new(hash, value));
    i
}

/// Makes room in a page's `entries` for `n` more: as [`push_page_entry`] does, a page's first
/// blocks reserve its size (`page_blocks`) at once.
#[inline]
pub fn reserve_page_entries(entries: &mut Vec<HashEntry>, n: usize, page_blocks: usize) {
    let len = entries.len();
    if entries.capacity() - len < n {
        match page_blocks.checked_sub(len) {
            Some(rest) => entries.reserve_exact(n.max(rest)),
            None => entries.reserve(n),
        }
    }
}

impl HashEntry {
    pub fn new(hash: BlockHash, value: u32) -> HashEntry {
        HashEntry { hash: [hash.0 as u32, (hash.0 >> 32) as u32], value }
    }

    #[inline]
    pub fn hash(&self) -> BlockHash {
        BlockHash(u64::from(self.hash[0]) | u64::from(self.hash[1]) << 32)
    }
}

/// Which hashes a small set (a page of blocks) may hold: 256 bits, one per hash's top byte.
/// A lookup of a hash not in the set usually ends here instead of scanning the set; a bit is
/// never cleared while the set lives, so removals only cost false positives, never a wrong
/// answer.
#[derive(Clone, Copy, Debug, Default)]
pub struct HashFilter([u64; 4]);

impl HashFilter {
    fn bit(hash: BlockHash) -> (usize, u64) {
        let b = (hash.0 >> 56) as usize;
        (b / 64, 1 << (b % 64))
    }

    pub fn add(&mut self, hash: BlockHash) {
        let (w, m) = HashFilter::bit(hash);
        self.0[w] |= m;
    }

    /// False: `hash` was never added.
    pub fn may_hold(&self, hash: BlockHash) -> bool {
        let (w, m) = HashFilter::bit(hash);
        self.0[w] & m != 0
    }

    /// Adds `hash`; returns [`HashFilter::may_hold`] of it before (one bit found, read and
    /// written once).
    #[inline(always)]
    pub fn insert(&mut self, hash: BlockHash) -> bool {
        let (w, m) = HashFilter::bit(hash);
        let word = self.0[w];
        self.0[w] = word | m;
        word & m != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_map_survives_removal_in_any_order() {
        let mut map = BlockMap::default();
        let keys: Vec<BlockHash> = (0..2000u64).map(|k| BlockHash(k * 7)).collect();
        for (k, &h) in keys.iter().enumerate() {
            let Probe::Vacant(slot) = map.probe(h) else { panic!("{h:?} found before insertion") };
            map.fill(slot, h, k as u32);
        }
        for (k, &h) in keys.iter().enumerate().filter(|(k, _)| k % 3 != 1) {
            assert_eq!(map.remove(h), Some(k as u32));
        }
        for (k, &h) in keys.iter().enumerate() {
            let want = (k % 3 == 1).then_some(k as u32);
            assert_eq!(map.get(h), want, "{h:?}");
        }
        assert_eq!(map.len(), keys.len().div_ceil(3));
    }
}
