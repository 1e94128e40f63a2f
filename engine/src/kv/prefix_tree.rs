//! A prefix tree of cached KV blocks, one node per full block, keyed by chained block hashes.
//!
//! A node is a block whose KV is kept for reuse. Its children are the blocks that followed it
//! in some prompt. Because every request that holds a node also holds all of its ancestors
//! (a prefix is only usable whole), reference counts never increase towards the leaves, and
//! the unreferenced nodes form whole subtrees at the bottom of the tree: all of them can be
//! reclaimed, leaf by leaf, which is why [`PrefixTree::unreferenced`] counts as free capacity.
//!
//! # Eviction order
//!
//! Unreferenced nodes sit in an intrusive LRU list, appended when their last reference goes.
//! Releases walk a path from the deepest node up, and time never goes backwards, so a node is
//! always appended after all of its unreferenced descendants: the list is ordered by last use
//! and its head is always a leaf. Eviction takes the head, the least recently used
//! unreferenced leaf, in O(1), touching only nodes it must touch anyway (no heap, no scan).
//!
//! # Finding children
//!
//! Most nodes have one child (a prompt's blocks form a chain until it diverges from others),
//! so a node keeps its only child inline, and only the children of branching nodes (and of
//! the root) go into the hash index, keyed by (parent, hash). Caching, matching and evicting
//! a chain therefore touch the nodes alone; the index is probed once per branch point.
//!
//! | operation | cost |
//! | --- | --- |
//! | find a child | a look at the parent's only child, or one hash-map probe |
//! | ref / unref a path of n blocks | O(n) |
//! | evict one leaf | O(1) |

use crate::ids::{BlockHash, BlockId};
use crate::time::Time;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Index of a node in the tree's slab. `NodeId::ROOT` is the empty prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub(crate) u32);

impl NodeId {
    pub const ROOT: NodeId = NodeId(0);
}

/// End of the LRU list (the root is never in it, so its index can mark "none").
const NIL: u32 = 0;

#[derive(Clone, Debug)]
struct Node {
    hash: BlockHash,
    parent: NodeId,
    block: BlockId,
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

/// A change to the set of cached blocks, in the shape of vLLM's KV events (stored with its
/// parent, removed), for whoever indexes this instance's cache from outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEvent {
    Stored { hash: BlockHash, parent: Option<BlockHash> },
    Removed { hash: BlockHash },
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
    /// Children of branching nodes, by (parent, hash).
    index: HashMap<(NodeId, BlockHash), NodeId, BuildHasherDefault<PassThrough>>,
    /// Cached blocks (live nodes other than the root).
    cached: u32,
    /// Least recently released unreferenced node (evicted first), and the most recent.
    lru_head: u32,
    lru_tail: u32,
    unreferenced: u32,
    events: Option<Vec<KvEvent>>,
}

impl Default for PrefixTree {
    fn default() -> Self {
        PrefixTree::with_capacity(0)
    }
}

impl PrefixTree {
    /// A tree for at most `blocks` cached blocks.
    pub fn with_capacity(blocks: u32) -> PrefixTree {
        let root = Node {
            hash: BlockHash::ROOT,
            parent: NodeId::ROOT,
            block: BlockId(u32::MAX),
            refs: 0,
            children: 0,
            last_access: Time::ZERO,
            prev: NIL,
            next: NIL,
            only_child: NIL,
            branching: true,
            alive: true,
        };
        let mut nodes = Vec::with_capacity(blocks as usize + 1);
        nodes.push(root);
        PrefixTree {
            nodes,
            free_slots: Vec::new(),
            index: HashMap::default(),
            cached: 0,
            lru_head: NIL,
            lru_tail: NIL,
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
        self.cached
    }

    pub fn is_empty(&self) -> bool {
        self.cached == 0
    }

    /// Cached blocks no request holds: all of them can be evicted.
    pub fn unreferenced(&self) -> u32 {
        self.unreferenced
    }

    pub fn child(&self, parent: NodeId, hash: BlockHash) -> Option<NodeId> {
        let p = &self.nodes[parent.0 as usize];
        if p.branching {
            self.index.get(&(parent, hash)).copied()
        } else {
            (p.only_child != NIL && self.nodes[p.only_child as usize].hash == hash).then_some(NodeId(p.only_child))
        }
    }

    pub fn block(&self, n: NodeId) -> BlockId {
        self.nodes[n.0 as usize].block
    }

    /// Takes a reference on `n` (a child of a node the caller already holds).
    pub fn acquire(&mut self, now: Time, n: NodeId) {
        debug_assert!(self.nodes[n.0 as usize].alive && n != NodeId::ROOT);
        if self.nodes[n.0 as usize].refs == 0 {
            self.unreferenced -= 1;
            self.unlink(n.0);
        }
        let node = &mut self.nodes[n.0 as usize];
        node.refs += 1;
        node.last_access = now;
    }

    /// The child of `parent` with content `hash`, referenced for the caller: the cached one
    /// if there is one (then `block` is not used; returns true), else `block` itself, inserted
    /// (returns false). One index probe either way.
    pub fn share_or_insert(&mut self, now: Time, parent: NodeId, hash: BlockHash, block: BlockId) -> (NodeId, bool) {
        if let Some(existing) = self.child(parent, hash) {
            self.acquire(now, existing);
            return (existing, true);
        }
        let node = Node {
            hash,
            parent,
            block,
            refs: 1,
            children: 0,
            last_access: now,
            prev: NIL,
            next: NIL,
            only_child: NIL,
            branching: false,
            alive: true,
        };
        let id = match self.free_slots.pop() {
            Some(slot) => {
                self.nodes[slot as usize] = node;
                NodeId(slot)
            }
            None => {
                self.nodes.push(node);
                NodeId(self.nodes.len() as u32 - 1)
            }
        };
        self.cached += 1;
        let p = &mut self.nodes[parent.0 as usize];
        p.children += 1;
        if p.branching {
            self.index.insert((parent, hash), id);
        } else if p.only_child == NIL {
            p.only_child = id.0;
        } else {
            // A second child: from now on this node's children live in the index.
            let first = p.only_child;
            p.only_child = NIL;
            p.branching = true;
            let first_hash = self.nodes[first as usize].hash;
            self.index.insert((parent, first_hash), NodeId(first));
            self.index.insert((parent, hash), id);
        }
        if let Some(ev) = &mut self.events {
            let parent_hash = (parent != NodeId::ROOT).then(|| self.nodes[parent.0 as usize].hash);
            ev.push(KvEvent::Stored { hash, parent: parent_hash });
        }
        (id, false)
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
                self.append(n.0);
            }
            n = parent;
        }
    }

    /// Evicts the least recently used unreferenced leaf and returns its block.
    pub fn evict_one(&mut self) -> Option<BlockId> {
        let n = self.lru_head;
        if n == NIL {
            return None;
        }
        self.unlink(n);
        let node = &mut self.nodes[n as usize];
        debug_assert!(node.refs == 0 && node.children == 0, "the LRU head is always an unreferenced leaf");
        node.alive = false;
        let (hash, parent, block) = (node.hash, node.parent, node.block);
        self.free_slots.push(n);
        self.unreferenced -= 1;
        self.cached -= 1;
        let p = &mut self.nodes[parent.0 as usize];
        p.children -= 1;
        if p.branching {
            self.index.remove(&(parent, hash));
            if p.children == 0 && parent != NodeId::ROOT {
                p.branching = false;
            }
        } else {
            p.only_child = NIL;
        }
        if let Some(ev) = &mut self.events {
            ev.push(KvEvent::Removed { hash });
        }
        Some(block)
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

    fn unlink(&mut self, n: u32) {
        let Node { prev, next, .. } = self.nodes[n as usize];
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
        let mut unreferenced = 0;
        let mut alive = 0;
        let mut indexed = 0;
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
            if parent.branching {
                assert_eq!(self.index.get(&(node.parent, node.hash)), Some(&NodeId(i as u32)), "node {i} not indexed");
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
        assert_eq!(self.cached, alive, "cached count");
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
        assert_eq!(listed, unreferenced, "LRU list length");
    }
}
