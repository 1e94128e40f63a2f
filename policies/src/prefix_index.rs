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
//!  map:        BlockHash ─▶ (segment, position)       every indexed block, exactly once
//!  segments:   s0  hashes [a  b  c  d  e  f ]          blocks laid out in chain order,
//!                  states [7  7  7  9  9  0 ]          as their Stored events came
//!              s1  hashes [x  y  ✝  z]                 ✝: dead position, no longer in the map
//!  states:     7 = {inst-3 L1, inst-8 L1, inst-8 L2}   interned holder sets (+ "in L3")
//!              9 = {inst-3 L1} + L3,   0 = {} (nobody)
//! ```
//!
//! Chained hashes make a prompt a path, and the blocks of one path arrive as `Stored` runs in
//! chain order, so a block stored after its parent is appended right after it in the
//! parent's segment. Each block carries the id of its holder set, interned so that a run of
//! blocks held by the same instances shares one id.
//!
//! | identifier | why |
//! | --- | --- |
//! | `map` | events name blocks by hash; a query enters a segment by hash |
//! | `Segment` | a query compares its hashes with a segment's, 12 bytes per block, in order, instead of probing the map per block |
//! | `State` | one holder set per run of equally held blocks: a query visits each holder once per run, not per block |
//! | `transitions` | a run of events doing the same thing (instance 3 stores in L1) to blocks in the same state costs one cache probe each |
//! | `pending` | a block's last holder going and its new tier arriving (L1 → L2 → L3 demotion) keeps the block in place |
//!
//! # Cost
//!
//! | operation | cost |
//! | --- | --- |
//! | `apply` (Stored, Removed) | one map probe and one segment access; O(holders) only when a new holder set is formed |
//! | `match_prefix` | one map probe per segment entered, 12 sequential bytes per block walked, O(holders) per run of one state |
//! | `remove_instance`, `Cleared` | O(states × holders), plus one pass over the segments if blocks lost their last holder |
//! | memory | ~17-27 bytes per block in the map (16 bytes a bucket and its control byte, at hashbrown's load) + 12 in segments |
//!
//! # Exactness
//!
//! Nothing here trusts the chain: adjacency in a segment is only a guess at where the next
//! block of a prompt is, checked by comparing hashes, and a live block is at exactly one
//! position (the map's). A wrong or missing `parent` only costs speed (a new segment), and a
//! prompt starting mid-chain, or one that is not a chain at all, is matched exactly. L1 sets
//! being prefix-closed is not assumed either: holes in any tier are matched exactly.

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
/// this many, and half of the segment, are dead.
const COMPACT_MIN_DEAD: u32 = 16;
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    in_l3: bool,
    /// [`holder_fp`] summed over `holders`, plus `L3_FP` if in L3: the intern key.
    fp: u64,
    /// Positions (and the pending block) with this state; at zero the state is freed.
    refs: u32,
    /// Bumped when the id is freed or the set changes in place, which invalidates the
    /// cached transitions that name it.
    gen: u32,
}

impl State {
    fn is_empty(&self) -> bool {
        self.holders.is_empty() && !self.in_l3
    }

    fn set_holders(&mut self, holders: Vec<u32>, in_l3: bool) {
        self.twice = holders.windows(2).any(|w| w[0] >> 1 == w[1] >> 1);
        self.fp = holders.iter().fold(if in_l3 { L3_FP } else { 0 }, |fp, &h| fp.wrapping_add(holder_fp(h)));
        self.holders = holders;
        self.in_l3 = in_l3;
    }
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

#[derive(Clone, Debug)]
pub struct PrefixIndex {
    map: FxHashMap<BlockHash, Loc>,
    segments: Vec<Segment>,
    free_segments: Vec<u32>,
    /// Holder sets by id; `states[EMPTY]` is the empty set and is never freed.
    states: Vec<State>,
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
            map: FxHashMap::default(),
            segments: Vec::new(),
            free_segments: Vec::new(),
            states: vec![State::default()],
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

    /// Heap bytes held, estimated from capacities (the map's buckets and control bytes,
    /// segments, holder sets, the intern map and the transition cache).
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        // hashbrown keeps 7/8 of a power-of-two bucket count usable, with one control byte each.
        let buckets = if self.map.capacity() == 0 { 0 } else { (self.map.capacity() * 8 / 7).next_power_of_two() };
        let map = buckets * (size_of::<(BlockHash, Loc)>() + 1);
        let segments = self.segments.capacity() * size_of::<Segment>()
            + self.segments.iter().map(|s| s.hashes.capacity() * 8 + s.states.capacity() * 4).sum::<usize>();
        let states = self.states.capacity() * size_of::<State>()
            + self.states.iter().map(|s| s.holders.capacity() * 4).sum::<usize>();
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

    fn store(&mut self, hash: BlockHash, parent: Option<BlockHash>, change: Change) {
        let loc = match self.pending {
            Some((h, loc)) if h == hash => {
                self.pending = None;
                loc
            }
            _ => {
                self.finish_pending();
                match self.map.get(&hash) {
                    Some(&loc) => loc,
                    None => {
                        let loc = self.place(hash, parent);
                        self.map.insert(hash, loc);
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
        let Some(&loc) = self.map.get(&hash) else { return };
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
            _ => self.map.get(&p).copied(),
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
        self.segments.get(loc.seg as usize).is_some_and(|s| {
            s.hashes.get(loc.idx as usize) == Some(&hash) && s.states[loc.idx as usize] != DEAD
        })
    }

    /// Applies `change` to the block at `loc`; returns its states before and after.
    fn change_at(&mut self, loc: Loc, change: Change) -> (u32, u32) {
        let from = self.segments[loc.seg as usize].states[loc.idx as usize];
        let to = self.transition(from, change);
        if to != from {
            self.segments[loc.seg as usize].states[loc.idx as usize] = to;
            if to != EMPTY {
                self.states[to as usize].refs += 1;
            }
            self.release(from);
        }
        (from, to)
    }

    /// The state `change` turns `from` into, from the cache or formed and interned.
    fn transition(&mut self, from: u32, change: Change) -> u32 {
        let code = change.code();
        let slot = (u64::from(from) << 32 | u64::from(code)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - TRANSITION_BITS);
        let t = self.transitions[slot as usize];
        if t.from == from
            && t.change == code
            && self.states[from as usize].gen == t.from_gen
            && self.states[t.to as usize].gen == t.to_gen
        {
            return t.to;
        }
        let to = self.form(from, change);
        let (from_gen, to_gen) = (self.states[from as usize].gen, self.states[to as usize].gen);
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
                self.states.len() as u32 - 1
            }
        };
        let s = &mut self.states[id as usize];
        s.set_holders(holders, in_l3);
        s.refs = 0;
        debug_assert_eq!(s.fp, fp);
        self.intern.entry(fp).or_insert(id);
        id
    }

    /// One position fewer has state `id`.
    fn release(&mut self, id: u32) {
        if id == EMPTY || id == DEAD {
            return;
        }
        let s = &mut self.states[id as usize];
        s.refs -= 1;
        if s.refs == 0 {
            if self.intern.get(&s.fp) == Some(&id) {
                self.intern.remove(&s.fp);
            }
            s.holders = Vec::new();
            s.in_l3 = false;
            s.gen = s.gen.wrapping_add(1);
            self.free_states.push(id);
        }
    }

    /// Drops the pending block from the index: nothing stored it back.
    fn finish_pending(&mut self) {
        if let Some((hash, loc)) = self.pending.take() {
            self.map.remove(&hash);
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
                self.map.get_mut(&seg.hashes[w]).expect("live positions are in the map").idx = w as u32;
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
        for id in 1..self.states.len() {
            let s = &mut self.states[id];
            if s.refs == 0 || !(s.holders.binary_search(&l1).is_ok() || s.holders.binary_search(&l2).is_ok()) {
                continue;
            }
            if self.intern.get(&s.fp) == Some(&(id as u32)) {
                self.intern.remove(&s.fp);
            }
            let mut holders = std::mem::take(&mut s.holders);
            holders.retain(|&h| h != l1 && h != l2);
            s.set_holders(holders, s.in_l3);
            s.gen = s.gen.wrapping_add(1);
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
            let seg = &self.segments[s];
            let mut killed = false;
            for idx in 0..seg.hashes.len() {
                let state = self.segments[s].states[idx];
                if state != DEAD && emptied[state as usize] {
                    let hash = self.segments[s].hashes[idx];
                    self.map.remove(&hash);
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
            let Some(&loc) = self.map.get(&hashes[j]) else { break };
            let seg = &self.segments[loc.seg as usize];
            let mut i = loc.idx as usize;
            loop {
                // The run: positions after `i` with the same state and the prompt's hashes.
                let state = seg.states[i];
                let max = (seg.hashes.len() - i).min(n - j);
                let (seg_hashes, seg_states, want) = (&seg.hashes[i..i + max], &seg.states[i..i + max], &hashes[j..j + max]);
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
                assert_eq!(self.map.get(&h), Some(&Loc { seg: s as u32, idx: idx as u32 }), "{h:?} not in the map");
                let pending = self.pending.is_some_and(|(p, _)| p == h);
                assert_eq!(state == EMPTY, pending, "{h:?}: only the pending block has the empty state");
                assert!(!self.states[state as usize].is_empty() || state == EMPTY, "{h:?}: a non-empty id holds nothing");
            }
            assert_eq!(seg.dead, dead, "segment {s} dead count");
        }
        assert_eq!(live, self.map.len(), "live positions and map entries");
        for (id, s) in self.states.iter().enumerate().skip(1) {
            assert_eq!(s.refs, refs[id], "state {id} reference count");
            assert!(s.holders.windows(2).all(|w| w[0] < w[1]), "state {id} holders sorted");
            let fp = s.holders.iter().fold(if s.in_l3 { L3_FP } else { 0 }, |fp, &h| fp.wrapping_add(holder_fp(h)));
            assert_eq!(s.fp, fp, "state {id} fingerprint");
        }
        for (&fp, &id) in &self.intern {
            assert!(self.states[id as usize].refs > 0, "interned state {id} is live");
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

/// The result of [`PrefixIndex::match_prefix`], reused across queries so that matching does
/// not allocate.
///
/// The walk visits runs of blocks with one holder set. A run in L3 keeps every live instance
/// alive; a run not in L3 keeps only its holders. Instead of touching every instance at every
/// run, each instance carries the number of non-L3 runs it survived, stamped with the query's
/// epoch; an instance never touched survived none, and its prefix is the L3-only one.
#[derive(Clone, Debug, Default)]
pub struct PrefixMatches {
    epoch: u32,
    slots: Vec<Slot>,
    /// Instances with an L1 or L2 block in their prefix, in the order the walk met them.
    touched: Vec<u32>,
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
        self.misses.clear();
        self.end = 0;
    }

    /// Walks a run of `len` blocks from position `at`, held as `state` says. Returns false
    /// when no instance's prefix goes past its start.
    fn visit(&mut self, state: &State, at: u32, len: u32) -> bool {
        let c = self.misses.len() as u32;
        let confirmed = if state.in_l3 { c } else { c + 1 };
        let epoch = self.epoch;
        let mut survived = false;
        if self.touched.is_empty() && !state.twice {
            // Nobody touched yet (so no run has been missed either): every holder is alive,
            // and its slot is stale.
            debug_assert_eq!(c, 0);
            self.touched.reserve(state.holders.len());
            for &h in &state.holders {
                // Arithmetic rather than an indexed store, which the slot's write would have
                // to wait for (a store-forwarding stall per holder).
                let l2 = h & 1;
                let blocks = [len * (1 - l2), len * l2];
                self.slots[(h >> 1) as usize] = Slot { epoch, confirmed, blocks };
                self.touched.push(h >> 1);
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
                    if c != 0 {
                        continue;
                    }
                    *slot = Slot { epoch, confirmed: 0, blocks: [0; 2] };
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

    /// Blocks of the prefix `instance` would find cached, by tier.
    pub fn get(&self, instance: InstanceId) -> TierMatch {
        let s = self.slots.get(instance.0 as usize).filter(|s| s.epoch == self.epoch).copied().unwrap_or_default();
        let depth = self.misses.get(s.confirmed as usize).copied().unwrap_or(self.end);
        let [l1, l2] = s.blocks;
        TierMatch { l1, l2, l3: depth - l1 - l2 }
    }

    /// The instances with at least one block of their prefix in L1 or L2, and their matches,
    /// in the order the walk met them (deterministic). Every other instance has
    /// [`PrefixMatches::shared`].
    pub fn iter(&self) -> impl Iterator<Item = (InstanceId, TierMatch)> + '_ {
        self.touched.iter().map(|&i| (InstanceId(i), self.get(InstanceId(i))))
    }

    /// The prefix every instance finds in the shared L3 store alone.
    pub fn shared(&self) -> TierMatch {
        TierMatch { l3: self.misses.first().copied().unwrap_or(self.end), ..TierMatch::default() }
    }
}
