//! Queries: the longest cached prefix of a request on every instance.

use super::chunks::ChunkWalk;
use super::holders::State;
use super::{PrefixIndex, TierMatch, EMPTY};
use engine::BlockHash;
use engine::InstanceId;
use std::sync::Arc;

impl PrefixIndex {
    /// The longest cached prefix of `hashes` (a chain from the root) on every instance, by
    /// tier, into `out`.
    pub fn match_prefix(&self, hashes: &[BlockHash], out: &mut PrefixMatches) {
        let chunked = self.chunk_blocks > 1;
        out.start(self.instances, if chunked { self.chunk_blocks } else { 0 });
        self.walk_pages(hashes, out);
        if chunked {
            self.walk_chunks(hashes, out);
        }
    }

    /// The walk of the prompt's pages, which finds every prefix without chunks, and the L1
    /// prefixes with them (the pages then hold L1 only).
    #[inline(always)]
    fn walk_pages(&self, hashes: &[BlockHash], out: &mut PrefixMatches) {
        let n = hashes.len();
        let page_blocks = self.page_blocks as usize;
        self.load_pages(hashes);
        // The run being followed (state, start, length): runs of one state that continue
        // across a page boundary are visited once.
        let mut run: Option<(u32, usize, usize)> = None;
        let mut j = 0;
        'walk: while j < n {
            let first = j / page_blocks * page_blocks;
            let Some(slot) = self.slots.get(hashes[first]) else { break };
            let page = &self.pages[slot as usize];
            let end = (first + page_blocks).min(n);
            let mut near = j - first;
            while j < end {
                let Some(i) = page.find(hashes[j], near) else { break 'walk };
                // The run: positions after `i` with the same state and the prompt's hashes.
                let state = page.state(i);
                if state == EMPTY {
                    break 'walk; // a tombstone: nobody holds the block
                }
                let max = (page.len() - i).min(end - j);
                let (entries, want) = (&page.entries[i..i + max], &hashes[j..j + max]);
                let mut len = 1;
                while len < max && entries[len].value == state && entries[len].hash() == want[len] {
                    len += 1;
                }
                match run {
                    Some((s, at, l)) if s == state && at + l == j => run = Some((s, at, l + len)),
                    _ => {
                        if let Some((s, at, l)) = run {
                            if !out.visit(&self.states[s as usize], at as u32, l as u32) {
                                out.end = at as u32;
                                return;
                            }
                        }
                        run = Some((state, j, len));
                    }
                }
                j += len;
                near = i + len;
            }
        }
        out.end = j as u32;
        if let Some((s, at, l)) = run {
            if !out.visit(&self.states[s as usize], at as u32, l as u32) {
                out.end = at as u32;
            }
        }
    }
}

impl PrefixIndex {
    /// Loads the map entries and the first blocks of the prompt's first pages before the walk
    /// reads them, so that their cache misses overlap instead of queueing one page at a time
    /// (the prompt names its pages up front).
    fn load_pages(&self, hashes: &[BlockHash]) {
        let firsts = || hashes.iter().step_by(self.page_blocks as usize).take(LOAD_PAGES);
        let mut sink = 0u64;
        for &h in firsts() {
            sink ^= self.slots.touch(h);
        }
        for &h in firsts() {
            if let Some(slot) = self.slots.get(h) {
                let page = &self.pages[slot as usize];
                sink ^= page.entries.first().map_or(0, |e| e.hash().0 ^ u64::from(e.value));
            }
        }
        std::hint::black_box(sink);
    }
}

/// Pages of a prompt [`PrefixIndex::load_pages`] loads ahead.
const LOAD_PAGES: usize = 64;

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    epoch: u32,
    /// Non-L3 runs this instance held (it is alive while this equals the number of non-L3
    /// runs so far).
    confirmed: u32,
    /// Blocks from L1 and from L2.
    blocks: [u32; 2],
}

/// The first run of a query, kept whole when its holder set is large (a prompt shared by
/// the fleet): its holders' slots are derived from the bitmap when needed.
#[derive(Clone, Debug)]
struct Base {
    bits: Arc<[u64]>,
    len: u32,
    in_l3: bool,
}

impl Base {
    /// The slot the first run gives `instance`: holders are alive after it, with its blocks
    /// in their best tier; others are alive only if it is in L3.
    fn slot(&self, instance: u32) -> Slot {
        let h = 2 * instance as usize;
        let pair = self.bits.get(h / 64).map_or(0, |w| (w >> (h % 64)) & 3);
        let confirmed = u32::from(!self.in_l3);
        match pair {
            0 => Slot::default(),
            1 | 3 => Slot { epoch: 0, confirmed, blocks: [self.len, 0] },
            _ => Slot { epoch: 0, confirmed, blocks: [0, self.len] },
        }
    }

    fn holds(&self, instance: u32) -> bool {
        let h = 2 * instance as usize;
        self.bits.get(h / 64).is_some_and(|w| (w >> (h % 64)) & 3 != 0)
    }

    /// Holders, in instance order.
    fn holders(&self) -> impl Iterator<Item = u32> + '_ {
        self.bits.iter().enumerate().flat_map(|(k, &w)| {
            // One bit per instance (L1 or L2), at the even positions.
            let mut any = (w | w >> 1) & 0x5555_5555_5555_5555;
            std::iter::from_fn(move || {
                (any != 0).then(|| {
                    let b = any.trailing_zeros();
                    any &= any - 1;
                    (k as u32 * 64 + b) / 2
                })
            })
        })
    }
}

/// The result of [`PrefixIndex::match_prefix`], reused across queries so that matching does
/// not allocate.
///
/// The walk visits runs of blocks with one holder set. A run in L3 keeps every live instance
/// alive; a run not in L3 keeps only its holders. Instead of touching every instance at every
/// run, each instance carries the number of non-L3 runs it survived, stamped with the query's
/// epoch; an instance never touched survived none, and its prefix is the L3-only one. A large
/// first run is not visited holder by holder at all (see [`Base`]). In chunk mode, the
/// chunk walk (`ChunkWalk`) does likewise over the prompt's chunks.
#[derive(Clone, Debug, Default)]
pub struct PrefixMatches {
    epoch: u32,
    slots: Vec<Slot>,
    /// Instances whose slot this query wrote, in the order the walk met them.
    touched: Vec<u32>,
    base: Option<Base>,
    /// Runs visited.
    runs: u32,
    /// Start of each non-L3 run, in order.
    misses: Vec<u32>,
    /// Where the walk stopped.
    end: u32,
    /// The walk of the lower tiers' chunks, in chunk mode.
    pub(super) chunks: ChunkWalk,
}

impl PrefixMatches {
    /// Starts a query of an index of `instances`, with chunks of `chunk_blocks` (0 outside
    /// chunk mode).
    fn start(&mut self, instances: u32, chunk_blocks: u32) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.slots.iter_mut().for_each(|s| s.epoch = 0);
            self.chunks.reset_epochs();
            self.epoch = 1;
        }
        self.chunks.start(chunk_blocks, instances);
        if self.slots.len() < instances as usize {
            self.slots.resize(instances as usize, Slot::default());
        }
        self.touched.clear();
        self.base = None;
        self.runs = 0;
        self.misses.clear();
        self.end = 0;
    }

    /// Walks a run of `len` blocks from position `at`, held as `state` says. Returns false
    /// when no instance's prefix goes past its start.
    fn visit(&mut self, state: &State, at: u32, len: u32) -> bool {
        let c = self.misses.len() as u32;
        let confirmed = if state.in_l3 { c } else { c + 1 };
        let epoch = self.epoch;
        let first = self.runs == 0;
        self.runs += 1;
        let mut survived = false;
        if let (true, Some(bits)) = (first, &state.bits) {
            self.base = Some(Base { bits: bits.clone(), len, in_l3: state.in_l3 });
            survived = true;
        } else if first && !state.twice {
            // Every slot is stale and every holder alive: two plain loops over local slices
            // (no reloads of `self` in between).
            self.touched.extend(state.holders.iter().map(|&h| h >> 1));
            let slots = self.slots.as_mut_slice();
            for &h in &state.holders {
                // Arithmetic rather than an indexed store, which the slot's write would have
                // to wait for (a store-forwarding stall per holder).
                let l2 = h & 1;
                let blocks = [len * (1 - l2), len * l2];
                slots[(h >> 1) as usize] = Slot { epoch, confirmed, blocks };
            }
            survived = !state.holders.is_empty();
        } else {
            let mut prev = u32::MAX;
            for &h in &state.holders {
                let instance = h >> 1;
                if state.twice && instance == prev {
                    // Its L2 copy, after its L1 one: the block counts in L1.
                    continue;
                }
                prev = instance;
                let slot = &mut self.slots[instance as usize];
                if slot.epoch != epoch {
                    let from = self.base.as_ref().map_or(Slot::default(), |b| b.slot(instance));
                    if from.confirmed != c {
                        continue;
                    }
                    *slot = Slot { epoch, ..from };
                    self.touched.push(instance);
                } else if slot.confirmed != c {
                    continue;
                }
                slot.blocks[(h & 1) as usize] += len;
                slot.confirmed = confirmed;
                survived = true;
            }
        }
        if state.in_l3 {
            return true;
        }
        self.misses.push(at);
        survived
    }

    fn slot(&self, instance: u32) -> Slot {
        slot(&self.slots, self.base.as_ref(), self.epoch, instance)
    }

    /// Where the page walk stopped: no instance's L1 prefix goes past it.
    pub(super) fn l1_end(&self) -> u32 {
        self.end
    }

    /// Walks chunk `k` of the prompt, held as `state` says (see [`ChunkWalk::visit`]).
    pub(super) fn visit_chunk(&mut self, k: u32, state: &State) -> bool {
        let (slots, base, epoch) = (&self.slots, self.base.as_ref(), self.epoch);
        self.chunks.visit(k, state, epoch, |i| slot(slots, base, epoch, i).blocks[0])
    }

    /// Blocks of the prefix `instance` would find cached, by tier. O(1); in chunk mode,
    /// O(log chunks) for an instance that took no chunk from L2.
    pub fn get(&self, instance: InstanceId) -> TierMatch {
        let s = self.slot(instance.0);
        if self.chunks.blocks > 0 {
            // The pages hold L1 only: the page walk's prefix is the L1 one.
            let l1 = s.blocks[0];
            let (l2, total) = self.chunks.prefix(instance.0, l1, self.epoch);
            return TierMatch { l1, l2, l3: total - l1 - l2 };
        }
        let depth = self.misses.get(s.confirmed as usize).copied().unwrap_or(self.end);
        let [l1, l2] = s.blocks;
        TierMatch { l1, l2, l3: depth - l1 - l2 }
    }

    /// The instances with at least one block of their prefix in L1 or L2, and their matches,
    /// in a deterministic order (the holders of a large first run by id, then the others in
    /// the order the walk met them). Every other instance has [`PrefixMatches::shared`].
    pub fn iter(&self) -> impl Iterator<Item = (InstanceId, TierMatch)> + '_ {
        let base = self.base.iter().flat_map(Base::holders);
        let rest = self.touched.iter().copied().filter(|&i| !self.base.as_ref().is_some_and(|b| b.holds(i)));
        // In chunk mode, then those with no L1 block and some in L2 (the others are listed).
        let l2_only = self.chunks.touched.iter().copied().filter(|&i| self.slot(i).blocks[0] == 0);
        base.chain(rest).chain(l2_only).map(|i| (InstanceId(i), self.get(InstanceId(i))))
    }

    /// The instance with the longest prefix (more blocks in L1, then in L2, then the lower id
    /// breaking ties), or `None` when no instance has a block of it in L1 or L2 (every
    /// instance then has [`PrefixMatches::shared`]). O(instances the walk touched one by one).
    pub fn longest(&self) -> Option<(InstanceId, TierMatch)> {
        let rank = |i: u32, m: TierMatch| (m.total(), m.l1, m.l2, std::cmp::Reverse(i));
        let mut best: Option<(u32, TierMatch)> = None;
        let mut consider = |i: u32| {
            let m = self.get(InstanceId(i));
            if best.is_none_or(|(b, bm)| rank(i, m) > rank(b, bm)) {
                best = Some((i, m));
            }
        };
        self.touched.iter().for_each(|&i| consider(i));
        self.chunks.touched.iter().for_each(|&i| consider(i));
        if let Some(base) = &self.base {
            // The holders of the first run that no later run (nor chunk) touched all match
            // alike, by tier; an L1 one beats every L2 one, and the first of them beats the
            // others.
            let untouched = |&i: &u32| {
                self.slots.get(i as usize).is_none_or(|s| s.epoch != self.epoch) && !self.chunks.met(i, self.epoch)
            };
            let mut l2 = None;
            for i in base.holders().filter(untouched) {
                if base.slot(i).blocks[0] > 0 {
                    l2 = None;
                    consider(i);
                    break;
                }
                l2 = l2.or(Some(i));
            }
            if let Some(i) = l2 {
                consider(i);
            }
        }
        best.map(|(i, m)| (InstanceId(i), m))
    }

    /// The prefix every instance finds in the shared L3 store alone.
    pub fn shared(&self) -> TierMatch {
        if self.chunks.blocks > 0 {
            return TierMatch { l3: self.chunks.shared(), ..TierMatch::default() };
        }
        TierMatch { l3: self.misses.first().copied().unwrap_or(self.end), ..TierMatch::default() }
    }
}

/// The slot of `instance` in query `epoch`: its own when the walk wrote it, else the one the
/// first run gives it.
fn slot(slots: &[Slot], base: Option<&Base>, epoch: u32, instance: u32) -> Slot {
    match slots.get(instance as usize) {
        Some(s) if s.epoch == epoch => *s,
        _ => base.map_or(Slot::default(), |b| b.slot(instance)),
    }
}
