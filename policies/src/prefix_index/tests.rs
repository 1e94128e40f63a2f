use super::*;
use proptest::prelude::*;
use std::collections::HashSet;
use std::ops::Range;

pub(super) const A: InstanceId = InstanceId(0);
pub(super) const B: InstanceId = InstanceId(1);
pub(super) const C: InstanceId = InstanceId(2);

/// Blocks a page spans in these tests: small, so that short prompts cross pages.
pub(super) const PAGE: usize = 4;

pub(super) fn new_index() -> PrefixIndex {
    PrefixIndex::with_page_blocks(PAGE as u32)
}

/// A chain of `n` block hashes after `parent`.
pub(super) fn chain(parent: BlockHash, seed: u64, n: usize) -> Vec<BlockHash> {
    let mut h = parent;
    (0..n as u64)
        .map(|k| {
            h = h.chain(seed * 1000 + k);
            h
        })
        .collect()
}

/// The event storing block `k` of the chain `path` (from the root), with its page.
fn stored(tier: Tier, path: &[BlockHash], k: usize) -> KvEvent {
    KvEvent::Stored { tier, hash: path[k], page: path[k / PAGE * PAGE] }
}

fn removed(tier: Tier, path: &[BlockHash], k: usize) -> KvEvent {
    KvEvent::Removed { tier, hash: path[k], page: path[k / PAGE * PAGE] }
}

fn store(index: &mut PrefixIndex, instance: InstanceId, tier: Tier, path: &[BlockHash], blocks: Range<usize>) {
    for k in blocks {
        index.apply(instance, &stored(tier, path, k));
        index.check_invariants();
    }
}

fn remove(index: &mut PrefixIndex, instance: InstanceId, tier: Tier, path: &[BlockHash], blocks: Range<usize>) {
    for k in blocks {
        index.apply(instance, &removed(tier, path, k));
        index.check_invariants();
    }
}

pub(super) fn tm(l1: u32, l2: u32, l3: u32) -> TierMatch {
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
    let mut index = new_index();
    store(&mut index, A, Tier::L1, &h, 0..2);
    store(&mut index, A, Tier::L2, &h, 2..4);
    store(&mut index, A, Tier::L3, &h, 1..5);
    // Held by A in L1 and L2 at once (between two events of a move): L1 wins.
    store(&mut index, A, Tier::L1, &h, 3..4);
    check(&index, &h, &[(A, tm(3, 1, 1)), (B, tm(0, 0, 0))]);
    assert_eq!(index.blocks(), 5);
}

#[test]
fn the_shared_store_alone_gives_every_instance_a_prefix() {
    let h = chain(BlockHash::ROOT, 2, 5);
    let mut index = new_index();
    store(&mut index, C, Tier::L3, &h, 0..3);
    store(&mut index, B, Tier::L1, &h, 0..4);
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
    let mut index = new_index();
    store(&mut index, A, Tier::L1, &h, 0..2);
    store(&mut index, B, Tier::L3, &h, 2..3);
    store(&mut index, A, Tier::L2, &h, 3..4);
    store(&mut index, B, Tier::L3, &h, 4..5);
    check(&index, &h, &[(A, tm(2, 1, 2)), (B, tm(0, 0, 0))]);
    // Prompts are chains from the root: one that starts mid-chain names no page.
    check(&index, &h[2..], &[(A, tm(0, 0, 0)), (B, tm(0, 0, 0))]);
}

#[test]
fn removing_a_block_ends_the_prefix_there() {
    let h = chain(BlockHash::ROOT, 4, 6);
    let mut index = new_index();
    store(&mut index, A, Tier::L1, &h, 0..h.len());
    store(&mut index, B, Tier::L1, &h, 0..4);
    remove(&mut index, A, Tier::L1, &h, 2..3);
    check(&index, &h, &[(A, tm(2, 0, 0)), (B, tm(4, 0, 0))]);
    assert_eq!(index.blocks(), 6, "B still holds the removed block");
    remove(&mut index, A, Tier::L1, &h, 4..h.len());
    assert_eq!(index.blocks(), 4);
    // Removing what is not there changes nothing.
    remove(&mut index, C, Tier::L2, &h, 0..h.len());
    remove(&mut index, A, Tier::L3, &h, 0..h.len());
    check(&index, &h, &[(A, tm(2, 0, 0)), (B, tm(4, 0, 0))]);
}

#[test]
fn demotion_keeps_blocks_in_place() {
    // What an engine publishes when L1 evicts a leaf: removed from L1, stored in L2.
    let h = chain(BlockHash::ROOT, 5, 8);
    let mut index = new_index();
    store(&mut index, A, Tier::L1, &h, 0..h.len());
    for k in (4..8).rev() {
        remove(&mut index, A, Tier::L1, &h, k..k + 1);
        index.apply(A, &stored(Tier::L2, &h, k));
        index.check_invariants();
    }
    // And when L2 evicts one: removed from L2, stored in L3 (without its parent).
    remove(&mut index, A, Tier::L2, &h, 7..h.len());
    index.apply(A, &KvEvent::Stored { tier: Tier::L3, hash: h[7], page: h[4] });
    index.check_invariants();
    check(&index, &h, &[(A, tm(4, 3, 1)), (B, tm(0, 0, 0))]);
    let slot = index.slots.get(h[4]).expect("the second page");
    let page: Vec<BlockHash> = index.pages[slot as usize].entries.iter().map(|e| e.hash()).collect();
    assert_eq!(page, h[4..], "the page keeps its blocks in chain order");
}

#[test]
fn remove_instance_and_cleared_forget_only_that_instances_tiers() {
    let h = chain(BlockHash::ROOT, 6, 6);
    let mut index = new_index();
    store(&mut index, A, Tier::L1, &h, 0..4);
    store(&mut index, A, Tier::L2, &h, 4..h.len());
    store(&mut index, B, Tier::L1, &h, 0..2);
    store(&mut index, C, Tier::L2, &h, 0..3);
    store(&mut index, C, Tier::L3, &h, 5..h.len());
    index.remove_instance(A);
    index.check_invariants();
    check(&index, &h, &[(A, tm(0, 0, 0)), (B, tm(2, 0, 0)), (C, tm(0, 3, 0))]);
    assert_eq!(index.blocks(), 4, "h[3] and h[4] were A's alone");
    index.apply(C, &KvEvent::Cleared);
    index.check_invariants();
    check(&index, &h, &[(B, tm(2, 0, 0)), (C, tm(0, 0, 0))]);
    assert_eq!(index.blocks(), 3, "h[2] goes with C, h[5] stays in L3");
    // The instance comes back.
    store(&mut index, A, Tier::L1, &h, 0..h.len());
    check(&index, &h, &[(A, tm(6, 0, 0)), (B, tm(2, 0, 0))]);
}

#[test]
fn a_fleet_wide_prefix_is_matched_for_every_instance() {
    let h = chain(BlockHash::ROOT, 7, 10);
    let mut index = new_index();
    for i in 0..300 {
        store(&mut index, InstanceId(i), Tier::L1, &h, 0..4);
    }
    store(&mut index, InstanceId(5), Tier::L1, &h, 4..8);
    store(&mut index, InstanceId(299), Tier::L2, &h, 4..6);
    let mut m = PrefixMatches::default();
    index.match_prefix(&h, &mut m);
    assert_eq!(m.get(InstanceId(5)), tm(8, 0, 0));
    assert_eq!(m.get(InstanceId(299)), tm(4, 2, 0));
    assert_eq!(m.get(InstanceId(17)), tm(4, 0, 0));
    assert_eq!(m.get(InstanceId(300)), tm(0, 0, 0));
    assert_eq!(m.iter().count(), 300);
    assert_eq!(m.iter().filter(|(_, t)| t.total() > 4).count(), 2);
}

#[test]
fn a_run_of_new_blocks_whose_filter_bits_collide_is_stored_once_each() {
    // Every hash has the same top byte, so the page's filter "may hold" each one after the
    // first: whether a block is new is told by looking, and the run goes on past the ones
    // that are.
    let h = |k: u64| BlockHash(0xab << 56 | k);
    let page = h(1);
    let run = |instance: InstanceId, index: &mut PrefixIndex, blocks: &[u64]| {
        let batch: KvEvents = blocks.iter().map(|&k| KvEvent::Stored { tier: Tier::L1, hash: h(k), page }).collect();
        index.apply_batch(instance, &batch);
        index.check_invariants();
    };
    let mut index = new_index();
    run(A, &mut index, &[1, 2, 3, 4]);
    // h(2) is on the page already, not beside the run's last block: it is not pushed again.
    run(B, &mut index, &[5, 6, 2]);
    // A block named twice among the new ones of a run is pushed once.
    run(C, &mut index, &[7, 8, 8]);
    let slot = index.slots.get(page).expect("the page");
    let p = &index.pages[slot as usize];
    let hashes: Vec<BlockHash> = p.entries.iter().map(|e| e.hash()).collect();
    assert_eq!(hashes, [1, 2, 3, 4, 5, 6, 7, 8].map(h));
    let holders = |k: usize| index.states[p.entries[k].value as usize].holders.clone();
    assert_eq!(holders(1), [holder(A, Tier::L1), holder(B, Tier::L1)]);
    assert_eq!(holders(7), [holder(C, Tier::L1)]);
    assert_eq!(index.blocks(), 8);
    // On a page new to the index, the run is appended at once, up to a block named twice;
    // the rest goes on from there.
    let fresh = h(20);
    let batch: KvEvents =
        [20, 21, 20, 22].iter().map(|&k| KvEvent::Stored { tier: Tier::L1, hash: h(k), page: fresh }).collect();
    index.apply_batch(C, &batch);
    index.check_invariants();
    let p = &index.pages[index.slots.get(fresh).expect("the new page") as usize];
    assert_eq!(p.entries.iter().map(|e| e.hash()).collect::<Vec<_>>(), [20, 21, 22].map(h));
    assert!(p.entries.iter().all(|e| index.states[e.value as usize].holders == [holder(C, Tier::L1)]));
    assert_eq!(index.blocks(), 11);
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
            KvEvent::Removed { tier: Tier::L3, hash, .. } => {
                self.l3.remove(&hash);
            }
            KvEvent::Stored { tier, hash, .. } => {
                self.own.insert((instance.0, tier, hash));
            }
            KvEvent::Removed { tier, hash, .. } => {
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

/// A block of the property test's universe: its hash and page.
#[derive(Clone, Copy, Debug)]
pub(super) struct Block {
    pub(super) hash: BlockHash,
    pub(super) page: BlockHash,
}

/// The block universe of the property test: a small tree of chained hashes over several
/// pages, with a page of many continuations (looked up, not scanned), plus the hash 0 (which
/// the map keeps aside). Returns the blocks and every root-to-block path.
pub(super) fn universe() -> (Vec<Block>, Vec<Vec<BlockHash>>) {
    let trunk = chain(BlockHash::ROOT, 10, 8);
    let mut paths: Vec<Vec<BlockHash>> = vec![trunk.clone()];
    let branch = [&trunk[..4], &chain(trunk[3], 11, 6)].concat();
    let twig = [&branch[..6], &chain(branch[5], 13, 3)].concat();
    paths.push(branch);
    paths.push(twig);
    paths.push(chain(BlockHash::ROOT, 12, 5));
    // Continuations of trunk[5] in its page (depths 6 and 7): more than the scan limit.
    for k in 0..8 {
        paths.push([&trunk[..6], &chain(trunk[5], 20 + k, 2)].concat());
    }
    let other = paths[3].clone();
    paths.push([&other[..], &[BlockHash(0)]].concat());
    let mut u: Vec<Block> = Vec::new();
    let mut all = Vec::new();
    for path in &paths {
        for k in 0..path.len() {
            if !u.iter().any(|b| b.hash == path[k]) {
                u.push(Block { hash: path[k], page: path[k / PAGE * PAGE] });
            }
            all.push(path[..=k].to_vec());
        }
    }
    all.sort();
    all.dedup();
    (u, all)
}

#[derive(Clone, Debug)]
enum Op {
    /// A whole run of the universe stored in chain order, as engines publish it.
    StoreRun {
        instance: u32,
        tier: u8,
        from: usize,
        len: usize,
    },
    Store {
        instance: u32,
        tier: u8,
        block: usize,
    },
    Remove {
        instance: u32,
        tier: u8,
        block: usize,
    },
    /// A run of the universe removed in reverse chain order, as engines evict it, or in chain
    /// order, as a store's victims leave.
    RemoveRun {
        instance: u32,
        tier: u8,
        from: usize,
        len: usize,
        down: bool,
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
    /// Several runs of one instance in one batch: `(shape, tier, from, len, cut)`, shape 0
    /// a run stored in `tier`, 1 one removed from it, 2 a demotion of a run (stored in L2,
    /// stored in L3 whole or but its first block, removed from L1; some L3 victims between),
    /// 3 everything of the instance cleared, 4 a run stored in L3 then in L2 (a `Cleared`
    /// between, which the L2 run must not pass).
    Batch {
        instance: u32,
        parts: Vec<(u8, u8, usize, usize, usize)>,
    },
    RemoveInstance {
        instance: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let n = universe().0.len();
    prop_oneof![
        4 => (0u32..4, 0u8..3, 0..n, 1usize..8).prop_map(|(instance, tier, from, len)| Op::StoreRun { instance, tier, from, len }),
        4 => (0u32..4, 0u8..3, 0..n).prop_map(|(instance, tier, block)| Op::Store { instance, tier, block }),
        4 => (0u32..4, 0u8..3, 0..n).prop_map(|(instance, tier, block)| Op::Remove { instance, tier, block }),
        3 => (0u32..4, 0u8..3, 0..n, 1usize..8, any::<bool>())
            .prop_map(|(instance, tier, from, len, down)| Op::RemoveRun { instance, tier, from, len, down }),
        2 => (0u32..4, 0u8..2, 0..n).prop_map(|(instance, tier, block)| Op::Move { instance, tier, block }),
        1 => (0u32..4).prop_map(|instance| Op::Cleared { instance }),
        3 => (0u32..4, proptest::collection::vec((0u8..5, 0u8..3, 0..n, 1usize..8, 0..n), 1..6))
            .prop_map(|(instance, parts)| Op::Batch { instance, parts }),
        1 => (0u32..4).prop_map(|instance| Op::RemoveInstance { instance }),
    ]
}

proptest! {
    /// Each run's link names the batch's next run on its page, or nothing when there is none
    /// or when a run between on another page took its table entry; entries left by earlier
    /// batches (a table of four, shared by all) never link anything.
    #[test]
    fn runs_are_linked_to_the_next_run_on_their_page(
        batches in proptest::collection::vec(proptest::collection::vec((0u64..6, 0usize..3, any::<bool>()), 0..40), 1..6),
    ) {
        let tiers = [Tier::L1, Tier::L2, Tier::L3];
        let mut recent = vec![(BlockHash(0), 0); 4];
        let (mut next, mut base) = (Vec::new(), 1);
        for events in batches {
            let batch: KvEvents = events
                .iter()
                .enumerate()
                .map(|(k, &(page, tier, stored))| {
                    let (tier, hash, page) = (tiers[tier], BlockHash(1000 + k as u64), BlockHash(page));
                    if stored { KvEvent::Stored { tier, hash, page } } else { KvEvent::Removed { tier, hash, page } }
                })
                .collect();
            let n = batch.run_count();
            let from = n / 3;
            link_runs(&batch, from, &mut next, &mut recent, base);
            base += n as u64;
            for (i, &link) in next.iter().enumerate().skip(from) {
                let page = batch.run_page(i);
                let later = (i + 1..n).find(|&j| batch.run_page(j) == page);
                if link == NO_RUN {
                    // Only a run between on another page in the same entry breaks the link.
                    if let Some(j) = later {
                        let slot = link_slot(page, recent.len());
                        prop_assert!((i + 1..j).any(|k| link_slot(batch.run_page(k), recent.len()) == slot));
                    }
                } else {
                    prop_assert_eq!(Some(link as usize), later);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Every instance's match, the shared match, the matched instances and the block
    /// count equal the model's after every operation, for every chain prompt.
    #[test]
    fn matches_equal_a_walk_over_per_tier_sets(ops in proptest::collection::vec(op(), 1..60)) {
        let (u, chains) = universe();
        let mut index = new_index();
        let mut model = Model::default();
        let tiers = [Tier::L1, Tier::L2, Tier::L3];
        let mut events = Vec::new();
        for op in ops {
            events.clear();
            match op {
                Op::StoreRun { instance, tier, from, len } => {
                    for b in &u[from..(from + len).min(u.len())] {
                        let tier = tiers[tier as usize];
                        events.push((instance, KvEvent::Stored { tier, hash: b.hash, page: b.page }));
                    }
                }
                Op::Store { instance, tier, block } => {
                    let b = u[block];
                    let tier = tiers[tier as usize];
                    events.push((instance, KvEvent::Stored { tier, hash: b.hash, page: b.page }));
                }
                Op::Remove { instance, tier, block } => {
                    let b = u[block];
                    events.push((instance, KvEvent::Removed { tier: tiers[tier as usize], hash: b.hash, page: b.page }));
                }
                Op::RemoveRun { instance, tier, from, len, down } => {
                    // Leaf first (a demotion's) or in the order stored (a store's victims).
                    let run = &u[from..(from + len).min(u.len())];
                    let mut blocks: Vec<&Block> = run.iter().collect();
                    if down {
                        blocks.reverse();
                    }
                    for b in blocks {
                        events.push((instance, KvEvent::Removed { tier: tiers[tier as usize], hash: b.hash, page: b.page }));
                    }
                }
                Op::Move { instance, tier, block } => {
                    let Block { hash, page } = u[block];
                    events.push((instance, KvEvent::Removed { tier: tiers[tier as usize], hash, page }));
                    events.push((instance, KvEvent::Stored { tier: tiers[tier as usize + 1], hash, page }));
                }
                Op::Cleared { instance } => events.push((instance, KvEvent::Cleared)),
                Op::Batch { instance, parts } => {
                    let run = |from: usize, len: usize| &u[from.min(u.len())..(from + len).min(u.len())];
                    // `stored` 0 or 1 for the blocks' events, 2 for a `Cleared`.
                    let mut push = |stored: u8, tier: usize, blocks: &[Block]| {
                        if stored == 2 {
                            events.push((instance, KvEvent::Cleared));
                        }
                        for b in blocks.iter().filter(|_| stored < 2) {
                            let (tier, hash, page) = (tiers[tier], b.hash, b.page);
                            let e = if stored == 1 { KvEvent::Stored { tier, hash, page } } else { KvEvent::Removed { tier, hash, page } };
                            events.push((instance, e));
                        }
                    };
                    for (shape, tier, from, len, cut) in parts {
                        match shape {
                            0 | 1 => push(1 - shape, tier as usize, run(from, len)),
                            3 => push(2, 0, &[]),
                            4 => {
                                push(1, 2, run(from, len));
                                if cut % 2 == 1 {
                                    push(2, 0, &[]);
                                }
                                push(1, 1, run(from, len));
                            }
                            _ => {
                                push(1, 1, run(from, len));
                                if cut % 2 == 1 {
                                    push(0, 2, run(cut, 2));
                                }
                                push(1, 2, run(from + usize::from(cut % 4 >= 2), len));
                                push(0, 0, run(from, len));
                            }
                        }
                    }
                }
                Op::RemoveInstance { instance } => {
                    index.remove_instance(InstanceId(instance));
                    model.apply(InstanceId(instance), &KvEvent::Cleared);
                }
            }
            // An op's events are one instance's, applied as one batch (where runs take the
            // short way; the rest is `apply`).
            if let Some(&(instance, _)) = events.first() {
                let batch: KvEvents = events.iter().map(|&(_, e)| e).collect();
                index.apply_batch(InstanceId(instance), &batch);
            }
            for (instance, e) in &events {
                model.apply(InstanceId(*instance), e);
            }
            index.check_invariants();
            prop_assert_eq!(index.blocks(), model.blocks());
            let mut m = PrefixMatches::default();
            for prompt in &chains {
                index.match_prefix(prompt, &mut m);
                check_matches(&m, prompt, |i| model.prefix(i, prompt))?;
            }
        }
    }
}

/// Checks the answers of `m`, just filled for `prompt`, against `want` (each instance's
/// prefix by tier; instances 0 to 4, and 99, which holds nothing, for the shared prefix):
/// `get`, `shared`, the instances `iter` lists (with their `get`) and `longest`.
pub(super) fn check_matches(
    m: &PrefixMatches,
    prompt: &[BlockHash],
    want: impl Fn(u32) -> TierMatch,
) -> Result<(), TestCaseError> {
    for i in 0..5 {
        prop_assert_eq!(m.get(InstanceId(i)), want(i), "instance {} prompt {:?}", i, prompt);
    }
    prop_assert_eq!(m.shared(), want(99));
    let mut listed: Vec<u32> = m
        .iter()
        .map(|(i, t)| {
            assert_eq!(t, m.get(i));
            i.0
        })
        .collect();
    listed.sort_unstable();
    let held: Vec<u32> = (0..5)
        .filter(|&i| {
            let t = want(i);
            t.l1 + t.l2 > 0
        })
        .collect();
    prop_assert_eq!(listed, held);
    let longest = (0..5)
        .map(|i| (i, want(i)))
        .filter(|(_, t)| t.l1 + t.l2 > 0)
        .max_by_key(|&(i, t)| (t.total(), t.l1, t.l2, std::cmp::Reverse(i)))
        .map(|(i, t)| (InstanceId(i), t));
    prop_assert_eq!(m.longest(), longest);
    Ok(())
}
