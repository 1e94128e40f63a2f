//! Holder sets: who holds a block in which tier, interned and shared by every block held alike.

use super::NO_STATE;
use engine::kv::Tier;
use engine::InstanceId;
use std::sync::Arc;

/// Holder sets at least this large get a bitmap (see `State::bits`; tests use small sets).
pub(super) const BITMAP_MIN_HOLDERS: usize = if cfg!(test) { 2 } else { 64 };

/// A holder is `instance << 1 | 1 if L2`: sorted, an instance's L1 entry comes before its L2
/// one, which is how the best tier wins.
pub(super) fn holder(instance: InstanceId, tier: Tier) -> u32 {
    assert!(instance.0 < 1 << 29, "instance id {} too large for the prefix index", instance.0);
    instance.0 << 1 | u32::from(tier == Tier::L2)
}

/// Order-independent fingerprint of a holder set, kept incrementally (`+` per holder).
pub(super) fn holder_fp(h: u32) -> u64 {
    engine::ids::mix64(u64::from(h) + 1)
}
pub(super) const L3_FP: u64 = 0x6a09_e667_f3bc_c909;

/// What one or more events of one instance do to one block's holder set: per tier, store
/// or remove (at most one of them a tier, so that the order they came in does not matter:
/// the events of a demotion, "stored in L2, stored in L3, removed from L1", applied as one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Change {
    /// The instance whose L1 and L2 the change touches (0 when it touches only L3, which is
    /// everyone's: such changes share their cached transitions across instances).
    instance: u32,
    /// Bit `2 * tier` stores in the tier, bit `2 * tier + 1` removes from it.
    ops: u8,
}

impl Change {
    pub(super) fn stored(instance: InstanceId, tier: Tier) -> Change {
        Change::new(instance, tier, 0)
    }

    pub(super) fn removed(instance: InstanceId, tier: Tier) -> Change {
        Change::new(instance, tier, 1)
    }

    fn new(instance: InstanceId, tier: Tier, removed: u8) -> Change {
        let instance = if tier == Tier::L3 { 0 } else { holder(instance, tier) >> 1 };
        Change { instance, ops: 1 << (2 * tier.index() as u8 + removed) }
    }

    /// Both changes, of one instance's events on tiers neither shares with the other.
    pub(super) fn and(self, other: Change) -> Change {
        // Both bits of each tier `other` touches (a shift of its bits alone would spill a
        // removal's bit into the next tier's store bit).
        let tiers = (other.ops | other.ops >> 1) & 0b01_0101;
        debug_assert!(self.ops & (tiers | tiers << 1) == 0, "tiers touched twice");
        debug_assert!(self.instance == other.instance || self.instance == 0 || other.instance == 0);
        Change { instance: self.instance | other.instance, ops: self.ops | other.ops }
    }

    /// Whether the change stores in `tier` (`Some(true)`), removes from it (`Some(false)`),
    /// or leaves it be.
    pub(super) fn on(self, tier: Tier) -> Option<bool> {
        match self.ops >> (2 * tier.index()) & 3 {
            0 => None,
            bits => Some(bits == 1),
        }
    }

    /// The holder the change stores or removes in `tier` (L1 or L2).
    pub(super) fn holder(self, tier: Tier) -> u32 {
        self.instance << 1 | u32::from(tier == Tier::L2)
    }

    /// Names the change in the transition cache.
    pub(super) fn code(self) -> u64 {
        u64::from(self.instance) << 6 | u64::from(self.ops)
    }
}

/// A set of holders, shared by every block it describes.
#[derive(Clone, Debug, Default)]
pub(super) struct State {
    /// Sorted holders (see [`holder`]).
    pub(super) holders: Vec<u32>,
    /// Some instance is listed twice (L1 and L2), which the query must skip.
    pub(super) twice: bool,
    /// For sets of [`BITMAP_MIN_HOLDERS`] or more: two bits per instance (L1, L2), so that a
    /// query starting with this set can record it whole instead of visiting every holder.
    pub(super) bits: Option<Arc<[u64]>>,
    pub(super) in_l3: bool,
    /// [`holder_fp`] summed over `holders`, plus `L3_FP` if in L3: the intern key.
    pub(super) fp: u64,
    /// Listed in `PrefixIndex::dormant` (once at most).
    pub(super) dormant: bool,
}

impl State {
    pub(super) fn is_empty(&self) -> bool {
        self.holders.is_empty() && !self.in_l3
    }

    pub(super) fn set_holders(&mut self, holders: Vec<u32>, in_l3: bool) {
        self.twice = holders.windows(2).any(|w| w[0] >> 1 == w[1] >> 1);
        self.bits = (holders.len() >= BITMAP_MIN_HOLDERS).then(|| {
            let last = *holders.last().expect("not empty");
            let mut bits = vec![0u64; (last as usize + 1).div_ceil(64)];
            // Holder `instance << 1 | l2` is exactly its bit's index.
            for &h in &holders {
                bits[h as usize / 64] |= 1 << (h % 64);
            }
            Arc::from(bits)
        });
        self.fp = holders.iter().fold(if in_l3 { L3_FP } else { 0 }, |fp, &h| fp.wrapping_add(holder_fp(h)));
        self.holders = holders;
        self.in_l3 = in_l3;
    }
}

/// The part of a state every event touches, kept apart in a dense array so that it stays
/// in the caches.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Meta {
    /// Positions with this state (`EMPTY`, the tombstones', is not counted); at
    /// zero the state goes dormant, to be freed later (`PrefixIndex::dormant`).
    pub(super) refs: u32,
    /// Bumped when the id is freed or the set changes in place, which invalidates the
    /// cached transitions that name it.
    pub(super) gen: u32,
}

/// A cached `from` + change = `to`, valid while both states keep their generations.
#[derive(Clone, Copy, Debug)]
pub(super) struct Transition {
    pub(super) from: u32,
    pub(super) to: u32,
    pub(super) change: u64,
    pub(super) from_gen: u32,
    pub(super) to_gen: u32,
}

pub(super) const NO_TRANSITION: Transition = Transition { from: NO_STATE, to: 0, change: 0, from_gen: 0, to_gen: 0 };
