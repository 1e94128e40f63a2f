//! Engines an operator registers (vLLM, SGLang), as opposed to ours, which register
//! themselves: from `serve --engine`, an `--engines` file and `POST /api/engines`. Each is
//! reached, its model's tokenizer loaded and its KV event endpoint bound before it joins the
//! fleet; it is stored in PostgreSQL and registered again when the control plane restarts.
//! One named on the command line, in the file or recovered from the database that does not
//! answer yet is tried again every second (`GET /api/engines` says why it is not serving).

use super::app::App;
use super::live_fleet::MemberState;
use super::lock::lock;
use super::spool::Write;
use super::vllm::{self, subscriber, EngineSpec};
use crate::tokenizer;
use axum::http::StatusCode;
use engine::InstanceId;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Why an engine could not be registered, with the HTTP status the API answers.
#[derive(Debug)]
pub struct RegisterError {
    pub status: StatusCode,
    pub message: String,
}

fn bad(message: impl Into<String>) -> RegisterError {
    RegisterError { status: StatusCode::BAD_REQUEST, message: message.into() }
}

fn unreachable(message: impl Into<String>) -> RegisterError {
    RegisterError { status: StatusCode::BAD_GATEWAY, message: message.into() }
}

/// An `--engines` file: `[[engine]]` tables with the fields of [`EngineSpec`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnginesFile {
    #[serde(default)]
    engine: Vec<EngineSpec>,
}

/// The engines of an `--engines` file, each checked; errors name the file and the engine.
pub fn read_file(path: &Path) -> Result<Vec<EngineSpec>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let file: EnginesFile = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut specs = file.engine;
    for (i, s) in specs.iter_mut().enumerate() {
        s.validate().map_err(|e| format!("{}: engine {} ({}): {e}", path.display(), i + 1, s.url))?;
    }
    Ok(specs)
}

/// Registers an engine: reaches it, loads its tokenizer, binds its KV event endpoint, stores
/// it and adds it to the fleet. Returns its instance id.
pub async fn register(app: &Arc<App>, mut spec: EngineSpec) -> Result<InstanceId, RegisterError> {
    spec.validate().map_err(bad)?;
    if let Some(m) = app.lock_hub().fleet.members().find(|m| m.address == spec.url && m.state != MemberState::Down) {
        return Err(RegisterError {
            status: StatusCode::CONFLICT,
            message: format!("{} is already registered as instance {}", spec.url, m.id),
        });
    }
    let probed = vllm::probe(&app.http, &spec).await.map_err(unreachable)?;
    let tokenizer_sha256 = ensure_tokenizer(app, &spec, &probed)?;
    if let Some(m) = app.lock_hub().fleet.block_size_conflict(&probed.model, probed.block_size) {
        return Err(bad(format!(
            "{}'s block size {} differs from {}'s {} for model `{}`",
            spec.url, probed.block_size, m.info.name, m.info.block_size, probed.model
        )));
    }
    let role = super::live_fleet::role_by_name(&spec.role).unwrap_or(policies::Role::Colocated);
    if let Some(m) = app.lock_hub().fleet.pd_kind_conflict(spec.kind, role) {
        return Err(bad(format!(
            "{} cannot serve in a P/D pool beside {} (a {} engine): KV moves between engines of one kind",
            spec.url,
            m.info.name,
            m.kind().name()
        )));
    }
    let sub = match &spec.kv_events {
        Some(endpoint) => {
            if let Some(r) = &spec.replay {
                subscriber::check_replay(r).await.map_err(unreachable)?;
            }
            Some(subscriber::bind(endpoint, spec.replay.clone()).await.map_err(unreachable)?)
        }
        None => None,
    };
    let host = spec.url.split("//").nth(1).unwrap_or(&spec.url).to_string();
    let info = crate::proto::EngineInfo {
        name: format!("{}@{host}", spec.kind.name()),
        model: probed.model.clone(),
        executor: spec.kind.name().to_string(),
        block_size: probed.block_size,
        kv_blocks: u32::try_from(probed.gpu_blocks).unwrap_or(u32::MAX),
        capacity_tokens: probed.capacity_tokens(),
        tokenizer_sha256,
        cost: None,
    };
    let engine = vllm::Engine::new(spec, probed, app.http.clone());
    let id = app.store.register_external(&engine.spec, &info).await.map_err(|e| RegisterError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: format!("cannot record the engine (database: {})", control::describe(&*e)),
    })?;
    let id = InstanceId(id as u32);
    let engine = Arc::new(engine);
    let mut hub = app.lock_hub();
    let news = hub.fleet.news();
    hub.fleet.join_external(id, engine.clone(), info);
    engine.start(id, sub, news);
    hub.pump();
    drop(hub);
    lock(&app.pending_engines).remove(&engine.spec.url);
    tracing::info!(instance = %id, url = %engine.spec.url, model = %engine.probed.model, kv_events = ?engine.spec.kv_events, "engine registered");
    Ok(id)
}

/// Loads the tokenizer (and chat template) the control plane tokenizes the engine's prompts
/// with: `tokenizer=PATH`, or the model folder the engine names when this machine can read it,
/// or one the fleet already has for the model. Returns its SHA-256.
fn ensure_tokenizer(app: &App, spec: &EngineSpec, probed: &vllm::Probed) -> Result<String, RegisterError> {
    let model = &probed.model;
    let path = spec
        .tokenizer
        .clone()
        .or_else(|| probed.root.as_ref().map(PathBuf::from).filter(|dir| tokenizer::in_model_dir(dir).is_some()));
    let Some(path) = path else {
        if let Some(sha) = app.tokenizers.sha256(model) {
            return Ok(sha);
        }
        return Err(bad(format!(
            "no tokenizer for model `{model}` of {}: its model folder ({}) is not readable here; give tokenizer=PATH (a model folder or tokenizer.json)",
            spec.url,
            probed.root.as_deref().unwrap_or("not reported")
        )));
    };
    let loaded = tokenizer::load(&path).map_err(|e| bad(control::describe(&*e)))?;
    let sha = loaded.sha256.clone();
    app.tokenizers.insert(model, loaded, path.display().to_string()).map_err(bad)?;
    Ok(sha)
}

/// Registers `spec`, trying again every second until it works or it is removed.
pub async fn keep_registering(app: Arc<App>, spec: EngineSpec) {
    let mut said = String::new();
    loop {
        match register(&app, spec.clone()).await {
            Ok(_) => return,
            Err(e) if e.status == StatusCode::CONFLICT => return,
            Err(e) => {
                if e.message != said {
                    tracing::warn!(url = %spec.url, "engine not serving yet: {}", e.message);
                    said = e.message.clone();
                }
                match lock(&app.pending_engines).get_mut(&spec.url) {
                    Some(p) => p.1 = e.message,
                    None => return, // removed meanwhile
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Starts registering the engines of the command line, the `--engines` file and the
/// database (those the command line names again take its spec).
pub async fn start(app: &Arc<App>, mut specs: Vec<EngineSpec>) {
    match app.store.external_engines().await {
        Ok(rows) => {
            for (id, spec) in rows {
                match serde_json::from_value::<EngineSpec>(spec) {
                    Ok(s) if s.actuated => {
                        // Its process stopped with the control plane that started it.
                        app.store.write(Write::InstanceState { id, state: "removed".into() });
                    }
                    Ok(s) if specs.iter().all(|c| c.url != s.url) => specs.push(s),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(instance = id, "stored engine spec not understood: {e}"),
                }
            }
        }
        Err(e) => tracing::warn!("cannot read the registered engines: {}", control::describe(&*e)),
    }
    for spec in specs {
        app.pending_engines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(spec.url.clone(), (spec.clone(), "not reached yet".into()));
        tokio::spawn(keep_registering(app.clone(), spec));
    }
}

/// Deregisters an engine an operator registered: it leaves the fleet and is not recovered.
pub fn remove(app: &App, id: InstanceId) -> Result<String, RegisterError> {
    let mut hub = app.lock_hub();
    let Some(m) = hub.fleet.member(id) else {
        return Err(RegisterError { status: StatusCode::NOT_FOUND, message: format!("no instance {id}") });
    };
    if m.external().is_none() {
        return Err(RegisterError {
            status: StatusCode::CONFLICT,
            message: format!("instance {id} is an engine of ours: drain it instead"),
        });
    }
    let url = m.address.clone();
    hub.fleet.remove(id);
    hub.pump();
    drop(hub);
    lock(&app.pending_engines).remove(&url);
    app.store.write(Write::InstanceState { id: id.0 as i32, state: "removed".into() });
    Ok(url)
}
