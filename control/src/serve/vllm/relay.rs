//! A request on an engine with its own OpenAI API: the client's request goes to the engine
//! as it came (tokenization, chat template and sampling stay the engine's) and the engine's
//! chunks come back to the client as they are, its errors in its own OpenAI shape. Two fields
//! are added on the way: `return_token_ids` (the output's ids, so a request whose engine
//! vanishes mid-stream can resume elsewhere after the tokens its client has) and
//! `stream_options.include_usage` (the cached-token count); what the client did not ask for
//! is taken out of the chunks again.
//!
//! A resumed request (or one without the client's call) is sent as a completion of token
//! ids, the prompt as the first engine tokenized it followed by the tokens already streamed,
//! and its output comes back as ids for the gateway to format, like our engines' output.

use super::{error_chain, Engine, Share};
use crate::proto::FinishReason;
use crate::serve::news::{Delta, News, Parked, Payload};
use crate::serve::stream::{Ended, Lost, Reporter};
use engine::{InstanceId, Request};
use futures_util::StreamExt;
use policies::FleetEvent;
use serde_json::{json, Map, Value};
use std::num::NonZeroU64;
use std::sync::Arc;

/// What a vLLM engine is asked to do with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// All of it, streamed to the client (a colocated engine).
    Whole,
    /// vLLM's first step of disaggregated serving: compute the prompt (and one token, which
    /// is dropped: the decode engine computes the first token again from the KV it pulls) and
    /// keep the KV for the decode engine the returned `kv_transfer_params` will name.
    Prefill,
}

/// What a prefill step asks of the engine's KV connector.
const PREFILL_KV_PARAMS: &str = r#"{"do_remote_decode": true, "do_remote_prefill": false,
    "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}"#;

/// Runs one request's `step` on a vLLM engine. A prefill ends parked with the engine's
/// `kv_transfer_params` until the controller pairs it with a decode engine ([`decode`]).
pub(in crate::serve) async fn run(
    instance: InstanceId,
    engine: Arc<Engine>,
    request: Request,
    mut payload: Payload,
    report: Reporter,
    step: Step,
) {
    payload.attempts += 1;
    let ended = {
        let output_tokens = if step == Step::Prefill { 1 } else { request.max_output_tokens };
        let mut share = Share::new(&engine, request.prompt_tokens, output_tokens);
        let mut call = Call::new(&engine, &request, &payload);
        if step == Step::Prefill {
            call.ask_prefill_only();
        }
        let mut leg = Leg::new(instance, &engine);
        match (leg.send(&call, &mut payload).await, step) {
            (Ok(response), Step::Whole) => leg.receive(&call, response, &mut payload, &report, &mut share).await,
            (Ok(response), Step::Prefill) => leg.prefilled(response, &mut payload, &mut share).await,
            (Err(ended), _) => ended,
        }
    };
    report.ended(instance, request, payload, ended);
}

/// The second step: the decode engine the controller paired the request with takes the
/// client's request again with the prefill engine's `kv_transfer_params`, pulls the KV and
/// streams the output. An engine that does not take it refuses the transfer (the KV stays on
/// the prefill engine and the request waits to be paired again).
pub(in crate::serve) async fn decode(to: InstanceId, engine: Arc<Engine>, parked: Parked, report: Reporter) {
    let Parked { from, request, mut payload, handoff, kv_tokens, ttft } = parked;
    let id = request.id;
    let mut share = Share::new(&engine, 0, request.max_output_tokens);
    let mut call = Call::new(&engine, &request, &payload);
    if let Some(h) = &handoff {
        call.body.insert("kv_transfer_params".into(), h.clone());
    }
    let mut leg = Leg::new(to, &engine);
    let ended = match leg.send(&call, &mut payload).await {
        Err(Ended::Broke(why)) => {
            drop(share);
            tracing::info!(request = %id, %from, %to, "transfer refused: {why}");
            let parked = Parked { from, request, payload, kv_tokens, ttft, handoff };
            let _ = report.news.send(News::Parked(parked));
            report.event(FleetEvent::TransferRefused { request: id, from, to });
            return;
        }
        Err(ended) => {
            report.event(FleetEvent::TransferDone { request: id, from, to });
            ended
        }
        Ok(response) => {
            report.event(FleetEvent::TransferDone { request: id, from, to });
            leg.receive(&call, response, &mut payload, &report, &mut share).await
        }
    };
    drop(share);
    report.ended(to, request, payload, ended);
}

/// What one call to an engine sends: the client's request as it came (with the fields the
/// relay needs), or a completion of token ids continuing what was streamed already.
struct Call {
    path: &'static str,
    body: Map<String, Value>,
    streaming: bool,
    /// The client's own request goes as it came: its chunks go to it as they are.
    passthrough: bool,
}

impl Call {
    /// Makes the call a prefill step: one token, whole, with the connector's parameters.
    fn ask_prefill_only(&mut self) {
        self.body.remove("max_completion_tokens");
        self.body.remove("stream_options");
        for (key, value) in [("max_tokens", json!(1)), ("stream", json!(false)), ("return_token_ids", json!(true))] {
            self.body.insert(key.into(), value);
        }
        let params: Value = serde_json::from_str(PREFILL_KV_PARAMS).unwrap_or_default();
        self.body.insert("kv_transfer_params".into(), params);
        self.streaming = false;
    }

    fn new(engine: &Engine, request: &Request, payload: &Payload) -> Call {
        let mut call = Call::of(engine, request, payload);
        // The class as the engine's priority: ours overrides a client's own `priority`.
        if let Some(p) =
            engine.spec.scheduling_policy.priority(request.service.engine_class()).filter(|_| payload.class_priority)
        {
            call.body.insert("priority".into(), json!(p));
        }
        call
    }

    fn of(engine: &Engine, request: &Request, payload: &Payload) -> Call {
        match (&payload.call, payload.generated.is_empty()) {
            (Some(call), true) => {
                let mut body = call.body.clone();
                body.insert("return_token_ids".into(), Value::Bool(true));
                if call.streaming() {
                    let options = body.entry("stream_options").or_insert_with(|| json!({}));
                    if let Some(o) = options.as_object_mut() {
                        o.insert("include_usage".into(), Value::Bool(true));
                    }
                }
                let path = if call.chat { "/v1/chat/completions" } else { "/v1/completions" };
                Call { path, body, streaming: call.streaming(), passthrough: true }
            }
            _ => Call {
                path: "/v1/completions",
                body: continuation(engine, request, payload),
                streaming: true,
                passthrough: false,
            },
        }
    }
}

/// One engine a request is on, and the signal that it was taken out (subscribed before the
/// request is sent, so that a loss while it is under way is not missed).
struct Leg<'a> {
    instance: InstanceId,
    engine: &'a Engine,
    lost: Lost,
}

impl<'a> Leg<'a> {
    fn new(instance: InstanceId, engine: &'a Engine) -> Leg<'a> {
        Leg { instance, engine, lost: engine.lost_signal() }
    }

    /// Sends `call` to the engine; an error is how the request ended (the engine's refusal of
    /// the request is passed to its client).
    async fn send(&mut self, call: &Call, payload: &mut Payload) -> Result<reqwest::Response, Ended> {
        let (instance, url) = (self.instance, &self.engine.spec.url);
        let send = self.engine.http.post(format!("{url}{}", call.path)).json(&call.body).send();
        let response = tokio::select! {
            r = send => r,
            () = payload.out.closed() => return Err(Ended::ClientGone),
            () = self.lost.taken_out() => return Err(Ended::Broke(format!("{instance} ({url}) stopped answering"))),
        };
        let response = match response {
            Ok(r) => r,
            Err(e) => {
                return Err(Ended::Broke(format!("{instance} ({url}) did not take the request: {}", error_chain(&e))))
            }
        };
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let text = response.text().await.unwrap_or_default();
        if status.is_server_error() {
            return Err(Ended::Broke(format!("{instance} ({url}) answered {status}: {text}")));
        }
        // The engine's own refusal (a bad field, a prompt too long for it): the client's.
        let body = serde_json::from_str(&text).unwrap_or_else(
            |_| json!({"error": {"message": text, "type": "invalid_request_error", "param": null, "code": null}}),
        );
        let _ = payload.out.send(Delta::Refused { status: status.as_u16(), body });
        Err(Ended::ClientGone)
    }

    /// Relays the engine's answer to `call` to the client until the request ends.
    async fn receive(
        &mut self,
        call: &Call,
        response: reqwest::Response,
        payload: &mut Payload,
        report: &Reporter,
        share: &mut Share<'_>,
    ) -> Ended {
        let (instance, url) = (self.instance, &self.engine.spec.url);
        let (streaming, passthrough) = (call.streaming, call.passthrough);
        if !streaming {
            let body: Value = match response.json().await {
                Ok(v) => v,
                Err(e) => return Ended::Broke(format!("{instance} ({url}) sent a response that is not JSON: {e}")),
            };
            let tokens = body["usage"]["completion_tokens"].as_u64().unwrap_or(0);
            share.prefilled();
            share.generated(tokens);
            note_first_token(payload, report);
            let ids = body["choices"][0]["token_ids"].as_array().map(|a| ids(a)).unwrap_or_default();
            payload.generated.extend(ids);
            let cached = cached_tokens(&body);
            let asked_ids = payload.call.as_ref().is_some_and(|c| c.asked("return_token_ids"));
            let mut body = body;
            if !asked_ids {
                strip_ids(&mut body);
            }
            let _ = payload.out.send(Delta::Whole { body, cached_tokens: cached, instance });
            return Ended::Finished;
        }
        let client_shape = if passthrough {
            payload.call.as_ref().map(|c| (c.asked_usage(), c.asked("return_token_ids")))
        } else {
            None
        };
        let mut stream = response.bytes_stream();
        let mut events = SseBuffer::default();
        let mut cached = [0u32; 3];
        let mut finish_reason = None;
        loop {
            let next = tokio::select! {
                next = stream.next() => next,
                () = payload.out.closed() => return Ended::ClientGone,
                () = self.lost.taken_out() => return Ended::Broke(format!("{instance} ({url}) stopped answering mid-stream")),
            };
            let bytes = match next {
                Some(Ok(b)) => b,
                Some(Err(e)) => {
                    return Ended::Broke(format!("{instance} ({url}) failed mid-stream: {}", error_chain(&e)))
                }
                None => {
                    return Ended::Broke(format!("{instance} ({url}) closed the stream before the request finished"))
                }
            };
            for data in events.push(&bytes) {
                if data == "[DONE]" {
                    let _ = match &client_shape {
                        Some(_) => payload.out.send(Delta::End { cached_tokens: cached, instance }),
                        None => payload.out.send(Delta::Done {
                            finish_reason: finish_reason.take().unwrap_or(FinishReason::Length),
                            cached_tokens: cached,
                            instance,
                        }),
                    };
                    return Ended::Finished;
                }
                let mut chunk: Value = match serde_json::from_str(&data) {
                    Ok(v) => v,
                    Err(e) => return Ended::Broke(format!("{instance} ({url}) sent a chunk that is not JSON: {e}")),
                };
                if chunk.get("error").is_some() {
                    let _ = payload.out.send(Delta::Refused { status: 500, body: chunk });
                    return Ended::ClientGone;
                }
                if chunk["usage"].is_object() {
                    cached = cached_tokens(&chunk);
                }
                let choice = &chunk["choices"][0];
                if let (Some(p), Some(call)) = (choice["prompt_token_ids"].as_array(), payload.call.as_mut()) {
                    call.engine_prompt = Some(ids(p));
                }
                let new = choice["token_ids"].as_array().map(|a| ids(a)).unwrap_or_default();
                if let Some(r) = choice["finish_reason"].as_str() {
                    finish_reason = Some(FinishReason::of_openai(r));
                }
                if !new.is_empty() {
                    note_first_token(payload, report);
                    share.prefilled();
                    share.generated(new.len() as u64);
                    payload.generated.extend_from_slice(&new);
                }
                match &client_shape {
                    Some((asked_usage, asked_ids)) => {
                        let is_usage = chunk["choices"].as_array().is_some_and(Vec::is_empty);
                        if is_usage && !asked_usage {
                            continue;
                        }
                        if !asked_ids {
                            strip_ids(&mut chunk);
                        }
                        let _ = payload.out.send(Delta::Chunk { body: chunk, tokens: new.len() });
                    }
                    None if !new.is_empty() => {
                        let _ = payload.out.send(Delta::Tokens(new));
                    }
                    None => {}
                }
            }
        }
    }

    /// What a prefill engine answered: the request's KV is there, found by the
    /// `kv_transfer_params` it returned.
    async fn prefilled(&self, response: reqwest::Response, payload: &mut Payload, share: &mut Share<'_>) -> Ended {
        let (instance, url) = (self.instance, &self.engine.spec.url);
        let body: Value = match response.json().await {
            Ok(v) => v,
            Err(e) => return Ended::Broke(format!("{instance} ({url}) sent a response that is not JSON: {e}")),
        };
        share.prefilled();
        let params = body.get("kv_transfer_params").filter(|p| p.is_object()).cloned();
        let Some(params) = params else {
            let why = format!(
                "prefill engine {instance} ({url}) returned no kv_transfer_params: start it with a KV connector \
             (--kv-transfer-config '{{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}}')"
            );
            let _ = payload.out.send(Delta::Failed(why));
            return Ended::ClientGone;
        };
        let prompt = body["choices"][0]["prompt_token_ids"].as_array().or_else(|| body["prompt_token_ids"].as_array());
        if let (Some(p), Some(call)) = (prompt, payload.call.as_mut()) {
            call.engine_prompt = Some(ids(p));
        }
        let kv_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
        Ended::Prefilled { kv_tokens, handoff: Some(params) }
    }
}

/// A completion of token ids that continues `payload` after what it generated: its prompt as
/// the engine first tokenized it (ours when no engine sent it yet), then the tokens streamed,
/// with the client's other sampling fields.
fn continuation(engine: &Engine, request: &Request, payload: &Payload) -> Map<String, Value> {
    let engine_prompt = payload.call.as_ref().and_then(|c| c.engine_prompt.clone());
    let mut prompt = engine_prompt.unwrap_or_else(|| payload.prompt.clone());
    prompt.extend_from_slice(&payload.generated);
    let left = request.max_output_tokens.saturating_sub(payload.generated.len() as u32).max(1);
    let mut body = payload.call.as_ref().map(|c| c.body.clone()).unwrap_or_default();
    for chat_only in ["messages", "max_completion_tokens", "tools", "tool_choice", "response_format", "echo", "n"] {
        body.remove(chat_only);
    }
    let s = payload.sampling;
    for (key, value) in [
        ("model", json!(engine.probed.model)),
        ("prompt", json!(prompt)),
        ("max_tokens", json!(left)),
        ("temperature", json!(s.temperature)),
        ("top_p", json!(s.top_p)),
        ("stream", json!(true)),
        ("stream_options", json!({"include_usage": true})),
        ("return_token_ids", json!(true)),
    ] {
        body.insert(key.into(), value);
    }
    if s.seed != 0 {
        body.insert("seed".into(), json!(s.seed));
    }
    body
}

fn note_first_token(payload: &mut Payload, report: &Reporter) {
    if payload.first_token_us.is_none() {
        payload.first_token_us = NonZeroU64::new(report.now().0.max(1));
    }
}

fn ids(a: &[Value]) -> Vec<u32> {
    a.iter().filter_map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
}

/// The prompt tokens the engine's cache served (`usage.prompt_tokens_details.cached_tokens`,
/// which vLLM reports with `--enable-prompt-tokens-details`), all counted as the GPU's.
fn cached_tokens(body: &Value) -> [u32; 3] {
    let c = body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    [u32::try_from(c).unwrap_or(u32::MAX), 0, 0]
}

/// Takes out the token-id fields the relay asked for and the client did not.
fn strip_ids(body: &mut Value) {
    if let Some(o) = body.as_object_mut() {
        o.remove("prompt_token_ids");
    }
    if let Some(choices) = body["choices"].as_array_mut() {
        for c in choices.iter_mut().filter_map(Value::as_object_mut) {
            c.remove("token_ids");
            c.remove("prompt_token_ids");
        }
    }
}

/// Server-sent events cut from a byte stream: the `data:` of each complete event.
#[derive(Default)]
struct SseBuffer {
    pending: Vec<u8>,
}

impl SseBuffer {
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = find_event_end(&self.pending) {
            let event: Vec<u8> = self.pending.drain(..end.1).collect();
            let text = String::from_utf8_lossy(&event[..end.0]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// Where the first event ends: (end of its text, end of its blank-line separator).
fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    (0..b.len()).find_map(|i| {
        if b[i..].starts_with(b"\n\n") {
            Some((i, i + 2))
        } else if b[i..].starts_with(b"\r\n\r\n") {
            Some((i, i + 4))
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_cut_wherever_the_bytes_split() {
        let stream = "data: {\"a\":1}\n\ndata: [DONE]\r\n\r\n";
        for cut in 0..stream.len() {
            let mut sse = SseBuffer::default();
            let mut got = sse.push(&stream.as_bytes()[..cut]);
            got.extend(sse.push(&stream.as_bytes()[cut..]));
            assert_eq!(got, ["{\"a\":1}", "[DONE]"], "cut at {cut}");
        }
    }

    #[test]
    fn what_the_client_did_not_ask_for_is_taken_out() {
        let mut chunk = json!({"id": "x", "prompt_token_ids": [1], "choices": [{"text": "a", "token_ids": [5], "prompt_token_ids": [1, 2]}]});
        strip_ids(&mut chunk);
        assert_eq!(chunk, json!({"id": "x", "choices": [{"text": "a"}]}));
        assert_eq!(cached_tokens(&json!({"usage": {"prompt_tokens_details": {"cached_tokens": 64}}})), [64, 0, 0]);
        assert_eq!(cached_tokens(&json!({"usage": {"prompt_tokens_details": null}})), [0, 0, 0]);
    }
}
