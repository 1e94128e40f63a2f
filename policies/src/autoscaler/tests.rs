//! The scaling policies' hysteresis, holds and cooldowns, on hand-made load sequences.

use super::*;

fn at(s: u64) -> Time {
    Time::from_millis(s * 1000)
}

fn input(now: Time, load_p: f64, load_d: f64, prefill: u32, decode: u32) -> ScaleInput {
    ScaleInput {
        now,
        loads: Loads { load_p, load_d, util_p: load_p, util_d: load_d, ..Loads::default() },
        prefill: PoolSize { serving: prefill, ..PoolSize::default() },
        decode: PoolSize { serving: decode, ..PoolSize::default() },
        headroom: 100,
        min_per_pool: 1,
        waiting_handoffs: 0,
    }
}

/// Runs `scaler` once a second over `loads` (load_p, load_d), applying its decisions at once
/// (no start-up), and returns the pool sizes after each tick.
fn drive(scaler: &mut dyn Autoscaler, loads: &[(f64, f64)], mut sizes: (u32, u32)) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    for (i, &(p, d)) in loads.iter().enumerate() {
        let s = scaler.decide(&input(at(i as u64), p, d, sizes.0, sizes.1));
        sizes = ((sizes.0 as i32 + s.prefill) as u32, (sizes.1 as i32 + s.decode) as u32);
        out.push(sizes);
    }
    out
}

fn knobs() -> Knobs {
    Knobs::for_startup(Dur::from_millis(10_000))
}

#[test]
fn a_load_inside_the_band_never_scales() {
    let mut s = SloLoadScaler::new(knobs());
    let loads: Vec<_> = (0..600).map(|i| if i % 2 == 0 { (0.45, 0.75) } else { (0.75, 0.45) }).collect();
    assert!(drive(&mut s, &loads, (4, 4)).iter().all(|&sz| sz == (4, 4)));
}

#[test]
fn a_spike_shorter_than_the_hold_is_ignored() {
    let mut s = SloLoadScaler::new(knobs());
    let loads = [(0.5, 0.5), (2.0, 0.5), (0.5, 0.5), (2.0, 0.5), (0.5, 0.5)];
    assert!(drive(&mut s, &loads, (4, 4)).iter().all(|&sz| sz == (4, 4)));
}

#[test]
fn sustained_overload_grows_one_pool_once_per_cooldown() {
    let mut s = SloLoadScaler::new(knobs());
    let loads = vec![(1.2, 0.5); 40];
    let sizes = drive(&mut s, &loads, (4, 4));
    // Held for 1 s (ticks 0, 1), then ceil(4 × 1.2 / 0.6) − 4 = 4 more; not again before
    // the 20 s cooldown (10 s start-up + 10 s), then again at tick 21.
    assert_eq!(sizes[0], (4, 4));
    assert_eq!(sizes[1], (8, 4));
    assert_eq!(sizes[20], (8, 4));
    assert_eq!(sizes[21], (16, 4));
    assert!(sizes.iter().all(|&(_, d)| d == 4), "the decode pool is left alone");
}

#[test]
fn a_quiet_pool_shrinks_one_at_a_time_after_the_hold_and_never_below_the_minimum() {
    let mut s = SloLoadScaler::new(knobs());
    let loads = vec![(0.1, 0.1); 1000];
    let sizes = drive(&mut s, &loads, (3, 3));
    assert_eq!(sizes[59], (3, 3), "not before 60 s below the band");
    assert_eq!(sizes[60], (2, 2));
    assert_eq!(sizes[179], (2, 2), "120 s cooldown between shrinks");
    assert_eq!(sizes[180], (1, 1));
    assert_eq!(*sizes.last().unwrap(), (1, 1));
}

#[test]
fn a_busy_pool_with_low_latency_does_not_shrink() {
    let mut s = SloLoadScaler::new(knobs());
    // Low latency but 50% utilization on 2 instances: one fewer would run at 100%.
    let mut sizes = (2, 2);
    for i in 0..300 {
        let mut inp = input(at(i), 0.2, 0.2, sizes.0, sizes.1);
        inp.loads.util_p = 0.5;
        inp.loads.util_d = 0.5;
        let d = s.decide(&inp);
        sizes = ((sizes.0 as i32 + d.prefill) as u32, (sizes.1 as i32 + d.decode) as u32);
    }
    assert_eq!(sizes, (2, 2));
}

#[test]
fn one_shift_changes_direction_at_most_once_per_pool() {
    let mut s = SloLoadScaler::new(knobs());
    // Overload, then a long quiet spell: grow, then shrink back, and no more flips.
    let loads: Vec<_> = (0..900).map(|i| if i < 30 { (1.5, 1.5) } else { (0.1, 0.1) }).collect();
    let sizes = drive(&mut s, &loads, (2, 2));
    let mut flips = 0;
    let mut last_dir = 0;
    for w in sizes.windows(2) {
        let dir = (w[1].0 as i32 - w[0].0 as i32).signum();
        if dir != 0 {
            if last_dir != 0 && dir != last_dir {
                flips += 1;
            }
            last_dir = dir;
        }
    }
    assert_eq!(flips, 1);
}

#[test]
fn fixed_xpyd_adds_and_removes_whole_groups() {
    let mut s = FixedXpyd::new(1, 3, knobs());
    let loads: Vec<_> = (0..300).map(|i| if i < 10 { (0.3, 1.2) } else { (0.1, 0.1) }).collect();
    let sizes = drive(&mut s, &loads, (2, 6));
    assert_eq!(sizes[1], (4, 12), "2 groups at load 1.2: ceil(2 × 1.2 / 0.6) − 2 = 2 more groups");
    assert!(sizes.iter().all(|&(p, d)| d == 3 * p), "the ratio never changes");
    assert!(sizes.last().unwrap().0 < 4, "groups are removed when the load stays low");
}

#[test]
fn fixed_xpyd_adds_no_partial_group_when_the_budget_is_short() {
    let mut s = FixedXpyd::new(2, 2, knobs());
    let mut inp = input(at(0), 2.0, 2.0, 2, 2);
    inp.headroom = 3;
    s.decide(&inp);
    inp.now = at(5);
    assert_eq!(s.decide(&inp), Scale::default());
}

#[test]
fn autoscalers_are_found_by_name_or_named_in_the_error() {
    for name in AutoscalerConfig::NAMES {
        assert_eq!(name.parse::<AutoscalerConfig>().unwrap().name(), name);
    }
    let err = "magic".parse::<AutoscalerConfig>().unwrap_err();
    assert_eq!(err.to_string(), "unknown autoscaler `magic` (valid: none, fixed-xpyd, slo-load)");
}
