//! A request's token stream from its engine to its client: relayed as it arrives, and how it
//! ended reported to the driver (finished, prefilled and parked for a hand-off, or broken and to
//! be placed again), with the latencies the controller's SLO load hears.

use super::news::{Delta, News, Parked, Payload};
use crate::engine_auth::EngineLink;
use crate::proto::{self, FinishReason};
use engine::{Dur, InstanceId, Request, Time};
use policies::{FleetEvent, OutputEnd};
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;

/// How a request's token stream from an engine ended.
pub(super) enum Ended {
    /// The request finished; its client has the last message.
    Finished,
    /// A prefill engine computed its prompt and first token and holds its KV (`handoff`:
    /// what the decode engine finds it by, from an engine with its own API).
    Prefilled { kv_tokens: u64, handoff: Option<serde_json::Value> },
    /// Its client went away (dropping the stream cancels the call; the engine drops it).
    ClientGone,
    /// The stream broke or the engine evicted the request: it must be placed again.
    Broke(String),
}

/// Raised when an engine is taken out (its connection lost, or silent past the timeout while
/// its sockets stay open, as a stopped process's do): the requests streaming from it stop
/// waiting and are placed again.
#[derive(Clone)]
pub(super) struct LostSignal(Arc<watch::Sender<u64>>);

impl LostSignal {
    pub(super) fn new() -> LostSignal {
        LostSignal(Arc::new(watch::channel(0).0))
    }

    pub(super) fn raise(&self) {
        self.0.send_modify(|g| *g += 1);
    }

    /// What one request watches: only raises after this call count, so take it before the
    /// request is sent.
    pub(super) fn watch(&self) -> Lost {
        Lost(self.0.subscribe())
    }
}

/// One request's watch on its engine's [`LostSignal`].
pub(super) struct Lost(watch::Receiver<u64>);

impl Lost {
    /// Resolves when the engine is taken out. An engine whose signal is gone (removed from
    /// the fleet) never resolves it: the stream's own end or error decides then.
    pub(super) async fn taken_out(&mut self) {
        if self.0.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Relays an engine's token stream to the request's client until it ends.
pub(super) async fn relay(
    instance: InstanceId,
    stream: &mut tonic::Streaming<proto::GenerateChunk>,
    lost: &mut Lost,
    payload: &mut Payload,
    report: &Reporter,
) -> Ended {
    loop {
        let next = tokio::select! {
            next = stream.next() => next,
            () = payload.out.closed() => return Ended::ClientGone,
            () = lost.taken_out() => return Ended::Broke(format!("{instance} was taken out mid-stream")),
        };
        let mut chunk = match next {
            Some(Ok(chunk)) => chunk,
            Some(Err(status)) => return Ended::Broke(format!("{instance} failed mid-stream: {}", status.message())),
            None => return Ended::Broke(format!("{instance} closed the stream before the request finished")),
        };
        if !chunk.tokens.is_empty() {
            if payload.first_token_us.is_none() {
                payload.first_token_us = NonZeroU64::new(report.now().0.max(1));
            }
            payload.generated.extend_from_slice(&chunk.tokens);
            let _ = payload.out.send(Delta::Tokens(std::mem::take(&mut chunk.tokens)));
        }
        match chunk.finish_reason() {
            FinishReason::Unspecified => {}
            FinishReason::Evicted => return Ended::Broke(format!("{instance} evicted it under KV pressure")),
            FinishReason::Prefilled => return Ended::Prefilled { kv_tokens: chunk.kv_tokens, handoff: None },
            finish_reason @ (FinishReason::Length | FinishReason::Stop | FinishReason::CutShort) => {
                let mut cached_tokens = [0; 3];
                for (c, v) in cached_tokens.iter_mut().zip(&chunk.cached_tokens) {
                    *c = *v;
                }
                let _ = payload.out.send(Delta::Done { finish_reason, cached_tokens, instance });
                read_to_end(stream).await;
                return Ended::Finished;
            }
        }
    }
}

/// How long a finished request's stream may take to deliver the engine's trailers.
const TRAILERS_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// Reads a finished stream to its end (the gRPC trailers) once the client has its last
/// message. Dropping it earlier resets the HTTP/2 stream, and when the trailers then arrive
/// h2 counts a local error reset; after 1,024 of them on one connection it closes the
/// connection (GOAWAY "too_many_internal_resets"), failing every request and the event
/// stream on it. Measured at 4,000 requests/s before this.
async fn read_to_end(stream: &mut tonic::Streaming<proto::GenerateChunk>) {
    let drain = async { while let Some(Ok(_)) = stream.next().await {} };
    let _ = tokio::time::timeout(TRAILERS_WAIT, drain).await;
}

/// Where a request's fleet task reports what happened to it.
#[derive(Clone)]
pub(super) struct Reporter {
    pub(super) news: mpsc::UnboundedSender<News>,
    /// Whether the controller wants each finished request's latencies.
    pub(super) latencies: bool,
    /// The hub's clock (requests' arrival times are on it).
    pub(super) clock: Instant,
}

impl Reporter {
    pub(super) fn now(&self) -> Time {
        Time(self.clock.elapsed().as_micros() as u64)
    }

    pub(super) fn event(&self, e: FleetEvent) {
        let _ = self.news.send(News::Event(e));
    }

    /// The request left `instance`: finished, or its client went away.
    pub(super) fn finished(&self, instance: InstanceId, request: &Request, payload: &Payload, ok: bool) {
        let output =
            ok.then_some(OutputEnd { tokens: payload.generated.len() as u32, bound: request.max_output_tokens });
        self.event(FleetEvent::RequestFinished { instance, request: request.id, output });
        if let (true, true, Some(first)) = (ok, self.latencies, payload.first_token_at()) {
            let tokens = payload.generated.len() as u64;
            let tpot = (tokens >= 2).then(|| Dur(self.now().since(first).0 / (tokens - 1)));
            let ttft = first.since(request.arrival);
            self.event(FleetEvent::RequestLatency { instance, request: request.id, ttft, tpot });
        }
    }

    /// How a relayed stream ended, reported; a broken one comes back to be placed again.
    pub(super) fn ended(&self, instance: InstanceId, request: Request, payload: Payload, ended: Ended) {
        match ended {
            Ended::Finished => self.finished(instance, &request, &payload, true),
            Ended::ClientGone => self.finished(instance, &request, &payload, false),
            Ended::Prefilled { kv_tokens, handoff } => {
                let ttft = payload.first_token_at().unwrap_or_else(|| self.now()).since(request.arrival);
                let done = FleetEvent::PrefillDone {
                    instance,
                    request: request.id,
                    kv_tokens,
                    output_tokens: request.max_output_tokens,
                    ttft,
                };
                let _ =
                    self.news.send(News::Parked(Parked { from: instance, request, payload, kv_tokens, ttft, handoff }));
                self.event(done);
            }
            Ended::Broke(why) => {
                self.event(FleetEvent::RequestLost { instance, request: request.id });
                let _ = self.news.send(News::Replace { from: instance, request, payload, why });
            }
        }
    }
}

/// Streams one request from its engine to its client.
pub(super) async fn stream_request(
    instance: InstanceId,
    mut client: EngineLink,
    mut lost: Lost,
    request: Request,
    mut payload: Payload,
    report: Reporter,
) {
    payload.attempts += 1;
    let wire = proto::GenerateRequest {
        request_id: request.id.0,
        prompt: payload.prompt.clone(),
        max_tokens: request.max_output_tokens,
        temperature: payload.sampling.temperature,
        top_p: payload.sampling.top_p,
        seed: payload.sampling.seed,
        generated: payload.generated.clone(),
        class: proto::wire_class(request.service.engine_class()).into(),
    };
    let answer = tokio::select! {
        answer = client.generate(wire) => Some(answer),
        () = lost.taken_out() => None,
    };
    let ended = match answer {
        None => Ended::Broke(format!("{instance} was taken out before it took the request")),
        Some(Err(status)) if status.code() == tonic::Code::InvalidArgument => {
            let _ = payload.out.send(Delta::Failed(format!("{instance} refused the request: {}", status.message())));
            Ended::ClientGone
        }
        Some(Err(status)) => Ended::Broke(format!("{instance} did not take the request: {}", status.message())),
        Some(Ok(stream)) => relay(instance, &mut stream.into_inner(), &mut lost, &mut payload, &report).await,
    };
    report.ended(instance, request, payload, ended);
}
