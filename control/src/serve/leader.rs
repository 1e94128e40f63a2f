//! Leader election among control-plane replicas sharing one database: the replica holding a
//! PostgreSQL advisory lock leads (runs the autoscaler). The lock lives on one dedicated
//! connection, so a leader that dies, or loses its database connection, releases it at once.
//!
//! A leader whose database stops answering keeps leading while it cannot reach it: nobody
//! can take the lock from a database that is down, and a lone replica goes on sizing its
//! pools through the outage. Once it reaches the database again it takes the lock back, or
//! steps down if another replica took it first. (A partition that cuts only the leader off
//! the database, while a follower reaches it, gives two leaders until the old one reaches it.)

use sqlx::postgres::PgConnection;
use sqlx::Connection;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The advisory lock's key ("fleetplane" leader).
const LOCK_KEY: i64 = 0x666c_6565_7470_6c61;
/// How often a follower tries to take the lock, and a leader checks it still holds it.
pub const POLL: Duration = Duration::from_millis(500);
/// How long one check may take before the database counts as not answering.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// What one poll found.
enum Check {
    /// The lock is held on a live connection (`true`), or another replica holds it (`false`).
    Answered(bool),
    /// The database did not answer: no connection, or the query failed or hung.
    Unreachable,
}

async fn check(conn: &mut Option<PgConnection>, url: &str, leading: bool) -> Check {
    let fresh = conn.is_none();
    if fresh {
        *conn = tokio::time::timeout(CHECK_TIMEOUT, PgConnection::connect(url)).await.ok().and_then(Result::ok);
    }
    let Some(c) = conn.as_mut() else { return Check::Unreachable };
    // A leader on the connection that took the lock still holds it while the connection lives;
    // on a new connection (after an outage) it must take the lock again.
    let query = async {
        if leading && !fresh {
            sqlx::query("SELECT 1").execute(&mut *c).await.map(|_| true)
        } else {
            sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_lock($1)").bind(LOCK_KEY).fetch_one(&mut *c).await
        }
    };
    match tokio::time::timeout(CHECK_TIMEOUT, query).await {
        Ok(Ok(held)) => Check::Answered(held),
        _ => {
            // Drop the connection (and with it any lock the server still holds for it).
            *conn = None;
            Check::Unreachable
        }
    }
}

pub async fn run(url: String, leader: Arc<AtomicBool>, on_change: impl Fn(bool) + Send + 'static) {
    let mut conn: Option<PgConnection> = None;
    loop {
        let leading = leader.load(Ordering::Relaxed);
        let held = match check(&mut conn, &url, leading).await {
            Check::Answered(held) => held,
            // Unreachable: a leader stays one, a follower stays one.
            Check::Unreachable => leading,
        };
        if held != leader.swap(held, Ordering::Relaxed) {
            on_change(held);
        }
        tokio::time::sleep(POLL).await;
    }
}
