//! The whole simulator (workload, controller, engine instances, cost model, metrics) end to
//! end, through its library API.

use policies::RouterConfig;
use simulator::report::{Report, RunReport};
use simulator::scenario::{FleetSection, Scenario, Settings, WorkloadSection};
use simulator::sim;
use simulator::workload::SyntheticConfig;

fn mooncake(instances: u32, max_requests: u64) -> Settings {
    Scenario {
        routers: Some(RouterConfig::names().iter().map(|s| s.to_string()).collect()),
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
    serde_json::to_string_pretty(&Report { runs }).expect("serializable")
}

#[test]
fn the_same_seed_and_inputs_give_byte_identical_json() {
    let s = mooncake(4, 1500);
    assert_eq!(json_of(&s), json_of(&s));
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
        let out = sim::run(&s.sim_config(&s.run_of(r)), s.open_workload(1.0).expect("trace opens"), &mut |_| {}).expect("run");
        out.summary.ttft_ms.mean
    };
    assert!(w(RouterConfig::LeastOutstanding) < w(RouterConfig::RoundRobin));
}

#[test]
fn more_instances_give_lower_time_to_first_token() {
    let ttft = |n| {
        let s = mooncake(n, 1500);
        let out =
            sim::run(&s.sim_config(&s.run_of(RouterConfig::LeastOutstanding)), s.open_workload(1.0).expect("trace"), &mut |_| {})
                .expect("run");
        out.summary.ttft_ms.p90
    };
    assert!(ttft(8) < ttft(2));
}
