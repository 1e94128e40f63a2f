//! Identifiers and content hashes, each a newtype so they cannot be mixed up.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A request, unique within a run (simulation) or a control plane (live).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// An engine instance in the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct InstanceId(pub u32);

/// Which of the fleet's served models a request asks for and an instance serves: an index
/// the driver hands out (the simulator's one model is 0). Only an instance serving the
/// request's model may take it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ModelId(pub u32);

/// A physical KV block slot in one instance's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u32);

/// The content hash of one full KV block, chained: it covers the block's tokens and, through
/// its parent, every token before it. Equal hashes mean equal prefixes, so a block's hash alone
/// names the prefix it ends (the property vLLM's and Dynamo's KV events rely on).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BlockHash(pub u64);

impl BlockHash {
    /// The parent of the first block of every prompt.
    pub const ROOT: BlockHash = BlockHash(0x9e37_79b9_7f4a_7c15);

    /// Hash of the block whose content key is `content`, following `self`.
    ///
    /// A fixed mixer (not `std`'s `DefaultHasher`, whose algorithm may change between Rust
    /// releases) so that hashes, and with them simulation results, are stable everywhere.
    pub fn chain(self, content: u64) -> BlockHash {
        BlockHash(mix64(self.0 ^ mix64(content.wrapping_add(0x632b_e59b_d9b4_e019))))
    }

    /// Content key of a block of token ids, for the live engine.
    pub fn content_of_tokens(tokens: &[u32]) -> u64 {
        tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| mix64(h ^ u64::from(t)))
    }
}

/// The chained hashes of the full blocks of a prompt given as token ids, as a live engine's
/// [`crate::Request::block_hashes`] and the control plane's prefix index both key them: equal
/// prefixes give equal hashes on every engine. The tail shorter than a block is not hashed.
pub fn block_hashes(tokens: &[u32], block_size: u32) -> Vec<BlockHash> {
    let mut parent = BlockHash::ROOT;
    tokens
        .chunks_exact(block_size.max(1) as usize)
        .map(|block| {
            parent = parent.chain(BlockHash::content_of_tokens(block));
            parent
        })
        .collect()
}

/// SplitMix64's finaliser: a cheap, well-distributed 64-bit bijection.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A sub-seed for one component (and one index within it) of a run seeded with `seed`.
/// Every random source of a run derives from the run's one seed this way, so a run replays
/// from its seed alone.
pub fn derive_seed(seed: u64, component: &str, index: u64) -> u64 {
    let name =
        component.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    mix64(mix64(seed ^ name) ^ index)
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "inst-{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_hashes_cover_full_blocks_and_chain_on_the_prefix() {
        let a = block_hashes(&[1, 2, 3, 4, 5], 2);
        assert_eq!(a.len(), 2);
        let b = block_hashes(&[1, 2, 3, 9], 2);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert_ne!(block_hashes(&[3, 4], 2)[0], a[1], "a block's hash depends on its parent");
    }

    #[test]
    fn chained_hashes_differ_by_parent() {
        let a = BlockHash::ROOT.chain(7);
        let b = BlockHash::ROOT.chain(8).chain(7);
        assert_ne!(a, b);
        assert_eq!(a, BlockHash::ROOT.chain(7));
    }

    /// Pins the hash function: changing it changes every simulation's cache behaviour.
    #[test]
    fn block_hash_chain_is_pinned() {
        assert_eq!(BlockHash::ROOT.chain(0).0, 0xf6c7_8eb1_892a_7202);
    }
}
