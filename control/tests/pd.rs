//! The live fleet disaggregated: prefill and decode engine processes, each request's KV handed
//! from one to the other over gRPC while its client's stream goes on; and the autoscaler
//! starting and stopping engine processes through the local actuator.

mod common;

use common::*;
use serde_json::{json, Value};
use std::thread;

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
}
