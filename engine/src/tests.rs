//! Scheduler behaviour, driven step by step with a fixed-duration executor.

use crate::kv::SharedStore;
use crate::*;
use proptest::prelude::*;

/// Every iteration takes 1 ms plus 1 µs per token: enough to order events.
struct Fixed;

impl Executor for Fixed {
    fn execute(&mut self, batch: &Batch, _out: &mut StepOutput) -> Result<Dur, ExecutorError> {
        Ok(Dur(1_000 + batch.stats.tokens()))
    }
}

fn config(total_blocks: u32, max_batch_tokens: u32) -> InstanceConfig {
    InstanceConfig {
        block_size: 4,
        total_blocks,
        max_batch_tokens,
        max_seqs: 64,
        admission_watermark: 0.0,
        l2_blocks: 0,
        prefill: PrefillPolicy::Fcfs,
    }
}

fn req(id: u64, prompt: u32, output: u32, prefix: &[u64]) -> Request {
    let mut h = BlockHash::ROOT;
    let block_hashes = (0..prompt / 4)
        .map(|i| {
            let key = prefix.get(i as usize).copied().unwrap_or(id * 1_000_000 + u64::from(i));
            h = h.chain(key);
            h
        })
        .collect();
    Request { id: RequestId(id), arrival: Time::ZERO, prompt_tokens: prompt, max_output_tokens: output, block_hashes }
}

/// Runs the instance until idle; returns finished requests and the batches' stats.
fn run(inst: &mut Instance, mut now: Time) -> (Vec<Finished>, Vec<BatchStats>, Time) {
    let mut done = Vec::new();
    let mut stats = Vec::new();
    for _ in 0..100_000 {
        let Some(d) = inst.begin_step(now, &mut Fixed).expect("fixed executor") else {
            break;
        };
        stats.push(inst.batch().stats);
        now += d;
        inst.end_step(now, &mut done);
    }
    assert!(!inst.has_work(), "instance did not drain");
    (done, stats, now)
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_under_the_token_budget() {
    let mut inst = Instance::new(config(64, 16));
    inst.enqueue(req(1, 40, 3, &[])).unwrap();
    let (done, stats, _) = run(&mut inst, Time::ZERO);
    let prefill: Vec<u64> = stats.iter().map(|s| s.prefill_tokens).collect();
    assert_eq!(prefill, [16, 16, 8, 0, 0]);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].output_tokens, 3);
}

#[test]
fn decodes_are_scheduled_before_prefill_chunks() {
    let mut inst = Instance::new(config(64, 8));
    inst.enqueue(req(1, 4, 10, &[])).unwrap();
    let mut done = Vec::new();
    let d = inst.begin_step(Time::ZERO, &mut Fixed).unwrap().unwrap();
    inst.end_step(Time::ZERO + d, &mut done);
    inst.enqueue(req(2, 64, 2, &[])).unwrap();
    inst.begin_step(Time(10_000), &mut Fixed).unwrap();
    let s = inst.batch().stats;
    assert_eq!((s.decode_seqs, s.prefill_tokens), (1, 7), "decode takes 1 of the 8 tokens first");
}

#[test]
fn the_second_request_with_a_shared_prefix_hits_the_cache() {
    let mut inst = Instance::new(config(64, 64));
    inst.enqueue(req(1, 32, 2, &[7, 7, 7, 7, 7])).unwrap();
    let (mut done, _, now) = run(&mut inst, Time::ZERO);
    inst.enqueue(req(2, 32, 2, &[7, 7, 7, 7, 7])).unwrap();
    done.extend(run(&mut inst, now).0);
    assert_eq!(done[0].cached_total(), 0);
    assert_eq!(done[1].cached_total(), 20, "five shared blocks of four tokens");
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut inst = Instance::new(config(64, 64));
    inst.enqueue(req(1, 16, 1, &[1, 2, 3, 4])).unwrap();
    let (_, _, now) = run(&mut inst, Time::ZERO);
    inst.enqueue(req(2, 16, 1, &[1, 2, 3, 4])).unwrap();
    let (done, stats, _) = run(&mut inst, now);
    assert_eq!(done[0].cached_total(), 12);
    assert_eq!(stats[0].prefill_tokens, 4);
}

#[test]
fn running_out_of_kv_preempts_the_newest_request_which_then_recomputes() {
    // 12 blocks of 4 tokens; two requests of 16 + 16 tokens cannot both finish at once.
    let mut inst = Instance::new(config(12, 64));
    inst.enqueue(req(1, 16, 17, &[])).unwrap();
    inst.enqueue(req(2, 16, 17, &[])).unwrap();
    let (done, _, _) = run(&mut inst, Time::ZERO);
    assert_eq!(done.len(), 2);
    assert_eq!(done.iter().map(|f| f.preemptions).sum::<u32>(), 1);
    let preempted = done.iter().find(|f| f.preemptions == 1).unwrap();
    assert_eq!(preempted.request.id, RequestId(2), "the newest is preempted");
    assert!(done.iter().all(|f| f.output_tokens == 17));
}

#[test]
fn a_request_larger_than_the_whole_cache_is_refused() {
    let mut inst = Instance::new(config(4, 64));
    let (err, back) = inst.enqueue(req(1, 16, 2, &[])).unwrap_err();
    assert_eq!(err, Rejected::TooLarge { needed_tokens: 17, capacity_tokens: 16 });
    assert_eq!(back.id, RequestId(1));
    assert_eq!(inst.enqueue(req(2, 0, 2, &[])).unwrap_err().0, Rejected::EmptyPrompt);
}

#[test]
fn a_prefix_evicted_to_lower_tiers_is_loaded_back_and_its_transfer_charged() {
    let l3 = SharedStore::new(64);
    let mut inst = Instance::with_shared_store(InstanceConfig { l2_blocks: 2, ..config(8, 64) }, Some(l3.clone()));
    let shared = [1, 2, 3, 4, 5];
    inst.enqueue(req(1, 24, 1, &shared)).unwrap();
    run(&mut inst, Time::ZERO);
    // Another 24-token prompt needs six of the eight blocks: the first prompt's blocks go down.
    inst.enqueue(req(2, 24, 1, &[])).unwrap();
    run(&mut inst, Time(100));
    assert!(inst.kv().l2_blocks() > 0 && !l3.lock().is_empty());
    inst.enqueue(req(3, 24, 1, &shared)).unwrap();
    let (done, stats, _) = run(&mut inst, Time(200));
    let [l1, l2, l3_hit] = done[0].cached_tokens;
    assert_eq!(l1 + l2 + l3_hit, 20, "five shared blocks of four tokens, from some tier");
    assert!(l2 > 0 && l3_hit > 0, "found in L2 and L3: {:?}", done[0].cached_tokens);
    assert_eq!((stats[0].load_l2_tokens, stats[0].load_l3_tokens), (u64::from(l2), u64::from(l3_hit)));
    assert_eq!(stats[0].prefill_tokens, 4, "only the uncached last block is computed");
}

fn fair(chunk_tokens: u32, quota_kv_share: f64, long_min_tokens: u32) -> PrefillPolicy {
    PrefillPolicy::Fair(FairPrefill { chunk_tokens, quota_kv_share, quota_growth: 2.0, long_min_tokens })
}

/// The seed's picture: a long prompt B admitted first, then short prompts C and D.
fn first_tokens_of_b_c_d(prefill: PrefillPolicy) -> Vec<(u64, Time)> {
    let mut inst = Instance::new(InstanceConfig { prefill, ..config(256, 16) });
    inst.enqueue(req(1, 160, 1, &[])).unwrap();
    let (done, _, _) = {
        inst.enqueue(req(2, 8, 1, &[])).unwrap();
        inst.enqueue(req(3, 8, 1, &[])).unwrap();
        run(&mut inst, Time::ZERO)
    };
    let mut firsts: Vec<(u64, Time)> = done.iter().map(|f| (f.request.id.0, f.first_token_at)).collect();
    firsts.sort();
    firsts
}

#[test]
fn fair_prefill_serves_prompts_that_fit_one_chunk_before_a_long_one() {
    // Budget 16 tokens a step; B needs 10 steps alone.
    let fcfs = first_tokens_of_b_c_d(PrefillPolicy::Fcfs);
    let fair = first_tokens_of_b_c_d(fair(8, 0.0, 4));
    // FCFS: C and D wait for B's whole prompt; fair: they finish in the first step.
    assert!(fcfs[1].1 > fcfs[0].1 && fcfs[2].1 > fcfs[0].1, "{fcfs:?}");
    assert!(fair[1].1 < fair[0].1 && fair[2].1 < fair[0].1, "{fair:?}");
    // B still computes its 160 tokens, only later: the first step gave it the 4 reserved.
    assert!(fair[0].1 > fcfs[0].1);
}

#[test]
fn a_long_prefill_that_yields_resumes_where_it_stopped_and_caches_the_same_blocks() {
    let shared: Vec<u64> = (0..40).map(|i| 7_000 + i).collect();
    let finished = |prefill| {
        let mut inst = Instance::new(InstanceConfig { prefill, ..config(512, 32) });
        // Two long prompts take turns: quotas of 1% of 2,048 KV tokens = 20, then 40, 80, ...
        inst.enqueue(req(1, 160, 1, &shared)).unwrap();
        inst.enqueue(req(2, 160, 1, &[])).unwrap();
        let (mut done, stats, end) = run(&mut inst, Time::ZERO);
        let computed: u64 = stats.iter().map(|s| s.prefill_tokens).sum();
        // Then the first prompt again: everything but its last block comes from the cache.
        inst.enqueue(req(3, 160, 1, &shared)).unwrap();
        let (again, _, _) = run(&mut inst, end);
        done.sort_by_key(|f| f.request.id);
        (
            done.iter().map(|f| f.yields).collect::<Vec<_>>(),
            computed,
            again[0].cached_total(),
            inst.kv().cached_blocks(),
        )
    };
    let (fcfs_yields, fcfs_computed, fcfs_hit, fcfs_cached) = finished(PrefillPolicy::Fcfs);
    let (fair_yields, fair_computed, fair_hit, fair_cached) = finished(fair(8, 0.01, 4));
    assert_eq!(fcfs_yields, [0, 0]);
    assert!(fair_yields.iter().all(|&y| y > 0), "both yielded: {fair_yields:?}");
    assert_eq!(fair_computed, fcfs_computed, "no token computed twice");
    assert_eq!((fair_hit, fair_cached), (fcfs_hit, fcfs_cached));
    assert_eq!(fair_hit, 156);
}

#[test]
fn a_long_prefill_finishes_within_the_stated_bound_under_a_stream_of_short_ones() {
    // Budget 16, chunk 8: two short prompts of 6 tokens arrive every step, enough to fill it;
    // the long one has 200 tokens and gets little more than the 4 reserved: the bound is 50.
    let long_min = 4;
    let mut inst = Instance::new(InstanceConfig { prefill: fair(8, 0.0, long_min), ..config(1024, 16) });
    inst.enqueue(req(1, 200, 1, &[])).unwrap();
    let mut now = Time::ZERO;
    let mut done = Vec::new();
    let mut steps = 0u32;
    while done.iter().all(|f: &Finished| f.request.id != RequestId(1)) {
        inst.enqueue(req(1000 + u64::from(steps), 6, 1, &[])).unwrap();
        inst.enqueue(req(2000 + u64::from(steps), 6, 1, &[])).unwrap();
        let d = inst.begin_step(now, &mut Fixed).unwrap().expect("work");
        now += d;
        inst.end_step(now, &mut done);
        steps += 1;
        assert!(steps <= 200 / long_min, "the long prompt starved past its bound");
    }
    let shorts = done.iter().filter(|f| f.request.id.0 >= 1000).count() as u32;
    assert!(shorts + 2 >= 2 * steps, "short prompts kept being served: {shorts} in {steps} steps");
    assert!(steps >= 200 / 16 * 3, "the long one ran on what the shorts left: {steps} steps");
}

#[test]
fn timestamps_of_a_finished_request_are_ordered() {
    let mut inst = Instance::new(config(64, 64));
    inst.enqueue(req(1, 10, 5, &[])).unwrap();
    let (done, _, end) = run(&mut inst, Time(5));
    let f = &done[0];
    assert!(
        f.request.arrival <= f.admitted_at && f.admitted_at <= f.first_token_at && f.first_token_at <= f.finished_at
    );
    assert_eq!(f.finished_at, end);
}

proptest! {
    /// Random arrivals into a small, contended instance: every request finishes with all of
    /// its tokens, and no block is leaked (invariants are checked after every step).
    #[test]
    fn every_request_finishes_and_no_block_leaks(
        reqs in proptest::collection::vec((0u64..50_000, 1u32..120, 0u32..40, 0u64..3), 1..40),
        blocks in 40u32..80,
        budget in 4u32..64,
        l2_blocks in 0u32..20,
        l3_blocks in proptest::option::of(0u32..30),
        fair_prefill in proptest::option::of((1u32..64, 0.0f64..0.2, 1u32..16)),
    ) {
        let prefill = match fair_prefill {
            None => PrefillPolicy::Fcfs,
            Some((chunk, share, long_min)) => fair(chunk, share, long_min),
        };
        let config = InstanceConfig { block_size: 4, total_blocks: blocks, max_batch_tokens: budget, max_seqs: 8, admission_watermark: 0.05, l2_blocks, prefill };
        let mut inst = Instance::with_shared_store(config, l3_blocks.map(SharedStore::new));
        let mut arrivals: Vec<(Time, Request)> = reqs.iter().enumerate().map(|(i, &(t, p, o, g))| {
            let shared = [g, g + 10, g + 20];
            let mut r = req(i as u64, p, o, &shared);
            r.arrival = Time(t);
            (Time(t), r)
        }).collect();
        arrivals.sort_by_key(|(t, r)| (*t, r.id));
        let mut queue = arrivals.into_iter().peekable();
        let mut now = Time::ZERO;
        let mut done = Vec::new();
        let mut accepted = 0;
        for _ in 0..1_000_000 {
            while let Some((t, _)) = queue.peek() {
                if *t > now { break; }
                let (_, r) = queue.next().unwrap();
                if inst.enqueue(r).is_ok() { accepted += 1; }
            }
            match inst.begin_step(now, &mut Fixed).unwrap() {
                Some(d) => { now += d; inst.end_step(now, &mut done); }
                None => match queue.peek() { Some((t, _)) => now = *t, None => break },
            }
        }
        prop_assert_eq!(done.len(), accepted);
        for f in &done {
            prop_assert_eq!(f.output_tokens, f.request.max_output_tokens.max(1));
            prop_assert!(f.cached_total() < f.request.prompt_tokens, "the last prompt token is always computed");
        }
        prop_assert_eq!(inst.kv().available_blocks(), blocks);
    }
}
