//! The tiers a block can be cached in (GPU memory, host DRAM, the fleet's shared store) and
//! the KV events every tier publishes. The lower tiers' stores are `store.rs`.
//!
//! L1 is the prefix tree in GPU memory. A block evicted from L1 is demoted to L2 and written
//! through to L3 (the fleet's shared store, as in Mooncake's architecture: host memory caches
//! the store, it does not stand in front of it); L2's and L3's victims are gone. L1 and L2 of
//! one instance are exclusive (a hit in L2 moves the block up to L1). L3 is shared: loading a
//! block from it leaves it there for the other instances, so it is inclusive of what
//! instances hold.

use crate::ids::BlockHash;
use serde::{Deserialize, Serialize};
use std::fmt;

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
