//! A radix tree of cached KV blocks keyed by chained block hashes. A node is a *run* of
//! blocks that are always cached, shared and released together; its children are the runs
//! that followed it in some prompt.
//!
//! Because every request that holds a node also holds all of its ancestors (a prefix is only
//! usable whole), reference counts never increase towards the leaves, and the unreferenced
//! nodes form whole subtrees at the bottom of the tree: all of their blocks can be reclaimed,
//! leaf by leaf, which is why [`PrefixTree::unreferenced`] counts as free capacity.
//!
//! # Runs
//!
//! A prompt's blocks past the point where it diverges from every cached prompt form one run,
//! extended in place chunk after chunk while its request is its only holder. A request that
//! matches part of a run splits it in two (prefix, then the rest as its child), so that every
//! holder of a node holds all of it. Caching, matching, releasing and evicting a prompt's
//! private tail therefore visit one node, not one node per block: the blocks and hashes of a
//! run lie side by side in memory.
//!
//! # Eviction order
//!
//! Unreferenced nodes sit in an intrusive LRU list, appended when their last reference goes.
//! Releases walk a path from the deepest node up, and time never goes backwards, so a node is
//! always listed after all of its unreferenced descendants: the list is ordered by last use
//! and its head is always a leaf. Eviction takes the last block of the head's run.
//!
//! # Finding children
//!
//! Most nodes have at most one child, kept inline; only the children of branching nodes (and
//! of the root) go into the hash index, keyed by (parent, first hash of the child's run).
//!
//! | operation | cost |
//! | --- | --- |
//! | find a child | a look at the parent's only child, or one hash-map probe |
//! | match / hold / release a path | O(nodes on the path + blocks compared) |
//! | evict one block | O(1) |

use super::events::KvEvents;
use super::page_runs::PageRuns;
use super::store::PAGE_BLOCKS;
use super::tier::Tier;
use super::BlockPool;
use crate::ids::{BlockHash, BlockId};
use crate::time::Time;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Index of a node in the tree's slab. `NodeId::ROOT` is the empty prefix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub(crate) u32);

impl NodeId {
    pub const ROOT: NodeId = NodeId(0);
}

/// Longest run whose buffers a dead slot keeps for reuse.
const SPARE_RUN_CAPACITY: usize = 64;

/// End of the LRU list and "no child" (the root is never in the list nor anyone's child).
const NIL: u32 = 0;

#[derive(Clone, Debug, Default)]
struct Node {
    parent: NodeId,
    /// The run: hashes and physical blocks, in prompt order (empty only for the root and for
    /// dead slots, which keep their capacity for reuse).
    hashes: Vec<BlockHash>,
    blocks: Vec<BlockId>,
    /// Depth of the run's first block in its chain (the root's empty run is at 0).
    start: u32,
    /// The name of the page ([`PAGE_BLOCKS`]) the run's first block is in, when that page
    /// starts in an ancestor's run (else the run's own first hash).
    page_above: BlockHash,
    /// Requests whose block table includes this node.
    refs: u32,
    children: u32,
    last_access: Time,
    /// Neighbours in the LRU list while unreferenced (`NIL` at the ends).
    prev: u32,
    next: u32,
    /// The one child, when the node has exactly one and is not `branching`; else `NIL`.
    only_child: u32,
    /// The node's children are in the index (it has had two at once; the root always).
    branching: bool,
    alive: bool,
}

impl Node {
    /// Appends blocks to the run, with room for `room` blocks from its current end (the rest
    /// of the prompt: a run grown chunk by chunk would double up to it, a quarter of L1's runs
    /// spare on average).
    fn extend_run(&mut self, hashes: &[BlockHash], blocks: &[BlockId], room: usize) {
        self.hashes.reserve_exact(room);
        self.blocks.reserve_exact(room);
        self.hashes.extend_from_slice(hashes);
        self.blocks.extend_from_slice(blocks);
    }

    fn len(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// The name of the page of the block at depth `depth` of this run, or of the depth just
    /// after the run (not a page's first) for a child's [`Node::page_above`].
    fn page_of(&self, depth: u32) -> BlockHash {
        let first = depth / PAGE_BLOCKS as u32 * PAGE_BLOCKS as u32;
        if first >= self.start {
            self.hashes[(first - self.start) as usize]
        } else {
            self.page_above
        }
    }
}

/// Hasher of the index's (parent, hash) keys. Block hashes are already uniformly mixed, so
/// the parent is folded in with one multiply and nothing is hashed again.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u32(&mut self, v: u32) {
        self.0 ^= u64::from(v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }
}

#[derive(Clone, Debug)]
pub struct PrefixTree {
    /// Slot 0 is the root; dead slots are reused through `free_slots`.
    nodes: Vec<Node>,
    free_slots: Vec<u32>,
    /// Children of branching nodes, by (parent, first hash of the child's run).
    index: HashMap<(NodeId, BlockHash), NodeId, BuildHasherDefault<PassThrough>>,
    /// Cached blocks, and those of them no request holds.
    cached: u32,
    unreferenced: u32,
    /// Least recently released unreferenced node (evicted first), and the most recent.
    lru_head: u32,
    lru_tail: u32,
    events: Option<KvEvents>,
}

impl Default for PrefixTree {
    fn default() -> Self {
        PrefixTree::new()
    }
}

impl PrefixTree {
    pub fn new() -> PrefixTree {
        let root = Node { branching: true, alive: true, ..Node::default() };
        PrefixTree {
            nodes: vec![root],
            free_slots: Vec::new(),
            index: HashMap::default(),
            cached: 0,
            unreferenced: 0,
            lru_head: NIL,
            lru_tail: NIL,
            events: None,
        }
    }

    /// Starts recording [`super::KvEvent`]s; collect them with [`PrefixTree::drain_events`].
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(KvEvents::new);
    }

    /// Moves the recorded events into `out`: an empty `out` trades buffers with the tree
    /// (nothing copied; the tree records into `out`'s old buffer next).
    pub fn drain_events(&mut self, out: &mut KvEvents) {
        if let Some(ev) = &mut self.events {
            if out.is_empty() {
                std::mem::swap(out, ev);
            } else {
                out.append(ev);
            }
        }
    }

    /// The events recorded so far, for the other tiers' events to follow the tree's: one
    /// stream in the order things happened (all of L1's first, then the lower tiers', would
    /// make an index drop and re-add every block demoted); `None` when not recording.
    pub fn events_mut(&mut self) -> Option<&mut KvEvents> {
        self.events.as_mut()
    }

    /// Cached blocks.
    pub fn len(&self) -> u32 {
        self.cached
    }

    pub fn is_empty(&self) -> bool {
        self.cached == 0
    }

    /// Cached blocks no request holds: all of them can be evicted.
    pub fn unreferenced(&self) -> u32 {
        self.unreferenced
    }

    fn node(&self, n: NodeId) -> &Node {
        &self.nodes[n.0 as usize]
    }

    fn node_mut(&mut self, n: NodeId) -> &mut Node {
        &mut self.nodes[n.0 as usize]
    }

    /// The child of `parent` whose run starts with `hash`.
    fn child(&self, parent: NodeId, hash: BlockHash) -> Option<NodeId> {
        let p = self.node(parent);
        if p.branching {
            self.index.get(&(parent, hash)).copied()
        } else {
            (p.only_child != NIL && self.nodes[p.only_child as usize].hashes[0] == hash).then_some(NodeId(p.only_child))
        }
    }

    /// Follows `hashes` down from `cursor` (the end of a path the caller holds), taking a
    /// reference on every node it passes and appending their blocks to `table`. Stops where
    /// the cache stops matching. Returns the new cursor and the number of blocks matched.
    pub fn match_path(
        &mut self,
        now: Time,
        mut cursor: NodeId,
        hashes: &[BlockHash],
        table: &mut Vec<BlockId>,
    ) -> (NodeId, u32) {
        let mut i = 0;
        while i < hashes.len() {
            let Some(c) = self.child(cursor, hashes[i]) else { break };
            let c = self.take_common_prefix(c, &hashes[i..]);
            self.acquire(now, c);
            let node = self.node(c);
            table.extend_from_slice(&node.blocks);
            i += node.blocks.len();
            cursor = c;
        }
        (cursor, i as u32)
    }

    /// Splits `c` where its run stops agreeing with `hashes` (which agrees on the first
    /// block), so that the returned node's run is exactly the common prefix.
    fn take_common_prefix(&mut self, c: NodeId, hashes: &[BlockHash]) -> NodeId {
        let run = &self.node(c).hashes;
        let k = run.iter().zip(hashes).take_while(|(a, b)| a == b).count();
        if k < run.len() {
            self.split(c, k)
        } else {
            c
        }
    }

    /// Cuts the first `k` blocks of `c`'s run into a new node placed between `c` and its
    /// parent, and returns it. `c` keeps its id, its children, its holders (who now hold both
    /// parts) and its place in the LRU list, so nothing that points at it changes.
    fn split(&mut self, c: NodeId, k: usize) -> NodeId {
        debug_assert!(k > 0 && k < self.node(c).hashes.len());
        let (slot, mut prefix) = self.take_slot();
        let node = &mut self.nodes[c.0 as usize];
        prefix.hashes.clear();
        prefix.blocks.clear();
        prefix.hashes.extend(node.hashes.drain(..k));
        prefix.blocks.extend(node.blocks.drain(..k));
        if node.hashes.capacity() > 2 * node.hashes.len() + SPARE_RUN_CAPACITY {
            // The rest keeps the buffers of the whole run: give back the part cut off.
            node.hashes.shrink_to_fit();
            node.blocks.shrink_to_fit();
        }
        prefix.start = node.start;
        prefix.page_above = node.page_above;
        node.start += k as u32;
        node.page_above = match node.start % PAGE_BLOCKS as u32 {
            0 => node.hashes[0],
            _ => prefix.page_of(node.start),
        };
        prefix.parent = node.parent;
        prefix.refs = node.refs;
        prefix.children = 1;
        prefix.last_access = node.last_access;
        prefix.only_child = c.0;
        prefix.branching = false;
        prefix.alive = true;
        prefix.prev = NIL;
        prefix.next = NIL;
        let parent = node.parent;
        let first = prefix.hashes[0];
        let p = self.place(slot, prefix);
        self.node_mut(c).parent = p;
        // The prefix takes `c`'s place under the parent: same parent, same first hash.
        if self.node(parent).branching {
            self.index.insert((parent, first), p);
        } else {
            self.node_mut(parent).only_child = p.0;
        }
        if self.node(p).refs == 0 {
            self.insert_after(c.0, p.0);
        }
        p
    }

    /// A dead slot to reuse (with its node, whose run buffers keep their capacity), or none.
    fn take_slot(&mut self) -> (Option<u32>, Node) {
        let slot = self.free_slots.pop();
        let node = slot.map(|s| std::mem::take(&mut self.nodes[s as usize])).unwrap_or_default();
        (slot, node)
    }

    /// Puts `node` into the slot from [`PrefixTree::take_slot`], or a new one.
    fn place(&mut self, slot: Option<u32>, node: Node) -> NodeId {
        match slot {
            Some(s) => {
                self.nodes[s as usize] = node;
                NodeId(s)
            }
            None => {
                self.nodes.push(node);
                NodeId(self.nodes.len() as u32 - 1)
            }
        }
    }

    /// Takes a reference on `n`, whose parent the caller holds.
    fn acquire(&mut self, now: Time, n: NodeId) {
        debug_assert!(self.node(n).alive && n != NodeId::ROOT);
        if self.node(n).refs == 0 {
            self.unreferenced -= self.node(n).len();
            self.unlink(n.0);
        }
        let node = self.node_mut(n);
        node.refs += 1;
        node.last_access = now;
    }

    /// Caches the blocks a sequence has just filled. `hashes` and `blocks` are the blocks
    /// after `cursor` (the end of the path the sequence holds); `rest` more of its prompt may
    /// follow them in later chunks. Where another request cached the same blocks meanwhile,
    /// they are shared: the sequence's copies go back to `pool` and `blocks` is updated to the
    /// cached ones. Returns the new cursor and how many of the blocks were shared (the rest
    /// are newly cached).
    pub fn commit(
        &mut self,
        now: Time,
        mut cursor: NodeId,
        hashes: &[BlockHash],
        blocks: &mut [BlockId],
        rest: usize,
        pool: &mut BlockPool,
    ) -> (NodeId, usize) {
        debug_assert_eq!(hashes.len(), blocks.len());
        let mut i = 0;
        while i < hashes.len() {
            if let Some(c) = self.child(cursor, hashes[i]) {
                let c = self.take_common_prefix(c, &hashes[i..]);
                self.acquire(now, c);
                let cached = &self.nodes[c.0 as usize].blocks;
                for (mine, &theirs) in blocks[i..i + cached.len()].iter_mut().zip(cached) {
                    pool.push(*mine);
                    *mine = theirs;
                }
                i += cached.len();
                cursor = c;
                continue;
            }
            self.emit_stored(cursor, &hashes[i..]);
            let node = self.node(cursor);
            let own_leaf = cursor != NodeId::ROOT && node.refs == 1 && node.children == 0;
            let room = hashes.len() - i + rest;
            if own_leaf {
                // Only this sequence holds it and nothing follows it: grow the run in place.
                let node = self.node_mut(cursor);
                node.extend_run(&hashes[i..], &blocks[i..], room);
                node.last_access = now;
            } else {
                cursor = self.new_child(now, cursor, &hashes[i..], &blocks[i..], room);
            }
            self.cached += (hashes.len() - i) as u32;
            return (cursor, i);
        }
        (cursor, i)
    }

    fn emit_stored(&mut self, cursor: NodeId, hashes: &[BlockHash]) {
        let Some(ev) = &mut self.events else { return };
        let Some(&first) = hashes.first() else { return };
        let node = &self.nodes[cursor.0 as usize];
        let depth = node.start + node.len();
        let mut page = if depth.is_multiple_of(PAGE_BLOCKS as u32) { first } else { node.page_of(depth) };
        // A page's run at a time: up to the next page boundary, then a page each.
        let mut rest = hashes;
        let mut take = PAGE_BLOCKS - depth as usize % PAGE_BLOCKS;
        while !rest.is_empty() {
            let (run, tail) = rest.split_at(take.min(rest.len()));
            ev.stored_run(Tier::L1, page, run);
            rest = tail;
            take = PAGE_BLOCKS;
            if let Some(&next) = rest.first() {
                page = next;
            }
        }
    }

    /// A new run under `parent`, held by the caller, with room for `room` blocks.
    fn new_child(
        &mut self,
        now: Time,
        parent: NodeId,
        hashes: &[BlockHash],
        blocks: &[BlockId],
        room: usize,
    ) -> NodeId {
        let (slot, mut node) = self.take_slot();
        node.hashes.clear();
        node.blocks.clear();
        node.extend_run(hashes, blocks, room);
        let p = &self.nodes[parent.0 as usize];
        node.start = p.start + p.len();
        node.page_above = match node.start % PAGE_BLOCKS as u32 {
            0 => hashes[0],
            _ => p.page_of(node.start),
        };
        node.parent = parent;
        node.refs = 1;
        node.children = 0;
        node.last_access = now;
        node.prev = NIL;
        node.next = NIL;
        node.only_child = NIL;
        node.branching = false;
        node.alive = true;
        let id = self.place(slot, node);
        let first = hashes[0];
        let p = &mut self.nodes[parent.0 as usize];
        p.children += 1;
        if p.branching {
            self.index.insert((parent, first), id);
        } else if p.only_child == NIL {
            p.only_child = id.0;
        } else {
            // A second child: from now on this node's children live in the index.
            let other = p.only_child;
            p.only_child = NIL;
            p.branching = true;
            let other_first = self.nodes[other as usize].hashes[0];
            self.index.insert((parent, other_first), NodeId(other));
            self.index.insert((parent, first), id);
        }
        id
    }

    /// Blocks of the path ending at `deepest` that only one holder references: from `deepest`
    /// up while a node has one reference (the rest is shared, and stays in use when that
    /// holder lets go).
    pub fn sole_blocks(&self, deepest: NodeId) -> u32 {
        let mut n = deepest;
        let mut blocks = 0;
        while n != NodeId::ROOT && self.node(n).refs == 1 {
            blocks += self.node(n).len();
            n = self.node(n).parent;
        }
        blocks
    }

    /// Drops one reference on every node from `deepest` up to the root.
    pub fn release_path(&mut self, now: Time, deepest: NodeId) {
        let mut n = deepest;
        while n != NodeId::ROOT {
            let node = self.node_mut(n);
            debug_assert!(node.refs > 0, "releasing an unreferenced node");
            node.refs -= 1;
            node.last_access = now;
            let parent = node.parent;
            if node.refs == 0 {
                self.unreferenced += self.node(n).len();
                self.append(n.0);
            }
            n = parent;
        }
    }

    /// Evicts `n` blocks, each the last block of the least recently used unreferenced leaf
    /// (a leaf's blocks from its end, then the next leaf), appending each block to `blocks`
    /// and its hash to `keys`, a page's run at a time. The caller has counted `n` unreferenced
    /// blocks. The removals are not recorded: the caller publishes them with the demotion
    /// they cause.
    ///
    /// With `chunks` (`c` and a list), the evicted blocks that end an offload chunk of `c`
    /// blocks (at depths `k * c + c - 1`) are also listed there, in the same order: the keys a
    /// lower tier that keeps chunks stores (see [`super::KvCache::offload_chunks`]).
    pub fn evict(
        &mut self,
        mut n: u32,
        blocks: &mut Vec<BlockId>,
        keys: &mut PageRuns,
        mut chunks: Option<(u32, &mut PageRuns)>,
    ) {
        while n > 0 {
            let leaf = self.lru_head;
            assert!(leaf != NIL, "available blocks counted an unevictable node");
            let node = &mut self.nodes[leaf as usize];
            debug_assert!(node.refs == 0 && node.children == 0, "the LRU head is always an unreferenced leaf");
            let len = node.hashes.len();
            let kept = len - (n as usize).min(len);
            blocks.extend(node.blocks[kept..].iter().rev());
            // The keys a page at a time, from the run's end: a page's blocks share its name.
            let mut end = len;
            while end > kept {
                let depth = node.start + end as u32 - 1;
                let page_first = depth / PAGE_BLOCKS as u32 * PAGE_BLOCKS as u32;
                let from = kept.max(page_first.saturating_sub(node.start) as usize);
                let page = node.page_of(depth);
                keys.push_run(page, node.hashes[from..end].iter().rev().copied());
                if let Some((c, ends)) = chunks.as_mut() {
                    // The chunk ends among positions from..end, deepest first.
                    let (c, start) = (*c as usize, node.start as usize);
                    // One past each chunk end (a multiple of c), from the deepest down.
                    let tops = std::iter::successors(Some((start + end) / c * c), |&t| t.checked_sub(c));
                    let hashes = &node.hashes;
                    ends.push_run(page, tops.take_while(|&t| t > start + from).map(|t| hashes[t - 1 - start]));
                }
                end = from;
            }
            // The block taken last: the run's first when the leaf is emptied.
            let last = node.hashes[kept];
            node.blocks.truncate(kept);
            node.hashes.truncate(kept);
            let taken = (len - kept) as u32;
            self.unreferenced -= taken;
            self.cached -= taken;
            n -= taken;
            if kept == 0 {
                self.remove_leaf(leaf, last);
            }
        }
    }

    /// Takes an emptied leaf whose run started with `first` out of the tree.
    fn remove_leaf(&mut self, n: u32, first: BlockHash) {
        self.unlink(n);
        let node = &mut self.nodes[n as usize];
        node.alive = false;
        // A dead slot keeps a small run's buffers for the next node, but not a long run's:
        // otherwise every slot would come to hold the longest run it ever had.
        if node.blocks.capacity() > SPARE_RUN_CAPACITY {
            node.blocks = Vec::new();
            node.hashes = Vec::new();
        }
        let parent = node.parent;
        self.free_slots.push(n);
        let p = &mut self.nodes[parent.0 as usize];
        p.children -= 1;
        if p.branching {
            if p.children == 0 && parent != NodeId::ROOT {
                p.branching = false;
            }
            self.index.remove(&(parent, first));
        } else {
            p.only_child = NIL;
        }
    }

    fn append(&mut self, n: u32) {
        let tail = self.lru_tail;
        let node = &mut self.nodes[n as usize];
        node.prev = tail;
        node.next = NIL;
        if tail == NIL {
            self.lru_head = n;
        } else {
            self.nodes[tail as usize].next = n;
        }
        self.lru_tail = n;
    }

    /// Puts `n` right after `at` in the LRU list (a split prefix goes just after its child).
    fn insert_after(&mut self, at: u32, n: u32) {
        let next = self.nodes[at as usize].next;
        let node = &mut self.nodes[n as usize];
        node.prev = at;
        node.next = next;
        self.nodes[at as usize].next = n;
        if next == NIL {
            self.lru_tail = n;
        } else {
            self.nodes[next as usize].prev = n;
        }
    }

    fn unlink(&mut self, n: u32) {
        let (prev, next) = (self.nodes[n as usize].prev, self.nodes[n as usize].next);
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    /// Checks the tree's bookkeeping; panics with the broken rule.
    pub fn check_invariants(&self) {
        let mut children = vec![0u32; self.nodes.len()];
        let (mut cached, mut unreferenced, mut unreferenced_nodes, mut indexed) = (0, 0, 0, 0);
        for (i, node) in self.nodes.iter().enumerate().skip(1) {
            if !node.alive {
                continue;
            }
            assert!(!node.blocks.is_empty() && node.blocks.len() == node.hashes.len(), "node {i} has a bad run");
            cached += node.len();
            children[node.parent.0 as usize] += 1;
            if node.refs == 0 {
                unreferenced += node.len();
                unreferenced_nodes += 1;
            }
            let parent = &self.nodes[node.parent.0 as usize];
            assert!(parent.alive, "node {i} has a dead parent");
            assert_eq!(node.start, parent.start + parent.len(), "node {i} starts where its parent ends");
            let page = if node.start % PAGE_BLOCKS as u32 == 0 { node.hashes[0] } else { parent.page_of(node.start) };
            assert_eq!(node.page_above, page, "node {i} knows the page it starts in");
            assert!(
                node.parent == NodeId::ROOT || parent.refs >= node.refs,
                "node {i} holds more references ({}) than its parent ({})",
                node.refs,
                parent.refs
            );
            if parent.branching {
                let key = (node.parent, node.hashes[0]);
                assert_eq!(self.index.get(&key), Some(&NodeId(i as u32)), "node {i} not indexed");
                indexed += 1;
            } else {
                assert_eq!(parent.only_child, i as u32, "node {i} is not its parent's only child");
            }
        }
        for (i, node) in self.nodes.iter().enumerate() {
            if node.alive {
                assert_eq!(node.children, children[i], "child count of node {i}");
                assert!(node.branching || node.children <= 1, "node {i} has children outside the index");
            }
        }
        assert_eq!(self.index.len(), indexed, "index size");
        assert_eq!(self.cached, cached, "cached count");
        assert_eq!(self.unreferenced, unreferenced, "unreferenced count");
        // The LRU list holds exactly the unreferenced nodes, oldest first, each after all of
        // its unreferenced descendants.
        let (mut n, mut prev, mut listed, mut last) = (self.lru_head, NIL, 0, Time::ZERO);
        let mut seen = vec![false; self.nodes.len()];
        while n != NIL {
            let node = &self.nodes[n as usize];
            assert!(node.alive && node.refs == 0, "LRU node {n} is dead or referenced");
            assert_eq!(node.prev, prev, "LRU back link of node {n}");
            assert!(node.last_access >= last, "LRU list out of time order at node {n}");
            assert!(!seen[node.parent.0 as usize], "node {n} listed after its parent");
            seen[n as usize] = true;
            last = node.last_access;
            listed += 1;
            prev = n;
            n = node.next;
        }
        assert_eq!(self.lru_tail, prev, "LRU tail");
        assert_eq!(listed, unreferenced_nodes, "LRU list length");
    }
}
