use super::*;
use engine::{CutShort, RequestId};

const SLO: Slo = Slo { ttft_ms: 200.0, tpot_ms: 50.0 };

const COST: FleetCost = FleetCost { gpus: 8, price_per_gpu_hour: 2.0 };

/// A finished request; every time is in ms since the start of the run.
struct Spec {
    arrival_ms: u64,
    admitted_ms: u64,
    first_token_ms: u64,
    finished_ms: u64,
    prompt_tokens: u32,
    output_tokens: u32,
    cached_tokens: u32,
    preemptions: u32,
}

fn finished(id: u64, s: Spec) -> Finished {
    Finished {
        request: Request {
            id: RequestId(id),
            arrival: Time::from_millis(s.arrival_ms),
            prompt_tokens: s.prompt_tokens,
            max_output_tokens: s.output_tokens,
            ends_after: None,
            block_hashes: Vec::new(),
            resume: None,
            service: Default::default(),
            model: Default::default(),
        },
        admitted_at: Time::from_millis(s.admitted_ms),
        first_token_at: Time::from_millis(s.first_token_ms),
        finished_at: Time::from_millis(s.finished_ms),
        output_tokens: s.output_tokens,
        cached_tokens: [s.cached_tokens, 0, 0],
        preemptions: s.preemptions,
        yields: 0,
        paused_wait: Dur::ZERO,
        evictions: 0,
        ended: None,
    }
}

/// A request turned away, asking for `output_tokens`.
fn refused(output_tokens: u32) -> Request {
    Request {
        id: RequestId(99),
        arrival: Time::ZERO,
        prompt_tokens: 10,
        max_output_tokens: output_tokens,
        ends_after: None,
        block_hashes: Vec::new(),
        resume: None,
        service: Default::default(),
        model: Default::default(),
    }
}

/// Four requests and one rejection; the expected numbers in the tests are worked out by
/// hand from this table.
///
/// | req | TTFT | TPOT | E2E | queue | SLO (200 ms, 50 ms) |
/// | --- | --- | --- | --- | --- | --- |
/// | 0 | 100 | 200/4 = 50 | 300 | 10 | met (TPOT exactly on target) |
/// | 1 | 300 | 100/2 = 50 | 400 | 0 | missed (TTFT) |
/// | 2 | 200 | none (1 token) | 200 | 50 | met (TTFT exactly on target) |
/// | 3 | 50 | 950/10 = 95 | 1000 | 0 | missed (TPOT) |
fn four_requests_and_a_rejection() -> Metrics {
    let mut m = Metrics::new(SLO);
    let specs = [
        Spec {
            arrival_ms: 0,
            admitted_ms: 10,
            first_token_ms: 100,
            finished_ms: 300,
            prompt_tokens: 1000,
            output_tokens: 5,
            cached_tokens: 500,
            preemptions: 0,
        },
        Spec {
            arrival_ms: 1000,
            admitted_ms: 1000,
            first_token_ms: 1300,
            finished_ms: 1400,
            prompt_tokens: 2000,
            output_tokens: 3,
            cached_tokens: 1000,
            preemptions: 0,
        },
        Spec {
            arrival_ms: 2000,
            admitted_ms: 2050,
            first_token_ms: 2200,
            finished_ms: 2200,
            prompt_tokens: 500,
            output_tokens: 1,
            cached_tokens: 0,
            preemptions: 0,
        },
        Spec {
            arrival_ms: 3000,
            admitted_ms: 3000,
            first_token_ms: 3050,
            finished_ms: 4000,
            prompt_tokens: 500,
            output_tokens: 11,
            cached_tokens: 500,
            preemptions: 2,
        },
    ];
    for (id, spec) in specs.into_iter().enumerate() {
        m.record(&finished(id as u64, spec));
    }
    m.record_rejected(&refused(1));
    m
}

/// Percentiles come from a 3-significant-digit histogram: within 0.1% and never below.
fn assert_percentile(actual: f64, expected: f64) {
    assert!(
        actual >= expected && actual <= expected * 1.001,
        "percentile {actual} is not within 0.1% above {expected}"
    );
}

#[test]
fn summary_of_hand_made_requests_gives_the_hand_computed_numbers() {
    let s = four_requests_and_a_rejection().summary(&COST);

    assert_eq!(s.requests, 4);
    assert_eq!(s.rejected, 1);
    assert_eq!(s.slo_met, 2);
    assert_eq!(s.preemptions, 2);
    assert_eq!(s.input_tokens, 4000);
    assert_eq!(s.output_tokens, 20);
    assert_eq!(s.cached_tokens, 2000);

    // TTFT 100, 300, 200, 50.
    assert_eq!(s.ttft_ms.mean, 162.5);
    assert_percentile(s.ttft_ms.p50, 100.0);
    assert_eq!(s.ttft_ms.p99, 300.0);
    // TPOT 50, 50, 95 (the one-token request has none).
    assert_eq!(s.tpot_ms.mean, 65.0);
    assert_percentile(s.tpot_ms.p50, 50.0);
    assert_eq!(s.tpot_ms.p99, 95.0);
    // E2E 300, 400, 200, 1000; queue 10, 0, 50, 0.
    assert_eq!(s.e2e_ms.mean, 475.0);
    assert_eq!(s.e2e_ms.p99, 1000.0);
    assert_eq!(s.queue_ms.mean, 15.0);
    assert_eq!(s.queue_ms.p99, 50.0);

    // Span 0 → 4000 ms.
    assert_eq!(s.duration_s, 4.0);
    // 2 met out of 4 finished + 1 rejected.
    assert_eq!(s.slo_attainment, 0.4);
    assert_eq!(s.goodput_rps, 0.5);
    assert_eq!(s.throughput_tok_s.input, 1000.0);
    assert_eq!(s.throughput_tok_s.output, 5.0);
    // 2000 cached of 4000 prompt tokens.
    assert_eq!(s.cache_hit_rate, 0.5);
    // 8 GPUs × 4 s; $2 per GPU-hour over 4020 tokens.
    let gpu_hours = 8.0 * 4.0 / 3600.0;
    assert_eq!(s.gpu_hours, gpu_hours);
    assert_eq!(s.cost_per_mtok, gpu_hours * 2.0 / (4020.0 / 1e6));
    assert_eq!(s.slo, SLO);
}

#[test]
fn ended_runaways_miss_the_slo_and_short_outputs_are_measured_apart() {
    let mut m = Metrics::new(SLO);
    let spec = |first_token_ms, finished_ms, output_tokens| Spec {
        arrival_ms: 0,
        admitted_ms: 0,
        first_token_ms,
        finished_ms,
        prompt_tokens: 100,
        output_tokens,
        cached_tokens: 0,
        preemptions: 0,
    };
    // A short output within the SLO, after 30 ms of paused admission.
    let mut short = finished(0, spec(100, 200, 3));
    short.paused_wait = Dur::from_millis(30);
    m.record(&short);
    // A long output within the SLO, evicted once on the way.
    let mut long = finished(1, spec(100, 100 + 40 * (LONG_OUTPUT_TOKENS as u64 - 1), LONG_OUTPUT_TOKENS));
    long.evictions = 1;
    m.record(&long);
    // A long output ended early: within the targets, yet it misses the SLO.
    let mut ended = finished(2, spec(50, 1_050, LONG_OUTPUT_TOKENS));
    ended.output_tokens = 101;
    ended.ended = Some(CutShort::Runaway { generated_here: 101, limit: 100 });
    m.record(&ended);
    // And a short one refused.
    m.record_rejected(&refused(10));
    m.record_eviction();
    m.record_reroute();
    m.record_admission_paused(Dur::from_millis(1_500));
    let s = m.summary(&COST);
    assert_eq!((s.requests, s.rejected, s.slo_met, s.ended_runaway), (3, 1, 2, 1));
    assert_eq!((s.evictions, s.reroutes, s.long_output_requests), (1, 1, 2));
    assert_eq!(s.slo_attainment_short_output, 0.5, "one met of one finished and one refused");
    assert_eq!(s.ttft_ms_short_output.p99, 100.0);
    assert_eq!(s.admission_paused_s, 1.5);
    assert_eq!(s.paused_wait_ms.p99, 30.0);
    assert_eq!(s.paused_wait_ms.p50, 0.0);
}

#[test]
fn an_empty_run_summarizes_to_zeros_and_serializes() {
    let s = Metrics::new(SLO).summary(&COST);
    assert_eq!(s.requests, 0);
    assert_eq!(s.ttft_ms, Percentiles::default());
    assert_eq!(s.tpot_ms, Percentiles::default());
    for x in [
        s.slo_attainment,
        s.goodput_rps,
        s.throughput_tok_s.input,
        s.throughput_tok_s.output,
        s.cache_hit_rate,
        s.gpu_hours,
        s.cost_per_mtok,
        s.duration_s,
    ] {
        assert_eq!(x, 0.0);
    }
    let json = serde_json::to_string(&s).expect("an empty summary serializes");
    assert!(!json.contains("null"), "{json}");
    let back: Summary = serde_json::from_str(&json).expect("and reads back");
    assert_eq!(back, s);
}

#[test]
fn rejections_alone_give_zero_attainment_and_no_nan() {
    let mut m = Metrics::new(SLO);
    m.record_rejected(&refused(1));
    m.record_rejected(&refused(1));
    let s = m.summary(&COST);
    assert_eq!(s.rejected, 2);
    assert_eq!(s.slo_attainment, 0.0);
    assert_eq!(s.goodput_rps, 0.0);
    assert!(m.ttft_cdf().is_empty());
}

#[test]
fn a_nan_price_gives_zero_cost_instead_of_nan() {
    let cost = FleetCost { gpus: 1, price_per_gpu_hour: f64::NAN };
    let s = four_requests_and_a_rejection().summary(&cost);
    assert_eq!(s.cost_per_mtok, 0.0);
}

#[test]
fn summary_json_has_the_documented_keys() {
    let s = four_requests_and_a_rejection().summary(&COST);
    let json = serde_json::to_value(&s).expect("summary serializes");
    let keys: Vec<&str> = json.as_object().expect("summary is an object").keys().map(String::as_str).collect();
    // The documented keys, in order; fields added later come after them.
    let documented = [
        "requests",
        "rejected",
        "ttft_ms",
        "tpot_ms",
        "e2e_ms",
        "queue_ms",
        "slo_attainment",
        "goodput_rps",
        "throughput_tok_s",
        "cache_hit_rate",
        "gpu_hours",
        "cost_per_mtok",
        "duration_s",
        "preemptions",
        "input_tokens",
        "output_tokens",
    ];
    // serde_json without `preserve_order` sorts keys, so compare as sets.
    for key in documented {
        assert!(keys.contains(&key), "missing `{key}` in {keys:?}");
    }
    for latency in ["ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"] {
        let mut fields: Vec<&str> =
            json[latency].as_object().expect("percentiles are an object").keys().map(String::as_str).collect();
        fields.sort_unstable();
        assert_eq!(fields, ["mean", "p50", "p90", "p95", "p99"], "{latency}");
    }
    let mut throughput: Vec<&str> =
        json["throughput_tok_s"].as_object().expect("throughput is an object").keys().map(String::as_str).collect();
    throughput.sort_unstable();
    assert_eq!(throughput, ["input", "output"]);

    // The serialized text (what lands in report files) keeps the declared order.
    let text = serde_json::to_string(&s).expect("summary serializes");
    let positions: Vec<usize> =
        documented.iter().map(|key| text.find(&format!("\"{key}\":")).expect("key present")).collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "{text}");
}

#[test]
fn cdfs_rise_from_the_fastest_to_the_slowest_request() {
    let m = four_requests_and_a_rejection();
    let cdf = m.ttft_cdf();
    assert_eq!(cdf.len(), CDF_STEPS + 1);
    assert_eq!(cdf.first(), Some(&(50.0, 0.0)));
    assert_eq!(cdf.last(), Some(&(300.0, 1.0)));
    assert!(cdf.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
    let tpot = m.tpot_cdf();
    assert_eq!(tpot.first(), Some(&(50.0, 0.0)));
    assert_eq!(tpot.last(), Some(&(95.0, 1.0)));
}

#[test]
fn a_latency_beyond_the_histogram_range_saturates_instead_of_panicking() {
    let mut m = Metrics::new(SLO);
    let huge_ms = 2 * MAX_TRACKABLE_US / 1000;
    m.record(&finished(
        0,
        Spec {
            arrival_ms: 0,
            admitted_ms: 0,
            first_token_ms: huge_ms,
            finished_ms: huge_ms,
            prompt_tokens: 1,
            output_tokens: 1,
            cached_tokens: 0,
            preemptions: 0,
        },
    ));
    let s = m.summary(&COST);
    assert_eq!(s.ttft_ms.mean, huge_ms as f64);
    assert!(s.ttft_ms.p99 > 0.0 && s.ttft_ms.p99.is_finite());
}
