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

/// A change one event makes to one block's holder set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Change {
    Add(u32),
    Remove(u32),
    SetL3,
    ClearL3,
}

impl Change {
    pub(super) fn stored(instance: InstanceId, tier: Tier) -> Change {
        if tier == Tier::L3 {
            Change::SetL3
        } else {
            Change::Add(holder(instance, tier))
        }
    }

    pub(super) fn removed(instance: InstanceId, tier: Tier) -> Change {
        if tier == Tier::L3 {
            Change::ClearL3
        } else {
            Change::Remove(holder(instance, tier))
        }
    }

    pub(super) fn code(self) -> u32 {
        match self {
            Change::Add(h) => h << 2,
            Change::Remove(h) => h << 2 | 1,
            Change::SetL3 => 2,
            Change::ClearL3 => 3,
        }
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
    pub(super) change: u32,
    pub(super) to: u32,
    pub(super) from_gen: u32,
    pub(super) to_gen: u32,
}

pub(super) const NO_TRANSITION: Transition = Transition { from: NO_STATE, change: 0, to: 0, from_gen: 0, to_gen: 0 };
