//! Scheduler behaviour, driven step by step with a fixed-duration executor.

use crate::kv::SharedStore;
use crate::*;
use proptest::prelude::*;

/// Every iteration takes 1 ms plus 1 µs per token: enough to order events.
pub(crate) struct Fixed;

impl Executor for Fixed {
    fn execute(&mut self, batch: &Batch, _out: &mut StepOutput) -> Result<Dur, ExecutorError> {
        Ok(Dur(1_000 + batch.stats.tokens()))
    }
}

/// Verifies `k` drafts per decode and accepts a seeded random number of them (any from none
/// to all), so that the scheduler is checked whatever the acceptance.
pub(crate) struct Speculating {
    k: u32,
    rng: rand_chacha::ChaCha8Rng,
}

impl Speculating {
    pub(crate) fn new(k: u32, seed: u64) -> Speculating {
        use rand::SeedableRng;
        Speculating { k, rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed) }
    }
}

impl Executor for Speculating {
    fn draft_tokens(&self) -> u32 {
        self.k
    }

    fn execute(&mut self, batch: &Batch, out: &mut StepOutput) -> Result<Dur, ExecutorError> {
        use rand::Rng;
        for e in &batch.entries {
            let drafts = if e.is_prefill { 0 } else { e.new_tokens - 1 };
            out.accepted.push(self.rng.random_range(0..=drafts));
        }
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
        offload_chunk_blocks: 1,
        prefill: PrefillPolicy::Fcfs,
        kv_protection: None,
        class_priority: false,
        lower_class_step_tokens: None,
        program_hold: None,
    }
}

/// A request whose blocks are unique to it after `prefix` (content keys of shared blocks).
pub(crate) fn req(id: u64, prompt: u32, output: u32, prefix: &[u64]) -> Request {
    let mut h = BlockHash::ROOT;
    let block_hashes = (0..prompt / 4)
        .map(|i| {
            let key = prefix.get(i as usize).copied().unwrap_or(id * 1_000_000 + u64::from(i));
            h = h.chain(key);
            h
        })
        .collect();
    Request {
        id: RequestId(id),
        arrival: Time::ZERO,
        prompt_tokens: prompt,
        max_output_tokens: output,
        ends_after: None,
        block_hashes,
        resume: None,
        service: Default::default(),
        model: Default::default(),
    }
}

/// Runs the instance until idle; returns finished requests and the batches' stats.
fn run(inst: &mut Instance, mut now: Time) -> (Vec<Finished>, Vec<BatchStats>, Time) {
    let mut done = Vec::new();
    let mut evicted = Vec::new();
    let mut stats = Vec::new();
    for _ in 0..100_000 {
        let Some(d) = inst.begin_step(now, &mut Fixed).expect("fixed executor") else {
            break;
        };
        stats.push(inst.batch().stats);
        now += d;
        inst.end_step(now, &mut done, &mut evicted);
    }
    assert!(!inst.has_work(), "instance did not drain");
    assert!(evicted.is_empty(), "no protection, no eviction");
    (done, stats, now)
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_under_the_token_budget() {
    let mut inst = Instance::new(config(64, 16));
    inst.enqueue(Time::ZERO, req(1, 40, 3, &[])).unwrap();
    let (done, stats, _) = run(&mut inst, Time::ZERO);
    let prefill: Vec<u64> = stats.iter().map(|s| s.prefill_tokens).collect();
    assert_eq!(prefill, [16, 16, 8, 0, 0]);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].output_tokens, 3);
}

/// The load report knows only the client's bound (as a live engine's would); the request
/// still ends at its end-of-sequence, and what the bound counted beyond it leaves the report.
#[test]
fn a_request_ending_before_its_bound_is_reported_to_the_bound_and_ends_at_its_end_of_sequence() {
    let mut inst = Instance::new(config(64, 64));
    let mut r = req(1, 8, 100, &[]);
    r.ends_after = std::num::NonZeroU32::new(3);
    inst.enqueue(Time::ZERO, r).unwrap();
    assert_eq!(inst.load().decode_tokens_left, 100);
    let mut done = Vec::new();
    let d = inst.begin_step(Time::ZERO, &mut Fixed).unwrap().unwrap();
    inst.end_step(Time::ZERO + d, &mut done, &mut Vec::new());
    assert_eq!(inst.load().decode_tokens_left, 99, "the prefill's token counts against the bound");
    let (rest, _, _) = run(&mut inst, Time::ZERO + d);
    assert_eq!((rest.len(), rest[0].output_tokens), (1, 3));
    assert_eq!(inst.load().decode_tokens_left, 0);
}

#[test]
fn decodes_are_scheduled_before_prefill_chunks() {
    let mut inst = Instance::new(config(64, 8));
    inst.enqueue(Time::ZERO, req(1, 4, 10, &[])).unwrap();
    let mut done = Vec::new();
    let d = inst.begin_step(Time::ZERO, &mut Fixed).unwrap().unwrap();
    inst.end_step(Time::ZERO + d, &mut done, &mut Vec::new());
    inst.enqueue(Time(10_000), req(2, 64, 2, &[])).unwrap();
    inst.begin_step(Time(10_000), &mut Fixed).unwrap();
    let s = inst.batch().stats;
    assert_eq!((s.decode_seqs, s.prefill_tokens), (1, 7), "decode takes 1 of the 8 tokens first");
}

#[test]
fn the_second_request_with_a_shared_prefix_hits_the_cache() {
    let mut inst = Instance::new(config(64, 64));
    inst.enqueue(Time::ZERO, req(1, 32, 2, &[7, 7, 7, 7, 7])).unwrap();
    let (mut done, _, now) = run(&mut inst, Time::ZERO);
    inst.enqueue(now, req(2, 32, 2, &[7, 7, 7, 7, 7])).unwrap();
    done.extend(run(&mut inst, now).0);
    assert_eq!(done[0].cached_total(), 0);
    assert_eq!(done[1].cached_total(), 20, "five shared blocks of four tokens");
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut inst = Instance::new(config(64, 64));
    inst.enqueue(Time::ZERO, req(1, 16, 1, &[1, 2, 3, 4])).unwrap();
    let (_, _, now) = run(&mut inst, Time::ZERO);
    inst.enqueue(now, req(2, 16, 1, &[1, 2, 3, 4])).unwrap();
    let (done, stats, _) = run(&mut inst, now);
    assert_eq!(done[0].cached_total(), 12);
    assert_eq!(stats[0].prefill_tokens, 4);
}

#[test]
fn running_out_of_kv_preempts_the_newest_request_which_then_recomputes() {
    // 12 blocks of 4 tokens; two requests of 16 + 16 tokens cannot both finish at once.
    let mut inst = Instance::new(config(12, 64));
    inst.enqueue(Time::ZERO, req(1, 16, 17, &[])).unwrap();
    inst.enqueue(Time::ZERO, req(2, 16, 17, &[])).unwrap();
    let (done, _, _) = run(&mut inst, Time::ZERO);
    assert_eq!(done.len(), 2);
    assert_eq!(done.iter().map(|f| f.preemptions).sum::<u32>(), 1);
    let preempted = done.iter().find(|f| f.preemptions == 1).unwrap();
    assert_eq!(preempted.request.id, RequestId(2), "the newest is preempted");
    assert!(done.iter().all(|f| f.output_tokens == 17));
}

fn of_class(mut r: Request, class: Class) -> Request {
    r.service.class = class;
    r
}

/// The order in which requests of 16-token prompts (one a step), each of a class and lifted
/// or not, get their first tokens on an instance with class priority `priority`.
fn first_token_order(priority: bool, requests: &[(u64, Class, bool)]) -> Vec<u64> {
    let mut inst = Instance::new(InstanceConfig { class_priority: priority, ..config(64, 16) });
    for &(id, class, lift) in requests {
        let mut r = of_class(req(id, 16, 2, &[]), class);
        r.service.lift = lift;
        inst.enqueue(Time::ZERO, r).unwrap();
    }
    let (mut done, _, _) = run(&mut inst, Time::ZERO);
    done.sort_by_key(|f| f.first_token_at);
    done.iter().map(|f| f.request.id.0).collect()
}

/// With class priority an interactive request is admitted ahead of batch requests queued
/// before it; without, FCFS.
#[test]
fn class_priority_admits_a_higher_class_first() {
    let requests = [(1, Class::Batch, false), (2, Class::Standard, false), (3, Class::Interactive, false)];
    assert_eq!(first_token_order(true, &requests), [3, 2, 1]);
    assert_eq!(first_token_order(false, &requests), [1, 2, 3]);
}

/// A lifted request (flow control's mark for a tenant under its share) is served one class
/// higher: a lifted standard one as interactive, a lifted batch one as standard (FCFS with
/// the standard one queued before it).
#[test]
fn a_lifted_request_is_served_one_class_higher() {
    let requests =
        [(1, Class::Batch, false), (2, Class::Standard, false), (3, Class::Batch, true), (4, Class::Standard, true)];
    assert_eq!(first_token_order(true, &requests), [4, 2, 3, 1]);
}

/// With class priority an interactive prompt arriving while a long batch prompt is being
/// computed takes the next chunk; FCFS leaves it behind every chunk of the long one.
#[test]
fn class_priority_gives_the_next_chunk_to_a_higher_class() {
    for (priority, wait_steps) in [(true, 1), (false, 8)] {
        let mut inst = Instance::new(InstanceConfig { class_priority: priority, ..config(512, 16) });
        inst.enqueue(Time::ZERO, of_class(req(1, 128, 2, &[]), Class::Batch)).unwrap();
        let mut done = Vec::new();
        let d = inst.begin_step(Time::ZERO, &mut Fixed).unwrap().unwrap();
        let mut now = Time::ZERO + d;
        inst.end_step(now, &mut done, &mut Vec::new());
        inst.enqueue(now, of_class(req(2, 16, 2, &[]), Class::Interactive)).unwrap();
        let mut steps = 0;
        loop {
            let d = inst.begin_step(now, &mut Fixed).unwrap().unwrap();
            steps += 1;
            let takes_interactive = inst.batch().entries.iter().any(|e| e.request == RequestId(2));
            now += d;
            inst.end_step(now, &mut done, &mut Vec::new());
            if takes_interactive {
                break;
            }
        }
        assert_eq!(steps, wait_steps, "class priority {priority}");
    }
}

/// While an interactive request decodes, a batch prompt's chunks are capped; once it is
/// done, the batch prompt takes the whole budget again.
#[test]
fn lower_class_chunks_are_capped_while_an_interactive_request_decodes() {
    let config = InstanceConfig { class_priority: true, lower_class_step_tokens: Some(4), ..config(512, 32) };
    let mut inst = Instance::new(config);
    inst.enqueue(Time::ZERO, of_class(req(1, 4, 3, &[]), Class::Interactive)).unwrap();
    inst.enqueue(Time::ZERO, of_class(req(2, 200, 1, &[]), Class::Batch)).unwrap();
    let (_, stats, _) = run(&mut inst, Time::ZERO);
    let prefill: Vec<u64> = stats.iter().map(|s| s.prefill_tokens).take(5).collect();
    // Step 1: the interactive prompt (4) and 28 of the batch one; then 4 a step while the
    // interactive request decodes (2 more tokens); then the full budget.
    assert_eq!(prefill, [32, 4, 4, 32, 32]);
}

/// With class priority, running out of KV preempts the batch request although the
/// interactive one was admitted after it.
#[test]
fn class_priority_preempts_the_lowest_class_first() {
    let mut inst = Instance::new(InstanceConfig { class_priority: true, ..config(12, 64) });
    inst.enqueue(Time::ZERO, of_class(req(1, 16, 17, &[]), Class::Batch)).unwrap();
    inst.enqueue(Time::ZERO, of_class(req(2, 16, 17, &[]), Class::Interactive)).unwrap();
    let (done, _, _) = run(&mut inst, Time::ZERO);
    let preempted: Vec<u64> = done.iter().filter(|f| f.preemptions > 0).map(|f| f.request.id.0).collect();
    assert_eq!(preempted, [1], "the batch request is preempted");
}

#[test]
fn a_request_larger_than_the_whole_cache_is_refused() {
    let mut inst = Instance::new(config(4, 64));
    let (err, back) = inst.enqueue(Time::ZERO, req(1, 16, 2, &[])).unwrap_err();
    assert_eq!(err, Rejected::TooLarge { needed_tokens: 17, capacity_tokens: 16 });
    assert_eq!(back.id, RequestId(1));
    assert_eq!(inst.enqueue(Time::ZERO, req(2, 0, 2, &[])).unwrap_err().0, Rejected::EmptyPrompt);
}

#[test]
fn a_prefix_evicted_to_lower_tiers_is_loaded_back_and_its_transfer_charged() {
    let l3 = SharedStore::new(64);
    let mut inst = Instance::with_shared_store(InstanceConfig { l2_blocks: 2, ..config(8, 64) }, Some(l3.clone()));
    let shared = [1, 2, 3, 4, 5];
    inst.enqueue(Time::ZERO, req(1, 24, 1, &shared)).unwrap();
    run(&mut inst, Time::ZERO);
    // Another 24-token prompt needs six of the eight blocks: the first prompt's blocks go down.
    inst.enqueue(Time(100), req(2, 24, 1, &[])).unwrap();
    run(&mut inst, Time(100));
    assert!(inst.kv().l2_blocks() > 0 && !l3.lock().is_empty());
    inst.enqueue(Time(200), req(3, 24, 1, &shared)).unwrap();
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
    inst.enqueue(Time::ZERO, req(1, 160, 1, &[])).unwrap();
    let (done, _, _) = {
        inst.enqueue(Time::ZERO, req(2, 8, 1, &[])).unwrap();
        inst.enqueue(Time::ZERO, req(3, 8, 1, &[])).unwrap();
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
        inst.enqueue(Time::ZERO, req(1, 160, 1, &shared)).unwrap();
        inst.enqueue(Time::ZERO, req(2, 160, 1, &[])).unwrap();
        let (mut done, stats, end) = run(&mut inst, Time::ZERO);
        let computed: u64 = stats.iter().map(|s| s.prefill_tokens).sum();
        // Then the first prompt again: everything but its last block comes from the cache.
        inst.enqueue(end, req(3, 160, 1, &shared)).unwrap();
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
    inst.enqueue(Time::ZERO, req(1, 200, 1, &[])).unwrap();
    let mut now = Time::ZERO;
    let mut done = Vec::new();
    let mut steps = 0u32;
    while done.iter().all(|f: &Finished| f.request.id != RequestId(1)) {
        inst.enqueue(now, req(1000 + u64::from(steps), 6, 1, &[])).unwrap();
        inst.enqueue(now, req(2000 + u64::from(steps), 6, 1, &[])).unwrap();
        let d = inst.begin_step(now, &mut Fixed).unwrap().expect("work");
        now += d;
        inst.end_step(now, &mut done, &mut Vec::new());
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
    inst.enqueue(Time::ZERO, req(1, 10, 5, &[])).unwrap();
    let (done, _, end) = run(&mut inst, Time(5));
    let f = &done[0];
    assert!(
        f.request.arrival <= f.admitted_at && f.admitted_at <= f.first_token_at && f.first_token_at <= f.finished_at
    );
    assert_eq!(f.finished_at, end);
}

fn protection(high_water: f64, low_water: f64, runaway: Option<u32>, action: RunawayAction) -> Option<KvProtection> {
    Some(KvProtection {
        high_water,
        low_water,
        runaway_output_tokens: runaway,
        runaway_action: action,
        max_evictions: u32::MAX,
    })
}

/// Steps the instance until it is idle, calling `on_step` after each step with the step's
/// end time; checks the invariants after every step. Returns the end time.
fn drive(
    inst: &mut Instance,
    mut now: Time,
    done: &mut Vec<Finished>,
    evicted: &mut Vec<Evicted>,
    mut on_step: impl FnMut(&mut Instance, Time, &[Finished], &[Evicted]),
) -> Time {
    for _ in 0..100_000 {
        let Some(d) = inst.begin_step(now, &mut Fixed).expect("fixed executor") else {
            return now;
        };
        now += d;
        inst.end_step(now, done, evicted);
        inst.check_invariants();
        on_step(inst, now, done, evicted);
    }
    panic!("instance did not drain");
}

#[test]
fn admission_pauses_at_the_high_water_mark_and_resumes_at_the_low_one() {
    // 40 blocks of 4 tokens: high water 20 blocks, low water 10. A holds 15 blocks and grows;
    // B holds 1 and grows. Together they pass 20 blocks after about 8 tokens each.
    let config =
        InstanceConfig { kv_protection: protection(0.5, 0.25, None, RunawayAction::Reroute), ..config(40, 128) };
    let mut inst = Instance::new(config);
    inst.enqueue(Time::ZERO, req(1, 60, 30, &[])).unwrap();
    inst.enqueue(Time::ZERO, req(2, 4, 60, &[])).unwrap();
    let (mut done, mut evicted) = (Vec::new(), Vec::new());
    let mut paused_at = None;
    let end = drive(&mut inst, Time::ZERO, &mut done, &mut evicted, |inst, now, _, _| {
        assert_eq!(inst.load().admission_paused, inst.admission_paused());
        if inst.admission_paused() && paused_at.is_none() {
            paused_at = Some(now);
            // C arrives while admission is paused: it waits although KV has room for it.
            assert!(inst.kv().available_blocks() > 1);
            inst.enqueue(now, req(3, 4, 1, &[])).unwrap();
        }
    });
    let paused_at = paused_at.expect("KV use reached the high-water mark");
    let f = |id| done.iter().find(|f: &&Finished| f.request.id == RequestId(id)).expect("finished");
    let (a, b, c) = (f(1), f(2), f(3));
    // A's finish leaves B's 9 blocks, under the low-water mark: C is admitted at once, while
    // B still runs.
    assert_eq!(c.admitted_at, a.finished_at);
    assert!(c.admitted_at < b.finished_at);
    assert_eq!(c.paused_wait, a.finished_at - paused_at, "C waited only while admission was paused");
    assert_eq!((a.paused_wait, b.paused_wait), (Dur::ZERO, Dur::ZERO));
    assert_eq!(inst.paused_clock(end), a.finished_at - paused_at);
    assert!(!inst.admission_paused() && evicted.is_empty());
    assert!(done.iter().all(|f| f.output_tokens == f.request.max_output_tokens && f.ended.is_none()));
}

/// The runaway scenario: A (15-block prompt, 50 tokens) and B (1-block prompt, 60 tokens)
/// pass the high-water mark (20 of 40 blocks) once both have generated about 8 tokens; with
/// a limit of 10, both are runaways from their 11th token, and A holds more KV.
fn runaway_case(action: RunawayAction) -> (Instance, Vec<Finished>, Vec<Evicted>, Time) {
    let config = InstanceConfig { kv_protection: protection(0.5, 0.25, Some(10), action), ..config(40, 128) };
    let mut inst = Instance::new(config);
    inst.enqueue(Time::ZERO, req(1, 60, 50, &[])).unwrap();
    inst.enqueue(Time::ZERO, req(2, 4, 60, &[])).unwrap();
    let (mut done, mut evicted) = (Vec::new(), Vec::new());
    let mut evicted_at = None;
    let end = drive(&mut inst, Time::ZERO, &mut done, &mut evicted, |inst, now, done, evicted| {
        if evicted_at.is_none() && (!evicted.is_empty() || done.iter().any(|f| f.ended.is_some())) {
            evicted_at = Some(now);
            // Only B's blocks are left: A's were all released.
            let b_tokens = 4 + 11;
            assert_eq!(inst.kv().used_blocks(), inst.kv().blocks_for(b_tokens));
            assert!(!inst.admission_paused(), "use fell to the low-water mark");
        }
    });
    assert!(evicted_at.is_some(), "A was cut short");
    (inst, done, evicted, end)
}

#[test]
fn a_runaway_is_evicted_under_pressure_with_its_kv_freed_and_finishes_elsewhere() {
    let (inst, done, evicted, end) = runaway_case(RunawayAction::Reroute);
    assert_eq!(inst.kv().available_blocks(), 40, "no block leaked");
    assert_eq!(done.len(), 1, "B finished where it was");
    assert_eq!(done[0].request.id, RequestId(2));
    let [Evicted { request, reason }] = &evicted[..] else { panic!("one eviction: {evicted:?}") };
    assert_eq!(request.id, RequestId(1));
    assert_eq!(*reason, CutShort::Runaway { generated_here: 11, limit: 10 });
    let resume = *request.resume.clone().expect("the evicted request carries its progress");
    assert_eq!((resume.generated, resume.evictions), (11, 1));

    // On another instance it recomputes its prompt and 11 tokens, then generates the rest.
    let mut other = Instance::new(config(64, 128));
    other.enqueue(end, request.clone()).unwrap();
    let (again, stats, _) = run(&mut other, end);
    let a = &again[0];
    assert_eq!(stats.iter().map(|s| s.prefill_tokens).sum::<u64>(), 60 + 11);
    assert_eq!((a.output_tokens, a.evictions, a.ended), (50, 1, None));
    assert_eq!(a.first_token_at, resume.first_token_at, "TTFT is that of its first placement");
    assert_eq!(a.admitted_at, Time::ZERO);
    assert_eq!(a.request.prompt_tokens, 60);

    // Placed back on a tight instance with a cap of one eviction, it is not evicted again:
    // it runs to its end under the same pressure.
    let capped = KvProtection { max_evictions: 1, ..protection(0.5, 0.25, Some(10), RunawayAction::Reroute).unwrap() };
    let mut tight = Instance::new(InstanceConfig { kv_protection: Some(capped), ..config(40, 128) });
    tight.enqueue(end, request.clone()).unwrap();
    let (mut done, mut evicted) = (Vec::new(), Vec::new());
    drive(&mut tight, end, &mut done, &mut evicted, |_, _, _, _| {});
    assert!(evicted.is_empty(), "a request evicted once is not evicted again");
    assert_eq!((done[0].output_tokens, done[0].evictions), (50, 1));
}

#[test]
fn a_runaway_ended_by_policy_finishes_early_with_its_reason() {
    let (inst, done, evicted, _) = runaway_case(RunawayAction::End);
    assert!(evicted.is_empty());
    assert_eq!(inst.kv().available_blocks(), 40, "no block leaked");
    let a = done.iter().find(|f| f.request.id == RequestId(1)).expect("A finished");
    assert_eq!(a.ended, Some(CutShort::Runaway { generated_here: 11, limit: 10 }));
    assert_eq!(a.output_tokens, 11);
    let b = done.iter().find(|f| f.request.id == RequestId(2)).expect("B finished");
    assert_eq!((b.ended, b.output_tokens), (None, 60));
}

#[test]
fn a_long_output_on_an_instance_with_room_runs_to_the_end() {
    let config =
        InstanceConfig { kv_protection: protection(0.9, 0.5, Some(10), RunawayAction::Reroute), ..config(64, 128) };
    let mut inst = Instance::new(config);
    inst.enqueue(Time::ZERO, req(1, 60, 50, &[])).unwrap();
    let (done, _, end) = run(&mut inst, Time::ZERO);
    assert_eq!((done[0].output_tokens, done[0].ended), (50, None));
    assert_eq!(inst.paused_clock(end), Dur::ZERO);
}

proptest! {
    /// Random arrivals into a small, contended instance, with or without KV high-water
    /// protection and speculative decoding: every request finishes (with all of its tokens, or ended early as a
    /// runaway with its reason); evicted requests are queued again and finish too; no block
    /// is leaked (invariants are checked after every step).
    #[test]
    fn every_request_finishes_and_no_block_leaks(
        reqs in proptest::collection::vec((0u64..50_000, 1u32..120, 0u32..40, 0u64..3, 0usize..3, 0u32..3), 1..40),
        class_priority in any::<bool>(),
        step_cap in proptest::option::of(1u32..16),
        blocks in 40u32..80,
        budget in 4u32..64,
        l2_blocks in 0u32..20,
        l3_blocks in proptest::option::of(0u32..30),
        fair_prefill in proptest::option::of((1u32..64, 0.0f64..0.2, 1u32..16)),
        kv_protection in proptest::option::of((0.2f64..=1.0, 0.05f64..0.95, proptest::option::of(0u32..20), any::<bool>())),
        speculation in proptest::option::of((1u32..8, any::<u64>())),
        program_hold in proptest::option::of((1u64..20_000, 0.05f64..=1.0, proptest::option::of(0u64..5_000))),
        chunked in any::<bool>(),
    ) {
        let mut exec: Box<dyn Executor> = match speculation {
            None => Box::new(Fixed),
            Some((k, seed)) => Box::new(Speculating::new(k, seed)),
        };
        let prefill = match fair_prefill {
            None => PrefillPolicy::Fcfs,
            Some((chunk, share, long_min)) => fair(chunk, share, long_min),
        };
        let kv_protection = kv_protection.and_then(|(high, low_share, runaway, end)| {
            let action = if end { RunawayAction::End } else { RunawayAction::Reroute };
            protection(high, high * low_share, runaway, action)
        });
        let config = InstanceConfig { block_size: 4, total_blocks: blocks, max_batch_tokens: budget, max_seqs: 8, admission_watermark: 0.05, l2_blocks, offload_chunk_blocks: if chunked { 2 } else { 1 }, prefill, kv_protection, class_priority, lower_class_step_tokens: step_cap, program_hold: program_hold.map(|(pause, share, prefetch)| ProgramHold { max_pause: Dur(pause), share, prefetch: prefetch.map(Dur) }) };
        let chunk = config.offload_chunk_blocks;
        let mut inst = Instance::with_shared_store(config, l3_blocks.map(|b| SharedStore::new(b / chunk)));
        let mut arrivals: Vec<(Time, Request)> = reqs.iter().enumerate().map(|(i, &(t, p, o, g, class, over))| {
            let shared = [g, g + 10, g + 20];
            let mut r = req(i as u64, p, o, &shared);
            // Some clients bound their output above where it ends (an end-of-sequence).
            if over > 0 {
                r.max_output_tokens = o + 20 * over;
                r.ends_after = std::num::NonZeroU32::new(o.max(1));
            }
            r.service.class = Class::ALL[class];
            // Requests of one shared prefix group are turns of one session.
            r.service.session = SessionId::new(g + 1);
            r.arrival = Time(t);
            (Time(t), r)
        }).collect();
        arrivals.sort_by_key(|(t, r)| (*t, r.id));
        let mut queue = arrivals.into_iter().peekable();
        let mut now = Time::ZERO;
        let mut done = Vec::new();
        let mut evicted = Vec::new();
        let (mut accepted, mut evictions) = (0, 0);
        for _ in 0..1_000_000 {
            while let Some((t, _)) = queue.peek() {
                if *t > now { break; }
                let (_, r) = queue.next().unwrap();
                if inst.enqueue(now, r).is_ok() { accepted += 1; }
            }
            match inst.begin_step(now, exec.as_mut()).unwrap() {
                Some(d) => {
                    now += d;
                    inst.end_step(now, &mut done, &mut evicted);
                    // Evicted requests come back as the driver would place them.
                    for e in evicted.drain(..) {
                        prop_assert!(kv_protection.is_some());
                        let resume = e.request.resume.as_deref().copied().expect("an evicted request carries its progress");
                        prop_assert!(resume.generated < e.request.output_len());
                        evictions += 1;
                        prop_assert!(inst.enqueue(now, e.request).is_ok(), "it fitted before");
                    }
                }
                None => match queue.peek() { Some((t, _)) => now = *t, None => break },
            }
        }
        prop_assert!(!inst.has_work(), "the instance drained");
        prop_assert_eq!((inst.load().prefill_tokens_left, inst.load().decode_tokens_left), (0, 0));
        prop_assert_eq!(done.len(), accepted);
        for f in &done {
            let wanted = f.request.output_len();
            match f.ended {
                None => prop_assert_eq!(f.output_tokens, wanted),
                Some(CutShort::Runaway { limit, generated_here }) => {
                    prop_assert!(generated_here > limit && f.output_tokens < wanted);
                }
            }
            prop_assert!(f.cached_total() < f.request.prompt_tokens, "the last prompt token is always computed");
            prop_assert!(f.request.arrival <= f.admitted_at && f.admitted_at <= f.first_token_at && f.first_token_at <= f.finished_at);
            prop_assert!(f.paused_wait <= f.finished_at - f.request.arrival);
        }
        prop_assert_eq!(done.iter().map(|f| f.evictions).sum::<u32>(), evictions);
        prop_assert!(!inst.admission_paused(), "an idle instance admits");
        // Sessions' holds last until their pause is over.
        if let Some((pause, ..)) = program_hold {
            prop_assert!(inst.begin_step(now + Dur(pause + 1), exec.as_mut()).unwrap().is_none());
        }
        prop_assert_eq!(inst.kv().available_blocks(), blocks);
    }
}

/// One step of [`trace_of`]: its start, batch, aggregates, the requests it finished and the
/// load after it.
type TracedStep = (Time, Vec<BatchEntry>, BatchStats, Vec<RequestId>, Load);

/// Every step's batch, duration and the requests finished, of `reqs` (arrival µs, prompt,
/// output, shared prefix group) run to the end on an instance of `config`. With `coast`, the
/// instance coasts ([`Instance::coast`]) through a number of the steps it may (drawn from
/// the seed) that end before the next arrival, and those steps are traced as they would
/// have run.
fn trace_of(
    config: &InstanceConfig,
    l3_blocks: Option<u32>,
    reqs: &[(u64, u32, u32, u64)],
    coast: Option<u64>,
) -> Vec<TracedStep> {
    let mut draws = coast.map(<rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64);
    let mut inst = Instance::with_shared_store(config.clone(), l3_blocks.map(SharedStore::new));
    let mut queue: Vec<(Time, Request)> = reqs
        .iter()
        .enumerate()
        .map(|(i, &(t, p, o, g))| (Time(t), req(i as u64, p, o, &[g, g + 10, g + 20])))
        .collect();
    queue.sort_by_key(|(t, r)| (*t, r.id));
    let mut queue = queue.into_iter().peekable();
    let (mut now, mut trace, mut done, mut evicted) = (Time::ZERO, Vec::new(), Vec::new(), Vec::new());
    loop {
        while let Some((_, r)) = queue.next_if(|(t, _)| *t <= now) {
            let _ = inst.enqueue(now, r);
        }
        match inst.begin_step(now, &mut Fixed).expect("fixed executor") {
            Some(mut d) => {
                if let Some(rng) = &mut draws {
                    let most = rand::Rng::random_range(rng, 0..=inst.coastable_steps());
                    let next_arrival = queue.peek().map_or(Time(u64::MAX), |(t, _)| *t);
                    let mut steps = 0;
                    // Coasted step `j` ends at `now + d`; the next one starts there.
                    while steps < most && now + d < next_arrival {
                        let mut entries = inst.batch().entries.clone();
                        entries.iter_mut().for_each(|e| e.context_tokens += steps);
                        let stats = inst.coast_stats(steps);
                        let start = now;
                        now += d;
                        steps += 1;
                        trace.push((start, entries, stats, Vec::new(), inst.load_after(steps)));
                        let next = Batch { stats: inst.coast_stats(steps), ..Batch::default() };
                        d = Fixed.execute(&next, &mut StepOutput::default()).expect("fixed executor");
                    }
                    inst.coast(steps);
                }
                let batch = (now, inst.batch().entries.clone(), inst.batch().stats, Vec::new(), Load::default());
                now += d;
                inst.end_step(now, &mut done, &mut evicted);
                trace.push(batch);
                let last = trace.last_mut().expect("pushed");
                last.3 = done.drain(..).map(|f| f.request.id).collect();
                last.4 = inst.load();
            }
            None => match queue.peek() {
                Some((t, _)) => now = *t,
                None => return trace,
            },
        }
    }
}

proptest! {
    /// A decode batch repeated without the scheduler's passes (`repeat_decodes`) is the batch
    /// the passes form: the same entries, aggregates, durations and finished requests at
    /// every step, on small contended instances where blocks run out, sequences are
    /// preempted and prefixes come back from L2 and L3. And coasting through the steps
    /// `coastable_steps` allows (any number of them, up to the next arrival) leaves the
    /// instance as the steps one by one would: the coasted steps' batches, aggregates and
    /// loads after them are those of the steps run one by one, and so is every step after.
    #[test]
    fn repeated_and_coasted_decode_batches_are_those_the_passes_form(
        reqs in proptest::collection::vec((0u64..50_000, 1u32..120, 1u32..60, 0u64..3), 1..30),
        blocks in 40u32..80,
        budget in 4u32..64,
        l2_blocks in 0u32..20,
        l3_blocks in proptest::option::of(0u32..30),
        fair_prefill in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let prefill = if fair_prefill { fair(8, 0.1, 4) } else { PrefillPolicy::Fcfs };
        let config = InstanceConfig { total_blocks: blocks, l2_blocks, prefill, ..config(blocks, budget) };
        let fast = trace_of(&config, l3_blocks, &reqs, None);
        crate::scheduler::PASSES_ONLY.with(|p| p.set(true));
        let passes = trace_of(&config, l3_blocks, &reqs, None);
        crate::scheduler::PASSES_ONLY.with(|p| p.set(false));
        let coasted = trace_of(&config, l3_blocks, &reqs, Some(seed));
        prop_assert_eq!(&fast, &passes);
        prop_assert_eq!(coasted, fast);
    }
}

#[test]
fn every_generated_token_is_reported_as_emitted_once() {
    let mut inst = Instance::new(config(64, 8));
    for (id, prompt, output) in [(1, 12, 5), (2, 20, 1), (3, 4, 9)] {
        inst.enqueue(Time::ZERO, req(id, prompt, output, &[])).unwrap();
    }
    let (mut now, mut done, mut evicted) = (Time::ZERO, Vec::new(), Vec::new());
    let mut emitted = std::collections::BTreeMap::<u64, u32>::new();
    while let Some(d) = inst.begin_step(now, &mut Fixed).expect("fixed executor") {
        now += d;
        inst.end_step(now, &mut done, &mut evicted);
        for id in inst.emitted() {
            *emitted.entry(id.0).or_default() += 1;
        }
    }
    assert_eq!(emitted, [(1, 5), (2, 1), (3, 9)].into_iter().collect());
}

#[test]
fn a_speculative_step_emits_every_accepted_token_and_stops_at_the_output() {
    // Every draft accepted: 1 + 3 tokens per decode step, the last step clamped to the 2 left.
    struct AcceptAll;
    impl Executor for AcceptAll {
        fn draft_tokens(&self) -> u32 {
            3
        }
        fn execute(&mut self, batch: &Batch, out: &mut StepOutput) -> Result<Dur, ExecutorError> {
            out.accepted.extend(batch.entries.iter().map(|e| if e.is_prefill { 0 } else { e.new_tokens - 1 }));
            Ok(Dur(1_000))
        }
    }
    let mut inst = Instance::new(config(64, 64));
    inst.enqueue(Time::ZERO, req(1, 8, 11, &[])).unwrap();
    let (mut now, mut done, mut evicted) = (Time::ZERO, Vec::new(), Vec::new());
    let mut per_step = Vec::new();
    while let Some(d) = inst.begin_step(now, &mut AcceptAll).expect("executor") {
        now += d;
        inst.end_step(now, &mut done, &mut evicted);
        per_step.push(inst.emitted().len());
        assert!(inst.emitted().iter().all(|&id| id == RequestId(1)));
    }
    assert_eq!(per_step, [1, 4, 4, 2], "prefill samples one, then verify steps of 4, 4 and the 2 left");
    let f = &done[0];
    assert_eq!(f.output_tokens, 11);
    assert_eq!((f.first_token_at, f.finished_at), (Time(1_000), Time(4_000)));
    assert_eq!(inst.kv().used_blocks(), 0);
}

#[test]
fn a_cancelled_request_leaves_and_frees_its_kv_while_the_others_finish() {
    let mut inst = Instance::new(config(64, 8));
    for (id, prompt, output) in [(1, 12, 40), (2, 8, 5), (3, 16, 5)] {
        inst.enqueue(Time::ZERO, req(id, prompt, output, &[])).unwrap();
    }
    let (mut now, mut done, mut evicted) = (Time::ZERO, Vec::new(), Vec::new());
    for _ in 0..4 {
        let d = inst.begin_step(now, &mut Fixed).expect("fixed executor").expect("work");
        now += d;
        inst.end_step(now, &mut done, &mut evicted);
    }
    let used = inst.kv().used_blocks();
    assert!(inst.cancel(now, RequestId(1)), "request 1 is running");
    assert!(inst.kv().used_blocks() < used, "its private blocks are free again");
    assert!(!inst.cancel(now, RequestId(1)), "cancelled once");
    assert!(!inst.cancel(now, RequestId(99)), "never here");
    let (rest, _, _) = run(&mut inst, now);
    done.extend(rest);
    let mut ids: Vec<u64> = done.iter().map(|f| f.request.id.0).collect();
    ids.sort();
    assert_eq!(ids, [2, 3]);
    assert_eq!(inst.kv().used_blocks(), 0);
}

#[test]
fn changing_the_scheduling_mid_run_loses_no_request() {
    let mut inst = Instance::new(config(48, 16));
    for id in 0..12u64 {
        let prompt = if id % 4 == 0 { 96 } else { 8 + 4 * id as u32 };
        inst.enqueue(Time::ZERO, req(id, prompt, 6 + id as u32, &[])).unwrap();
    }
    let policies = [
        (fair(8, 0.1, 4), protection(0.5, 0.3, None, RunawayAction::Reroute)),
        (PrefillPolicy::Fcfs, None),
        (PrefillPolicy::Fcfs, protection(0.6, 0.4, None, RunawayAction::Reroute)),
        (fair(16, 0.05, 8), None),
    ];
    let (mut done, mut evicted, mut steps) = (Vec::new(), Vec::new(), 0usize);
    let mut changes = 0;
    drive(&mut inst, Time::ZERO, &mut done, &mut evicted, |inst, now, _, _| {
        steps += 1;
        if steps % 3 == 0 {
            let (prefill, protection) = policies[changes % policies.len()];
            inst.set_scheduling(now, prefill, protection);
            assert_eq!((inst.config().prefill, inst.config().kv_protection), (prefill, protection));
            inst.check_invariants();
            changes += 1;
        }
    });
    assert!(changes >= 8, "the policy changed {changes} times");
    let mut ids: Vec<u64> = done.iter().map(|f| f.request.id.0).collect();
    ids.sort();
    assert_eq!(ids, (0..12).collect::<Vec<_>>(), "every request finished once");
    assert!(evicted.is_empty());
    assert!(!inst.admission_paused());
    assert_eq!(inst.kv().used_blocks(), 0);
}

/// A turn of session 9, whose context is its first `blocks` blocks (the same in every turn),
/// with 2 output tokens.
fn session_turn(id: u64, prompt: u32, blocks: u64) -> Request {
    let keys: Vec<u64> = (1..=blocks).collect();
    let mut r = req(id, prompt, 2, &keys);
    r.service.session = SessionId::new(9);
    r
}

/// A paused session's context outlives newer cached blocks with a hold, and is the first to
/// go without one (plain LRU): the session's turn 1 finishes, a one-off request caches its
/// prompt after it, a third request needs room, then the session's turn 2 arrives.
#[test]
fn a_held_session_keeps_its_context_through_other_traffic() {
    let turn = |id, prompt| session_turn(id, prompt, 24);
    let turn2_cached = |program_hold| {
        let mut inst = Instance::new(InstanceConfig { program_hold, ..config(64, 64) });
        let mut now = Time::ZERO;
        for r in [turn(1, 96), req(2, 64, 2, &[]), req(3, 120, 2, &[])] {
            inst.enqueue(now, r).unwrap();
            now = run(&mut inst, now).2;
        }
        inst.enqueue(now, turn(4, 128)).unwrap();
        let (done, _, now) = run(&mut inst, now);
        // Turn 4's own hold lasts until its pause is over.
        inst.begin_step(now + Dur::from_millis(60_000), &mut Fixed).unwrap();
        assert_eq!(inst.kv().available_blocks(), 64, "every hold dropped once expired");
        done[0].cached_total()
    };
    let hold = ProgramHold { max_pause: Dur::from_millis(10_000), ..ProgramHold::default() };
    assert_eq!(turn2_cached(Some(hold)), 96, "the 24 blocks of turn 1 were held");
    assert!(turn2_cached(None) < 96, "LRU took the session's blocks, older than the one-off's");
}

/// A session whose tool pauses are longer than holds last loses its context to L2 under
/// other traffic; with prefetch it is loaded back before the session's next turn is
/// expected, in the background of a step, and the turn finds it in GPU memory.
#[test]
fn a_paused_sessions_context_is_prefetched_from_l2_before_its_next_turn() {
    let turn = |id, prompt| session_turn(id, prompt, 40);
    let s = |secs: f64| Dur::from_secs_f64(secs);
    let third_turn = |prefetch| {
        let hold = ProgramHold { max_pause: s(1.0), share: 0.5, prefetch };
        let mut inst = Instance::new(InstanceConfig { program_hold: Some(hold), l2_blocks: 64, ..config(64, 64) });
        inst.enqueue(Time::ZERO, turn(1, 96)).unwrap();
        let (_, _, t1) = run(&mut inst, Time::ZERO);
        // A pause of 5 s, longer than holds last: turn 2's context is left to LRU.
        inst.enqueue(t1 + s(5.0), turn(2, 128)).unwrap();
        let (_, _, t2) = run(&mut inst, t1 + s(5.0));
        // Other traffic pushes the session's 32 blocks out to L2.
        inst.enqueue(t2 + s(0.1), req(3, 120, 2, &[])).unwrap();
        inst.enqueue(t2 + s(0.1), req(4, 120, 2, &[])).unwrap();
        run(&mut inst, t2 + s(0.1));
        assert!(inst.kv().l2_blocks() >= 24, "the session's context went to L2");
        // A step 4.5 s after turn 2 ended: turn 3 is expected at 5 s, within the lead.
        inst.enqueue(t2 + s(4.5), req(5, 8, 2, &[])).unwrap();
        let (_, stats, _) = run(&mut inst, t2 + s(4.5));
        let prefetched: u64 = stats.iter().map(|b| b.prefetch_l2_tokens).sum();
        inst.enqueue(t2 + s(5.0), turn(6, 160)).unwrap();
        let (done, _, _) = run(&mut inst, t2 + s(5.0));
        inst.check_invariants();
        (prefetched, done[0].cached_tokens)
    };
    let (prefetched, cached) = third_turn(Some(s(1.0)));
    assert!(prefetched >= 96, "most of turn 2's 32 blocks were loaded back: {prefetched} tokens");
    assert_eq!(cached, [128, 0, 0], "turn 3 found its context in L1");
    let (prefetched, cached) = third_turn(None);
    assert_eq!(prefetched, 0);
    assert!(cached[1] > 0 && cached[0] < 128, "without prefetch it loads from L2 itself: {cached:?}");
}
