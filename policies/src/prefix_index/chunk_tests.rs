//! Chunk mode: L2 and L3 events naming chunks of blocks.

use super::tests::{chain, new_index, tm, A, B, C, PAGE};
use super::*;

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
