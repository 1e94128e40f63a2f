//! What travels between the live fleet's tasks and its driver: a request's payload (its
//! tokens, its client and the client's OpenAI call), what the client receives ([`Delta`]),
//! and what the streams and engine tasks report ([`News`]).

use crate::engine_proc::Sampling;
use crate::proto::{self, FinishReason};
use engine::{Dur, InstanceId, Request, Time};
use policies::FleetEvent;
use serde_json::{Map, Value};
use std::num::NonZeroU64;
use tokio::sync::mpsc;

/// What a request's client receives.
#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    Tokens(Vec<u32>),
    /// The last message: why it ended, and the prompt tokens the cache served by tier on
    /// `instance`, the engine that finished it.
    Done {
        finish_reason: FinishReason,
        cached_tokens: [u32; 3],
        instance: InstanceId,
    },
    /// The request failed after it started; the message says why.
    Failed(String),
    /// A chunk of an engine's own OpenAI stream, for the client as it is (`tokens`: the
    /// output tokens it carries).
    Chunk {
        body: serde_json::Value,
        tokens: usize,
    },
    /// An engine's own stream ended, all its chunks passed on.
    End {
        cached_tokens: [u32; 3],
        instance: InstanceId,
    },
    /// An engine's whole (not streamed) OpenAI response.
    Whole {
        body: serde_json::Value,
        cached_tokens: [u32; 3],
        instance: InstanceId,
    },
    /// The engine refused the request: its HTTP status and OpenAI error body.
    Refused {
        status: u16,
        body: serde_json::Value,
    },
    /// Flow control refused it while it waited (the only delta it gets).
    Shed {
        reason: policies::ShedReason,
        retry_after: engine::Dur,
    },
}

/// A request's tokens and its client, kept by the fleet while the request runs.
#[derive(Debug)]
pub struct Payload {
    pub prompt: Vec<u32>,
    pub sampling: Sampling,
    pub out: mpsc::UnboundedSender<Delta>,
    /// Tokens streamed so far (a request placed again resumes after them).
    pub generated: Vec<u32>,
    /// Placements tried so far.
    pub attempts: u32,
    /// When its first token reached the control plane, in µs of the hub's clock (never 0:
    /// the clock has run since the request arrived): its TTFT, and the start of its TPOT.
    pub first_token_us: Option<NonZeroU64>,
    /// The client's OpenAI request, for engines with their own API (vLLM, SGLang).
    pub call: Option<Box<OpenAiCall>>,
    /// Whether the policy in force when it was dispatched orders engines' work by class:
    /// engines with their own API that schedule by priority are sent its class as one.
    pub class_priority: bool,
}

impl Payload {
    pub fn first_token_at(&self) -> Option<Time> {
        self.first_token_us.map(|t| Time(t.get()))
    }
}

/// A request whose prefill ended, its KV held by prefill engine `from` until the controller
/// pairs it with a decode engine.
#[derive(Debug)]
pub struct Parked {
    pub from: InstanceId,
    pub request: Request,
    pub payload: Payload,
    pub kv_tokens: u64,
    pub ttft: Dur,
    /// What an engine with its own API returned for the decode engine to find the KV by
    /// (vLLM's `kv_transfer_params`); ours export it over gRPC instead.
    pub handoff: Option<serde_json::Value>,
}

/// What the fleet's tasks report to the driver.
#[derive(Debug)]
pub enum News {
    Event(FleetEvent),
    /// An engine registered by an operator answers again after failing its health check
    /// (the driver revives it if it was taken out meanwhile).
    EngineBack {
        instance: InstanceId,
    },
    /// An engine's event stream ended: it is gone until it registers again.
    EngineLost {
        instance: InstanceId,
        why: String,
    },
    /// A request's stream broke (its engine vanished) or the engine evicted it: the driver
    /// places it again, resuming after the tokens it already streamed.
    Replace {
        from: InstanceId,
        request: Request,
        payload: Payload,
        why: String,
    },
    /// A request's prefill ended (or its transfer was refused): it waits for a decode engine.
    Parked(Parked),
    /// A draining engine holds no request any more (or cannot be asked): its process may stop.
    Drained {
        instance: InstanceId,
    },
    /// An engine reported a scheduling other than its last report's.
    Scheduling {
        instance: InstanceId,
        scheduling: proto::Scheduling,
    },
}

/// The client's OpenAI request, as an engine with its own API takes it.
#[derive(Debug, Clone)]
pub struct OpenAiCall {
    pub chat: bool,
    /// The request's JSON object, with `model` and `max_tokens` as routed.
    pub body: Map<String, Value>,
    /// The prompt as the engine tokenized it (from its first chunk): what a resumed request
    /// continues.
    pub engine_prompt: Option<Vec<u32>>,
}

impl OpenAiCall {
    pub fn streaming(&self) -> bool {
        self.body.get("stream").and_then(Value::as_bool).unwrap_or(false)
    }

    pub fn asked(&self, key: &str) -> bool {
        self.body.get(key).and_then(Value::as_bool).unwrap_or(false)
    }

    pub fn asked_usage(&self) -> bool {
        self.body.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false)
    }
}
