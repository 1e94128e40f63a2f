//! The admin console end to end: a real `fleetplane serve` with engine processes on a real
//! database, and the console driven in headless Chromium as an operator would use it. The
//! browser test saves a screenshot of each page under docs/console/.
//!
//! Without Chromium and chromedriver the browser test prints "skipped" and passes, unless
//! FLEETPLANE_REQUIRE_BROWSER is set (CI installs them and sets it).

#[path = "console/browser.rs"]
mod browser;
mod common;

use browser::Browser;
use common::*;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A scenario small enough to simulate in seconds, with shared prefixes so that routers differ.
const SMALL_SCENARIO: &str = r#"seed = 5

[fleet]
instances = 4
model = "llama-3.1-8b"
gpu = "h100"

[workload.synthetic]
requests = 400
arrival = { kind = "poisson", rate_rps = 20.0 }
input = { kind = "lognormal", median = 1024, sigma = 0.8, min = 16, max = 8192 }
output = { kind = "lognormal", median = 64, sigma = 0.8, min = 1, max = 512 }
prefix = { groups = 4, tokens = 512, share = 0.7 }

[slo]
ttft_ms = 1000
tpot_ms = 50
"#;

fn screenshots() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/console")
}

fn browser_or_skip(test: &str) -> Option<Browser> {
    let b = Browser::start();
    if b.is_none() {
        assert!(
            std::env::var_os("FLEETPLANE_REQUIRE_BROWSER").is_none(),
            "FLEETPLANE_REQUIRE_BROWSER is set but chromium or chromedriver is not installed"
        );
        println!("{test}: skipped (no /usr/bin/chromium or /usr/bin/chromedriver)");
    }
    b
}

/// Sends completions with a shared prefix through the gateway until dropped, so that the
/// history has latency and cache numbers to show.
struct Traffic {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u32>>,
}

impl Traffic {
    fn start(http: &str) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let (url, flag) = (format!("{http}/v1/completions"), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut ok = 0;
            let mut i = 0u32;
            while !flag.load(Ordering::Relaxed) {
                let prompt: Vec<u32> = (0..512).map(|t| 100 + t).chain((0..64).map(|t| 10_000 + 64 * i + t)).collect();
                let (status, _) = post(&url, Some(ADMIN), &json!({"model": MODEL, "prompt": prompt, "max_tokens": 8}));
                ok += u32::from(status == 200);
                i += 1;
                std::thread::sleep(Duration::from_millis(150));
            }
            ok
        });
        Traffic { stop, thread: Some(thread) }
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn router_in_force(http: &str) -> String {
    get(&format!("{http}/api/fleet"), Some(ADMIN)).1["router"].as_str().unwrap_or_default().to_string()
}

fn simulation_done(http: &str, id: u64) -> Value {
    let mut last = Value::Null;
    eventually(120, "the simulation finishes", || {
        last = get(&format!("{http}/api/simulations/{id}"), Some(ADMIN)).1;
        last["state"] == "done" || last["state"] == "failed"
    });
    assert_eq!(last["state"], "done", "{last}");
    last
}

#[test]
fn the_console_is_served_and_the_history_and_scenarios_feed_it() {
    let db = Db::fresh("console_api");
    let s = serve(&db, &[]);
    let _e = engine(&s.grpc, "e0", &[]);
    wait_serving(&s.http, 1);

    // `/` leads to the console; each file comes with its content type.
    let no_redirects =
        reqwest::blocking::Client::builder().redirect(reqwest::redirect::Policy::none()).build().expect("client");
    let root = no_redirects.get(format!("{}/", s.http)).send().expect("GET /");
    assert_eq!(root.status().as_u16(), 303);
    assert_eq!(root.headers()["location"], "/console/");
    for (path, content_type) in [
        ("/console/", "text/html; charset=utf-8"),
        ("/console/app.js", "text/javascript; charset=utf-8"),
        ("/console/pages/whatif.js", "text/javascript; charset=utf-8"),
        ("/console/console.css", "text/css; charset=utf-8"),
    ] {
        let r = client().get(format!("{}{path}", s.http)).send().expect("GET");
        assert_eq!(
            (r.status().as_u16(), r.headers()["content-type"].to_str().ok()),
            (200, Some(content_type)),
            "{path}"
        );
    }
    assert_eq!(client().get(format!("{}/console/nope.js", s.http)).send().expect("GET").status().as_u16(), 404);

    // The console's data is behind the admin token like the rest of the API.
    assert_eq!(get(&format!("{}/api/history", s.http), None).0, 401);
    assert_eq!(get(&format!("{}/api/scenarios", s.http), Some("wrong")).0, 401);

    // The same prompt twice: the second is served from the cache, and the window says so.
    let prompt: Vec<u32> = (0..1024).map(|t| 500 + t).collect();
    for _ in 0..2 {
        let (status, v) = post(
            &format!("{}/v1/completions", s.http),
            Some(ADMIN),
            &json!({"model": MODEL, "prompt": prompt, "max_tokens": 4}),
        );
        assert_eq!(status, 200, "{v}");
    }
    let mut sample = Value::Null;
    eventually(10, "a sample counts both requests", || {
        let (_, v) = get(&format!("{}/api/history", s.http), Some(ADMIN));
        sample = v["samples"].as_array().and_then(|a| a.last()).cloned().unwrap_or(Value::Null);
        sample["window"]["finished"] == 2
    });
    let w = &sample["window"];
    assert!(w["ttft_ms"]["p50"].as_f64().is_some_and(|t| t > 0.0), "{sample}");
    assert!(w["tpot_ms"]["p99"].as_f64().is_some_and(|t| t > 0.0), "{sample}");
    // 1024 - 16 of 2048 prompt tokens came from L1 (all but the block holding the last token).
    assert_eq!(w["cached_share"], json!((1024.0 - 16.0) / 2048.0), "{sample}");
    assert_eq!(w["cached_share_by_tier"][0], w["cached_share"]);
    // One engine served both: the same share for it alone.
    let engines = sample["engines"].as_object().expect("engines");
    assert_eq!(engines.len(), 1, "{sample}");
    assert_eq!(engines.values().next().map(|e| e["cached_share"].clone()), Some(w["cached_share"].clone()));
    assert_eq!(sample["pools"]["colocated"]["serving"], 1);
    assert_eq!(sample["load_p"], Value::Null, "a colocated fleet has no pool loads, so none are invented");
    // The two requests share their whole prompt: 64 blocks of 16 tokens.
    let (_, top) = get(&format!("{}/api/prefixes", s.http), Some(ADMIN));
    assert_eq!(
        (top["prefixes"][0]["tokens"].as_u64(), top["prefixes"][0]["requests"].as_u64()),
        (Some(1024), Some(2)),
        "{top}"
    );
    assert_eq!(get(&format!("{}/api/prefixes", s.http), None).0, 401);
    let since = sample["at_ms"].as_u64().expect("at_ms");
    let (_, newer) = get(&format!("{}/api/history?since_ms={since}", s.http), Some(ADMIN));
    assert!(newer["samples"].as_array().expect("samples").iter().all(|x| x["at_ms"].as_u64() > Some(since)));

    let (status, v) = get(&format!("{}/api/scenarios", s.http), Some(ADMIN));
    assert_eq!(status, 200);
    let names: Vec<&str> = v["scenarios"].as_array().expect("list").iter().filter_map(|x| x["name"].as_str()).collect();
    assert!(names.contains(&"synthetic-shared-prefix.toml"), "{names:?}");

    // A what-if names the routers to compare; a bad one is refused naming the valid ones.
    let url = format!("{}/api/simulations", s.http);
    let (status, v) =
        post(&url, Some(ADMIN), &json!({"scenario": SMALL_SCENARIO, "routers": ["round-robin", "no-such-router"]}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("scenario")), "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("cache-aware")), "{v}");
    let (status, v) =
        post(&url, Some(ADMIN), &json!({"scenario": SMALL_SCENARIO, "routers": ["round-robin", "cache-aware"]}));
    assert_eq!(status, 202, "{v}");
    let done = simulation_done(&s.http, v["id"].as_u64().expect("id"));
    let routers: Vec<&str> =
        done["result"]["runs"].as_array().expect("runs").iter().filter_map(|r| r["router"].as_str()).collect();
    assert_eq!(routers, ["round-robin", "cache-aware"]);
    // A run of a tuned policy: the router's parameters beside its name, its step budget a variant.
    let tuned = json!({"name": "cache-aware@b1024", "copy_weight": 2.5});
    let (status, v) = post(&url, Some(ADMIN), &json!({"scenario": SMALL_SCENARIO, "routers": ["cache-aware", tuned]}));
    assert_eq!(status, 202, "{v}");
    let done = simulation_done(&s.http, v["id"].as_u64().expect("id"));
    let routers: Vec<&str> =
        done["result"]["runs"].as_array().expect("runs").iter().filter_map(|r| r["router"].as_str()).collect();
    assert_eq!(routers, ["cache-aware", "cache-aware(copy_weight=2.5)@b1024"]);
    let bad = json!({"name": "cache-aware", "copy_weight": "heavy"});
    let (status, v) = post(&url, Some(ADMIN), &json!({"scenario": SMALL_SCENARIO, "routers": [bad]}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("scenario")), "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("`copy_weight` of `cache-aware`")), "{v}");
}

#[test]
fn an_operator_watches_the_fleet_changes_the_policy_and_tries_a_router_first() {
    let Some(b) = browser_or_skip("an_operator_watches_the_fleet_changes_the_policy_and_tries_a_router_first") else {
        return;
    };
    let db = Db::fresh("console");
    let s = serve(&db, &["--router", "cache-aware"]);
    let _e0 = engine(&s.grpc, "e0", &[]);
    let _e1 = engine(&s.grpc, "e1", &[]);
    wait_serving(&s.http, 2);
    let shots = screenshots();
    let traffic = Traffic::start(&s.http);

    // A wrong token is refused at the login page, with the reason.
    b.goto(&format!("{}/", s.http));
    b.type_into("#token", "not-the-admin-token");
    b.click("#login button[type=submit]");
    b.wait_text("#login-status", &["Refused", "does not know this token", "401"]);
    b.screenshot(&shots.join("login.png"));
    // So is a token the server knows but only for inference.
    let (status, v) =
        post(&format!("{}/api/tokens", s.http), Some(ADMIN), &json!({"name": "app", "role": "inference"}));
    assert_eq!(status, 201, "{v}");
    b.type_into("#token", v["token"].as_str().expect("token"));
    b.click("#login button[type=submit]");
    b.wait_text("#login-status", &["Refused", "not an admin token", "403"]);

    // The right one opens the fleet overview, where both engines appear.
    b.type_into("#token", ADMIN);
    b.click("#login button[type=submit]");
    b.wait_text("#serving-count", &["2"]);
    b.wait_text("[data-pool=colocated]", &["e0", "e1", "2 serving"]);
    b.wait_for("the page shows, without a reload, KV blocks the traffic cached and hits", |b| {
        assert_eq!(b.text("#router-in-force")?, "cache-aware");
        let busy = b.script(
            "return [...document.querySelectorAll('tr[data-instance] .kv')].some(k => !/; 0 cached/.test(k.title))
                && [...document.querySelectorAll('tr[data-instance] td.hit-rate')].some(td => /[1-9][0-9.]*%/.test(td.textContent))",
            json!([]),
        )?;
        Ok(busy.as_bool().filter(|&b| b))
    });
    b.screenshot(&shots.join("fleet.png"));

    // SLO & pools: latency percentiles of the gateway's requests are drawn; SLO load is
    // labelled as not measured rather than drawn. A quarter of a minute of traffic first, so
    // that the screenshots show lines rather than points.
    eventually(40, "15 samples with finished requests", || {
        let (_, v) = get(&format!("{}/api/history", s.http), Some(ADMIN));
        let samples = v["samples"].as_array().cloned().unwrap_or_default();
        samples.iter().filter(|x| x["window"]["finished"].as_u64() > Some(0)).count() >= 15
    });
    b.goto(&format!("{}/console/#/slo", s.http));
    b.wait_text("#page-slo", &["TTFT percentiles", "Load_P: not measured"]);
    // Flow control and latency by class and tenant: the traffic is standard, of tenant `default`.
    b.wait_text("#classes", &["Classes and tenants", "Flow control in force: none", "interactive", "batch"]);
    b.wait_text("#tenant-table", &["default"]);
    b.wait_for("the TTFT chart has a line", |b| {
        let js = "const f = [...document.querySelectorAll('figure')].find(f => f.textContent.startsWith('TTFT percentiles'));
                  return !!f && [...f.querySelectorAll('path')].some(p => p.getAttribute('d').includes('L'));";
        Ok(b.script(js, json!([]))?.as_bool().filter(|&b| b))
    });
    b.screenshot(&shots.join("slo.png"));

    // Cache: the shared prefix is served from the cache, and the index holds its blocks.
    b.goto(&format!("{}/console/#/cache", s.http));
    b.wait_for("a hit rate above zero", |b| {
        let t = b.text("#hit-rate")?;
        Ok(t.trim_end_matches('%').parse::<f64>().ok().filter(|&h| h > 0.0))
    });
    b.wait_for("index blocks counted", |b| Ok(b.text("#index-blocks")?.parse::<u64>().ok().filter(|&n| n > 0)));
    // The traffic's 512-token system prompt tops the shared prefixes.
    b.wait_text("#top-prefixes tbody tr:first-child", &["512"]);
    b.screenshot(&shots.join("cache.png"));
    drop(traffic);

    b.goto(&format!("{}/console/#/scaling", s.http));
    b.wait_text("#no-scaling-events", &["No scaling events yet"]);
    b.screenshot(&shots.join("scaling.png"));

    // Policies: an invalid field is refused inline, next to it; valid sets are put in force
    // (the router in the controller, the prefill scheduler on every engine) and versioned; a
    // rollback puts an old set back whole, as a new version.
    b.goto(&format!("{}/console/#/policies", s.http));
    b.wait_text("#policy-in-force", &["cache-aware"]);
    b.wait_text("#engines-in-force", &["e0: fcfs, no KV high-water mark", "e1: fcfs"]);
    b.type_into("#router", "no-such-router");
    b.click("#policy-form button[type=submit]");
    b.wait_text("#router-message", &["unknown router `no-such-router`", "round-robin"]);
    assert_eq!(router_in_force(&s.http), "cache-aware");
    b.type_into("#router", "power-of-two");
    b.set_value("#prefill-scheduler", "fair");
    b.set_value("#kv-high-water", "1.5");
    b.click("#policy-form button[type=submit]");
    b.wait_text("#kv_high_water-message", &["1.5 is not a share in (0, 1]"]);
    assert_eq!(b.text("#router-message").unwrap_or_default(), "", "only the field at fault has a message");
    assert_eq!(router_in_force(&s.http), "cache-aware");
    b.set_value("#kv-high-water", "0.9");
    b.set_value("#max-batch-tokens", "0");
    b.click("#policy-form button[type=submit]");
    b.wait_text("#max_batch_tokens-message", &["must be at least 1"]);
    b.set_value("#max-batch-tokens", "2048");
    b.click("#policy-form button[type=submit]");
    b.wait_text("#policy-message", &["Saved as version 1"]);
    b.wait_text("#policy-in-force", &["power-of-two"]);
    b.wait_text(
        "#engines-in-force",
        &["e0: fair, KV high-water 0.9 / low 0.72", "e1: fair, KV high-water 0.9", "step budget 2048"],
    );
    assert_eq!(router_in_force(&s.http), "power-of-two");
    let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
    let prefills: Vec<&str> = v["instances"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|i| i["scheduling"]["prefill_scheduler"].as_str())
        .collect();
    assert_eq!(prefills, ["fair", "fair"], "{v}");
    b.wait_text("#policy-history tbody tr:first-child", &["1", "power-of-two", "fair", "0.9", "admin"]);
    b.type_into("#router", "least-outstanding");
    b.set_value("#prefill-scheduler", "fcfs");
    b.set_value("#kv-high-water", "");
    b.set_value("#max-batch-tokens", "");
    b.click("#policy-form button[type=submit]");
    b.wait_text("#policy-message", &["Saved as version 2"]);
    b.wait_text("#policy-in-force", &["least-outstanding"]);
    b.wait_text("#engines-in-force", &["e0: fcfs, no KV high-water mark", "e1: fcfs, no KV high-water mark"]);
    assert_eq!(router_in_force(&s.http), "least-outstanding");
    b.click("tr[data-version='1'] button.rollback");
    b.wait_text("#policy-history tbody tr:first-child", &["3", "power-of-two", "fair", "admin"]);
    b.wait_text("#policy-in-force", &["power-of-two"]);
    b.wait_text("#engines-in-force", &["e0: fair, KV high-water 0.9", "e1: fair, KV high-water 0.9"]);
    assert_eq!(router_in_force(&s.http), "power-of-two");
    let (_, history) = get(&format!("{}/api/policies/history", s.http), Some(ADMIN));
    assert_eq!(history["versions"].as_array().map(Vec::len), Some(3), "{history}");
    assert_eq!(
        history["versions"][0]["policy"], history["versions"][2]["policy"],
        "the rollback restores the whole set"
    );
    // SLO targets: refused inline when not positive, stored when they are.
    b.type_into("#ttft-ms", "-5");
    b.click("#slo-form button[type=submit]");
    b.wait_text("#slo-message", &["ttft_ms must be a positive number"]);
    b.type_into("#ttft-ms", "1500");
    b.click("#slo-form button[type=submit]");
    b.wait_text("#slo-message", &["Saved: TTFT ≤ 1500 ms"]);
    assert_eq!(get(&format!("{}/api/slo", s.http), Some(ADMIN)).1["ttft_ms"], 1500.0);
    b.screenshot(&shots.join("policies.png"));

    // What-if: the examples are offered; a small scenario compares the router in force with
    // the edited one, and "apply" puts the edited one in force on the live fleet.
    b.goto(&format!("{}/console/#/whatif", s.http));
    b.wait_text("#scenario-pick", &["synthetic-shared-prefix.toml"]);
    b.set_value("#scenario-pick", "synthetic-shared-prefix.toml");
    b.wait_for("the example's text is loaded", |b| {
        Ok(b.script("return document.querySelector('#scenario-text').value", json!([]))?
            .as_str()
            .filter(|t| t.contains("[workload.synthetic]"))
            .map(str::to_string))
    });
    b.set_value("#scenario-text", SMALL_SCENARIO);
    b.wait_for("the router in force is shown", |b| {
        Ok(b.script("return document.querySelector('#current-router').value", json!([]))?
            .as_str()
            .filter(|v| *v == "power-of-two")
            .map(str::to_string))
    });
    b.type_into("#edited-router", "cache-aware");
    b.click("#run-whatif");
    b.wait_text("#whatif-state", &["done"]);
    // The edited scheduling (FCFS, no high-water mark, the engines' own step budget: version
    // 2's) runs against the one in force (fair, high-water 0.9, step budget 2,048, from the
    // rollback).
    b.wait_text(
        "#whatif-result",
        &["in force: power-of-two@fair+hw+b2048", "edited: cache-aware@fcfs+nohw", "TTFT p99", "GPU-hours"],
    );
    b.wait_for("the CDF chart is shown", |b| {
        Ok(b.script(
            "const i = document.querySelector('img.cdf'); return !!i && i.complete && i.naturalWidth > 0",
            json!([]),
        )?
        .as_bool()
        .filter(|&b| b))
    });
    b.screenshot(&shots.join("whatif.png"));
    b.click("#apply-edited");
    b.wait_text("#apply-message", &["Applied", "cache-aware"]);
    assert_eq!(router_in_force(&s.http), "cache-aware");
    let (_, v) = get(&format!("{}/api/policies", s.http), Some(ADMIN));
    assert_eq!(v["policy"]["prefill_scheduler"], "fcfs", "the edited scheduling is applied with the router: {v}");
    assert_eq!(v["policy"]["max_batch_tokens"], json!(null), "and its step budget (the engines' own): {v}");

    // Simulation runs: a second run, then the two compared side by side.
    let (status, v) = post(
        &format!("{}/api/simulations", s.http),
        Some(ADMIN),
        &json!({"scenario": SMALL_SCENARIO, "routers": ["least-outstanding"]}),
    );
    assert_eq!(status, 202, "{v}");
    simulation_done(&s.http, v["id"].as_u64().expect("id"));
    b.goto(&format!("{}/console/#/runs", s.http));
    b.wait_for("two runs can be ticked", |b| {
        let n = b.script("return document.querySelectorAll('input.pick:not([disabled])').length", json!([]))?;
        Ok(n.as_u64().filter(|&n| n >= 2))
    });
    b.click("input.pick[data-id='1']");
    b.click("input.pick[data-id='2']");
    b.click("#compare-selected");
    b.wait_text("#comparison", &["#1 power-of-two", "#1 cache-aware", "#2 least-outstanding", "SLO attainment"]);
    b.screenshot(&shots.join("runs.png"));

    // A token revoked while the console uses it: the next poll is refused and the operator
    // is back at the login page, told why.
    let (status, v) = post(&format!("{}/api/tokens", s.http), Some(ADMIN), &json!({"name": "ops", "role": "admin"}));
    assert_eq!(status, 201, "{v}");
    b.click("#logout");
    b.type_into("#token", v["token"].as_str().expect("token"));
    b.click("#login button[type=submit]");
    // Back on the page the operator left, which polls the API.
    b.wait_text("#runs", &["done", "admin"]);
    let (status, _) = send(reqwest::Method::DELETE, &format!("{}/api/tokens/ops", s.http), Some(ADMIN), &json!({}));
    assert_eq!(status, 204);
    b.wait_text("#login-status", &["Your token was refused", "401"]);

    assert_eq!(b.script_errors(), Vec::<String>::new(), "the console's scripts failed");
}

/// A policy file as `fleetplane tune` writes it (`PolicyFile::to_toml`).
const TUNED_POLICY: &str = r#"router = "cache-aware"
prefill_scheduler = "fair"

[router_params]
copy_weight = 2.0

[prefill_params]
chunk_tokens = 4096.0
"#;

#[test]
fn an_operator_applies_a_tuned_policy_file() {
    let Some(b) = browser_or_skip("an_operator_applies_a_tuned_policy_file") else {
        return;
    };
    let db = Db::fresh("console_tuned");
    let s = serve(&db, &["--router", "round-robin"]);
    let _e0 = engine(&s.grpc, "e0", &[]);
    wait_serving(&s.http, 1);
    let dir = std::env::temp_dir().join(format!("fp-console-tuned-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (tuned, bad) = (dir.join("tuned.toml"), dir.join("bad.toml"));
    std::fs::write(&tuned, TUNED_POLICY).expect("write");
    std::fs::write(&bad, TUNED_POLICY.replace("copy_weight = 2.0", "copy_weight = 99.0")).expect("write");

    b.goto(&format!("{}/", s.http));
    b.type_into("#token", ADMIN);
    b.click("#login button[type=submit]");
    b.wait_text("#serving-count", &["1"]);
    b.goto(&format!("{}/console/#/policies", s.http));
    b.wait_text("#policy-in-force", &["round-robin"]);
    let loaded = |b: &Browser, part: &'static str| {
        b.wait_for("the file's text is loaded", |b| {
            Ok(b.script("return document.querySelector('#tuned-text').value", json!([]))?
                .as_str()
                .filter(|t| t.contains(part))
                .map(str::to_string))
        })
    };

    // A parameter out of its range: refused, naming it and its range; nothing changes.
    b.choose_file("#tuned-file", &bad);
    loaded(&b, "99.0");
    b.click("#tuned-form button[type=submit]");
    b.wait_text("#tuned-message", &["Not applied", "router_params.copy_weight", "outside its range [0, 64]"]);
    assert_eq!(router_in_force(&s.http), "round-robin");

    // The tuned file: the new version shows with its parameters, in force in the controller
    // and on the engine.
    b.choose_file("#tuned-file", &tuned);
    loaded(&b, "copy_weight = 2.0");
    b.click("#tuned-form button[type=submit]");
    b.wait_text("#tuned-message", &["Applied as version 1", "cache-aware(copy_weight=2)", "chunk_tokens=4096"]);
    b.wait_text("#policy-in-force", &["cache-aware(copy_weight=2)"]);
    b.wait_text("#policy-params", &["router_params: copy_weight=2", "prefill_params: chunk_tokens=4096"]);
    b.wait_text("#engines-in-force", &["e0: fair", "chunk_tokens=4096"]);
    b.wait_text(
        "#policy-history tbody tr:first-child",
        &["1", "cache-aware(copy_weight=2)", "fair (chunk_tokens=4096)"],
    );
    let edited = b.script("return document.querySelector('#router-params').value", json!([])).expect("script");
    assert_eq!(edited, "copy_weight=2", "the editor holds the version's parameters");
    b.screenshot(&screenshots().join("policies-tuned.png"));

    // Pasted JSON works too; and the editor's parameters are checked like the file's.
    b.set_value("#tuned-text", r#"{"router": "dynamo-kv", "router_params": {"overlap_score_weight": 1.5}}"#);
    b.click("#tuned-form button[type=submit]");
    b.wait_text("#tuned-message", &["Applied as version 2", "dynamo-kv(overlap_score_weight=1.5)"]);
    b.wait_text("#policy-in-force", &["dynamo-kv(overlap_score_weight=1.5)"]);
    b.wait_for("the editor holds version 2", |b| {
        let v = b.script("return document.querySelector('#router-params').value", json!([]))?;
        Ok((v == "overlap_score_weight=1.5").then_some(()))
    });
    b.type_into("#router-params", "overlap_score_weight=99");
    b.click("#policy-form button[type=submit]");
    b.wait_text("#router_params-message", &["router_params.overlap_score_weight", "outside its range [0, 16]"]);
    assert_eq!(get(&format!("{}/api/policies", s.http), Some(ADMIN)).1["version"], 2);
    b.goto(&format!("{}/console/#/fleet", s.http));
    b.wait_text("#router-in-force", &["dynamo-kv(overlap_score_weight=1.5)"]);
    assert_eq!(b.script_errors(), Vec::<String>::new());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_operator_sees_the_pd_pools_loads_and_the_scaling_events_with_their_causes() {
    let Some(b) = browser_or_skip("an_operator_sees_the_pd_pools_loads_and_the_scaling_events_with_their_causes")
    else {
        return;
    };
    let db = Db::fresh("console_pd");
    let flags = ["--mode", "pd", "--actuator", "local", "--autoscaler", "slo-load", "--gpu-budget", "4"];
    let s = serve(&db, &flags);
    // The leader fills the empty pools: two scaling events, each with its loads.
    wait_serving(&s.http, 2);
    let traffic = Traffic::start(&s.http);
    eventually(20, "samples with Load_P and Load_D", || {
        let (_, v) = get(&format!("{}/api/history", s.http), Some(ADMIN));
        let samples = v["samples"].as_array().cloned().unwrap_or_default();
        samples.iter().filter(|x| x["load_p"].is_number() && x["load_d"].as_f64() > Some(0.0)).count() >= 3
    });
    b.goto(&format!("{}/", s.http));
    b.type_into("#token", ADMIN);
    b.click("#login button[type=submit]");
    b.wait_text("[data-pool=prefill]", &["1 serving"]);
    b.goto(&format!("{}/console/#/slo", s.http));
    b.wait_text("#page-slo", &["SLO load", "Load_P", "Load_D", "prefill starting"]);
    b.wait_for("the SLO load chart draws a line", |b| {
        let js = "const f = [...document.querySelectorAll('figure')].find(f => f.textContent.startsWith('SLO load'));
                  return !!f && !f.textContent.includes('not measured') && [...f.querySelectorAll('path')].some(p => p.getAttribute('d').includes('L'));";
        Ok(b.script(js, json!([]))?.as_bool().filter(|&b| b))
    });
    b.screenshot(&screenshots().join("slo-pd.png"));
    b.goto(&format!("{}/console/#/scaling", s.http));
    b.wait_text(".timeline", &["0 → 1 engines: pool below its minimum (autoscaler slo-load)", "Load_P", "Load_D"]);
    b.screenshot(&screenshots().join("scaling-pd.png"));
    drop(traffic);
    assert_eq!(b.script_errors(), Vec::<String>::new());
}
