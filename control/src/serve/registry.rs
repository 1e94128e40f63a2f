//! The control plane's gRPC service: engines register here, and keep registering as their
//! heartbeat.

use super::live_fleet::MemberState;
use super::store::Write;
use super::App;
use crate::proto::{self, control_server::Control};
use engine::InstanceId;
use std::sync::Arc;
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
        // Known engines (re-)register without the database; a new one needs it for its id.
        let known = {
            let hub = self.app.lock_hub();
            let mismatch = hub.fleet.members().find(|m| {
                m.state != MemberState::Down && m.info.model == info.model && m.info.block_size != info.block_size
            });
            if let Some(m) = mismatch {
                return Err(Status::invalid_argument(format!(
                    "block size {} differs from {}'s {} for the same model",
                    info.block_size, m.info.name, m.info.block_size
                )));
            }
            let known = hub.fleet.members().find(|m| m.address == r.address).map(|m| (m.id, m.state));
            known
        };
        let id =
            match known {
                Some((id, state)) if state != MemberState::Down => id,
                _ => {
                    let id =
                        self.app.store.register_instance(&r.address, &r.pool, &info).await.map_err(|e| {
                            Status::unavailable(format!("cannot record a new engine (database: {e:#})"))
                        })?;
                    InstanceId(id as u32)
                }
            };
        let mut hub = self.app.lock_hub();
        if hub.fleet.join(id, r.address.clone(), r.pool.clone(), info.clone()) {
            tracing::info!(instance = %id, address = %r.address, name = %info.name, "engine joined");
            self.app.store.write(Write::InstanceState { id: id.0 as i32, state: "serving" });
        }
        if r.draining && hub.fleet.mark_draining(id) {
            tracing::info!(instance = %id, "engine drained by another control plane");
        }
        hub.pump();
        Ok(Response::new(proto::RegisterReply { instance_id: id.0, heartbeat_ms: HEARTBEAT_MS }))
    }
}
