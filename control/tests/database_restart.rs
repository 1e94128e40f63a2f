//! PostgreSQL stopped and started under a running control plane: routing goes on without it,
//! and the writes made meanwhile reach the database once it is back. Alone in its test binary
//! (cargo runs test binaries one at a time), since it stops the machine's database server.

mod common;

use common::*;
use serde_json::json;
use std::process::Command;

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
    if !std::path::Path::new("/etc/postgresql").exists()
        || Command::new("pg_ctlcluster").arg("--help").output().is_err()
    {
        eprintln!("skipped: no local PostgreSQL cluster to restart (pg_ctlcluster)");
        return;
    }
    let db = Db::fresh("restart");
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
    let (status, v) = post(&format!("{}/api/instances/{id}/drain", s.http), Some(ADMIN), &json!({}));
    assert_eq!(status, 202, "{v}");
    let (_, v) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
    assert!(v["pending_database_writes"].as_u64().unwrap_or(0) >= 1, "{v}");
    // Reads that need the database say so.
    let (status, v) = get(&format!("{}/api/audit", s.http), Some(ADMIN));
    assert_eq!((status, v["error"]["code"].as_str()), (503, Some("database_unavailable")));
    assert_eq!(ask().0, 200);

    assert!(cluster("start"), "cannot start PostgreSQL");
    drop(guard);
    eventually(20, "queued writes reach the database", || {
        db.query(&format!("SELECT state FROM instances WHERE id = {id}")) == "draining"
            && db.query("SELECT count(*) FROM audit_log WHERE action = 'instance.drain'") == "1"
    });
    let (_, v) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
    assert_eq!(v["pending_database_writes"], 0);
    assert_eq!(ask().0, 200);
}
