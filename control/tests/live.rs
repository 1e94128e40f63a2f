//! The live control plane end to end: real `fleetplane serve` and `fleetplane engine`
//! processes over real sockets, a real PostgreSQL database, the gateway driven over HTTP.

mod common;

use common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::time::Duration;

fn completion(http: &str, token: &str, body: Value) -> (u16, Value) {
    post(&format!("{http}/v1/completions"), Some(token), &body)
}

/// Posts a streaming request to `path` and reads its SSE response: the JSON chunks before the
/// final `[DONE]`.
fn streamed(http: &str, path: &str, body: Value) -> Vec<Value> {
    let response =
        common::client().post(format!("{http}{path}")).bearer_auth(ADMIN).json(&body).send().expect("stream");
    assert_eq!(response.status().as_u16(), 200);
    let events: Vec<String> = BufReader::new(response)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("json")).collect()
}

#[test]
fn the_gateway_routes_through_the_controller_to_engine_processes() {
    let db = Db::fresh("gateway");
    let s = serve(&db, &[]);
    let _e0 = engine(&s.grpc, "e0", &[]);
    let _e1 = engine(&s.grpc, "e1", &[]);
    wait_serving(&s.http, 2);

    let (status, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
    assert_eq!(status, 200);
    let mut names: Vec<&str> =
        v["instances"].as_array().expect("list").iter().filter_map(|i| i["name"].as_str()).collect();
    names.sort();
    assert_eq!(names, ["e0", "e1"]);

    let (status, v) = get(&format!("{}/v1/models", s.http), Some(ADMIN));
    assert_eq!((status, v["data"][0]["id"].as_str()), (200, Some(MODEL)));

    let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "Hello, fleet", "max_tokens": 7}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(!v["choices"][0]["text"].as_str().unwrap_or_default().is_empty());

    // The same long prompt twice: the second finds its prefix cached (cache-aware routing),
    // all but the last block, whose last token is computed again to sample from.
    let prompt: Vec<u32> = (0..2048).map(|i| 1000 + i).collect();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let (_, first) = completion(&s.http, ADMIN, body.clone());
    let (_, second) = completion(&s.http, ADMIN, body);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], 2048 - 16, "{second}");

    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": true,
        "stream_options": {"include_usage": true}});
    let chunks = streamed(&s.http, "/v1/chat/completions", body);
    let content: usize =
        chunks.iter().filter(|c| c["choices"][0]["delta"]["content"].as_str().is_some_and(|t| !t.is_empty())).count();
    assert_eq!(content, 5);
    assert_eq!(chunks.last().expect("usage")["usage"]["completion_tokens"], 5);

    let metrics = common::client().get(format!("{}/metrics", s.http)).send().expect("metrics").text().expect("text");
    assert!(metrics.contains("fleetplane_gateway_requests_total{outcome=\"ok\"} 4"), "{metrics}");
    assert!(metrics.contains("fleetplane_instances_serving 2"));
}

#[test]
fn a_speculating_engine_streams_every_accepted_token_once() {
    let db = Db::fresh("spec");
    let s = serve(&db, &[]);
    let _e = engine(&s.grpc, "drafting", &["--spec", "dspark", "--seed", "7"]);
    wait_serving(&s.http, 1);
    let body = json!({"model": MODEL, "prompt": "draft ahead", "max_tokens": 40, "stream": true,
        "stream_options": {"include_usage": true}});
    let chunks = streamed(&s.http, "/v1/completions", body);
    let tokens = chunks.iter().filter(|c| c["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty())).count();
    assert_eq!(tokens, 40, "steps of several tokens stream each token once");
    assert_eq!(chunks.last().expect("usage")["usage"]["completion_tokens"], 40);
}

#[test]
fn tokens_are_checked_and_bad_requests_get_openai_errors() {
    let db = Db::fresh("auth");
    let s = serve(&db, &[]);
    // A small KV (64 blocks of 16 tokens) so that an oversized request is easy to make.
    let _e = engine(&s.grpc, "small", &["--kv-blocks", "64"]);
    let _intruder = engine_with_token(&s.grpc, "intruder", &[], "wrong-token");
    wait_serving(&s.http, 1);

    let fleet = format!("{}/api/fleet", s.http);
    assert_eq!(get(&fleet, None).0, 401);
    assert_eq!(get(&fleet, Some("nope")).0, 401);
    let (status, v) =
        post(&format!("{}/api/tokens", s.http), Some(ADMIN), &json!({"name": "app", "role": "inference"}));
    assert_eq!(status, 201, "{v}");
    let app_token = v["token"].as_str().expect("token").to_string();
    let (status, v) = get(&fleet, Some(&app_token));
    assert_eq!(status, 403);
    assert_eq!(v["error"]["type"], "permission_error");
    assert_eq!(db.query("SELECT count(*) FROM api_tokens WHERE token_sha256 = sha256(convert_to('x', 'UTF8'))"), "0");
    assert!(!db.query("SELECT encode(token_sha256, 'hex') FROM api_tokens").contains(&app_token), "stored hashed");

    let ok = json!({"model": MODEL, "prompt": "hi", "max_tokens": 2});
    assert_eq!(completion(&s.http, &app_token, ok.clone()).0, 200);
    assert_eq!(post(&format!("{}/v1/completions", s.http), None, &ok).0, 401);

    // Only the engine with the right token registered.
    std::thread::sleep(Duration::from_millis(1500));
    let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
    assert_eq!(v["instances"].as_array().map(Vec::len), Some(1), "{v}");

    let bad = |body: Value, status: u16, code: &str| {
        let (got, v) = completion(&s.http, ADMIN, body);
        assert_eq!(got, status, "{v}");
        assert_eq!(v["error"]["code"], code, "{v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    };
    bad(json!({"model": MODEL, "prompt": "hi", "max_tokens": 5000}), 400, "context_length_exceeded");
    bad(json!({"model": "gpt-9", "prompt": "hi"}), 404, "model_not_found");
    bad(json!({"model": MODEL, "prompt": ""}), 400, "invalid_value");
    bad(json!({"model": MODEL, "prompt": "hi", "n": 3}), 400, "invalid_value");
    bad(json!({"model": MODEL, "prompt": "hi", "temperature": 9}), 400, "invalid_value");
    // Fields that would change the output and that engines of ours do not honour are refused,
    // naming the field, instead of ignored; their defaults are taken.
    let refused = |path: &str, body: Value, param: &str| {
        let (status, v) = post(&format!("{}{path}", s.http), Some(ADMIN), &body);
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{body}: {v}");
    };
    let chat = |extra: Value| {
        let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        body.as_object_mut().expect("an object").extend(extra.as_object().expect("an object").clone());
        body
    };
    refused("/v1/chat/completions", chat(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})), "tools");
    refused("/v1/chat/completions", chat(json!({"response_format": {"type": "json_object"}})), "response_format");
    refused("/v1/chat/completions", chat(json!({"logit_bias": {"7": 3}})), "logit_bias");
    refused("/v1/completions", json!({"model": MODEL, "prompt": "hi", "best_of": 2}), "best_of");
    let wizard = json!({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]});
    refused("/v1/chat/completions", wizard, "messages[0].role");
    let defaults = chat(json!({"tools": [], "response_format": {"type": "text"}, "logit_bias": {}, "best_of": 1}));
    assert_eq!(post(&format!("{}/v1/chat/completions", s.http), Some(ADMIN), &defaults).0, 200);
    let raw = common::client()
        .post(format!("{}/v1/completions", s.http))
        .bearer_auth(ADMIN)
        .header("content-type", "application/json")
        .body("{\"model\": ")
        .send()
        .expect("post");
    assert_eq!(raw.status().as_u16(), 400);
    let v: Value = raw.json().expect("json error");
    assert_eq!(v["error"]["code"], "invalid_json");
    let huge = "x".repeat(17 << 20);
    let raw =
        common::client().post(format!("{}/v1/completions", s.http)).bearer_auth(ADMIN).body(huge).send().expect("post");
    assert_eq!(raw.status().as_u16(), 413);

    // A field of the wrong type is named, in the gateway and in the API.
    let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "hi", "max_tokens": "five"}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("max_tokens")), "{v}");
    let (status, v) = post(&format!("{}/api/tokens", s.http), Some(ADMIN), &json!({"name": 7, "role": "admin"}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("name")), "{v}");

    // The scheme is case-insensitive (RFC 9110): `bearer` is Bearer.
    let lower = common::client().get(&fleet).header("authorization", format!("bearer {ADMIN}")).send().expect("get");
    assert_eq!(lower.status().as_u16(), 200);
    // A token name with a control character is the caller's mistake, named.
    let (status, v) =
        post(&format!("{}/api/tokens", s.http), Some(ADMIN), &json!({"name": "a\u{0}b", "role": "inference"}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("name")), "{v}");
    // A name is counted in characters, not bytes.
    let (status, v) =
        post(&format!("{}/api/tokens", s.http), Some(ADMIN), &json!({"name": "é".repeat(64), "role": "inference"}));
    assert_eq!(status, 201, "{v}");
    // Revoking a token that does not exist changes nothing, so audits nothing; a name no token
    // can have (a NUL) is no database error.
    let (status, _) = send(reqwest::Method::DELETE, &format!("{}/api/tokens/nobody", s.http), Some(ADMIN), &json!({}));
    assert_eq!(status, 404);
    let (status, v) = send(reqwest::Method::DELETE, &format!("{}/api/tokens/a%00b", s.http), Some(ADMIN), &json!({}));
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("not_found")), "{v}");
    assert_eq!(db.query("SELECT count(*) FROM audit_log WHERE action = 'token.revoke'"), "0");
    // An unknown path, a method a path does not take and a malformed path parameter answer
    // in the error shape too, not with empty or plain-text bodies.
    let (status, v) = get(&format!("{}/api/nothing-here", s.http), Some(ADMIN));
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("not_found")), "{v}");
    let (status, v) = send(reqwest::Method::DELETE, &format!("{}/v1/completions", s.http), Some(ADMIN), &json!({}));
    assert_eq!((status, v["error"]["code"].as_str()), (405, Some("method_not_allowed")), "{v}");
    let (status, v) = get(&format!("{}/api/simulations/not-a-number", s.http), Some(ADMIN));
    assert_eq!((status, v["error"]["code"].as_str()), (400, Some("invalid_path")), "{v}");

    // The server is still fine.
    assert_eq!(completion(&s.http, ADMIN, ok).0, 200);
}

#[test]
fn policies_are_validated_audited_and_recovered_after_a_restart() {
    let db = Db::fresh("policy");
    let mut s = serve(&db, &["--router", "round-robin"]);
    let _e = engine(&s.grpc, "e0", &[]);
    wait_serving(&s.http, 1);
    let url = format!("{}/api/policies", s.http);
    let (status, v) = common::send(reqwest::Method::PUT, &url, Some(ADMIN), &json!({"router": "fastest"}));
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("cache-aware")), "names valid routers: {v}");
    let (status, _) =
        common::send(reqwest::Method::PUT, &url, Some(ADMIN), &json!({"router": "cache-aware", "extra": 1}));
    assert_eq!(status, 400);
    let (status, v) = common::send(reqwest::Method::PUT, &url, Some(ADMIN), &json!({"router": "dynamo-kv"}));
    assert_eq!((status, v["version"].as_i64()), (200, Some(1)), "{v}");
    let (_, v) = get(&url, Some(ADMIN));
    assert_eq!(v["in_force"]["router"], "dynamo-kv");
    let (_, audit) = get(&format!("{}/api/audit", s.http), Some(ADMIN));
    assert_eq!(audit["entries"][0]["action"], "policy.put");
    assert_eq!(audit["entries"][0]["actor"], "admin");
    let (status, _) = common::send(
        reqwest::Method::PUT,
        &format!("{}/api/slo", s.http),
        Some(ADMIN),
        &json!({"ttft_ms": 500, "tpot_ms": 40}),
    );
    assert_eq!(status, 200);

    // A new control plane on the same database and ports: the policy comes back, the engine
    // re-registers by its heartbeat, and requests flow.
    let (http, grpc) = (s.http.trim_start_matches("http://").to_string(), s.grpc.clone());
    s.proc.kill();
    let s = serve_on(&db, &http, &grpc, &["--router", "round-robin"]);
    let (_, v) = get(&format!("{}/api/policies", s.http), Some(ADMIN));
    assert_eq!(v["in_force"]["router"], "dynamo-kv", "{v}");
    assert_eq!(v["version"], 1);
    wait_serving(&s.http, 1);
    let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "again", "max_tokens": 3}));
    assert_eq!(status, 200, "{v}");
    let (_, slo) = get(&format!("{}/api/slo", s.http), Some(ADMIN));
    assert_eq!(slo, json!({"ttft_ms": 500.0, "tpot_ms": 40.0}));
}

/// The scheduling every engine reports through `/api/instances`, by engine name.
fn schedulings(http: &str) -> Vec<(String, Value)> {
    let (_, v) = get(&format!("{http}/api/instances"), Some(ADMIN));
    let mut all: Vec<(String, Value)> = v["instances"]
        .as_array()
        .expect("list")
        .iter()
        .map(|i| (i["name"].as_str().unwrap_or_default().to_string(), i["scheduling"].clone()))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

/// PUTs each policy of `cases` to `url`, which must refuse it with a 400 naming the field and
/// saying what the case says.
fn refused_by_name(url: &str, cases: &[(Value, &str, &str)]) {
    for (body, field, says) in cases {
        let (status, v) = common::send(reqwest::Method::PUT, url, Some(ADMIN), body);
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(*field)), "{body}: {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains(says)), "{body}: {v}");
    }
}

#[test]
fn a_policy_sets_every_engines_scheduling_and_a_rollback_restores_the_whole_set() {
    let db = Db::fresh("policyset");
    let s = serve(&db, &["--router", "round-robin"]);
    let _e0 = engine(&s.grpc, "e0", &[]);
    wait_serving(&s.http, 1);
    let url = format!("{}/api/policies", s.http);
    let fcfs = json!({"prefill_scheduler": "fcfs", "prefill_params": {}, "kv_high_water": null, "kv_low_water": null});
    eventually(10, "e0 reports its own scheduling", || schedulings(&s.http) == [("e0".to_string(), fcfs.clone())]);

    // Each bad field is refused with its name and the valid values; nothing is stored.
    let refused = [
        (json!({"router": "round-robin", "prefill_scheduler": "lifo"}), "prefill_scheduler", "valid: fcfs, fair"),
        (json!({"router": "round-robin", "kv_high_water": 1.5}), "kv_high_water", "(0, 1]"),
        (
            json!({"router": "round-robin", "kv_high_water": 0.8, "kv_low_water": 0.9}),
            "kv_low_water",
            "kv_high_water = 0.8",
        ),
        (json!({"router": "round-robin", "kv_low_water": 0.5}), "kv_low_water", "needs kv_high_water"),
        (json!({"router": "round-robin", "autoscaler": "slo-load"}), "autoscaler", "valid: none"),
    ];
    refused_by_name(&url, &refused);
    let (_, v) = get(&format!("{url}/history"), Some(ADMIN));
    assert_eq!(v["versions"], json!([]), "refused versions are not stored");

    let fair = json!({"router": "round-robin", "prefill_scheduler": "fair", "kv_high_water": 0.9, "kv_low_water": 0.6});
    let (status, v) = common::send(reqwest::Method::PUT, &url, Some(ADMIN), &fair);
    assert_eq!((status, v["version"].as_i64()), (200, Some(1)), "{v}");
    let fair_in_force = json!({"prefill_scheduler": "fair", "kv_high_water": 0.9, "kv_low_water": 0.6,
        "prefill_params": {"chunk_tokens": 8192.0, "quota_kv_share": 0.02, "quota_growth": 2.0, "long_min_tokens": 1024.0}});
    eventually(10, "e0 schedules fairly", || schedulings(&s.http) == [("e0".to_string(), fair_in_force.clone())]);
    // An engine that joins later gets the policy in force.
    let _e1 = engine(&s.grpc, "e1", &[]);
    wait_serving(&s.http, 2);
    let both = |sched: &Value| vec![("e0".to_string(), sched.clone()), ("e1".to_string(), sched.clone())];
    eventually(10, "e1 schedules fairly too", || schedulings(&s.http) == both(&fair_in_force));
    let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "fairly", "max_tokens": 3}));
    assert_eq!(status, 200, "{v}");

    let (status, _) = common::send(reqwest::Method::PUT, &url, Some(ADMIN), &json!({"router": "least-outstanding"}));
    assert_eq!(status, 200);
    eventually(10, "both back to FCFS", || schedulings(&s.http) == both(&fcfs));
    let (_, v) = get(&url, Some(ADMIN));
    assert_eq!(v["in_force"]["router"], "least-outstanding");

    // Rollback: the console PUTs the old version's whole policy as a new version.
    let (_, history) = get(&format!("{url}/history"), Some(ADMIN));
    let v1 = history["versions"].as_array().expect("versions").iter().find(|v| v["version"] == 1).expect("v1");
    assert_eq!(v1["author"], "admin");
    let (status, v) = common::send(reqwest::Method::PUT, &url, Some(ADMIN), &v1["policy"]);
    assert_eq!((status, v["version"].as_i64()), (200, Some(3)), "{v}");
    eventually(10, "the rollback's scheduling is in force", || schedulings(&s.http) == both(&fair_in_force));
    let (_, v) = get(&url, Some(ADMIN));
    assert_eq!(v["in_force"]["router"], "round-robin");
    assert_eq!(
        v["policy"],
        json!({"router": "round-robin", "router_params": {}, "prefill_scheduler": "fair", "prefill_params": {},
            "kv_high_water": 0.9, "kv_low_water": 0.6, "autoscaler": null, "autoscaler_params": {}})
    );
    let (_, history) = get(&format!("{url}/history"), Some(ADMIN));
    let v2 = &history["versions"][1];
    assert_eq!(v2["policy"]["prefill_scheduler"], "fcfs", "history shows every field, defaults filled: {v2}");
}

/// Posts a policy file's text to `POST /api/policies/file`.
fn apply_policy_file(http: &str, text: &str) -> (u16, Value) {
    let r = common::client()
        .post(format!("{http}/api/policies/file"))
        .bearer_auth(ADMIN)
        .header("content-type", "application/toml")
        .body(text.to_string())
        .send()
        .expect("POST");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

#[test]
fn a_policys_parameters_run_in_the_controller_and_reach_the_engines() {
    let db = Db::fresh("policyparams");
    let s = serve(&db, &["--router", "round-robin"]);
    let _e0 = engine(&s.grpc, "e0", &[]);
    wait_serving(&s.http, 1);
    let url = format!("{}/api/policies", s.http);

    // A parameter out of its range, or one the router does not have, is refused by name.
    let refused = [
        (
            json!({"router": "cache-aware", "router_params": {"copy_weight": 99}}),
            "router_params.copy_weight",
            "range [0, 64]",
        ),
        (
            json!({"router": "round-robin", "router_params": {"copy_weight": 1}}),
            "router_params.copy_weight",
            "no parameter",
        ),
        (
            json!({"router": "round-robin", "prefill_params": {"quota_growth": 0.5}}),
            "prefill_params.quota_growth",
            "[1, 16]",
        ),
        (
            json!({"router": "round-robin", "autoscaler_params": {"up_load": 1}}),
            "autoscaler_params.up_load",
            "none has no",
        ),
    ];
    refused_by_name(&url, &refused);

    // Through the JSON API: the router with its parameters in the controller, fair prefill's
    // on the engine, which reports them back.
    let policy = json!({"router": "cache-aware", "router_params": {"copy_weight": 2}, "prefill_scheduler": "fair",
        "prefill_params": {"chunk_tokens": 4096}});
    let (status, v) = common::send(reqwest::Method::PUT, &url, Some(ADMIN), &policy);
    assert_eq!((status, v["version"].as_i64()), (200, Some(1)), "{v}");
    let (_, v) = get(&url, Some(ADMIN));
    assert_eq!(v["policy"]["router_params"], json!({"copy_weight": 2.0}), "{v}");
    assert_eq!(v["policy"]["prefill_params"], json!({"chunk_tokens": 4096.0}), "{v}");
    assert_eq!(v["in_force"]["router"], "cache-aware");
    assert_eq!(v["in_force"]["router_label"], "cache-aware(copy_weight=2)", "{v}");
    assert_eq!(v["in_force"]["router_params"], json!({"copy_weight": 2.0}));
    let (_, fleet) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
    assert_eq!(fleet["router_label"], "cache-aware(copy_weight=2)", "{fleet}");
    let chunk = |http: &str| schedulings(http)[0].1["prefill_params"]["chunk_tokens"].as_f64();
    eventually(10, "e0 schedules fairly with 4,096-token chunks", || chunk(&s.http) == Some(4096.0));
    let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "tuned", "max_tokens": 3}));
    assert_eq!(status, 200, "{v}");

    // A tuned policy file, TOML as `fleetplane tune` writes it: applied as the next version.
    let tuned = "router = \"dynamo-kv\"\nkv_high_water = 0.9\n\n[router_params]\noverlap_score_weight = 1.5\n";
    let (status, v) = apply_policy_file(&s.http, tuned);
    assert_eq!((status, v["version"].as_i64()), (200, Some(2)), "{v}");
    assert_eq!(v["policy"]["router_params"], json!({"overlap_score_weight": 1.5}), "{v}");
    let (_, v) = get(&url, Some(ADMIN));
    assert_eq!(v["in_force"]["router_label"], "dynamo-kv(overlap_score_weight=1.5)", "{v}");
    eventually(10, "e0 back to FCFS", || chunk(&s.http).is_none());
    // Its errors name the key, a parameter with its range.
    let (status, v) =
        apply_policy_file(&s.http, "router = \"dynamo-kv\"\nrouter_params = { overlap_score_weight = 40 }\n");
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("router_params.overlap_score_weight")), "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("[0, 16]")), "{v}");
    let (status, v) = apply_policy_file(&s.http, "router = \"dynamo-kv\"\nrouter_parameters = {}\n");
    assert_eq!((status, v["error"]["code"].as_str()), (400, Some("invalid_toml")), "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("router_parameters")), "{v}");
    let (_, v) = get(&format!("{url}/history"), Some(ADMIN));
    assert_eq!(v["versions"].as_array().map(Vec::len), Some(2), "refused files are not stored: {v}");
}

/// Two engines and a 600-token stream on one of them; after 50 tokens `fault` strikes the
/// engine running it, and the stream must still end within `within` with every token once.
/// Returns the fleet (the struck engine's index beside it) for further checks.
fn a_stream_outlives(fault: fn(&mut Proc), within: Duration) -> (Db, Serve, Vec<Proc>, usize) {
    let db = Db::fresh("fault");
    let s = serve(&db, &["--router", "least-outstanding"]);
    let mut engines = vec![engine(&s.grpc, "a", &[]), engine(&s.grpc, "b", &[])];
    wait_serving(&s.http, 2);
    // ~5 ms a token on the cost model: 600 tokens take about 3 s.
    let response = common::client()
        .post(format!("{}/v1/completions", s.http))
        .bearer_auth(ADMIN)
        .json(&json!({"model": MODEL, "prompt": "a long story", "max_tokens": 600, "stream": true}))
        .send()
        .expect("stream");
    // Read on a thread of its own, so that a stalled stream fails the test instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(response).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut tokens = 0;
    while tokens < 50 {
        let line = rx.recv_timeout(Duration::from_secs(30)).expect("stream open");
        tokens += usize::from(line.starts_with("data: {"));
    }
    let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
    let busy =
        v["instances"].as_array().expect("list").iter().find(|i| i["load"]["running"] == 1).expect("a busy engine")
            ["name"]
            .as_str()
            .expect("name")
            .to_string();
    let k = engines.iter().position(|e| e.first_line.contains(&format!("engine {busy} "))).expect("its process");
    fault(&mut engines[k]);
    let deadline = std::time::Instant::now() + within;
    let mut rest = Vec::new();
    while rest.last().map(String::as_str) != Some("[DONE]") {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => rest.extend(line.strip_prefix("data: ").map(str::to_string)),
            Err(e) => panic!("the stream did not end within {within:?} ({e}); last: {:?}", rest.last()),
        }
    }
    let more = rest.iter().filter(|e| e.contains("\"text\":\"") && !e.contains("\"text\":\"\"")).count();
    assert_eq!(tokens + more, 600, "every token arrives exactly once");
    (db, s, engines, k)
}

#[test]
fn a_request_on_an_engine_killed_mid_stream_resumes_elsewhere() {
    let (_db, s, mut engines, _) = a_stream_outlives(Proc::kill, Duration::from_secs(30));
    // The dead engine is known to be down; new requests go to the other one.
    eventually(10, "the killed engine is down", || {
        let (_, v) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
        v["instances"]["down"] == 1
    });
    let (status, _) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "next", "max_tokens": 3}));
    assert_eq!(status, 200);
    // With no engine left, a request is refused at once with a clear error, not hung.
    engines.clear();
    eventually(10, "no engine serving", || {
        let (_, v) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
        v["instances"]["serving"].is_null()
    });
    let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "anyone?", "max_tokens": 3}));
    assert_eq!((status, v["error"]["code"].as_str()), (503, Some("no_engine")));
}

#[test]
fn a_request_on_an_engine_that_stops_answering_resumes_elsewhere() {
    // SIGSTOP: the process and its sockets stay, nothing comes out of them. The engine is
    // taken out after 5 s of silence, and its stream must move as a dead engine's does.
    let stop = |e: &mut Proc| {
        let _ = std::process::Command::new("kill").args(["-STOP", &e.child.id().to_string()]).status();
    };
    let (_db, s, mut engines, k) = a_stream_outlives(stop, Duration::from_secs(20));
    let (_, v) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
    assert_eq!(v["instances"]["down"], 1, "{v}");
    let (status, _) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "next", "max_tokens": 3}));
    assert_eq!(status, 200);
    engines[k].kill();
}

#[test]
fn two_replicas_share_one_database_and_the_leader_hands_over() {
    let db = Db::fresh("leader");
    let a = serve(&db, &["--replica", "a"]);
    let b = serve(&db, &["--replica", "b"]);
    let _e = common::start(
        &[
            "engine",
            "--executor",
            "sim",
            "--model",
            MODEL,
            "--control",
            &format!("{},{}", a.grpc, b.grpc),
            "--name",
            "shared",
        ],
        &[("FLEETPLANE_ENGINE_TOKEN", ENGINE)],
        "listening on",
    );
    wait_serving(&a.http, 1);
    wait_serving(&b.http, 1);
    let leader = |s: &Serve| get(&format!("{}/api/fleet", s.http), Some(ADMIN)).1["leader"].as_bool();
    eventually(5, "one leader", || leader(&a).is_some_and(|x| x) != leader(&b).is_some_and(|x| x));
    // Both serve the gateway.
    for s in [&a, &b] {
        let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "both", "max_tokens": 2}));
        assert_eq!(status, 200, "{v}");
    }
    let (mut old, new) = if leader(&a) == Some(true) { (a, b) } else { (b, a) };
    old.proc.kill();
    let started = std::time::Instant::now();
    eventually(5, "the other replica leads", || leader(&new) == Some(true));
    eprintln!("leader handed over in {:?}", started.elapsed());
    let (status, _) = completion(&new.http, ADMIN, json!({"model": MODEL, "prompt": "still", "max_tokens": 2}));
    assert_eq!(status, 200);
}

#[test]
fn simulations_submitted_through_the_api_run_in_the_background() {
    let db = Db::fresh("sim");
    let s = serve(&db, &[]);
    let url = format!("{}/api/simulations", s.http);
    let (status, v) = post(&url, Some(ADMIN), &json!({"scenario": "routers = [\"warp-drive\"]"}));
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("warp-drive")), "{v}");
    let scenario = r#"
        seed = 3
        routers = ["round-robin", "cache-aware"]
        [fleet]
        instances = 4
        [workload.synthetic]
        requests = 400
        arrival = { kind = "poisson", rate_rps = 20.0 }
        input = { kind = "uniform", min = 256, max = 2048 }
        output = { kind = "uniform", min = 16, max = 128 }
        prefix = { groups = 4, tokens = 512, share = 0.5 }
    "#;
    let (status, v) = post(&url, Some(ADMIN), &json!({"scenario": scenario}));
    assert_eq!(status, 202, "{v}");
    let id = v["id"].as_i64().expect("id");
    let mut run = Value::Null;
    eventually(60, "the simulation finishes", || {
        run = get(&format!("{url}/{id}"), Some(ADMIN)).1;
        run["state"] == "done" || run["state"] == "failed"
    });
    assert_eq!(run["state"], "done", "{run}");
    let runs = run["result"]["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[1]["router"], "cache-aware");
    assert_eq!(runs[0]["summary"]["requests"], 400);
    let chart = common::client().get(format!("{url}/{id}/chart.svg")).bearer_auth(ADMIN).send().expect("chart");
    assert_eq!(chart.status().as_u16(), 200);
    assert!(chart.text().expect("svg").contains("<svg"));
}

#[test]
fn the_demo_starts_the_live_system_and_replays_through_the_gateway() {
    let db = Db::fresh("demo");
    let stdout = run_demo(&db, &["--engines", "2", "--requests", "40"]);
    assert!(stdout.contains("gateway (OpenAI API)  http://127.0.0.1:"), "{stdout}");
    assert!(stdout.contains("requests sent 40  ok 40  failed 0"), "{stdout}");
}

/// The processes whose parent is `pid` (from /proc).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // `pid (comm) state ppid ...`: comm may hold spaces, so read after its `)`.
            let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
            after.split_whitespace().nth(1).and_then(|pp| pp.parse::<u32>().ok()) == Some(pid)
        })
        .collect()
}

#[test]
fn one_ctrl_c_during_the_demos_replay_stops_it_and_reaps_every_child() {
    use std::os::unix::process::CommandExt;
    let db = Db::fresh("demo_sigint");
    // In a process group of its own, as a shell runs a foreground job: a terminal's Ctrl-C
    // is SIGINT to the whole group.
    let mut demo = std::process::Command::new(bin())
        .args(["demo", "--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--engines", "2"])
        .args(["--database-url", &db.url])
        .env("FLEETPLANE_SPOOL_DIR", db.spool_dir())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .expect("demo starts");
    let pid = demo.id();
    let (tx, lines) = std::sync::mpsc::channel();
    let stdout = demo.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !lines.recv_timeout(Duration::from_secs(60)).is_ok_and(|l| l.contains("replaying the workload")) {
        assert!(std::time::Instant::now() < deadline, "the demo never began its replay");
    }
    // Requests in flight, as the demo's workload keeps some.
    std::thread::sleep(Duration::from_secs(3));
    let children = children_of(pid);
    assert_eq!(children.len(), 3, "serve and two engines: {children:?}");
    let interrupted = std::time::Instant::now();
    assert!(std::process::Command::new("kill")
        .args(["-INT", "--", &format!("-{pid}")])
        .status()
        .is_ok_and(|s| s.success()));
    let status = loop {
        if let Some(status) = demo.try_wait().expect("try_wait") {
            break status;
        }
        if interrupted.elapsed() > Duration::from_secs(15) {
            let _ = std::process::Command::new("kill").args(["-KILL", "--", &format!("-{pid}")]).status();
            for c in &children {
                let _ = std::process::Command::new("kill").args(["-KILL", &c.to_string()]).status();
            }
            let _ = demo.wait();
            panic!("the demo was still running 15 s after one Ctrl-C");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let took = interrupted.elapsed();
    let out: Vec<String> = lines.try_iter().collect();
    assert!(status.success(), "{status}: {}", out.join("\n"));
    assert!(out.iter().any(|l| l.contains("cut off when stopped")), "{}", out.join("\n"));
    // Reaped by the demo itself: not running, and no zombie left behind.
    let left: Vec<_> = children.iter().filter(|c| std::path::Path::new(&format!("/proc/{c}")).exists()).collect();
    assert!(left.is_empty(), "children of the demo left after it exited: {left:?}");
    eprintln!("the demo exited {:.2} s after Ctrl-C", took.as_secs_f64());
}

#[test]
fn a_client_that_goes_away_frees_its_engine() {
    let db = Db::fresh("cancel");
    let s = serve(&db, &[]);
    let _e = engine(&s.grpc, "e0", &[]);
    wait_serving(&s.http, 1);
    // ~5 ms a token: 2,000 tokens would hold the engine for about 10 s.
    let response = common::client()
        .post(format!("{}/v1/completions", s.http))
        .bearer_auth(ADMIN)
        .json(&json!({"model": MODEL, "prompt": "a very long story", "max_tokens": 2000, "stream": true}))
        .send()
        .expect("stream");
    let mut lines = BufReader::new(response).lines().map_while(Result::ok);
    let mut tokens = 0;
    while tokens < 20 {
        tokens += usize::from(lines.next().expect("stream open").starts_with("data: {"));
    }
    let running =
        || get(&format!("{}/api/instances", s.http), Some(ADMIN)).1["instances"][0]["load"]["running"].as_u64();
    assert_eq!(running(), Some(1));
    drop(lines);
    eventually(3, "the engine drops the abandoned request", || running() == Some(0));
    let (status, _) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "next", "max_tokens": 2}));
    assert_eq!(status, 200);
}

#[test]
fn an_engine_drained_through_one_replica_stops_taking_requests_from_the_others() {
    let db = Db::fresh("drain2");
    let (a, b) = (serve(&db, &["--replica", "a"]), serve(&db, &["--replica", "b"]));
    let both = format!("{},{}", a.grpc, b.grpc);
    let _e0 = engine(&both, "e0", &[]);
    let _e1 = engine(&both, "e1", &[]);
    wait_serving(&a.http, 2);
    wait_serving(&b.http, 2);
    let id_of = |s: &Serve, name: &str| {
        let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
        v["instances"].as_array().and_then(|l| l.iter().find(|i| i["name"] == name).cloned()).expect("listed")
    };
    let id = id_of(&a, "e0")["id"].as_u64().expect("id");
    let (status, _) = post(&format!("{}/api/instances/{id}/drain", a.http), Some(ADMIN), &json!({}));
    assert_eq!(status, 202);
    // Replica b hears it in the engine's next heartbeat.
    eventually(3, "the other replica sees the engine draining", || id_of(&b, "e0")["state"] == "draining");
    for _ in 0..4 {
        let (status, v) = completion(&b.http, ADMIN, json!({"model": MODEL, "prompt": "elsewhere", "max_tokens": 2}));
        assert_eq!(status, 200, "{v}");
    }
    let metrics = common::client().get(format!("{}/metrics", b.http)).send().expect("metrics").text().expect("text");
    assert!(metrics.contains("fleetplane_requests_replaced_total 0"), "nothing sent to the draining engine: {metrics}");
}

/// Whether `text` is `n` words of the word-level test tokenizer, one space apart.
fn is_words(text: &str, n: usize) -> bool {
    let words: Vec<&str> = text.split(' ').collect();
    words.len() == n && words.iter().all(|w| w.strip_prefix('w').is_some_and(|d| d.parse::<u32>().is_ok()))
}

#[test]
fn an_engines_tokenizer_turns_text_into_ids_and_output_ids_into_text() {
    let db = Db::fresh("tokenizer");
    let dir = tests::scratch_dir("engine-tokenizer");
    // The cost-model engine's made-up tokens are below 32,000: all of them are words here.
    let file = write_word_level_tokenizer(&dir.join("a"), 32_000);
    let s = serve(&db, &[]);
    let _e0 = engine(&s.grpc, "e0", &["--tokenizer", file.to_str().expect("utf-8 path")]);
    wait_serving(&s.http, 1);

    // Two words of the tokenizer: two ids (the stand-in cuts each into two pieces).
    let body = json!({"model": MODEL, "prompt": "w31999 w31998", "max_tokens": 12, "temperature": 0});
    let (status, v) = completion(&s.http, ADMIN, body.clone());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 2, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap_or_default().to_string();
    assert!(is_words(&text, 12), "the output reads as the tokenizer's words: {text:?}");

    // Streamed, chunk by chunk: the chunks add up to words too.
    let mut stream_body = body;
    stream_body["stream"] = json!(true);
    let chunks = streamed(&s.http, "/v1/completions", stream_body);
    let streamed_text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert!(is_words(&streamed_text, 12), "{streamed_text:?}");

    // An engine with another tokenizer for the same model is refused, naming both.
    let other = write_word_level_tokenizer(&dir.join("b"), 100);
    let mut e1 = engine(&s.grpc, "e1", &["--tokenizer", other.to_str().expect("utf-8 path")]);
    let refused = (0..100).find_map(|_| {
        let line = e1.lines.recv_timeout(Duration::from_millis(100)).ok()?;
        line.contains("is not the fleet's").then_some(line)
    });
    assert!(refused.is_some(), "the second engine was not refused for its tokenizer");
    e1.kill();
    let (_, fleet) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
    assert_eq!(fleet["instances"]["serving"], 1, "{fleet}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_tokenizer_given_to_serve_tokenizes_for_engines_that_bring_none() {
    let db = Db::fresh("tokenizer_pin");
    let dir = tests::scratch_dir("serve-tokenizer");
    write_word_level_tokenizer(&dir, 32_000);
    let pin = format!("{MODEL}={}", dir.display());
    let s = serve(&db, &["--tokenizer", &pin]);
    let _e0 = engine(&s.grpc, "e0", &[]);
    wait_serving(&s.http, 1);
    let body = json!({"model": MODEL, "prompt": "w1 w2 w3 unknown", "max_tokens": 3});
    let (status, v) = completion(&s.http, ADMIN, body);
    assert_eq!((status, v["usage"]["prompt_tokens"].as_u64()), (200, Some(4)), "{v}");
    assert!(is_words(v["choices"][0]["text"].as_str().unwrap_or_default(), 3), "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn latency_probes_the_path_with_the_profiles_lone_prompts() {
    let db = Db::fresh("latency");
    let s = serve(&db, &[]);
    let profile = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/results/profile-h200-llama-8b-2026-12-01.json");
    let _e = engine(&s.grpc, "probed", &["--gpu", "h200", "--profile", profile]);
    wait_serving(&s.http, 1);
    let json = std::env::temp_dir().join(format!("fleetplane-latency-{}.json", std::process::id()));
    let run = |extra: &[&str]| {
        let mut args = vec!["latency", "--profile", profile, "--gateway", &s.http, "--requests", "3"];
        args.extend_from_slice(extra);
        std::process::Command::new(bin()).args(&args).env("FLEETPLANE_ADMIN_TOKEN", ADMIN).output().expect("runs")
    };
    let out = run(&["--max-prompt-tokens", "256", "--json", json.to_str().expect("utf-8 path")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("dispatch_ms = "), "{stdout}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).expect("json");
    let _ = std::fs::remove_file(&json);
    let lengths: Vec<(u64, u64)> = v["lengths"]
        .as_array()
        .expect("lengths")
        .iter()
        .map(|l| (l["prompt_tokens"].as_u64().unwrap_or(0), l["requests"].as_u64().unwrap_or(0)))
        .collect();
    assert_eq!(lengths, [(64, 3), (256, 3)], "{v}");
    // The engine's steps take the calibrated model's time, near the profile's: what is left is
    // the path, a few ms on this machine, not a prefill.
    let dispatch = v["dispatch_ms"].as_f64().expect("dispatch_ms");
    assert!(dispatch.is_finite() && dispatch.abs() < 50.0, "{v}");

    let out = run(&["--served-model", "no-such-model"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("64-token probe failed") && stderr.contains("no-such-model"), "{stderr}");
}

#[test]
fn an_engine_logs_the_steps_it_served_as_a_profile_simulate_calibrates_on() {
    let db = Db::fresh("steplog");
    let s = serve(&db, &[]);
    let log = std::env::temp_dir().join(format!("fleetplane-step-log-{}.json", std::process::id()));
    let _e = engine(&s.grpc, "logged", &["--gpu", "h200", "--step-log", log.to_str().expect("utf-8 path")]);
    wait_serving(&s.http, 1);
    let prompt: Vec<u32> = (0..300).map(|i| 500 + i).collect();
    let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": prompt, "max_tokens": 6}));
    assert_eq!(status, 200, "{v}");
    // Written when the engine goes idle: one prefill step, then five decode steps.
    let mut profile = Value::Null;
    eventually(10, "the step log", || {
        profile = std::fs::read_to_string(&log).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
        profile["samples"].as_array().is_some_and(|a| a.len() >= 6)
    });
    assert_eq!((profile["model"].as_str(), profile["gpu"].as_str()), (Some(MODEL), Some("h200")), "{profile}");
    let samples = profile["samples"].as_array().expect("samples");
    assert_eq!(samples[0]["prefill_tokens"], 300, "{profile}");
    assert!(samples[1..6].iter().all(|s| s["decode_seqs"] == 1 && s["prefill_seqs"] == 0), "{profile}");
    assert!(samples.iter().all(|s| s["seconds"].as_f64().is_some_and(|t| t > 0.0)), "{profile}");

    let out = std::process::Command::new(bin())
        .args(["simulate", "--scenario", concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/cuda-fidelity.toml")])
        .args(["--profile", log.to_str().expect("utf-8 path"), "--max-requests", "20", "--instances", "1"])
        .output()
        .expect("runs");
    let _ = std::fs::remove_file(&log);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("calibrated on"), "{stdout}");
}

#[test]
fn an_engine_given_sigterm_finishes_its_streams_and_exits() {
    let term = |e: &mut Proc| {
        let _ = std::process::Command::new("kill").args(["-TERM", &e.child.id().to_string()]).status();
    };
    // Its stream ends whole (from it or, past the drain bound, elsewhere), and the process exits.
    let (_db, s, mut engines, k) = a_stream_outlives(term, Duration::from_secs(20));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while engines[k].child.try_wait().expect("wait").is_none() {
        assert!(std::time::Instant::now() < deadline, "the engine still runs 10 s after the stream ended");
        std::thread::sleep(Duration::from_millis(100));
    }
    eventually(10, "the stopped engine is down", || {
        let (_, v) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
        v["instances"]["down"] == 1
    });
    let (status, _) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "next", "max_tokens": 3}));
    assert_eq!(status, 200);
}

#[test]
fn clients_that_hold_half_sent_requests_are_cut_off_and_the_rest_are_served() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let db = Db::fresh("slow");
    let flags = ["--header-timeout-s", "1", "--body-timeout-s", "1", "--max-connections", "8"];
    let s = serve(&db, &flags);
    let address = s.http.trim_start_matches("http://").to_string();
    // Closed by the server: a read that ends (0 bytes, a response, or a reset) within `secs`.
    let closed_within = |c: &mut TcpStream, secs: u64| {
        c.set_read_timeout(Some(Duration::from_secs(secs))).expect("timeout");
        let mut buf = Vec::new();
        match c.read_to_end(&mut buf) {
            Ok(_) => Some(String::from_utf8_lossy(&buf).to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Some(String::new()),
            Err(_) => None,
        }
    };
    // As many half-sent headers as the server takes connections, and one idle connection.
    let mut slow: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut c = TcpStream::connect(&address).expect("connect");
            c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").expect("part of the headers");
            c
        })
        .collect();
    for c in &mut slow {
        assert!(closed_within(c, 5).is_some(), "a connection holding half its headers stays open");
    }
    // A body that stops halfway: the request fails and the connection closes.
    let mut c = TcpStream::connect(&address).expect("connect");
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"",
    )
    .expect("part of the body");
    let answer = closed_within(&mut c, 5).expect("a half-sent body is not waited for");
    assert!(answer.is_empty() || !answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The server still serves everyone else.
    let (status, _) = get(&format!("{}/healthz", s.http), None);
    assert_eq!(status, 200);
}

#[test]
fn requests_go_only_to_engines_of_their_model() {
    let db = Db::fresh("models");
    let s = serve(&db, &["--router", "least-outstanding"]);
    let _llama = engine(&s.grpc, "l", &[]);
    // A small qwen engine: 64 blocks of 16 tokens.
    let qwen_args = ["engine", "--executor", "sim", "--model", "qwen3-32b", "--kv-blocks", "64"];
    let _qwen = start(
        &[&qwen_args[..], &["--control", &s.grpc, "--name", "q"]].concat(),
        &[("FLEETPLANE_ENGINE_TOKEN", ENGINE)],
        "listening on",
    );
    wait_serving(&s.http, 2);
    let (_, v) = get(&format!("{}/v1/models", s.http), Some(ADMIN));
    let ids: Vec<&str> = v["data"].as_array().expect("models").iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, ["llama-3.1-8b", "qwen3-32b"], "{v}");

    // The size check is the model's own: the llama engine would hold it, qwen's does not.
    let long: Vec<u32> = (0..2000).map(|i| 100 + i % 1000).collect();
    let (status, v) = completion(&s.http, ADMIN, json!({"model": "qwen3-32b", "prompt": long, "max_tokens": 8}));
    assert_eq!((status, v["error"]["code"].as_str()), (400, Some("context_length_exceeded")), "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("`qwen3-32b` holds 1024")), "{v}");
    let (status, _) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": long, "max_tokens": 8}));
    assert_eq!(status, 200);
    // Loads are the engines' own reports: wait for the one that shows the llama request gone,
    // or a report sent while it ran reads as a qwen request below.
    let llama_running = || {
        let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
        v["instances"]
            .as_array()
            .expect("instances")
            .iter()
            .filter(|i| i["model"] == MODEL)
            .map(|i| i["load"]["running"].as_u64().unwrap_or(0))
            .sum::<u64>()
    };
    eventually(10, "the llama engine reports its request done", || llama_running() == 0);

    // Streams for qwen run on the qwen engine only, however busy it is.
    let streams: Vec<_> = (0..4)
        .map(|k| {
            let http = s.http.clone();
            std::thread::spawn(move || {
                streamed(
                    &http,
                    "/v1/completions",
                    json!({"model": "qwen3-32b", "prompt": format!("story {k}"), "max_tokens": 200, "stream": true}),
                )
            })
        })
        .collect();
    let mut seen_running = false;
    while !streams.iter().all(|t| t.is_finished()) {
        let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
        for i in v["instances"].as_array().expect("instances") {
            let running = i["load"]["running"].as_u64().unwrap_or(0);
            if i["model"] == MODEL {
                assert_eq!(running, 0, "a qwen request on the llama engine: {v}");
            } else {
                seen_running |= running > 0;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for t in streams {
        assert!(!t.join().expect("stream").is_empty());
    }
    assert!(seen_running, "the qwen engine ran them");
    let (status, v) = completion(&s.http, ADMIN, json!({"model": "gpt-9", "prompt": "hi", "max_tokens": 2}));
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("model_not_found")), "{v}");
}

/// Prompt tokens the cache served for a completion of `prompt`.
fn cached_tokens(http: &str, prompt: &[u32]) -> u64 {
    let (status, v) = completion(http, ADMIN, json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}));
    assert_eq!(status, 200, "{v}");
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached tokens")
}

#[test]
fn a_policy_change_keeps_what_the_controller_knows_of_the_caches() {
    let db = Db::fresh("keepindex");
    let s = serve(&db, &["--router", "cache-aware"]);
    let (_a, _b) = (engine(&s.grpc, "a", &[]), engine(&s.grpc, "b", &[]));
    wait_serving(&s.http, 2);
    let prompt: Vec<u32> = (0..600).map(|i| 7 + i % 500).collect();
    assert_eq!(cached_tokens(&s.http, &prompt), 0);
    // Cache-aware finds it once the engine's KV events are in.
    eventually(10, "a repeat is served from the cache", || cached_tokens(&s.http, &prompt) > 0);

    // Dynamo's rule reads the same index: with it kept, the repeat goes where the prefix is
    // (forgotten, both engines tie and the one holding fewer cached blocks wins).
    let url = format!("{}/api/policies", s.http);
    let (status, v) = common::send(reqwest::Method::PUT, &url, Some(ADMIN), &json!({"router": "dynamo-kv"}));
    assert_eq!(status, 200, "{v}");
    eventually(10, "dynamo-kv in force", || get(&url, Some(ADMIN)).1["in_force"]["router"] == "dynamo-kv");
    assert!(cached_tokens(&s.http, &prompt) >= 576, "the first request after the change is served from the cache");
}

#[test]
fn the_routers_price_steps_by_the_model_and_gpu_the_engines_registered_with() {
    let db = Db::fresh("hints");
    let s = serve(&db, &[]);
    let _e = engine(&s.grpc, "a100", &["--gpu", "a100"]);
    wait_serving(&s.http, 1);
    let (model, gpu) = (cost::model_by_name(MODEL).expect("model"), cost::gpu_by_name("a100").expect("gpu"));
    let a100 = cost::CostModel::new(model, gpu, cost::Deployment::tensor_parallel(1), cost::CostParams::default())
        .expect("cost model");
    let instance = engine::InstanceConfig { block_size: 16, max_batch_tokens: 8192, ..Default::default() };
    // Through text, as the response came: serde_json may parse a number's last digit off.
    let text = serde_json::to_string(&cost::cost_hints(&a100, &instance)).expect("json");
    let want: Value = serde_json::from_str(&text).expect("json");
    let (_, v) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
    assert_eq!(v["cost_hints"], want, "{v}");
}
