//! The hit rate of an infinite cache shared by every instance: each prompt's longest prefix
//! already seen in any earlier prompt (at most all blocks but the one holding the last token,
//! which is always computed), over all prompt tokens. The bound every router's hit rate is
//! measured against (`max_hit_rate`).
//!
//! The prompts seen are kept as a trie of runs of chained hashes (a prompt's blocks past the
//! point where it leaves every earlier prompt are one run): matching a prompt compares its
//! hashes with a run's side by side in memory and probes a map once per branch it takes, and
//! adding it appends its new blocks to one run. A set of every block hash, which this
//! replaces, cost a random memory access per block (a fifth of a tiered simulation).
//! Chained hashes make the two the same: a block's hash names its whole prefix.

use engine::BlockHash;
use rustc_hash::FxHashMap;

/// "No child"; node 0 is the root, nobody's child.
const NIL: u32 = 0;

#[derive(Clone, Debug, Default)]
struct Run {
    hashes: Vec<BlockHash>,
    /// The one child, while the run has at most one (else its children are in the map).
    only_child: u32,
    branching: bool,
}

/// Every prompt seen so far, as a trie of runs.
#[derive(Clone, Debug)]
struct Trie {
    runs: Vec<Run>,
    /// Children of branching runs, by (run, first hash of the child).
    children: FxHashMap<(u32, BlockHash), u32>,
}

impl Default for Trie {
    fn default() -> Trie {
        Trie { runs: vec![Run { branching: true, ..Run::default() }], children: FxHashMap::default() }
    }
}

impl Trie {
    fn child(&self, run: u32, hash: BlockHash) -> Option<u32> {
        let r = &self.runs[run as usize];
        if r.branching {
            self.children.get(&(run, hash)).copied()
        } else {
            (r.only_child != NIL && self.runs[r.only_child as usize].hashes[0] == hash).then_some(r.only_child)
        }
    }

    /// Adds `child` under `run`.
    fn adopt(&mut self, run: u32, child: u32) {
        let first = self.runs[child as usize].hashes[0];
        let r = &mut self.runs[run as usize];
        if r.branching {
            self.children.insert((run, first), child);
        } else if r.only_child == NIL {
            r.only_child = child;
        } else {
            let other = std::mem::replace(&mut r.only_child, NIL);
            r.branching = true;
            let other_first = self.runs[other as usize].hashes[0];
            self.children.insert((run, other_first), other);
            self.children.insert((run, first), child);
        }
    }

    /// Blocks of `hashes` seen before (its longest prefix in the trie), then adds the rest.
    fn match_and_add(&mut self, hashes: &[BlockHash]) -> usize {
        let (mut at, mut i) = (0u32, 0usize);
        // Where the match stopped inside a run: (the run's parent, the run, blocks in common).
        let mut inside = None;
        while i < hashes.len() {
            let Some(c) = self.child(at, hashes[i]) else { break };
            let run = &self.runs[c as usize].hashes;
            let k = run.iter().zip(&hashes[i..]).take_while(|(a, b)| a == b).count();
            i += k;
            if k < run.len() {
                inside = Some((at, c, k));
                break;
            }
            at = c;
        }
        if i == hashes.len() {
            return i;
        }
        if let Some((parent, c, k)) = inside {
            at = self.split(parent, c, k);
        }
        let r = &mut self.runs[at as usize];
        if at != NIL && r.only_child == NIL && !r.branching {
            r.hashes.extend_from_slice(&hashes[i..]); // a leaf grows in place
        } else {
            self.runs.push(Run { hashes: hashes[i..].to_vec(), ..Run::default() });
            let new = self.runs.len() as u32 - 1;
            self.adopt(at, new);
        }
        i
    }

    /// Cuts run `c` (a child of `parent`) after its first `k` blocks; returns the new run of
    /// those `k`, which takes `c`'s place and has `c` as its only child.
    fn split(&mut self, parent: u32, c: u32, k: usize) -> u32 {
        let rest = self.runs[c as usize].hashes.split_off(k);
        let head = std::mem::replace(&mut self.runs[c as usize].hashes, rest);
        let first = head[0];
        self.runs.push(Run { hashes: head, only_child: c, branching: false });
        let new = self.runs.len() as u32 - 1;
        let p = &mut self.runs[parent as usize];
        if p.branching {
            self.children.insert((parent, first), new);
        } else {
            p.only_child = new;
        }
        new
    }
}

/// See the module doc.
#[derive(Clone, Debug, Default)]
pub struct InfiniteCacheBound {
    seen: Trie,
    cached_tokens: u64,
    prompt_tokens: u64,
}

impl InfiniteCacheBound {
    pub fn observe(&mut self, r: &engine::Request, block_size: u32) {
        let usable = ((r.prompt_tokens.saturating_sub(1)) / block_size) as usize;
        let hit = self.seen.match_and_add(&r.block_hashes).min(usable);
        self.cached_tokens += hit as u64 * u64::from(block_size);
        self.prompt_tokens += u64::from(r.prompt_tokens);
    }

    pub fn hit_rate(&self) -> f64 {
        crate::metrics::ratio(self.cached_tokens as f64, self.prompt_tokens as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn chain(keys: &[u64]) -> Vec<BlockHash> {
        let mut h = BlockHash::ROOT;
        keys.iter()
            .map(|&k| {
                h = h.chain(k);
                h
            })
            .collect()
    }

    proptest! {
        /// The trie answers as a set of every hash seen: a prompt's seen prefix is the run of
        /// its first hashes in the set (prompts drawn from a few keys, so that they share
        /// prefixes and diverge anywhere, also inside runs and at their ends).
        #[test]
        fn the_trie_matches_as_a_set_of_every_hash_seen(
            prompts in proptest::collection::vec(proptest::collection::vec(0u64..3, 0..12), 1..60),
        ) {
            let (mut trie, mut set) = (Trie::default(), HashSet::new());
            for keys in prompts {
                let hashes = chain(&keys);
                let want = hashes.iter().take_while(|h| set.contains(*h)).count();
                prop_assert_eq!(trie.match_and_add(&hashes), want);
                set.extend(hashes.iter().copied());
                prop_assert_eq!(trie.match_and_add(&hashes), hashes.len(), "a prompt seen is matched whole");
            }
        }
    }
}
