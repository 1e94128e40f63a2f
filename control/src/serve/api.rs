//! The REST API under `/api/` (admin tokens only): fleet, instances, pools, policies, SLO
//! targets, simulations, scaling events, tokens and the audit log. The OpenAPI document is at
//! `/api/openapi.json`.

use super::app::App;
use super::auth::{self, Principal, Role};
use super::errors::ApiError;
use super::live_fleet::MemberState;
use super::lock::lock;
use super::policy::{Policy, PREFILL_SCHEDULERS};
use super::spool::Write;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::InstanceId;
use policies::{AutoscalerConfig, Command, Fleet, RouterConfig};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;

type ApiResult = Result<Response, ApiError>;

fn admin(app: &App, headers: &HeaderMap) -> Result<Principal, ApiError> {
    app.auth.check(headers, Role::Admin)
}

fn db_error(e: anyhow::Error) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "database_unavailable",
        format!("database: {}", control::describe(&*e)),
    )
}

/// A body as axum read it, its rejection (too large, cut off) in the API's error shape.
fn raw_body(bytes: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    bytes.map_err(|e| ApiError::new(e.status(), "invalid_body", e.body_text()))
}

fn body<T: DeserializeOwned>(bytes: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = raw_body(bytes)?;
    serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(&bytes))
        .map_err(|e| ApiError::invalid_json("the body is not valid", e))
}

/// A path parameter (`{id}`, `{name}`) whose rejection is a 400 in the API's error shape
/// naming it, not axum's plain text.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(ApiPath(v)),
            Err(e) => Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_path", e.body_text())),
        }
    }
}

pub async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], include_str!("openapi.json")).into_response()
}

pub async fn fleet(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    let hub = app.lock_hub();
    let mut counts = std::collections::BTreeMap::<&str, u32>::new();
    for m in hub.fleet.members() {
        *counts.entry(m.state.name()).or_default() += 1;
    }
    Ok(Json(json!({
        "replica": app.replica,
        "leader": app.leader.load(Ordering::Relaxed),
        "router": hub.controller.router_name(),
        "router_label": hub.config.router.label(),
        "cost_hints": hub.config.hints,
        "instances": counts,
        "pending_database_writes": app.store.backlog(),
    }))
    .into_response())
}

/// The prompt prefixes recent requests share, most tokens saved first.
pub async fn prefixes(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    let hub = app.lock_hub();
    let top = hub.prefixes.top(20);
    Ok(Json(json!({"requests": hub.prefixes.requests(), "window": super::prefixes::WINDOW, "prefixes": top}))
        .into_response())
}

pub async fn instances(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    let hub = app.lock_hub();
    let list: Vec<Value> = hub
        .fleet
        .members()
        .map(|m| {
            let l = m.load;
            json!({
                "id": m.id.0,
                "name": m.info.name,
                "address": m.address,
                "pool": m.pool,
                "model": m.info.model,
                "executor": m.info.executor,
                "kind": m.kind(),
                "state": m.state,
                "capacity_tokens": m.info.capacity_tokens,
                "load": {
                    "waiting": l.waiting,
                    "running": l.running,
                    "kv_used_blocks": l.kv_used_blocks,
                    "kv_total_blocks": l.kv_total_blocks,
                    "kv_cached_blocks": l.kv_cached_blocks,
                    "prefill_tokens_left": l.prefill_tokens_left,
                    "decode_tokens_left": l.decode_tokens_left,
                    "admission_paused": l.admission_paused,
                },
                "scheduling": m.scheduling.as_ref().map(scheduling_json),
                "seconds_since_seen": m.last_seen.elapsed().as_secs_f64(),
            })
        })
        .collect();
    Ok(Json(json!({"instances": list})).into_response())
}

/// The engines an operator registered (vLLM, SGLang): those in the fleet with their health,
/// and those named that do not serve yet, with why.
pub async fn engines(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    let mut list: Vec<Value> = {
        let hub = app.lock_hub();
        hub.fleet
            .members()
            .filter_map(|m| {
                let e = m.external()?;
                Some(json!({
                    "id": m.id.0,
                    "kind": m.kind(),
                    "url": e.spec.url,
                    "kv_events": e.spec.kv_events,
                    "replay": e.spec.replay,
                    "role": e.spec.role,
                    "actuated": e.spec.actuated,
                    "model": m.info.model,
                    "block_size": m.info.block_size,
                    "capacity_tokens": m.info.capacity_tokens,
                    "state": m.state,
                    "healthy": m.state == MemberState::Serving,
                    "events": e.spec.kv_events.is_some().then(|| lock(&e.events).clone()),
                    "seconds_since_seen": m.last_seen.elapsed().as_secs_f64(),
                }))
            })
            .collect()
    };
    for (url, (spec, why)) in lock(&app.pending_engines).iter() {
        list.push(json!({"id": null, "kind": spec.kind, "url": url, "kv_events": spec.kv_events, "replay": spec.replay, "role": spec.role, "actuated": spec.actuated, "state": "pending", "healthy": false, "error": why}));
    }
    Ok(Json(json!({"engines": list})).into_response())
}

/// Registers an engine that is not ours; the answer names what was wrong when it cannot.
pub async fn register_engine(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    bytes: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let who = admin(&app, &headers)?;
    let spec: super::vllm::EngineSpec = body(bytes)?;
    let url = spec.url.clone();
    let id = super::engines::register(&app, spec)
        .await
        .map_err(|e| ApiError::new(e.status, "engine_not_registered", e.message))?;
    app.store.write(Write::Audit {
        actor: who.name,
        action: "engine.register".into(),
        detail: json!({"instance": id.0, "url": url}),
    });
    Ok((StatusCode::CREATED, Json(json!({"id": id.0, "url": url, "state": "serving"}))).into_response())
}

pub async fn remove_engine(State(app): State<Arc<App>>, headers: HeaderMap, ApiPath(id): ApiPath<u32>) -> ApiResult {
    let who = admin(&app, &headers)?;
    let url = super::engines::remove(&app, InstanceId(id))
        .map_err(|e| ApiError::new(e.status, "engine_not_removed", e.message))?;
    app.store.write(Write::Audit {
        actor: who.name,
        action: "engine.remove".into(),
        detail: json!({"instance": id, "url": url}),
    });
    Ok(Json(json!({"id": id, "url": url, "state": "removed"})).into_response())
}

pub async fn drain_instance(State(app): State<Arc<App>>, headers: HeaderMap, ApiPath(id): ApiPath<u32>) -> ApiResult {
    let who = admin(&app, &headers)?;
    {
        let mut hub = app.lock_hub();
        match hub.fleet.member(InstanceId(id)).map(|m| m.state) {
            None => return Err(ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no instance {id}"))),
            Some(MemberState::Serving) => {}
            Some(s) => {
                return Err(ApiError::new(StatusCode::CONFLICT, "not_serving", format!("instance {id} is {s:?}")));
            }
        }
        let now = hub.now();
        hub.fleet.apply(now, &Command::Drain { instance: InstanceId(id) });
        hub.pump();
    }
    app.store.write(Write::InstanceState { id: id as i32, state: "draining".into() });
    app.store.write(Write::Audit { actor: who.name, action: "instance.drain".into(), detail: json!({"instance": id}) });
    Ok((StatusCode::ACCEPTED, Json(json!({"instance": id, "state": "draining"}))).into_response())
}

pub async fn pools(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    let mut pools = lock(&app.known).pools.clone();
    let hub = app.lock_hub();
    for p in &mut pools {
        let name = p["name"].as_str().unwrap_or_default().to_string();
        let serving = hub.fleet.members().filter(|m| m.pool == name && m.state == MemberState::Serving).count();
        p["serving"] = json!(serving);
    }
    // A disaggregated fleet: the controller's view of the pools and their SLO loads.
    let pd = hub.controller.pools().map(|st| {
        let finite = |x: f64| x.is_finite().then_some(x);
        json!({
            "load_p": finite(st.loads.load_p),
            "load_d": finite(st.loads.load_d),
            "loads": st.loads,
            "prefill": st.prefill,
            "decode": st.decode,
            "waiting_handoffs": st.waiting_handoffs,
            "autoscaler": hub.pools.map(|p| p.autoscaler.name()),
            "actuator": hub.fleet.actuator().map(|a| a.name()),
        })
    });
    Ok(Json(json!({"pools": pools, "pd": pd})).into_response())
}

/// What is in force now: the controller's router and autoscaler with their parameters, and
/// each engine's scheduling as its last load report gave it.
fn in_force(app: &App) -> Value {
    let hub = app.lock_hub();
    let engines: Vec<Value> = hub
        .fleet
        .members()
        .filter(|m| m.state != MemberState::Down)
        .map(|m| json!({"id": m.id.0, "name": m.info.name, "scheduling": m.scheduling.as_ref().map(scheduling_json)}))
        .collect();
    json!({
        "router": hub.controller.router_name(),
        // The router as reports name it: its parameters that differ from the defaults.
        "router_label": hub.config.router.label(),
        "cost_hints": hub.config.hints,
        "router_params": hub.config.router.changed(),
        "autoscaler": hub.pools.map(|p| p.autoscaler.name()),
        "autoscaler_params": hub.pools.map(|p| p.autoscaler.values()),
        "engines": engines,
    })
}

/// An engine's reported scheduling in the policy's field names.
fn scheduling_json(s: &crate::proto::Scheduling) -> Value {
    let mut v = json!({
        "prefill_scheduler": s.prefill,
        "prefill_params": crate::scheduling::prefill_params(s),
        "kv_high_water": s.kv_high_water,
        "kv_low_water": s.kv_low_water,
        "class_priority": s.class_priority == Some(true),
        "max_batch_tokens": s.max_batch_tokens,
    });
    if let (Some(seconds), Some(share)) = (s.program_hold_s, s.program_hold_share) {
        v["program_hold_s"] = json!(seconds);
        v["program_hold_share"] = json!(share);
        if let Some(lead) = s.program_prefetch_s {
            v["program_prefetch_s"] = json!(lead);
        }
    }
    v
}

pub async fn get_policy(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    // From memory: the version this replica knows is the one in force here.
    let current = lock(&app.known).policy.clone();
    let in_force = in_force(&app);
    let mut v = match current {
        Some((version, policy, author, at)) => {
            json!({"version": version, "policy": Policy::normalized(policy), "author": author, "created_at": at})
        }
        None => {
            let router = in_force["router"].as_str().unwrap_or_default();
            let policy = serde_json::to_value(Policy::command_line(router)).unwrap_or_default();
            json!({"version": 0, "policy": Policy::normalized(policy), "author": "default"})
        }
    };
    v["in_force"] = in_force;
    // What an editor may offer; a PUT of anything else is refused with the same list.
    let autoscalers: &[&str] = if app.pool_args.is_some() { &AutoscalerConfig::NAMES } else { &["none"] };
    v["valid"] = json!({
        "router": RouterConfig::names(),
        "prefill_scheduler": PREFILL_SCHEDULERS,
        "autoscaler": autoscalers,
        "flow": policies::FlowConfig::NAMES,
        "command_line_autoscaler": app.pool_args.as_ref().map(|p| p.autoscaler.as_str()),
    });
    Ok(Json(v).into_response())
}

pub async fn policy_history(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    let mut versions = app.store.policy_history().await.map_err(db_error)?;
    for v in &mut versions {
        v["policy"] = Policy::normalized(v["policy"].take());
    }
    Ok(Json(json!({"versions": versions})).into_response())
}

pub async fn put_policy(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    bytes: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let who = admin(&app, &headers)?;
    store_policy(&app, who, body(bytes)?).await
}

/// Applies a policy file's text as `fleetplane tune` writes it (TOML, or JSON), as a new
/// version: the same checks and answer as `PUT /api/policies`.
pub async fn post_policy_file(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    bytes: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let who = admin(&app, &headers)?;
    let bytes = raw_body(bytes)?;
    let text = std::str::from_utf8(&bytes).map_err(|e| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_body", format!("the policy file is not UTF-8: {e}"))
    })?;
    store_policy(&app, who, Policy::from_text(text)?).await
}

/// Checks, stores (audited) and applies a new policy version; answers it with every field.
async fn store_policy(app: &App, who: Principal, policy: Policy) -> ApiResult {
    let set = policy.validate(app.pool_args.as_ref())?;
    let value = serde_json::to_value(&policy).map_err(|e| ApiError::invalid("policy", e.to_string()))?;
    let version = app.store.put_policy(&value, &who.name).await.map_err(db_error)?;
    app.apply_policy(set, version);
    if let Ok(stored) = app.store.policy().await {
        lock(&app.known).learn_policy(stored);
    }
    Ok(Json(json!({"version": version, "policy": Policy::normalized(value)})).into_response())
}

/// The largest SLO target, in milliseconds (the OpenAPI document's `maximum`): an hour.
const SLO_MAX_MS: f64 = simulator::slo::Slo::MAX_MS;

pub async fn get_slo(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    let (ttft_ms, tpot_ms) = lock(&app.known).slo;
    Ok(Json(json!({"ttft_ms": ttft_ms, "tpot_ms": tpot_ms})).into_response())
}

pub async fn put_slo(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    bytes: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let who = admin(&app, &headers)?;
    let slo: simulator::slo::Slo = body(bytes)?;
    if let Some((name, _)) = slo.out_of_range() {
        let why = format!("{name} must be a positive number of milliseconds, at most {SLO_MAX_MS} (an hour)");
        return Err(ApiError::invalid(name, why));
    }
    app.store.put_slo(slo.ttft_ms, slo.tpot_ms, &who.name).await.map_err(db_error)?;
    lock(&app.known).slo = (slo.ttft_ms, slo.tpot_ms);
    app.lock_hub().set_slo(slo.ttft_ms, slo.tpot_ms);
    Ok(Json(json!({"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms})).into_response())
}

pub async fn scaling_events(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    Ok(Json(json!({"events": app.store.scaling_events().await.map_err(db_error)?})).into_response())
}

/// A query string's parameters; one that does not parse is a 400 naming `param`.
fn query_of<T>(query: Result<Query<T>, QueryRejection>, param: &'static str) -> Result<T, ApiError> {
    query.map(|Query(q)| q).map_err(|e| ApiError::invalid(param, e.body_text()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionsQuery {
    limit: Option<usize>,
}

/// The router's latest decisions, oldest first, each with the reason it gave.
pub async fn decisions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    query: Result<Query<DecisionsQuery>, QueryRejection>,
) -> ApiResult {
    admin(&app, &headers)?;
    let q = query_of(query, "limit")?;
    let limit = q.limit.unwrap_or(super::decisions::KEPT);
    if !(1..=super::decisions::KEPT).contains(&limit) {
        return Err(ApiError::invalid("limit", format!("limit must be from 1 to {}", super::decisions::KEPT)));
    }
    let decisions = app.lock_hub().decisions.latest(limit);
    Ok(Json(json!({"decisions": decisions})).into_response())
}

pub async fn audit_log(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    Ok(Json(json!({"entries": app.store.audit_log().await.map_err(db_error)?})).into_response())
}

/// The longest token name, in characters (the OpenAPI document's `maxLength`).
const TOKEN_NAME_CHARS: usize = 64;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenBody {
    name: String,
    role: String,
}

pub async fn create_token(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    bytes: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let who = admin(&app, &headers)?;
    let t: TokenBody = body(bytes)?;
    let Some(role) = Role::parse(&t.role) else {
        return Err(ApiError::invalid("role", format!("unknown role `{}` (valid: inference, admin)", t.role)));
    };
    if t.name.is_empty() || t.name.chars().count() > TOKEN_NAME_CHARS {
        return Err(ApiError::invalid("name", format!("name must be 1 to {TOKEN_NAME_CHARS} characters")));
    }
    if t.name.chars().any(char::is_control) {
        // PostgreSQL's text cannot hold NUL; no name needs a control character.
        return Err(ApiError::invalid("name", "name must not contain control characters"));
    }
    let token = auth::generate()
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "no_randomness", e.to_string()))?;
    let hash = auth::hash(&token);
    app.store.create_token(&t.name, role, &hash, &who.name).await.map_err(|e| {
        if format!("{e:#}").contains("duplicate key") {
            ApiError::new(StatusCode::CONFLICT, "exists", format!("a token named `{}` exists", t.name))
        } else {
            db_error(e)
        }
    })?;
    app.auth.learn([(hash, Principal { name: t.name.clone(), role })]);
    Ok((StatusCode::CREATED, Json(json!({"name": t.name, "role": role.name(), "token": token}))).into_response())
}

pub async fn tokens(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    Ok(Json(json!({"tokens": app.store.tokens().await.map_err(db_error)?})).into_response())
}

pub async fn revoke_token(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    ApiPath(name): ApiPath<String>,
) -> ApiResult {
    let who = admin(&app, &headers)?;
    let not_found = || ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no live token named {name:?}"));
    // No token has such a name (they are refused at creation), and PostgreSQL's text holds no NUL.
    if name.chars().any(char::is_control) {
        return Err(not_found());
    }
    match app.store.revoke_token(&name, &who.name).await.map_err(db_error)? {
        None => Err(not_found()),
        Some(hash) => {
            app.auth.forget(&hash);
            Ok(StatusCode::NO_CONTENT.into_response())
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SimulationBody {
    /// A scenario file's text (TOML), as `fleetplane simulate --scenario` reads it.
    scenario: String,
    /// Routers to compare instead of the scenario's own `routers` (the console's what-if:
    /// the policy in force against the edited one on the same arrivals): run names, or objects
    /// of a `name` and the router's parameters.
    #[serde(default)]
    routers: Option<Vec<simulator::scenario::RouterEntry>>,
    /// KV water marks for the runs written `router@…+hw` (the edited policy's), with `routers`.
    #[serde(default)]
    water_marks: Option<super::simulations::WaterMarks>,
}

pub async fn submit_simulation(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    bytes: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let who = admin(&app, &headers)?;
    let b: SimulationBody = body(bytes)?;
    let scenario = match &b.routers {
        Some(routers) => super::simulations::with_routers(&b.scenario, routers, b.water_marks)
            .map_err(|e| ApiError::invalid("scenario", e))?,
        None if b.water_marks.is_some() => {
            return Err(ApiError::invalid("water_marks", "water_marks go with routers (the what-if's runs)"))
        }
        None => b.scenario,
    };
    super::simulations::validate(&scenario).map_err(|e| ApiError::invalid("scenario", e))?;
    let id = app.store.submit_simulation(&scenario, &who.name).await.map_err(db_error)?;
    super::simulations::spawn(app.clone(), id, scenario);
    Ok((StatusCode::ACCEPTED, Json(json!({"id": id, "state": "queued"}))).into_response())
}

pub async fn simulations(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    Ok(Json(json!({"simulations": app.store.simulations().await.map_err(db_error)?})).into_response())
}

pub async fn simulation(State(app): State<Arc<App>>, headers: HeaderMap, ApiPath(id): ApiPath<i64>) -> ApiResult {
    admin(&app, &headers)?;
    match app.store.simulation(id).await.map_err(db_error)? {
        Some(v) => Ok(Json(v).into_response()),
        None => Err(ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no simulation {id}"))),
    }
}

pub async fn simulation_chart(State(app): State<Arc<App>>, headers: HeaderMap, ApiPath(id): ApiPath<i64>) -> ApiResult {
    admin(&app, &headers)?;
    match app.store.simulation_chart(id).await.map_err(db_error)? {
        Some(svg) => Ok(([(header::CONTENT_TYPE, "image/svg+xml")], svg).into_response()),
        None => Err(ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("simulation {id} has no chart (yet)"))),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistoryQuery {
    /// Only samples taken after this time (milliseconds since the Unix epoch).
    #[serde(default)]
    since_ms: u64,
}

pub async fn history(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    query: Result<Query<HistoryQuery>, QueryRejection>,
) -> ApiResult {
    admin(&app, &headers)?;
    let q = query_of(query, "since_ms")?;
    if q.since_ms > super::gateway::JSON_SAFE_MAX {
        let why = format!("since_ms must be at most {}", super::gateway::JSON_SAFE_MAX);
        return Err(ApiError::invalid("since_ms", why));
    }
    Ok(Json(json!({
        "interval_ms": 1000,
        "window_seconds": super::history::WINDOW.as_secs(),
        "capacity": super::history::CAPACITY,
        "samples": app.history.since(q.since_ms),
    }))
    .into_response())
}

pub async fn scenarios(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult {
    admin(&app, &headers)?;
    Ok(Json(json!({"scenarios": super::simulations::examples()})).into_response())
}
