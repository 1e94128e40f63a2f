//! Flow control on a live fleet: request classes from headers and `service_tier`, interactive
//! requests overtaking a batch backlog, batch work shed with a 429 and `Retry-After`, and the
//! engines told to hold sessions' KV.

use super::*;
use std::time::Instant;

/// One engine of `kv_blocks` blocks of KV.
fn small_fleet(db: &Db, kv_blocks: &str) -> (Serve, Proc) {
    let s = serve(db, &["--router", "least-outstanding"]);
    let e = engine(&s.grpc, "e0", &["--kv-blocks", kv_blocks]);
    wait_serving(&s.http, 1);
    (s, e)
}

fn put_policy(http: &str, policy: Value) {
    let url = format!("{http}/api/policies");
    let (status, v) = common::send(reqwest::Method::PUT, &url, Some(ADMIN), &policy);
    assert_eq!(status, 200, "{policy}: {v}");
}

/// What one completion came back with: its status, `Retry-After`, error code and when.
struct Answer {
    status: u16,
    retry_after: Option<u64>,
    code: Option<String>,
    at: Instant,
}

/// Sends a completion with `headers`, on its own thread.
fn spawn_completion(
    http: &str,
    body: Value,
    headers: &[(&'static str, &'static str)],
) -> std::thread::JoinHandle<Answer> {
    let (url, headers) = (format!("{http}/v1/completions"), headers.to_vec());
    std::thread::spawn(move || {
        let mut r = common::client().post(url).bearer_auth(ADMIN).json(&body);
        for (k, v) in headers {
            r = r.header(k, v);
        }
        let response = r.send().expect("completion");
        let status = response.status().as_u16();
        let retry_after =
            response.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
        let v: Value = response.json().unwrap_or(Value::Null);
        let code = v["error"]["code"].as_str().map(str::to_string);
        Answer { status, retry_after, code, at: Instant::now() }
    })
}

/// A batch request of a short prompt.
fn batch_job(i: usize, max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": format!("batch job {i}: summarise the quarterly report"),
           "max_tokens": max_tokens, "service_tier": "flex"})
}

#[test]
fn interactive_requests_overtake_a_batch_backlog() {
    let db = Db::fresh("flowclasses");
    // KV for about three of the batch requests at once: the rest queue.
    let (s, _e) = small_fleet(&db, "48");
    put_policy(&s.http, json!({"router": "least-outstanding", "flow": "slo"}));
    // The policy turns the engines' class priority on (flow slo's default) and reaches them.
    eventually(10, "e0 admits by class", || {
        let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
        v["instances"][0]["scheduling"]["class_priority"] == json!(true)
    });

    let batch: Vec<_> = (0..12).map(|i| spawn_completion(&s.http, batch_job(i, 150), &[])).collect();
    std::thread::sleep(Duration::from_millis(300));
    let body = json!({"model": MODEL, "prompt": "what is the capital of France?", "max_tokens": 20});
    let interactive = spawn_completion(&s.http, body, &[("x-fleetplane-class", "interactive")]).join().expect("joins");
    assert_eq!(interactive.status, 200);
    let batch: Vec<Answer> = batch.into_iter().map(|h| h.join().expect("joins")).collect();
    assert!(batch.iter().all(|a| a.status == 200), "every batch request is served in the end");
    let ahead = batch.iter().filter(|a| a.at < interactive.at).count();
    // The engine holds about three of these at a time: arriving last, an interactive request
    // under FCFS would finish behind nearly the whole backlog.
    assert!(ahead <= 3, "{ahead} of 12 batch requests sent before it finished before the interactive one");

    let metrics = common::client().get(format!("{}/metrics", s.http)).send().expect("metrics").text().expect("text");
    for line in [
        "fleetplane_flow_requests_total{class=\"batch\",outcome=\"queued\"}",
        "fleetplane_tenant_requests_total{tenant=\"default\"} 13",
    ] {
        assert!(metrics.contains(line), "/metrics has {line}:\n{metrics}");
    }
}

#[test]
fn batch_work_past_its_longest_wait_is_shed_with_retry_after_and_nothing_else_is_lost() {
    let db = Db::fresh("flowshed");
    let (s, _e) = small_fleet(&db, "4096");
    put_policy(&s.http, json!({"router": "least-outstanding", "flow": "slo", "flow_params": {"batch_max_wait": 0.2}}));
    // Prompts of ~3,000 tokens: each one's predicted prefill (~75 ms) fills the queue that
    // batch work may fill (70% of 5% of the 2 s TTFT target), so they go one by one and the
    // last ones wait well past 0.2 s.
    let long_job = |i: usize| {
        json!({"model": MODEL, "prompt": format!("{i} {}", "quarterly report ".repeat(700)),
               "max_tokens": 20, "service_tier": "flex"})
    };
    let batch: Vec<_> = (0..10).map(|i| spawn_completion(&s.http, long_job(i), &[])).collect();
    let standard: Vec<_> = (0..3)
        .map(|i| {
            let body = json!({"model": MODEL, "prompt": format!("standard {i}"), "max_tokens": 10});
            spawn_completion(&s.http, body, &[("x-fleetplane-tenant", "acme")])
        })
        .collect();
    let batch: Vec<Answer> = batch.into_iter().map(|h| h.join().expect("joins")).collect();
    let shed: Vec<&Answer> = batch.iter().filter(|a| a.status == 429).collect();
    let statuses: Vec<u16> = batch.iter().map(|a| a.status).collect();
    assert!(!shed.is_empty(), "the backlog outlasts 0.2 s: some batch requests are shed: {statuses:?}");
    assert!(batch.iter().all(|a| a.status == 200 || a.status == 429), "a batch request is served or shed");
    for a in shed {
        assert_eq!(a.code.as_deref(), Some("shed"));
        assert!(a.retry_after.is_some_and(|s| s >= 1), "429 carries Retry-After in seconds");
    }
    for h in standard {
        assert_eq!(h.join().expect("joins").status, 200, "standard work is never shed");
    }

    // Under llm-d's rule batch work is shed at once while every engine's last report shows it
    // saturated: standard requests hold more than 5% of the KV for a while, then batch comes.
    put_policy(&s.http, json!({"router": "least-outstanding", "flow": "llm-d", "flow_params": {"kv_util": 0.05}}));
    let holders: Vec<_> = (20..24)
        .map(|i| {
            let prompt = format!("{i} {}", "quarterly report ".repeat(700));
            spawn_completion(&s.http, json!({"model": MODEL, "prompt": prompt, "max_tokens": 400}), &[])
        })
        .collect();
    eventually(10, "e0 reports more than 5% of its KV in use", || {
        let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
        v["instances"][0]["load"]["kv_used_blocks"].as_u64().unwrap_or(0) > 4096 / 20
    });
    let batch: Vec<_> = (10..13).map(|i| spawn_completion(&s.http, long_job(i), &[])).collect();
    for a in batch.into_iter().map(|h| h.join().expect("joins")) {
        assert_eq!((a.status, a.code.as_deref()), (429, Some("shed")), "llm-d sheds batch work under saturation");
        assert!(a.retry_after.is_some_and(|s| s >= 1));
    }
    for h in holders {
        assert_eq!(h.join().expect("joins").status, 200, "standard work is queued, not shed");
    }

    let (status, v) =
        completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "x", "max_tokens": 2, "service_tier": "scale"}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("service_tier")), "{v}");
    let mut r = common::client().post(format!("{}/v1/completions", s.http)).bearer_auth(ADMIN);
    r = r.header("x-fleetplane-class", "urgent").json(&json!({"model": MODEL, "prompt": "x", "max_tokens": 2}));
    let response = r.send().expect("completion");
    assert_eq!(response.status().as_u16(), 400, "an unknown class is named");
}

#[test]
fn a_policy_turns_on_the_engines_holds_of_sessions_kv_and_refuses_bad_ones() {
    let db = Db::fresh("flowholds");
    let (s, _e) = small_fleet(&db, "256");
    let url = format!("{}/api/policies", s.http);
    for (params, field, says) in [
        (json!({"program_hold_s": 5, "program_hold_share": 1.5}), "flow_params.program_hold_share", "(0, 1]"),
        (json!({"program_hold_share": 0.5}), "flow_params.program_hold_share", "needs program_hold_s"),
        (json!({"program_hold_s": -1}), "flow_params.program_hold_s", "seconds > 0"),
        (json!({"program_prefetch_s": 1}), "flow_params.program_prefetch_s", "needs program_hold_s"),
        (json!({"program_hold_s": 5, "program_prefetch_s": -2}), "flow_params.program_prefetch_s", "seconds >= 0"),
    ] {
        let body = json!({"router": "least-outstanding", "flow": "slo", "flow_params": params});
        let (status, v) = common::send(reqwest::Method::PUT, &url, Some(ADMIN), &body);
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(field)), "{body}: {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains(says)), "{body}: {v}");
    }
    let holds = json!({"program_hold_s": 5, "program_prefetch_s": 1.5});
    put_policy(&s.http, json!({"router": "least-outstanding", "flow": "slo", "flow_params": holds}));
    eventually(10, "e0 holds sessions' KV for pauses up to 5 s and prefetches it 1.5 s ahead", || {
        let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
        let scheduling = &v["instances"][0]["scheduling"];
        scheduling["program_hold_s"] == json!(5.0)
            && scheduling["program_hold_share"] == json!(0.5)
            && scheduling["program_prefetch_s"] == json!(1.5)
    });
    // Turns of one session are served with holds on; a policy without holds turns them off.
    for turn in 0..2 {
        let body = json!({"model": MODEL, "prompt": format!("plan the trip, step {turn}"), "max_tokens": 5});
        let a = spawn_completion(&s.http, body, &[("x-fleetplane-session", "trip-1")]).join().expect("joins");
        assert_eq!(a.status, 200, "turn {turn}");
    }
    put_policy(&s.http, json!({"router": "least-outstanding", "flow": "slo"}));
    eventually(10, "e0 holds nothing", || {
        let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
        v["instances"][0]["scheduling"].get("program_hold_s").is_none()
    });
}
