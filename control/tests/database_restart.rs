//! PostgreSQL stopped and started under a running control plane: routing goes on without it,
//! the API's reads of stored state and the console's history come from memory, a lone replica
//! keeps leading (and sizing its pools), and the writes made meanwhile reach the database once
//! it is back, stamped with when they happened. Alone in its test binary (cargo runs test
//! binaries one at a time), since it stops the machine's database server; the tests here run
//! one at a time for the same reason.

mod common;

use common::*;
use serde_json::{json, Value};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

static OUTAGES: Mutex<()> = Mutex::new(());

/// The database server for one test (one outage at a time) and a database of its own; `None`
/// (the test skips) where there is no cluster to stop and start.
fn take_the_database(tag: &str) -> Option<(MutexGuard<'static, ()>, Db)> {
    let one = OUTAGES.lock().unwrap_or_else(|p| p.into_inner());
    can_restart().then(|| (one, Db::fresh(tag)))
}

fn now_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970").as_secs_f64()
}

/// Whether this machine has a PostgreSQL cluster the test may stop and start.
fn can_restart() -> bool {
    let ok = std::path::Path::new("/etc/postgresql").exists()
        && Command::new("pg_ctlcluster").arg("--help").output().is_ok();
    if !ok {
        eprintln!("skipped: no local PostgreSQL cluster to restart (pg_ctlcluster)");
    }
    ok
}

fn cluster(action: &str) -> bool {
    let Ok(versions) = std::fs::read_dir("/etc/postgresql") else { return false };
    let Some(version) = versions.filter_map(Result::ok).map(|e| e.file_name().to_string_lossy().to_string()).next()
    else {
        return false;
    };
    Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, "main", action])
        .status()
        .is_ok_and(|s| s.success())
}

/// Starts the database again however the test ends.
struct Restart;

impl Drop for Restart {
    fn drop(&mut self) {
        cluster("start");
    }
}

#[test]
fn routing_survives_a_database_restart_and_writes_catch_up() {
    let Some((_one, db)) = take_the_database("restart") else { return };
    let s = serve(&db, &[]);
    let _a = engine(&s.grpc, "a", &[]);
    let _b = engine(&s.grpc, "b", &[]);
    wait_serving(&s.http, 2);
    let ask = || {
        post(
            &format!("{}/v1/completions", s.http),
            Some(ADMIN),
            &json!({"model": MODEL, "prompt": "hi", "max_tokens": 3}),
        )
    };

    let guard = Restart;
    assert!(cluster("stop"), "cannot stop PostgreSQL");
    for _ in 0..5 {
        assert_eq!(ask().0, 200, "routing goes on without the database");
    }
    // Engines keep their heartbeat; an operator's drain is applied now and written later.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
    let id = v["instances"][0]["id"].as_u64().expect("id");
    let drained_at = now_s();
    let (status, v) = post(&format!("{}/api/instances/{id}/drain", s.http), Some(ADMIN), &json!({}));
    assert_eq!(status, 202, "{v}");
    let (_, v) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
    assert!(v["pending_database_writes"].as_u64().unwrap_or(0) >= 1, "{v}");
    // Reads that need the database say so.
    let (status, v) = get(&format!("{}/api/audit", s.http), Some(ADMIN));
    assert_eq!((status, v["error"]["code"].as_str()), (503, Some("database_unavailable")));
    assert_eq!(ask().0, 200);

    // The database comes back a few seconds after the drain.
    std::thread::sleep(Duration::from_secs(3));
    let restarted_at = now_s();
    assert!(cluster("start"), "cannot start PostgreSQL");
    drop(guard);
    eventually(20, "queued writes reach the database", || {
        db.query(&format!("SELECT state FROM instances WHERE id = {id}")) == "draining"
            && db.query("SELECT count(*) FROM audit_log WHERE action = 'instance.drain'") == "1"
    });
    // The audit row says when the drain happened, not when the database took it.
    let at: f64 = db
        .query("SELECT extract(epoch FROM at) FROM audit_log WHERE action = 'instance.drain'")
        .parse()
        .expect("a time");
    assert!(
        (at - drained_at).abs() < 1.0 && at < restarted_at,
        "drained at {drained_at:.3}, audited at {at:.3}, database back at {restarted_at:.3}"
    );
    let (_, v) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
    assert_eq!(v["pending_database_writes"], 0);
    assert_eq!(ask().0, 200);
}

#[test]
fn through_an_outage_stored_state_is_read_from_memory_and_the_lone_replica_keeps_leading() {
    let Some((_one, db)) = take_the_database("outage_reads") else { return };
    let s = serve(&db, &[]);
    let _a = engine(&s.grpc, "a", &[]);
    wait_serving(&s.http, 1);
    let api = |path: &str| format!("{}/api/{path}", s.http);
    let (status, v) = send(reqwest::Method::PUT, &api("slo"), Some(ADMIN), &json!({"ttft_ms": 700, "tpot_ms": 70}));
    assert_eq!(status, 200, "{v}");
    let (status, v) =
        send(reqwest::Method::PUT, &api("policies"), Some(ADMIN), &json!({"router": "least-outstanding"}));
    assert_eq!(status, 200, "{v}");
    eventually(10, "the replica leads", || get(&api("fleet"), Some(ADMIN)).1["leader"] == true);

    let guard = Restart;
    assert!(cluster("stop"), "cannot stop PostgreSQL");
    let stopped_ms = (now_s() * 1e3) as u64;
    std::thread::sleep(Duration::from_secs(7));
    let (status, v) = get(&api("slo"), Some(ADMIN));
    assert_eq!((status, v["ttft_ms"].as_f64()), (200, Some(700.0)), "{v}");
    let (status, v) = get(&api("policies"), Some(ADMIN));
    assert_eq!((status, v["policy"]["router"].as_str()), (200, Some("least-outstanding")), "{v}");
    assert_eq!(v["in_force"]["router"], "least-outstanding", "{v}");
    let (status, v) = get(&api("pools"), Some(ADMIN));
    assert_eq!(status, 200, "{v}");
    assert!(v["pools"].as_array().is_some_and(|p| !p.is_empty()), "{v}");
    let (_, v) = get(&api("fleet"), Some(ADMIN));
    assert_eq!(v["leader"], true, "a lone replica keeps leading: {v}");
    // The history samples once a second through the outage, with the stored SLO targets.
    let (_, v) = get(&api(&format!("history?since_ms={}", stopped_ms + 1000)), Some(ADMIN));
    let at: Vec<u64> = v["samples"].as_array().expect("samples").iter().filter_map(|x| x["at_ms"].as_u64()).collect();
    let within = at.iter().filter(|&&t| t <= stopped_ms + 6000).count();
    assert!(within >= 4, "samples in the outage's seconds 1 to 6: {at:?}");
    let gaps: Vec<u64> = at.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps.iter().all(|&g| g < 1600), "samples a second apart: gaps {gaps:?} ms");

    assert!(cluster("start"), "cannot start PostgreSQL");
    drop(guard);
    eventually(20, "the replica leads with the database back", || {
        let (status, v) = get(&api("audit"), Some(ADMIN));
        status == 200 && get(&api("fleet"), Some(ADMIN)).1["leader"] == true && v["entries"].is_array()
    });
}

fn prefill(http: &str) -> Value {
    get(&format!("{http}/api/pools"), Some(ADMIN)).1["pd"]["prefill"].clone()
}

#[test]
fn a_lone_pd_replica_keeps_sizing_its_pools_through_an_outage() {
    let Some((_one, db)) = take_the_database("outage_pd") else { return };
    let flags = ["--mode", "pd", "--actuator", "local", "--autoscaler", "none", "--min-per-pool", "1"];
    let s = serve(&db, &[&flags[..], &["--gpu-budget", "4", "--scale-tick-ms", "200"]].concat());
    // An empty fleet: the leader fills each pool with an engine process.
    wait_serving(&s.http, 2);
    let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
    let first = v["instances"]
        .as_array()
        .expect("instances")
        .iter()
        .find(|i| i["pool"] == "prefill")
        .expect("a prefill engine")["id"]
        .as_u64()
        .expect("an id");

    let guard = Restart;
    assert!(cluster("stop"), "cannot stop PostgreSQL");
    // Past the leader's next checks of its lock.
    std::thread::sleep(Duration::from_secs(3));
    let (status, v) = post(&format!("{}/api/instances/{first}/drain", s.http), Some(ADMIN), &json!({}));
    assert_eq!(status, 202, "{v}");
    // The prefill pool is below its minimum: the leader starts another engine process (which
    // cannot register before the database is back: a new engine needs it for its id).
    eventually(10, "the leader starts a prefill engine during the outage", || {
        prefill(&s.http)["starting"].as_u64() >= Some(1)
    });

    assert!(cluster("start"), "cannot start PostgreSQL");
    drop(guard);
    eventually(30, "the new prefill engine serves once the database is back", || {
        prefill(&s.http)["serving"].as_u64() == Some(1)
    });
}

#[test]
fn writes_queued_when_a_replica_dies_in_an_outage_reach_the_database_through_the_next_one() {
    let Some((_one, db)) = take_the_database("outage_spool") else { return };
    let spool = db.spool_dir();
    let (http, grpc) = (free_addr(), free_addr());
    let replica = |db: &Db| {
        let args = ["serve", "--listen", &http, "--grpc-listen", &grpc, "--database-url", &db.url];
        let env =
            [("FLEETPLANE_ADMIN_TOKEN", ADMIN), ("FLEETPLANE_ENGINE_TOKEN", ENGINE), ("FLEETPLANE_SPOOL_DIR", &spool)];
        start(&args, &env, "serving http://")
    };
    let base = format!("http://{http}");
    let mut first = replica(&db);
    let _a = engine(&grpc, "a", &[]);
    wait_serving(&base, 1);
    let (_, v) = get(&format!("{base}/api/instances"), Some(ADMIN));
    let id = v["instances"][0]["id"].as_u64().expect("id");

    let guard = Restart;
    assert!(cluster("stop"), "cannot stop PostgreSQL");
    let drained_at = now_s();
    let (status, v) = post(&format!("{base}/api/instances/{id}/drain"), Some(ADMIN), &json!({}));
    assert_eq!(status, 202, "{v}");
    // The replica dies with the drain's writes queued.
    first.kill();
    assert!(cluster("start"), "cannot start PostgreSQL");
    drop(guard);

    let _second = replica(&db);
    eventually(20, "the dead replica's writes reach the database", || {
        db.query("SELECT count(*) FROM audit_log WHERE action = 'instance.drain'") == "1"
            && db.query(&format!("SELECT state FROM instances WHERE id = {id}")) == "draining"
    });
    let at: f64 = db
        .query("SELECT extract(epoch FROM at) FROM audit_log WHERE action = 'instance.drain'")
        .parse()
        .expect("a time");
    assert!((at - drained_at).abs() < 1.0, "drained at {drained_at:.3}, audited at {at:.3}");
    // Once each: a second restart takes nothing over again.
    drop(_second);
    let _third = replica(&db);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(db.query("SELECT count(*) FROM audit_log WHERE action = 'instance.drain'"), "1");
}
