//! One contract suite run over every router, then each router's own rule.

use super::*;
use crate::controller::{Controller, ControllerConfig};
use crate::event::OutputEnd;
use crate::fleet::Reject;
use crate::fleet::Route;
use engine::kv::{KvEvent, Tier};
use engine::{BlockHash, InstanceId, Load, RequestId, Time};

fn request(prompt: u32, output: u32) -> Request {
    Request {
        id: RequestId(0),
        arrival: Time::ZERO,
        prompt_tokens: prompt,
        max_output_tokens: output,
        ends_after: None,
        block_hashes: Vec::new(),
        resume: None,
        service: Default::default(),
        model: Default::default(),
    }
}

fn controller(router: RouterConfig, capacities: &[u64]) -> Controller {
    let mut c = Controller::new(&ControllerConfig { router, seed: 7, hints: CostHints::default() });
    for (i, &cap) in capacities.iter().enumerate() {
        c.on_event(Time::ZERO, &FleetEvent::InstanceUp { instance: InstanceId(i as u32), capacity_tokens: cap });
    }
    c
}

fn report(c: &mut Controller, instance: u32, prefill_tokens_left: u64) {
    let load = Load { prefill_tokens_left, ..Load::default() };
    c.on_event(Time::ZERO, &FleetEvent::Load { instance: InstanceId(instance), load });
}

#[test]
fn every_router_picks_only_serving_instances_that_can_hold_the_request() {
    for router in RouterConfig::all() {
        let mut c = controller(router, &[1_000, 100_000, 100_000, 100_000]);
        c.on_event(Time::ZERO, &FleetEvent::InstanceDraining { instance: InstanceId(2) });
        c.on_event(Time::ZERO, &FleetEvent::InstanceDown { instance: InstanceId(3) });
        for _ in 0..20 {
            let route = c.route(Time::ZERO, &request(5_000, 100)).expect("instance 1 fits");
            assert_eq!(route.prefill, InstanceId(1), "{router}");
            assert_eq!(route.decode, route.prefill, "{router}: colocated");
        }
    }
}

#[test]
fn every_router_rejects_when_nothing_serves_or_fits() {
    for router in RouterConfig::all() {
        let mut c = controller(router, &[]);
        assert_eq!(c.route(Time::ZERO, &request(10, 10)), Err(Reject::NoInstance), "{router}");
        let mut c = controller(router, &[1_000, 2_000]);
        assert_eq!(
            c.route(Time::ZERO, &request(5_000, 1)),
            Err(Reject::TooLarge { needed_tokens: 5_000, largest_tokens: 2_000 }),
            "{router}"
        );
    }
}

#[test]
fn every_router_keeps_a_request_to_engines_of_its_model() {
    use engine::ModelId;
    for router in RouterConfig::all() {
        // Instances 0 and 2 serve model 1, the big one 1 and 3 model 0.
        let mut c = Controller::new(&ControllerConfig { router, seed: 7, hints: CostHints::default() });
        for (i, (model, cap)) in [(1, 1_000), (0, 100_000), (1, 2_000), (0, 100_000)].into_iter().enumerate() {
            let instance = InstanceId(i as u32);
            c.on_event(Time::ZERO, &FleetEvent::InstanceModel { instance, model: ModelId(model) });
            c.on_event(Time::ZERO, &FleetEvent::InstanceUp { instance, capacity_tokens: cap });
        }
        for k in 0..20 {
            let r = Request { model: ModelId(1), ..request(100 + k, 10) };
            let route = c.route(Time::ZERO, &r).expect("model 1 has room");
            assert!([InstanceId(0), InstanceId(2)].contains(&route.prefill), "{router}: {route:?}");
        }
        // Too large for model 1's engines, whatever model 0's hold.
        let big = Request { model: ModelId(1), ..request(5_000, 1) };
        assert_eq!(
            c.route(Time::ZERO, &big),
            Err(Reject::TooLarge { needed_tokens: 5_000, largest_tokens: 2_000 }),
            "{router}"
        );
        // A model no instance serves has nowhere to go.
        assert_eq!(c.route(Time::ZERO, &Request { model: ModelId(7), ..request(10, 1) }), Err(Reject::NoInstance));
    }
}

#[test]
fn every_router_repeats_its_choices_for_the_same_seed() {
    for router in RouterConfig::all() {
        let run = || {
            let mut c = controller(router, &[10_000; 8]);
            (0..100u32)
                .map(|i| {
                    report(&mut c, i % 8, u64::from(i * 37 % 11));
                    c.route(Time::ZERO, &request(100 + i, 10)).map(|r| r.prefill)
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run(), "{router}");
    }
}

#[test]
fn router_names_round_trip_and_unknown_names_list_the_valid_ones() {
    for router in RouterConfig::all() {
        assert_eq!(router.name().parse::<RouterConfig>(), Ok(router));
        assert_eq!(router.build(1, &CostHints::default()).name(), router.name());
    }
    let err = "fastest".parse::<RouterConfig>().unwrap_err().to_string();
    assert!(
        err.starts_with("unknown router `fastest` (valid: round-robin, least-outstanding, power-of-two, "),
        "{err}"
    );
    for name in ["sglang-cache-aware", "dynamo-kv", "llm-d"] {
        assert!(err.contains(name), "{err}");
    }
}

/// A load report of an instance whose KV is at `kv_used_blocks` of 1,000 blocks, with
/// admission paused or not, and `prefill_tokens_left` of queued work.
fn report_kv(c: &mut Controller, instance: u32, kv_used_blocks: u32, paused: bool, prefill_tokens_left: u64) {
    let load = Load {
        kv_used_blocks,
        kv_total_blocks: 1_000,
        admission_paused: paused,
        prefill_tokens_left,
        ..Load::default()
    };
    c.on_event(Time::ZERO, &FleetEvent::Load { instance: InstanceId(instance), load });
}

#[test]
fn every_router_avoids_instances_that_paused_admission_unless_all_did() {
    for router in RouterConfig::all() {
        let mut c = controller(router, &[100_000; 3]);
        // 0 and 1 are idle and hold the prompt's prefix, but paused admission (KV above the
        // high-water mark); 2 admits but has a long queue.
        let prompt = chain(1, 8);
        store(&mut c, 0, Tier::L1, &prompt);
        store(&mut c, 1, Tier::L1, &prompt);
        report_kv(&mut c, 0, 950, true, 0);
        report_kv(&mut c, 1, 950, true, 0);
        report_kv(&mut c, 2, 100, false, 50_000);
        for _ in 0..10 {
            assert_eq!(c.route(Time::ZERO, &request_of(&prompt)).unwrap().prefill, InstanceId(2), "{router}");
        }
        // When every instance paused, requests are still placed, by the router's own rule.
        report_kv(&mut c, 2, 950, true, 50_000);
        assert!(c.route(Time::ZERO, &request_of(&prompt)).is_ok(), "{router}");
        // One that falls back to its low-water mark is preferred again.
        report_kv(&mut c, 1, 300, false, 0);
        assert_eq!(c.route(Time::ZERO, &request_of(&prompt)).unwrap().prefill, InstanceId(1), "{router}");
    }
}

#[test]
fn every_router_places_an_evicted_request_away_from_the_instance_it_left() {
    let evicted = |c: &mut Controller, instance: u32| {
        let reason = engine::CutShort::Runaway { generated_here: 5_000, limit: 4_096 };
        c.on_event(
            Time::ZERO,
            &FleetEvent::RequestEvicted { instance: InstanceId(instance), request: RequestId(0), reason },
        );
    };
    for router in RouterConfig::all() {
        let mut c = controller(router, &[100_000; 2]);
        // 0 caches the prompt and is idle: the first choice of every router but for the eviction.
        let prompt = chain(1, 8);
        store(&mut c, 0, Tier::L1, &prompt);
        report_kv(&mut c, 1, 100, false, 20_000);
        let request = request_of(&prompt);
        let first = c.route(Time::ZERO, &request).unwrap().prefill;
        evicted(&mut c, first.0);
        assert_eq!(c.fleet().get(first).unwrap().in_flight, 0, "{router}: an eviction ends its stay");
        let again = c.reroute(Time::ZERO, &request, first).unwrap().prefill;
        assert_ne!(again, first, "{router}");
        assert_eq!(c.fleet().get(again).unwrap().in_flight, 1, "{router}");
        // The instance it left, admitting again, beats one that paused admission.
        evicted(&mut c, again.0);
        report_kv(&mut c, again.0, 950, true, 0);
        assert_eq!(c.reroute(Time::ZERO, &request, first).unwrap().prefill, first, "{router}");
        // And with no other instance serving, it goes back where it was.
        evicted(&mut c, first.0);
        c.on_event(Time::ZERO, &FleetEvent::InstanceDown { instance: again });
        assert_eq!(c.reroute(Time::ZERO, &request, first).unwrap().prefill, first, "{router}");
        // Routing afterwards is not affected by the last re-route's exclusion.
        assert_eq!(c.route(Time::ZERO, &request).unwrap().prefill, first, "{router}");
    }
}

#[test]
fn round_robin_cycles_through_serving_instances() {
    let mut c = controller(RouterConfig::RoundRobin(Default::default()), &[10_000; 3]);
    let picks: Vec<u32> = (0..6).map(|_| c.route(Time::ZERO, &request(10, 1)).unwrap().prefill.0).collect();
    assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
}

#[test]
fn least_outstanding_counts_tokens_routed_since_the_last_report() {
    let mut c = controller(RouterConfig::LeastOutstanding(Default::default()), &[10_000; 3]);
    report(&mut c, 0, 500);
    report(&mut c, 1, 100);
    report(&mut c, 2, 300);
    // 1 has least (100); after 250 more tokens it has 350, so 2 (300) is next, then 0 (500)
    // ties with nothing and 1 (350) is next again.
    let picks: Vec<u32> = (0..3).map(|_| c.route(Time::ZERO, &request(200, 50)).unwrap().prefill.0).collect();
    assert_eq!(picks, [1, 2, 1]);
    report(&mut c, 1, 0);
    assert_eq!(c.route(Time::ZERO, &request(1, 1)).unwrap().prefill, InstanceId(1));
}

#[test]
fn power_of_two_sends_to_the_less_loaded_of_its_draw() {
    let mut c = controller(RouterConfig::PowerOfTwo(Default::default()), &[10_000; 5]);
    for (i, load) in [400u64, 0, 300, 200, 100].into_iter().enumerate() {
        report(&mut c, i as u32, load);
    }
    for _ in 0..50 {
        let route = c.route(Time::ZERO, &request(1, 1)).unwrap();
        let Why::PowerOfTwo { drawn, outstanding_tokens } = route.why else { panic!("wrong reason") };
        assert_ne!(drawn[0], drawn[1]);
        let best = if outstanding_tokens[1] < outstanding_tokens[0] { drawn[1] } else { drawn[0] };
        assert_eq!(route.prefill, best);
        report(&mut c, route.prefill.0, outstanding_tokens.iter().copied().min().unwrap_or(0));
    }
}

/// `n` chained block hashes whose contents are `seed * 1000 + j`: chains of the same seed
/// share their prefix, chains of different seeds share nothing.
fn chain(seed: u64, n: usize) -> Vec<BlockHash> {
    let mut h = BlockHash::ROOT;
    (0..n as u64)
        .map(|j| {
            h = h.chain(seed * 1000 + j);
            h
        })
        .collect()
}

/// A request whose prompt is exactly `hashes.len()` blocks of the default block size.
fn request_of(hashes: &[BlockHash]) -> Request {
    let prompt = hashes.len() as u32 * CostHints::default().block_size;
    Request { block_hashes: hashes.to_vec(), ..request(prompt, 10) }
}

/// `instance` tells the controller it now caches `hashes` (a chain from the root) in `tier`.
fn store(c: &mut Controller, instance: u32, tier: Tier, hashes: &[BlockHash]) {
    for (k, &hash) in hashes.iter().enumerate() {
        let page = engine::kv::PageKey::at(hashes, k).page;
        let event = KvEvent::Stored { tier, hash, page };
        c.on_event(Time::ZERO, &FleetEvent::Kv { instance: InstanceId(instance), events: vec![event].into() });
    }
}

fn report_load(c: &mut Controller, instance: u32, load: Load) {
    c.on_event(Time::ZERO, &FleetEvent::Load { instance: InstanceId(instance), load });
}

fn sglang_why(route: &Route) -> (SglangBranch, u32, u32) {
    let Why::SglangCacheAware { branch, matched_blocks, request_blocks, .. } = route.why else {
        panic!("wrong reason: {:?}", route.why)
    };
    (branch, matched_blocks, request_blocks)
}

#[test]
fn sglang_sends_a_match_above_30_percent_to_the_instance_it_remembers() {
    let mut c = controller(RouterConfig::SglangCacheAware(Default::default()), &[100_000; 4]);
    let a = chain(1, 10);
    assert_eq!(c.route(Time::ZERO, &request_of(&a)).unwrap().prefill, InstanceId(0), "a miss: least loaded");
    assert_eq!(c.route(Time::ZERO, &request_of(&chain(2, 10))).unwrap().prefill, InstanceId(1));
    // 4 of 10 blocks match instance 0: a hit, although 2 and 3 are idle.
    let hit = [&a[..4], &chain(3, 6)].concat();
    let route = c.route(Time::ZERO, &request_of(&hit)).unwrap();
    assert_eq!(route.prefill, InstanceId(0));
    assert_eq!(sglang_why(&route), (SglangBranch::CacheHit, 4, 10));
    // 3 of 10 is not above the threshold: the least loaded instance.
    let miss = [&a[..3], &chain(4, 7)].concat();
    let route = c.route(Time::ZERO, &request_of(&miss)).unwrap();
    assert_eq!(route.prefill, InstanceId(2));
    assert_eq!(sglang_why(&route), (SglangBranch::CacheMiss, 3, 10));
}

#[test]
fn sglang_sends_to_the_least_loaded_once_the_spread_passes_64_and_half_the_minimum() {
    let mut c = controller(RouterConfig::SglangCacheAware(Default::default()), &[100_000; 4]);
    let a = request_of(&chain(1, 8));
    let picks: Vec<(u32, SglangBranch)> = (0..70)
        .map(|_| {
            let route = c.route(Time::ZERO, &a).unwrap();
            (route.prefill.0, sglang_why(&route).0)
        })
        .collect();
    use SglangBranch::*;
    assert_eq!(picks[0], (0, CacheMiss));
    assert!(picks[1..65].iter().all(|&p| p == (0, CacheHit)), "{picks:?}");
    // 65 in flight on 0 and none elsewhere: 65 − 0 > 64 and 65 > 1.5 × 0.
    assert_eq!(&picks[65..68], [(1, Imbalanced), (2, Imbalanced), (3, Imbalanced)]);
    // Now min is 1: 65 − 1 = 64 is not above 64, so the match wins again (all four
    // instances remember it; the lowest id takes it), which makes the spread 65 again.
    assert_eq!(&picks[68..], [(0, CacheHit), (1, Imbalanced)]);
    let route = c.route(Time::ZERO, &a).unwrap();
    let Why::SglangCacheAware { in_flight_min, in_flight_max, .. } = route.why else { panic!("wrong reason") };
    assert_eq!((route.prefill, in_flight_min, in_flight_max), (InstanceId(2), 1, 66));
    // Finishing requests lowers the load the rule sees.
    for _ in 0..60 {
        c.on_event(
            Time::ZERO,
            &FleetEvent::RequestFinished { instance: InstanceId(0), request: RequestId(0), output: None },
        );
    }
    assert_eq!(sglang_why(&c.route(Time::ZERO, &a).unwrap()).0, CacheHit);
}

#[test]
fn sglang_forgets_what_it_sent_to_an_instance_that_went_down() {
    let mut c = controller(RouterConfig::SglangCacheAware(Default::default()), &[100_000; 2]);
    let a = request_of(&chain(1, 8));
    assert_eq!(c.route(Time::ZERO, &a).unwrap().prefill, InstanceId(0));
    c.on_event(Time::ZERO, &FleetEvent::InstanceDown { instance: InstanceId(0) });
    c.on_event(Time::ZERO, &FleetEvent::InstanceUp { instance: InstanceId(0), capacity_tokens: 100_000 });
    c.on_event(
        Time::ZERO,
        &FleetEvent::RequestFinished { instance: InstanceId(0), request: RequestId(0), output: None },
    );
    let route = c.route(Time::ZERO, &a).unwrap();
    assert_eq!((route.prefill, sglang_why(&route)), (InstanceId(0), (SglangBranch::CacheMiss, 0, 8)));
}

fn dynamo_why(route: &Route) -> (u32, f64, u64, f64) {
    let Why::DynamoKv { overlap_blocks, prefill_blocks, decode_blocks, cost } = route.why else {
        panic!("wrong reason: {:?}", route.why)
    };
    (overlap_blocks, prefill_blocks, decode_blocks, cost)
}

#[test]
fn dynamo_prefers_a_big_gpu_overlap_to_an_idle_empty_instance() {
    let mut c = controller(RouterConfig::DynamoKv(Default::default()), &[100_000; 2]);
    assert!(c.wants_kv_events());
    let prompt = chain(1, 110);
    store(&mut c, 0, Tier::L1, &prompt[..100]);
    report_load(&mut c, 0, Load { kv_used_blocks: 20, kv_total_blocks: 1_000, ..Load::default() });
    let route = c.route(Time::ZERO, &request_of(&prompt)).unwrap();
    // 0: prefill 10 + decode (20 used + 10 new) = 40; 1: prefill 110 + decode 110 = 220.
    assert_eq!(route.prefill, InstanceId(0));
    assert_eq!(dynamo_why(&route), (100, 10.0, 30, 40.0));
}

#[test]
fn dynamo_prefers_the_lighter_instance_when_the_overlap_is_small() {
    let mut c = controller(RouterConfig::DynamoKv(Default::default()), &[100_000; 2]);
    let prompt = chain(1, 20);
    store(&mut c, 0, Tier::L1, &prompt[..4]);
    let busy = Load { kv_used_blocks: 200, kv_total_blocks: 1_000, prefill_tokens_left: 1_600, ..Load::default() };
    report_load(&mut c, 0, busy);
    let route = c.route(Time::ZERO, &request_of(&prompt)).unwrap();
    // 0 would cost (1600 + 320 − 64) / 16 = 116 + (200 + 100 + 16) = 432; 1 costs 20 + 20.
    assert_eq!(route.prefill, InstanceId(1));
    assert_eq!(dynamo_why(&route), (0, 20.0, 20, 40.0));
}

#[test]
fn dynamo_counts_what_it_sent_since_the_last_report_and_only_gpu_blocks_as_overlap() {
    let mut c = controller(RouterConfig::DynamoKv(Default::default()), &[100_000; 2]);
    let prompt = chain(1, 10);
    store(&mut c, 0, Tier::L2, &prompt);
    let picks: Vec<u32> = (0..3).map(|_| c.route(Time::ZERO, &request_of(&prompt)).unwrap().prefill.0).collect();
    // Equal costs go to 0; then 0 carries 10 + 10 blocks sent, so 1 is cheaper, then 0 again.
    assert_eq!(picks, [0, 1, 0]);
    assert_eq!(dynamo_why(&c.route(Time::ZERO, &request_of(&prompt)).unwrap()), (0, 20.0, 20, 40.0));
    // A report replaces what was sent before it.
    report_load(&mut c, 0, Load::default());
    let route = c.route(Time::ZERO, &request_of(&prompt)).unwrap();
    assert_eq!((route.prefill, dynamo_why(&route).3), (InstanceId(0), 20.0));
}

#[test]
fn dynamos_overlap_weight_set_by_name_weighs_the_prefill_term() {
    let router =
        RouterConfig::with_params("dynamo-kv", &[("overlap_score_weight".to_string(), 0.5)].into()).expect("in range");
    let mut c = controller(router, &[100_000; 2]);
    let prompt = chain(1, 110);
    store(&mut c, 0, Tier::L1, &prompt[..100]);
    report_load(&mut c, 0, Load { kv_used_blocks: 20, kv_total_blocks: 1_000, ..Load::default() });
    let route = c.route(Time::ZERO, &request_of(&prompt)).unwrap();
    // 0: 0.5 × prefill 10 + decode (20 used + 10 new) = 35.
    assert_eq!(dynamo_why(&route), (100, 10.0, 30, 35.0));
}

#[test]
fn a_router_parameter_unknown_or_out_of_range_is_refused_by_name_with_its_range() {
    let with = |name: &str, param: &str, v: f64| RouterConfig::with_params(name, &[(param.to_string(), v)].into());
    let e = with("dynamo-kv", "overlap_score_weight", -1.0).unwrap_err();
    assert_eq!(e.to_string(), "dynamo-kv's `overlap_score_weight` is -1, outside its range [0, 16]");
    let RouterError::Param(p) = &e else { panic!("{e:?}") };
    assert_eq!(p.param(), "overlap_score_weight");
    let e = with("sglang-cache-aware", "balance_abs_threshold", 1.5).unwrap_err();
    assert_eq!(
        e.to_string(),
        "sglang-cache-aware's `balance_abs_threshold` is 1.5, outside its range integer in [0, 65536]"
    );
    let e = with("cache-aware", "copy", 1.0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "cache-aware has no parameter `copy` (valid: copy_weight, stall_weight, own_weight, hot_factor, hot_slack, kv_weight, left_weight, lost_queue_factor, lost_cap)"
    );
    assert_eq!(
        with("round-robin", "x", 1.0).unwrap_err().to_string(),
        "round-robin has no parameter `x` (valid: none)"
    );
    assert!(matches!(with("fastest", "x", 1.0), Err(RouterError::Unknown(_))));
}

#[test]
fn every_routers_parameters_read_back_as_set_at_both_ends_of_their_ranges() {
    for router in RouterConfig::all() {
        assert_eq!(router.label(), router.name(), "defaults add nothing to the name");
        for p in router.params() {
            for end in [p.max, if p.min_open { (p.min + p.max) / 2.0 } else { p.min }] {
                let mut r = router;
                r.set(p.name, end).expect("in range");
                assert_eq!(r.values()[p.name], end, "{router} {}", p.name);
                let built = r.build(1, &CostHints::default());
                assert_eq!(built.name(), router.name());
            }
        }
    }
    let mut r: RouterConfig = "llm-d".parse().unwrap();
    r.set("queue_weight", 1.0).unwrap();
    r.set("l2_weight", 0.5).unwrap();
    assert_eq!(r.label(), "llm-d(l2_weight=0.5,queue_weight=1)");
}

#[test]
fn the_catalog_lists_every_routers_parameters_with_defaults_and_ranges() {
    let catalog = crate::catalog();
    let routers: Vec<&str> = catalog.iter().filter(|p| p.role == "router").map(|p| p.policy).collect();
    assert_eq!(routers, RouterConfig::NAMES);
    for (router, entry) in RouterConfig::all().iter().zip(&catalog) {
        let names: Vec<&str> = entry.params.iter().map(|p| p.param.name).collect();
        assert_eq!(names, router.params().iter().map(|p| p.name).collect::<Vec<_>>());
        for p in &entry.params {
            assert_eq!(router.values()[p.param.name], p.default);
            assert!(p.param.min <= p.default && p.default <= p.param.max, "{router} {}", p.param.name);
        }
    }
    let dynamo = catalog.iter().find(|p| p.policy == "dynamo-kv").unwrap().to_string();
    assert!(dynamo.contains("overlap_score_weight") && dynamo.contains("[0, 16]"), "{dynamo}");
    for policy in ["fair", "fixed-xpyd", "slo-load", "none"] {
        assert!(catalog.iter().any(|p| p.policy == policy), "{policy}");
    }
}

fn llm_d_scores(route: &Route) -> [f64; 4] {
    let Why::LlmD { prefix_score, queue_score, kv_score, score, .. } = route.why else {
        panic!("wrong reason: {:?}", route.why)
    };
    [prefix_score, queue_score, kv_score, score]
}

#[test]
fn llm_d_weighs_prefix_3_queue_2_and_free_kv_2() {
    // 0 holds the whole prompt but has 4 waiting (queue score 0); 1 is empty and idle
    // (prefix 0, queue 1, kv 1: 4.0). 0 scores 3 + 0 + 2 × (1 − usage).
    for (used_blocks, winner, score) in [(250, 0, 4.5), (750, 1, 4.0)] {
        let mut c = controller(RouterConfig::LlmD(Default::default()), &[100_000; 2]);
        assert!(c.wants_kv_events());
        let prompt = chain(1, 8);
        store(&mut c, 0, Tier::L1, &prompt);
        let load = Load { waiting: 4, kv_used_blocks: used_blocks, kv_total_blocks: 1_000, ..Load::default() };
        report_load(&mut c, 0, load);
        report_load(&mut c, 1, Load { kv_total_blocks: 1_000, ..Load::default() });
        let route = c.route(Time::ZERO, &request_of(&prompt)).unwrap();
        assert_eq!(route.prefill, InstanceId(winner), "{used_blocks} blocks used");
        assert_eq!(llm_d_scores(&route)[3], score);
    }
}

#[test]
fn llm_d_normalizes_queues_over_the_candidates_and_credits_host_blocks_at_0_8() {
    let mut c = controller(RouterConfig::LlmD(Default::default()), &[100_000; 3]);
    let prompt = chain(1, 10);
    store(&mut c, 1, Tier::L2, &prompt[..5]);
    for (i, waiting) in [(0, 4), (1, 6), (2, 8)] {
        report_load(&mut c, i, Load { waiting, kv_total_blocks: 100, ..Load::default() });
    }
    // 0: 0 + 2 × 1 + 2 = 4; 1: 3 × 0.4 + 2 × 0.5 + 2 = 4.2; 2: 0 + 0 + 2 = 2.
    let route = c.route(Time::ZERO, &request_of(&prompt)).unwrap();
    assert_eq!(route.prefill, InstanceId(1));
    let [prefix, queue, kv, score] = llm_d_scores(&route);
    assert!((prefix - 0.4).abs() < 1e-12 && queue == 0.5 && kv == 1.0 && (score - 4.2).abs() < 1e-12);
    let Why::LlmD { matched_blocks, waiting, .. } = route.why else { panic!("wrong reason") };
    assert_eq!((matched_blocks, waiting), ([0, 5, 0], 6));
}

#[test]
fn llm_d_breaks_ties_at_random_from_the_seed() {
    let mut c = controller(RouterConfig::LlmD(Default::default()), &[100_000; 4]);
    let picks: Vec<u32> = (0..12).map(|_| c.route(Time::ZERO, &request(100, 10)).unwrap().prefill.0).collect();
    assert_eq!(picks, [2, 3, 2, 2, 3, 0, 3, 2, 1, 1, 0, 1]);
}

fn cache_aware_why(route: &Route) -> (u32, u32, u32, f64) {
    match route.why {
        Why::CacheAware { l1_tokens, l2_tokens, l3_tokens, predicted_ttft_ms, .. } => {
            (l1_tokens, l2_tokens, l3_tokens, predicted_ttft_ms)
        }
        ref other => panic!("not a cache-aware reason: {other:?}"),
    }
}

#[test]
fn cache_aware_weighs_a_cached_prefix_against_the_queue_in_predicted_seconds() {
    // Default hints: 40,000 prompt tokens/s; L2 loads 400,000 tokens/s; L3 200,000.
    let mut c = controller(RouterConfig::CacheAware(Default::default()), &[1_000_000; 3]);
    assert!(c.wants_kv_events());
    let prompt = chain(1, 250); // 4,000 tokens: 100 ms to compute from scratch
    store(&mut c, 0, Tier::L1, &prompt[..200]);
    store(&mut c, 1, Tier::L2, &prompt[..249]);
    // Every instance is charged 8 × the prefill time of the prompt tokens it does not hold in
    // L1 or L2 (the new copy): 0 holds 3,200, so 800 tokens: 160 ms; 1 holds 3,984: 3.2 ms;
    // 2 holds none: 800 ms.
    // 0 has 40 ms of queued prefill: 40 + 50 tokens × 16 / 40k + 160 = 40 + 20 + 160 = 220 ms.
    report(&mut c, 0, 1_600);
    // 1 loads 3,984 tokens from L2 (10 ms) while computing 16 (0.4 ms): 10 + 3.2 ms.
    // 2: 100 + 800 ms.
    let route = c.route(Time::ZERO, &request_of(&prompt)).unwrap();
    assert_eq!(route.prefill, InstanceId(1));
    assert_eq!(cache_aware_why(&route), (0, 3_984, 0, 13.2));
    // The uncached 16 tokens now count as routed to 1; a queue of 250 ms there tips it to 0.
    report(&mut c, 1, 10_000);
    let route = c.route(Time::ZERO, &request_of(&prompt)).unwrap();
    assert_eq!(route.prefill, InstanceId(0));
    assert_eq!(cache_aware_why(&route), (3_200, 0, 0, 220.0));
}

#[test]
fn cache_aware_passes_over_a_hot_instance_however_much_it_caches() {
    // Only instance 0 holds 2,000-token requests; all four hold the cached 896-token one.
    let mut c = controller(RouterConfig::CacheAware(Default::default()), &[1_000_000, 1_000, 1_000, 1_000]);
    let prompt = chain(2, 56);
    store(&mut c, 0, Tier::L1, &prompt[..55]);
    let big = request(2_000, 1);
    let cached_goes_to = |c: &mut Controller, in_flight_on_0: u32| {
        while c.fleet().get(InstanceId(0)).unwrap().in_flight < in_flight_on_0 {
            assert_eq!(c.route(Time::ZERO, &big).unwrap().prefill, InstanceId(0));
        }
        // Nothing queued as far as the report says: only the in-flight count differs.
        report(c, 0, 0);
        let route = c.route(Time::ZERO, &request_of(&prompt)).unwrap();
        c.on_event(
            Time::ZERO,
            &FleetEvent::RequestFinished { instance: route.prefill, request: RequestId(0), output: None },
        );
        route.prefill
    };
    // Hot above 2 × mean + 8: 16 of 16 in flight is not (2 × 4 + 8 = 16), 17 is.
    assert_eq!(cached_goes_to(&mut c, 16), InstanceId(0));
    assert_eq!(cached_goes_to(&mut c, 17), InstanceId(1));
}

fn cache_aware_terms(route: &Route) -> (f64, f64, f64, f64) {
    match route.why {
        Why::CacheAware { predicted_ttft_ms, stall_ms, step_ms, score_ms, .. } => {
            (predicted_ttft_ms, stall_ms, step_ms, score_ms)
        }
        ref other => panic!("not a cache-aware reason: {other:?}"),
    }
}

/// A report of `running` decoding requests with `decode_tokens_left` to generate between
/// them, and nothing else.
fn decoding(running: u32, decode_tokens_left: u64) -> Load {
    Load { running, decode_tokens_left, kv_total_blocks: 100_000, ..Load::default() }
}

/// cache-aware without its decode-tokens-left term, for the tests of the terms it would blur.
fn without_left() -> RouterConfig {
    RouterConfig::CacheAware(CacheAwareConfig { left_weight: 0.0, ..CacheAwareConfig::default() })
}

#[test]
fn cache_aware_sends_a_prompt_away_from_a_big_decode_batch_when_ttft_is_equal() {
    // 0 decodes 60 requests (100 tokens left each on average), 1 is idle; neither has a
    // queue, so the time to first token is the same (50 ms of prefill and 8 × 50 ms of copy
    // term: no prefix).
    let mut c = controller(without_left(), &[1_000_000; 2]);
    report_load(&mut c, 0, decoding(60, 6_000));
    report_load(&mut c, 1, decoding(0, 0));
    let route = c.route(Time::ZERO, &request(2_000, 100)).unwrap();
    assert_eq!(route.prefill, InstanceId(1));
    let (ttft_ms, stall_ms, ..) = cache_aware_terms(&route);
    assert_eq!((ttft_ms, stall_ms), (450.0, 0.0));
    // On 0 the prompt would have cost each of its 60 decodes 50 ms more over ~100 tokens:
    // 2 × 50 ms × 60 × 60 / 6,000 = 60 ms. A queue of 100 ms on 1 outweighs that.
    report(&mut c, 1, 4_000);
    let route = c.route(Time::ZERO, &request(2_000, 100)).unwrap();
    assert_eq!(route.prefill, InstanceId(0));
    let (ttft_ms, stall_ms, ..) = cache_aware_terms(&route);
    assert_eq!((ttft_ms, stall_ms), (450.0, 60.0));
}

#[test]
fn cache_aware_counts_a_stall_against_the_tokens_the_running_requests_have_left() {
    // 0 runs 10 requests about to finish (10 tokens left each); 1 runs 40 with 1,000 left
    // each. The same 50 ms of prefill adds 5 ms to each of 0's TPOTs, 0.05 ms to 1's.
    let mut c = controller(without_left(), &[1_000_000; 2]);
    report_load(&mut c, 0, decoding(10, 100));
    report_load(&mut c, 1, decoding(40, 40_000));
    let route = c.route(Time::ZERO, &request(2_000, 100)).unwrap();
    assert_eq!(route.prefill, InstanceId(1));
    // 2 × 50 ms × 40 × 40 / 40,000 = 4 ms (on 0 it would have been 100 ms).
    assert_eq!(cache_aware_terms(&route).1, 4.0);
}

#[test]
fn cache_aware_predicts_the_decode_step_the_request_would_join() {
    // Equal queues and batches; 0 holds 320,000 tokens of KV, 1 none. Default hints: a step
    // is 6 ms + 20 µs a sequence + 0.04 µs a token of KV.
    let mut c = controller(RouterConfig::CacheAware(Default::default()), &[1_000_000; 2]);
    report_load(&mut c, 0, Load { kv_used_blocks: 20_000, ..decoding(0, 0) });
    report_load(&mut c, 1, decoding(0, 0));
    let route = c.route(Time::ZERO, &request(1_000, 100)).unwrap();
    assert_eq!(route.prefill, InstanceId(1));
    // 6,000 + 20 + 0.04 × 1,000 µs, weighted 4; on 0 it would be 12.8 ms longer.
    let (ttft_ms, _, step_ms, score_ms) = cache_aware_terms(&route);
    assert_eq!(step_ms, 6.1);
    assert!((score_ms - (ttft_ms + 24.2)).abs() < 1e-9, "score {score_ms} ms, TTFT {ttft_ms} ms");
}

#[test]
fn cache_aware_keeps_a_prompt_off_an_instance_whose_kv_would_overflow() {
    // Both hold 16,000 tokens of KV and decode 10 requests. 0 holds 8,000 tokens now but
    // its requests have 8,000 still to generate: with the prompt's 2,000 its KV would end
    // 2,000 tokens over. 1 holds 12,800 now, 1,000 to generate: it fits.
    let kv = |used, left| Load { kv_used_blocks: used, kv_total_blocks: 1_000, ..decoding(10, left) };
    let setup = |config: CacheAwareConfig| {
        let mut c = controller(RouterConfig::CacheAware(config), &[1_000_000; 2]);
        report_load(&mut c, 0, kv(500, 8_000));
        report_load(&mut c, 1, kv(800, 1_000));
        c
    };
    let route = setup(CacheAwareConfig::default()).route(Time::ZERO, &request(2_000, 100)).unwrap();
    assert_eq!(route.prefill, InstanceId(1));
    let Why::CacheAware { kv_ms, stall_ms, .. } = route.why else { panic!("not a cache-aware reason") };
    // 1 fits (no KV term) but stalls more: 2 × 50 ms × 10 × 10 / 1,000 = 10 ms against 0's
    // 1.2 ms; 0's overflow costs 0.5 × 2,000 / 40,000 tokens/s = 25 ms.
    assert_eq!((kv_ms, stall_ms), (0.0, 10.0));
    // Without the KV side (and the tokens left, which see the same 7,000 more on 0) the
    // smaller stall wins.
    let config = CacheAwareConfig { kv_weight: 0.0, left_weight: 0.0, ..CacheAwareConfig::default() };
    let route = setup(config).route(Time::ZERO, &request(2_000, 100)).unwrap();
    assert_eq!(route.prefill, InstanceId(0));
}

#[test]
fn cache_aware_prefers_the_instance_whose_requests_have_fewer_tokens_left() {
    // The same batch of 20 on both, the same queue: 0's requests have 20,000 tokens still to
    // generate, 1's 4,000. The prompt's stall is smaller on 0 (spread over more tokens: 1 ms
    // against 5 ms), but 0's batch will hold its KV and its steps five times as long.
    let mut c = controller(RouterConfig::CacheAware(Default::default()), &[1_000_000; 2]);
    report_load(&mut c, 0, decoding(20, 20_000));
    report_load(&mut c, 1, decoding(20, 4_000));
    let route = c.route(Time::ZERO, &request(2_000, 100)).unwrap();
    assert_eq!(route.prefill, InstanceId(1));
    let Why::CacheAware { left_ms, .. } = route.why else { panic!("not a cache-aware reason") };
    // 4,000 tokens / 40,000 tokens/s = 100 ms (on 0 it would have been 500 ms).
    assert_eq!(left_ms, 100.0);
    // Without the term the smaller stall on 0 (1 ms against 5 ms) takes it.
    let mut c = controller(without_left(), &[1_000_000; 2]);
    report_load(&mut c, 0, decoding(20, 20_000));
    report_load(&mut c, 1, decoding(20, 4_000));
    assert_eq!(c.route(Time::ZERO, &request(2_000, 100)).unwrap().prefill, InstanceId(0));
}

#[test]
fn cache_aware_counts_the_tokens_left_of_requests_routed_since_the_report() {
    // Both decode 20 requests with 4,000 tokens left; 1 has 2.5 s of prefill queued, so both
    // prompts go to 0. The second sees the first's 2,000 tokens to generate, which 0's last
    // report cannot: 6,000 tokens / 40,000 tokens/s = 150 ms, not 100.
    let mut c = controller(RouterConfig::CacheAware(Default::default()), &[1_000_000; 2]);
    report_load(&mut c, 0, decoding(20, 4_000));
    report_load(&mut c, 1, Load { prefill_tokens_left: 100_000, ..decoding(20, 4_000) });
    let left_ms = |route: Route| {
        assert_eq!(route.prefill, InstanceId(0));
        let Why::CacheAware { left_ms, .. } = route.why else { panic!("not a cache-aware reason") };
        left_ms
    };
    assert_eq!(left_ms(c.route(Time::ZERO, &request(1_000, 2_000)).unwrap()), 100.0);
    assert_eq!(left_ms(c.route(Time::ZERO, &request(1_000, 100)).unwrap()), 150.0);
}

#[test]
fn cache_aware_scales_the_reported_tokens_left_by_the_share_of_their_bounds_outputs_use() {
    // The report counts 4,000 tokens left, to the requests' bounds. Outputs that ended used a
    // tenth of theirs, so 400 are expected: 10 ms, not 100; one cut short teaches nothing.
    let mut c = controller(RouterConfig::CacheAware(Default::default()), &[1_000_000; 2]);
    let ended = |output| FleetEvent::RequestFinished { instance: InstanceId(1), request: RequestId(0), output };
    c.on_event(Time::ZERO, &ended(Some(OutputEnd { tokens: 400, bound: 4_000 })));
    c.on_event(Time::ZERO, &ended(None));
    report_load(&mut c, 0, decoding(20, 4_000));
    report_load(&mut c, 1, Load { prefill_tokens_left: 100_000, ..decoding(20, 4_000) });
    let route = c.route(Time::ZERO, &request(1_000, 2_000)).unwrap();
    let Why::CacheAware { left_ms, output_share, .. } = route.why else { panic!("not a cache-aware reason") };
    assert_eq!((route.prefill, left_ms, output_share), (InstanceId(0), 10.0, 0.1));
    // The share is the fleet's, kept when a policy change builds the router anew.
    let config =
        ControllerConfig { router: RouterConfig::CacheAware(Default::default()), seed: 7, hints: CostHints::default() };
    c.set_router(&config);
    assert_eq!(c.fleet().output_share(), 0.1);
}

/// TTFT 2 s, TPOT 100 ms for every class.
const TARGETS_2S: [crate::flow::Targets; 3] =
    [crate::flow::Targets { ttft: engine::Dur(2_000_000), tpot: engine::Dur(100_000) }; 3];

/// Cache-aware with triage at `lost_cap` on `n` instances, under [`TARGETS_2S`].
fn triage_controller(lost_cap: f64, n: usize) -> Controller {
    let config = CacheAwareConfig { lost_cap, ..Default::default() };
    let mut c = controller(RouterConfig::CacheAware(config), &vec![1_000_000; n]);
    c.set_targets(TARGETS_2S);
    c
}

#[test]
fn cache_aware_places_a_request_lost_everywhere_on_the_longest_queue_below_the_cap() {
    // Queues of 2, 3 and 2.5 s of prefill: a 1,000-token prompt's first token comes after
    // 2.025 s at best, past its 2 s target everywhere, so with triage on it goes to 1 (the
    // longest queue), not to 0 (the best score); with the cap at 2.75 s, to 2; with triage
    // off, or without targets to triage by, to 0.
    let loaded = |c: &mut Controller| {
        for (i, queued) in [80_000, 120_000, 100_000].into_iter().enumerate() {
            report(c, i as u32, queued);
        }
    };
    let place = |lost_cap: f64, with_targets: bool| {
        let config = CacheAwareConfig { lost_cap, ..Default::default() };
        let mut c = controller(RouterConfig::CacheAware(config), &[1_000_000; 3]);
        if with_targets {
            c.set_targets(TARGETS_2S);
        }
        loaded(&mut c);
        let route = c.route(Time::ZERO, &request(1_000, 10)).unwrap();
        (route.prefill.0, matches!(route.why, Why::CacheAware { lost: true, .. }))
    };
    assert_eq!(place(4.0, true), (1, true));
    assert_eq!(place(1.375, true), (2, true));
    assert_eq!(place(0.0, true), (0, false));
    assert_eq!(place(4.0, false), (0, false));
    // Nothing below a 1 s cap: placed as the others.
    assert_eq!(place(0.5, true), (0, false));
}

#[test]
fn cache_aware_places_a_lost_request_by_its_queue_less_the_work_it_brings() {
    // 0 holds all but the last block of the 4,000-token prompt behind a 3 s queue; 1 holds
    // nothing behind 3.2 s. Lost on both (3 s × 1.5 > 2 s): on 0 it brings 16 tokens of
    // prefill, on 1 all 4,000 and a new copy (0.1 s + 4 × 0.1 s), so it goes to 0.
    let mut c = triage_controller(4.0, 2);
    let prompt = chain(3, 250);
    store(&mut c, 0, Tier::L1, &prompt[..249]);
    report(&mut c, 0, 120_000);
    report(&mut c, 1, 128_000);
    let route = c.route(Time::ZERO, &request_of(&prompt)).unwrap();
    assert_eq!(route.prefill, InstanceId(0));
    assert!(matches!(route.why, Why::CacheAware { lost: true, .. }));
}

#[test]
fn cache_aware_counts_the_time_a_request_has_waited_against_its_target() {
    // 1 s of queue on 0, 1.5 s on 1, taken 1.5 times longer: a request arriving now makes
    // its 2 s target on 0 (1.525 s), the same request routed 1 s after its arrival does not.
    let mut c = triage_controller(4.0, 2);
    report(&mut c, 0, 40_000);
    report(&mut c, 1, 60_000);
    let fresh = c.route(Time::ZERO, &request(1_000, 10)).unwrap();
    assert_eq!(fresh.prefill, InstanceId(0));
    assert!(matches!(fresh.why, Why::CacheAware { lost: false, .. }));
    let late = c.route(Time(1_000_000), &request(1_000, 10)).unwrap();
    assert_eq!(late.prefill, InstanceId(1));
    assert!(matches!(late.why, Why::CacheAware { lost: true, .. }));
}

#[test]
fn cache_aware_keeps_a_cached_prompt_on_its_busy_instance() {
    // 0 holds all but the last block of the prompt and decodes 60 requests; 1 is idle and
    // holds nothing. On 0 only 16 tokens are computed, so the stall is tiny.
    let mut c = controller(RouterConfig::CacheAware(Default::default()), &[1_000_000; 2]);
    let prompt = chain(3, 250);
    store(&mut c, 0, Tier::L1, &prompt[..249]);
    report_load(&mut c, 0, decoding(60, 6_000));
    report_load(&mut c, 1, decoding(0, 0));
    let route = c.route(Time::ZERO, &request_of(&prompt)).unwrap();
    assert_eq!(route.prefill, InstanceId(0));
    // 16 tokens: 2 × 0.4 ms of prefill × 60 × 60 / 6,000 = 0.48 ms.
    assert_eq!(cache_aware_terms(&route).1, 0.5);
}

#[test]
fn cache_aware_picks_in_queue_order_exactly_as_it_scores_every_instance() {
    use super::cache_aware::CacheAware;
    use rand::{Rng, SeedableRng};
    for seed in 0..6u64 {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = 80u32;
        let mut c = controller(RouterConfig::CacheAware(Default::default()), &vec![400_000; n as usize]);
        let hints = CostHints::default();
        let mut every = CacheAware::new(Default::default(), hints).ordered_from(usize::MAX);
        let mut ordered = CacheAware::new(Default::default(), hints).ordered_from(0);
        // Prompts from a few shared prefixes, cached here and there in every tier.
        let prefixes: Vec<Vec<BlockHash>> = (0..6).map(|p| chain(p, 40)).collect();
        for step in 0..400 {
            match rng.random_range(0..10) {
                0..=3 => {
                    let load = Load {
                        prefill_tokens_left: rng.random_range(0..4) * rng.random_range(0..20_000),
                        decode_tokens_left: rng.random_range(0..50_000),
                        running: rng.random_range(0..40),
                        waiting: rng.random_range(0..4),
                        kv_used_blocks: rng.random_range(0..20_000),
                        kv_total_blocks: 25_000,
                        admission_paused: rng.random_range(0..30) == 0,
                        ..Load::default()
                    };
                    let event = FleetEvent::Load { instance: InstanceId(rng.random_range(0..n)), load };
                    c.on_event(Time::ZERO, &event);
                    every.on_event(&event);
                    ordered.on_event(&event);
                }
                4 | 5 => {
                    let p = &prefixes[rng.random_range(0..prefixes.len())];
                    let tier = [Tier::L1, Tier::L2, Tier::L3][rng.random_range(0..3)];
                    store(&mut c, rng.random_range(0..n), tier, &p[..rng.random_range(1..p.len())]);
                }
                6 => {
                    // Routed by the controller: requests in flight and routed since reports.
                    let p = &prefixes[rng.random_range(0..prefixes.len())];
                    let _ = c.route(Time::ZERO, &request_of(&p[..rng.random_range(1..p.len())]));
                }
                7 if step % 50 == 7 => {
                    let instance = InstanceId(rng.random_range(0..n));
                    c.on_event(Time::ZERO, &FleetEvent::InstanceDraining { instance });
                }
                _ => {
                    let p = &prefixes[rng.random_range(0..prefixes.len())];
                    let r = request_of(&p[..rng.random_range(1..p.len())]);
                    let a = every.pick(&r, c.fleet());
                    let b = ordered.pick(&r, c.fleet());
                    assert_eq!(a, b, "seed {seed}, step {step}");
                }
            }
        }
    }
}
