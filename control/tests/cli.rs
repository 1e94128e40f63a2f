//! The `fleetplane` binary as a user runs it: real process, real files, exit codes.

use std::path::Path;
use std::process::{Command, Output};
use tests::{mooncake, stderr, stdout};

fn fleetplane(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fleetplane")).args(args).output().expect("fleetplane runs")
}

/// Runs and expects a bad-input failure (exit 2) whose message contains every `needle`.
fn fails_with(args: &[&str], needles: &[&str]) {
    tests::assert_input_error(&fleetplane(args), needles);
}

#[test]
fn simulate_compares_two_routers_side_by_side_and_writes_json_and_a_plot() {
    let dir = tests::scratch_dir("simulate");
    let json = dir.join("out.json");
    let svg = dir.join("cdf.svg");
    let o = fleetplane(&[
        "simulate",
        "--trace",
        &mooncake(),
        "--instances",
        "4",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "h100",
        "--router",
        "round-robin,least-outstanding",
        "--max-requests",
        "600",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.starts_with("seed=42"), "the seed is printed first: {out}");
    assert!(out.contains("round-robin") && out.contains("least-outstanding"), "{out}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["router"], "round-robin");
    for key in ["requests", "ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "slo_attainment", "goodput_rps"] {
        assert!(runs[1]["summary"].get(key).is_some(), "summary lacks {key}");
    }
    assert_eq!(runs[0]["summary"]["requests"], 600);
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
}

#[test]
fn a_scenario_file_gives_the_settings_and_flags_override_it() {
    let dir = tests::scratch_dir("scenario");
    let scenario = dir.join("s.toml");
    std::fs::write(
        &scenario,
        format!(
            "seed = 9\nrouters = [\"power-of-two\"]\n[fleet]\ninstances = 2\n[workload]\ntrace = \"{}\"\nmax_requests = 300\n",
            mooncake()
        ),
    )
    .unwrap();
    let o = fleetplane(&["simulate", "--scenario", scenario.to_str().unwrap(), "--seed", "11"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.starts_with("seed=11 | 2 x llama-3.1-8b"), "{out}");
    assert!(out.contains("power-of-two"), "{out}");
}

#[test]
fn the_shipped_examples_are_valid_scenarios() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let o = fleetplane(&["simulate", "--scenario", path.to_str().unwrap(), "--max-requests", "200"]);
        assert!(o.status.success(), "{}: {}", path.display(), stderr(&o));
    }
}

#[test]
fn max_rate_finds_a_scale_per_router_and_writes_json() {
    let dir = tests::scratch_dir("max-rate");
    let json = dir.join("max.json");
    let o = fleetplane(&[
        "max-rate",
        "--trace",
        &mooncake(),
        "--instances",
        "8",
        "--router",
        "least-outstanding,round-robin",
        "--max-requests",
        "300",
        "--target-attainment",
        "0.9",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for run in v["runs"].as_array().unwrap() {
        let scale = run["max_rate_scale"].as_f64().unwrap();
        assert!(scale > 0.0, "{run}");
        assert!(run["summary"]["slo_attainment"].as_f64().unwrap() >= 0.9, "{run}");
    }
}

/// `--precision` narrows the same bisection further: the finer answer lies in the bracket the
/// default 1% stopped at; a precision out of range is refused, naming the flag.
#[test]
fn a_finer_max_rate_precision_narrows_the_same_bracket() {
    let dir = tests::scratch_dir("max-rate-precision");
    let scale = |precision: &str| {
        let json = dir.join(format!("max-{precision}.json"));
        let o = fleetplane(&[
            "max-rate",
            "--trace",
            &mooncake(),
            "--instances",
            "4",
            "--router",
            "least-outstanding",
            "--max-requests",
            "300",
            "--precision",
            precision,
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        v["runs"][0]["max_rate_scale"].as_f64().unwrap()
    };
    let (coarse, fine) = (scale("0.01"), scale("0.001"));
    assert!(coarse > 0.0 && coarse <= fine && fine <= coarse * 1.01, "{coarse} then {fine}");
    let o = fleetplane(&["max-rate", "--trace", &mooncake(), "--precision", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--precision must be in"), "{}", stderr(&o));
}

/// The search evaluates several rates at once on many threads; only the runs the sequential
/// search makes decide, so one thread and seven give the same file, byte for byte (a bracket
/// found by halving from a rate too high, then bisection levels run as trees of 1 and 7).
#[test]
fn max_rate_gives_the_same_result_on_one_thread_and_on_many() {
    let dir = tests::scratch_dir("max-rate-threads");
    let run = |threads: &str| {
        let json = dir.join(format!("max-{threads}.json"));
        let o = Command::new(env!("CARGO_BIN_EXE_fleetplane"))
            .env("RAYON_NUM_THREADS", threads)
            .args(["max-rate", "--trace", &mooncake(), "--instances", "4", "--router", "least-outstanding,round-robin"])
            .args(["--max-requests", "300", "--rate-scale", "40", "--json", json.to_str().unwrap()])
            .output()
            .expect("fleetplane runs");
        assert!(o.status.success(), "{}", stderr(&o));
        std::fs::read_to_string(&json).unwrap()
    };
    let one = run("1");
    assert!(one.contains("max_rate_scale"), "{one}");
    assert_eq!(one, run("14"), "7 runs at once per search");
}

#[test]
fn a_malformed_trace_line_is_named_with_file_and_line() {
    let dir = tests::scratch_dir("bad-trace");
    let trace = dir.join("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 100, \"output_length\": 5, \"hash_ids\": [1]}\n{\"timestamp\": 10, \"output_length\": 5, \"hash_ids\": [2]}\n",
    )
    .unwrap();
    fails_with(&["simulate", "--trace", trace.to_str().unwrap()], &["bad.jsonl", "line 2", "input_length"]);
    // Commands that read the trace once for all their runs say the same.
    let two = ["--trace", trace.to_str().unwrap(), "--router", "least-outstanding,round-robin"];
    fails_with(&[&["simulate"][..], &two].concat(), &["bad.jsonl", "line 2", "input_length"]);
    fails_with(&[&["max-rate"][..], &two].concat(), &["bad.jsonl", "line 2", "input_length"]);
    // A run that stops before the bad line does not meet it.
    let first = fleetplane(&[&["simulate", "--max-requests", "1"][..], &two].concat());
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
}

#[test]
fn unknown_names_list_the_valid_ones() {
    let t = mooncake();
    fails_with(&["simulate", "--trace", &t, "--model", "gpt-5"], &["gpt-5", "llama-3.1-8b", "deepseek-v3"]);
    fails_with(&["simulate", "--trace", &t, "--gpu", "tpu"], &["tpu", "h100", "b200"]);
    fails_with(&["simulate", "--trace", &t, "--router", "fastest"], &["fastest", "round-robin", "power-of-two"]);
    fails_with(&["simulate", "--trace", &t, "--format", "parquet"], &["parquet", "mooncake", "azure"]);
    fails_with(&["simulate", "--trace", &t, "--spec", "medusa"], &["medusa", "none, eagle3, dflash, dspark"]);
}

#[test]
fn spec_sets_the_drafter_of_runs_without_their_own_and_the_json_names_it() {
    let dir = tests::scratch_dir("spec");
    let json = dir.join("spec.json");
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/spec-decoding.toml");
    let o = fleetplane(&[
        "simulate",
        "--scenario",
        example.to_str().unwrap(),
        "--router",
        "least-outstanding,least-outstanding@nospec,least-outstanding@eagle3",
        "--spec",
        "dspark",
        "--max-requests",
        "200",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("drafter dspark"), "{}", stdout(&o));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let runs = v["runs"].as_array().unwrap();
    let drafters: Vec<&serde_json::Value> = runs.iter().map(|r| &r["summary"]["speculation"]["drafter"]).collect();
    assert_eq!(drafters, [&serde_json::json!("dspark"), &serde_json::Value::Null, &serde_json::json!("eagle3")]);
    let accepted = runs[0]["summary"]["speculation"]["accepted_per_step"].as_f64().unwrap();
    assert!(accepted > 1.0 && accepted <= 5.0, "dspark verifies 5 drafts and accepts about 2.3: {accepted}");
}

#[test]
fn an_invalid_scenario_key_is_named() {
    let dir = tests::scratch_dir("bad-scenario");
    let scenario = dir.join("s.toml");
    std::fs::write(&scenario, "[fleet]\ninstances = 2\nreplicas = 3\n").unwrap();
    fails_with(&["simulate", "--scenario", scenario.to_str().unwrap()], &["s.toml", "replicas"]);
}

#[test]
fn bad_numbers_and_missing_files_are_input_errors() {
    let t = mooncake();
    fails_with(&["simulate", "--trace", &t, "--rate-scale", "0"], &["rate_scale"]);
    fails_with(&["simulate", "--trace", &t, "--instances", "0"], &["instances"]);
    fails_with(&["simulate", "--trace", "/nonexistent/trace.jsonl"], &["/nonexistent/trace.jsonl"]);
    fails_with(&["simulate"], &["trace"]);
    fails_with(&["simulate", "--trace", &t, "--model", "llama-3.1-70b", "--gpu", "a100"], &["llama-3.1-70b"]);
}

#[test]
fn capacity_prints_kv_per_gpu_and_node_for_a_layout_and_writes_json() {
    let dir = tests::scratch_dir("capacity");
    let json = dir.join("capacity.json");
    let mla = |layout: &[&str], json: &Path| -> serde_json::Value {
        let mut args = vec!["capacity", "--model", "deepseek-v3", "--gpu", "h200", "--gpus", "8"];
        args.extend_from_slice(layout);
        args.extend_from_slice(&["--json", json.to_str().unwrap()]);
        let o = fleetplane(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = stdout(&o);
        assert!(out.contains("KV capacity per node, tokens") && out.contains("decode step, batch 1"), "{out}");
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
    };
    // The numbers worked out by hand in cost/src/roofline.rs's tests.
    let tp8 = mla(&["--tp", "8"], &json);
    assert_eq!(tp8["kv_capacity_tokens_per_node"], 581_704);
    assert_eq!(tp8["kv_capacity_tokens_per_gpu"], 581_704 / 8);
    let dp8 = mla(&["--dp-attention", "8", "--ep", "8"], &json);
    assert_eq!(dp8["kv_capacity_tokens_per_node"], 8 * 428_049);
    assert_eq!(dp8["kv_capacity_tokens_per_gpu"], 428_049);
    // 428_049 tokens per rank hold 13 requests of 32K: 104 on the node.
    assert_eq!(dp8["largest_batch"], 104);
    assert!(dp8["decode_step_ms_largest_batch"].as_f64().unwrap() > 0.0);
    // Two TP 4 instances per node: the node holds twice one instance.
    let small = fleetplane(&[
        "capacity",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "h100",
        "--tp",
        "4",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(small.status.success(), "{}", stderr(&small));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["instances_per_node"], 2);
    assert_eq!(v["kv_capacity_tokens_per_node"], 2 * v["kv_capacity_tokens_per_instance"].as_u64().unwrap());

    fails_with(&["capacity", "--model", "gpt-5", "--gpu", "h200"], &["unknown model `gpt-5`", "deepseek-v3"]);
    fails_with(
        &["capacity", "--model", "deepseek-v3", "--gpu", "h200", "--tp", "8", "--dp-attention", "8"],
        &["dp_attention", "64 GPUs"],
    );
    fails_with(
        &["capacity", "--model", "llama-3.1-8b", "--gpu", "h100", "--ep", "2", "--tp", "2"],
        &["ep = 2", "dense"],
    );
    fails_with(&["capacity", "--model", "deepseek-v3", "--gpu", "h200", "--tp", "1"], &["does not fit", "tp 1"]);
}

#[test]
fn simulate_describes_an_attention_dp_layout_and_runs_it() {
    let o = fleetplane(&[
        "simulate",
        "--trace",
        &mooncake(),
        "--instances",
        "1",
        "--model",
        "deepseek-v3",
        "--gpu",
        "h200",
        "--dp-attention",
        "8",
        "--ep",
        "8",
        "--max-requests",
        "50",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("(TP 1 x DP-attention 8, EP 8: 8 GPUs), KV 3424392 tokens per instance"), "{out}");
}

#[test]
fn kv_high_water_knobs_are_checked_and_runs_switch_protection_by_name() {
    let t = mooncake();
    fails_with(&["simulate", "--trace", &t, "--kv-high-water", "1.5"], &["kv_high_water", "1.5", "(0, 1]"]);
    fails_with(
        &["simulate", "--trace", &t, "--kv-high-water", "0.8", "--kv-low-water", "0.9"],
        &["kv_low_water", "0.9", "kv_high_water = 0.8"],
    );
    fails_with(&["simulate", "--trace", &t, "--runaway-output-tokens", "0"], &["runaway_output_tokens"]);
    fails_with(&["simulate", "--trace", &t, "--router", "least-outstanding@hv"], &["`hv`", "hw", "nohw", "fair", "l1"]);
    let dir = tests::scratch_dir("runaway-action");
    let scenario = dir.join("s.toml");
    std::fs::write(&scenario, format!("[workload]\ntrace = \"{t}\"\n[scheduler]\nrunaway_action = \"drop\"\n"))
        .unwrap();
    fails_with(&["simulate", "--scenario", scenario.to_str().unwrap()], &["runaway_action", "drop", "reroute, end"]);

    let json = dir.join("out.json");
    let o = fleetplane(&[
        "simulate",
        "--trace",
        &t,
        "--instances",
        "2",
        "--max-requests",
        "300",
        "--kv-high-water",
        "0.9",
        "--runaway-output-tokens",
        "512",
        "--router",
        "least-outstanding@nohw,least-outstanding@hw",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for row in ["evictions", "re-routes", "ended (runaway)", "admission paused (s)", "paused wait p99 (ms)"] {
        assert!(out.contains(row), "the table has `{row}`: {out}");
    }
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs[1]["router"], "least-outstanding@hw");
    for run in runs {
        let s = &run["summary"];
        assert_eq!(s["requests"], 300, "{run}");
        for key in ["evictions", "reroutes", "ended_runaway", "admission_paused_s", "paused_wait_ms"] {
            assert!(s.get(key).is_some(), "summary lacks {key}");
        }
    }
}

#[test]
fn engine_and_serve_name_what_is_wrong_with_their_flags() {
    fails_with(&["engine", "--role", "middle"], &["'middle'", "prefill, decode"]);
    // A CUDA engine takes the P/D roles: what stops this one is its model folder.
    fails_with(
        &["engine", "--role", "prefill", "--executor", "cuda", "--model", "/no/such/model"],
        &["/no/such/model"],
    );
    fails_with(&["engine", "--model", "gpt-9"], &["gpt-9", "llama-3.1-8b"]);
    fails_with(&["engine", "--block-size", "12"], &["--block-size 12"]);
    fails_with(&["engine", "--spec", "medusa"], &["medusa", "none, eagle3, dflash, dspark"]);
    fails_with(&["engine", "--executor", "cuda", "--spec", "dspark"], &["--spec dspark needs --executor sim"]);
    fails_with(&["engine", "--executor", "cuda", "--model", "/no/such/model"], &["/no/such/model", "make-model"]);
    fails_with(&["serve", "--router", "fastest"], &["fastest", "cache-aware"]);
    fails_with(&["serve", "--mode", "pd", "--autoscaler", "guess"], &["guess", "slo-load"]);
    fails_with(&["serve", "--actuator", "local"], &["--mode pd"]);
    fails_with(&["serve", "--mode", "pd", "--engine-time-scale", "0"], &["--engine-time-scale"]);
}

#[test]
fn a_cuda_engine_without_a_gpu_says_so() {
    let dir = tests::scratch_dir("cuda-engine");
    let model = dir.join("tiny");
    let o = fleetplane(&["make-model", "--config", "tiny", "--out", &model.display().to_string()]);
    assert!(o.status.success(), "make-model: {}", stderr(&o));
    assert!(model.join("config.json").is_file() && model.join("model.safetensors").is_file());
    if Path::new("/dev/nvidia0").exists() {
        return; // A GPU is here: the GPU checks (scripts/gpu-check.sh) serve from it.
    }
    fails_with(&["engine", "--executor", "cuda", "--model", &model.display().to_string()], &["CUDA"]);
}

#[test]
fn a_measured_profile_calibrates_the_simulation_and_a_wrong_one_is_refused() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let scenario = root.join("examples/cuda-fidelity.toml");
    let profile = root.join("docs/results/profile-h200-llama-8b.json");
    let dir = tests::scratch_dir("profile");
    let json = dir.join("out.json");
    let (scenario, profile) = (scenario.to_str().unwrap(), profile.to_str().unwrap());
    let args = ["simulate", "--scenario", scenario, "--max-requests", "100", "--profile", profile];
    let o = fleetplane(&[&args[..], &["--json", json.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("calibrated on"), "{}", stdout(&o));
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let c = &report["calibration"];
    let (fitted, plain) = (c["median_error"].as_f64().unwrap(), c["uncalibrated_median_error"].as_f64().unwrap());
    assert!(fitted < 0.1 && fitted < plain / 2.0, "the fit predicts the measured steps: {c}");
    assert_eq!(c["fits"].as_array().unwrap().len() as u64, c["samples"].as_u64().unwrap());
    // The profile was measured on an H200: an H100 fleet cannot use it.
    fails_with(&[&args[..], &["--gpu", "h100"]].concat(), &["profile-h200-llama-8b.json", "gpu `h200`, not `h100`"]);
    let broken = dir.join("broken.json");
    std::fs::write(&broken, "{\"format\": 1, \"model\": ").unwrap();
    let mut bad = args;
    bad[6] = broken.to_str().unwrap();
    fails_with(&bad, &["parsing profile", "broken.json"]);
}

#[test]
fn simulate_mode_pd_runs_from_flags_with_each_autoscaler() {
    let dir = tests::scratch_dir("pd-flags");
    let azure = tests::trace("azure-llm-2023-conv.csv").display().to_string();
    // 3,000 Azure requests at 8x their rate overload one prefill and one decode instance:
    // `none` keeps the pools and misses the SLO, the others grow within 6 GPUs.
    for (autoscaler, grows) in [("none", false), ("fixed-xpyd", true), ("slo-load", true)] {
        let json = dir.join(format!("{autoscaler}.json"));
        let o = fleetplane(&[
            "simulate",
            "--trace",
            &azure,
            "--max-requests",
            "3000",
            "--rate-scale",
            "8",
            "--instances",
            "6",
            "--mode",
            "pd",
            "--prefill-instances",
            "1",
            "--decode-instances",
            "1",
            "--autoscaler",
            autoscaler,
            "--startup-s",
            "5",
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{autoscaler}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let s = &v["runs"][0]["summary"];
        let p = &s["pools"];
        assert_eq!((p["mode"].as_str(), p["autoscaler"].as_str()), (Some("pd"), Some(autoscaler)));
        assert_eq!((s["requests"].as_u64(), p["transfers"].as_u64()), (Some(3000), Some(3000)), "{autoscaler}");
        assert!(s["gpu_hours"].as_f64().is_some_and(|h| h > 0.0), "{autoscaler}: {s}");
        let events = p["scaling_events"].as_u64().unwrap();
        assert_eq!(events > 0, grows, "{autoscaler}: {events} scaling events");
        assert_eq!(p["scaling"].as_array().map(Vec::len), Some(events as usize));
        let timeline = p["timeline"].as_array().unwrap();
        assert!(timeline.len() >= 5, "{autoscaler}: {} points", timeline.len());
        let last = &timeline[timeline.len() - 1];
        for key in ["t_s", "prefill", "decode", "gpus", "load_p", "load_d", "slo_attainment"] {
            assert!(last[key].is_number(), "{autoscaler}: timeline point lacks {key}: {last}");
        }
        let most_gpus = timeline.iter().filter_map(|t| t["gpus"].as_u64()).max();
        assert_eq!(most_gpus.is_some_and(|g| g > 2), grows, "{autoscaler}: at most {most_gpus:?} GPUs");
    }
}

#[test]
fn a_table_piped_into_a_reader_that_stops_early_ends_without_a_panic() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_fleetplane"))
        .args(["simulate", "--trace", &mooncake(), "--max-requests", "2000", "--router", "round-robin"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fleetplane runs");
    // Read the first line, as `| head -1` does, and close the pipe.
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut first).expect("a line");
    assert!(first.starts_with("seed="), "{first}");
    let out = child.wait_with_output().expect("it ends");
    let err = stderr(&out);
    assert!(!err.contains("panicked"), "{err}");
}
