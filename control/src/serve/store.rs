//! Fleet state in PostgreSQL, through sqlx migrations (migrations/) and runtime queries.
//!
//! Reads of the logs that answer the API go to the database. Writes that the serving path
//! produces (instance state, scaling events, drains' audit rows) go through a queue that
//! retries until the database takes them: routing never waits on the database, and when
//! PostgreSQL restarts the writes catch up. Each carries the time of its action, and is
//! spooled to disk first ([`super::spool`]), so that a replica dying meanwhile loses none.

use super::auth::{Principal, Role, TokenHash};
use super::spool::{Spool, Spooled, Write};
use anyhow::{Context, Result};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool, Row};
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

#[derive(Clone)]
pub struct Store {
    pool: PgPool,
    writes: mpsc::UnboundedSender<Spooled>,
    queue: Arc<Queue>,
}

/// What the queue's two ends share. The spool is appended to as a write is queued and emptied
/// when the last one reaches the database, both under its lock, so that a write is never
/// queued but missing from the spool.
struct Queue {
    spool: Mutex<Option<Spool>>,
    /// Writes queued and not yet in the database.
    backlog: AtomicUsize,
    /// This replica's prefix of write ids (process id and a random nonce) and the next number.
    owner: String,
    next: AtomicU64,
}

/// An engine's row.
#[derive(Clone, Debug, serde::Serialize)]
pub struct InstanceRow {
    pub id: i32,
    pub address: String,
    pub name: String,
    pub pool: String,
    pub model: String,
    pub executor: String,
    pub state: String,
    /// `fleetplane`, `vllm` or `sglang`.
    pub kind: String,
}

/// Creates the database named in `url` when it does not exist (through the server's
/// `postgres` database), so a fresh machine needs no setup step.
pub async fn ensure_database(url: &str) -> Result<()> {
    let opts =
        PgConnectOptions::from_str(url).with_context(|| format!("DATABASE_URL `{url}` is not a PostgreSQL URL"))?;
    let Some(name) = opts.get_database().map(str::to_string) else { return Ok(()) };
    let admin = opts.clone().database("postgres");
    let mut conn = admin.connect().await.with_context(|| format!("cannot connect to PostgreSQL at {url}"))?;
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(&name)
        .fetch_one(&mut conn)
        .await?;
    if !exists {
        let quoted = format!("\"{}\"", name.replace('"', "\"\""));
        // Two replicas may race to create it; losing the race is fine.
        if let Err(e) = sqlx::query(&format!("CREATE DATABASE {quoted}")).execute(&mut conn).await {
            if !e.to_string().contains("already exists") {
                return Err(e).with_context(|| format!("cannot create database {name}"));
            }
        }
    }
    Ok(())
}

impl Store {
    /// Connects, applies the migrations and starts the write-behind queue, spooled in
    /// `spool_dir` (`None`: in memory only); writes spooled by replicas of this database that
    /// are gone are queued first.
    pub async fn open(url: &str, spool_dir: Option<&Path>, nonce: u32) -> Result<Store> {
        ensure_database(url).await?;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(3))
            .connect(url)
            .await
            .with_context(|| format!("cannot connect to PostgreSQL at {url} (set DATABASE_URL)"))?;
        sqlx::migrate!("../migrations").run(&pool).await.context("cannot apply the database migrations")?;
        let owner = format!("{}-{nonce:06x}", std::process::id());
        let (spool, adopted) = match spool_dir {
            Some(dir) => {
                let opts = PgConnectOptions::from_str(url)?;
                let key =
                    super::spool::database_key(opts.get_host(), opts.get_port(), opts.get_database().unwrap_or(""));
                let (spool, adopted) = Spool::open(dir, &key, &owner)?;
                (Some(spool), adopted)
            }
            None => (None, Vec::new()),
        };
        let (writes, rx) = mpsc::unbounded_channel();
        let queue =
            Arc::new(Queue { spool: Mutex::new(spool), backlog: AtomicUsize::new(0), owner, next: AtomicU64::new(0) });
        for w in adopted {
            queue.backlog.fetch_add(1, Ordering::Relaxed);
            let _ = writes.send(w);
        }
        tokio::spawn(write_behind(pool.clone(), rx, queue.clone()));
        Ok(Store { pool, writes, queue })
    }

    /// Queues a write, stamped with the time of its action, after putting it in the spool; it
    /// reaches the database as soon as the database is there.
    pub fn write(&self, write: Write) {
        let q = &self.queue;
        let at_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        let w = Spooled { id: format!("{}-{}", q.owner, q.next.fetch_add(1, Ordering::Relaxed)), at_us, write };
        let mut spool = super::lock::lock(&q.spool);
        if let Some(s) = spool.as_mut() {
            if let Err(e) = s.append(&w) {
                tracing::warn!(
                    "write not spooled (lost if this replica dies before the database takes it): {}",
                    control::describe(&*e)
                );
            }
        }
        q.backlog.fetch_add(1, Ordering::Relaxed);
        if self.writes.send(w).is_err() {
            q.backlog.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Writes queued and not yet in the database.
    pub fn backlog(&self) -> usize {
        self.queue.backlog.load(Ordering::Relaxed)
    }

    /// Removes the spool when nothing is queued (a clean shutdown).
    pub fn close(&self) {
        let mut spool = super::lock::lock(&self.queue.spool);
        if self.backlog() == 0 {
            if let Some(s) = spool.take() {
                s.remove();
            }
        }
    }

    /// The id of the engine at `address`, registering it (or updating its description).
    pub async fn register_instance(&self, address: &str, pool: &str, info: &crate::proto::EngineInfo) -> Result<i32> {
        let id: i32 = sqlx::query_scalar(
            "INSERT INTO instances (address, name, pool, model, executor, block_size, kv_blocks, capacity_tokens, state)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'serving')
             ON CONFLICT (address) DO UPDATE SET name = $2, pool = $3, model = $4, executor = $5, block_size = $6,
                 kv_blocks = $7, capacity_tokens = $8, state = 'serving', last_seen = to_timestamp($9)
             RETURNING id",
        )
        .bind(address)
        .bind(&info.name)
        .bind(pool)
        .bind(&info.model)
        .bind(&info.executor)
        .bind(info.block_size as i32)
        .bind(i64::from(info.kv_blocks))
        .bind(info.capacity_tokens as i64)
        .bind(epoch_s(SystemTime::now()))
        .fetch_one(&self.pool)
        .await?;
        Ok(id)
    }

    /// Records an engine an operator registered (an engine of ours registers itself);
    /// the same URL keeps its id.
    pub async fn register_external(
        &self,
        spec: &super::vllm::EngineSpec,
        info: &crate::proto::EngineInfo,
    ) -> Result<i32> {
        let id: i32 = sqlx::query_scalar(
            "INSERT INTO instances (address, name, pool, model, executor, block_size, kv_blocks, capacity_tokens, state, kind, spec)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'serving', $9, $10)
             ON CONFLICT (address) DO UPDATE SET name = $2, pool = $3, model = $4, executor = $5, block_size = $6,
                 kv_blocks = $7, capacity_tokens = $8, state = 'serving', kind = $9, spec = $10, last_seen = to_timestamp($11)
             RETURNING id",
        )
        .bind(&spec.url)
        .bind(&info.name)
        .bind(&spec.role)
        .bind(&info.model)
        .bind(&info.executor)
        .bind(info.block_size as i32)
        .bind(i64::from(info.kv_blocks))
        .bind(info.capacity_tokens as i64)
        .bind(spec.kind.name())
        .bind(serde_json::to_value(spec)?)
        .bind(epoch_s(SystemTime::now()))
        .fetch_one(&self.pool)
        .await?;
        Ok(id)
    }

    /// The engines operators registered and did not remove, with their specs.
    pub async fn external_engines(&self) -> Result<Vec<(i32, Value)>> {
        let rows = sqlx::query(
            "SELECT id, spec FROM instances WHERE kind <> 'fleetplane' AND state <> 'removed' AND spec IS NOT NULL ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|r| (r.get("id"), r.get("spec"))).collect())
    }

    pub async fn instances(&self) -> Result<Vec<InstanceRow>> {
        let rows =
            sqlx::query("SELECT id, address, name, pool, model, executor, state, kind FROM instances ORDER BY id")
                .fetch_all(&self.pool)
                .await?;
        Ok(rows
            .into_iter()
            .map(|r| InstanceRow {
                id: r.get("id"),
                address: r.get("address"),
                name: r.get("name"),
                pool: r.get("pool"),
                model: r.get("model"),
                executor: r.get("executor"),
                state: r.get("state"),
                kind: r.get("kind"),
            })
            .collect())
    }

    pub async fn pools(&self) -> Result<Vec<Value>> {
        let rows = sqlx::query("SELECT name, role, min_instances, max_instances FROM pools ORDER BY name")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows
            .into_iter()
            .map(|r| {
                serde_json::json!({
                    "name": r.get::<String, _>("name"),
                    "role": r.get::<String, _>("role"),
                    "min_instances": r.get::<i32, _>("min_instances"),
                    "max_instances": r.get::<i32, _>("max_instances"),
                })
            })
            .collect())
    }

    /// The policy in force: (version, policy, author, when).
    pub async fn policy(&self) -> Result<Option<(i32, Value, String, String)>> {
        let row = sqlx::query(
            "SELECT version, policy, author, to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS at
             FROM policy_versions ORDER BY version DESC LIMIT 1",
        )
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| (r.get("version"), r.get("policy"), r.get("author"), r.get("at"))))
    }

    pub async fn policy_history(&self) -> Result<Vec<Value>> {
        let rows = sqlx::query(
            "SELECT version, policy, author, to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS at
             FROM policy_versions ORDER BY version DESC LIMIT 100",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| {
                serde_json::json!({"version": r.get::<i32, _>("version"), "policy": r.get::<Value, _>("policy"),
                    "author": r.get::<String, _>("author"), "created_at": r.get::<String, _>("at")})
            })
            .collect())
    }

    /// Stores a new policy version (already validated) with its audit record, in one
    /// transaction; returns the version.
    pub async fn put_policy(&self, policy: &Value, author: &str) -> Result<i32> {
        let mut tx = self.pool.begin().await?;
        let before: Option<Value> =
            sqlx::query_scalar("SELECT policy FROM policy_versions ORDER BY version DESC LIMIT 1")
                .fetch_optional(&mut *tx)
                .await?;
        let version: i32 =
            sqlx::query_scalar("INSERT INTO policy_versions (policy, author) VALUES ($1, $2) RETURNING version")
                .bind(policy)
                .bind(author)
                .fetch_one(&mut *tx)
                .await?;
        audit(
            &mut *tx,
            author,
            "policy.put",
            serde_json::json!({"version": version, "before": before, "after": policy}),
        )
        .await?;
        tx.commit().await?;
        Ok(version)
    }

    pub async fn slo(&self) -> Result<Option<(f64, f64)>> {
        let row = sqlx::query("SELECT ttft_ms, tpot_ms FROM slo_targets").fetch_optional(&self.pool).await?;
        Ok(row.map(|r| (r.get("ttft_ms"), r.get("tpot_ms"))))
    }

    pub async fn put_slo(&self, ttft_ms: f64, tpot_ms: f64, author: &str) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO slo_targets (id, ttft_ms, tpot_ms, updated_by) VALUES (TRUE, $1, $2, $3)
             ON CONFLICT (id) DO UPDATE SET ttft_ms = $1, tpot_ms = $2, updated_by = $3, updated_at = now()",
        )
        .bind(ttft_ms)
        .bind(tpot_ms)
        .bind(author)
        .execute(&mut *tx)
        .await?;
        audit(&mut *tx, author, "slo.put", serde_json::json!({"ttft_ms": ttft_ms, "tpot_ms": tpot_ms})).await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn create_token(&self, name: &str, role: Role, hash: &TokenHash, author: &str) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("INSERT INTO api_tokens (name, role, token_sha256, created_by) VALUES ($1, $2, $3, $4)")
            .bind(name)
            .bind(role.name())
            .bind(&hash[..])
            .bind(author)
            .execute(&mut *tx)
            .await?;
        audit(&mut *tx, author, "token.create", serde_json::json!({"name": name, "role": role.name()})).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Revokes a token; returns its hash if it existed.
    pub async fn revoke_token(&self, name: &str, author: &str) -> Result<Option<TokenHash>> {
        let mut tx = self.pool.begin().await?;
        let hash: Option<Vec<u8>> = sqlx::query_scalar(
            "UPDATE api_tokens SET revoked_at = now() WHERE name = $1 AND revoked_at IS NULL RETURNING token_sha256",
        )
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?;
        // Only a revocation that happened is audited (an unknown name changes nothing).
        if hash.is_some() {
            audit(&mut *tx, author, "token.revoke", serde_json::json!({"name": name})).await?;
        }
        tx.commit().await?;
        Ok(hash.and_then(|h| h.try_into().ok()))
    }

    pub async fn tokens(&self) -> Result<Vec<Value>> {
        let rows =
            sqlx::query("SELECT name, role, created_by, revoked_at IS NOT NULL AS revoked FROM api_tokens ORDER BY id")
                .fetch_all(&self.pool)
                .await?;
        Ok(rows
            .into_iter()
            .map(|r| {
                serde_json::json!({"name": r.get::<String, _>("name"), "role": r.get::<String, _>("role"),
                    "created_by": r.get::<String, _>("created_by"), "revoked": r.get::<bool, _>("revoked")})
            })
            .collect())
    }

    /// Every live token, for the in-memory check.
    pub async fn live_tokens(&self) -> Result<(Vec<(TokenHash, Principal)>, Vec<TokenHash>)> {
        let rows = sqlx::query("SELECT name, role, token_sha256, revoked_at IS NOT NULL AS revoked FROM api_tokens")
            .fetch_all(&self.pool)
            .await?;
        let (mut live, mut revoked) = (Vec::new(), Vec::new());
        for r in rows {
            let Ok(hash) = TokenHash::try_from(r.get::<Vec<u8>, _>("token_sha256")) else { continue };
            if r.get::<bool, _>("revoked") {
                revoked.push(hash);
            } else if let Some(role) = Role::parse(&r.get::<String, _>("role")) {
                live.push((hash, Principal { name: r.get("name"), role }));
            }
        }
        Ok((live, revoked))
    }

    pub async fn submit_simulation(&self, scenario: &str, author: &str) -> Result<i64> {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO simulation_runs (scenario, state, submitted_by) VALUES ($1, 'queued', $2) RETURNING id",
        )
        .bind(scenario)
        .bind(author)
        .fetch_one(&self.pool)
        .await?;
        Ok(id)
    }

    pub async fn simulation_state(&self, id: i64, state: &str) -> Result<()> {
        sqlx::query("UPDATE simulation_runs SET state = $2 WHERE id = $1")
            .bind(id)
            .bind(state)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn finish_simulation(&self, id: i64, outcome: Result<(Value, String), String>) -> Result<()> {
        let (state, result, svg, error) = match outcome {
            Ok((result, svg)) => ("done", Some(result), Some(svg), None),
            Err(e) => ("failed", None, None, Some(e)),
        };
        sqlx::query(
            "UPDATE simulation_runs SET state = $2, result = $3, chart_svg = $4, error = $5, finished_at = now() WHERE id = $1",
        )
        .bind(id)
        .bind(state)
        .bind(result)
        .bind(svg)
        .bind(error)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn simulations(&self) -> Result<Vec<Value>> {
        let rows = sqlx::query(&format!("SELECT {SIM_COLUMNS} FROM simulation_runs ORDER BY id DESC LIMIT 100"))
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| simulation_json(r, false)).collect())
    }

    pub async fn simulation(&self, id: i64) -> Result<Option<Value>> {
        let row = sqlx::query(&format!("SELECT {SIM_COLUMNS}, result FROM simulation_runs WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| simulation_json(&r, true)))
    }

    pub async fn simulation_chart(&self, id: i64) -> Result<Option<String>> {
        let svg: Option<Option<String>> = sqlx::query_scalar("SELECT chart_svg FROM simulation_runs WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(svg.flatten())
    }

    pub async fn scaling_events(&self) -> Result<Vec<Value>> {
        let rows = sqlx::query(&format!(
            "SELECT id, {AT} AS at, pool, action, instance, reason, replica FROM scaling_events ORDER BY id DESC LIMIT 500"
        ))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| {
                serde_json::json!({"id": r.get::<i64, _>("id"), "at": r.get::<String, _>("at"), "pool": r.get::<String, _>("pool"),
                    "action": r.get::<String, _>("action"), "instance": r.get::<Option<i32>, _>("instance"),
                    "reason": r.get::<Value, _>("reason"), "replica": r.get::<String, _>("replica")})
            })
            .collect())
    }

    pub async fn audit_log(&self) -> Result<Vec<Value>> {
        let rows = sqlx::query(&format!(
            "SELECT id, {AT} AS at, actor, action, detail FROM audit_log ORDER BY id DESC LIMIT 500"
        ))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| {
                serde_json::json!({"id": r.get::<i64, _>("id"), "at": r.get::<String, _>("at"), "actor": r.get::<String, _>("actor"),
                    "action": r.get::<String, _>("action"), "detail": r.get::<Value, _>("detail")})
            })
            .collect())
    }
}

const AT: &str = "to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')";
const SIM_COLUMNS: &str = "id, state, error, submitted_by, \
    to_char(submitted_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS submitted_at, \
    to_char(finished_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS finished_at";

fn simulation_json(r: &sqlx::postgres::PgRow, with_result: bool) -> Value {
    let mut v = serde_json::json!({
        "id": r.get::<i64, _>("id"),
        "state": r.get::<String, _>("state"),
        "error": r.get::<Option<String>, _>("error"),
        "submitted_by": r.get::<String, _>("submitted_by"),
        "submitted_at": r.get::<String, _>("submitted_at"),
        "finished_at": r.get::<Option<String>, _>("finished_at"),
    });
    if with_result {
        v["result"] = r.get::<Option<Value>, _>("result").unwrap_or(Value::Null);
    }
    v
}

async fn audit<'e>(db: impl sqlx::PgExecutor<'e>, actor: &str, action: &str, detail: Value) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO audit_log (at, actor, action, detail) VALUES (to_timestamp($1), $2, $3, $4)")
        .bind(epoch_s(SystemTime::now()))
        .bind(actor)
        .bind(action)
        .bind(detail)
        .execute(db)
        .await?;
    Ok(())
}

/// Seconds since the Unix epoch, as PostgreSQL's `to_timestamp` takes them (microseconds
/// survive in an f64 for centuries).
fn epoch_s(at: SystemTime) -> f64 {
    at.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// Applies a queued write once: a write taken over from a spool may have reached the database
/// already (its replica died before emptying the spool), so rows carry the write's id, unique,
/// and an instance's state is set only over one not newer.
async fn apply(pool: &PgPool, w: &Spooled) -> Result<(), sqlx::Error> {
    let at = w.at_us as f64 / 1e6;
    match &w.write {
        Write::InstanceState { id, state } => {
            sqlx::query(
                "UPDATE instances SET state = $2, last_seen = to_timestamp($3) WHERE id = $1 AND last_seen <= to_timestamp($3)",
            )
            .bind(id)
            .bind(state)
            .bind(at)
            .execute(pool)
            .await?;
        }
        Write::Scaling { pool: name, action, reason, replica } => {
            sqlx::query(
                "INSERT INTO scaling_events (write_id, at, pool, action, reason, replica)
                 VALUES ($1, to_timestamp($2), $3, $4, $5, $6) ON CONFLICT (write_id) DO NOTHING",
            )
            .bind(&w.id)
            .bind(at)
            .bind(name)
            .bind(action)
            .bind(reason)
            .bind(replica)
            .execute(pool)
            .await?;
        }
        Write::Audit { actor, action, detail } => {
            sqlx::query(
                "INSERT INTO audit_log (write_id, at, actor, action, detail)
                 VALUES ($1, to_timestamp($2), $3, $4, $5) ON CONFLICT (write_id) DO NOTHING",
            )
            .bind(&w.id)
            .bind(at)
            .bind(actor)
            .bind(action)
            .bind(detail)
            .execute(pool)
            .await?;
        }
    }
    Ok(())
}

/// Applies queued writes in order, retrying each until the database takes it; empties the
/// spool whenever the queue is empty.
async fn write_behind(pool: PgPool, mut rx: mpsc::UnboundedReceiver<Spooled>, queue: Arc<Queue>) {
    while let Some(w) = rx.recv().await {
        let mut delay = Duration::from_millis(100);
        let mut warned = false;
        while let Err(e) = apply(&pool, &w).await {
            if !warned {
                tracing::warn!("database write delayed ({} queued): {e}", queue.backlog.load(Ordering::Relaxed));
                warned = true;
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
        }
        if warned {
            tracing::info!("database writes caught up");
        }
        let mut spool = super::lock::lock(&queue.spool);
        if queue.backlog.fetch_sub(1, Ordering::Relaxed) == 1 {
            if let Some(Err(e)) = spool.as_mut().map(Spool::clear) {
                tracing::warn!("{}", control::describe(&*e));
            }
        }
    }
}
