//! Registration with a control plane, repeated as a heartbeat: a control plane that restarted
//! (or lost the engine's record) learns of the engine again at the next beat.

use super::runner::Shared;
use crate::proto::{self, control_client::ControlClient};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Beat interval until the control plane names one.
const FIRST_BEAT: Duration = Duration::from_millis(500);

pub async fn keep_registered(
    control: String,
    token: String,
    addr: SocketAddr,
    pool: String,
    info: proto::EngineInfo,
    shared: Arc<Shared>,
) {
    let url = if control.contains("://") { control.clone() } else { format!("http://{control}") };
    let mut registered = false;
    loop {
        let request = proto::RegisterRequest {
            token: token.clone(),
            address: addr.to_string(),
            pool: pool.clone(),
            info: Some(info.clone()),
            draining: shared.draining.load(Ordering::Relaxed),
        };
        let result = async {
            let mut client = ControlClient::connect(url.clone()).await.map_err(|e| e.to_string())?;
            client.register(request).await.map(|r| r.into_inner()).map_err(|s| format!("{}: {}", s.code(), s.message()))
        }
        .await;
        let beat = match result {
            Ok(reply) => {
                if !registered {
                    tracing::info!(control = %url, instance = reply.instance_id, "registered");
                    registered = true;
                }
                Duration::from_millis(u64::from(reply.heartbeat_ms.clamp(100, 10_000)))
            }
            Err(e) => {
                if registered {
                    tracing::warn!(control = %url, "lost the control plane: {e}");
                } else {
                    tracing::warn!(control = %url, "cannot register: {e}");
                }
                registered = false;
                FIRST_BEAT
            }
        };
        tokio::time::sleep(beat).await;
    }
}
