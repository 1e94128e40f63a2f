//! One contract suite run over every router, then each router's own rule.

use super::*;
use crate::controller::{Controller, ControllerConfig, Reject};
use engine::{InstanceId, Load, RequestId, Time};

fn request(prompt: u32, output: u32) -> Request {
    Request {
        id: RequestId(0),
        arrival: Time::ZERO,
        prompt_tokens: prompt,
        max_output_tokens: output,
        block_hashes: Vec::new(),
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
    for router in RouterConfig::ALL {
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
    for router in RouterConfig::ALL {
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
fn every_router_repeats_its_choices_for_the_same_seed() {
    for router in RouterConfig::ALL {
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
    for router in RouterConfig::ALL {
        assert_eq!(router.name().parse::<RouterConfig>(), Ok(router));
        assert_eq!(router.build(1).name(), router.name());
    }
    let err = "fastest".parse::<RouterConfig>().unwrap_err().to_string();
    assert_eq!(err, "unknown router `fastest` (valid: round-robin, least-outstanding, power-of-two)");
}

#[test]
fn round_robin_cycles_through_serving_instances() {
    let mut c = controller(RouterConfig::RoundRobin, &[10_000; 3]);
    let picks: Vec<u32> = (0..6).map(|_| c.route(Time::ZERO, &request(10, 1)).unwrap().prefill.0).collect();
    assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
}

#[test]
fn least_outstanding_counts_tokens_routed_since_the_last_report() {
    let mut c = controller(RouterConfig::LeastOutstanding, &[10_000; 3]);
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
    let mut c = controller(RouterConfig::PowerOfTwo, &[10_000; 5]);
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
