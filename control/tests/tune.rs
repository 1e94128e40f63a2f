//! `fleetplane tune` and policy files as a user runs them: real process, real files.

use std::path::Path;
use std::process::{Command, Output};
use tests::{mooncake, stderr, stdout};

fn fleetplane(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fleetplane")).args(args).output().expect("fleetplane runs")
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("written")).expect("JSON")
}

/// Runs and expects a bad-input failure (exit 2) whose message contains every `needle`.
fn fails_with(args: &[&str], needles: &[&str]) {
    tests::assert_input_error(&fleetplane(args), needles);
}

/// `name`, then `base`, then `extra`.
fn command<'a>(name: &'a str, base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    [&[name][..], base, extra].concat()
}

/// A small, busy fleet: 400 Mooncake requests on 2 instances at twice the trace's rate.
const FLEET: [&str; 6] = ["--instances", "2", "--max-requests", "400", "--rate-scale", "2"];

#[test]
fn tune_searches_on_one_slice_judges_on_the_rest_and_writes_a_policy_that_simulate_runs() {
    let dir = tests::scratch_dir("tune");
    let (report, policy, plot) = (dir.join("tune.json"), dir.join("tuned.toml"), dir.join("search.svg"));
    let o = fleetplane(
        &[
            &["tune", "--trace", &mooncake()][..],
            &FLEET,
            &["--router", "cache-aware", "--params", "copy_weight,hot_slack", "--range", "hot_slack=0:64"],
            &["--objective", "goodput", "--trials", "8", "--population", "4", "--train-share", "0.6"],
            &["--json", report.to_str().unwrap(), "--out", policy.to_str().unwrap(), "--plot", plot.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("tuning copy_weight, hot_slack on requests 0..240"), "{out}");
    assert!(out.contains("held-out slice"), "{out}");
    let r = json(&report);
    assert_eq!(r["train"]["requests"], 240);
    assert_eq!((r["held_out"]["skip_requests"].as_u64(), r["held_out"]["requests"].as_u64()), (Some(240), Some(160)));
    assert_eq!(r["space"][1]["hi"], 64.0, "--range replaces hot_slack's range");
    let trials = r["trials"].as_array().expect("trials");
    assert!(!trials.is_empty() && trials.len() <= 8, "two generations of four at most: {}", trials.len());
    let default = policies::RouterConfig::all().iter().find(|r| r.name() == "cache-aware").map(|r| r.values());
    let default = default.and_then(|v| v.get("copy_weight").copied()).expect("cache-aware's copy weight");
    for t in trials {
        let w = t["params"]["copy_weight"].as_f64().expect("copy_weight");
        assert!((default / 4.0..=default * 4.0).contains(&w), "a quarter to four times the default {default}: {t}");
    }
    // Tuned, untuned and every other router, on the held-out slice.
    let runs: Vec<&str> =
        r["held_out_runs"].as_array().expect("runs").iter().map(|r| r["policy"].as_str().unwrap_or("")).collect();
    assert_eq!(runs[..2], ["tuned", "untuned"]);
    assert_eq!(runs.len(), 2 + 6, "six other routers");
    assert!(r["improved_on_held_out"].is_boolean());
    assert!(std::fs::read_to_string(&plot).expect("plot").contains("best so far"));

    // The policy file runs as it was judged: simulate on the held-out slice gives the same
    // goodput the report gives for the tuned policy.
    let text = std::fs::read_to_string(&policy).expect("policy file");
    assert!(text.contains("router = \"cache-aware\""), "{text}");
    let sim_json = dir.join("sim.json");
    let o = fleetplane(
        &[
            &["simulate", "--trace", &mooncake(), "--instances", "2", "--rate-scale", "2"][..],
            &["--skip-requests", "240", "--max-requests", "160", "--policy", policy.to_str().unwrap()],
            &["--json", sim_json.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let sim = json(&sim_json);
    assert_eq!(sim["runs"][0]["router"], r["held_out_runs"][0]["label"]);
    assert_eq!(sim["runs"][0]["summary"]["goodput_rps"], r["held_out_runs"][0]["value"]);
}

/// Every trial of a goodput search runs at the scenario's rate, as the untuned policy did: a
/// trial at the untuned policy's point scores what it scored (max-rate's searches start at
/// the untuned policy's answer; no other objective moves the rate).
#[test]
fn a_goodput_trial_at_the_untuned_point_scores_as_the_untuned_policy() {
    let dir = tests::scratch_dir("tune-goodput");
    let report = dir.join("tune.json");
    let o = fleetplane(
        &[
            &["tune", "--trace", &mooncake()][..],
            &FLEET,
            &["--router", "least-outstanding", "--params", "prefill.chunk_tokens"],
            &["--range", "prefill.chunk_tokens=8192:8193", "--objective", "goodput"],
            &["--trials", "8", "--population", "4", "--json", report.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let r = json(&report);
    let untuned = &r["untuned"];
    assert_eq!(untuned["params"]["prefill.chunk_tokens"], 8192.0);
    let at_start: Vec<&serde_json::Value> = r["trials"]
        .as_array()
        .expect("trials")
        .iter()
        .filter(|t| t["params"]["prefill.chunk_tokens"] == 8192.0)
        .collect();
    assert!(!at_start.is_empty(), "CMA-ES from the range's bottom clamps some points onto it: {}", r["trials"]);
    for t in at_start {
        assert_eq!(t["value"], untuned["value"], "{t}");
    }
}

/// Trials run side by side; the search, its trials and its report are the same on one thread
/// and on several.
#[test]
fn tune_gives_the_same_report_on_one_thread_and_on_many() {
    let dir = tests::scratch_dir("tune-threads");
    let run = |threads: &str| {
        let report = dir.join(format!("tune-{threads}.json"));
        let o = Command::new(env!("CARGO_BIN_EXE_fleetplane"))
            .env("RAYON_NUM_THREADS", threads)
            .args(["tune", "--trace", &mooncake(), "--instances", "2", "--max-requests", "200"])
            .args(["--router", "dynamo-kv", "--trials", "8", "--population", "4"])
            .args(["--json", report.to_str().unwrap()])
            .output()
            .expect("fleetplane runs");
        assert!(o.status.success(), "{}", stderr(&o));
        std::fs::read_to_string(&report).expect("report")
    };
    let one = run("1");
    assert!(one.contains("\"objective\": \"max-rate\""), "{one}");
    assert_eq!(one, run("4"));
}

#[test]
fn tune_lists_every_parameter_with_its_range_and_default() {
    let dir = tests::scratch_dir("tune-list");
    let listing = dir.join("params.json");
    let o = fleetplane(&["tune", "--list-params", "--json", listing.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in
        ["router cache-aware", "copy_weight", "prefill-scheduler fair", "autoscaler slo-load", "kv_high_water"]
    {
        assert!(out.contains(needle), "lacks {needle}: {out}");
    }
    let v = json(&listing);
    let routers = v["policies"].as_array().expect("policies").iter().filter(|p| p["role"] == "router").count();
    assert_eq!(routers, 7);
}

#[test]
fn tune_and_policy_files_name_what_is_wrong() {
    let trace = mooncake();
    let base = ["--trace", trace.as_str(), "--max-requests", "50"];
    let tune = |extra: &[&'static str]| command("tune", &base, extra);
    fails_with(
        &tune(&["--router", "dynamo-kv", "--params", "magic"]),
        &["unknown parameter `magic`", "overlap_score_weight"],
    );
    fails_with(&tune(&["--router", "dynamo-kv", "--range", "overlap_score_weight=3:1"]), &["3:1 is empty"]);
    fails_with(&tune(&["--router", "round-robin,dynamo-kv"]), &["tune takes one router", "got 2"]);
    fails_with(&tune(&["--router", "dynamo-kv", "--train-share", "1"]), &["--train-share must be in (0, 1)"]);
    fails_with(&tune(&["--router", "dynamo-kv@l1+l2"]), &["`dynamo-kv@l1+l2` changes the fleet"]);
    fails_with(
        &tune(&["--router", "dynamo-kv", "--params", "flow.batch_headroom"]),
        &["unknown parameter `flow.batch_headroom`"],
    );

    let dir = tests::scratch_dir("policy-files");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "router = \"cache-aware\"\nrouter_params = { copy_weight = 99.0 }\n").expect("write");
    fails_with(
        &command("simulate", &base, &["--policy", bad.to_str().unwrap()]),
        &["router_params.copy_weight", "outside its range [0, 64]"],
    );
    fails_with(
        &command("simulate", &base, &["--policy", dir.join("missing.toml").to_str().unwrap()]),
        &["missing.toml"],
    );
    let good = dir.join("good.toml");
    std::fs::write(&good, "router = \"dynamo-kv\"\nrouter_params = { overlap_score_weight = 2.0 }\n").expect("write");
    fails_with(
        &command("simulate", &base, &["--policy", good.to_str().unwrap(), "--router", "llm-d"]),
        &["cannot be used with"],
    );

    // A good one runs in max-rate too, under its label.
    let o = fleetplane(&[&["max-rate"][..], &base, &["--policy", good.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("dynamo-kv(overlap_score_weight=2)"), "{}", stdout(&o));
}

/// A closed loop (agent sessions) cannot be split by requests: it is tuned on its sessions as
/// drawn with the scenario's seed and judged on those of the next seed.
#[test]
fn tune_judges_closed_loop_sessions_on_another_draw_of_them() {
    let dir = tests::scratch_dir("tune-sessions");
    let scenario = dir.join("sessions.toml");
    std::fs::write(
        &scenario,
        r#"seed = 3
routers = ["cache-aware"]
[fleet]
instances = 2
[workload.agentic]
sessions = 40
arrival = { kind = "poisson", rate_rps = 2.0 }
turns = { kind = "uniform", min = 2, max = 4 }
task = { kind = "lognormal", median = 2000, sigma = 0.5, min = 64, max = 8000 }
output = { kind = "lognormal", median = 100, sigma = 0.5, min = 8, max = 1000 }
tool_output = { kind = "lognormal", median = 500, sigma = 0.5, min = 16, max = 4000 }
tool_ms = { kind = "lognormal", median = 500, sigma = 0.5, min = 50, max = 5000 }
[flow]
rules = [{ name = "slo", program_kv_share = 0.9 }]
"#,
    )
    .expect("write");
    let report = dir.join("report.json");
    let o = fleetplane(&[
        "tune",
        "--scenario",
        scenario.to_str().unwrap(),
        "--params",
        "flow.program_kv_share",
        "--objective",
        "goodput",
        "--trials",
        "8",
        "--json",
        report.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("on the sessions of seed 3"), "{}", stdout(&o));
    let v = json(&report);
    assert_eq!((v["train"]["seed"].as_u64(), v["held_out"]["seed"].as_u64()), (Some(3), Some(4)));
    assert!(v["held_out_runs"][0]["value"].as_f64().is_some_and(|g| g > 0.0), "{v}");
    // Every turn ran, not only the sessions' first ones.
    let requests = v["held_out_runs"][0]["summary"]["requests"].as_u64().unwrap_or(0);
    assert!(requests > 40, "{requests} requests for 40 sessions of 2 to 4 turns");
}
