//! `sglang-cache-aware`: the SGLang router's cache-aware policy, as a named baseline.
//!
//! # Rule
//!
//! Load is the number of requests in flight on an instance (routed by us and not finished,
//! [`InstanceView::in_flight`]), taken over the candidates. For each request:
//!
//! 1. If the fleet is imbalanced, `max − min > 64` **and** `max > 1.5 × min`, send it to the
//!    least loaded instance.
//! 2. Otherwise find the longest prefix of the request that the router remembers sending to
//!    some candidate. If `matched blocks / request blocks > 0.3`, send it to that instance.
//! 3. Otherwise send it to the least loaded instance.
//!
//! Whatever the branch, the request's blocks are then remembered for the chosen instance.
//! Ties go to the lowest id.
//!
//! # Where it comes from
//!
//! sgl-project/sglang, `sgl-router/src/policies/cache_aware.rs` (since moved to
//! `sgl-model-gateway/src/policies/cache_aware.rs`), whose header states the rule, and the
//! router's launch defaults (`--cache-threshold 0.3 --balance-abs-threshold 64
//! --balance-rel-threshold 1.5 --max-tree-size 67108864`; the library's own
//! `CacheAwareConfig::default` is 0.5 / 32 / 1.1, but the launcher and the CLI use these).
//! The load SGLang compares is `Worker::load()`, the gateway's own count of requests it sent
//! and that have not completed: our `in_flight`.
//!
//! Branch 3 changed over time: the original `sgl-router` sent a low match to the worker with
//! the *smallest approximate tree* (`get_smallest_tenant`, "most available cache capacity");
//! the current gateway sends it to the *least loaded* healthy worker. We follow the current
//! rule.
//!
//! # The approximate tree
//!
//! SGLang never hears from the workers' caches: it keeps one radix tree of the text it routed,
//! each node listing the workers ("tenants") it was sent to with a last-access time, and
//! evicts a worker's least recently used leaves once its share passes `max_tree_size`
//! characters. `ApproxTree` is the same tree over block hashes: each routed request's chain
//! is inserted for the chosen instance, and each instance keeps at most `max_tree_tokens` worth of
//! blocks, evicting its least recently used nodes, leaves first (a path is touched from its
//! leaf up, so a node is always less recent than its ancestors). What an instance remembers
//! is therefore always closed under prefixes, as in SGLang.
//!
//! # Adaptations
//!
//! - **Blocks, not characters.** Matching is over the request's chained block hashes, and the
//!   match rate is `matched blocks / request blocks`, where request blocks count the whole
//!   prompt (`ceil(prompt_tokens / block_size)`), so a partial last block or an unhashed tail
//!   counts as unmatched, as the unmatched text does in SGLang.
//! - **Tree size.** `max_tree_tokens` defaults to 2^20 tokens' worth of blocks (65,536 blocks
//!   of 16 tokens). SGLang's 2^26 characters are about 2^24 tokens at ~4 characters a token,
//!   far more than one GPU caches (Llama-3.1-8B on an H100 holds ~450k tokens); it evicts
//!   only every 120 s, so in practice it remembers prefixes the worker has long dropped. We
//!   keep that property (the default remembers ~2× the default instance's GPU cache) at 1/16
//!   of the size, which bounds the tree at 8 bytes × 65,536 blocks per instance (32 MB for 64
//!   instances) however long the trace. Eviction is immediate instead of on a 120 s
//!   background timer (a timer thread cannot run in virtual time).
//! - **One instance per match.** SGLang's tree returns one tenant of the deepest matched
//!   node, in its map's order: in effect a fixed one (SGLang PR 6164 added round-robin tie
//!   breaking because of it). We take the lowest id among the candidates that remember the
//!   deepest matched node.
//! - **Candidates.** SGLang takes min and max load over all workers, healthy or not, and may
//!   pick a tenant that is unhealthy (then falls back to the first healthy worker). Here
//!   loads, matches and picks are over the candidates only ([`FleetView::candidates`]:
//!   serving instances that can hold the request, without those that paused admission unless
//!   all did).
//! - **Instances that go down** are forgotten, as SGLang's `remove_worker` removes a tenant.
//!
//! # Cost
//!
//! Chained hashes name their prefix, so a node is found by its first hash in one map: a match
//! or an insertion costs one lookup per node on the request's path plus an in-place
//! comparison of its hashes, whatever the fleet size (about 2 µs for 400-block prompts over
//! 64 instances).

use super::{CostHints, Pick, Router, RouterFactory, Why};
use crate::event::FleetEvent;
use crate::view::{FleetView, InstanceView};
use engine::slots;
use engine::{BlockHash, InstanceId, Request};
use rustc_hash::FxHashMap;

/// Which branch of the rule decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SglangBranch {
    /// `max − min > abs` and `max > rel × min` in-flight requests: least loaded.
    Imbalanced,
    /// Balanced, and the longest remembered match is above the threshold: that instance.
    CacheHit,
    /// Balanced, and the match is at or below the threshold: least loaded.
    CacheMiss,
}

/// SGLang's thresholds and tree size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SglangCacheAwareConfig {
    /// Match rate above which the request follows its longest match (`--cache-threshold`).
    pub cache_threshold: f64,
    /// In-flight spread above which the fleet may be imbalanced (`--balance-abs-threshold`).
    pub balance_abs_threshold: u32,
    /// Ratio of max to min in-flight above which the fleet may be imbalanced
    /// (`--balance-rel-threshold`).
    pub balance_rel_threshold: f64,
    /// Tokens' worth of blocks each instance's approximate tree keeps (the analogue of
    /// `--max-tree-size`).
    pub max_tree_tokens: u32,
}

impl SglangCacheAwareConfig {
    /// Tokens' worth of blocks an instance's tree keeps by default (see the module doc).
    pub const DEFAULT_TREE_TOKENS: u32 = 1 << 20;

    /// Blocks each instance's tree keeps at `block_size`.
    fn max_tree_blocks(&self, block_size: u32) -> u32 {
        (self.max_tree_tokens / block_size.max(1)).max(1)
    }
}

impl Default for SglangCacheAwareConfig {
    /// SGLang's launch defaults, with a tree of [`Self::DEFAULT_TREE_TOKENS`].
    fn default() -> Self {
        SglangCacheAwareConfig {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            max_tree_tokens: Self::DEFAULT_TREE_TOKENS,
        }
    }
}

crate::params!(SglangCacheAwareConfig, "sglang-cache-aware", {
    cache_threshold: float from 0.0 ..= 1.0, "match rate above which a request follows its longest remembered match";
    balance_abs_threshold: integer from 0 ..= 65_536, "in-flight spread above which the fleet may be imbalanced";
    balance_rel_threshold: float from 1.0 ..= 64.0, "max over min in-flight ratio above which the fleet may be imbalanced";
    max_tree_tokens: integer from 1 ..= 1_073_741_824, "tokens' worth of blocks each instance's approximate tree keeps";
});

impl RouterFactory for SglangCacheAwareConfig {
    fn build(&self, _seed: u64, hints: &CostHints) -> Box<dyn Router> {
        Box::new(SglangCacheAware::new(*self, hints.block_size))
    }
}

#[derive(Debug)]
pub struct SglangCacheAware {
    config: SglangCacheAwareConfig,
    /// Tokens per block, to count a request's blocks from its prompt.
    block_size: u32,
    tree: ApproxTree,
    /// Whether each instance (by id) is a candidate for the request being routed; kept to
    /// avoid allocating per request.
    candidate: Vec<bool>,
}

impl SglangCacheAware {
    pub fn new(config: SglangCacheAwareConfig, block_size: u32) -> SglangCacheAware {
        assert!(block_size > 0, "block size must be positive");
        SglangCacheAware { config, block_size, tree: ApproxTree::new(config.max_tree_blocks(block_size)), candidate: Vec::new() }
    }
}

impl Router for SglangCacheAware {
    fn name(&self) -> &'static str {
        "sglang-cache-aware"
    }

    fn pick(&mut self, request: &Request, fleet: &FleetView) -> Option<Pick> {
        self.candidate.clear();
        self.candidate.resize(fleet.all().len(), false);
        let (mut min, mut max) = (u32::MAX, 0);
        let mut least: Option<&InstanceView> = None;
        for v in fleet.candidates(request) {
            self.candidate[v.id.0 as usize] = true;
            min = min.min(v.in_flight);
            max = max.max(v.in_flight);
            if least.is_none_or(|l| v.in_flight < l.in_flight) {
                least = Some(v);
            }
        }
        let least = least?.id;

        let hashes = &request.block_hashes;
        let request_blocks = request.prompt_tokens.div_ceil(self.block_size).max(hashes.len() as u32);
        let candidate = &self.candidate;
        let (matched_blocks, holder) = self.tree.longest_match(hashes, |i| candidate.get(i as usize) == Some(&true));

        let c = &self.config;
        let imbalanced =
            max - min > c.balance_abs_threshold && f64::from(max) > f64::from(min) * c.balance_rel_threshold;
        let rate = if request_blocks == 0 { 0.0 } else { f64::from(matched_blocks) / f64::from(request_blocks) };
        let (branch, instance) = match holder {
            _ if imbalanced => (SglangBranch::Imbalanced, least),
            Some(holder) if rate > c.cache_threshold => (SglangBranch::CacheHit, holder),
            _ => (SglangBranch::CacheMiss, least),
        };
        self.tree.insert(instance, hashes);
        Some(Pick {
            instance,
            why: Why::SglangCacheAware {
                branch,
                matched_blocks,
                request_blocks,
                in_flight_min: min,
                in_flight_max: max,
            },
        })
    }

    fn on_event(&mut self, event: &FleetEvent) {
        if let FleetEvent::InstanceDown { instance } = *event {
            self.tree.remove_instance(instance);
        }
    }
}

/// End of a list, or no node.
const NIL: u32 = u32::MAX;

/// A run of blocks that every instance remembering any of it remembers whole: a node of the
/// radix tree. Its first hash names it in [`ApproxTree::by_first`].
#[derive(Clone, Debug, Default)]
struct Node {
    run: Vec<BlockHash>,
    /// The node whose run precedes this one; `NIL` under the root.
    parent: u32,
    /// Child nodes (a node is removed only once it has none).
    children: u32,
    /// The instances that remember this node, as ids into [`ApproxTree::members`].
    members: Vec<u32>,
}

/// One instance remembering one node, linked into that instance's recency list.
#[derive(Clone, Copy, Debug)]
struct Member {
    node: u32,
    instance: u32,
    prev: u32,
    next: u32,
}

/// An instance's memberships from least to most recently used, and the blocks they hold.
#[derive(Clone, Copy, Debug)]
struct Tenant {
    head: u32,
    tail: u32,
    blocks: u64,
}

impl Default for Tenant {
    fn default() -> Self {
        Tenant { head: NIL, tail: NIL, blocks: 0 }
    }
}

/// What the router remembers sending where: a radix tree over block hashes whose nodes list
/// the instances that were sent them (SGLang's multi-tenant tree), with a per-instance LRU
/// list of nodes and a cap on each instance's blocks.
///
/// Chained hashes name their whole prefix, so a node is found by its first hash alone: the
/// walk of a request looks up one hash per node and compares the rest of the run in place.
///
/// **Invariant:** in each instance's list, a node comes before (is less recent than) every
/// ancestor of it that the instance remembers, so the list's head is a leaf for that instance
/// and evicting from the head keeps what an instance remembers closed under prefixes.
#[derive(Clone, Debug)]
struct ApproxTree {
    by_first: FxHashMap<BlockHash, u32>,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    members: Vec<Member>,
    free_members: Vec<u32>,
    /// Indexed by instance id.
    tenants: Vec<Tenant>,
    /// Blocks each instance may remember.
    capacity: u64,
    /// Nodes of the current insertion's path, root first (kept to avoid allocating).
    path: Vec<u32>,
}

impl ApproxTree {
    fn new(capacity: u32) -> ApproxTree {
        ApproxTree {
            by_first: FxHashMap::default(),
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            members: Vec::new(),
            free_members: Vec::new(),
            tenants: Vec::new(),
            capacity: u64::from(capacity),
            path: Vec::new(),
        }
    }

    /// The longest prefix of `hashes` remembered for some instance that `eligible` accepts, in
    /// blocks, and the lowest such instance remembering all of it (`None` when nothing matched).
    fn longest_match(&self, hashes: &[BlockHash], eligible: impl Fn(u32) -> bool) -> (u32, Option<InstanceId>) {
        let (mut j, mut holder) = (0, None);
        while let Some(&n) = hashes.get(j).and_then(|h| self.by_first.get(h)) {
            let node = &self.nodes[n as usize];
            // Instances remembering a node remember its ancestors: none below if none here.
            let Some(lowest) =
                node.members.iter().map(|&m| self.members[m as usize].instance).filter(|&i| eligible(i)).min()
            else {
                break;
            };
            let k = common_len(&node.run, &hashes[j..]);
            (j, holder) = (j + k, Some(InstanceId(lowest)));
            if k < node.run.len() {
                break;
            }
        }
        (j as u32, holder)
    }

    /// Remembers `hashes` (a request's chain) for `instance` as its most recent blocks, then
    /// forgets its least recently used nodes until it is within capacity.
    fn insert(&mut self, instance: InstanceId, hashes: &[BlockHash]) {
        let i = instance.0;
        if self.tenants.len() <= i as usize {
            self.tenants.resize(i as usize + 1, Tenant::default());
        }
        let mut path = std::mem::take(&mut self.path);
        path.clear();
        let (mut j, mut parent) = (0, NIL);
        while j < hashes.len() {
            let Some(&n) = self.by_first.get(&hashes[j]) else {
                path.push(self.new_node(hashes[j..].to_vec(), parent));
                break;
            };
            let k = common_len(&self.nodes[n as usize].run, &hashes[j..]);
            let n = if k < self.nodes[n as usize].run.len() { self.split(n, k) } else { n };
            path.push(n);
            (j, parent) = (j + k, n);
        }
        // Deepest first, so that each node ends up less recent than its ancestors.
        for &n in path.iter().rev() {
            self.touch(i, n);
        }
        self.path = path;
        while self.tenants[i as usize].blocks > self.capacity {
            let head = self.tenants[i as usize].head;
            self.drop_member(head);
        }
    }

    /// Forgets everything `instance` was sent.
    fn remove_instance(&mut self, instance: InstanceId) {
        let Some(&tenant) = self.tenants.get(instance.0 as usize) else { return };
        let mut m = tenant.head;
        while m != NIL {
            let next = self.members[m as usize].next;
            self.drop_member(m);
            m = next;
        }
    }

    fn new_node(&mut self, run: Vec<BlockHash>, parent: u32) -> u32 {
        let first = run[0];
        let node = Node { run, parent, children: 0, members: Vec::new() };
        let n = slots::place(&mut self.nodes, &mut self.free_nodes, node);
        if parent != NIL {
            self.nodes[parent as usize].children += 1;
        }
        self.by_first.insert(first, n);
        n
    }

    /// Cuts node `n` after its first `k` blocks; returns the new upper node. Every instance
    /// remembering `n` remembers both halves, the upper one just after the lower one in its
    /// list (as recent as possible without passing an ancestor).
    fn split(&mut self, n: u32, k: usize) -> u32 {
        let node = &mut self.nodes[n as usize];
        let upper_run: Vec<BlockHash> = node.run.drain(..k).collect();
        let (grandparent, lower_first) = (node.parent, node.run[0]);
        let upper = self.new_node(upper_run, grandparent);
        if grandparent != NIL {
            // `n` moved under `upper`: the grandparent's count of children is unchanged.
            self.nodes[grandparent as usize].children -= 1;
        }
        self.nodes[upper as usize].children = 1;
        self.nodes[n as usize].parent = upper;
        self.by_first.insert(lower_first, n);
        for idx in 0..self.nodes[n as usize].members.len() {
            let m = self.nodes[n as usize].members[idx];
            let instance = self.members[m as usize].instance;
            let u = self.new_member(upper, instance);
            self.link_after(instance, m, u);
        }
        upper
    }

    /// Makes node `n` the most recent of `instance`'s nodes, joining it if needed.
    fn touch(&mut self, instance: u32, n: u32) {
        let found =
            self.nodes[n as usize].members.iter().copied().find(|&m| self.members[m as usize].instance == instance);
        let m = match found {
            Some(m) => {
                self.unlink(m);
                m
            }
            None => {
                let m = self.new_member(n, instance);
                self.tenants[instance as usize].blocks += self.nodes[n as usize].run.len() as u64;
                m
            }
        };
        let tail = self.tenants[instance as usize].tail;
        self.link_after(instance, tail, m);
    }

    fn new_member(&mut self, node: u32, instance: u32) -> u32 {
        let member = Member { node, instance, prev: NIL, next: NIL };
        let m = slots::place(&mut self.members, &mut self.free_members, member);
        self.nodes[node as usize].members.push(m);
        m
    }

    /// Links `m` into `instance`'s list right after `at` (`NIL`: at the head).
    fn link_after(&mut self, instance: u32, at: u32, m: u32) {
        let t = &mut self.tenants[instance as usize];
        let next = if at == NIL { t.head } else { self.members[at as usize].next };
        match at {
            NIL => t.head = m,
            a => self.members[a as usize].next = m,
        }
        match next {
            NIL => t.tail = m,
            x => self.members[x as usize].prev = m,
        }
        let member = &mut self.members[m as usize];
        (member.prev, member.next) = (at, next);
    }

    fn unlink(&mut self, m: u32) {
        let Member { instance, prev, next, .. } = self.members[m as usize];
        let t = &mut self.tenants[instance as usize];
        match prev {
            NIL => t.head = next,
            p => self.members[p as usize].next = next,
        }
        match next {
            NIL => t.tail = prev,
            x => self.members[x as usize].prev = prev,
        }
    }

    /// Forgets membership `m`, and its node once no instance remembers it (it then has no
    /// children: theirs would be remembered by a subset of its instances).
    fn drop_member(&mut self, m: u32) {
        self.unlink(m);
        let Member { node: n, instance, .. } = self.members[m as usize];
        self.free_members.push(m);
        let node = &mut self.nodes[n as usize];
        node.members.retain(|&x| x != m);
        self.tenants[instance as usize].blocks -= node.run.len() as u64;
        if node.members.is_empty() {
            debug_assert_eq!(node.children, 0, "a node without instances has children");
            let Node { run, parent, .. } = std::mem::take(node);
            self.by_first.remove(&run[0]);
            if parent != NIL {
                self.nodes[parent as usize].children -= 1;
            }
            self.free_nodes.push(n);
        }
    }

    /// Blocks `instance` remembers.
    #[cfg(test)]
    fn blocks(&self, instance: InstanceId) -> u64 {
        self.tenants.get(instance.0 as usize).map_or(0, |t| t.blocks)
    }

    /// The hashes `instance` remembers, by walking its list.
    #[cfg(test)]
    fn remembered(&self, instance: u32) -> Vec<BlockHash> {
        let mut out = Vec::new();
        let mut m = self.tenants.get(instance as usize).map_or(NIL, |t| t.head);
        while m != NIL {
            out.extend_from_slice(&self.nodes[self.members[m as usize].node as usize].run);
            m = self.members[m as usize].next;
        }
        out
    }

    /// Lists are well linked, counted and within capacity; every node is named by its first
    /// hash and counts its children; each instance's list puts nodes before their ancestors.
    #[cfg(test)]
    fn check_invariants(&self) {
        let live: Vec<u32> = (0..self.nodes.len() as u32).filter(|n| !self.free_nodes.contains(n)).collect();
        assert_eq!(self.by_first.len(), live.len(), "map and nodes disagree");
        let mut children = vec![0u32; self.nodes.len()];
        for &n in &live {
            let node = &self.nodes[n as usize];
            assert!(!node.run.is_empty() && !node.members.is_empty(), "node {n} is empty");
            assert_eq!(self.by_first.get(&node.run[0]), Some(&n), "node {n} is not named by its first hash");
            if node.parent != NIL {
                children[node.parent as usize] += 1;
            }
        }
        for &n in &live {
            assert_eq!(self.nodes[n as usize].children, children[n as usize], "node {n} miscounts its children");
        }
        for (i, t) in self.tenants.iter().enumerate() {
            assert!(t.blocks <= self.capacity, "instance {i} remembers {} > {}", t.blocks, self.capacity);
            let (mut m, mut prev, mut blocks, mut position) = (t.head, NIL, 0, FxHashMap::default());
            while m != NIL {
                let member = self.members[m as usize];
                assert_eq!((member.prev, member.instance), (prev, i as u32), "instance {i}: broken list");
                assert!(self.nodes[member.node as usize].members.contains(&m), "instance {i}: stray member");
                blocks += self.nodes[member.node as usize].run.len() as u64;
                position.insert(member.node, position.len());
                (prev, m) = (m, member.next);
            }
            assert_eq!((t.tail, t.blocks), (prev, blocks), "instance {i}: wrong tail or count");
            for (&n, &at) in &position {
                let parent = self.nodes[n as usize].parent;
                if parent != NIL {
                    let p = position.get(&parent).copied();
                    assert!(p.is_some_and(|p| p > at), "instance {i}: node {n} not before its parent");
                }
            }
        }
    }
}

/// How many leading hashes `a` and `b` share.
fn common_len(a: &[BlockHash], b: &[BlockHash]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A chain of hashes whose block `j` has content `keys[j]`.
    fn chain(keys: &[u64]) -> Vec<BlockHash> {
        keys.iter()
            .scan(BlockHash::ROOT, |h, &k| {
                *h = h.chain(k);
                Some(*h)
            })
            .collect()
    }

    #[test]
    fn a_full_instance_forgets_its_least_recent_nodes_leaves_first() {
        let mut t = ApproxTree::new(3);
        let (a, b) = (chain(&[1, 2, 3]), chain(&[1, 2, 9]));
        t.insert(InstanceId(0), &a);
        t.insert(InstanceId(0), &b);
        t.check_invariants();
        // b split a's run into [1,2] and [3] and added [9]: 4 blocks, so the least recent
        // node, a's leaf [3], went.
        assert_eq!(t.blocks(InstanceId(0)), 3);
        assert_eq!(t.longest_match(&b, |_| true), (3, Some(InstanceId(0))));
        assert_eq!(t.longest_match(&a, |_| true), (2, Some(InstanceId(0))));
        // The least recent node is now b's leaf; its prefix stays.
        t.insert(InstanceId(0), &chain(&[7]));
        t.check_invariants();
        assert_eq!(t.longest_match(&b, |_| true), (2, Some(InstanceId(0))));
        assert_eq!(t.longest_match(&chain(&[7]), |_| true), (1, Some(InstanceId(0))));
    }

    #[test]
    fn a_match_goes_to_the_lowest_eligible_instance_holding_all_of_it() {
        let mut t = ApproxTree::new(100);
        let a = chain(&[1, 2, 3, 4]);
        t.insert(InstanceId(3), &a);
        t.insert(InstanceId(1), &a[..2]);
        t.insert(InstanceId(2), &a);
        t.check_invariants();
        assert_eq!(t.longest_match(&a, |_| true), (4, Some(InstanceId(2))));
        assert_eq!(t.longest_match(&a, |i| i != 2), (4, Some(InstanceId(3))));
        assert_eq!(t.longest_match(&a, |i| i == 1), (2, Some(InstanceId(1))));
        assert_eq!(t.longest_match(&a, |i| i == 0), (0, None));
        assert_eq!(t.longest_match(&chain(&[1, 2, 5]), |_| true), (2, Some(InstanceId(1))));
        t.remove_instance(InstanceId(2));
        t.remove_instance(InstanceId(3));
        t.check_invariants();
        assert_eq!(t.longest_match(&a, |_| true), (2, Some(InstanceId(1))));
    }

    proptest! {
        /// Whatever is inserted: the invariants hold, each instance's memory is closed under
        /// prefixes and holds its last request (when it fits), and a match is the longest
        /// prefix an eligible instance remembers, given to the lowest such instance.
        #[test]
        fn the_tree_remembers_closed_prefixes_and_matches_the_longest(
            capacity in 1u32..12,
            ops in prop::collection::vec((0u32..4, prop::collection::vec(0u64..3, 0..8), 0u32..16), 1..60),
        ) {
            let mut t = ApproxTree::new(capacity);
            for (instance, keys, mask) in ops {
                let hashes = chain(&keys);
                let eligible = |i: u32| mask & (1 << i) != 0;
                let remembered: Vec<Vec<BlockHash>> = (0..4).map(|i| t.remembered(i)).collect();
                let mut naive = (0, None);
                for i in (0..4).filter(|&i| eligible(i)) {
                    let n = hashes.iter().take_while(|h| remembered[i as usize].contains(h)).count() as u32;
                    if n > naive.0 {
                        naive = (n, Some(InstanceId(i)));
                    }
                }
                prop_assert_eq!(t.longest_match(&hashes, eligible), naive);

                t.insert(InstanceId(instance), &hashes);
                t.check_invariants();
                if hashes.len() as u32 <= capacity {
                    let mine = t.remembered(instance);
                    prop_assert!(hashes.iter().all(|h| mine.contains(h)));
                }
                for i in 0..4 {
                    let mine = t.remembered(i);
                    // Closed under prefixes: each remembered hash's chain predecessor is too.
                    for node in t.nodes.iter().filter(|n| !n.run.is_empty()) {
                        for w in node.run.windows(2) {
                            prop_assert!(!mine.contains(&w[1]) || mine.contains(&w[0]));
                        }
                        if node.parent != NIL && mine.contains(&node.run[0]) {
                            prop_assert!(mine.contains(t.nodes[node.parent as usize].run.last().unwrap()));
                        }
                    }
                }
            }
        }
    }
}
