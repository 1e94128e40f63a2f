//! A prefilled request's move from its prefill engine to the decode engine the controller
//! paired it with (`Command::Transfer`), and the rest of its stream from there.
//!
//! ```text
//! prefill engine ──Export──▶ control plane ──Import──▶ decode engine (reserves the KV, or refuses)
//!        ◀──Release── (once the decode engine took it)        └─ tokens 2.. ─▶ the client's stream
//! ```
//!
//! The client's stream goes on where the prefill engine's first token left it. The controller
//! hears `TransferDone` once the prefill engine's copy is released, `TransferRefused` when the
//! decode engine has no room (the KV stays where it is and the request waits to be paired
//! again), and the request's end from the decode engine. If the prefill engine lost the
//! request, it is placed again like one whose engine vanished.

use super::news::{Delta, News, Parked};
use super::stream::{relay, Ended, Lost, Reporter};
use crate::engine_auth::EngineLink;
use crate::proto;
use engine::InstanceId;
use policies::FleetEvent;
use tonic::Code;

pub(super) struct Carry {
    pub(super) parked: Parked,
    pub(super) to: InstanceId,
    pub(super) from_client: EngineLink,
    pub(super) to_client: EngineLink,
    /// The decode engine's lost signal, watched from before the import.
    pub(super) to_lost: Lost,
    /// The link's time for this KV, which the decode engine waits (a cost-model KV has no
    /// bytes to copy).
    pub(super) transfer_us: u64,
    pub(super) report: Reporter,
}

impl Carry {
    pub(super) async fn run(mut self) {
        let Parked { from, ref request, .. } = self.parked;
        let (id, to) = (request.id, self.to);
        let export = self.from_client.export(proto::ExportRequest { request_id: id.0 }).await;
        let handoff = match export {
            Ok(h) => h.into_inner(),
            Err(status) => {
                // Its KV is gone with the prefill engine: close the transfer, place it again.
                self.report.event(FleetEvent::TransferDone { request: id, from, to });
                let why = format!("{from} could not export it: {}", status.message());
                let Parked { request, payload, .. } = self.parked;
                self.report.ended(to, request, payload, Ended::Broke(why));
                return;
            }
        };
        let s = self.parked.payload.sampling;
        let import = proto::ImportRequest {
            handoff: Some(handoff),
            temperature: s.temperature,
            top_p: s.top_p,
            seed: s.seed,
            transfer_us: self.transfer_us,
        };
        let imported = tokio::select! {
            imported = self.to_client.import(import) => imported,
            () = self.to_lost.taken_out() => Err(tonic::Status::unavailable(format!("{to} was taken out"))),
        };
        let mut stream = match imported {
            Ok(stream) => stream.into_inner(),
            Err(status) if status.code() == Code::InvalidArgument => {
                // The decode engine will never take it: nothing better to do than fail it.
                self.release(from, id).await;
                self.report.event(FleetEvent::TransferDone { request: id, from, to });
                let Parked { request, payload, .. } = self.parked;
                let _ = payload.out.send(Delta::Failed(format!("{to} refused the hand-off: {}", status.message())));
                self.report.finished(to, &request, &payload, false);
                return;
            }
            Err(status) => {
                tracing::info!(request = %id, %from, %to, "transfer refused: {}", status.message());
                let _ = self.report.news.send(News::Parked(self.parked));
                self.report.event(FleetEvent::TransferRefused { request: id, from, to });
                return;
            }
        };
        self.release(from, id).await;
        self.report.event(FleetEvent::TransferDone { request: id, from, to });
        let Parked { request, mut payload, .. } = self.parked;
        let ended = relay(to, &mut stream, &mut self.to_lost, &mut payload, &self.report).await;
        self.report.ended(to, request, payload, ended);
    }

    /// Frees the prefill engine's copy of the KV.
    async fn release(&mut self, from: InstanceId, id: engine::RequestId) {
        match self.from_client.release(proto::ReleaseRequest { request_id: id.0 }).await {
            Ok(r) if r.get_ref().released => {}
            Ok(_) => tracing::warn!(request = %id, %from, "nothing to release: the prefill engine no longer held it"),
            Err(e) => tracing::warn!(request = %id, %from, "cannot release the prefilled KV: {}", e.message()),
        }
    }
}
