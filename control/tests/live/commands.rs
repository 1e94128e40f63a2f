//! The commands around the live system: background simulations, the demo, latency probes, step profiles.

use super::*;

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
