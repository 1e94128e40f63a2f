//! Sends a workload's requests through the gateway at their arrival times, as an OpenAI client
//! would (streaming completions with token-id prompts), and measures what the client sees.
//!
//! Prompts are made from the workload's block hashes: each block's tokens are derived from
//! its chained hash, so requests that share a prefix in the trace share the same token prefix
//! on the wire, and the live fleet's prefix caches see the trace's reuse.

use control::quantile;
use engine::ids::mix64;
use engine::BlockHash;
use futures_util::StreamExt;
use serde_json::{json, Value};
use simulator::report::write_json;
use simulator::slo::Slo;
use simulator::workload::{Arrival, TurnEnd, Workload};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Token ids prompts use when `--vocab` is not given: a Llama-2-sized vocabulary.
pub const DEFAULT_VOCAB: u32 = 32_000;

pub struct Options {
    /// Gateway base URL, e.g. http://127.0.0.1:8080.
    pub gateway: String,
    pub token: String,
    pub model: String,
    pub block_size: u32,
    pub max_requests: Option<u64>,
    /// Prompts use token ids below this (the served model's vocabulary).
    pub vocab: u32,
    /// Tenants' names by [`engine::TenantId`], sent as `x-fleetplane-tenant` (nothing for a
    /// workload of one unnamed tenant).
    pub tenants: Vec<String>,
    /// Each class's SLO (by [`engine::Class::index`]): a closed-loop workload hears whether
    /// each of its turns met it.
    pub slos: [Slo; 3],
}

impl Options {
    /// What replaying `settings`' workload through `gateway` takes.
    pub fn new(
        settings: &simulator::scenario::Settings,
        gateway: &str,
        token: &str,
        model: &str,
        vocab: u32,
    ) -> Options {
        Options {
            gateway: gateway.to_string(),
            token: token.to_string(),
            model: model.to_string(),
            block_size: settings.instance.block_size,
            max_requests: settings.max_requests,
            vocab,
            tenants: settings
                .classes
                .as_ref()
                .map(|c| c.tenants.iter().map(|t| t.name.clone()).collect())
                .unwrap_or_default(),
            slos: settings.class_slos().unwrap_or([settings.slo; 3]),
        }
    }

    /// How a request of a closed-loop workload's session ended, `elapsed` into the replay.
    fn turn_end(&self, o: &Outcome, elapsed: Duration) -> Option<TurnEnd> {
        let session = o.service.session?;
        let slo = self.slos[o.service.class.index()];
        let ms = |d: Option<Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1e3);
        let within_slo = o.ok && ms(o.ttft) <= slo.ttft_ms && ms(o.tpot) <= slo.tpot_ms;
        let at = engine::Time(elapsed.as_micros() as u64);
        Some(TurnEnd { session, at, finished: o.ok, within_slo })
    }

    /// The headers that give the gateway `service` as the workload drew it: its class (when
    /// not standard), tenant, deadline and session (docs/FLOW.md).
    fn service_headers(&self, service: &engine::Service) -> Vec<(&'static str, String)> {
        let mut headers = Vec::new();
        if service.class != engine::Class::Standard {
            headers.push(("x-fleetplane-class", service.class.name().to_string()));
        }
        if let Some(name) = self.tenants.get(service.tenant.0 as usize) {
            headers.push(("x-fleetplane-tenant", name.clone()));
        }
        if let Some(ms) = service.deadline_ms {
            headers.push(("x-fleetplane-deadline-ms", ms.to_string()));
        }
        if let Some(session) = service.session {
            headers.push(("x-fleetplane-session", session.0.to_string()));
        }
        headers
    }

    /// The rows a request's outcome counts in besides the whole: its class and tenant.
    fn groups(&self, service: &engine::Service) -> [String; 2] {
        let tenant = self.tenants.get(service.tenant.0 as usize).map_or("default", String::as_str);
        [format!("class {}", service.class.name()), format!("tenant {tenant}")]
    }
}

/// One request's outcome as the client saw it.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub(crate) ok: bool,
    pub(crate) error: Option<String>,
    pub(crate) ttft: Option<Duration>,
    tpot: Option<Duration>,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// The rows it counts in besides the whole (its class and tenant).
    groups: [String; 2],
    service: engine::Service,
}

#[derive(Debug, Default)]
pub struct Summary {
    pub sent: u64,
    pub ok: u64,
    pub failed: u64,
    /// Requests still in flight when the replay was stopped, cut off (neither ok nor failed).
    pub interrupted: u64,
    /// Whether `stop` ended the replay before the workload did.
    pub stopped: bool,
    pub first_error: Option<String>,
    ttft_ms: Vec<f64>,
    tpot_ms: Vec<f64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// TTFTs (ms) of the requests that succeeded, by class and by tenant.
    groups: std::collections::BTreeMap<String, Vec<f64>>,
    /// A closed-loop workload's sessions, as it counted them.
    sessions: Option<simulator::workload::SessionStats>,
}

impl Summary {
    /// The summary as JSON (latencies in milliseconds, as the client saw them).
    pub fn json(&mut self) -> Value {
        let hit = if self.prompt_tokens == 0 { 0.0 } else { self.cached_tokens as f64 / self.prompt_tokens as f64 };
        let pct = |v: &mut Vec<f64>| {
            json!({"p50": quantile(v, 0.5), "p90": quantile(v, 0.9), "p99": quantile(v, 0.99),
                "mean": if v.is_empty() { f64::NAN } else { v.iter().sum::<f64>() / v.len() as f64 }})
        };
        let groups: serde_json::Map<String, Value> =
            self.groups.iter_mut().map(|(k, v)| (k.clone(), json!({"ok": v.len(), "ttft_ms": pct(v)}))).collect();
        json!({
            "sent": self.sent, "ok": self.ok, "failed": self.failed, "first_error": self.first_error,
            "ttft_ms": pct(&mut self.ttft_ms), "tpot_ms": pct(&mut self.tpot_ms), "hit_rate": hit,
            "groups": groups,
            "sessions": self.sessions.map(|s| json!({
                "started": s.started, "completed": s.completed, "completed_within_slo": s.completed_within_slo,
                "failed": s.failed, "turns": s.turns,
            })),
        })
    }

    pub fn table(&mut self) -> String {
        let hit = if self.prompt_tokens == 0 { 0.0 } else { self.cached_tokens as f64 / self.prompt_tokens as f64 };
        let (t, p) = (&mut self.ttft_ms, &mut self.tpot_ms);
        let mut text = format!(
            "requests sent {}  ok {}  failed {}{}\n\
             TTFT ms  p50 {:.0}  p90 {:.0}  p99 {:.0}\n\
             TPOT ms  p50 {:.1}  p90 {:.1}  p99 {:.1}\n\
             prompt tokens served from cache: {:.1}%\n",
            self.sent,
            self.ok,
            self.failed,
            if self.stopped { format!("  cut off when stopped {}", self.interrupted) } else { String::new() },
            quantile(t, 0.5),
            quantile(t, 0.9),
            quantile(t, 0.99),
            quantile(p, 0.5),
            quantile(p, 0.9),
            quantile(p, 0.99),
            100.0 * hit
        );
        if let Some(s) = self.sessions {
            text.push_str(&format!(
                "sessions started {}  completed {} ({} within the SLO)  failed {}  turns {}\n",
                s.started, s.completed, s.completed_within_slo, s.failed, s.turns
            ));
        }
        // Rows by class and tenant, where the workload has more than one of either.
        for kind in ["class ", "tenant "] {
            let rows: Vec<_> = self.groups.iter_mut().filter(|(k, _)| k.starts_with(kind)).collect();
            if rows.len() > 1 {
                for (k, v) in rows {
                    let (n, p50, p99) = (v.len(), quantile(v, 0.5), quantile(v, 0.99));
                    text.push_str(&format!("  {k}: ok {n}  TTFT ms p50 {p50:.0}  p99 {p99:.0}\n"));
                }
            }
        }
        text
    }
}

/// The prompt's token ids, each below `vocab`: blocks from their hashes, the tail from the
/// request's index.
pub fn prompt_tokens(hashes: &[BlockHash], prompt_tokens: u32, block_size: u32, salt: u64, vocab: u32) -> Vec<u32> {
    let vocab = u64::from(vocab.max(1));
    let mut tokens = Vec::with_capacity(prompt_tokens as usize);
    for h in hashes {
        tokens.extend((0..u64::from(block_size)).map(|j| (mix64(h.0 ^ (j << 48)) % vocab) as u32));
    }
    let mut k = 0u64;
    while tokens.len() < prompt_tokens as usize {
        tokens.push((mix64(salt.wrapping_mul(0x9e37_79b9) ^ k) % vocab) as u32);
        k += 1;
    }
    tokens.truncate(prompt_tokens as usize);
    tokens
}

/// Replays `workload` until it ends, `max_requests` are sent, or `stop` resolves; a stop cuts
/// off the requests in flight instead of waiting for them. A closed-loop workload (agent
/// sessions) hears each of its requests end, as in the simulator, and its later turns come
/// from that: an end heard while the next arrival waits for its time may bring a turn
/// before it.
pub async fn replay(
    opts: Options,
    mut workload: Box<dyn Workload>,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<Summary> {
    let client = reqwest::Client::new();
    let (tx, mut rx) = mpsc::unbounded_channel::<Outcome>();
    let start = Instant::now();
    let mut summary = Summary::default();
    let mut in_flight = tokio::task::JoinSet::new();
    let closed = workload.closed_loop();
    let record = |summary: &mut Summary, workload: &mut Box<dyn Workload>, o: Outcome| {
        if let Some(end) = opts.turn_end(&o, start.elapsed()).filter(|_| closed) {
            workload.ended(end);
        }
        summary.add(o);
    };
    tokio::pin!(stop);
    loop {
        if opts.max_requests.is_some_and(|m| summary.sent >= m) {
            break;
        }
        let a: Arrival = match workload.next_arrival(Vec::new())? {
            Some(a) => a,
            // Sessions still running: their next turns come as their turns end.
            None if closed && summary.sent > summary.ok + summary.failed => {
                tokio::select! {
                    Some(o) = rx.recv() => record(&mut summary, &mut workload, o),
                    _ = &mut stop => {
                        summary.stopped = true;
                        break;
                    }
                }
                continue;
            }
            None => break,
        };
        let at = start + Duration::from_micros(a.at.0);
        tokio::select! {
            _ = tokio::time::sleep_until(at.into()) => {}
            Some(o) = rx.recv(), if closed => {
                record(&mut summary, &mut workload, o);
                workload.put_back(a);
                continue;
            }
            _ = &mut stop => {
                summary.stopped = true;
                break;
            }
        }
        let prompt = prompt_tokens(&a.block_hashes, a.prompt_tokens, opts.block_size, summary.sent, opts.vocab);
        let body = json!({
            "model": opts.model,
            "prompt": prompt,
            "max_tokens": a.output_tokens.max(1),
            // The trace's output length, also where a sampling engine (vLLM) would have
            // sampled its end-of-sequence token first; engines of ours always run to it.
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let mut request = client.post(format!("{}/v1/completions", opts.gateway)).bearer_auth(&opts.token).json(&body);
        for (name, value) in opts.service_headers(&a.service) {
            request = request.header(name, value);
        }
        let (tx, groups, service) = (tx.clone(), opts.groups(&a.service), a.service);
        in_flight.spawn(async move {
            let _ = tx.send(Outcome { groups, service, ..one(request).await });
        });
        summary.sent += 1;
        while let Ok(o) = rx.try_recv() {
            record(&mut summary, &mut workload, o);
        }
        while in_flight.try_join_next().is_some() {}
    }
    drop(tx);
    if !summary.stopped {
        // The workload ended: wait for its last requests, unless stopped meanwhile.
        loop {
            tokio::select! {
                o = rx.recv() => match o {
                    Some(o) => summary.add(o),
                    None => break,
                },
                _ = &mut stop => {
                    summary.stopped = true;
                    break;
                }
            }
        }
    }
    in_flight.shutdown().await;
    while let Ok(o) = rx.try_recv() {
        summary.add(o);
    }
    summary.interrupted = summary.sent - summary.ok - summary.failed;
    summary.sessions = workload.sessions();
    Ok(summary)
}

impl Summary {
    fn add(&mut self, o: Outcome) {
        if o.ok {
            self.ok += 1;
            self.ttft_ms.extend(o.ttft.map(|d| d.as_secs_f64() * 1e3));
            for g in o.groups {
                self.groups.entry(g).or_default().extend(o.ttft.map(|d| d.as_secs_f64() * 1e3));
            }
            self.tpot_ms.extend(o.tpot.map(|d| d.as_secs_f64() * 1e3));
            self.prompt_tokens += o.prompt_tokens;
            self.cached_tokens += o.cached_tokens;
        } else {
            self.failed += 1;
            if self.first_error.is_none() {
                self.first_error = o.error;
            }
        }
    }
}

/// Sends one streaming request and reads its events.
pub(crate) async fn one(request: reqwest::RequestBuilder) -> Outcome {
    let sent = Instant::now();
    let mut out = Outcome::default();
    let response = match request.send().await {
        Ok(r) => r,
        Err(e) => return Outcome { error: Some(e.to_string()), ..out },
    };
    if !response.status().is_success() {
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        return Outcome { error: Some(format!("{status}: {text}")), ..out };
    }
    let mut stream = response.bytes_stream();
    let mut buf = Vec::new();
    let (mut first, mut last, mut chunks, mut completion_tokens) = (None, None, 0u64, None);
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else {
            return Outcome { error: Some("the stream broke".into()), ..out };
        };
        buf.extend_from_slice(&chunk);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data:").map(str::trim) else { continue };
            if data == "[DONE]" {
                out.ok = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else { continue };
            if let Some(e) = v.get("error") {
                return Outcome { error: Some(e.to_string()), ..out };
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                out.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
                completion_tokens = u["completion_tokens"].as_u64();
            }
            // A chunk with a choice carries new tokens, also when their text is empty (an
            // engine holds back the text of a token that ends inside a UTF-8 character).
            if v["choices"].get(0).is_some() {
                let now = Instant::now();
                first.get_or_insert(now);
                last = Some(now);
                chunks += 1;
            }
        }
    }
    if let Some(f) = first {
        out.ttft = Some(f - sent);
        // Tokens after the first one: the usage's count where given (a chunk may carry several).
        let tokens = completion_tokens.unwrap_or(chunks);
        if let Some(l) = last.filter(|_| tokens > 1 && chunks > 1) {
            out.tpot = Some((l - f) / (tokens - 1) as u32);
        }
    }
    if !out.ok {
        out.error = Some("the stream ended without [DONE]".into());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_carries_its_class_tenant_deadline_and_session_as_the_gateway_reads_them() {
        let opts = Options {
            gateway: String::new(),
            token: String::new(),
            model: String::new(),
            block_size: 16,
            max_requests: None,
            vocab: DEFAULT_VOCAB,
            tenants: vec!["heavy".into(), "light".into()],
            slos: [Slo { ttft_ms: 500.0, tpot_ms: 50.0 }; 3],
        };
        let service = engine::Service {
            class: engine::Class::Interactive,
            tenant: engine::TenantId(1),
            deadline_ms: std::num::NonZeroU32::new(500),
            session: engine::SessionId::new(7),
            lift: false,
        };
        let headers = opts.service_headers(&service);
        let expected = [
            ("x-fleetplane-class", "interactive"),
            ("x-fleetplane-tenant", "light"),
            ("x-fleetplane-deadline-ms", "500"),
            ("x-fleetplane-session", "7"),
        ];
        assert_eq!(headers.iter().map(|(k, v)| (*k, v.as_str())).collect::<Vec<_>>(), expected);
        assert_eq!(opts.groups(&service), ["class interactive", "tenant light"]);
        // Its session hears it ended, and whether within its class's SLO.
        let o = Outcome { ok: true, ttft: Some(Duration::from_millis(400)), service, ..Outcome::default() };
        let end = opts.turn_end(&o, Duration::from_secs(3)).expect("a session's turn");
        assert_eq!(
            (end.session, end.at, end.finished, end.within_slo),
            (service.session.unwrap(), engine::Time(3_000_000), true, true)
        );
        let late = Outcome { ttft: Some(Duration::from_millis(600)), ..o };
        assert!(!opts.turn_end(&late, Duration::ZERO).expect("a turn").within_slo);
        // A standard request of a workload without tenants sends nothing.
        let plain = Options { tenants: Vec::new(), ..opts };
        assert!(plain.service_headers(&engine::Service::default()).is_empty());
    }

    #[test]
    fn shared_blocks_give_shared_tokens() {
        let a = [BlockHash(1), BlockHash(2)];
        let b = [BlockHash(1), BlockHash(3)];
        let (ta, tb) = (prompt_tokens(&a, 40, 16, 0, DEFAULT_VOCAB), prompt_tokens(&b, 40, 16, 1, DEFAULT_VOCAB));
        assert_eq!(ta.len(), 40);
        assert_eq!(ta[..16], tb[..16]);
        assert_ne!(ta[16..32], tb[16..32]);
    }

    #[test]
    fn token_ids_stay_inside_the_vocabulary() {
        let hashes: Vec<BlockHash> = (0..8).map(BlockHash).collect();
        let tokens = prompt_tokens(&hashes, 300, 32, 5, 484);
        assert_eq!(tokens.len(), 300);
        assert!(tokens.iter().all(|&t| t < 484));
        // Not all one id: a small vocabulary still gives varied prompts.
        assert!(tokens.iter().collect::<std::collections::HashSet<_>>().len() > 100);
    }
}

/// Where a client command sends its requests: a gateway, its token and the model to ask for
/// (`fleetplane replay` and `fleetplane latency`).
#[derive(clap::Args, Debug)]
pub struct GatewayArgs {
    /// Gateway base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub gateway: String,

    /// Bearer token (an inference or admin token).
    #[arg(long, env = "FLEETPLANE_ADMIN_TOKEN", hide_env_values = true)]
    pub token: String,

    /// Model name to ask for [default: the cost-model name the scenario or profile gives].
    #[arg(long)]
    pub served_model: Option<String>,

    /// Size of the served model's vocabulary: prompts use token ids below it (the engines
    /// refuse larger ones).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_VOCAB, value_parser = clap::value_parser!(u32).range(1..))]
    pub vocab: u32,
}

impl GatewayArgs {
    /// The base URL without a trailing slash.
    pub fn base_url(&self) -> &str {
        self.gateway.trim_end_matches('/')
    }

    /// The model to ask for: `--served-model`, else `default`.
    pub fn model(&self, default: &str) -> String {
        self.served_model.clone().unwrap_or_else(|| default.to_string())
    }
}

/// `fleetplane replay`: a workload through any fleetplane gateway, as clients would send it.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub flags: crate::cli::SimFlags,

    #[command(flatten)]
    pub gateway: GatewayArgs,

    /// Write the client-side summary as JSON.
    #[arg(long, value_name = "PATH")]
    pub json: Option<std::path::PathBuf>,
}

pub fn run(args: Args) -> Result<(), crate::Failure> {
    use crate::Failure;
    let settings = args.flags.settings()?;
    println!("{}", crate::cli::describe(&settings));
    let model = args.gateway.model(settings.cost.model().name);
    let opts = Options::new(&settings, args.gateway.base_url(), &args.gateway.token, &model, args.gateway.vocab);
    let workload = settings.open_workload(settings.rate_scale).map_err(|e| Failure::Input(e.into()))?;
    let mut summary =
        crate::runtime()?.block_on(replay(opts, workload, crate::shutdown_signal())).map_err(Failure::Run)?;
    print!("{}", summary.table());
    if let Some(e) = &summary.first_error {
        eprintln!("first failure: {e}");
    }
    if let Some(path) = &args.json {
        write_json(path, &summary.json()).map_err(|e| Failure::Output(e.into()))?;
    }
    if summary.ok == 0 && summary.sent > 0 {
        return Err(Failure::Run(anyhow::anyhow!("no request succeeded")));
    }
    Ok(())
}
