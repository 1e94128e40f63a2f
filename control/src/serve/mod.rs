//! `fleetplane serve`: the live control plane. One HTTP address carries the OpenAI-compatible
//! gateway (`/v1`), the REST API (`/api`) and Prometheus metrics (`/metrics`); engines register
//! on a gRPC address. The same [`policies::Controller`] the simulator runs routes every request
//! ([`hub`]); fleet state lives in PostgreSQL ([`store`]); replicas on one database elect a
//! leader ([`leader`]).
//!
//! | file | what it is |
//! | --- | --- |
//! | **spine** | |
//! | `app.rs` | `App`: what every handler and task shares (hub, store, metrics, auth, known state) |
//! | `errors.rs` | `ApiError`: OpenAI's error shape, for the gateway and the REST API |
//! | `news.rs` | what tasks tell the driver (`News`) and clients receive (`Delta`); a request's `Payload` |
//! | `lock.rs` | locking shared state, also after a panic |
//! | **routing** | |
//! | `hub.rs` | the `Controller` and the `LiveFleet` under one mutex: flow control, place, events, re-placement |
//! | `live_fleet.rs` | `policies::Fleet` over our gRPC engines and vLLM's HTTP ones |
//! | `decisions.rs` | the router's latest decisions with their reasons (`/api/decisions`) |
//! | `stream.rs`, `transfer.rs` | a request's token stream to its client; a P/D hand-off |
//! | `pools.rs`, `actuator.rs` | `--mode pd`'s pool settings; starting and stopping engines |
//! | `registry.rs`, `engines.rs`, `vllm/` | engines registering (ours over gRPC; vLLM and SGLang by an operator) |
//! | **HTTP** | |
//! | `listener.rs` | the HTTP listener's limits (header and body deadlines, connection cap) |
//! | `gateway.rs`, `service.rs` | `/v1`: OpenAI-compatible completions and chat; the class, tenant, deadline and session a request asks for |
//! | `api.rs`, `openapi.json`, `policy.rs`, `simulations.rs` | `/api`: REST, its document, the policy set, background simulations |
//! | `auth.rs` | bearer tokens and roles |
//! | `metrics.rs` | `/metrics` |
//! | `console.rs`, `history.rs`, `sampler.rs`, `prefixes.rs` | `/console/` and the time series and shared prefixes it shows |
//! | **state** | |
//! | `store.rs`, `spool.rs` | PostgreSQL, the write-behind queue and its spool on disk |
//! | `leader.rs` | leader election among replicas |

mod actuator;
mod api;
mod app;
mod auth;
mod console;
mod decisions;
mod engines;
mod errors;
mod gateway;
mod history;
mod hub;
mod leader;
mod listener;
mod live_fleet;
mod lock;
mod metrics;
mod news;
mod policy;
pub mod pools;
mod prefixes;
mod registry;
mod sampler;
mod service;
mod simulations;
mod spool;
mod store;
mod stream;
mod transfer;
pub mod vllm;

use crate::tokenizer;
use crate::Failure;
use anyhow::Context;
use app::{App, Known};
use auth::Auth;
use axum::extract::{DefaultBodyLimit, State};
use axum::routing::{get, post};
use clap::Args as ClapArgs;
use hub::Hub;
use live_fleet::{LiveFleet, MemberState};
use lock::lock;
use metrics::{InstanceLabels, Metrics};
use news::News;
use policies::{ControllerConfig, RouterConfig};
use spool::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use store::Store;
use tokio::sync::{mpsc, Semaphore};

/// SLO targets until an operator sets them: (TTFT ms, TPOT ms).
pub const DEFAULT_SLO: (f64, f64) = (2000.0, 100.0);
/// An engine not heard from for this long is taken as gone.
const ENGINE_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest request body the HTTP address reads.
const BODY_LIMIT: usize = 16 << 20;

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/fleetplane";

#[derive(ClapArgs, Debug, Clone)]
pub struct Args {
    /// HTTP address of the gateway, the API and /metrics.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// gRPC address engines register at.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub grpc_listen: SocketAddr,

    #[command(flatten)]
    pub limits: listener::Limits,

    /// PostgreSQL database (created if missing).
    #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub database_url: String,

    /// Folder of the write-behind queue's spool on disk: writes queued while the database is
    /// down survive this replica's death, and the next replica of the database to start on
    /// this machine takes them over [default: $XDG_STATE_HOME/fleetplane/spool, else
    /// ~/.local/state/fleetplane/spool].
    #[arg(long, env = "FLEETPLANE_SPOOL_DIR")]
    pub spool_dir: Option<std::path::PathBuf>,

    /// Keep queued writes in memory only (lost if this replica dies before the database is back).
    #[arg(long, conflicts_with = "spool_dir")]
    pub no_spool: bool,

    /// Router until a policy is stored through the API.
    #[arg(long, default_value = "cache-aware")]
    pub router: String,

    /// Seed of the routers' random choices.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,

    /// This replica's name [default: fleetplane-PID].
    #[arg(long)]
    pub replica: Option<String>,

    /// The tokenizer of a model, as MODEL=PATH (PATH: a tokenizer.json or a folder holding
    /// one); repeat for several models. Engines report their model's own tokenizer, which is
    /// fetched from them when they register; a model without one gets the stand-in.
    #[arg(long, value_name = "MODEL=PATH")]
    pub tokenizer: Vec<String>,

    /// An engine that is not ours, as KIND=URL[,kv-events=ENDPOINT][,replay=ENDPOINT]
    /// [,tokenizer=PATH][,role=ROLE][,scheduling-policy=priority] (KIND: vllm or sglang;
    /// ENDPOINT: the tcp://host:port of the engine's --kv-events-config endpoint, which serve
    /// binds, and replay_endpoint; scheduling-policy=priority for an engine started with
    /// --scheduling-policy priority: it is sent each request's class); repeat for several. Stored, and registered again at every start until removed.
    #[arg(long = "engine", value_name = "KIND=URL,...")]
    pub engines: Vec<String>,

    /// A TOML file of such engines: `[[engine]]` tables with kind, url, kv_events, replay,
    /// role, tokenizer, scheduling_policy.
    #[arg(long = "engines", value_name = "FILE")]
    pub engines_file: Option<std::path::PathBuf>,

    #[command(flatten)]
    pub pools: pools::PoolArgs,
}

/// A new random token (for the demo's children).
pub fn new_token() -> anyhow::Result<String> {
    auth::generate()
}

fn token_from_env(var: &str, what: &str) -> anyhow::Result<String> {
    match std::env::var(var) {
        Ok(t) if !t.is_empty() => Ok(t),
        _ => {
            let t = auth::generate()?;
            println!("{what} (set {var} to choose it): {t}");
            Ok(t)
        }
    }
}

fn default_slo() -> simulator::slo::Slo {
    simulator::slo::Slo { ttft_ms: DEFAULT_SLO.0, tpot_ms: DEFAULT_SLO.1 }
}

pub fn run(args: Args) -> Result<(), Failure> {
    let router: RouterConfig = args.router.parse().map_err(|e| Failure::Input(anyhow::Error::from(e)))?;
    let tokenizers = tokenizer::Tokenizers::default();
    for pin in &args.tokenizer {
        let (model, path) =
            tokenizer::parse_pin(pin).map_err(|e| Failure::Input(anyhow::anyhow!("--tokenizer {e}")))?;
        let loaded = tokenizer::load(&path).map_err(Failure::Input)?;
        let source = path.display().to_string();
        tokenizers.insert(&model, loaded, source).map_err(|e| Failure::Input(anyhow::anyhow!("--tokenizer: {e}")))?;
    }
    // Checked before anything starts; the stored SLO targets replace the defaults.
    args.pools.pd_config(default_slo()).map_err(Failure::Input)?;
    args.limits.check().map_err(|e| Failure::Input(anyhow::anyhow!(e)))?;
    let mut engines = Vec::new();
    for arg in &args.engines {
        engines
            .push(arg.parse::<vllm::EngineSpec>().map_err(|e| Failure::Input(anyhow::anyhow!("--engine {arg}: {e}")))?);
    }
    if let Some(path) = &args.engines_file {
        engines.extend(engines::read_file(path).map_err(|e| Failure::Input(anyhow::anyhow!("--engines {e}")))?);
    }
    let runtime = crate::runtime()?;
    runtime.block_on(serve(args, router, tokenizers, engines)).map_err(Failure::Run)
}

async fn serve(
    args: Args,
    router: RouterConfig,
    tokenizers: tokenizer::Tokenizers,
    engines: Vec<vllm::EngineSpec>,
) -> anyhow::Result<()> {
    let mut nonce = [0u8; 4];
    getrandom::fill(&mut nonce).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
    let nonce = u32::from_le_bytes(nonce) & 0xff_ffff;
    let spool_dir = (!args.no_spool).then(|| args.spool_dir.clone().unwrap_or_else(spool::default_dir));
    let store = Store::open(&args.database_url, spool_dir.as_deref(), nonce).await?;
    let admin_token = token_from_env("FLEETPLANE_ADMIN_TOKEN", "admin token")?;
    let engine_token = token_from_env("FLEETPLANE_ENGINE_TOKEN", "engine token")?;
    let auth = Auth::new(&admin_token, &engine_token);
    let (live, _) = store.live_tokens().await?;
    auth.learn(live);
    let replica = args.replica.clone().unwrap_or_else(|| format!("fleetplane-{}", std::process::id()));
    let (news_tx, news_rx) = mpsc::unbounded_channel();
    let metrics = Arc::new(Metrics::new());
    let known_slo = store.slo().await?.unwrap_or(DEFAULT_SLO);
    let slo = simulator::slo::Slo { ttft_ms: known_slo.0, tpot_ms: known_slo.1 };
    let stored_policy = store.policy().await?;
    let known = Known { slo: known_slo, policy: stored_policy.clone(), pools: store.pools().await? };
    let pd = args.pools.pd_config(slo)?;
    let config = ControllerConfig { router, seed: args.seed, hints: args.pools.cost_hints()? };
    let present = crate::engine_auth::Present::new(&engine_token)?;
    let hub = Hub::new(config, pd, LiveFleet::new(news_tx, present.clone()), metrics.clone(), nonce);
    let app = Arc::new(App {
        hub: Mutex::new(hub),
        metrics,
        auth,
        store: store.clone(),
        replica,
        leader: Arc::new(AtomicBool::new(false)),
        simulations: Semaphore::new(1),
        policy_version: 0.into(),
        pool_args: pd.is_some().then(|| args.pools.clone()),
        recorder: history::Recorder::default(),
        history: history::History::default(),
        tokenizers,
        engine_token: present,
        http: reqwest::Client::builder().tcp_nodelay(true).build().context("cannot make an HTTP client")?,
        pending_engines: Mutex::default(),
        known: Mutex::new(known),
    });
    if let Some((version, policy, _, _)) = stored_policy {
        match policy::Policy::stored(policy, app.pool_args.as_ref()) {
            Ok(set) => app.apply_policy(set, version),
            Err(e) => tracing::warn!(version, "stored policy ignored: {e}"),
        }
    }
    recover_instances(&app).await;
    engines::start(&app, engines).await;

    let http = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let grpc = tokio::net::TcpListener::bind(args.grpc_listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.grpc_listen))?;
    let (http_addr, grpc_addr) = (http.local_addr()?, grpc.local_addr()?);
    if args.pools.actuator == pools::ActuatorKind::Local {
        let p = &args.pools;
        let launch = match &p.engine_command {
            Some(template) => {
                let (register, started) = mpsc::unbounded_channel();
                tokio::spawn(register_started(app.clone(), started));
                actuator::Launch::Command(actuator::EngineCommand { template: template.clone(), register })
            }
            None => actuator::Launch::Ours(actuator::OurEngine {
                exe: std::env::current_exe().context("cannot find this binary to start engines")?,
                control: if p.engine_control.is_empty() { grpc_addr.to_string() } else { p.engine_control.join(",") },
                engine_token: engine_token.clone(),
                model: p.engine_model.clone(),
                gpu: p.engine_gpu.clone(),
                profile: p.engine_profile.clone(),
                time_scale: p.engine_time_scale,
                kv_blocks: p.engine_kv_blocks,
            }),
        };
        app.lock_hub().fleet.set_actuator(Box::new(actuator::LocalProcesses::new(launch)));
    }

    tokio::spawn(drive(app.clone(), news_rx));
    tokio::spawn(sync_from_database(app.clone()));
    tokio::spawn(sampler::run(app.clone()));
    let leader_app = app.clone();
    tokio::spawn(leader::run(args.database_url.clone(), app.leader.clone(), move |leading| {
        leader_app.metrics.leader.set(i64::from(leading));
        tracing::info!(replica = %leader_app.replica, "{}", if leading { "leading" } else { "following" });
    }));

    let registry = proto_server(app.clone());
    let grpc_task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(registry)
            .serve_with_incoming_shutdown(crate::incoming(grpc), crate::shutdown_signal()),
    );
    println!("fleetplane {} serving http://{http_addr} (console /console/, gateway /v1, API /api, metrics /metrics); engines register at {grpc_addr}", app.replica);
    listener::serve(http, routes(app), args.limits, crate::shutdown_signal()).await?;
    grpc_task.await??;
    store.close();
    Ok(())
}

fn proto_server(app: Arc<App>) -> crate::proto::control_server::ControlServer<registry::Registry> {
    crate::proto::control_server::ControlServer::new(registry::Registry { app })
}

pub fn routes(app: Arc<App>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(gateway::completions))
        .route("/v1/chat/completions", post(gateway::chat_completions))
        .route("/v1/models", get(gateway::models))
        .route("/api/openapi.json", get(api::openapi))
        .route("/api/fleet", get(api::fleet))
        .route("/api/instances", get(api::instances))
        .route("/api/instances/{id}/drain", post(api::drain_instance))
        .route("/api/engines", get(api::engines).post(api::register_engine))
        .route("/api/engines/{id}", axum::routing::delete(api::remove_engine))
        .route("/api/pools", get(api::pools))
        .route("/api/policies", get(api::get_policy).put(api::put_policy))
        .route("/api/policies/history", get(api::policy_history))
        .route("/api/policies/file", post(api::post_policy_file))
        .route("/api/slo", get(api::get_slo).put(api::put_slo))
        .route("/api/simulations", get(api::simulations).post(api::submit_simulation))
        .route("/api/simulations/{id}", get(api::simulation))
        .route("/api/simulations/{id}/chart.svg", get(api::simulation_chart))
        .route("/api/scaling-events", get(api::scaling_events))
        .route("/api/decisions", get(api::decisions))
        .route("/api/audit", get(api::audit_log))
        .route("/api/history", get(api::history))
        .route("/api/prefixes", get(api::prefixes))
        .route("/api/scenarios", get(api::scenarios))
        .route("/api/tokens", get(api::tokens).post(api::create_token))
        .route("/api/tokens/{name}", axum::routing::delete(api::revoke_token))
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(|| async { "ok" }))
        .merge(console::routes())
        .fallback(no_route)
        .method_not_allowed_fallback(no_method)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(app)
}

/// A path nothing serves: the error in the gateway's and the API's shape, not an empty 404.
async fn no_route(method: axum::http::Method, uri: axum::http::Uri) -> errors::ApiError {
    errors::ApiError::new(
        axum::http::StatusCode::NOT_FOUND,
        "not_found",
        format!("nothing is served at {method} {}", uri.path()),
    )
}

/// A method a path does not take (405), in the same shape.
async fn no_method(method: axum::http::Method, uri: axum::http::Uri) -> errors::ApiError {
    let why = format!("{} does not take {method}", uri.path());
    errors::ApiError::new(axum::http::StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", why)
}

async fn render_metrics(State(app): State<Arc<App>>) -> String {
    {
        let hub = app.lock_hub();
        let mut serving = 0;
        let mut by_kind = std::collections::BTreeMap::<(&str, &str), i64>::new();
        for m in hub.fleet.members() {
            // Every state of a kind present, so that one emptied reads 0.
            for state in [MemberState::Serving, MemberState::Draining, MemberState::Down] {
                by_kind.entry((m.kind().name(), state.name())).or_default();
            }
            *by_kind.entry((m.kind().name(), m.state.name())).or_default() += 1;
            let labels = InstanceLabels { instance: m.info.name.clone(), pool: m.pool.clone() };
            let total = f64::from(m.load.kv_total_blocks.max(1));
            app.metrics.kv_usage.get_or_create(&labels).set(f64::from(m.load.kv_used_blocks) / total);
            app.metrics.waiting.get_or_create(&labels).set(i64::from(m.load.waiting));
            serving += i64::from(m.state == MemberState::Serving);
        }
        app.metrics.instances_serving.set(serving);
        app.metrics.unmatched_ends.set(hub.controller.unmatched_ends() as i64);
        for ((kind, state), n) in by_kind {
            app.metrics.engines.get_or_create(&metrics::KindState { kind: kind.into(), state: state.into() }).set(n);
        }
        if let Some(st) = hub.controller.pools() {
            for (pool, load, size) in [("prefill", st.loads.load_p, st.prefill), ("decode", st.loads.load_d, st.decode)]
            {
                app.metrics.load.get_or_create(&metrics::PoolLabel { pool: pool.into() }).set(load);
                for (state, n) in [("serving", size.serving), ("starting", size.starting), ("draining", size.draining)]
                {
                    let labels = metrics::PoolState { pool: pool.into(), state: state.into() };
                    app.metrics.pool_instances.get_or_create(&labels).set(i64::from(n));
                }
            }
        }
    }
    app.metrics.render()
}

/// Applies what the fleet's tasks learn, and runs the controller's periodic work.
async fn drive(app: Arc<App>, mut news: mpsc::UnboundedReceiver<News>) {
    let mut ticker = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            n = news.recv() => {
                let Some(n) = n else { return };
                let mut lost = Vec::new();
                let mut back = Vec::new();
                let mut hub = app.lock_hub();
                let mut next = Some(n);
                // Take everything queued under one lock.
                while let Some(n) = next {
                    match &n {
                        News::EngineLost { instance, .. } | News::Drained { instance } => lost.push(*instance),
                        News::EngineBack { instance } => back.push(*instance),
                        _ => {}
                    }
                    hub.handle(n);
                    next = news.try_recv().ok();
                }
                let scaling = hub.new_scaling_events();
                drop(hub);
                for id in lost {
                    app.store.write(Write::InstanceState { id: id.0 as i32, state: "down".into() });
                }
                for id in back {
                    app.store.write(Write::InstanceState { id: id.0 as i32, state: "serving".into() });
                }
                store_scaling(&app, scaling);
            }
            _ = ticker.tick() => {
                let mut hub = app.lock_hub();
                let mut stale: Vec<_> = hub
                    .fleet
                    .members()
                    .filter(|m| m.state != MemberState::Down && m.last_seen.elapsed() > ENGINE_TIMEOUT)
                    .map(|m| m.id)
                    .collect();
                for id in &stale {
                    tracing::warn!(instance = %id, "engine silent for {ENGINE_TIMEOUT:?}: taken as gone");
                    hub.fleet.lose(*id);
                }
                hub.sweep_flow();
                hub.pump();
                let leading = app.leader.load(Ordering::Relaxed);
                hub.set_leading(leading);
                hub.tick();
                if leading {
                    stale.extend(hub.fleet.check_actuated());
                    watch_drains(&mut hub);
                }
                let scaling = hub.new_scaling_events();
                drop(hub);
                for id in stale {
                    app.store.write(Write::InstanceState { id: id.0 as i32, state: "down".into() });
                }
                store_scaling(&app, scaling);
            }
        }
    }
}

/// Starts waiting for each draining engine the actuator started to empty, so that its
/// process can stop.
fn watch_drains(hub: &mut Hub) {
    let news = hub.fleet.news();
    let Some(actuator) = hub.fleet.actuator() else { return };
    let watch: Vec<_> = hub
        .fleet
        .members()
        .filter(|m| m.state == MemberState::Draining && !m.drain_watched && actuator.owns(&m.address))
        .map(|m| (m.id, m.client(), m.external().cloned()))
        .collect();
    for (id, client, external) in watch {
        if let Some(m) = hub.fleet.member_mut(id) {
            m.drain_watched = true;
        }
        match (client, external) {
            (Some(client), _) => drop(tokio::spawn(actuator::watch_drain(id, client, news.clone()))),
            (None, Some(engine)) => drop(tokio::spawn(actuator::watch_drain_external(id, engine, news.clone()))),
            (None, None) => {}
        }
    }
}

/// Registers the engines the actuator started from `--engine-command` (each tried every
/// second until it answers, as one named on the command line).
async fn register_started(app: Arc<App>, mut started: mpsc::UnboundedReceiver<vllm::EngineSpec>) {
    while let Some(spec) = started.recv().await {
        lock(&app.pending_engines).insert(spec.url.clone(), (spec.clone(), "starting".into()));
        tokio::spawn(engines::keep_registering(app.clone(), spec));
    }
}

/// Stores scaling decisions with the loads that caused them.
fn store_scaling(app: &App, events: Vec<policies::ScalingEvent>) {
    for e in events {
        let action = if e.to > e.from { "scale_up" } else { "scale_down" };
        let reason = serde_json::json!({
            "by": format!("autoscaler {}", e.autoscaler),
            "why": e.reason,
            "from": e.from,
            "to": e.to,
            "at_s": e.at_s,
            "loads": e.loads,
        });
        let (pool, action) = (e.pool.name().into(), action.into());
        app.store.write(Write::Scaling { pool, action, reason, replica: app.replica.clone() });
    }
}

/// Keeps what other replicas change (tokens, policy, SLO targets) in force here too, and the
/// copies the API reads from memory up to date. A database that does not answer changes
/// nothing: what is known stays in force.
async fn sync_from_database(app: Arc<App>) {
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        if let Ok((live, revoked)) = app.store.live_tokens().await {
            app.auth.learn(live);
            for h in revoked {
                app.auth.forget(&h);
            }
        }
        if let Ok(Some((ttft_ms, tpot_ms))) = app.store.slo().await {
            lock(&app.known).slo = (ttft_ms, tpot_ms);
            app.lock_hub().set_slo(ttft_ms, tpot_ms);
        }
        if let Ok(pools) = app.store.pools().await {
            lock(&app.known).pools = pools;
        }
        if let Ok(stored) = app.store.policy().await {
            lock(&app.known).learn_policy(stored.clone());
            if let Some((version, policy, _, _)) = stored {
                if version > app.policy_version.load(Ordering::SeqCst) {
                    if let Ok(set) = policy::Policy::stored(policy, app.pool_args.as_ref()) {
                        app.apply_policy(set, version);
                    }
                }
            }
        }
    }
}

/// Dials the engines the database lists as serving: those still alive rejoin at once,
/// before their next heartbeat.
async fn recover_instances(app: &Arc<App>) {
    let rows = match app.store.instances().await {
        Ok(rows) => rows,
        Err(e) => {
            tracing::warn!("cannot read instances: {}", control::describe(&*e));
            return;
        }
    };
    // Engines of ours only: those an operator registered are registered again (`engines`).
    for row in rows.into_iter().filter(|r| r.kind == "fleetplane" && r.state != "down" && r.state != "removed") {
        let url = format!("http://{}", row.address);
        let probe = async {
            let channel = tonic::transport::Endpoint::from_shared(url).ok()?.connect().await.ok()?;
            let mut client = app.engine_token.link(channel);
            client.info(crate::proto::InfoRequest {}).await.ok().map(|r| r.into_inner())
        };
        match tokio::time::timeout(Duration::from_secs(1), probe).await {
            Ok(Some(info)) => {
                if let Err(e) = registry::ensure_tokenizer(app, &row.address, &info).await {
                    tracing::warn!(instance = row.id, "engine not recovered: {}", e.message());
                    continue;
                }
                let mut hub = app.lock_hub();
                let id = engine::InstanceId(row.id as u32);
                if hub.fleet.join(id, row.address.clone(), row.pool.clone(), info.clone()) {
                    registry::price_as(&mut hub, &info);
                }
                hub.pump();
                tracing::info!(instance = row.id, address = %row.address, "engine recovered from the database");
            }
            _ => app.store.write(Write::InstanceState { id: row.id, state: "down".into() }),
        }
    }
}
