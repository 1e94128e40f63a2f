//! The live fleet disaggregated: prefill and decode engine processes, each request's KV handed
//! from one to the other over gRPC while its client's stream goes on; and the autoscaler
//! starting and stopping engine processes through the local actuator.

mod common;

use common::*;
use serde_json::{json, Value};
use std::sync::{Mutex, MutexGuard};
use std::thread;

/// The tests here start control planes that start engine processes and time holds and
/// cooldowns of a second or so: one at a time, so that on a 2-core machine they do not
/// stretch each other's timings past their waits.
static SERIAL: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn completion(http: &str, body: Value) -> (u16, Value) {
    post(&format!("{http}/v1/completions"), Some(ADMIN), &body)
}

fn instances(http: &str) -> Vec<Value> {
    get(&format!("{http}/api/instances"), Some(ADMIN)).1["instances"].as_array().cloned().unwrap_or_default()
}

/// Whether every engine that serves reports no request and no KV block held.
fn all_idle(http: &str) -> bool {
    instances(http).iter().filter(|i| i["state"] == "serving").all(|i| {
        let l = &i["load"];
        (l["running"].as_u64(), l["waiting"].as_u64(), l["kv_used_blocks"].as_u64()) == (Some(0), Some(0), Some(0))
    })
}

#[test]
fn prefill_and_decode_engines_hand_off_each_request_and_release_its_kv_on_both_sides() {
    let _serial = one_at_a_time();
    let db = Db::fresh("pd");
    let s = serve(&db, &["--mode", "pd"]);
    let _p = engine(&s.grpc, "p0", &["--role", "prefill"]);
    let _d = engine(&s.grpc, "d0", &["--role", "decode"]);
    wait_serving(&s.http, 2);
    let pools: Vec<(String, String)> = instances(&s.http)
        .iter()
        .map(|i| (i["name"].as_str().unwrap_or_default().into(), i["pool"].as_str().unwrap_or_default().into()))
        .collect();
    assert!(pools.contains(&("p0".into(), "prefill".into())) && pools.contains(&("d0".into(), "decode".into())));

    // Concurrent requests of several lengths: a prefill engine makes one token of each, so
    // every other token comes from the decode engine.
    let workers: Vec<_> = (0..12)
        .map(|k| {
            let http = s.http.clone();
            thread::spawn(move || {
                let prompt: Vec<u32> = (0..(100 + 40 * k)).map(|i| 7 + i * (k + 1)).collect();
                let max_tokens = 1 + 5 * k;
                let (status, v) =
                    completion(&http, json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}));
                (status, v["usage"]["completion_tokens"].as_u64(), max_tokens, v)
            })
        })
        .collect();
    for w in workers {
        let (status, got, want, v) = w.join().expect("worker");
        assert_eq!((status, got), (200, Some(u64::from(want))), "{v}");
    }

    // A stream: the first token from the prefill engine, the rest from the decode engine,
    // one SSE event each, in one response.
    let body = json!({"model": MODEL, "prompt": "Tell me a story about two engines", "max_tokens": 9, "stream": true});
    let events = sse(open_stream(&s.http, "/v1/completions", &body));
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let texts = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).expect("json"))
        .filter(|c| c["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()))
        .count();
    assert_eq!(texts, 9);

    eventually(5, "both engines hold no request and no KV", || all_idle(&s.http));
    let (_, pools) = get(&format!("{}/api/pools", s.http), Some(ADMIN));
    assert_eq!(pools["pd"]["waiting_handoffs"], 0, "{pools}");
    let metrics = common::client().get(format!("{}/metrics", s.http)).send().expect("metrics").text().expect("text");
    assert!(metrics.contains("fleetplane_gateway_requests_total{outcome=\"ok\"} 13"), "{metrics}");

    // Targets set through the API rescale the loads: the same TPOTs against 0.5 ms are far
    // over the target.
    let load_d = || get(&format!("{}/api/pools", s.http), Some(ADMIN)).1["pd"]["load_d"].as_f64();
    assert!(load_d().is_some_and(|l| l < 1.0), "{:?}", load_d());
    let (status, _) = send(
        reqwest::Method::PUT,
        &format!("{}/api/slo", s.http),
        Some(ADMIN),
        &json!({"ttft_ms": 2000, "tpot_ms": 0.5}),
    );
    assert_eq!(status, 200);
    eventually(3, "Load_D against the new TPOT target", || load_d().is_some_and(|l| l > 1.0));

    // The policy set of a P/D fleet: the autoscaler goes to the controller, the scheduling to
    // both pools' engines.
    let url = format!("{}/api/policies", s.http);
    let (status, v) =
        send(reqwest::Method::PUT, &url, Some(ADMIN), &json!({"router": "least-outstanding", "autoscaler": "magic"}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("autoscaler")), "{v}");
    let (status, v) = send(
        reqwest::Method::PUT,
        &url,
        Some(ADMIN),
        &json!({"router": "least-outstanding", "autoscaler_params": {"shrink_util": 0}}),
    );
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("autoscaler_params.shrink_util")), "{v}");
    let policy = json!({"router": "least-outstanding", "autoscaler": "fixed-xpyd", "prefill_scheduler": "fair",
        "autoscaler_params": {"up_load": 0.85}});
    let (status, v) = send(reqwest::Method::PUT, &url, Some(ADMIN), &policy);
    assert_eq!(status, 200, "{v}");
    let (_, pools) = get(&format!("{}/api/pools", s.http), Some(ADMIN));
    assert_eq!(pools["pd"]["autoscaler"], "fixed-xpyd", "{pools}");
    let (_, v) = get(&url, Some(ADMIN));
    assert_eq!(v["in_force"]["autoscaler_params"]["up_load"], 0.85, "the parameter in the pools' autoscaler: {v}");
    eventually(10, "both pools' engines schedule fairly", || {
        instances(&s.http).iter().all(|i| i["scheduling"]["prefill_scheduler"] == "fair")
    });
    let (status, v) = completion(&s.http, json!({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 4}));
    assert_eq!((status, v["usage"]["completion_tokens"].as_u64()), (200, Some(4)), "{v}");
}

fn pool_members(http: &str, pool: &str, state: &str) -> Vec<Value> {
    instances(http).into_iter().filter(|i| i["pool"] == pool && i["state"] == state).collect()
}

#[test]
fn the_leader_starts_an_engine_process_under_a_burst_and_stops_a_drained_one_when_quiet() {
    let _serial = one_at_a_time();
    let db = Db::fresh("actuator");
    // The engines' steps last twice the cost model's time, so that a burst of long prompts
    // queues for seconds; short holds, cooldowns and window so that the test takes seconds.
    let flags = [
        "--mode",
        "pd",
        "--actuator",
        "local",
        "--autoscaler",
        "slo-load",
        "--min-per-pool",
        "1",
        "--gpu-budget",
        "4",
        "--engine-time-scale",
        "2",
        "--scale-tick-ms",
        "200",
        "--slo-window-s",
        "2",
        "--up-hold-ms",
        "200",
        "--down-hold-ms",
        "1000",
        "--up-cooldown-ms",
        "3000",
        "--down-cooldown-ms",
        "1000",
    ];
    let s = serve(&db, &flags);
    // An empty fleet: the leader fills each pool to its minimum with engine processes.
    wait_serving(&s.http, 2);
    assert_eq!(
        (pool_members(&s.http, "prefill", "serving").len(), pool_members(&s.http, "decode", "serving").len()),
        (1, 1)
    );

    // 40 distinct prompts of 2,000 tokens at once: about 4 s of prefill for one engine, far
    // over the 2 s TTFT target.
    let burst = std::time::Instant::now();
    let workers: Vec<_> = (0..40u32)
        .map(|k| {
            let http = s.http.clone();
            thread::spawn(move || {
                let prompt: Vec<u32> = (0..2000).map(|i| 1 + (i * 7919 + k * 104_729) % 30_000).collect();
                let (status, v) = completion(&http, json!({"model": MODEL, "prompt": prompt, "max_tokens": 20}));
                (status, v["usage"]["completion_tokens"].as_u64(), v)
            })
        })
        .collect();
    eventually(20, "more prefill engine processes start and register", || {
        pool_members(&s.http, "prefill", "serving").len() >= 2
    });
    eprintln!("a new prefill engine served {:?} after the burst began", burst.elapsed());
    for w in workers {
        let (status, tokens, v) = w.join().expect("worker");
        assert_eq!((status, tokens), (200, Some(20)), "no request is lost: {v}");
    }
    let (_, events) = get(&format!("{}/api/scaling-events", s.http), Some(ADMIN));
    let events = events["events"].as_array().cloned().unwrap_or_default();
    let up = events
        .iter()
        .find(|e| e["pool"] == "prefill" && e["action"] == "scale_up" && e["reason"]["from"] == 1)
        .unwrap_or_else(|| panic!("a prefill scale-up stored: {events:?}"));
    assert_eq!(up["reason"]["by"], "autoscaler slo-load");
    assert!(up["reason"]["loads"]["load_p"].as_f64().is_some_and(|l| l > 0.8), "the load that caused it: {up}");

    // Quiet: Load_P falls below the band and the pool has room to spare; prefill engines
    // drain one at a time (newest first), hold nothing, and their processes stop, down to the
    // pool's minimum.
    let quiet = std::time::Instant::now();
    let drained = (0..600).any(|_| {
        thread::sleep(std::time::Duration::from_millis(100));
        pool_members(&s.http, "prefill", "serving").len() == 1
    });
    if !drained {
        let (_, pools) = get(&format!("{}/api/pools", s.http), Some(ADMIN));
        let (_, events) = get(&format!("{}/api/scaling-events", s.http), Some(ADMIN));
        panic!("the prefill pool did not drain back to its minimum within 60 s: pools {pools}, events {events}");
    }
    eprintln!("back to one prefill engine {:?} after the last request ended", quiet.elapsed());
    let gone = pool_members(&s.http, "prefill", "down");
    assert!(!gone.is_empty());
    for g in &gone {
        let address = g["address"].as_str().expect("address").to_string();
        eventually(5, "a stopped engine's process no longer listens", || {
            std::net::TcpStream::connect(&address).is_err()
        });
    }
    let (_, events) = get(&format!("{}/api/scaling-events", s.http), Some(ADMIN));
    assert!(
        events["events"]
            .as_array()
            .is_some_and(|v| v.iter().any(|e| e["pool"] == "prefill" && e["action"] == "scale_down")),
        "{events}"
    );
    let (_, pools) = get(&format!("{}/api/pools", s.http), Some(ADMIN));
    assert_eq!(
        (pools["pd"]["autoscaler"].as_str(), pools["pd"]["actuator"].as_str()),
        (Some("slo-load"), Some("local"))
    );
    let metrics = common::client().get(format!("{}/metrics", s.http)).send().expect("metrics").text().expect("text");
    assert!(metrics.contains("fleetplane_pool_slo_load{pool=\"prefill\"}"), "{metrics}");
    assert!(metrics.contains("fleetplane_pool_instances{pool=\"prefill\",state=\"serving\"} 1"), "{metrics}");
    // A request still goes through the smaller fleet.
    assert_eq!(completion(&s.http, json!({"model": MODEL, "prompt": "after", "max_tokens": 4})).0, 200);
}

#[test]
fn the_demo_runs_a_pd_fleet_that_starts_its_own_engines() {
    let _serial = one_at_a_time();
    let db = Db::fresh("pddemo");
    let stdout = run_demo(&db, &["--mode", "pd", "--requests", "30"]);
    assert!(stdout.contains("requests sent 30  ok 30  failed 0"), "{stdout}");
    assert_eq!(db.query("SELECT count(*) FROM instances WHERE pool IN ('prefill', 'decode')"), "2");
    let why = db.query("SELECT reason->>'why' FROM scaling_events ORDER BY id LIMIT 1");
    assert_eq!(why, "pool below its minimum");
}

#[test]
fn of_two_replicas_only_the_leader_starts_engines_and_a_new_leader_refills_the_pools() {
    let _serial = one_at_a_time();
    let db = Db::fresh("pdreplicas");
    let (ga, gb) = (free_addr(), free_addr());
    let both = format!("{ga},{gb}");
    let flags = ["--mode", "pd", "--actuator", "local", "--autoscaler", "slo-load", "--engine-control", &both];
    let a = serve_on(&db, "127.0.0.1:0", &ga, &flags);
    let b = serve_on(&db, "127.0.0.1:0", &gb, &flags);
    let leader = |s: &Serve| get(&format!("{}/api/fleet", s.http), Some(ADMIN)).1["leader"].as_bool() == Some(true);
    eventually(5, "one leader", || leader(&a) != leader(&b));
    wait_serving(&a.http, 2);
    wait_serving(&b.http, 2);
    // The follower sizes nothing: one prefill and one decode engine in all, known to both.
    thread::sleep(std::time::Duration::from_millis(1500));
    for s in [&a, &b] {
        assert_eq!(instances(&s.http).len(), 2, "{:?}", instances(&s.http));
        let (status, v) = completion(&s.http, json!({"model": MODEL, "prompt": "both replicas", "max_tokens": 6}));
        assert_eq!((status, v["usage"]["completion_tokens"].as_u64()), (200, Some(6)), "{v}");
    }
    assert_eq!(db.query("SELECT count(*) FROM scaling_events"), "2", "only the leader decided");
    let (mut old, new) = if leader(&a) { (a, b) } else { (b, a) };
    // Its engines go with it; the new leader fills the empty pools again.
    old.proc.kill();
    eventually(15, "the new leader runs a prefill and a decode engine of its own", || {
        leader(&new)
            && pool_members(&new.http, "prefill", "serving").len() == 1
            && pool_members(&new.http, "decode", "serving").len() == 1
            && instances(&new.http).iter().filter(|i| i["state"] == "down").count() == 2
    });
    let (status, v) = completion(&new.http, json!({"model": MODEL, "prompt": "after the hand-over", "max_tokens": 6}));
    assert_eq!((status, v["usage"]["completion_tokens"].as_u64()), (200, Some(6)), "{v}");
}

#[test]
fn a_prefilled_request_nobody_sends_on_frees_its_kv_and_is_placed_again_when_a_decode_engine_comes() {
    let _serial = one_at_a_time();
    let db = Db::fresh("parked");
    let s = serve(&db, &["--mode", "pd"]);
    let _p = engine(&s.grpc, "p0", &["--role", "prefill", "--parked-limit-s", "1"]);
    wait_serving(&s.http, 1);
    // No decode engine yet: the request is prefilled and parks with its KV.
    let http = s.http.clone();
    let prompt: Vec<u32> = (0..100).collect();
    let client = thread::spawn(move || completion(&http, json!({"model": MODEL, "prompt": prompt, "max_tokens": 5})));
    let kv_used = || instances(&s.http).first().and_then(|i| i["load"]["kv_used_blocks"].as_u64());
    eventually(5, "the prefill engine holds the request's KV", || kv_used().is_some_and(|n| n > 0));
    eventually(5, "and frees it once the limit passed", || kv_used() == Some(0));
    // A decode engine comes: the transfer finds nothing to export, and the request is placed
    // again after the token its client already has.
    let _d = engine(&s.grpc, "d0", &["--role", "decode"]);
    let (status, v) = client.join().expect("client");
    assert_eq!((status, v["usage"]["completion_tokens"].as_u64()), (200, Some(5)), "{v}");
    eventually(5, "both engines hold no request and no KV", || all_idle(&s.http));
}
