//! Flow control: priority, fairness, shedding, and every request ending exactly once.

use super::*;
use crate::controller::{Controller, ControllerConfig, Released};
use crate::fleet::{DispatchError, Fleet, Route};
use crate::{Command, FleetEvent};
use engine::{InstanceId, Load, RequestId, Service, TenantId};
use proptest::prelude::*;

/// A fleet that takes every request and remembers the order.
#[derive(Default)]
struct Recording {
    placed: Vec<u64>,
    /// Those placed lifted (their tenant under its share).
    lifted: Vec<u64>,
}

impl Fleet for Recording {
    type Payload = ();

    fn dispatch(&mut self, _: Time, r: Request, _: (), _: &Route) -> Result<(), (DispatchError, Request, ())> {
        self.placed.push(r.id.0);
        if r.service.lift {
            self.lifted.push(r.id.0);
        }
        Ok(())
    }

    fn apply(&mut self, _: Time, _: &Command) {}

    fn poll_events(&mut self, _: &mut Vec<FleetEvent>) {}
}

fn request(id: u64, at_ms: u64, class: Class, tenant: u32) -> Request {
    Request {
        id: RequestId(id),
        arrival: Time::from_millis(at_ms),
        prompt_tokens: 100,
        max_output_tokens: 100,
        ends_after: None,
        block_hashes: Vec::new(),
        resume: None,
        model: Default::default(),
        service: Service { class, tenant: TenantId(tenant), ..Service::default() },
    }
}

const TARGETS: [Targets; 3] = [
    Targets { ttft: Dur(1_000_000), tpot: Dur(100_000) },
    Targets { ttft: Dur(2_000_000), tpot: Dur(100_000) },
    Targets { ttft: Dur(30_000_000), tpot: Dur(200_000) },
];

fn setup(config: FlowConfig) -> (Controller, Flow<()>, Recording) {
    let hints = CostHints::default();
    let mut c =
        Controller::new(&ControllerConfig { router: "least-outstanding".parse().expect("a router"), seed: 1, hints });
    c.on_event(Time::ZERO, &FleetEvent::InstanceUp { instance: InstanceId(0), capacity_tokens: 1_000_000 });
    (c, Flow::new(&config, &hints, TARGETS), Recording::default())
}

/// The one instance reports a long prefill queue (or none).
fn report(c: &mut Controller, busy: bool) {
    let load = Load {
        prefill_tokens_left: if busy { 1_000_000 } else { 0 },
        waiting: if busy { 50 } else { 0 },
        kv_total_blocks: 10_000,
        ..Load::default()
    };
    c.on_event(Time::ZERO, &FleetEvent::Load { instance: InstanceId(0), load });
}

fn placed(out: &[Released<()>]) -> Vec<u64> {
    out.iter().filter_map(|r| if let Released::Placed { id, .. } = r { Some(id.0) } else { None }).collect()
}

#[test]
fn no_flow_control_places_every_request_at_once() {
    let (mut c, mut flow, mut fleet) = setup(FlowConfig::None);
    report(&mut c, true);
    for id in 0..5 {
        let r = c.offer(&mut flow, &mut fleet, Time::ZERO, request(id, 0, Class::Batch, 0), ());
        assert!(matches!(r, Released::Placed { .. }), "{r:?}");
    }
    assert!(flow.is_empty());
}

/// Batch work queued first; an interactive request arriving later goes first once there
/// is room; standard before batch.
#[test]
fn a_higher_class_overtakes_the_queued_lower_classes() {
    for config in [FlowConfig::Slo(SloFlowConfig::default()), FlowConfig::LlmD(LlmDFlowConfig::default())] {
        let (mut c, mut flow, mut fleet) = setup(config);
        // One request in flight so that a report counts.
        c.offer(&mut flow, &mut fleet, Time::ZERO, request(0, 0, Class::Interactive, 0), ());
        report(&mut c, true);
        let batch = if config.name() == "llm-d" { Class::Standard } else { Class::Batch };
        for id in 1..4 {
            let r = c.offer(&mut flow, &mut fleet, Time::from_millis(id), request(id, id, batch, 0), ());
            assert!(matches!(r, Released::Queued), "{}: {r:?}", config.name());
        }
        c.offer(&mut flow, &mut fleet, Time::from_millis(5), request(4, 5, Class::Standard, 0), ());
        c.offer(&mut flow, &mut fleet, Time::from_millis(6), request(5, 6, Class::Interactive, 0), ());
        assert_eq!(flow.len(), 5);
        report(&mut c, false);
        let mut out = Vec::new();
        c.release(&mut flow, &mut fleet, Time::from_millis(10), &mut out);
        let order = placed(&out);
        assert_eq!(order[0], 5, "{}: interactive first: {order:?}", config.name());
        if batch == Class::Batch {
            assert_eq!(order, [5, 4, 1, 2, 3], "{}: then standard, then batch", config.name());
        }
    }
}

/// llm-d refuses a sheddable request at once when saturated; ours queues it and sheds it
/// after its longest wait, with a retry-after.
#[test]
fn sheddable_work_is_shed_when_the_fleet_is_saturated() {
    let (mut c, mut flow, mut fleet) = setup(FlowConfig::LlmD(LlmDFlowConfig::default()));
    c.offer(&mut flow, &mut fleet, Time::ZERO, request(0, 0, Class::Standard, 0), ());
    report(&mut c, true);
    let r = c.offer(&mut flow, &mut fleet, Time::ZERO, request(1, 0, Class::Batch, 0), ());
    let Released::Shed(shed) = r else { panic!("{r:?}") };
    assert_eq!(shed.reason, ShedReason::Saturated { class: Class::Batch });
    assert!(shed.retry_after >= Dur::from_secs_f64(1.0));

    let config = SloFlowConfig { batch_max_wait: Dur::from_secs_f64(5.0), ..SloFlowConfig::default() };
    let (mut c, mut flow, mut fleet) = setup(FlowConfig::Slo(config));
    c.offer(&mut flow, &mut fleet, Time::ZERO, request(0, 0, Class::Standard, 0), ());
    report(&mut c, true);
    let r = c.offer(&mut flow, &mut fleet, Time::ZERO, request(1, 0, Class::Batch, 0), ());
    assert!(matches!(r, Released::Queued), "{r:?}");
    assert_eq!(flow.next_deadline(), Some(Time::from_millis(5_000)));
    let mut out = Vec::new();
    c.release(&mut flow, &mut fleet, Time::from_millis(4_999), &mut out);
    assert!(out.is_empty());
    c.release(&mut flow, &mut fleet, Time::from_millis(5_000), &mut out);
    let [Released::Shed(shed)] = &out[..] else { panic!("{out:?}") };
    assert_eq!(shed.reason, ShedReason::Waited { class: Class::Batch, waited_ms: 5_000 });
    assert!(flow.is_empty());
}

#[test]
fn a_full_band_refuses_with_its_limit() {
    let config = SloFlowConfig { queue_limit: 2, ..SloFlowConfig::default() };
    let (mut c, mut flow, mut fleet) = setup(FlowConfig::Slo(config));
    c.offer(&mut flow, &mut fleet, Time::ZERO, request(0, 0, Class::Standard, 0), ());
    report(&mut c, true);
    for id in 1..3 {
        assert!(matches!(
            c.offer(&mut flow, &mut fleet, Time::ZERO, request(id, 0, Class::Standard, 0), ()),
            Released::Queued
        ));
    }
    let r = c.offer(&mut flow, &mut fleet, Time::ZERO, request(3, 0, Class::Standard, 0), ());
    let Released::Shed(shed) = r else { panic!("{r:?}") };
    assert_eq!(shed.reason, ShedReason::QueueFull { class: Class::Standard, limit: 2 });
    assert_eq!(shed.reason.code(), "queue_full");
}

/// A heavy tenant queues ten requests, then a light one queues one: least attained service
/// serves the light one second, not eleventh.
#[test]
fn a_light_tenant_is_not_stuck_behind_a_heavy_one() {
    let (mut c, mut flow, mut fleet) = setup(FlowConfig::Slo(SloFlowConfig::default()));
    c.offer(&mut flow, &mut fleet, Time::ZERO, request(0, 0, Class::Standard, 1), ());
    report(&mut c, true);
    for id in 1..11 {
        c.offer(&mut flow, &mut fleet, Time::from_millis(id), request(id, id, Class::Standard, 1), ());
    }
    c.offer(&mut flow, &mut fleet, Time::from_millis(20), request(99, 20, Class::Standard, 2), ());
    let mut order = Vec::new();
    for _ in 0..11 {
        // Room for one request at a time.
        c.on_event(
            Time::ZERO,
            &FleetEvent::RequestFinished { instance: InstanceId(0), request: RequestId(0), output: None },
        );
        report(&mut c, false);
        let mut out = Vec::new();
        while let Some((r, ())) = flow.next(Time::from_millis(30), c.fleet()) {
            out.push(r.id.0);
            report(&mut c, true);
        }
        order.extend(out);
    }
    assert_eq!(order.len(), 11);
    let light = order.iter().position(|&id| id == 99).expect("released");
    assert!(light <= 1, "the light tenant's request came {light}th: {order:?}");
}

/// A tenant that had more than its share of the recent service leaves queue room to the
/// others: with 30 ms of prefill queued (the standard limit is 45 ms: 90% of 5% of the 1 s
/// target), a heavy tenant's request waits (its limit is 30% of that) and a light tenant's is
/// placed at once, ahead of the heavy one waiting, and lifted for the engine.
#[test]
fn a_tenant_over_its_share_leaves_room_to_the_others() {
    // The light tenant (2) was served once, the heavy one (1) ten times as much; then 30 ms
    // of prefill is queued and the heavy tenant offers one more request.
    let heavy_then_queue = |config: SloFlowConfig| {
        let (mut c, mut flow, mut fleet) = setup(FlowConfig::Slo(config));
        for (id, tenant) in [(100, 2)].into_iter().chain((0..10).map(|id| (id, 1))) {
            let r = c.offer(&mut flow, &mut fleet, Time::from_millis(id), request(id, id, Class::Standard, tenant), ());
            assert!(matches!(r, Released::Placed { .. }), "room at first: {r:?}");
            report(&mut c, false);
        }
        let load = Load { prefill_tokens_left: 1_200, waiting: 3, kv_total_blocks: 10_000, ..Load::default() };
        c.on_event(Time::ZERO, &FleetEvent::Load { instance: InstanceId(0), load });
        let heavy = c.offer(&mut flow, &mut fleet, Time::from_millis(20), request(20, 20, Class::Standard, 1), ());
        (c, flow, fleet, heavy)
    };
    let (mut c, mut flow, mut fleet, heavy) = heavy_then_queue(SloFlowConfig::default());
    assert!(matches!(heavy, Released::Queued), "the heavy tenant is over its share: {heavy:?}");
    let light = c.offer(&mut flow, &mut fleet, Time::from_millis(21), request(21, 21, Class::Standard, 2), ());
    assert!(matches!(light, Released::Placed { .. }), "the light tenant goes first, at once: {light:?}");
    assert_eq!(fleet.placed.last(), Some(&21));
    // Lifted: requests of a tenant under its share when placed: the heavy tenant's first (the
    // light one had had more by then) and the light one's last.
    assert_eq!(fleet.lifted, [0, 21]);
    // With the over-share limits at 1, the same heavy request finds room.
    let config = SloFlowConfig { over_share_queue: 1.0, over_share_batch: 1.0, ..SloFlowConfig::default() };
    let (.., heavy) = heavy_then_queue(config);
    assert!(matches!(heavy, Released::Placed { .. }), "without the over-share limit: {heavy:?}");
}

proptest! {
    /// Whatever arrives and whenever room comes, every request offered ends exactly once:
    /// placed or shed; the queues end empty once the fleet has room for good.
    #[test]
    fn every_offered_request_ends_exactly_once(
        arrivals in proptest::collection::vec((0u64..20_000, 0usize..3, 0u32..4, any::<bool>()), 1..80),
        rule in 0usize..4,
        max_wait_s in 0.0f64..10.0,
    ) {
        let slo = SloFlowConfig { batch_max_wait: Dur::from_secs_f64(max_wait_s), queue_limit: 20, ..SloFlowConfig::default() };
        let config = match rule {
            0 => FlowConfig::None,
            1 => FlowConfig::Slo(slo),
            // Sessions, admission by program with packing: pauses, best-fit-decreasing.
            2 => FlowConfig::Slo(SloFlowConfig { program_kv_share: 0.1, program_packing: 2, ..slo }),
            _ => FlowConfig::LlmD(LlmDFlowConfig { queue_limit: 20, ..LlmDFlowConfig::default() }),
        };
        let (mut c, mut flow, mut fleet) = setup(config);
        let mut arrivals = arrivals;
        arrivals.sort_by_key(|a| a.0);
        let mut ended = std::collections::BTreeMap::<u64, u32>::new();
        let mut out = Vec::new();
        let settle = |out: &mut Vec<Released<()>>, ended: &mut std::collections::BTreeMap<u64, u32>| {
            for r in out.drain(..) {
                match r {
                    Released::Placed { id, .. } => *ended.entry(id.0).or_default() += 1,
                    Released::Shed(s) => *ended.entry(s.request.id.0).or_default() += 1,
                    Released::Unplaced(u) => *ended.entry(u.request.id.0).or_default() += 1,
                    Released::Queued => {}
                }
            }
        };
        for (id, &(at, class, tenant, busy)) in arrivals.iter().enumerate() {
            let now = Time::from_millis(at);
            report(&mut c, busy);
            let mut r = request(id as u64, at, Class::ALL[class], tenant);
            if rule == 2 {
                r.service.session = engine::SessionId::new(at % 5 + 1);
                r.prompt_tokens = 10_000 + (at % 7) as u32 * 9_000;
            }
            let r = c.offer(&mut flow, &mut fleet, now, r, ());
            out.push(r);
            c.release(&mut flow, &mut fleet, now, &mut out);
            settle(&mut out, &mut ended);
        }
        report(&mut c, false);
        // A minute at a time, so that programs in progress go idle and let others start.
        let mut end = Time::from_millis(1_000_000);
        while !flow.is_empty() {
            c.release(&mut flow, &mut fleet, end, &mut out);
            settle(&mut out, &mut ended);
            report(&mut c, false);
            end += Dur::from_secs_f64(60.0);
        }
        prop_assert_eq!(ended.len(), arrivals.len());
        prop_assert!(ended.values().all(|&n| n == 1), "{:?}", ended);
    }
}

/// A turn of agent session `session` with a context of 60K tokens.
fn turn(id: u64, session: u64, at_ms: u64, tenant: u32) -> Request {
    let mut r = request(id, at_ms, Class::Standard, tenant);
    r.prompt_tokens = 59_000;
    r.max_output_tokens = 1_000;
    r.service.session = engine::SessionId::new(session);
    r
}

/// With admission by program, a new session waits while those in progress fill the KV
/// share; a later turn of one in progress goes at once, ahead of it; a session that goes
/// idle lets the waiting one start.
#[test]
fn new_programs_wait_for_room_in_the_kv_and_later_turns_go_first() {
    let config = SloFlowConfig { program_kv_share: 0.1, program_idle: Dur::from_secs_f64(10.0), ..Default::default() };
    let (mut c, mut flow, mut fleet) = setup(FlowConfig::Slo(config));
    // One instance of 1M tokens: 100K for programs; each turn's context 60K. The instance
    // reports itself idle before each step, so that only admission by program holds work.
    let turn = |id: u64, session: u64, at_ms: u64| turn(id, session, at_ms, 0);
    let r = c.offer(&mut flow, &mut fleet, Time::ZERO, turn(0, 1, 0), ());
    assert!(matches!(r, Released::Placed { .. }), "the first program starts: {r:?}");
    report(&mut c, false);
    let r = c.offer(&mut flow, &mut fleet, Time::from_millis(1), turn(1, 2, 1), ());
    assert!(matches!(r, Released::Queued), "60K + 60K > 100K: {r:?}");
    let r = c.offer(&mut flow, &mut fleet, Time::from_millis(2_000), turn(2, 1, 2_000), ());
    assert!(matches!(r, Released::Placed { .. }), "a later turn passes the queued first turn: {r:?}");
    report(&mut c, false);
    let mut out = Vec::new();
    c.release(&mut flow, &mut fleet, Time::from_millis(5_000), &mut out);
    assert!(placed(&out).is_empty(), "session 1 is still in progress");
    // The flow wakes when session 1 may go idle: at 10 s (its first turn's entry, stale),
    // then at 12 s (its last turn at 2 s).
    assert_eq!(flow.next_deadline(), Some(Time::from_millis(10_000)));
    c.release(&mut flow, &mut fleet, Time::from_millis(10_000), &mut out);
    assert!(placed(&out).is_empty());
    assert_eq!(flow.next_deadline(), Some(Time::from_millis(12_000)));
    c.release(&mut flow, &mut fleet, Time::from_millis(12_000), &mut out);
    assert_eq!(placed(&out), [1], "session 2 starts once session 1 is idle");
    assert!(flow.is_empty());
}

/// A first turn waiting for programs in progress to end does not hold the other tenants of
/// its band: the room it waits for is not the fleet's.
#[test]
fn a_first_turn_waiting_for_programs_lets_other_tenants_go() {
    let config = SloFlowConfig { program_kv_share: 0.1, ..Default::default() };
    let (mut c, mut flow, mut fleet) = setup(FlowConfig::Slo(config));
    let turn = |id: u64, session: u64, tenant: u32| turn(id, session, 0, tenant);
    let r = c.offer(&mut flow, &mut fleet, Time::ZERO, turn(0, 1, 0), ());
    assert!(matches!(r, Released::Placed { .. }), "{r:?}");
    report(&mut c, true);
    // Tenant 1's new session waits for session 1; tenant 2's request queues behind it.
    let r = c.offer(&mut flow, &mut fleet, Time::from_millis(1), turn(1, 2, 1), ());
    assert!(matches!(r, Released::Queued), "{r:?}");
    let r = c.offer(&mut flow, &mut fleet, Time::from_millis(2), request(2, 2, Class::Standard, 2), ());
    assert!(matches!(r, Released::Queued), "{r:?}");
    report(&mut c, false);
    let mut out = Vec::new();
    c.release(&mut flow, &mut fleet, Time::from_millis(3), &mut out);
    assert_eq!(placed(&out), [2], "tenant 2 goes; tenant 1's first turn still waits for session 1");
    assert_eq!(flow.len(), 1);
}

/// Offers `r` at its arrival, the instance reporting itself idle.
fn offer_idle(c: &mut Controller, flow: &mut Flow<()>, fleet: &mut Recording, r: Request) -> Released<()> {
    report(c, false);
    c.offer(flow, fleet, r.arrival, r, ())
}

/// A turn of `session` with a context of `k` thousand tokens.
fn sized_turn(id: u64, session: u64, at_ms: u64, k: u32) -> Request {
    let mut r = turn(id, session, at_ms, 0);
    r.prompt_tokens = k * 1_000 - 1_000;
    r
}

/// With packing (1 and 2), the waiting program turn that best fits the room left goes when
/// the one ahead does not fit; with 2, a program that grows past the share pauses the
/// shorter ones.
#[test]
fn with_packing_programs_resume_best_fit_decreasing_and_grown_ones_pause_shorter_ones() {
    for packing in [0, 1, 2] {
        let config = SloFlowConfig { program_kv_share: 0.1, program_packing: packing, ..Default::default() };
        let (mut c, mut flow, mut fleet) = setup(FlowConfig::Slo(config));
        // 100K tokens for programs: session 1 takes 60K; session 2 (50K) waits; sessions 3
        // (30K) and 4 (20K) queue behind it.
        assert!(matches!(offer_idle(&mut c, &mut flow, &mut fleet, sized_turn(0, 1, 0, 60)), Released::Placed { .. }));
        for (id, session, k) in [(1, 2, 50), (2, 3, 30), (3, 4, 20)] {
            assert!(matches!(
                offer_idle(&mut c, &mut flow, &mut fleet, sized_turn(id, session, id, k)),
                Released::Queued
            ));
        }
        report(&mut c, false);
        let mut out = Vec::new();
        c.release(&mut flow, &mut fleet, Time::from_millis(10), &mut out);
        if packing == 0 {
            assert!(placed(&out).is_empty(), "FIFO: session 2 blocks the queue");
            continue;
        }
        assert_eq!(placed(&out), [2], "the largest that fits the 40K left: session 3");
        if packing == 1 {
            // Without pausing, a later turn always passes.
            let r = offer_idle(&mut c, &mut flow, &mut fleet, sized_turn(4, 1, 2_000, 80));
            assert!(matches!(r, Released::Placed { .. }), "{r:?}");
            assert_eq!(flow.programs_paused(), 0);
            continue;
        }
        // Session 1 grows to 80K: pausing session 3 (30K) makes room (80K in progress).
        let r = offer_idle(&mut c, &mut flow, &mut fleet, sized_turn(4, 1, 2_000, 80));
        assert!(matches!(r, Released::Placed { .. }), "{r:?}");
        assert_eq!(flow.programs_paused(), 1);
        // Session 3's next turn waits as a new program's would: 80K + 31K > 100K; session
        // 4 (20K) fits.
        let r = offer_idle(&mut c, &mut flow, &mut fleet, sized_turn(5, 3, 2_001, 31));
        assert!(matches!(r, Released::Queued), "{r:?}");
        report(&mut c, false);
        let mut out = Vec::new();
        c.release(&mut flow, &mut fleet, Time::from_millis(2_002), &mut out);
        assert_eq!(placed(&out), [3], "session 4 fits the 20K left");
        assert_eq!(flow.len(), 2, "sessions 2 and 3 wait");
        // Sessions 1 and 4 go on (95K in progress); a new 5K session fits, but the head
        // (session 3's turn, ahead of new programs) has waited past program_idle (30 s): it
        // is not passed over any more.
        for (id, session, at, k) in [(6, 1, 25_000, 80), (7, 4, 25_000, 15)] {
            assert!(matches!(
                offer_idle(&mut c, &mut flow, &mut fleet, sized_turn(id, session, at, k)),
                Released::Placed { .. }
            ));
        }
        // (Sent at 2.1 s, offered at 35 s: as late as the others, so it queues behind them.)
        report(&mut c, false);
        let r = c.offer(&mut flow, &mut fleet, Time::from_millis(35_000), sized_turn(8, 6, 2_100, 5), ());
        assert!(matches!(r, Released::Queued), "{r:?}");
        let mut out = Vec::new();
        c.release(&mut flow, &mut fleet, Time::from_millis(35_000), &mut out);
        assert!(placed(&out).is_empty(), "{out:?}");
    }
}
