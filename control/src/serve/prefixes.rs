//! The prompt prefixes that recent requests share: the console's "top shared prefixes".
//!
//! Block hashes are chained, so the hash of a prompt's `d`-th block names its whole first `d`
//! blocks. Each request counts once at depths 1, 2, 4, … blocks of its prompt (a power-of-two
//! ladder keeps it to ~log₂ keys a request); a prefix is shared when several requests of the
//! window counted it. Listed: the prefixes that most tokens would be saved on by a cache
//! (tokens × (requests − 1)), leaving out one that a longer prefix shares with exactly as many
//! requests (the longer one says it all). The window is the last [`WINDOW`] requests, so the
//! memory is bounded whatever the traffic.

use engine::BlockHash;
use std::collections::{HashMap, VecDeque};

/// Requests the counts cover.
pub const WINDOW: usize = 5_000;
/// Deepest prefix counted, in blocks (64K tokens at 16-token blocks).
const MAX_BLOCKS: usize = 4_096;

/// One shared prefix.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SharedPrefix {
    /// The hash of its last block, which names it (hex).
    pub id: String,
    pub tokens: u64,
    /// Requests of the window whose prompt starts with it.
    pub requests: u32,
}

struct Entry {
    count: u32,
    tokens: u64,
    /// The next shorter prefix on the ladder (none at depth 1).
    parent: Option<u64>,
}

#[derive(Default)]
pub struct SharedPrefixes {
    /// The keys each request of the window counted, oldest first.
    window: VecDeque<Vec<u64>>,
    counts: HashMap<u64, Entry>,
}

impl SharedPrefixes {
    /// Counts a routed request's prompt (its block hashes at `block_size` tokens a block).
    pub fn record(&mut self, hashes: &[BlockHash], block_size: u32) {
        if self.window.len() == WINDOW {
            if let Some(old) = self.window.pop_front() {
                for key in old {
                    if let Some(e) = self.counts.get_mut(&key) {
                        e.count -= 1;
                        if e.count == 0 {
                            self.counts.remove(&key);
                        }
                    }
                }
            }
        }
        let mut keys = Vec::new();
        let mut depth = 1;
        while depth <= hashes.len().min(MAX_BLOCKS) {
            let key = hashes[depth - 1].0;
            let parent = keys.last().copied();
            let tokens = depth as u64 * u64::from(block_size);
            self.counts.entry(key).or_insert(Entry { count: 0, tokens, parent }).count += 1;
            keys.push(key);
            depth *= 2;
        }
        self.window.push_back(keys);
    }

    /// Requests the counts cover now.
    pub fn requests(&self) -> usize {
        self.window.len()
    }

    /// The `n` shared prefixes a cache saves most tokens on, most first.
    pub fn top(&self, n: usize) -> Vec<SharedPrefix> {
        // A prefix with a longer one shared as widely is implied by it.
        let mut implied = std::collections::HashSet::new();
        for e in self.counts.values() {
            if let Some(p) = e.parent {
                if self.counts.get(&p).is_some_and(|pe| pe.count == e.count) {
                    implied.insert(p);
                }
            }
        }
        let mut shared: Vec<(u64, &Entry)> =
            self.counts.iter().filter(|(k, e)| e.count >= 2 && !implied.contains(*k)).map(|(k, e)| (*k, e)).collect();
        // Most tokens saved first; ties by length, then by id, so the order is stable.
        shared.sort_by_key(|(k, e)| {
            (std::cmp::Reverse(e.tokens * u64::from(e.count - 1)), std::cmp::Reverse(e.tokens), *k)
        });
        shared
            .into_iter()
            .take(n)
            .map(|(k, e)| SharedPrefix { id: format!("{k:016x}"), tokens: e.tokens, requests: e.count })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(shared: &[u32], own: &[u32]) -> Vec<BlockHash> {
        let tokens: Vec<u32> = shared.iter().chain(own).copied().collect();
        engine::block_hashes(&tokens, 4)
    }

    #[test]
    fn a_system_prompt_shared_by_requests_is_listed_once_at_its_longest() {
        let system: Vec<u32> = (0..32).collect(); // 8 blocks of 4 tokens
        let mut p = SharedPrefixes::default();
        for k in 0..3u32 {
            p.record(&prompt(&system, &[1000 + k; 8]), 4);
        }
        p.record(&prompt(&[7; 16], &[]), 4); // shares nothing
        let top = p.top(10);
        // Depths 1, 2, 4 and 8 blocks are all shared by the three: only the 8-block one (32
        // tokens) is listed; the 16-block prefixes are each their own.
        assert_eq!(top.len(), 1, "{top:?}");
        assert_eq!((top[0].tokens, top[0].requests), (32, 3));
        assert_eq!(p.requests(), 4);
    }

    #[test]
    fn the_window_forgets_the_oldest_requests() {
        let mut p = SharedPrefixes::default();
        let shared = prompt(&[1; 8], &[]);
        p.record(&shared, 4);
        p.record(&shared, 4);
        assert_eq!(p.top(5).len(), 1);
        for k in 0..WINDOW as u32 {
            p.record(&prompt(&[k + 10; 4], &[]), 4);
        }
        assert!(p.top(5).is_empty(), "the two shared ones left the window");
        assert_eq!(p.requests(), WINDOW);
        assert!(p.counts.len() <= WINDOW, "counts shrink with the window");
    }

    #[test]
    fn prefixes_are_ranked_by_the_tokens_a_cache_saves() {
        let mut p = SharedPrefixes::default();
        let long: Vec<u32> = (100..164).collect(); // 16 blocks, shared by 2
        let short: Vec<u32> = (500..508).collect(); // 2 blocks, shared by 5
        for _ in 0..2 {
            p.record(&prompt(&long, &[]), 4);
        }
        for _ in 0..5 {
            p.record(&prompt(&short, &[]), 4);
        }
        let top = p.top(10);
        assert_eq!(top.iter().map(|t| (t.tokens, t.requests)).collect::<Vec<_>>(), [(64, 2), (8, 5)]);
    }
}
