//! The tiers a block can be cached in (GPU memory, host DRAM, the fleet's shared store). The
//! lower tiers' stores are `store.rs`; the events every tier publishes are `events.rs`.
//!
//! L1 is the prefix tree in GPU memory. A block evicted from L1 is demoted to L2 and written
//! through to L3 (the fleet's shared store, as in Mooncake's architecture: host memory caches
//! the store, it does not stand in front of it); L2's and L3's victims are gone. L1 and L2 of
//! one instance are exclusive (a hit in L2 moves the block up to L1). L3 is shared: loading a
//! block from it leaves it there for the other instances, so it is inclusive of what
//! instances hold.

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
