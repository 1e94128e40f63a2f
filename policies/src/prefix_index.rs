//! The global prefix index: which instance holds which block in which tier, built only from
//! the instances' KV events, and the longest cached prefix of a request on every instance.
//!
//! Block hashes are chained (a block's hash names its whole prefix), so the index is a map
//! from hash to holders; no tree is needed to answer "is this prefix cached there". A prefix
//! on instance `i` runs as long as each next block is held by `i` (in L1 or L2) or by the
//! shared L3 store.
//!
//! # Matching
//!
//! [`PrefixIndex::match_prefix`] walks the request's hashes once. Positions that L3 holds
//! keep every live instance alive; at a position L3 misses, only the instances holding the
//! block survive. Instead of touching every instance at every position, each instance carries
//! the number of L3 misses it has survived, stamped with the query's epoch; an instance never
//! touched survived none. The walk stops at the first L3 miss no live instance holds. Cost:
//! O(walked positions + holders listed at them), independent of the fleet size.

use engine::kv::{KvEvent, Tier};
use engine::{BlockHash, InstanceId};
use rustc_hash::FxHashMap;

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

/// Holders of one block: `instance << 2 | tier` for L1 and L2, and whether L3 has it.
#[derive(Clone, Debug, Default)]
struct Holders {
    held: Vec<u32>,
    in_l3: bool,
}

fn holder(instance: InstanceId, tier: Tier) -> u32 {
    instance.0 << 2 | tier.index() as u32
}

#[derive(Clone, Debug, Default)]
pub struct PrefixIndex {
    blocks: FxHashMap<BlockHash, Holders>,
}

impl PrefixIndex {
    pub fn new() -> PrefixIndex {
        PrefixIndex::default()
    }

    /// Distinct blocks indexed (in any tier).
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Applies one event published by `instance`. L3 events describe the shared store,
    /// whichever instance published them.
    pub fn apply(&mut self, instance: InstanceId, event: &KvEvent) {
        match *event {
            KvEvent::Stored { tier: Tier::L3, hash, .. } => self.blocks.entry(hash).or_default().in_l3 = true,
            KvEvent::Stored { tier, hash, .. } => {
                let h = holder(instance, tier);
                let e = self.blocks.entry(hash).or_default();
                if !e.held.contains(&h) {
                    e.held.push(h);
                }
            }
            KvEvent::Removed { tier: Tier::L3, hash } => {
                if let Some(e) = self.blocks.get_mut(&hash) {
                    e.in_l3 = false;
                    if e.held.is_empty() {
                        self.blocks.remove(&hash);
                    }
                }
            }
            KvEvent::Removed { tier, hash } => {
                let h = holder(instance, tier);
                if let Some(e) = self.blocks.get_mut(&hash) {
                    e.held.retain(|&x| x != h);
                    if e.held.is_empty() && !e.in_l3 {
                        self.blocks.remove(&hash);
                    }
                }
            }
            KvEvent::Cleared => self.remove_instance(instance),
        }
    }

    /// Forgets everything `instance` held in its own tiers (it went down or was cleared).
    /// Scans the whole index: rare, and cheaper than keeping a per-instance list on every event.
    pub fn remove_instance(&mut self, instance: InstanceId) {
        self.blocks.retain(|_, e| {
            e.held.retain(|&x| x >> 2 != instance.0);
            !e.held.is_empty() || e.in_l3
        });
    }

    /// The longest cached prefix of `hashes` on every instance, by tier, into `out`.
    pub fn match_prefix(&self, hashes: &[BlockHash], out: &mut PrefixMatches) {
        out.start();
        let mut end = hashes.len() as u32;
        for (j, h) in hashes.iter().enumerate() {
            let e = self.blocks.get(h);
            let in_l3 = e.is_some_and(|e| e.in_l3);
            let c = out.misses.len() as u32;
            let mut survived = false;
            for &x in e.map(|e| e.held.as_slice()).unwrap_or(&[]) {
                let slot = out.slot(x >> 2);
                if slot.confirmed != c {
                    continue;
                }
                if x & 3 == Tier::L1.index() as u32 {
                    slot.m.l1 += 1;
                } else {
                    slot.m.l2 += 1;
                }
                if !in_l3 {
                    slot.confirmed = c + 1;
                    survived = true;
                }
            }
            if !in_l3 {
                out.misses.push(j as u32);
                if !survived {
                    end = j as u32;
                    break;
                }
            }
        }
        out.end = end;
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    epoch: u32,
    /// L3 misses this instance held the block at (it is alive while this equals the number
    /// of misses so far).
    confirmed: u32,
    m: TierMatch,
}

/// The result of [`PrefixIndex::match_prefix`], reused across queries so that matching does
/// not allocate.
#[derive(Clone, Debug, Default)]
pub struct PrefixMatches {
    epoch: u32,
    slots: Vec<Slot>,
    /// Positions the L3 store missed, in order.
    misses: Vec<u32>,
    /// Where the walk stopped.
    end: u32,
}

impl PrefixMatches {
    fn start(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.slots.iter_mut().for_each(|s| s.epoch = 0);
            self.epoch = 1;
        }
        self.misses.clear();
        self.end = 0;
    }

    fn slot(&mut self, instance: u32) -> &mut Slot {
        let i = instance as usize;
        if self.slots.len() <= i {
            self.slots.resize(i + 1, Slot::default());
        }
        let s = &mut self.slots[i];
        if s.epoch != self.epoch {
            *s = Slot { epoch: self.epoch, ..Slot::default() };
        }
        s
    }

    /// Blocks of the prefix `instance` would find cached, by tier.
    pub fn get(&self, instance: InstanceId) -> TierMatch {
        let s = self.slots.get(instance.0 as usize).filter(|s| s.epoch == self.epoch).copied().unwrap_or_default();
        let depth = self.misses.get(s.confirmed as usize).copied().unwrap_or(self.end);
        TierMatch { l3: depth - s.m.l1 - s.m.l2, ..s.m }
    }
}
