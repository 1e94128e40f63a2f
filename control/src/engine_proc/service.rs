//! The engine's gRPC service: requests in, token streams and events out.

use super::runner::{Command, Import, Sampling, Shared};
use crate::proto::{self, engine_server::Engine};
use engine::{Dur, Request, RequestId, Resume, Time};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{BroadcastStream, UnboundedReceiverStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request as GrpcRequest, Response, Status};

pub struct EngineService {
    pub commands: Mutex<Sender<Command>>,
    pub shared: Arc<Shared>,
    pub info: proto::EngineInfo,
    /// The model's tokenizer.json, if it has one.
    pub tokenizer: Option<Arc<Vec<u8>>>,
}

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl EngineService {
    fn send(&self, command: Command) -> Result<(), Status> {
        let sent = self.commands.lock().map_err(|_| Status::internal("engine loop lock poisoned"))?.send(command);
        sent.map_err(|_| Status::unavailable("engine loop has stopped"))
    }

    /// Sends a command that answers, and waits for the answer.
    async fn ask<T>(&self, command: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, Status> {
        let (reply, answer) = oneshot::channel();
        self.send(command(reply))?;
        answer.await.map_err(|_| Status::unavailable("engine loop has stopped"))
    }
}

/// Sampling parameters as the wire gives them, checked.
fn sampling(temperature: f32, top_p: f32, seed: u64) -> Result<Sampling, Status> {
    if !(temperature.is_finite() && temperature >= 0.0 && top_p > 0.0 && top_p <= 1.0) {
        return Err(Status::invalid_argument("temperature must be >= 0 and top_p in (0, 1]"));
    }
    Ok(Sampling { temperature, top_p, seed })
}

#[tonic::async_trait]
impl Engine for EngineService {
    type GenerateStream = Boxed<proto::GenerateChunk>;
    type EventsStream = Boxed<proto::EngineEvent>;
    type ImportStream = Boxed<proto::GenerateChunk>;

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
        let sampling = sampling(g.temperature, g.top_p, g.seed)?;
        let class = crate::proto::class_of(g.class());
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
            ends_after: None,
            block_hashes: engine::block_hashes(&prompt, self.info.block_size),
            resume: None,
            service: engine::Service { class, ..Default::default() },
            model: Default::default(),
        };
        let (out, rx) = mpsc::unbounded_channel();
        self.send(Command::Generate { request, prompt, sampling, out })?;
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }

    async fn export(&self, req: GrpcRequest<proto::ExportRequest>) -> Result<Response<proto::Handoff>, Status> {
        let id = RequestId(req.into_inner().request_id);
        self.ask(|reply| Command::Export { id, reply }).await?.map(Response::new)
    }

    async fn import(&self, req: GrpcRequest<proto::ImportRequest>) -> Result<Response<Self::ImportStream>, Status> {
        let i = req.into_inner();
        if self.shared.draining.load(Ordering::Relaxed) {
            return Err(Status::unavailable("engine is draining"));
        }
        let h = i.handoff.ok_or_else(|| Status::invalid_argument("import without a hand-off"))?;
        let generated = h.generated.len() as u32;
        if h.prompt.is_empty() || generated == 0 || generated >= h.max_tokens {
            return Err(Status::invalid_argument(format!(
                "a hand-off needs a prompt and 1 to max_tokens - 1 generated tokens (got {} prompt, {generated} generated, max_tokens {})",
                h.prompt.len(),
                h.max_tokens
            )));
        }
        let mut cached_tokens = [0; 3];
        for (c, v) in cached_tokens.iter_mut().zip(&h.cached_tokens) {
            *c = *v;
        }
        let request = Request {
            id: RequestId(h.request_id),
            arrival: Time::ZERO,
            prompt_tokens: h.prompt.len() as u32,
            max_output_tokens: h.max_tokens,
            ends_after: None,
            block_hashes: engine::block_hashes(&h.prompt, self.info.block_size),
            // The prefill engine's clock is not ours: the timeline starts here.
            resume: Some(Box::new(Resume {
                generated,
                admitted_at: Time::ZERO,
                first_token_at: Time::ZERO,
                cached_tokens,
                preemptions: 0,
                yields: 0,
                paused_wait: Dur::ZERO,
                evictions: 0,
            })),
            service: Default::default(),
            model: Default::default(),
        };
        let (out, rx) = mpsc::unbounded_channel();
        let import = Import {
            request,
            sampling: sampling(i.temperature, i.top_p, i.seed)?,
            prompt: h.prompt,
            generated: h.generated,
            kv: h.kv,
            transfer: std::time::Duration::from_micros(i.transfer_us),
            out,
        };
        self.ask(|reply| Command::Import { import, reply }).await??;
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }

    async fn release(&self, req: GrpcRequest<proto::ReleaseRequest>) -> Result<Response<proto::ReleaseReply>, Status> {
        let id = RequestId(req.into_inner().request_id);
        let released = self.ask(|reply| Command::Release { id, reply }).await?;
        Ok(Response::new(proto::ReleaseReply { released }))
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

    async fn configure(&self, req: GrpcRequest<proto::Scheduling>) -> Result<Response<proto::Scheduling>, Status> {
        let s = req.into_inner();
        let invalid = |e: crate::scheduling::Invalid| Status::invalid_argument(format!("{}: {}", e.field, e.reason));
        let (prefill, kv_protection) = crate::scheduling::resolve(&s).map_err(invalid)?;
        let class_priority = crate::scheduling::class_priority(&s).map_err(invalid)?;
        let program_hold = crate::scheduling::program_hold(&s).map_err(invalid)?;
        let max_batch_tokens = crate::scheduling::max_batch_tokens(&s).map_err(invalid)?;
        let now_in_force = self
            .ask(|reply| Command::Configure {
                prefill,
                kv_protection,
                class_priority,
                program_hold,
                max_batch_tokens,
                reply,
            })
            .await?;
        Ok(Response::new(now_in_force))
    }

    async fn info(&self, _req: GrpcRequest<proto::InfoRequest>) -> Result<Response<proto::EngineInfo>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn tokenizer(
        &self,
        _req: GrpcRequest<proto::TokenizerRequest>,
    ) -> Result<Response<proto::TokenizerReply>, Status> {
        let json = self.tokenizer.as_ref().ok_or_else(|| Status::not_found("this engine's model has no tokenizer"))?;
        Ok(Response::new(proto::TokenizerReply { json: json.to_vec() }))
    }
}
