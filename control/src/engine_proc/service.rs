//! The engine's gRPC service: requests in, token streams and events out.

use super::runner::{Command, Sampling, Shared};
use crate::proto::{self, engine_server::Engine};
use engine::{Request, RequestId, Time};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{BroadcastStream, UnboundedReceiverStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request as GrpcRequest, Response, Status};

pub struct EngineService {
    pub commands: Mutex<Sender<Command>>,
    pub shared: Arc<Shared>,
    pub info: proto::EngineInfo,
}

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Engine for EngineService {
    type GenerateStream = Boxed<proto::GenerateChunk>;
    type EventsStream = Boxed<proto::EngineEvent>;

    async fn generate(
        &self,
        req: GrpcRequest<proto::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let g = req.into_inner();
        if self.shared.draining.load(Ordering::Relaxed) {
            return Err(Status::unavailable("engine is draining"));
        }
        if g.prompt.is_empty() {
            return Err(Status::invalid_argument("prompt is empty"));
        }
        if g.max_tokens == 0 {
            return Err(Status::invalid_argument("max_tokens must be at least 1"));
        }
        if !(g.temperature.is_finite() && g.temperature >= 0.0 && g.top_p > 0.0 && g.top_p <= 1.0) {
            return Err(Status::invalid_argument("temperature must be >= 0 and top_p in (0, 1]"));
        }
        let mut prompt = g.prompt;
        // Tokens generated before a resume are recomputed as part of the prompt.
        let generated = g.generated.len() as u32;
        if generated >= g.max_tokens {
            return Err(Status::invalid_argument("the resumed request already generated max_tokens"));
        }
        prompt.extend_from_slice(&g.generated);
        let request = Request {
            id: RequestId(g.request_id),
            arrival: Time::ZERO,
            prompt_tokens: prompt.len() as u32,
            max_output_tokens: g.max_tokens - generated,
            block_hashes: engine::block_hashes(&prompt, self.info.block_size),
            resume: None,
        };
        let (out, rx) = mpsc::unbounded_channel();
        let sampling = Sampling { temperature: g.temperature, top_p: g.top_p, seed: g.seed };
        let sent = self
            .commands
            .lock()
            .map_err(|_| Status::internal("engine loop lock poisoned"))?
            .send(Command::Generate { request, prompt, sampling, out });
        if sent.is_err() {
            return Err(Status::unavailable("engine loop has stopped"));
        }
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }

    async fn events(&self, _req: GrpcRequest<proto::EventsRequest>) -> Result<Response<Self::EventsStream>, Status> {
        let stream = BroadcastStream::new(self.shared.events.subscribe()).filter_map(|e| match e {
            Ok(e) => Some(Ok(e)),
            // A subscriber too slow to keep up loses events; the index it feeds is a hint.
            Err(lagged) => {
                tracing::warn!("events subscriber lagged: {lagged}");
                None
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn drain(&self, _req: GrpcRequest<proto::DrainRequest>) -> Result<Response<proto::DrainReply>, Status> {
        self.shared.draining.store(true, Ordering::Relaxed);
        tracing::info!("draining: no new requests");
        Ok(Response::new(proto::DrainReply { in_flight: self.shared.in_flight.load(Ordering::Relaxed) }))
    }

    async fn info(&self, _req: GrpcRequest<proto::InfoRequest>) -> Result<Response<proto::EngineInfo>, Status> {
        Ok(Response::new(self.info.clone()))
    }
}
