//! Faults: engines that die, hang or are told to stop mid-stream, and replicas that hand over.

use super::*;

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
