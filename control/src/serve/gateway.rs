//! The OpenAI-compatible gateway: `/v1/completions`, `/v1/chat/completions` (each streaming
//! over server-sent events or not) and `/v1/models`, with errors in OpenAI's format. Every
//! request is routed by the controller like a simulated one.

use super::app::App;
use super::auth::Role;
use super::errors::ApiError;
use super::history::Finished;
use super::hub::{Admitted, Refused};
use super::live_fleet::MemberState;
use super::news::{Delta, OpenAiCall, Payload};
use crate::engine_proc::Sampling;
use crate::tokenizer::{TextDecoder, Tokenizer, Tokenizers};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::{InstanceId, Request, RequestId};
use policies::{PlaceError, Reject, ShedReason};
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// Largest `max_tokens` accepted (a larger value is almost surely a mistake).
const MAX_TOKENS_LIMIT: u32 = 1 << 20;
/// The largest integer every JSON client reads exactly (2^53 − 1): the bound of the integers
/// the API takes that have no smaller one of their own (a seed, a time in milliseconds).
pub const JSON_SAFE_MAX: u64 = (1 << 53) - 1;

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Content,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The fields both endpoints share; others OpenAI defines are accepted and ignored unless
/// they would change the output (those are refused, naming the field).
#[derive(Deserialize)]
struct Body {
    model: Option<String>,
    prompt: Option<Prompt>,
    messages: Option<Vec<Message>>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    n: Option<u32>,
    stop: Option<Value>,
    logprobs: Option<Value>,
    echo: Option<bool>,
    best_of: Option<u32>,
    logit_bias: Option<Value>,
    suffix: Option<Value>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    functions: Option<Value>,
    function_call: Option<Value>,
    response_format: Option<Value>,
    /// OpenAI's service tier, read as the request's class (see [`super::service`]).
    service_tier: Option<String>,
}

/// The chat roles engines of ours render (a `tool` message answers a tool call, which they
/// never make).
const CHAT_ROLES: [&str; 4] = ["system", "developer", "user", "assistant"];

/// Whether `v` is absent in effect: JSON null, or the empty value of its type.
fn unset(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(Value::Object(o)) => o.is_empty(),
        Some(_) => false,
    }
}

impl Body {
    /// The first field engines of ours do not honour, as the 400 that names it: a field that
    /// would change the output and is not the default's value (`None`: all are honoured).
    fn unhonoured(&self) -> Option<ApiError> {
        let refuse = |param: &'static str, why: &str| Some(ApiError::invalid(param, format!("`{param}` {why}")));
        if self.n.is_some_and(|n| n != 1) {
            return refuse("n", "must be 1: one choice per request");
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return refuse("best_of", "must be 1: one candidate per request");
        }
        if !unset(&self.stop) {
            return refuse("stop", "is not supported by this gateway yet (stop sequences)");
        }
        if self.logprobs.as_ref().is_some_and(|l| !l.is_null() && *l != Value::Bool(false)) {
            return refuse("logprobs", "is not supported");
        }
        if self.echo == Some(true) {
            return refuse("echo", "is not supported");
        }
        if !unset(&self.logit_bias) {
            return refuse("logit_bias", "is not supported: engines sample without biases");
        }
        if !unset(&self.suffix) {
            return refuse("suffix", "is not supported (insertion)");
        }
        for (param, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if v.is_some_and(|p| p != 0.0) {
                return refuse(param, "is not supported: engines sample without penalties (give 0 or leave it out)");
            }
        }
        for (param, v) in [("tools", &self.tools), ("functions", &self.functions)] {
            if !unset(v) {
                return refuse(param, "is not supported: engines of this model call no tools");
            }
        }
        for (param, v) in [("tool_choice", &self.tool_choice), ("function_call", &self.function_call)] {
            if !unset(v) && v.as_ref().and_then(Value::as_str) != Some("none") {
                return refuse(param, "is not supported: engines of this model call no tools (only `none`)");
            }
        }
        if !unset(&self.response_format)
            && self.response_format.as_ref().and_then(|f| f.get("type")) != Some(&json!("text"))
        {
            return refuse("response_format", "is not supported: only {\"type\": \"text\"} (no JSON mode or schema)");
        }
        let mut roles = self.messages.iter().flatten().enumerate();
        if let Some((i, m)) = roles.find(|(_, m)| !CHAT_ROLES.contains(&m.role.as_str())) {
            let why = format!("role `{}` is not one of {}", m.role, CHAT_ROLES.join(", "));
            return Some(ApiError::invalid(format!("messages[{i}].role"), why));
        }
        None
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

pub async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(app, headers, body, Kind::Completion).await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(app, headers, body, Kind::Chat).await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = app.auth.check(&headers, Role::Inference) {
        return e.into_response();
    }
    let hub = app.lock_hub();
    let mut names: Vec<String> =
        hub.fleet.members().filter(|m| m.state == MemberState::Serving).map(|m| m.info.model.clone()).collect();
    names.sort();
    names.dedup();
    let data: Vec<Value> =
        names.iter().map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "fleetplane"})).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

struct Parsed {
    kind: Kind,
    /// A field only engines with their own OpenAI API (vLLM, SGLang) serve: refused when
    /// the model has engines of ours.
    unsupported: Option<ApiError>,
    /// The request's JSON object, for those engines.
    raw: serde_json::Map<String, Value>,
    model: String,
    prompt: Vec<u32>,
    /// The model's tokenizer (or the stand-in): it made `prompt` from text, and turns the
    /// output into text.
    tokenizer: Tokenizer,
    max_tokens: u32,
    sampling: Sampling,
    stream: bool,
    include_usage: bool,
    service_tier: Option<String>,
}

/// Reads a request; text prompts are tokenized with the tokenizer of the model asked for.
fn parse(bytes: &[u8], kind: Kind, tokenizers: &Tokenizers) -> Result<Parsed, ApiError> {
    let invalid_json = |e: serde_json::Error| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", format!("the body is not a valid request: {e}"))
    };
    let value: Value = serde_json::from_slice(bytes).map_err(invalid_json)?;
    // Read in place: the object is kept whole for engines with their own API.
    let body: Body = serde_path_to_error::deserialize(&value)
        .map_err(|e| ApiError::invalid_json("the body is not a valid request", e))?;
    let Value::Object(raw) = value else {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", "the body is not a JSON object"));
    };
    let unsupported = body.unhonoured();
    let model =
        body.model.filter(|m| !m.is_empty()).ok_or_else(|| ApiError::invalid("model", "`model` is required"))?;
    let tokenizer = tokenizers.get(&model);
    let templated = matches!(tokenizer, Tokenizer::Model(_, Some(_)));
    let encode = |text: &str| tokenizer.encode(text).map_err(|e| ApiError::invalid("prompt", e));
    let prompt = match kind {
        Kind::Completion => match body.prompt {
            None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
            Some(Prompt::Text(t)) => encode(&t)?,
            Some(Prompt::Tokens(t)) => t,
            Some(Prompt::Texts(v)) if v.len() == 1 => encode(&v[0])?,
            Some(Prompt::TokenLists(mut v)) if v.len() == 1 => v.remove(0),
            Some(_) => return Err(ApiError::invalid("prompt", "give one prompt per request")),
        },
        Kind::Chat => {
            let messages = body.messages.ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
            if messages.is_empty() {
                return Err(ApiError::invalid("messages", "`messages` is empty"));
            }
            let mut texts = Vec::with_capacity(messages.len());
            for m in &messages {
                let text = match &m.content {
                    Content::Text(t) => t.clone(),
                    Content::Parts(parts) => {
                        if let Some(p) = parts.iter().find(|p| p.kind != "text") {
                            return Err(ApiError::invalid(
                                "messages",
                                format!("content parts of type `{}` are not supported", p.kind),
                            ));
                        }
                        // Text parts joined as vLLM joins them for a template.
                        let sep = if templated { "\n" } else { "" };
                        parts.iter().filter_map(|p| p.text.as_deref()).collect::<Vec<_>>().join(sep)
                    }
                };
                texts.push((m.role.as_str(), text));
            }
            // The model's chat template, or the stand-in's role markers without one.
            tokenizer.chat(texts.iter().map(|(r, t)| (*r, t.as_str()))).map_err(|e| ApiError::invalid("messages", e))?
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    let default_max = if kind == Kind::Completion { 16 } else { 256 };
    let max_tokens = body.max_completion_tokens.or(body.max_tokens).unwrap_or(default_max);
    if max_tokens == 0 || max_tokens > MAX_TOKENS_LIMIT {
        return Err(ApiError::invalid("max_tokens", format!("max_tokens must be between 1 and {MAX_TOKENS_LIMIT}")));
    }
    let temperature = body.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid("temperature", "temperature must be between 0 and 2"));
    }
    let top_p = body.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p", "top_p must be in (0, 1]"));
    }
    if body.seed.is_some_and(|s| s > JSON_SAFE_MAX) {
        return Err(ApiError::invalid("seed", format!("seed must be at most {JSON_SAFE_MAX}")));
    }
    Ok(Parsed {
        kind,
        unsupported,
        raw,
        model,
        prompt,
        tokenizer,
        max_tokens,
        sampling: Sampling { temperature, top_p, seed: body.seed.unwrap_or(0) },
        stream: body.stream,
        include_usage: body.stream_options.unwrap_or_default().include_usage,
        service_tier: body.service_tier,
    })
}

async fn serve(
    app: Arc<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Result<Response, ApiError> {
    app.auth.check(&headers, Role::Inference)?;
    // TTFT counts from here, also for a request flow control holds.
    let arrived = Instant::now();
    let bytes = body.map_err(|e| {
        app.metrics.request("rejected");
        ApiError::new(e.status(), "invalid_body", format!("cannot read the body: {}", e.body_text()))
    })?;
    let mut parsed = parse(&bytes, kind, &app.tokenizers).inspect_err(|_| app.metrics.request("rejected"))?;
    let asked = super::service::asked(&headers, parsed.service_tier.as_deref())
        .inspect_err(|_| app.metrics.request("rejected"))?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let prompt_tokens = parsed.prompt.len() as u32;
    let (id, admitted) = {
        let mut hub = app.lock_hub();
        let serving: Vec<_> = hub.fleet.members().filter(|m| m.state == MemberState::Serving).collect();
        if serving.is_empty() {
            app.metrics.request("unavailable");
            return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_engine", "no engine is serving"));
        }
        let ours = serving.iter().any(|m| m.info.model == parsed.model && m.external().is_none());
        let theirs = serving.iter().any(|m| m.info.model == parsed.model && m.external().is_some());
        if ours {
            if let Some(e) = parsed.unsupported.take() {
                app.metrics.request("rejected");
                return Err(e);
            }
        }
        let Some(block_size) = serving.iter().find(|m| m.info.model == parsed.model).map(|m| m.info.block_size) else {
            if hub.fleet.model_id(&parsed.model).is_some() {
                app.metrics.request("unavailable");
                let why = format!("no engine of model `{}` is serving", parsed.model);
                return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_engine", why));
            }
            app.metrics.request("rejected");
            let mut served: Vec<_> = serving.iter().map(|m| m.info.model.clone()).collect();
            served.dedup();
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "model_not_found",
                format!("model `{}` is not served here (served: {})", parsed.model, served.join(", ")),
            ));
        };
        // Routers choose among this model's engines only.
        let model = hub.fleet.model_id(&parsed.model).unwrap_or_default();
        let id = hub.next_request_id();
        let service = engine::Service {
            class: asked.class,
            tenant: hub.tenant(&asked.tenant),
            deadline_ms: asked.deadline_ms,
            session: asked.session,
            lift: false,
        };
        let request = Request {
            id,
            arrival: hub.now(),
            prompt_tokens,
            max_output_tokens: parsed.max_tokens,
            ends_after: None,
            block_hashes: engine::block_hashes(&parsed.prompt, block_size),
            resume: None,
            service,
            model,
        };
        hub.prefixes.record(&request.block_hashes, block_size);
        let call = theirs.then(|| {
            let mut body = std::mem::take(&mut parsed.raw);
            // The output's bound the controller reserved KV for, also where the client set none.
            body.insert("max_tokens".into(), json!(parsed.max_tokens));
            body.remove("max_completion_tokens");
            Box::new(OpenAiCall { chat: kind == Kind::Chat, body, engine_prompt: None })
        });
        let payload = Payload {
            prompt: parsed.prompt.clone(),
            sampling: parsed.sampling,
            out: tx,
            generated: Vec::new(),
            attempts: 0,
            first_token_us: None,
            call,
            class_priority: false,
        };
        let admitted = match hub.admit(request, payload) {
            Ok(a) => a,
            Err((Refused::Shed { reason, retry_after }, _)) => {
                app.metrics.request("shed");
                return Err(shed_error(reason, retry_after));
            }
            Err((Refused::Place(e), _)) => {
                app.metrics.request("rejected");
                return Err(place_error(e, prompt_tokens, &parsed));
            }
        };
        (id, admitted)
    };
    // A queued request answers once it is placed or shed: a shed one gets its status and
    // Retry-After, not a stream that fails.
    let first = match admitted {
        Admitted::Placed => None,
        Admitted::Queued => match rx.recv().await {
            Some(Delta::Shed { reason, retry_after }) => {
                app.metrics.request("shed");
                return Err(shed_error(reason, retry_after));
            }
            other => other,
        },
    };
    let mut run = Run::new(app, id, parsed, rx);
    (run.first, run.class, run.tenant, run.started) = (first, asked.class, asked.tenant, arrived);
    Ok(if run.parsed.stream { run.stream() } else { run.collect().await })
}

/// A refusal by flow control: 429 for sheddable work shed, 503 for a full queue, each
/// with when to try again.
fn shed_error(reason: ShedReason, retry_after: engine::Dur) -> ApiError {
    let status = match reason {
        ShedReason::QueueFull { .. } => StatusCode::SERVICE_UNAVAILABLE,
        ShedReason::Saturated { .. } | ShedReason::Waited { .. } => StatusCode::TOO_MANY_REQUESTS,
    };
    let seconds = retry_after.as_secs_f64().ceil() as u64;
    ApiError::new(status, reason.code(), format!("{reason}; try again in {seconds} s")).retry_after(seconds)
}

/// A request no engine takes, as the client's error.
fn place_error(e: PlaceError, prompt_tokens: u32, parsed: &Parsed) -> ApiError {
    match e {
        PlaceError::Reject(Reject::TooLarge { needed_tokens, largest_tokens }) => ApiError::new(
            StatusCode::BAD_REQUEST,
            "context_length_exceeded",
            format!("the prompt ({prompt_tokens} tokens) plus max_tokens ({}) needs {needed_tokens} tokens of KV; the largest engine of `{}` holds {largest_tokens}", parsed.max_tokens, parsed.model),
        )
        .with_param("max_tokens"),
        PlaceError::Reject(Reject::NoInstance) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_engine", "no engine is serving")
        }
        PlaceError::Dispatch(e) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "dispatch_failed", e.to_string()),
    }
}

/// One request's stream from the fleet to its client.
struct Run {
    app: Arc<App>,
    parsed: Parsed,
    rx: mpsc::UnboundedReceiver<Delta>,
    id: String,
    created: u64,
    started: Instant,
    /// When the first token reached the gateway: TTFT, and the start of TPOT.
    first_token_at: Option<Instant>,
    completion_tokens: u32,
    /// The output's text so far, as it streams.
    text: TextDecoder,
    /// A delta already taken from `rx` (a queued request's first).
    first: Option<Delta>,
    class: engine::Class,
    tenant: String,
}

impl Run {
    fn new(app: Arc<App>, id: RequestId, parsed: Parsed, rx: mpsc::UnboundedReceiver<Delta>) -> Run {
        app.metrics.in_flight.inc();
        let prefix = if parsed.kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let text = parsed.tokenizer.decoder();
        Run {
            app,
            parsed,
            rx,
            id: format!("{prefix}-{:x}", id.0),
            created,
            started: Instant::now(),
            first_token_at: None,
            completion_tokens: 0,
            text,
            first: None,
            class: engine::Class::default(),
            tenant: String::new(),
        }
    }

    async fn next(&mut self) -> Option<Delta> {
        match self.first.take() {
            Some(d) => Some(d),
            None => self.rx.recv().await,
        }
    }

    fn note_tokens(&mut self, n: usize) {
        if self.first_token_at.is_none() {
            let now = Instant::now();
            self.first_token_at = Some(now);
            let ttft = now.duration_since(self.started).as_secs_f64();
            self.app.metrics.ttft_seconds.observe(ttft);
            let class = super::metrics::ClassLabel { class: self.class.name().to_string() };
            self.app.metrics.class_ttft_seconds.get_or_create(&class).observe(ttft);
        }
        self.completion_tokens += n as u32;
        self.app.metrics.tokens_generated.inc_by(n as u64);
    }

    fn note_done(&self, cached: [u32; 3], instance: InstanceId) {
        self.app.metrics.request("ok");
        let tenant = super::metrics::TenantLabel { tenant: self.tenant.clone() };
        self.app.metrics.tenant_requests.get_or_create(&tenant).inc();
        self.app.metrics.prompt_tokens.inc_by(self.parsed.prompt.len() as u64);
        self.app.metrics.cached_prompt_tokens.inc_by(cached.iter().map(|&c| u64::from(c)).sum());
        // A request that ends before any token (a zero-length output) has no TTFT to report.
        if let Some(first) = self.first_token_at {
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            let tpot_ms =
                (self.completion_tokens > 1).then(|| ms(first.elapsed()) / f64::from(self.completion_tokens - 1));
            self.app.recorder.finished(Finished {
                ttft_ms: ms(first.duration_since(self.started)),
                tpot_ms,
                prompt_tokens: self.parsed.prompt.len() as u32,
                cached_tokens: cached,
                instance,
                class: self.class,
                tenant: self.tenant.clone(),
            });
        }
    }

    /// Counts an engine's own refusal: the client's fault below 500, the engine's above.
    fn note_refused(&self, status: u16) {
        self.app.metrics.request(if status < 500 { "rejected" } else { "failed" });
    }

    /// The engine's own refusal, passed on with its status.
    fn refused(&self, status: u16, body: Value) -> Response {
        self.note_refused(status);
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
        (status, Json(body)).into_response()
    }

    fn usage(&self, cached: [u32; 3]) -> Value {
        let prompt = self.parsed.prompt.len() as u32;
        let cached_total: u32 = cached.iter().sum();
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_total},
        })
    }

    fn object(&self, streaming: bool) -> &'static str {
        match (self.parsed.kind, streaming) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn choice(&self, text: &str, finish_reason: Option<&str>, streaming: bool) -> Value {
        match self.parsed.kind {
            Kind::Completion => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason}),
            Kind::Chat if streaming => {
                json!({"index": 0, "delta": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish_reason})
            }
            Kind::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish_reason})
            }
        }
    }

    fn envelope(&self, choices: Vec<Value>, streaming: bool) -> Value {
        json!({"id": self.id, "object": self.object(streaming), "created": self.created, "model": self.parsed.model, "choices": choices})
    }

    async fn collect(mut self) -> Response {
        let mut tokens = Vec::new();
        while let Some(d) = self.next().await {
            match d {
                Delta::Tokens(t) => {
                    self.note_tokens(t.len());
                    tokens.extend(t);
                }
                Delta::Done { finish_reason, cached_tokens, instance } => {
                    self.note_done(cached_tokens, instance);
                    let text = self.text.push(&tokens) + &self.text.finish();
                    let choice = self.choice(&text, Some(finish_reason.openai()), false);
                    let mut body = self.envelope(vec![choice], false);
                    body["usage"] = self.usage(cached_tokens);
                    return Json(body).into_response();
                }
                Delta::Failed(why) => {
                    self.app.metrics.request("failed");
                    return ApiError::new(StatusCode::BAD_GATEWAY, "engine_failed", why).into_response();
                }
                Delta::Whole { mut body, cached_tokens, instance } => {
                    let tokens = body["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                    self.note_tokens(tokens as usize);
                    self.note_done(cached_tokens, instance);
                    body["id"] = json!(self.id);
                    return Json(body).into_response();
                }
                Delta::Refused { status, body } => return self.refused(status, body),
                Delta::Shed { reason, retry_after } => return shed_error(reason, retry_after).into_response(),
                // Only streamed calls bring these; a request resumed on an engine of ours
                // after one of them broke mid-stream cannot be collected here.
                Delta::Chunk { .. } | Delta::End { .. } => {}
            }
        }
        self.app.metrics.request("failed");
        ApiError::new(StatusCode::BAD_GATEWAY, "engine_failed", "the request's stream ended without a result")
            .into_response()
    }

    fn stream(self) -> Response {
        let events = futures_util::stream::unfold((self, false), |(mut run, done)| async move {
            if done {
                return None;
            }
            let (event, done) = match run.next().await {
                Some(Delta::Tokens(t)) => {
                    run.note_tokens(t.len());
                    let text = run.text.push(&t);
                    let body = run.envelope(vec![run.choice(&text, None, true)], true);
                    (vec![Event::default().data(body.to_string())], false)
                }
                Some(Delta::Done { finish_reason, cached_tokens, instance }) => {
                    run.note_done(cached_tokens, instance);
                    let mut events = vec![];
                    // Text held back for a character the last tokens left incomplete.
                    let rest = run.text.finish();
                    let last = run.envelope(vec![run.choice(&rest, Some(finish_reason.openai()), true)], true);
                    events.push(Event::default().data(last.to_string()));
                    if run.parsed.include_usage {
                        let mut usage = run.envelope(vec![], true);
                        usage["usage"] = run.usage(cached_tokens);
                        events.push(Event::default().data(usage.to_string()));
                    }
                    events.push(Event::default().data("[DONE]"));
                    (events, true)
                }
                Some(Delta::Failed(why)) => {
                    run.app.metrics.request("failed");
                    let e = ApiError::new(StatusCode::BAD_GATEWAY, "engine_failed", why);
                    (vec![Event::default().data(e.body().to_string())], true)
                }
                Some(Delta::Chunk { mut body, tokens }) => {
                    run.note_tokens(tokens);
                    body["id"] = json!(run.id);
                    (vec![Event::default().data(body.to_string())], false)
                }
                Some(Delta::End { cached_tokens, instance }) => {
                    run.note_done(cached_tokens, instance);
                    (vec![Event::default().data("[DONE]")], true)
                }
                Some(Delta::Whole { body, .. }) => (vec![Event::default().data(body.to_string())], true),
                Some(Delta::Refused { status, body }) => {
                    run.note_refused(status);
                    (vec![Event::default().data(body.to_string())], true)
                }
                Some(Delta::Shed { reason, retry_after }) => {
                    (vec![Event::default().data(shed_error(reason, retry_after).body().to_string())], true)
                }
                None => {
                    run.app.metrics.request("failed");
                    let e = ApiError::new(StatusCode::BAD_GATEWAY, "engine_failed", "the request's stream ended early");
                    (vec![Event::default().data(e.body().to_string())], true)
                }
            };
            Some((futures_util::stream::iter(event.into_iter().map(Ok::<_, Infallible>)), (run, done)))
        });
        use futures_util::StreamExt;
        Sse::new(events.flatten()).into_response()
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        self.app.metrics.in_flight.dec();
    }
}
