//! An engine's block hashes mapped to ours through the token ids its events carry, so no
//! engine's hash function is copied: our hash of a stored block is the chain of our hash of
//! its parent and its tokens, exactly what the gateway computes from a prompt's token ids.

use super::kv_events::{EngineEvent, EngineHash};
use engine::kv::{KvEvent, KvEvents, Tier, PAGE_BLOCKS};
use engine::BlockHash;
use std::collections::HashMap;

/// The engine's hashes this instance caches, with ours and the tiers holding each block.
#[derive(Default, Debug)]
pub struct BlockMap {
    blocks: HashMap<EngineHash, Mapped>,
    /// Stored blocks whose parent was never seen (an event lost for good): left out.
    pub unmapped: u64,
}

#[derive(Clone, Copy, Debug)]
struct Mapped {
    ours: BlockHash,
    /// Our page of the block (`engine::kv::PageKey`), from its depth in the chain.
    page: BlockHash,
    depth: u32,
    /// Bit `t` set: tier `t` holds the block.
    tiers: u8,
}

fn bit(tier: Tier) -> u8 {
    1 << tier as u8
}

impl BlockMap {
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Translates one engine event into ours, appended to `out`, for an engine whose blocks
    /// are `block_size` tokens (a stored block of another size is refused: the index could
    /// not match it against prompts).
    pub fn translate(&mut self, event: &EngineEvent, block_size: u32, out: &mut KvEvents) -> Result<(), String> {
        match event {
            EngineEvent::Stored { hashes, parent, token_ids, block_size: size, tier } => {
                if *size != block_size {
                    return Err(format!("blocks of {size} tokens stored; the engine registered {block_size}"));
                }
                // Our hash, page and depth of the block before the next one.
                let mut before = match parent {
                    None => None,
                    Some(p) => match self.blocks.get(p) {
                        Some(m) => Some((m.ours, m.page, m.depth)),
                        None => {
                            self.unmapped += hashes.len() as u64;
                            return Ok(());
                        }
                    },
                };
                for (hash, tokens) in hashes.iter().zip(token_ids.chunks_exact(*size as usize)) {
                    let parent_ours = before.map(|(ours, _, _)| ours);
                    let ours = parent_ours.unwrap_or(BlockHash::ROOT).chain(BlockHash::content_of_tokens(tokens));
                    let depth = before.map_or(0, |(_, _, d)| d + 1);
                    let page = match before {
                        Some((_, page, _)) if !depth.is_multiple_of(PAGE_BLOCKS as u32) => page,
                        _ => ours,
                    };
                    let m = self.blocks.entry(hash.clone()).or_insert(Mapped { ours, page, depth, tiers: 0 });
                    (m.ours, m.page, m.depth) = (ours, page, depth);
                    m.tiers |= bit(*tier);
                    out.push(KvEvent::Stored { tier: *tier, hash: ours, page });
                    before = Some((ours, page, depth));
                }
            }
            EngineEvent::Removed { hashes, tier } => {
                for hash in hashes {
                    let Some(m) = self.blocks.get_mut(hash) else { continue };
                    if m.tiers & bit(*tier) == 0 {
                        continue;
                    }
                    out.push(KvEvent::Removed { tier: *tier, hash: m.ours, page: m.page });
                    m.tiers &= !bit(*tier);
                    if m.tiers == 0 {
                        self.blocks.remove(hash);
                    }
                }
            }
            EngineEvent::Cleared => self.clear(out),
        }
        Ok(())
    }

    /// Forgets everything (the engine restarted or cleared its cache).
    pub fn clear(&mut self, out: &mut KvEvents) {
        self.blocks.clear();
        out.push(KvEvent::Cleared);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: i128) -> EngineHash {
        EngineHash::Int(x)
    }

    #[test]
    fn our_hashes_are_the_gateways_for_the_same_tokens() {
        let tokens: Vec<u32> = (0..8).collect();
        let ours = engine::block_hashes(&tokens, 2);
        let mut map = BlockMap::default();
        let mut out = KvEvents::new();
        // Two events: the second block run continues from the first's last block.
        let first = EngineEvent::Stored {
            hashes: vec![h(100), h(101)],
            parent: None,
            token_ids: tokens[..4].to_vec(),
            block_size: 2,
            tier: Tier::L1,
        };
        let second = EngineEvent::Stored {
            hashes: vec![h(102), h(103)],
            parent: Some(h(101)),
            token_ids: tokens[4..].to_vec(),
            block_size: 2,
            tier: Tier::L1,
        };
        map.translate(&first, 2, &mut out).expect("same block size");
        map.translate(&second, 2, &mut out).expect("same block size");
        let stored: Vec<_> = out
            .iter()
            .map(|e| match e {
                KvEvent::Stored { hash, .. } => hash,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(stored, ours[..4], "each block's hash chains on its parent's");
    }

    #[test]
    fn our_pages_follow_the_depth_in_the_chain_across_events() {
        let tokens: Vec<u32> = (0..70).collect();
        let ours = engine::block_hashes(&tokens, 2);
        let mut map = BlockMap::default();
        let mut out = KvEvents::new();
        let engine_hashes: Vec<EngineHash> = (0..35).map(|k| h(1000 + k)).collect();
        for (range, parent) in [(0..20, None), (20..35, Some(h(1019)))] {
            let e = EngineEvent::Stored {
                hashes: engine_hashes[range.clone()].to_vec(),
                parent,
                token_ids: tokens[range.start * 2..range.end * 2].to_vec(),
                block_size: 2,
                tier: Tier::L1,
            };
            map.translate(&e, 2, &mut out).expect("same block size");
        }
        let pages: Vec<BlockHash> = out
            .iter()
            .map(|e| match e {
                KvEvent::Stored { page, .. } => page,
                other => panic!("{other:?}"),
            })
            .collect();
        let want: Vec<BlockHash> = (0..35).map(|k| engine::kv::PageKey::at(&ours, k).page).collect();
        assert_eq!(pages, want);
        assert_eq!(pages[32], ours[32], "the 33rd block starts a page");
    }

    #[test]
    fn a_block_leaves_the_map_when_no_tier_holds_it() {
        let mut map = BlockMap::default();
        let mut out = KvEvents::new();
        for tier in [Tier::L1, Tier::L2] {
            let e =
                EngineEvent::Stored { hashes: vec![h(1)], parent: None, token_ids: vec![7, 8], block_size: 2, tier };
            map.translate(&e, 2, &mut out).expect("ok");
        }
        let ours = engine::block_hashes(&[7, 8], 2)[0];
        out.clear();
        map.translate(&EngineEvent::Removed { hashes: vec![h(1)], tier: Tier::L1 }, 2, &mut out).expect("ok");
        assert_eq!(out, vec![KvEvent::Removed { tier: Tier::L1, hash: ours, page: ours }].into());
        assert_eq!(map.len(), 1, "L2 still holds it");
        // Removing it again from L1, or a block never seen, says nothing.
        out.clear();
        map.translate(&EngineEvent::Removed { hashes: vec![h(1), h(9)], tier: Tier::L1 }, 2, &mut out).expect("ok");
        assert!(out.is_empty());
        map.translate(&EngineEvent::Removed { hashes: vec![h(1)], tier: Tier::L2 }, 2, &mut out).expect("ok");
        assert_eq!(map.len(), 0);
    }

    #[test]
    fn orphans_and_other_block_sizes_are_left_out() {
        let mut map = BlockMap::default();
        let mut out = KvEvents::new();
        let orphan = EngineEvent::Stored {
            hashes: vec![h(5)],
            parent: Some(h(4)),
            token_ids: vec![1, 2],
            block_size: 2,
            tier: Tier::L1,
        };
        map.translate(&orphan, 2, &mut out).expect("skipped, not an error");
        assert!(out.is_empty());
        assert_eq!(map.unmapped, 1);
        let other = EngineEvent::Stored {
            hashes: vec![h(5)],
            parent: None,
            token_ids: vec![1; 4],
            block_size: 4,
            tier: Tier::L1,
        };
        assert!(map.translate(&other, 2, &mut out).is_err());
        map.translate(&EngineEvent::Cleared, 2, &mut out).expect("ok");
        assert_eq!(out, vec![KvEvent::Cleared].into());
    }
}
