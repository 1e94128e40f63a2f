//! Leader election among control-plane replicas sharing one database: the replica holding a
//! PostgreSQL advisory lock leads (runs the autoscaler). The lock lives on one dedicated
//! connection, so a leader that dies, or loses its database connection, releases it at once.

use sqlx::postgres::PgConnection;
use sqlx::Connection;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The advisory lock's key ("fleetplane" leader).
const LOCK_KEY: i64 = 0x666c_6565_7470_6c61;
/// How often a follower tries to take the lock, and a leader checks it still holds it.
pub const POLL: Duration = Duration::from_millis(500);

pub async fn run(url: String, leader: Arc<AtomicBool>, on_change: impl Fn(bool) + Send + 'static) {
    let mut conn: Option<PgConnection> = None;
    loop {
        if conn.is_none() {
            conn = PgConnection::connect(&url).await.ok();
        }
        let leading = leader.load(Ordering::Relaxed);
        let checked = match conn.as_mut() {
            None => Err(()),
            // Still leading while the connection that holds the lock is alive.
            Some(c) if leading => sqlx::query("SELECT 1").execute(&mut *c).await.map(|_| true).map_err(|_| ()),
            Some(c) => sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_lock($1)")
                .bind(LOCK_KEY)
                .fetch_one(&mut *c)
                .await
                .map_err(|_| ()),
        };
        let held = checked.unwrap_or_else(|()| {
            // The connection failed: drop it (and with it any lock the server still holds).
            conn = None;
            false
        });
        if held != leader.swap(held, Ordering::Relaxed) {
            on_change(held);
        }
        tokio::time::sleep(POLL).await;
    }
}
