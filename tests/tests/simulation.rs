//! The whole simulator (workload, controller, engine instances, cost model, metrics) end to
//! end, through its library API.

use policies::RouterConfig;
use simulator::report::{Report, RunReport};
use simulator::scenario::tiers::KvSection;
use simulator::scenario::{FleetSection, PoolsSection, Scenario, SchedulerSection, Settings, WorkloadSection};
use simulator::sim;
use simulator::workload::{ArrivalProcess, LengthDist, LongOutputs, MaxTokens, SyntheticConfig};

fn mooncake(instances: u32, max_requests: u64) -> Settings {
    Scenario {
        routers: Some(RouterConfig::names().iter().map(|s| s.to_string().into()).collect()),
        fleet: FleetSection { instances: Some(instances), ..FleetSection::default() },
        workload: WorkloadSection {
            trace: Some(tests::trace("mooncake-conversation.jsonl")),
            max_requests: Some(max_requests),
            ..WorkloadSection::default()
        },
        ..Scenario::default()
    }
    .resolve()
    .expect("valid scenario")
}

fn json_of(settings: &Settings) -> String {
    let runs = settings
        .routers
        .iter()
        .map(|r| {
            let w = settings.open_workload(settings.rate_scale).expect("trace opens");
            let out = sim::run(&settings.sim_config(r), w, &mut |_| {}).expect("run");
            RunReport { router: out.router, summary: out.summary, decisions: out.decisions }
        })
        .collect();
    serde_json::to_string_pretty(&Report { runs, calibration: None, step_check: None }).expect("serializable")
}

#[test]
fn the_same_seed_and_inputs_give_byte_identical_json() {
    let s = mooncake(4, 1500);
    assert_eq!(json_of(&s), json_of(&s));
}

/// Clients' `max_tokens` changes what routers know of outputs, not the work: the same tokens
/// come out, a router blind to token counts places every request as before, and one that
/// counts tokens left (least-outstanding) sees the bound.
#[test]
fn a_client_bound_on_outputs_hides_their_lengths_from_routers_not_from_engines() {
    let run = |router: &str, max_tokens: MaxTokens| {
        let mut s = mooncake(4, 1500);
        s.routers.retain(|r| r.label() == router);
        s.max_tokens = max_tokens;
        let w = s.open_workload(s.rate_scale).expect("trace opens");
        sim::run(&s.sim_config(&s.routers[0]), w, &mut |_| {}).expect("run")
    };
    for router in ["round-robin", "least-outstanding"] {
        let (exact, bound) = (run(router, MaxTokens::Exact), run(router, MaxTokens::Bound(8192)));
        assert_eq!(exact.summary.output_tokens, bound.summary.output_tokens, "{router}");
        let same = serde_json::to_string(&exact.summary).ok() == serde_json::to_string(&bound.summary).ok();
        assert_eq!(same, router == "round-robin", "{router}: only a router counting tokens left sees the bound");
    }
    // The decisions sampled: with requests in flight, the least outstanding is past the bound.
    let outstanding = |m| {
        let out = run("least-outstanding", m);
        out.decisions.iter().filter_map(|d| d.why["outstanding_tokens"].as_u64()).max().unwrap_or(0)
    };
    assert!(outstanding(MaxTokens::Bound(8192)) > outstanding(MaxTokens::Exact));
}

#[test]
fn a_synthetic_workload_replays_from_its_seed_and_changes_with_it() {
    let settings = |seed| {
        let mut synthetic = SyntheticConfig::bench_default();
        synthetic.requests = 3000;
        Scenario {
            seed: Some(seed),
            routers: Some(vec!["power-of-two".into()]),
            fleet: FleetSection { instances: Some(4), ..FleetSection::default() },
            workload: WorkloadSection {
                synthetic: Some(synthetic),
                rate_scale: Some(0.05),
                ..WorkloadSection::default()
            },
            ..Scenario::default()
        }
        .resolve()
        .expect("valid scenario")
    };
    assert_eq!(json_of(&settings(1)), json_of(&settings(1)));
    assert_ne!(json_of(&settings(1)), json_of(&settings(2)));
}

/// The Mooncake trace on two instances (or one prefill and one decode instance), each run
/// speculating as its variant says.
fn speculating(seed: u64, mode: &str, routers: &[&str]) -> Settings {
    Scenario {
        seed: Some(seed),
        routers: Some(routers.iter().map(|r| r.to_string().into()).collect()),
        fleet: FleetSection { instances: Some(2), ..FleetSection::default() },
        workload: WorkloadSection {
            trace: Some(tests::trace("mooncake-conversation.jsonl")),
            max_requests: Some(1500),
            ..WorkloadSection::default()
        },
        pools: PoolsSection { mode: Some(mode.into()), ..PoolsSection::default() },
        ..Scenario::default()
    }
    .resolve()
    .expect("valid scenario")
}

#[test]
fn speculating_runs_replay_from_their_seed_and_finish_every_request() {
    let routers = ["least-outstanding@nospec", "least-outstanding@dspark", "power-of-two@eagle3+hw"];
    for mode in ["colocated", "pd"] {
        let s = speculating(1, mode, &routers);
        let json = json_of(&s);
        assert_eq!(json, json_of(&s), "{mode}");
        assert_ne!(json, json_of(&speculating(2, mode, &routers)), "{mode}: acceptance draws come from the seed");
        let report: Report = serde_json::from_str(&json).expect("a report");
        let drafters: Vec<Option<&str>> =
            report.runs.iter().map(|r| r.summary.speculation.as_ref().map(|p| p.drafter.as_str())).collect();
        assert_eq!(drafters, [None, Some("dspark"), Some("eagle3")], "{mode}");
        for r in &report.runs {
            assert_eq!(r.summary.requests + r.summary.rejected, 1500, "{mode} {}", r.router);
        }
        let tpot = |i: usize| report.runs[i].summary.tpot_ms.mean;
        assert!(tpot(1) < tpot(0), "{mode}: dspark {} ms against {} ms without", tpot(1), tpot(0));
    }
}

#[test]
fn every_request_of_the_trace_is_finished_or_refused_under_every_router() {
    let s = mooncake(2, 2000);
    for r in &s.routers {
        let w = s.open_workload(s.rate_scale).expect("trace opens");
        let out = sim::run(&s.sim_config(r), w, &mut |_| {}).expect("run");
        assert_eq!(out.summary.requests + out.summary.rejected, 2000, "{}", out.router);
        assert!(out.summary.cache_hit_rate > 0.0, "{}: the trace shares prefixes", out.router);
    }
}

#[test]
fn load_aware_routing_beats_round_robin_on_a_loaded_fleet() {
    let s = mooncake(3, 3000);
    let w = |r| {
        let out = sim::run(&s.sim_config(&s.run_of(r)), s.open_workload(1.0).expect("trace opens"), &mut |_| {})
            .expect("run");
        out.summary.ttft_ms.mean
    };
    assert!(w(RouterConfig::LeastOutstanding(Default::default())) < w(RouterConfig::RoundRobin(Default::default())));
}

#[test]
fn more_instances_give_lower_time_to_first_token() {
    let ttft = |n| {
        let s = mooncake(n, 1500);
        let out = sim::run(
            &s.sim_config(&s.run_of(RouterConfig::LeastOutstanding(Default::default()))),
            s.open_workload(1.0).expect("trace"),
            &mut |_| {},
        )
        .expect("run");
        out.summary.ttft_ms.p90
    };
    assert!(ttft(8) < ttft(2));
}

fn tiered(instances: u32, max_requests: u64, trace: &str, routers: &[&str]) -> Settings {
    tiered_in_chunks(instances, max_requests, trace, routers, None)
}

/// [`tiered`] with L2 and L3 in offload chunks of `chunk_tokens` (`None`: single blocks).
fn tiered_in_chunks(
    instances: u32,
    max_requests: u64,
    trace: &str,
    routers: &[&str],
    chunk_tokens: Option<u32>,
) -> Settings {
    Scenario {
        routers: Some(routers.iter().map(|s| s.to_string().into()).collect()),
        fleet: FleetSection { instances: Some(instances), ..FleetSection::default() },
        workload: WorkloadSection {
            trace: Some(tests::trace(trace)),
            max_requests: Some(max_requests),
            ..WorkloadSection::default()
        },
        kv: KvSection {
            tiers: Some("l1,l2,l3".into()),
            l2_gib: Some(16.0),
            l3_gib: Some(256.0),
            offload_chunk_tokens: chunk_tokens,
            ..KvSection::default()
        },
        ..Scenario::default()
    }
    .resolve()
    .expect("valid scenario")
}

fn summaries(s: &Settings) -> Vec<simulator::metrics::Summary> {
    s.routers
        .iter()
        .map(|r| {
            let w = s.open_workload(s.rate_scale).expect("workload opens");
            sim::run(&s.sim_config(r), w, &mut |_| {}).expect("run").summary
        })
        .collect()
}

/// Round-robin over `fleet` (two instances unless it says) on `synthetic` at `rate_scale`.
fn round_robin_synthetic(fleet: FleetSection, synthetic: SyntheticConfig, rate_scale: f64) -> Settings {
    Scenario {
        routers: Some(vec!["round-robin".into()]),
        fleet: FleetSection { instances: fleet.instances.or(Some(2)), ..fleet },
        workload: WorkloadSection {
            synthetic: Some(synthetic),
            rate_scale: Some(rate_scale),
            ..WorkloadSection::default()
        },
        ..Scenario::default()
    }
    .resolve()
    .expect("valid scenario")
}

#[test]
fn tiered_kv_with_cache_aware_routing_nears_the_infinite_cache_bound() {
    let s = tiered(4, 3000, "mooncake-conversation.jsonl", &["least-outstanding@l1", "cache-aware"]);
    let [l1_only, tiered] = <[_; 2]>::try_from(summaries(&s)).expect("two runs");
    let by_tier =
        |x: &simulator::metrics::Summary| x.hit_rate_by_tier.l1 + x.hit_rate_by_tier.l2 + x.hit_rate_by_tier.l3;
    for x in [&l1_only, &tiered] {
        assert!((by_tier(x) - x.cache_hit_rate).abs() < 1e-9, "tiers add up to the hit rate");
        assert!(x.cache_hit_rate <= x.max_hit_rate.expect("measured") + 1e-9, "no run beats the bound");
    }
    assert_eq!(l1_only.hit_rate_by_tier.l2 + l1_only.hit_rate_by_tier.l3, 0.0, "L1-only uses no lower tier");
    assert!(tiered.hit_rate_by_tier.l2 > 0.0 && tiered.hit_rate_by_tier.l3 > 0.0);
    assert!(
        tiered.cache_hit_rate > l1_only.cache_hit_rate + 0.10,
        "hit rate {} vs {}",
        tiered.cache_hit_rate,
        l1_only.cache_hit_rate
    );
    assert!(tiered.ttft_ms.mean < l1_only.ttft_ms.mean);
}

/// L2 and L3 kept in 256-token offload chunks: on the Mooncake trace (hashed in 512-token
/// blocks) every chunk is whole where a block was, so the hit rates stay those of tiers kept
/// by block; cache-aware still reads L2 and L3 through the index (its hits there are placed
/// by the index's chunk walk); and the same inputs give the same JSON.
#[test]
fn offload_chunks_keep_the_hit_rate_of_tiers_kept_by_block() {
    let routers = ["least-outstanding", "cache-aware", "dynamo-kv"];
    let by_block = tiered(4, 3000, "mooncake-conversation.jsonl", &routers);
    let chunked = tiered_in_chunks(4, 3000, "mooncake-conversation.jsonl", &routers, Some(256));
    assert_eq!(chunked.instance.offload_chunk_blocks, 16);
    for (block, chunk) in summaries(&by_block).iter().zip(summaries(&chunked)) {
        assert!(
            (block.cache_hit_rate - chunk.cache_hit_rate).abs() < 0.01,
            "{} vs {}",
            block.cache_hit_rate,
            chunk.cache_hit_rate
        );
        assert!(chunk.hit_rate_by_tier.l2 > 0.0 && chunk.hit_rate_by_tier.l3 > 0.0, "{:?}", chunk.hit_rate_by_tier);
        assert!(chunk.cache_hit_rate <= chunk.max_hit_rate.expect("measured") + 1e-9, "no run beats the bound");
    }
    assert_eq!(json_of(&chunked), json_of(&chunked));
    assert_ne!(json_of(&chunked), json_of(&by_block), "the chunks changed what the tiers hold");
}

#[test]
fn cache_aware_routing_does_not_lose_where_nothing_is_shared() {
    let s = tiered(3, 3000, "azure-llm-2023-conv.csv", &["least-outstanding", "cache-aware"]);
    let [lo, ca] = <[_; 2]>::try_from(summaries(&s)).expect("two runs");
    assert_eq!(ca.cache_hit_rate, 0.0);
    assert!(ca.ttft_ms.mean <= lo.ttft_ms.mean * 1.05, "{} vs {}", ca.ttft_ms.mean, lo.ttft_ms.mean);
}

/// Two small-KV instances (Qwen3-32B on one H100 each: about 37K tokens of KV) under short
/// requests and, from 10 s to 30 s, a burst of 4K to 8K-token outputs.
fn long_output_burst(routers: &[&str], runaway_action: &str) -> Settings {
    let synthetic = SyntheticConfig {
        requests: 400,
        arrival: ArrivalProcess::Poisson { rate_rps: 8.0 },
        rate_schedule: Vec::new(),
        input: LengthDist::Lognormal { median: 512.0, sigma: 0.8, min: 16, max: 2048 },
        output: LengthDist::Lognormal { median: 100.0, sigma: 0.8, min: 1, max: 1024 },
        prefix: None,
        long: None,
        long_output: Some(LongOutputs {
            share: 0.3,
            output: LengthDist::Uniform { min: 4096, max: 8192 },
            from_s: Some(10.0),
            until_s: Some(30.0),
        }),
    };
    Scenario {
        routers: Some(routers.iter().map(|s| s.to_string().into()).collect()),
        fleet: FleetSection {
            instances: Some(2),
            model: Some("qwen3-32b".into()),
            gpu: Some("h100".into()),
            ..FleetSection::default()
        },
        workload: WorkloadSection { synthetic: Some(synthetic), ..WorkloadSection::default() },
        scheduler: SchedulerSection {
            kv_high_water: Some(0.9),
            kv_low_water: Some(0.7),
            runaway_output_tokens: Some(1024),
            runaway_action: Some(runaway_action.into()),
            ..SchedulerSection::default()
        },
        ..Scenario::default()
    }
    .resolve()
    .expect("valid scenario")
}

#[test]
fn a_burst_of_long_outputs_is_evicted_and_rerouted_and_every_request_finishes() {
    let s = long_output_burst(&["least-outstanding@nohw", "least-outstanding@hw", "round-robin"], "reroute");
    let [off, on, round_robin] = <[_; 3]>::try_from(summaries(&s)).expect("three runs");
    for x in [&off, &on, &round_robin] {
        assert_eq!((x.requests, x.rejected, x.ended_runaway), (400, 0, 0), "every request finishes");
        assert!(x.long_output_requests > 20, "the burst has long outputs: {}", x.long_output_requests);
    }
    assert_eq!((off.evictions, off.admission_paused_s, off.paused_wait_ms.p99), (0, 0.0, 0.0), "@nohw: off");
    // Plain runs follow the scenario, which sets a high-water mark: on.
    for x in [&on, &round_robin] {
        assert!(x.evictions > 0 && x.admission_paused_s > 0.0, "{x:?}");
        assert_eq!(x.reroutes, x.evictions, "every evicted request is placed again");
        assert!(x.output_tokens == off.output_tokens, "each generates all of its output, once");
    }
    assert!(on.preemptions < off.preemptions, "{} vs {}", on.preemptions, off.preemptions);
}

#[test]
fn runaways_ended_by_policy_are_counted_and_never_meet_the_slo() {
    let s = long_output_burst(&["least-outstanding"], "end");
    let [x] = <[_; 1]>::try_from(summaries(&s)).expect("one run");
    assert_eq!((x.requests, x.rejected, x.evictions, x.reroutes), (400, 0, 0, 0));
    assert!(x.ended_runaway > 0);
    assert!(x.slo_met + x.ended_runaway <= x.requests);
}

#[test]
fn a_dispatch_latency_adds_itself_to_every_first_token_and_nothing_else() {
    let run = |dispatch_ms: f64| {
        let mut synthetic = SyntheticConfig::bench_default();
        synthetic.requests = 200;
        let fleet = FleetSection { dispatch_ms: Some(dispatch_ms), ..FleetSection::default() };
        summaries(&round_robin_synthetic(fleet, synthetic, 0.002)).remove(0)
    };
    let (ideal, live) = (run(0.0), run(3.5));
    assert_eq!(ideal.requests, live.requests);
    // A constant latency before routing shifts the whole run in time: queueing is unchanged.
    let (a, b) = (ideal.ttft_ms.mean, live.ttft_ms.mean);
    assert!((b - a - 3.5).abs() < 1e-6, "mean TTFT {a} ms without the latency, {b} ms with it");
    // Percentiles come from histogram buckets (about 1% wide).
    for (a, b) in [(ideal.ttft_ms.p50, live.ttft_ms.p50), (ideal.ttft_ms.p99, live.ttft_ms.p99)] {
        assert!((b - (a + 3.5)).abs() < 0.01 * b, "TTFT percentile {a} ms without the latency, {b} ms with it");
    }
    assert_eq!(ideal.tpot_ms, live.tpot_ms, "the latency is the path's, not the steps'");
}

#[test]
fn engines_sharing_a_gpu_share_its_time() {
    let run_with = |per_gpu: u32, rate_scale: f64, efficiency: f64| {
        let mut synthetic = SyntheticConfig::bench_default();
        synthetic.requests = 300;
        synthetic.output = LengthDist::Constant { tokens: 16 };
        // Nearly regular arrivals.
        synthetic.arrival = ArrivalProcess::Gamma { rate_rps: 1200.0, cv: 0.01 };
        let fleet = FleetSection {
            instances_per_gpu: Some(per_gpu),
            gpu_share_efficiency: Some(efficiency),
            kv_blocks: Some(20_000),
            ..FleetSection::default()
        };
        summaries(&round_robin_synthetic(fleet, synthetic, rate_scale)).remove(0)
    };
    let run = |per_gpu, rate_scale| run_with(per_gpu, rate_scale, 1.0);
    // A request every ~8 s, each done within about a second: never two at once, nothing waits.
    let (own, shared) = (run(1, 0.000_1), run(2, 0.000_1));
    assert_eq!((own.ttft_ms, own.tpot_ms), (shared.ttft_ms, shared.tpot_ms));
    assert!((shared.gpu_hours * 2.0 - own.gpu_hours).abs() < 1e-9, "one GPU instead of two");
    // Busy: both engines step at once and the GPU runs one step at a time.
    let (own, shared) = (run(1, 0.006), run(2, 0.006));
    assert_eq!(own.requests, shared.requests);
    assert!(shared.tpot_ms.mean > 1.2 * own.tpot_ms.mean, "TPOT {:?} alone, {:?} shared", own.tpot_ms, shared.tpot_ms);
    assert!(shared.ttft_ms.mean > own.ttft_ms.mean, "TTFT {:?} alone, {:?} shared", own.ttft_ms, shared.ttft_ms);
    // Context switches: overlapping steps get less of the GPU between them, lone ones all of it.
    let switching = run_with(2, 0.006, 0.8);
    assert!(switching.tpot_ms.mean > shared.tpot_ms.mean, "{:?} vs {:?}", switching.tpot_ms, shared.tpot_ms);
    assert_eq!(run_with(2, 0.000_1, 0.8).tpot_ms, run(2, 0.000_1).tpot_ms);
}
