use super::*;
use proptest::prelude::*;

fn hashes(keys: &[u64]) -> Vec<BlockHash> {
    let mut h = BlockHash::ROOT;
    keys.iter()
        .map(|&k| {
            h = h.chain(k);
            h
        })
        .collect()
}

/// A sequence that computed `hs.len()` full blocks and committed them.
fn filled(kv: &mut KvCache, now: u64, hs: &[BlockHash]) -> SeqKv {
    let mut s = SeqKv::default();
    let hit = kv.match_more(Time(now), &mut s, hs, u32::MAX);
    assert!(kv.allocate(&mut s, hs.len() as u32 - hit));
    kv.commit(Time(now), &mut s, hs, hs.len() as u32);
    s
}

fn private(seqs: &[&SeqKv]) -> u32 {
    seqs.iter().map(|s| s.private_blocks()).sum()
}

#[test]
fn a_released_prompt_is_matched_by_the_next_request_with_the_same_prefix() {
    let mut kv = KvCache::new(16, 4);
    let mut a = filled(&mut kv, 1, &hashes(&[1, 2, 3]));
    kv.release(Time(2), &mut a);
    assert_eq!(kv.cached_blocks(), 3);
    assert_eq!(kv.available_blocks(), 16);
    let mut b = SeqKv::default();
    assert_eq!(kv.match_more(Time(3), &mut b, &hashes(&[1, 2, 9]), u32::MAX), 2);
    assert_eq!(b.tree_blocks, 2);
    assert_eq!(kv.used_blocks(), 2);
    kv.check_invariants(private(&[&b]));
}

#[test]
fn a_prompt_diverging_inside_a_cached_run_shares_the_common_part_only() {
    let mut kv = KvCache::new(16, 4);
    let mut a = filled(&mut kv, 1, &hashes(&[1, 2, 3, 4]));
    let mut b = SeqKv::default();
    assert_eq!(kv.match_more(Time(2), &mut b, &hashes(&[1, 2, 9]), u32::MAX), 2);
    assert_eq!(b.blocks[..], a.blocks[..2]);
    kv.check_invariants(private(&[&a, &b]));
    // Releasing the longer prompt leaves its tail evictable while the shared part is held.
    kv.release(Time(3), &mut a);
    assert_eq!(kv.used_blocks(), 2);
    let mut c = SeqKv::default();
    assert!(kv.allocate(&mut c, 14));
    assert_eq!(kv.cached_blocks(), 2, "the unshared tail went first");
    kv.check_invariants(private(&[&b, &c]));
}

#[test]
fn matching_resumes_from_the_cursor_without_rescanning() {
    let mut kv = KvCache::new(16, 4);
    let hs = hashes(&[1, 2, 3, 4]);
    let mut a = filled(&mut kv, 1, &hs);
    let mut b = SeqKv::default();
    assert_eq!(kv.match_more(Time(2), &mut b, &hs, 2), 2);
    assert_eq!(kv.match_more(Time(3), &mut b, &hs, 3), 1, "only the third block is new");
    assert_eq!(kv.match_more(Time(4), &mut b, &hs, 4), 1);
    assert_eq!(b.blocks, a.blocks);
    kv.release(Time(5), &mut a);
    kv.release(Time(5), &mut b);
    kv.check_invariants(0);
}

#[test]
fn committing_a_block_another_request_cached_meanwhile_shares_it() {
    let mut kv = KvCache::new(16, 4);
    let hs = hashes(&[1, 2]);
    let mut a = SeqKv::default();
    let mut b = SeqKv::default();
    assert!(kv.allocate(&mut a, 2));
    assert!(kv.allocate(&mut b, 2));
    kv.commit(Time(1), &mut a, &hs, 2);
    kv.commit(Time(1), &mut b, &hs, 2);
    assert_eq!(a.blocks, b.blocks, "b now points at a's blocks");
    assert_eq!(kv.cached_blocks(), 2);
    assert_eq!(kv.used_blocks(), 2, "b's copies went back to the pool");
    kv.check_invariants(private(&[&a, &b]));
}

#[test]
fn eviction_takes_the_least_recently_used_leaf_first() {
    let mut kv = KvCache::new(4, 1);
    let mut old = filled(&mut kv, 1, &hashes(&[1, 2]));
    let mut new = filled(&mut kv, 2, &hashes(&[3, 4]));
    kv.release(Time(3), &mut old);
    kv.release(Time(4), &mut new);
    let mut s = SeqKv::default();
    assert!(kv.allocate(&mut s, 2));
    // Both blocks of the older prompt went, leaf first; the newer prompt is intact.
    let mut probe = SeqKv::default();
    assert_eq!(kv.match_more(Time(5), &mut probe, &hashes(&[3, 4]), u32::MAX), 2);
    assert_eq!(kv.match_more(Time(5), &mut SeqKv::default(), &hashes(&[1]), u32::MAX), 0);
    kv.check_invariants(private(&[&s]));
}

#[test]
fn a_referenced_block_is_never_evicted_and_allocation_is_all_or_nothing() {
    let mut kv = KvCache::new(4, 1);
    let a = filled(&mut kv, 1, &hashes(&[1, 2, 3]));
    let mut s = SeqKv::default();
    assert!(!kv.allocate(&mut s, 2));
    assert!(s.blocks.is_empty());
    assert!(kv.allocate(&mut s, 1));
    kv.check_invariants(private(&[&a, &s]));
}

#[test]
fn kv_events_report_stored_blocks_with_their_page_and_removals() {
    let mut kv = KvCache::new(2, 1);
    kv.record_events();
    let hs = hashes(&[1, 2]);
    let mut a = filled(&mut kv, 1, &hs);
    kv.release(Time(2), &mut a);
    let mut s = SeqKv::default();
    assert!(kv.allocate(&mut s, 1));
    let mut ev = KvEvents::new();
    kv.drain_events(&mut ev);
    assert_eq!(
        ev.iter().collect::<Vec<_>>(),
        [
            KvEvent::Stored { tier: Tier::L1, hash: hs[0], page: hs[0] },
            KvEvent::Stored { tier: Tier::L1, hash: hs[1], page: hs[0] },
            KvEvent::Removed { tier: Tier::L1, hash: hs[1], page: hs[0] },
        ]
    );
}

#[test]
fn evicted_blocks_go_to_l2_and_through_to_l3_and_are_promoted_back_on_a_hit() {
    let l3 = SharedStore::new(8);
    let mut kv = KvCache::with_tiers(4, 1, 2, Some(l3.clone()));
    kv.record_events();
    let hs = hashes(&[1, 2, 3, 4]);
    let mut a = filled(&mut kv, 1, &hs);
    kv.release(Time(2), &mut a);
    // A different prompt takes all four L1 blocks: the old ones go to L2 (which keeps the
    // last two) and through to L3.
    let mut b = filled(&mut kv, 3, &hashes(&[9, 8, 7, 6]));
    assert_eq!(kv.l2_blocks(), 2);
    assert_eq!(l3.lock().len(), 4, "written through to L3");
    kv.release(Time(4), &mut b);
    let mut c = SeqKv::default();
    assert_eq!(kv.match_more(Time(5), &mut c, &hs, 4), 0, "nothing of it is left in L1");
    let hit = kv.peek_lower(&c, &hs, 4);
    assert_eq!(hit, LowerHit { l2: 2, l3: 2 });
    assert!(kv.promote(Time(5), &mut c, &hs, hit));
    assert_eq!((c.tree_blocks, c.private_blocks()), (4, 0));
    assert_eq!(l3.lock().len(), 8, "L3 keeps its shared copies; the second prompt's joined them");
    let mut ev = KvEvents::new();
    kv.drain_events(&mut ev);
    let stored = |t: Tier| ev.iter().filter(|e| matches!(e, KvEvent::Stored { tier, .. } if *tier == t)).count();
    assert_eq!((stored(Tier::L1), stored(Tier::L2), stored(Tier::L3)), (12, 8, 8));
    kv.check_invariants(0);
}

/// What the events of one cache say it holds, tier by tier.
#[derive(Default)]
struct EventModel {
    tiers: [std::collections::BTreeSet<BlockHash>; 3],
}

impl EventModel {
    fn apply(&mut self, events: &KvEvents) {
        for e in events.iter() {
            match e {
                KvEvent::Stored { tier, hash, .. } => assert!(self.tiers[tier.index()].insert(hash), "{e:?} twice"),
                KvEvent::Removed { tier, hash, .. } => assert!(self.tiers[tier.index()].remove(&hash), "{e:?} unknown"),
                KvEvent::Cleared => self.tiers[..2].iter_mut().for_each(|t| t.clear()),
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Start a sequence over a prompt drawn from a few shared prefixes.
    Start {
        prefix: u8,
        len: u8,
    },
    /// Grow sequence k by some private blocks.
    Grow {
        k: u8,
        n: u8,
    },
    /// Commit what sequence k has.
    Commit {
        k: u8,
    },
    Release {
        k: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..4, 1u8..8).prop_map(|(prefix, len)| Op::Start { prefix, len }),
        (any::<u8>(), 1u8..4).prop_map(|(k, n)| Op::Grow { k, n }),
        any::<u8>().prop_map(|k| Op::Commit { k }),
        any::<u8>().prop_map(|k| Op::Release { k }),
    ]
}

/// Carries out `op` at time `t`. A started prompt shares its first `shared` blocks with the
/// other prompts of its prefix group; with `load_lower`, its prefix continues from L2 and L3.
fn apply(kv: &mut KvCache, seqs: &mut Vec<(SeqKv, Vec<BlockHash>)>, t: usize, op: Op, shared: u64, load_lower: bool) {
    let now = Time(t as u64);
    match op {
        Op::Start { prefix, len } => {
            let keys: Vec<u64> = (0..u64::from(len))
                .map(|i| if i < shared { u64::from(prefix) * 100 + i } else { t as u64 * 1000 + i })
                .collect();
            let hs = hashes(&keys);
            let mut s = SeqKv::default();
            kv.match_more(now, &mut s, &hs, u32::MAX);
            if load_lower {
                let hit = kv.peek_lower(&s, &hs, u32::MAX);
                let _ = kv.promote(now, &mut s, &hs, hit);
            }
            seqs.push((s, hs));
        }
        Op::Grow { k, n } if !seqs.is_empty() => {
            let i = k as usize % seqs.len();
            let _ = kv.allocate(&mut seqs[i].0, u32::from(n));
        }
        Op::Commit { k } if !seqs.is_empty() => {
            let i = k as usize % seqs.len();
            let (s, hs) = &mut seqs[i];
            let full = s.blocks.len() as u32;
            kv.commit(now, s, hs, full);
        }
        Op::Release { k } if !seqs.is_empty() => {
            let i = k as usize % seqs.len();
            let (mut s, _) = seqs.swap_remove(i);
            kv.release(now, &mut s);
        }
        _ => {}
    }
}

proptest! {
    /// Whatever the order of operations, no block is leaked or counted twice, and releasing
    /// everything makes the whole cache available again.
    #[test]
    fn no_block_is_leaked_under_any_sequence_of_operations(ops in proptest::collection::vec(op(), 1..200)) {
        let mut kv = KvCache::new(24, 2);
        let mut seqs: Vec<(SeqKv, Vec<BlockHash>)> = Vec::new();
        for (t, op) in ops.into_iter().enumerate() {
            apply(&mut kv, &mut seqs, t, op, 3, false);
            kv.check_invariants(seqs.iter().map(|(s, _)| s.private_blocks()).sum());
        }
        for (s, _) in &mut seqs {
            kv.release(Time(10_000), s);
        }
        kv.check_invariants(0);
        prop_assert_eq!(kv.available_blocks(), 24);
    }

    /// With L2 and L3 on, and prefixes loaded back from them: no block is leaked, no block
    /// of the instance is in L1 and L2 at once, and the events describe every tier exactly.
    #[test]
    fn tiers_never_hold_a_block_twice_and_events_describe_them(ops in proptest::collection::vec(op(), 1..200)) {
        let l3 = SharedStore::new(10);
        let mut kv = KvCache::with_tiers(16, 2, 6, Some(l3.clone()));
        replay_tiers(&mut kv, &l3, ops, |kv, [l1, l2, l3_model], events, prompts| {
            // Every event names its block's page, as the prompts place it.
            let pages: std::collections::BTreeMap<BlockHash, BlockHash> = prompts
                .iter()
                .flat_map(|hs| (0..hs.len()).map(move |i| (hs[i], PageKey::at(hs, i).page)))
                .collect();
            for e in events.iter() {
                if let KvEvent::Stored { hash, page, .. } | KvEvent::Removed { hash, page, .. } = e {
                    prop_assert_eq!(Some(&page), pages.get(&hash), "{:?}", e);
                }
            }
            prop_assert!(l1.is_disjoint(l2), "a block in L1 and L2 at once");
            // Every block held below L1 is found where a prompt looks for it (its page).
            for hs in prompts {
                for i in 0..hs.len() {
                    prop_assert_eq!(kv.l2().contains(PageKey::at(hs, i)), l2.contains(&hs[i]));
                    prop_assert_eq!(l3.lock().contains(PageKey::at(hs, i)), l3_model.contains(&hs[i]));
                }
            }
            Ok(())
        })?;
    }

    /// With L2 and L3 in offload chunks of two blocks: no block is leaked, the stores hold
    /// only chunks' last blocks, never one L1 holds, the events describe every tier exactly,
    /// and a prompt's prefix below L1 goes on chunk by chunk as the events say.
    #[test]
    fn chunked_tiers_keep_whole_chunks_and_events_describe_them(ops in proptest::collection::vec(op(), 1..200)) {
        const C: usize = 2;
        let l3 = SharedStore::new(5);
        let mut kv = KvCache::with_tiers(16, 2, 6, Some(l3.clone())).offload_chunks(C as u32);
        let mut seqs = replay_tiers(&mut kv, &l3, ops, |kv, [l1, l2, l3_model], _, prompts| {
            prop_assert!(l2.len() <= 3 && l3_model.len() <= 5, "the stores hold chunks, not blocks");
            prop_assert_eq!(kv.l2_blocks(), (l2.len() * C) as u32);
            prop_assert!(l1.is_disjoint(l2), "a chunk in L2 while its last block is in L1");
            for hs in prompts {
                for (i, h) in hs.iter().enumerate() {
                    if (i + 1) % C != 0 {
                        prop_assert!(!l2.contains(h) && !l3_model.contains(h), "a block inside a chunk is kept below L1");
                    }
                }
                // From the prompt's start, chunk by chunk, in the best tier below L1.
                let mut want = LowerHit::default();
                for end in hs.chunks_exact(C).map(|c| c[C - 1]) {
                    if l2.contains(&end) {
                        want.l2 += C as u32;
                    } else if l3_model.contains(&end) {
                        want.l3 += C as u32;
                    } else {
                        break;
                    }
                }
                prop_assert_eq!(kv.peek_lower(&SeqKv::default(), hs, u32::MAX), want);
            }
            Ok(())
        })?;
        for (s, _) in &mut seqs {
            kv.release(Time(10_000), s);
        }
        kv.check_invariants(0);
    }
}

type Tiers = [std::collections::BTreeSet<BlockHash>; 3];

/// Carries out `ops` on `kv` (whose shared store is `l3`) with its events recorded and
/// prefixes loaded back from below, and after each: checks the invariants, that the events
/// replay to L1's size and to L2's and L3's contents, then `check` with the tiers as the
/// events tell them, the events of that op and the prompts so far. Returns the sequences
/// left running.
fn replay_tiers(
    kv: &mut KvCache,
    l3: &SharedStore,
    ops: Vec<Op>,
    mut check: impl FnMut(
        &KvCache,
        &Tiers,
        &KvEvents,
        &std::collections::BTreeSet<Vec<BlockHash>>,
    ) -> Result<(), TestCaseError>,
) -> Result<Vec<(SeqKv, Vec<BlockHash>)>, TestCaseError> {
    kv.record_events();
    let mut model = EventModel::default();
    let mut events = KvEvents::new();
    let mut seqs: Vec<(SeqKv, Vec<BlockHash>)> = Vec::new();
    let mut prompts = std::collections::BTreeSet::new();
    for (t, op) in ops.into_iter().enumerate() {
        apply(kv, &mut seqs, t, op, 5, true);
        kv.check_invariants(seqs.iter().map(|(s, _)| s.private_blocks()).sum());
        events.clear();
        kv.drain_events(&mut events);
        model.apply(&events);
        prompts.extend(seqs.iter().map(|(_, hs)| hs.clone()));
        let [l1, l2, l3_model] = &model.tiers;
        prop_assert_eq!(l1.len() as u32, kv.cached_blocks());
        prop_assert_eq!(l2, &kv.l2().iter().collect());
        prop_assert_eq!(l3_model, &l3.lock().iter().collect());
        check(kv, &model.tiers, &events, &prompts)?;
    }
    Ok(seqs)
}

/// A long prompt prefilled chunk by chunk through the cursor: each chunk's `match_more` and
/// `commit` take only the chunk's own blocks (in all, every block is matched or inserted
/// exactly once, and each chunk stores exactly its new blocks), and the cache ends exactly as
/// after one uninterrupted prefill: same blocks cached, same KV events, same blocks matched
/// by a later identical prompt and by the cached prompt it diverged from.
#[test]
fn a_prompt_prefilled_in_chunks_touches_each_block_once_and_caches_what_one_commit_does() {
    const BLOCKS: u32 = 40;
    let prompt = hashes(&(0..u64::from(BLOCKS)).collect::<Vec<_>>());
    // A cached prompt shares the first 10 blocks, so a chunk boundary can fall inside its run.
    let other = hashes(&(0..10).chain(100..105).collect::<Vec<_>>());
    let prefill = |chunk_blocks: u32| {
        let mut kv = KvCache::new(64, 4);
        let mut o = filled(&mut kv, 1, &other);
        kv.release(Time(2), &mut o);
        kv.record_events();
        let mut s = SeqKv::default();
        let (mut touched, mut end, mut t) = (0, 0, 3);
        let mut events = KvEvents::new();
        while end < BLOCKS {
            end = (end + chunk_blocks).min(BLOCKS);
            touched += kv.match_more(Time(t), &mut s, &prompt, end);
            let need = end - s.blocks.len() as u32;
            assert!(kv.allocate(&mut s, need));
            let before = s.tree_blocks;
            kv.commit(Time(t), &mut s, &prompt, end);
            let inserted = s.tree_blocks - before;
            touched += inserted;
            assert_eq!(touched, end, "{chunk_blocks}-block chunks: the chunk ending at {end} went over earlier blocks");
            let seen = events.len();
            kv.drain_events(&mut events);
            assert_eq!(events.len() - seen, inserted as usize, "{chunk_blocks}-block chunks: stored blocks");
            kv.check_invariants(private(&[&s]));
            t += 1;
        }
        let (table, cached) = (s.blocks.clone(), kv.cached_blocks());
        kv.release(Time(t), &mut s);
        kv.check_invariants(0);
        // A walk that took references on the prefix again would leave it held.
        assert_eq!(kv.available_blocks(), 64, "{chunk_blocks}-block chunks: blocks still held after release");
        let mut later = SeqKv::default();
        assert_eq!(kv.match_more(Time(t + 1), &mut later, &prompt, u32::MAX), BLOCKS);
        let mut again = SeqKv::default();
        kv.match_more(Time(t + 1), &mut again, &other, u32::MAX);
        (table, cached, events, later.blocks, again.blocks)
    };
    let whole = prefill(BLOCKS);
    assert_eq!(whole.1, BLOCKS + 5);
    assert_eq!(whole.2.len(), (BLOCKS - 10) as usize, "the shared blocks are matched, not stored again");
    for chunk_blocks in 1..BLOCKS {
        assert_eq!(prefill(chunk_blocks), whole, "{chunk_blocks}-block chunks");
    }
}
