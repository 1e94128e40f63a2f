//! Chunk mode: L2 and L3 events naming chunks of blocks, against the semantics written out.

use super::tests::{chain, check_matches, new_index, tm, universe, Block, A, B, C, PAGE};
use super::*;
use proptest::prelude::*;
use std::collections::HashSet;

/// An index on the tests' small pages, with chunks of `c` blocks.
fn chunk_index(c: u32) -> PrefixIndex {
    new_index().chunked(c)
}

/// The event storing or removing block `k` of the chain `path` in L1.
fn l1_event(stored: bool, path: &[BlockHash], k: usize) -> KvEvent {
    let (tier, hash, page) = (Tier::L1, path[k], path[k / PAGE * PAGE]);
    if stored {
        KvEvent::Stored { tier, hash, page }
    } else {
        KvEvent::Removed { tier, hash, page }
    }
}

/// The event storing or removing chunk `k` (of `c` blocks) of the chain `path` in `tier`:
/// named by its last block.
fn chunk_event(stored: bool, tier: Tier, path: &[BlockHash], c: usize, k: usize) -> KvEvent {
    let last = (k + 1) * c - 1;
    let (hash, page) = (path[last], path[last / PAGE * PAGE]);
    if stored {
        KvEvent::Stored { tier, hash, page }
    } else {
        KvEvent::Removed { tier, hash, page }
    }
}

fn apply_all(index: &mut PrefixIndex, instance: InstanceId, events: impl IntoIterator<Item = KvEvent>) {
    for e in events {
        index.apply(instance, &e);
        index.check_invariants();
    }
}

fn matches(index: &PrefixIndex, hashes: &[BlockHash]) -> PrefixMatches {
    let mut m = PrefixMatches::default();
    index.match_prefix(hashes, &mut m);
    m
}

#[test]
fn chunks_continue_an_l1_prefix_from_the_chunk_it_ends_in() {
    let h = chain(BlockHash::ROOT, 31, 12);
    let mut index = chunk_index(4);
    apply_all(&mut index, A, (0..5).map(|k| l1_event(true, &h, k)));
    apply_all(&mut index, A, [chunk_event(true, Tier::L2, &h, 4, 1)]);
    apply_all(&mut index, B, [chunk_event(true, Tier::L3, &h, 4, 2)]);
    apply_all(&mut index, C, [chunk_event(true, Tier::L2, &h, 4, 0)]);
    let m = matches(&index, &h);
    // A: blocks 5..8 of its L2 chunk, then the L3 chunk.
    assert_eq!(m.get(A), tm(5, 3, 4));
    assert_eq!(m.get(B), tm(0, 0, 0), "chunk 0 is nowhere for B");
    assert_eq!(m.get(C), tm(0, 4, 0), "an instance with L2 chunks and no L1 block");
    assert_eq!(m.shared(), tm(0, 0, 0));
    assert_eq!(m.iter().collect::<Vec<_>>(), vec![(A, tm(5, 3, 4)), (C, tm(0, 4, 0))]);
    assert_eq!(m.longest(), Some((A, tm(5, 3, 4))));
    // A chunk whose last block is not in the prompt is of no use.
    assert_eq!(matches(&index, &h[..11]).get(A), tm(5, 3, 0));
    apply_all(&mut index, B, [0, 1].map(|k| chunk_event(true, Tier::L3, &h, 4, k)));
    let m = matches(&index, &h);
    assert_eq!(m.get(A), tm(5, 3, 4));
    assert_eq!(m.get(B), tm(0, 0, 12));
    assert_eq!(m.get(C), tm(0, 4, 8));
    assert_eq!(m.shared(), tm(0, 0, 12));
    assert_eq!(m.iter().count(), 2);
    assert_eq!(index.blocks(), 5 + 3 * 4);
    assert_eq!(index.chunks(), 3);
}

#[test]
fn cleared_and_remove_instance_drop_their_l2_chunks_not_l3() {
    let h = chain(BlockHash::ROOT, 32, 8);
    let mut index = chunk_index(2);
    apply_all(&mut index, A, (0..3).map(|k| l1_event(true, &h, k)));
    apply_all(&mut index, A, [1, 2].map(|k| chunk_event(true, Tier::L2, &h, 2, k)));
    apply_all(&mut index, A, [chunk_event(true, Tier::L3, &h, 2, 3)]);
    apply_all(&mut index, B, (0..4).map(|k| chunk_event(true, Tier::L2, &h, 2, k)));
    assert_eq!(matches(&index, &h).get(A), tm(3, 3, 2));
    assert_eq!(matches(&index, &h).get(B), tm(0, 8, 0));
    assert_eq!(index.blocks(), 3 + 4 * 2);
    index.apply(A, &KvEvent::Cleared);
    index.check_invariants();
    assert_eq!(matches(&index, &h).get(A), tm(0, 0, 0));
    assert_eq!(index.blocks(), 4 * 2, "B still holds every chunk");
    index.remove_instance(B);
    index.check_invariants();
    assert_eq!(matches(&index, &h).get(B), tm(0, 0, 0));
    assert_eq!((index.chunks(), index.blocks()), (1, 2), "the L3 chunk stays");
    // Removing what is not there changes nothing; removing from L3 is anyone's to do.
    apply_all(&mut index, A, [chunk_event(false, Tier::L2, &h, 2, 3)]);
    assert_eq!(index.chunks(), 1);
    apply_all(&mut index, C, [chunk_event(false, Tier::L3, &h, 2, 3)]);
    assert_eq!((index.chunks(), index.blocks()), (0, 0));
}

#[test]
fn chunk_sizes_are_powers_of_two_dividing_a_page() {
    assert_eq!(PrefixIndex::with_chunk_blocks(1).chunk_blocks(), 1);
    assert_eq!(PrefixIndex::with_chunk_blocks(16).chunk_blocks(), 16);
    assert_eq!(PrefixIndex::new().chunk_blocks(), 1);
    for c in [0, 3, 2 * PAGE_BLOCKS as u32] {
        assert!(std::panic::catch_unwind(|| PrefixIndex::with_chunk_blocks(c)).is_err(), "{c}");
    }
}

/// The chunk-mode semantics written out: per-instance L1 blocks and L2 chunks, L3 chunks.
#[derive(Default)]
struct Model {
    l1: HashSet<(u32, BlockHash)>,
    l2: HashSet<(u32, BlockHash)>,
    l3: HashSet<BlockHash>,
}

impl Model {
    fn apply(&mut self, instance: InstanceId, event: &KvEvent) {
        let i = instance.0;
        match *event {
            KvEvent::Stored { tier, hash, .. } => match tier {
                Tier::L1 => self.l1.insert((i, hash)),
                Tier::L2 => self.l2.insert((i, hash)),
                Tier::L3 => self.l3.insert(hash),
            },
            KvEvent::Removed { tier, hash, .. } => match tier {
                Tier::L1 => self.l1.remove(&(i, hash)),
                Tier::L2 => self.l2.remove(&(i, hash)),
                Tier::L3 => self.l3.remove(&hash),
            },
            KvEvent::Cleared => {
                self.l1.retain(|&(j, _)| j != i);
                self.l2.retain(|&(j, _)| j != i);
                true
            }
        };
    }

    /// The L1 prefix, then chunk by chunk from the one it ends in: L2, else L3, else stop.
    fn prefix(&self, c: usize, instance: u32, hashes: &[BlockHash]) -> TierMatch {
        let l1 = hashes.iter().take_while(|&&h| self.l1.contains(&(instance, h))).count();
        let mut m = tm(l1 as u32, 0, 0);
        let mut k = l1 / c;
        while (k + 1) * c <= hashes.len() {
            let h = hashes[(k + 1) * c - 1];
            let n = ((k + 1) * c - l1.max(k * c)) as u32;
            if self.l2.contains(&(instance, h)) {
                m.l2 += n;
            } else if self.l3.contains(&h) {
                m.l3 += n;
            } else {
                break;
            }
            k += 1;
        }
        m
    }

    /// Distinct L1 blocks, and `c` blocks a chunk held in L2 or L3.
    fn blocks(&self, c: usize) -> usize {
        let l1: HashSet<BlockHash> = self.l1.iter().map(|&(_, h)| h).collect();
        let mut chunks = self.l3.clone();
        chunks.extend(self.l2.iter().map(|&(_, h)| h));
        l1.len() + c * chunks.len()
    }
}

/// A chunk of the universe: its last block (which names it) and its blocks.
#[derive(Clone, Debug)]
struct Chunk {
    last: Block,
    blocks: Vec<Block>,
}

/// The chunks of `c` blocks of every path of the universe.
fn chunks(paths: &[Vec<BlockHash>], c: usize) -> Vec<Chunk> {
    let block = |p: &[BlockHash], k: usize| Block { hash: p[k], page: p[k / PAGE * PAGE] };
    paths
        .iter()
        .filter(|p| p.len() % c == 0)
        .map(|p| Chunk { last: block(p, p.len() - 1), blocks: (p.len() - c..p.len()).map(|k| block(p, k)).collect() })
        .collect()
}

#[derive(Clone, Debug)]
enum Part {
    /// A run of the universe's blocks stored in L1 or removed from it (leaf first when
    /// `down`).
    L1 {
        from: usize,
        len: usize,
        stored: bool,
        down: bool,
    },
    /// A run of chunks (indices taken modulo their number) stored in L2 (tier 1) or L3
    /// (tier 2), or removed from it.
    Lower {
        tier: u8,
        from: usize,
        len: usize,
        stored: bool,
    },
    /// A chunk demoted from L1: stored in L2 (and in L3 with `l3`), its blocks then removed
    /// from L1, leaf first.
    Demote {
        chunk: usize,
        l3: bool,
    },
    Cleared,
}

#[derive(Clone, Debug)]
enum Op {
    /// One instance's events, as one batch.
    Events {
        instance: u32,
        parts: Vec<Part>,
    },
    RemoveInstance {
        instance: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let n = universe().0.len();
    let part = prop_oneof![
        4 => (0..n, 1usize..8, any::<bool>(), any::<bool>())
            .prop_map(|(from, len, stored, down)| Part::L1 { from, len, stored, down }),
        5 => (1u8..3, 0usize..64, 1usize..5, any::<bool>())
            .prop_map(|(tier, from, len, stored)| Part::Lower { tier, from, len, stored }),
        2 => (0usize..64, any::<bool>()).prop_map(|(chunk, l3)| Part::Demote { chunk, l3 }),
        1 => Just(Part::Cleared),
    ];
    prop_oneof![
        12 => (0u32..4, proptest::collection::vec(part, 1..4)).prop_map(|(instance, parts)| Op::Events { instance, parts }),
        1 => (0u32..4).prop_map(|instance| Op::RemoveInstance { instance }),
    ]
}

/// The events of `parts`, in order.
fn events(parts: &[Part], u: &[Block], chunks: &[Chunk]) -> Vec<KvEvent> {
    let tiers = [Tier::L1, Tier::L2, Tier::L3];
    let event = |stored: bool, tier: Tier, b: &Block| {
        let (hash, page) = (b.hash, b.page);
        if stored {
            KvEvent::Stored { tier, hash, page }
        } else {
            KvEvent::Removed { tier, hash, page }
        }
    };
    let mut out = Vec::new();
    for part in parts {
        match *part {
            Part::L1 { from, len, stored, down } => {
                let mut run: Vec<&Block> = u[from..(from + len).min(u.len())].iter().collect();
                if down {
                    run.reverse();
                }
                out.extend(run.into_iter().map(|b| event(stored, Tier::L1, b)));
            }
            Part::Lower { tier, from, len, stored } => {
                out.extend(
                    (from..from + len).map(|k| event(stored, tiers[tier as usize], &chunks[k % chunks.len()].last)),
                );
            }
            Part::Demote { chunk, l3 } => {
                let chunk = &chunks[chunk % chunks.len()];
                out.push(event(true, Tier::L2, &chunk.last));
                if l3 {
                    out.push(event(true, Tier::L3, &chunk.last));
                }
                out.extend(chunk.blocks.iter().rev().map(|b| event(false, Tier::L1, b)));
            }
            Part::Cleared => out.push(KvEvent::Cleared),
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// In chunk mode, every instance's match, the shared match, the matched instances, the
    /// longest and the block count equal the model's after every operation, for every chain
    /// prompt, whether the events come in batches or one by one.
    #[test]
    fn chunk_matches_equal_a_walk_over_per_tier_sets(
        c in prop_oneof![Just(2usize), Just(4)],
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        let (u, prompts) = universe();
        let chunks = chunks(&prompts, c);
        let mut batched = chunk_index(c as u32);
        let mut single = chunk_index(c as u32);
        let mut model = Model::default();
        let mut m = PrefixMatches::default();
        for op in ops {
            match op {
                Op::Events { instance, parts } => {
                    let instance = InstanceId(instance);
                    let events = events(&parts, &u, &chunks);
                    let batch: KvEvents = events.iter().copied().collect();
                    batched.apply_batch(instance, &batch);
                    for e in &events {
                        single.apply(instance, e);
                        model.apply(instance, e);
                    }
                }
                Op::RemoveInstance { instance } => {
                    batched.remove_instance(InstanceId(instance));
                    single.remove_instance(InstanceId(instance));
                    model.apply(InstanceId(instance), &KvEvent::Cleared);
                }
            }
            for index in [&batched, &single] {
                index.check_invariants();
                prop_assert_eq!(index.blocks(), model.blocks(c));
                for prompt in &prompts {
                    index.match_prefix(prompt, &mut m);
                    check_matches(&m, prompt, |i| model.prefix(c, i, prompt))?;
                }
            }
        }
    }
}
