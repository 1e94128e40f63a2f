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
//! Measured by `fleetplane bench-index` (docs/BENCHMARKS.md).
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
use std::sync::Arc;

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
/// Holder sets at least this large get a bitmap (see `State::bits`; tests use small sets).
const BITMAP_MIN_HOLDERS: usize = if cfg!(test) { 2 } else { 64 };
/// Events [`PrefixIndex::apply_batch`] loads ahead at once.
const PREFETCH_EVENTS: usize = 32;
/// Blocks a query compares at once while it follows a run.
const RUN_STRIDE: usize = 8;

/// A holder is `instance << 1 | 1 if L2`: sorted, an instance's L1 entry comes before its L2
/// one, which is how the best tier wins.
fn holder(instance: InstanceId, tier: Tier) -> u32 {
    assert!(instance.0 < 1 << 29, "instance id {} too large for the prefix index", instance.0);
    instance.0 << 1 | u32::from(tier == Tier::L2)
}

/// Order-independent fingerprint of a holder set, kept incrementally (`+` per holder).
fn holder_fp(h: u32) -> u64 {
    engine::ids::mix64(u64::from(h) + 1)
}
const L3_FP: u64 = 0x6a09_e667_f3bc_c909;

/// A change one event makes to one block's holder set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    Add(u32),
    Remove(u32),
    SetL3,
    ClearL3,
}

impl Change {
    fn stored(instance: InstanceId, tier: Tier) -> Change {
        if tier == Tier::L3 {
            Change::SetL3
        } else {
            Change::Add(holder(instance, tier))
        }
    }

    fn removed(instance: InstanceId, tier: Tier) -> Change {
        if tier == Tier::L3 {
            Change::ClearL3
        } else {
            Change::Remove(holder(instance, tier))
        }
    }

    fn code(self) -> u32 {
        match self {
            Change::Add(h) => h << 2,
            Change::Remove(h) => h << 2 | 1,
            Change::SetL3 => 2,
            Change::ClearL3 => 3,
        }
    }
}

/// Where a block is: `segments[seg]`, index `idx`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Loc {
    seg: u32,
    idx: u32,
}

/// Blocks laid out in the order their `Stored` events chained them. Positions only grow at
/// the end; a block leaving the index leaves a dead position, dropped from the end at once
/// and from the middle by compaction.
#[derive(Clone, Debug, Default)]
struct Segment {
    hashes: Vec<BlockHash>,
    /// State id of each position, or `DEAD`.
    states: Vec<u32>,
    /// Dead positions.
    dead: u32,
}

impl Segment {
    fn push(&mut self, hash: BlockHash) -> u32 {
        let len = self.hashes.len();
        if len == self.hashes.capacity() {
            // 1.5x growth keeps the unused tail of long segments to a third at most.
            let extra = (len / 2).max(4);
            self.hashes.reserve_exact(extra);
            self.states.reserve_exact(extra);
        }
        self.hashes.push(hash);
        self.states.push(EMPTY);
        len as u32
    }
}

/// A set of holders, shared by every block it describes.
#[derive(Clone, Debug, Default)]
struct State {
    /// Sorted holders (see [`holder`]).
    holders: Vec<u32>,
    /// Some instance is listed twice (L1 and L2), which the query must skip.
    twice: bool,
    /// For sets of [`BITMAP_MIN_HOLDERS`] or more: two bits per instance (L1, L2), so that a
    /// query starting with this set can record it whole instead of visiting every holder.
    bits: Option<Arc<[u64]>>,
    in_l3: bool,
    /// [`holder_fp`] summed over `holders`, plus `L3_FP` if in L3: the intern key.
    fp: u64,
}

impl State {
    fn is_empty(&self) -> bool {
        self.holders.is_empty() && !self.in_l3
    }

    fn set_holders(&mut self, holders: Vec<u32>, in_l3: bool) {
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
struct Meta {
    /// Positions with this state (the pending block's is `EMPTY`, which is not counted); at
    /// zero the state is freed.
    refs: u32,
    /// Bumped when the id is freed or the set changes in place, which invalidates the
    /// cached transitions that name it.
    gen: u32,
}

/// A cached `from` + change = `to`, valid while both states keep their generations.
#[derive(Clone, Copy, Debug)]
struct Transition {
    from: u32,
    change: u32,
    to: u32,
    from_gen: u32,
    to_gen: u32,
}

const NO_TRANSITION: Transition = Transition { from: DEAD, change: 0, to: 0, from_gen: 0, to_gen: 0 };

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

    /// The longest cached prefix of `hashes` on every instance, by tier, into `out`.
    pub fn match_prefix(&self, hashes: &[BlockHash], out: &mut PrefixMatches) {
        out.start(self.instances);
        let n = hashes.len();
        let mut j = 0;
        'walk: while j < n {
            let Some(loc) = self.map.get(hashes[j]) else { break };
            let seg = &self.segments[loc.seg as usize];
            let mut i = loc.idx as usize;
            loop {
                // The run: positions after `i` with the same state and the prompt's hashes.
                let state = seg.states[i];
                let max = (seg.hashes.len() - i).min(n - j);
                let (seg_hashes, seg_states, want) =
                    (&seg.hashes[i..i + max], &seg.states[i..i + max], &hashes[j..j + max]);
                let mut len = 1;
                while len + RUN_STRIDE <= max
                    && seg_states[len..len + RUN_STRIDE].iter().all(|&s| s == state)
                    && seg_hashes[len..len + RUN_STRIDE] == want[len..len + RUN_STRIDE]
                {
                    len += RUN_STRIDE;
                }
                while len < max && seg_states[len] == state && seg_hashes[len] == want[len] {
                    len += 1;
                }
                if !out.visit(&self.states[state as usize], j as u32, len as u32) {
                    break 'walk;
                }
                j += len;
                i += len;
                if j == n || i == seg.hashes.len() || seg.states[i] == DEAD || seg.hashes[i] != hashes[j] {
                    continue 'walk;
                }
            }
        }
        out.end = j as u32;
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
/// first run is not visited holder by holder at all (see [`Base`]).
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
}

impl PrefixMatches {
    fn start(&mut self, instances: u32) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.slots.iter_mut().for_each(|s| s.epoch = 0);
            self.epoch = 1;
        }
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
        match self.slots.get(instance as usize) {
            Some(s) if s.epoch == self.epoch => *s,
            _ => self.base.as_ref().map_or(Slot::default(), |b| b.slot(instance)),
        }
    }

    /// Blocks of the prefix `instance` would find cached, by tier.
    pub fn get(&self, instance: InstanceId) -> TierMatch {
        let s = self.slot(instance.0);
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
        base.chain(rest).map(|i| (InstanceId(i), self.get(InstanceId(i))))
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
        if let Some(base) = &self.base {
            // The holders of the first run that no later run touched all match alike, by
            // tier; an L1 one beats every L2 one, and the first of them beats the others.
            let untouched = |&i: &u32| self.slots.get(i as usize).is_none_or(|s| s.epoch != self.epoch);
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
        TierMatch { l3: self.misses.first().copied().unwrap_or(self.end), ..TierMatch::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    const A: InstanceId = InstanceId(0);
    const B: InstanceId = InstanceId(1);
    const C: InstanceId = InstanceId(2);

    /// A chain of `n` block hashes after `parent`.
    fn chain(parent: BlockHash, seed: u64, n: usize) -> Vec<BlockHash> {
        let mut h = parent;
        (0..n as u64)
            .map(|k| {
                h = h.chain(seed * 1000 + k);
                h
            })
            .collect()
    }

    fn store(index: &mut PrefixIndex, instance: InstanceId, tier: Tier, hashes: &[BlockHash]) {
        for (k, &hash) in hashes.iter().enumerate() {
            let parent = k.checked_sub(1).map(|k| hashes[k]);
            index.apply(instance, &KvEvent::Stored { tier, hash, parent });
            index.check_invariants();
        }
    }

    fn remove(index: &mut PrefixIndex, instance: InstanceId, tier: Tier, hashes: &[BlockHash]) {
        for &hash in hashes {
            index.apply(instance, &KvEvent::Removed { tier, hash });
            index.check_invariants();
        }
    }

    fn tm(l1: u32, l2: u32, l3: u32) -> TierMatch {
        TierMatch { l1, l2, l3 }
    }

    /// Matches `hashes` and checks each listed instance's result.
    fn check(index: &PrefixIndex, hashes: &[BlockHash], expected: &[(InstanceId, TierMatch)]) {
        let mut m = PrefixMatches::default();
        index.match_prefix(hashes, &mut m);
        for &(i, want) in expected {
            assert_eq!(m.get(i), want, "{i}");
        }
    }

    #[test]
    fn blocks_count_in_the_best_tier_the_instance_has_them_in() {
        let h = chain(BlockHash::ROOT, 1, 6);
        let mut index = PrefixIndex::new();
        store(&mut index, A, Tier::L1, &h[..2]);
        store(&mut index, A, Tier::L2, &h[2..4]);
        store(&mut index, A, Tier::L3, &h[1..5]);
        // Held by A in L1 and L2 at once (between two events of a move): L1 wins.
        store(&mut index, A, Tier::L1, &h[3..4]);
        check(&index, &h, &[(A, tm(3, 1, 1)), (B, tm(0, 0, 0))]);
        assert_eq!(index.blocks(), 5);
    }

    #[test]
    fn the_shared_store_alone_gives_every_instance_a_prefix() {
        let h = chain(BlockHash::ROOT, 2, 5);
        let mut index = PrefixIndex::new();
        store(&mut index, C, Tier::L3, &h[..3]);
        store(&mut index, B, Tier::L1, &h[..4]);
        let mut m = PrefixMatches::default();
        index.match_prefix(&h, &mut m);
        assert_eq!(m.get(A), tm(0, 0, 3), "an instance that never published anything");
        assert_eq!(m.get(C), tm(0, 0, 3), "the publisher of the L3 events holds nothing itself");
        assert_eq!(m.get(InstanceId(77)), tm(0, 0, 3), "an instance the index never heard of");
        assert_eq!(m.get(B), tm(4, 0, 0));
        assert_eq!(m.shared(), tm(0, 0, 3));
        assert_eq!(m.iter().collect::<Vec<_>>(), vec![(B, tm(4, 0, 0))]);
    }

    #[test]
    fn a_prefix_continues_across_holes_filled_by_another_tier() {
        let h = chain(BlockHash::ROOT, 3, 6);
        let mut index = PrefixIndex::new();
        store(&mut index, A, Tier::L1, &h[..2]);
        store(&mut index, B, Tier::L3, &h[2..3]);
        store(&mut index, A, Tier::L2, &h[3..4]);
        store(&mut index, B, Tier::L3, &h[4..5]);
        check(&index, &h, &[(A, tm(2, 1, 2)), (B, tm(0, 0, 0))]);
        // A prompt that starts mid-chain, and one that is not a chain at all.
        check(&index, &h[2..], &[(A, tm(0, 1, 2)), (B, tm(0, 0, 1))]);
        check(&index, &[h[3], h[0], h[4], h[1]], &[(A, tm(2, 1, 1))]);
    }

    #[test]
    fn removing_a_block_ends_the_prefix_there() {
        let h = chain(BlockHash::ROOT, 4, 6);
        let mut index = PrefixIndex::new();
        store(&mut index, A, Tier::L1, &h);
        store(&mut index, B, Tier::L1, &h[..4]);
        remove(&mut index, A, Tier::L1, &h[2..3]);
        check(&index, &h, &[(A, tm(2, 0, 0)), (B, tm(4, 0, 0))]);
        assert_eq!(index.blocks(), 6, "B still holds the removed block");
        remove(&mut index, A, Tier::L1, &h[4..]);
        assert_eq!(index.blocks(), 4);
        // Removing what is not there changes nothing.
        remove(&mut index, C, Tier::L2, &h);
        remove(&mut index, A, Tier::L3, &h);
        check(&index, &h, &[(A, tm(2, 0, 0)), (B, tm(4, 0, 0))]);
    }

    #[test]
    fn demotion_keeps_blocks_in_place() {
        // What an engine publishes when L1 evicts a leaf: removed from L1, stored in L2.
        let h = chain(BlockHash::ROOT, 5, 8);
        let mut index = PrefixIndex::new();
        store(&mut index, A, Tier::L1, &h);
        for k in (4..8).rev() {
            remove(&mut index, A, Tier::L1, &h[k..=k]);
            index.apply(A, &KvEvent::Stored { tier: Tier::L2, hash: h[k], parent: Some(h[k - 1]) });
            index.check_invariants();
        }
        // And when L2 evicts one: removed from L2, stored in L3 (without its parent).
        remove(&mut index, A, Tier::L2, &h[7..]);
        index.apply(A, &KvEvent::Stored { tier: Tier::L3, hash: h[7], parent: None });
        index.check_invariants();
        check(&index, &h, &[(A, tm(4, 3, 1)), (B, tm(0, 0, 0))]);
        assert_eq!(index.segments.len() - index.free_segments.len(), 1, "still one run of positions");
    }

    #[test]
    fn remove_instance_and_cleared_forget_only_that_instances_tiers() {
        let h = chain(BlockHash::ROOT, 6, 6);
        let mut index = PrefixIndex::new();
        store(&mut index, A, Tier::L1, &h[..4]);
        store(&mut index, A, Tier::L2, &h[4..]);
        store(&mut index, B, Tier::L1, &h[..2]);
        store(&mut index, C, Tier::L2, &h[..3]);
        store(&mut index, C, Tier::L3, &h[5..]);
        index.remove_instance(A);
        index.check_invariants();
        check(&index, &h, &[(A, tm(0, 0, 0)), (B, tm(2, 0, 0)), (C, tm(0, 3, 0))]);
        assert_eq!(index.blocks(), 4, "h[3] and h[4] were A's alone");
        index.apply(C, &KvEvent::Cleared);
        index.check_invariants();
        check(&index, &h, &[(B, tm(2, 0, 0)), (C, tm(0, 0, 0))]);
        assert_eq!(index.blocks(), 3, "h[2] goes with C, h[5] stays in L3");
        // The instance comes back.
        store(&mut index, A, Tier::L1, &h);
        check(&index, &h, &[(A, tm(6, 0, 0)), (B, tm(2, 0, 0))]);
    }

    #[test]
    fn a_fleet_wide_prefix_is_matched_for_every_instance() {
        let h = chain(BlockHash::ROOT, 7, 10);
        let mut index = PrefixIndex::new();
        for i in 0..300 {
            store(&mut index, InstanceId(i), Tier::L1, &h[..4]);
        }
        store(&mut index, InstanceId(5), Tier::L1, &h[4..8]);
        store(&mut index, InstanceId(299), Tier::L2, &h[4..6]);
        let mut m = PrefixMatches::default();
        index.match_prefix(&h, &mut m);
        assert_eq!(m.get(InstanceId(5)), tm(8, 0, 0));
        assert_eq!(m.get(InstanceId(299)), tm(4, 2, 0));
        assert_eq!(m.get(InstanceId(17)), tm(4, 0, 0));
        assert_eq!(m.get(InstanceId(300)), tm(0, 0, 0));
        assert_eq!(m.iter().count(), 300);
        assert_eq!(m.iter().filter(|(_, t)| t.total() > 4).count(), 2);
    }

    /// The index against the semantics written out: per (instance, tier) sets and a walk.
    #[derive(Default)]
    struct Model {
        own: HashSet<(u32, Tier, BlockHash)>,
        l3: HashSet<BlockHash>,
    }

    impl Model {
        fn apply(&mut self, instance: InstanceId, event: &KvEvent) {
            match *event {
                KvEvent::Stored { tier: Tier::L3, hash, .. } => {
                    self.l3.insert(hash);
                }
                KvEvent::Removed { tier: Tier::L3, hash } => {
                    self.l3.remove(&hash);
                }
                KvEvent::Stored { tier, hash, .. } => {
                    self.own.insert((instance.0, tier, hash));
                }
                KvEvent::Removed { tier, hash } => {
                    self.own.remove(&(instance.0, tier, hash));
                }
                KvEvent::Cleared => self.own.retain(|&(i, _, _)| i != instance.0),
            }
        }

        fn prefix(&self, instance: u32, hashes: &[BlockHash]) -> TierMatch {
            let mut m = TierMatch::default();
            for &h in hashes {
                if self.own.contains(&(instance, Tier::L1, h)) {
                    m.l1 += 1;
                } else if self.own.contains(&(instance, Tier::L2, h)) {
                    m.l2 += 1;
                } else if self.l3.contains(&h) {
                    m.l3 += 1;
                } else {
                    break;
                }
            }
            m
        }

        fn blocks(&self) -> usize {
            let mut all: HashSet<BlockHash> = self.l3.clone();
            all.extend(self.own.iter().map(|&(_, _, h)| h));
            all.len()
        }
    }

    /// The block universe of the property test: a small tree of chained hashes, each with its
    /// parent, plus the hash 0 (which the map keeps aside).
    fn universe() -> Vec<(BlockHash, Option<BlockHash>)> {
        let trunk = chain(BlockHash::ROOT, 10, 8);
        let branch = chain(trunk[3], 11, 6);
        let other = chain(BlockHash::ROOT, 12, 5);
        let twig = chain(branch[1], 13, 3);
        let mut u = Vec::new();
        for c in [&trunk, &branch, &other, &twig] {
            for (k, &h) in c.iter().enumerate() {
                let parent = match k {
                    0 if c == &branch => Some(trunk[3]),
                    0 if c == &twig => Some(branch[1]),
                    0 => None,
                    _ => Some(c[k - 1]),
                };
                u.push((h, parent));
            }
        }
        u.push((BlockHash(0), Some(other[4])));
        u
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// A whole run of the universe stored in chain order, as engines publish it.
        StoreRun {
            instance: u32,
            tier: u8,
            from: usize,
            len: usize,
            with_parent: bool,
        },
        Store {
            instance: u32,
            tier: u8,
            block: usize,
            with_parent: bool,
        },
        Remove {
            instance: u32,
            tier: u8,
            block: usize,
        },
        /// Removed from one tier, stored in the next (a demotion).
        Move {
            instance: u32,
            tier: u8,
            block: usize,
        },
        Cleared {
            instance: u32,
        },
        RemoveInstance {
            instance: u32,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        let n = universe().len();
        prop_oneof![
            4 => (0u32..4, 0u8..3, 0..n, 1usize..8, any::<bool>())
                .prop_map(|(instance, tier, from, len, with_parent)| Op::StoreRun { instance, tier, from, len, with_parent }),
            4 => (0u32..4, 0u8..3, 0..n, any::<bool>())
                .prop_map(|(instance, tier, block, with_parent)| Op::Store { instance, tier, block, with_parent }),
            4 => (0u32..4, 0u8..3, 0..n).prop_map(|(instance, tier, block)| Op::Remove { instance, tier, block }),
            2 => (0u32..4, 0u8..2, 0..n).prop_map(|(instance, tier, block)| Op::Move { instance, tier, block }),
            1 => (0u32..4).prop_map(|instance| Op::Cleared { instance }),
            1 => (0u32..4).prop_map(|instance| Op::RemoveInstance { instance }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Every instance's match, the shared match, the matched instances and the block
        /// count equal the model's after every operation, for chain prompts and arbitrary ones.
        #[test]
        fn matches_equal_a_walk_over_per_tier_sets(
            ops in proptest::collection::vec(op(), 1..60),
            prompts in proptest::collection::vec(proptest::collection::vec(0usize..30, 0..12), 1..4),
        ) {
            let u = universe();
            let mut index = PrefixIndex::new();
            let mut model = Model::default();
            let tiers = [Tier::L1, Tier::L2, Tier::L3];
            let mut events = Vec::new();
            let mut chains: Vec<Vec<BlockHash>> = Vec::new();
            // Chain prompts: every root-to-block path of the universe.
            for k in 0..u.len() {
                let mut path = vec![u[k].0];
                let mut p = u[k].1;
                while let Some(h) = p {
                    path.push(h);
                    p = u.iter().find(|(x, _)| *x == h).and_then(|&(_, q)| q);
                }
                path.reverse();
                chains.push(path);
            }
            chains.extend(prompts.iter().map(|p| p.iter().map(|&k| u[k % u.len()].0).collect()));
            for op in ops {
                events.clear();
                match op {
                    Op::StoreRun { instance, tier, from, len, with_parent } => {
                        for &(hash, parent) in &u[from..(from + len).min(u.len())] {
                            let parent = if with_parent { parent } else { None };
                            events.push((instance, KvEvent::Stored { tier: tiers[tier as usize], hash, parent }));
                        }
                    }
                    Op::Store { instance, tier, block, with_parent } => {
                        let (hash, parent) = u[block];
                        let parent = if with_parent { parent } else { None };
                        events.push((instance, KvEvent::Stored { tier: tiers[tier as usize], hash, parent }));
                    }
                    Op::Remove { instance, tier, block } => {
                        events.push((instance, KvEvent::Removed { tier: tiers[tier as usize], hash: u[block].0 }));
                    }
                    Op::Move { instance, tier, block } => {
                        let (hash, parent) = u[block];
                        events.push((instance, KvEvent::Removed { tier: tiers[tier as usize], hash }));
                        events.push((instance, KvEvent::Stored { tier: tiers[tier as usize + 1], hash, parent }));
                    }
                    Op::Cleared { instance } => events.push((instance, KvEvent::Cleared)),
                    Op::RemoveInstance { instance } => {
                        index.remove_instance(InstanceId(instance));
                        model.apply(InstanceId(instance), &KvEvent::Cleared);
                    }
                }
                for (instance, e) in &events {
                    index.apply(InstanceId(*instance), e);
                    model.apply(InstanceId(*instance), e);
                    index.check_invariants();
                }
                prop_assert_eq!(index.blocks(), model.blocks());
                let mut m = PrefixMatches::default();
                for prompt in &chains {
                    index.match_prefix(prompt, &mut m);
                    for i in 0..5 {
                        prop_assert_eq!(m.get(InstanceId(i)), model.prefix(i, prompt), "instance {} prompt {:?}", i, prompt);
                    }
                    prop_assert_eq!(m.shared(), model.prefix(99, prompt));
                    let mut listed: Vec<u32> = m.iter().map(|(i, t)| {
                        assert_eq!(t, m.get(i));
                        i.0
                    }).collect();
                    listed.sort_unstable();
                    let want: Vec<u32> = (0..5).filter(|&i| {
                        let t = model.prefix(i, prompt);
                        t.l1 + t.l2 > 0
                    }).collect();
                    prop_assert_eq!(listed, want);
                    let longest = (0..5)
                        .map(|i| (i, model.prefix(i, prompt)))
                        .filter(|(_, t)| t.l1 + t.l2 > 0)
                        .max_by_key(|&(i, t)| (t.total(), t.l1, t.l2, std::cmp::Reverse(i)))
                        .map(|(i, t)| (InstanceId(i), t));
                    prop_assert_eq!(m.longest(), longest);
                }
            }
        }
    }
}
