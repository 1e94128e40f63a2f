//! The global prefix index: which instance holds which block in which tier, built only from
//! the instances' KV events, and the longest cached prefix of a request on every instance.
//!
//! A prefix on instance `i` runs as long as each next block is held by `i` (in L1 or L2) or
//! by the shared L3 store; each of its blocks counts in the best tier `i` has it in
//! (L1 > L2 > L3).
//!
//! # Structure
//!
//! ```text
//!  map:       BlockHash ─▶ (segment, position)         every indexed block, exactly once
//!  segments:  s0  hashes [a  b  c  d  e  f ]            blocks laid out in chain order,
//!                 states [7  7  7  9  9  0 ]            as their Stored events came
//!             s1  hashes [x  y  ✝  z]                   ✝: dead position, out of the map
//!  states:    7 = {inst-3 L1, inst-8 L1, inst-8 L2}     interned holder sets (+ "in L3"),
//!             9 = {inst-3 L1} + L3,   0 = {}            bitmaps for large ones
//! ```
//!
//! Chained hashes make a prompt a path, and engines publish the blocks of a path as `Stored`
//! runs in chain order, so a block stored right after its parent is appended after it in
//! the parent's segment. A query probes the map once per segment it enters and then compares
//! its hashes with the segment's in order: a 700-block prompt costs a handful of random
//! memory accesses instead of 700 (a hash-map probe per block, which on a 10M-block index is
//! a cache miss each, would cost ~100 µs). Each block carries the id of its holder set,
//! interned, so that a run of blocks held alike is visited once per holder, not once per
//! block and holder.
//!
//! | identifier | why |
//! | --- | --- |
//! | `BlockMap` | events name blocks by hash; 16-byte entries probed linearly cost one cache miss a probe |
//! | `Segment` | 12 bytes a block (hash, state id), read in order by queries, appended to by chain-order stores |
//! | `State` | one holder set per run of equally held blocks; `Meta` keeps the fields each event touches dense |
//! | `transitions` | events doing the same thing (instance 3 stores in L1) to blocks in the same state cost one cache probe each |
//! | `pending` | the engine demotes a block as "removed here, stored there": the block keeps its place meanwhile |
//! | `Base` | a query's first run, when held by many (a fleet-wide system prompt), is recorded whole, not per holder |
//!
//! # Cost
//!
//! | operation | cost |
//! | --- | --- |
//! | `apply` (Stored, Removed) | one map probe and one segment access (cache misses at scale); O(holders) only when a new holder set is formed |
//! | `apply_batch` | the same, with the misses of 32 events in flight at once |
//! | `match_prefix` | one map probe per segment entered, 12 sequential bytes per block, O(holders) per run after the first |
//! | `PrefixMatches::get` | O(1) |
//! | `remove_instance`, `Cleared` | O(states × holders), plus one pass over the segments if blocks lost their last holder |
//! | memory | the map: 16 bytes an entry at 40-81% load (20-40 bytes a block); segments: 12 bytes a block plus growth slack |
//!
//! Measured by `fleetplane-bench index` (docs/BENCHMARKS.md).
//!
//! # Exactness
//!
//! Nothing here trusts the chain: adjacency in a segment is only a guess at where the next
//! block of a prompt is, checked by comparing hashes, and a live block is at exactly one
//! position (the map's). A wrong or missing `parent` only costs speed (a new segment), and a
//! prompt starting mid-chain, or one that is not a chain at all, is matched exactly. Nor is
//! any tier assumed prefix-closed: holes anywhere are matched exactly. Interning is only an
//! optimisation too: two ids with equal sets split a run in two, with the same result.

use engine::block_map::{BlockMap, Probe};
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

/// The state id of a block nobody holds (only the pending block has it).
const EMPTY: u32 = 0;
/// The state of a position whose block left the index (it is no longer in the map).
const DEAD: u32 = u32::MAX;
/// Slots of the direct-mapped transition cache.
const TRANSITION_BITS: u32 = 12;
/// Compacting a segment rewrites its live blocks' map entries, so it waits until at least
/// this many, and half of the segment, are dead (tests compact early, to exercise it).
const COMPACT_MIN_DEAD: u32 = if cfg!(test) { 2 } else { 16 };
/// Events [`PrefixIndex::apply_batch`] loads ahead at once.
const PREFETCH_EVENTS: usize = 32;

mod holders;
mod matches;
mod segment;
#[cfg(test)]
mod tests;

use holders::{holder, holder_fp, Change, Meta, State, Transition, L3_FP, NO_TRANSITION};
pub use matches::PrefixMatches;
use segment::{Loc, Segment};

/// Which instance holds which block in which tier, from KV events (see the module
/// documentation for the structure and its costs).
#[derive(Clone, Debug)]
pub struct PrefixIndex {
    map: BlockMap<Loc>,
    segments: Vec<Segment>,
    free_segments: Vec<u32>,
    /// Holder sets by id; `states[EMPTY]` is the empty set and is never freed.
    states: Vec<State>,
    /// Reference counts and generations of `states`, by the same id.
    meta: Vec<Meta>,
    free_states: Vec<u32>,
    /// Fingerprint to state id, for the states that are interned (a fingerprint collision
    /// leaves the newer state out: duplicates only split runs, they do not change results).
    intern: FxHashMap<u64, u32>,
    transitions: Box<[Transition]>,
    /// The block whose last holder just left, with its position: freed at the next event
    /// unless that event stores it again (an engine demotes a block by removing it from one
    /// tier, then storing it in the next).
    pending: Option<(BlockHash, Loc)>,
    /// The block stored last and where: the next `Stored` usually names it as parent.
    last: Option<(BlockHash, Loc)>,
    /// Scratch for forming holder sets.
    scratch: Vec<u32>,
    /// One more than the largest instance id ever stored as a holder: the size of a query's
    /// per-instance table.
    instances: u32,
}

impl Default for PrefixIndex {
    fn default() -> PrefixIndex {
        PrefixIndex::new()
    }
}

impl PrefixIndex {
    pub fn new() -> PrefixIndex {
        PrefixIndex {
            map: BlockMap::default(),
            segments: Vec::new(),
            free_segments: Vec::new(),
            states: vec![State::default()],
            meta: vec![Meta::default()],
            free_states: Vec::new(),
            intern: FxHashMap::default(),
            transitions: vec![NO_TRANSITION; 1 << TRANSITION_BITS].into_boxed_slice(),
            pending: None,
            last: None,
            scratch: Vec::new(),
            instances: 0,
        }
    }

    /// Distinct blocks indexed (in any tier).
    pub fn blocks(&self) -> usize {
        self.map.len() - usize::from(self.pending.is_some())
    }

    /// Heap bytes held, estimated from capacities (the map's entries, segments, holder sets
    /// and their bitmaps, the intern map and the transition cache).
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        let map = self.map.bytes();
        let segments = self.segments.capacity() * size_of::<Segment>()
            + self.segments.iter().map(|s| s.hashes.capacity() * 8 + s.states.capacity() * 4).sum::<usize>();
        let states = self.states.capacity() * size_of::<State>()
            + self.meta.capacity() * size_of::<Meta>()
            + self
                .states
                .iter()
                .map(|s| s.holders.capacity() * 4 + s.bits.as_ref().map_or(0, |b| b.len() * 8))
                .sum::<usize>();
        let intern = self.intern.capacity() * (size_of::<(u64, u32)>() + 1);
        map + segments + states + intern + self.transitions.len() * size_of::<Transition>()
    }

    /// Applies one event published by `instance`. L3 events describe the shared store,
    /// whichever instance published them.
    pub fn apply(&mut self, instance: InstanceId, event: &KvEvent) {
        match *event {
            KvEvent::Stored { tier, hash, parent } => self.store(hash, parent, Change::stored(instance, tier)),
            KvEvent::Removed { tier, hash } => self.unstore(hash, Change::removed(instance, tier)),
            KvEvent::Cleared => self.remove_instance(instance),
        }
    }

    /// Applies events in order, as [`PrefixIndex::apply`] does one by one, faster: the map
    /// entries and positions of the next events are loaded first, so that the cache misses of
    /// an index larger than the caches overlap instead of queueing.
    pub fn apply_batch(&mut self, instance: InstanceId, events: &[KvEvent]) {
        fn hash_of(e: &KvEvent) -> Option<BlockHash> {
            match *e {
                KvEvent::Stored { hash, .. } | KvEvent::Removed { hash, .. } => Some(hash),
                KvEvent::Cleared => None,
            }
        }
        let mut sink = 0u64;
        for chunk in events.chunks(PREFETCH_EVENTS) {
            // Short loops of independent loads keep many misses in flight at once: first the
            // map entries, then the positions of the blocks they name.
            for e in chunk {
                if let Some(h) = hash_of(e) {
                    sink ^= self.map.touch(h);
                }
            }
            for e in chunk {
                if let Some(loc) = hash_of(e).and_then(|h| self.map.get(h)) {
                    sink ^= u64::from(self.segments[loc.seg as usize].states[loc.idx as usize]);
                }
            }
            for event in chunk {
                self.apply(instance, event);
            }
        }
        std::hint::black_box(sink);
    }

    fn store(&mut self, hash: BlockHash, parent: Option<BlockHash>, change: Change) {
        let loc = match self.pending {
            Some((h, loc)) if h == hash => {
                self.pending = None;
                loc
            }
            _ => {
                self.finish_pending();
                match self.map.probe(hash) {
                    Probe::Found(loc) => loc,
                    Probe::Vacant(slot) => {
                        let loc = self.place(hash, parent);
                        self.map.fill(slot, hash, loc);
                        loc
                    }
                }
            }
        };
        self.change_at(loc, change);
        self.last = Some((hash, loc));
    }

    fn unstore(&mut self, hash: BlockHash, change: Change) {
        if self.pending.is_some_and(|(h, _)| h == hash) {
            return;
        }
        self.finish_pending();
        let Some(loc) = self.map.get(hash) else { return };
        let (from, to) = self.change_at(loc, change);
        if to == EMPTY && from != EMPTY {
            self.pending = Some((hash, loc));
        }
    }

    /// A position for a new block: right after its parent when the parent ends its segment,
    /// else at the start of a new segment.
    fn place(&mut self, hash: BlockHash, parent: Option<BlockHash>) -> Loc {
        let after = parent.and_then(|p| match self.last {
            Some((h, loc)) if h == p && self.is_at(p, loc) => Some(loc),
            _ => self.map.get(p),
        });
        let seg = match after {
            Some(loc) if loc.idx as usize + 1 == self.segments[loc.seg as usize].hashes.len() => loc.seg,
            _ => match self.free_segments.pop() {
                Some(s) => s,
                None => {
                    self.segments.push(Segment::default());
                    self.segments.len() as u32 - 1
                }
            },
        };
        let idx = self.segments[seg as usize].push(hash);
        Loc { seg, idx }
    }

    /// Whether the live block `hash` is at `loc` (a remembered location may have gone stale).
    fn is_at(&self, hash: BlockHash, loc: Loc) -> bool {
        self.segments
            .get(loc.seg as usize)
            .is_some_and(|s| s.hashes.get(loc.idx as usize) == Some(&hash) && s.states[loc.idx as usize] != DEAD)
    }

    /// Applies `change` to the block at `loc`; returns its states before and after.
    fn change_at(&mut self, loc: Loc, change: Change) -> (u32, u32) {
        let from = self.segments[loc.seg as usize].states[loc.idx as usize];
        let to = self.transition(from, change);
        if to != from {
            self.segments[loc.seg as usize].states[loc.idx as usize] = to;
            if to != EMPTY {
                self.meta[to as usize].refs += 1;
            }
            self.release(from);
        }
        (from, to)
    }

    /// The state `change` turns `from` into, from the cache or formed and interned.
    fn transition(&mut self, from: u32, change: Change) -> u32 {
        let code = change.code();
        let slot =
            (u64::from(from) << 32 | u64::from(code)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - TRANSITION_BITS);
        let t = self.transitions[slot as usize];
        if t.from == from
            && t.change == code
            && self.meta[from as usize].gen == t.from_gen
            && self.meta[t.to as usize].gen == t.to_gen
        {
            return t.to;
        }
        let to = self.form(from, change);
        let (from_gen, to_gen) = (self.meta[from as usize].gen, self.meta[to as usize].gen);
        self.transitions[slot as usize] = Transition { from, change: code, to, from_gen, to_gen };
        to
    }

    fn form(&mut self, from: u32, change: Change) -> u32 {
        let s = &self.states[from as usize];
        let (mut in_l3, mut fp) = (s.in_l3, s.fp);
        self.scratch.clear();
        self.scratch.extend_from_slice(&s.holders);
        match change {
            Change::Add(h) => match self.scratch.binary_search(&h) {
                Ok(_) => return from,
                Err(p) => {
                    self.scratch.insert(p, h);
                    fp = fp.wrapping_add(holder_fp(h));
                    self.instances = self.instances.max((h >> 1) + 1);
                }
            },
            Change::Remove(h) => match self.scratch.binary_search(&h) {
                Ok(p) => {
                    self.scratch.remove(p);
                    fp = fp.wrapping_sub(holder_fp(h));
                }
                Err(_) => return from,
            },
            Change::SetL3 if in_l3 => return from,
            Change::SetL3 => {
                in_l3 = true;
                fp = fp.wrapping_add(L3_FP);
            }
            Change::ClearL3 if !in_l3 => return from,
            Change::ClearL3 => {
                in_l3 = false;
                fp = fp.wrapping_sub(L3_FP);
            }
        }
        if self.scratch.is_empty() && !in_l3 {
            return EMPTY;
        }
        if let Some(&id) = self.intern.get(&fp) {
            let s = &self.states[id as usize];
            if s.in_l3 == in_l3 && s.holders == self.scratch {
                return id;
            }
        }
        let holders = self.scratch.clone();
        let id = match self.free_states.pop() {
            Some(id) => id,
            None => {
                self.states.push(State::default());
                self.meta.push(Meta::default());
                self.states.len() as u32 - 1
            }
        };
        let s = &mut self.states[id as usize];
        s.set_holders(holders, in_l3);
        debug_assert_eq!(self.meta[id as usize].refs, 0);
        debug_assert_eq!(s.fp, fp);
        self.intern.entry(fp).or_insert(id);
        id
    }

    /// One position fewer has state `id`.
    fn release(&mut self, id: u32) {
        if id == EMPTY || id == DEAD {
            return;
        }
        let m = &mut self.meta[id as usize];
        m.refs -= 1;
        if m.refs == 0 {
            m.gen = m.gen.wrapping_add(1);
            let s = &mut self.states[id as usize];
            if self.intern.get(&s.fp) == Some(&id) {
                self.intern.remove(&s.fp);
            }
            s.set_holders(Vec::new(), false);
            self.free_states.push(id);
        }
    }

    /// Drops the pending block from the index: nothing stored it back.
    fn finish_pending(&mut self) {
        if let Some((hash, loc)) = self.pending.take() {
            self.map.remove(hash);
            self.kill(loc);
            self.tidy(loc.seg);
        }
    }

    /// Marks a position dead (its block is already out of the map).
    fn kill(&mut self, loc: Loc) {
        let seg = &mut self.segments[loc.seg as usize];
        let state = std::mem::replace(&mut seg.states[loc.idx as usize], DEAD);
        seg.dead += 1;
        self.release(state);
    }

    /// Drops dead positions from the end of segment `s`, frees it when nothing is left, and
    /// compacts it when most of it is dead.
    fn tidy(&mut self, s: u32) {
        let seg = &mut self.segments[s as usize];
        while seg.states.last() == Some(&DEAD) {
            seg.states.pop();
            seg.hashes.pop();
            seg.dead -= 1;
        }
        if seg.hashes.is_empty() {
            *seg = Segment::default();
            self.free_segments.push(s);
        } else if seg.dead >= COMPACT_MIN_DEAD && seg.dead as usize * 2 >= seg.hashes.len() {
            let mut w = 0;
            for r in 0..seg.hashes.len() {
                if seg.states[r] == DEAD {
                    continue;
                }
                seg.hashes[w] = seg.hashes[r];
                seg.states[w] = seg.states[r];
                self.map.set(seg.hashes[w], Loc { seg: s, idx: w as u32 });
                w += 1;
            }
            seg.hashes.truncate(w);
            seg.states.truncate(w);
            seg.hashes.shrink_to_fit();
            seg.states.shrink_to_fit();
            seg.dead = 0;
        }
    }

    /// Forgets everything `instance` held in its own tiers (it went down or was cleared).
    /// Holder sets change in place, so this costs O(states), plus one pass over the segments
    /// when some blocks were held by the instance alone.
    pub fn remove_instance(&mut self, instance: InstanceId) {
        self.finish_pending();
        let (l1, l2) = (holder(instance, Tier::L1), holder(instance, Tier::L2));
        let mut emptied = vec![false; self.states.len()];
        let mut any_emptied = false;
        for (id, (s, m)) in self.states.iter_mut().zip(&mut self.meta).enumerate().skip(1) {
            if m.refs == 0 || !(s.holders.binary_search(&l1).is_ok() || s.holders.binary_search(&l2).is_ok()) {
                continue;
            }
            if self.intern.get(&s.fp) == Some(&(id as u32)) {
                self.intern.remove(&s.fp);
            }
            let mut holders = std::mem::take(&mut s.holders);
            holders.retain(|&h| h != l1 && h != l2);
            s.set_holders(holders, s.in_l3);
            m.gen = m.gen.wrapping_add(1);
            if s.is_empty() {
                emptied[id] = true;
                any_emptied = true;
            } else {
                self.intern.entry(s.fp).or_insert(id as u32);
            }
        }
        if !any_emptied {
            return;
        }
        for s in 0..self.segments.len() {
            let mut killed = false;
            for idx in 0..self.segments[s].hashes.len() {
                let state = self.segments[s].states[idx];
                if state != DEAD && emptied[state as usize] {
                    let hash = self.segments[s].hashes[idx];
                    self.map.remove(hash);
                    self.kill(Loc { seg: s as u32, idx: idx as u32 });
                    killed = true;
                }
            }
            if killed {
                self.tidy(s as u32);
            }
        }
    }

    /// Checks the structure: every map entry at a live position with its hash and every live
    /// position in the map, reference counts equal to positions, dead counts, interned
    /// states live with their fingerprint. For tests; O(blocks).
    pub fn check_invariants(&self) {
        let mut refs = vec![0u32; self.states.len()];
        let mut live = 0;
        for (s, seg) in self.segments.iter().enumerate() {
            assert_eq!(seg.hashes.len(), seg.states.len());
            assert!(self.free_segments.contains(&(s as u32)) == seg.hashes.is_empty(), "segment {s} freed iff empty");
            assert_ne!(seg.states.last(), Some(&DEAD), "segment {s} ends in a dead position");
            let mut dead = 0;
            for (idx, (&h, &state)) in seg.hashes.iter().zip(&seg.states).enumerate() {
                if state == DEAD {
                    dead += 1;
                    continue;
                }
                live += 1;
                refs[state as usize] += 1;
                assert_eq!(self.map.get(h), Some(Loc { seg: s as u32, idx: idx as u32 }), "{h:?} not in the map");
                let pending = self.pending.is_some_and(|(p, _)| p == h);
                assert_eq!(state == EMPTY, pending, "{h:?}: only the pending block has the empty state");
                assert!(
                    !self.states[state as usize].is_empty() || state == EMPTY,
                    "{h:?}: a non-empty id holds nothing"
                );
            }
            assert_eq!(seg.dead, dead, "segment {s} dead count");
        }
        assert_eq!(live, self.map.len(), "live positions and map entries");
        for (h, loc) in self.map.iter() {
            assert!(self.is_at(h, loc), "{h:?}: the map points at a position without it");
        }
        for (id, s) in self.states.iter().enumerate().skip(1) {
            assert_eq!(self.meta[id].refs, refs[id], "state {id} reference count");
            assert!(s.holders.windows(2).all(|w| w[0] < w[1]), "state {id} holders sorted");
            let fp = s.holders.iter().fold(if s.in_l3 { L3_FP } else { 0 }, |fp, &h| fp.wrapping_add(holder_fp(h)));
            assert_eq!(s.fp, fp, "state {id} fingerprint");
            assert_eq!(s.twice, s.holders.windows(2).any(|w| w[0] >> 1 == w[1] >> 1), "state {id} twice");
        }
        for (&fp, &id) in &self.intern {
            assert!(self.meta[id as usize].refs > 0, "interned state {id} is live");
            assert_eq!(self.states[id as usize].fp, fp, "interned state {id} fingerprint");
        }
    }
}
