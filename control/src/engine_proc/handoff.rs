//! The engine process's side of P/D disaggregation: the engine crate's hand-off
//! ([`engine::Handoff`]) over gRPC.
//!
//! - A **prefill** engine queues requests with `enqueue_prefill_only`; once a request's first
//!   token is streamed, its `Generate` stream ends with `finish_reason` PREFILLED and the
//!   request parks here with its KV ([`Runner::park_handoffs`]). `Export` reads its state,
//!   `Release` frees its KV once a decode engine has it.
//! - A **decode** engine's `Import` reserves the KV at once (all or nothing: a full engine
//!   says so before anything moves), then lets it land: a GPU executor copies the KV's bytes
//!   (`Handoff::kv`, exported by the prefill engine's executor) into the reserved blocks at
//!   once, a cost model waits the transfer time the control plane gives (its KV has no bytes);
//!   then it decodes the rest of the output on the import's stream. An import the executor
//!   refuses (KV of another model's shape, no bytes for a GPU) gives the blocks back.
//!
//! A parked or landing request counts as in flight: a draining engine stops only when it holds
//! none (`DrainReply::in_flight`).

use super::runner::{Import, Imported, Runner, Stream};
use crate::proto::{self, FinishReason, GenerateChunk};
use engine::{Handoff, Rejected, RequestId, Time};
use std::sync::atomic::Ordering;
use std::time::Duration;
use tonic::Status;

/// A prefilled request waiting here for its KV to be sent.
pub struct Parked {
    handoff: Handoff,
    /// When it parked (engine time).
    since: Time,
    /// The prompt as this engine computed it, and the tokens it streamed.
    prompt: Vec<u32>,
    generated: Vec<u32>,
}

impl Runner {
    /// Ends the streams of requests whose prefill just ended and parks them.
    pub(super) fn park_handoffs(&mut self) {
        let mut handoffs = Vec::new();
        self.instance.take_handoffs(&mut handoffs);
        for handoff in handoffs {
            let id = handoff.request.id;
            let stream = self.streams.remove(&id);
            let listening = stream.as_ref().is_some_and(|s| !s.out.is_closed());
            let Some(Stream { out, prompt, sent, .. }) = stream.filter(|_| listening) else {
                // Nobody will ask for this hand-off: free its KV now.
                let now = self.now();
                self.instance.release_handoff(now, id);
                self.backend.release(id);
                self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
                continue;
            };
            let chunk = GenerateChunk {
                finish_reason: FinishReason::Prefilled.into(),
                kv_tokens: u64::from(handoff.kv_tokens),
                ..GenerateChunk::default()
            };
            let _ = out.send(Ok(chunk));
            let since = self.now();
            self.parked.insert(id, Parked { handoff, since, prompt, generated: sent });
        }
    }

    pub(super) fn export(&mut self, id: RequestId) -> Result<proto::Handoff, Status> {
        let p = self.parked.get(&id).ok_or_else(|| Status::not_found(format!("{id} is not parked here")))?;
        let blocks = self.instance.parked_blocks(id).expect("a parked request holds its blocks");
        let kv = self
            .backend
            .export_kv(id, blocks, p.handoff.kv_tokens)
            .map_err(|e| Status::internal(format!("cannot export the KV of {id}: {e}")))?;
        if kv.len() > crate::proto::MAX_MESSAGE_BYTES - (1 << 20) {
            return Err(Status::resource_exhausted(format!(
                "the KV of {id} takes {} bytes, more than one gRPC message carries ({} bytes)",
                kv.len(),
                crate::proto::MAX_MESSAGE_BYTES
            )));
        }
        let r = &p.handoff.request;
        let cached_tokens = r.resume.as_ref().map_or([0; 3], |x| x.cached_tokens);
        Ok(proto::Handoff {
            request_id: id.0,
            prompt: p.prompt.clone(),
            generated: p.generated.clone(),
            max_tokens: r.max_output_tokens,
            kv_tokens: u64::from(p.handoff.kv_tokens),
            cached_tokens: cached_tokens.to_vec(),
            kv,
        })
    }

    pub(super) fn import(&mut self, import: Import) -> Result<(), Status> {
        let Import { request, sampling, prompt, generated, kv, transfer, out } = import;
        let id = request.id;
        if self.streams.contains_key(&id) {
            return Err(Status::already_exists(format!("{id} is already running here")));
        }
        let produced = request.generated_before();
        let now = self.now();
        match self.instance.receive_transfer(now, request) {
            Ok(()) => {}
            Err((why @ Rejected::NoKvRoom { .. }, _)) => return Err(Status::resource_exhausted(why.to_string())),
            Err((why, _)) => return Err(Status::invalid_argument(why.to_string())),
        }
        let blocks = self.instance.parked_blocks(id).expect("the transfer was just received");
        let imported = Imported { id, prompt: &prompt, generated: &generated, sampling, kv: &kv };
        if let Err(why) = self.backend.import(&imported, blocks) {
            self.instance.abort_transfer(now, id);
            return Err(Status::invalid_argument(format!("cannot import {id}: {why}")));
        }
        self.shared.in_flight.fetch_add(1, Ordering::Relaxed);
        let stream = Stream { out, seed: sampling.seed, produced, prompt: Vec::new(), sent: Vec::new() };
        self.streams.insert(id, stream);
        // KV with bytes is in place now; a cost model's waits the link's modelled time.
        let lands = if kv.is_empty() { now + engine::Dur(transfer.as_micros() as u64) } else { now };
        self.landing.push((lands, id));
        Ok(())
    }

    pub(super) fn release(&mut self, id: RequestId) -> bool {
        if self.parked.remove(&id).is_none() {
            return false;
        }
        let now = self.now();
        let released = self.instance.release_handoff(now, id);
        debug_assert!(released, "{id} was parked here");
        self.backend.release(id);
        self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        true
    }

    /// Frees the KV of prefilled requests not sent on within `limit`: a control plane that
    /// died (or lost the request) never asks for them, and their KV must not stay held for
    /// ever. One the control plane asks for later is placed again from its tokens.
    pub(super) fn expire_parked(&mut self, limit: Duration) {
        let now = self.now();
        let limit_us = engine::Dur(limit.as_micros() as u64);
        let expired: Vec<RequestId> =
            self.parked.iter().filter(|(_, p)| now.since(p.since) >= limit_us).map(|(&id, _)| id).collect();
        for id in expired {
            tracing::warn!(request = %id, "prefilled request not sent on within {limit:?}: its KV is freed");
            self.release(id);
        }
    }

    /// Imported requests whose KV has landed start decoding.
    pub(super) fn land_transfers(&mut self) {
        if self.landing.is_empty() {
            return;
        }
        let now = self.now();
        let instance = &mut self.instance;
        self.landing.retain(|&(at, id)| {
            if at > now {
                return true;
            }
            let landed = instance.finish_transfer(now, id);
            debug_assert!(landed, "{id} was being received here");
            false
        });
    }

    /// Whether request `id`'s KV is still on its way here (it cannot be cancelled before).
    pub(super) fn is_landing(&self, id: RequestId) -> bool {
        self.landing.iter().any(|&(_, l)| l == id)
    }

    /// How long an idle loop may wait for a command: until the next transfer lands, at most
    /// `max`.
    pub(super) fn idle_wait(&self, max: Duration) -> Duration {
        let now = self.now();
        let next = self.landing.iter().map(|&(at, _)| at).min();
        next.map_or(max, |at: Time| Duration::from_micros(at.since(now).0).min(max))
    }
}
