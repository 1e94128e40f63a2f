//! The control plane's gRPC service: engines register here, and keep registering as their
//! heartbeat.

use super::app::App;
use super::hub::Hub;
use super::live_fleet::MemberState;
use super::spool::Write;
use crate::proto::{self, control_server::Control};
use crate::tokenizer::{self, Check};
use engine::InstanceId;
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};

/// How often engines re-register.
pub const HEARTBEAT_MS: u32 = 1000;

pub struct Registry {
    pub app: Arc<App>,
}

#[tonic::async_trait]
impl Control for Registry {
    async fn register(&self, req: Request<proto::RegisterRequest>) -> Result<Response<proto::RegisterReply>, Status> {
        let r = req.into_inner();
        if !self.app.auth.is_engine(&r.token) {
            return Err(Status::unauthenticated("wrong engine token (FLEETPLANE_ENGINE_TOKEN)"));
        }
        let info = r.info.ok_or_else(|| Status::invalid_argument("registration without engine info"))?;
        if r.address.parse::<std::net::SocketAddr>().is_err() {
            return Err(Status::invalid_argument(format!("engine address `{}` is not host:port", r.address)));
        }
        if !matches!(r.pool.as_str(), "colocated" | "prefill" | "decode") {
            return Err(Status::invalid_argument(format!("unknown pool `{}`", r.pool)));
        }
        if info.block_size == 0 || info.capacity_tokens == 0 {
            return Err(Status::invalid_argument("engine reports no KV capacity"));
        }
        ensure_tokenizer(&self.app, &r.address, &info).await?;
        // Known engines (re-)register without the database; a new one needs it for its id.
        let known = {
            let hub = self.app.lock_hub();
            if let Some(m) = hub.fleet.block_size_conflict(&info.model, info.block_size) {
                return Err(Status::invalid_argument(format!(
                    "block size {} differs from {}'s {} for the same model",
                    info.block_size, m.info.name, m.info.block_size
                )));
            }
            let role = super::live_fleet::role_by_name(&r.pool).unwrap_or(policies::Role::Colocated);
            if let Some(m) = hub.fleet.pd_kind_conflict(super::vllm::EngineKind::Fleetplane, role) {
                return Err(Status::failed_precondition(format!(
                    "pool {} has {} (a {} engine): KV moves between engines of one kind",
                    r.pool,
                    m.info.name,
                    m.kind().name()
                )));
            }
            let known = hub.fleet.members().find(|m| m.address == r.address).map(|m| (m.id, m.state));
            known
        };
        let id = match known {
            Some((id, state)) if state != MemberState::Down => id,
            _ => {
                let id = self.app.store.register_instance(&r.address, &r.pool, &info).await.map_err(|e| {
                    Status::unavailable(format!("cannot record a new engine (database: {})", control::describe(&*e)))
                })?;
                InstanceId(id as u32)
            }
        };
        let mut hub = self.app.lock_hub();
        if hub.fleet.join(id, r.address.clone(), r.pool.clone(), info.clone()) {
            tracing::info!(instance = %id, address = %r.address, name = %info.name, "engine joined");
            price_as(&mut hub, &info);
            self.app.store.write(Write::InstanceState { id: id.0 as i32, state: "serving".into() });
        }
        if r.draining && hub.fleet.mark_draining(id) {
            tracing::info!(instance = %id, "engine drained by another control plane");
            // Stored again from the engine's own report: the replica that drained it may
            // have died before the database took its write.
            self.app.store.write(Write::InstanceState { id: id.0 as i32, state: "draining".into() });
        }
        hub.pump();
        Ok(Response::new(proto::RegisterReply { instance_id: id.0, heartbeat_ms: HEARTBEAT_MS }))
    }
}

/// A colocated fleet's routers price steps as the engine that joined last does: when its
/// model, GPU or layout gives other cost hints than those in force, the router is rebuilt
/// with them (what the controller knows of the fleet stays). A P/D fleet's hints are its
/// flags' (`--engine-model`, `--engine-gpu`, `--engine-profile`).
pub(super) fn price_as(hub: &mut Hub, info: &proto::EngineInfo) {
    let Some(shape) = info.cost.as_ref().filter(|_| hub.pools.is_none()) else { return };
    hub.priced_as = Some((shape.clone(), info.block_size));
    reprice(hub, &format!("engine {}'s steps", info.name));
}

/// Rebuilds the routers with the hints of the engine they price as, at the step budget in
/// force (a policy's, capped at the engine's own as the engines cap it): a smaller budget
/// computes prompts in smaller, slower chunks, and the routers' prefill rate must say so.
/// `why` names what changed ("engine e0's steps"), for the log.
pub(super) fn reprice(hub: &mut Hub, why: &str) {
    let Some((shape, block_size)) = hub.priced_as.clone() else { return };
    let asked = hub.fleet.scheduling().and_then(|s| s.max_batch_tokens);
    let budget = crate::scheduling::budget_in_force(asked, shape.max_batch_tokens);
    let shape = proto::CostShape { max_batch_tokens: budget, ..shape };
    match super::pools::engine_hints(&shape, block_size) {
        Ok(hints) if hints != hub.config.hints => {
            hub.config.hints = hints;
            hub.controller.set_router(&hub.config);
            tracing::info!(model = %shape.model, gpu = %shape.gpu, tp = shape.tp, budget, "routers price from {why}");
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("{why} cannot be priced, the routers' cost hints stay: {}", control::describe(&*e)),
    }
}

/// How long fetching a tokenizer from an engine may take.
const TOKENIZER_FETCH: Duration = Duration::from_secs(10);

/// Makes sure the gateway can tokenize an engine's model before the engine serves: fetches
/// the tokenizer the engine reports unless the fleet has it already, and refuses an engine
/// whose tokenizer is not the fleet's for its model (the engine's next heartbeat tries
/// again).
pub(super) async fn ensure_tokenizer(app: &App, address: &str, info: &proto::EngineInfo) -> Result<(), Status> {
    let name = &info.name;
    match app.tokenizers.check(&info.model, &info.tokenizer_sha256) {
        Ok(Check::Known) => return Ok(()),
        Ok(Check::Fetch) => {}
        Err(why) => return Err(Status::failed_precondition(format!("engine {name}: {why}"))),
    }
    let fetch = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| e.to_string())?
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        let mut client = app.engine_token.link(channel).max_decoding_message_size(proto::MAX_MESSAGE_BYTES);
        let reply = client.tokenizer(proto::TokenizerRequest {}).await.map_err(|s| s.message().to_string())?;
        Ok::<_, String>(reply.into_inner().json)
    };
    let json = match tokio::time::timeout(TOKENIZER_FETCH, fetch).await {
        Ok(Ok(json)) => json,
        Ok(Err(e)) => return Err(Status::unavailable(format!("cannot fetch engine {name}'s tokenizer: {e}"))),
        Err(_) => return Err(Status::unavailable(format!("engine {name} sent no tokenizer in {TOKENIZER_FETCH:?}"))),
    };
    // Parsing a large vocabulary takes a while: off the async threads.
    let loaded = tokio::task::spawn_blocking(move || tokenizer::parse(json))
        .await
        .map_err(|e| Status::internal(format!("reading engine {name}'s tokenizer: {e}")))?
        .map_err(|e| Status::invalid_argument(format!("engine {name}'s tokenizer: {e}")))?;
    if loaded.sha256 != info.tokenizer_sha256 {
        return Err(Status::invalid_argument(format!(
            "engine {name} sent a tokenizer whose SHA-256 is {}, not the {} it reported",
            loaded.sha256, info.tokenizer_sha256
        )));
    }
    let source = format!("engine {name} at {address}");
    app.tokenizers
        .insert(&info.model, loaded, source)
        .map_err(|e| Status::failed_precondition(format!("engine {name}: {e}")))
}
