//! A prefix tree of cached KV blocks, one node per full block, keyed by chained block hashes.
//!
//! A node is a block whose KV is kept for reuse. Its children are the blocks that followed it
//! in some prompt. Because every request that holds a node also holds all of its ancestors
//! (a prefix is only usable whole), reference counts never increase towards the leaves, and
//! the unreferenced nodes form whole subtrees at the bottom of the tree. Eviction therefore
//! takes the least recently used unreferenced *leaf*, and the parent of an evicted leaf may
//! become evictable in turn; every unreferenced node is reclaimable this way, which is why
//! [`PrefixTree::unreferenced`] counts as free capacity.
//!
//! | operation | cost |
//! | --- | --- |
//! | find a child | one hash-map probe |
//! | ref / unref a path of n blocks | O(n) |
//! | evict one leaf | O(log e), e = entries in the eviction heap |
//!
//! The eviction heap is lazy: an entry is checked when popped (node still alive, same
//! generation, unreferenced, childless, same access time) and dropped if stale.

use crate::ids::{BlockHash, BlockId};
use crate::time::Time;
use rustc_hash::FxHashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Index of a node in the tree's slab. `NodeId::ROOT` is the empty prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub(crate) u32);

impl NodeId {
    pub const ROOT: NodeId = NodeId(0);
}

#[derive(Clone, Debug)]
struct Node {
    hash: BlockHash,
    parent: NodeId,
    block: BlockId,
    /// Requests whose block table includes this node.
    refs: u32,
    children: u32,
    last_access: Time,
    /// Bumped when the slot is freed, so that stale heap entries are recognised.
    generation: u32,
    alive: bool,
}

/// A change to the set of cached blocks, in the shape of vLLM's KV events (stored with its
/// parent, removed), for whoever indexes this instance's cache from outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEvent {
    Stored { hash: BlockHash, parent: Option<BlockHash> },
    Removed { hash: BlockHash },
}

#[derive(Clone, Debug)]
pub struct PrefixTree {
    nodes: Vec<Node>,
    free_slots: Vec<u32>,
    children: FxHashMap<(NodeId, BlockHash), NodeId>,
    evictable: BinaryHeap<Reverse<(Time, NodeId, u32)>>,
    unreferenced: u32,
    events: Option<Vec<KvEvent>>,
}

impl Default for PrefixTree {
    fn default() -> Self {
        PrefixTree::new()
    }
}

impl PrefixTree {
    pub fn new() -> PrefixTree {
        let root = Node {
            hash: BlockHash::ROOT,
            parent: NodeId::ROOT,
            block: BlockId(u32::MAX),
            refs: 0,
            children: 0,
            last_access: Time::ZERO,
            generation: 0,
            alive: true,
        };
        PrefixTree {
            nodes: vec![root],
            free_slots: Vec::new(),
            children: FxHashMap::default(),
            evictable: BinaryHeap::new(),
            unreferenced: 0,
            events: None,
        }
    }

    /// Starts recording [`KvEvent`]s; collect them with [`PrefixTree::drain_events`].
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    pub fn drain_events(&mut self, out: &mut Vec<KvEvent>) {
        if let Some(ev) = &mut self.events {
            out.append(ev);
        }
    }

    /// Cached blocks (nodes other than the root).
    pub fn len(&self) -> u32 {
        self.children.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.children.is_empty()
    }

    /// Cached blocks no request holds: all of them can be evicted.
    pub fn unreferenced(&self) -> u32 {
        self.unreferenced
    }

    pub fn child(&self, parent: NodeId, hash: BlockHash) -> Option<NodeId> {
        self.children.get(&(parent, hash)).copied()
    }

    pub fn block(&self, n: NodeId) -> BlockId {
        self.nodes[n.0 as usize].block
    }

    /// Takes a reference on `n` (which must be a child of a node the caller already holds).
    pub fn acquire(&mut self, now: Time, n: NodeId) {
        let node = &mut self.nodes[n.0 as usize];
        debug_assert!(node.alive && n != NodeId::ROOT);
        if node.refs == 0 {
            self.unreferenced -= 1;
        }
        node.refs += 1;
        node.last_access = now;
    }

    /// Adds `block` as the child of `parent` with content `hash`, held by the caller.
    /// The caller checked that no such child exists.
    pub fn insert(&mut self, now: Time, parent: NodeId, hash: BlockHash, block: BlockId) -> NodeId {
        debug_assert!(self.child(parent, hash).is_none());
        let node = Node { hash, parent, block, refs: 1, children: 0, last_access: now, generation: 0, alive: true };
        let id = match self.free_slots.pop() {
            Some(slot) => {
                let generation = self.nodes[slot as usize].generation;
                self.nodes[slot as usize] = Node { generation, ..node };
                NodeId(slot)
            }
            None => {
                self.nodes.push(node);
                NodeId(self.nodes.len() as u32 - 1)
            }
        };
        self.nodes[parent.0 as usize].children += 1;
        self.children.insert((parent, hash), id);
        if let Some(ev) = &mut self.events {
            let parent_hash = (parent != NodeId::ROOT).then(|| self.nodes[parent.0 as usize].hash);
            ev.push(KvEvent::Stored { hash, parent: parent_hash });
        }
        id
    }

    /// Drops one reference on every node from `deepest` up to the root.
    pub fn release_path(&mut self, now: Time, deepest: NodeId) {
        let mut n = deepest;
        while n != NodeId::ROOT {
            let node = &mut self.nodes[n.0 as usize];
            debug_assert!(node.refs > 0, "releasing an unreferenced node");
            node.refs -= 1;
            node.last_access = now;
            let parent = node.parent;
            if node.refs == 0 {
                self.unreferenced += 1;
                if node.children == 0 {
                    let generation = node.generation;
                    self.evictable.push(Reverse((now, n, generation)));
                }
            }
            n = parent;
        }
    }

    /// Evicts the least recently used unreferenced leaf and returns its block.
    pub fn evict_one(&mut self) -> Option<BlockId> {
        while let Some(Reverse((t, n, generation))) = self.evictable.pop() {
            let node = &self.nodes[n.0 as usize];
            let valid = node.alive
                && node.generation == generation
                && node.refs == 0
                && node.children == 0
                && node.last_access == t;
            if !valid {
                continue;
            }
            let (hash, parent, block) = (node.hash, node.parent, node.block);
            self.children.remove(&(parent, hash));
            let node = &mut self.nodes[n.0 as usize];
            node.alive = false;
            node.generation = node.generation.wrapping_add(1);
            self.free_slots.push(n.0);
            self.unreferenced -= 1;
            if let Some(ev) = &mut self.events {
                ev.push(KvEvent::Removed { hash });
            }
            let p = &mut self.nodes[parent.0 as usize];
            p.children -= 1;
            if parent != NodeId::ROOT && p.children == 0 && p.refs == 0 {
                self.evictable.push(Reverse((p.last_access, parent, p.generation)));
            }
            self.compact_heap_if_stale();
            return Some(block);
        }
        None
    }

    /// Rebuilds the heap when stale entries dominate, so that it stays bounded by the tree.
    fn compact_heap_if_stale(&mut self) {
        if self.evictable.len() > 4 * (self.nodes.len() + 16) {
            let nodes = &self.nodes;
            self.evictable.retain(|Reverse((t, n, g))| {
                let node = &nodes[n.0 as usize];
                node.alive && node.generation == *g && node.refs == 0 && node.children == 0 && node.last_access == *t
            });
        }
    }

    /// Checks the tree's bookkeeping; panics with the broken rule.
    pub fn check_invariants(&self) {
        let mut children = vec![0u32; self.nodes.len()];
        let mut unreferenced = 0;
        let mut alive = 0;
        for (i, node) in self.nodes.iter().enumerate().skip(1) {
            if !node.alive {
                continue;
            }
            alive += 1;
            children[node.parent.0 as usize] += 1;
            if node.refs == 0 {
                unreferenced += 1;
            }
            let parent = &self.nodes[node.parent.0 as usize];
            assert!(parent.alive, "node {i} has a dead parent");
            assert!(
                node.parent == NodeId::ROOT || parent.refs >= node.refs,
                "node {i} holds more references ({}) than its parent ({})",
                node.refs,
                parent.refs
            );
            assert_eq!(self.children.get(&(node.parent, node.hash)), Some(&NodeId(i as u32)), "node {i} not indexed");
        }
        for (i, node) in self.nodes.iter().enumerate() {
            if node.alive {
                assert_eq!(node.children, children[i], "child count of node {i}");
            }
        }
        assert_eq!(self.children.len(), alive, "index size");
        assert_eq!(self.unreferenced, unreferenced, "unreferenced count");
    }
}
