//! Policies in force on a live fleet: validation, audit, engine scheduling, parameters, and what a change keeps.

use super::*;

/// A fresh database, a serve routing with `router` and one engine, `e0`, serving.
fn one_engine(db: &str, router: &str) -> (Db, Serve, Proc) {
    let db = Db::fresh(db);
    let s = serve(&db, &["--router", router]);
    let e0 = engine(&s.grpc, "e0", &[]);
    wait_serving(&s.http, 1);
    (db, s, e0)
}

#[test]
fn policies_are_validated_audited_and_recovered_after_a_restart() {
    let (db, mut s, _e) = one_engine("policy", "round-robin");
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
    let (_db, s, _e0) = one_engine("policyset", "round-robin");
    let url = format!("{}/api/policies", s.http);
    let fcfs = json!({"prefill_scheduler": "fcfs", "prefill_params": {}, "kv_high_water": null, "kv_low_water": null,
        "class_priority": false, "max_batch_tokens": 8192});
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
        (json!({"router": "round-robin", "max_batch_tokens": 0}), "max_batch_tokens", "at least 1"),
    ];
    refused_by_name(&url, &refused);
    let (_, v) = get(&format!("{url}/history"), Some(ADMIN));
    assert_eq!(v["versions"], json!([]), "refused versions are not stored");

    // The step budget is capped at the one the engines started with (8,192).
    let fair = json!({"router": "round-robin", "prefill_scheduler": "fair", "kv_high_water": 0.9, "kv_low_water": 0.6,
        "max_batch_tokens": 2048});
    let (status, v) = common::send(reqwest::Method::PUT, &url, Some(ADMIN), &fair);
    assert_eq!((status, v["version"].as_i64()), (200, Some(1)), "{v}");
    let fair_in_force = json!({"prefill_scheduler": "fair", "kv_high_water": 0.9, "kv_low_water": 0.6,
        "class_priority": false, "max_batch_tokens": 2048, "prefill_params": {"chunk_tokens": 8192.0, "quota_kv_share": 0.02, "quota_growth": 2.0, "long_min_tokens": 1024.0}});
    eventually(10, "e0 schedules fairly", || schedulings(&s.http) == [("e0".to_string(), fair_in_force.clone())]);
    // The routers price steps at the budget in force (smaller chunks, a slower prefill).
    let hints = || get(&format!("{}/api/fleet", s.http), Some(ADMIN)).1["cost_hints"].clone();
    eventually(10, "the routers price steps at 2,048 tokens", || hints()["max_batch_tokens"] == 2048);
    // An engine that joins later gets the policy in force.
    let _e1 = engine(&s.grpc, "e1", &[]);
    wait_serving(&s.http, 2);
    let both = |sched: &Value| vec![("e0".to_string(), sched.clone()), ("e1".to_string(), sched.clone())];
    eventually(10, "e1 schedules fairly too", || schedulings(&s.http) == both(&fair_in_force));
    let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "fairly", "max_tokens": 3}));
    assert_eq!(status, 200, "{v}");

    // A budget above the engines' own is capped there: back to FCFS at 8,192.
    let over = json!({"router": "least-outstanding", "max_batch_tokens": 100_000});
    let (status, _) = common::send(reqwest::Method::PUT, &url, Some(ADMIN), &over);
    assert_eq!(status, 200);
    eventually(10, "both back to FCFS at their own budget", || schedulings(&s.http) == both(&fcfs));
    assert_eq!(hints()["max_batch_tokens"], 8192, "priced at the engines' own budget again");
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
            "kv_high_water": 0.9, "kv_low_water": 0.6, "max_batch_tokens": 2048, "autoscaler": null, "autoscaler_params": {},
            "flow": null, "flow_params": {}, "class_priority": null, "class_slo": {}})
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
    let (_db, s, _e0) = one_engine("policyparams", "round-robin");
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

/// The router's decisions are explained live (`GET /api/decisions`), and cache-aware's triage
/// runs on the SLO in force: under a TTFT target no prompt can make, a request is placed as
/// lost.
#[test]
fn the_routers_decisions_are_explained_live_and_triage_follows_the_slo_in_force() {
    let (_db, s, _e0) = one_engine("decisions", "cache-aware");
    let decisions = |query: &str| {
        let (status, v) = get(&format!("{}/api/decisions{query}", s.http), Some(ADMIN));
        assert_eq!(status, 200, "{v}");
        v["decisions"].as_array().cloned().unwrap_or_default()
    };
    let ask = || {
        let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "why here", "max_tokens": 3}));
        assert_eq!(status, 200, "{v}");
    };
    ask();
    ask();
    let d = decisions("");
    assert_eq!(d.len(), 2, "{d:?}");
    let why = &d[1]["why"];
    assert_eq!(why["rule"].as_str(), Some("cache-aware"), "{why}");
    // The first output ran to its bound: the share of their bounds outputs use is 1.
    assert_eq!((why["lost"].as_bool(), why["output_share"].as_f64()), (Some(false), Some(1.0)), "{why}");
    assert!(why["predicted_ttft_ms"].as_f64().is_some_and(|t| t > 0.0), "{why}");
    assert_eq!(decisions("?limit=1"), d[1..].to_vec());
    let (status, v) = get(&format!("{}/api/decisions?limit=0", s.http), Some(ADMIN));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("limit")), "{v}");

    // Triage on, and a 1 ms TTFT target: a prompt of 1,000 tokens (~25 ms of prefill) is lost
    // wherever it goes.
    let policy = json!({"router": "cache-aware", "router_params": {"lost_cap": 4}});
    let (status, v) = common::send(reqwest::Method::PUT, &format!("{}/api/policies", s.http), Some(ADMIN), &policy);
    assert_eq!(status, 200, "{v}");
    let slo = json!({"ttft_ms": 1, "tpot_ms": 100});
    let (status, v) = common::send(reqwest::Method::PUT, &format!("{}/api/slo", s.http), Some(ADMIN), &slo);
    assert_eq!(status, 200, "{v}");
    let prompt: Vec<u32> = (0..1_000).map(|i| i % 97 + 1).collect();
    let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}));
    assert_eq!(status, 200, "{v}");
    let last = decisions("?limit=1");
    assert_eq!(last[0]["why"]["lost"].as_bool(), Some(true), "{last:?}");
}
