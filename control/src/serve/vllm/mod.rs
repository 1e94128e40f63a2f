//! Engines that are not ours: vLLM (and SGLang) processes in the live fleet. Requests go to
//! the engine's own OpenAI API ([`relay`]); its ZMQ KV events feed the global prefix index
//! ([`subscriber`], [`kv_events`], [`hashes`]); its Prometheus `/metrics` and `/health`
//! become load reports and liveness ([`watch`], [`metrics`]). The control plane tokenizes
//! prompts (with the model's chat template) only to know the block hashes the engine caches.

pub mod hashes;
pub mod kv_events;
pub mod metrics;
pub mod relay;
pub mod subscriber;

use super::news::News;
use super::stream::{Lost, LostSignal};
use crate::serve::lock::lock;
use engine::InstanceId;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Which kind of engine a member is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// `fleetplane engine` over gRPC: it registers itself.
    Fleetplane,
    Vllm,
    Sglang,
}

impl EngineKind {
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Fleetplane => "fleetplane",
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
        }
    }
}

/// An engine an operator registers: `serve --engine`, an `--engines` file, or
/// `POST /api/engines`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSpec {
    pub kind: EngineKind,
    /// Its OpenAI API, `http://host:port`.
    pub url: String,
    /// The endpoint its KV events are published to (its `--kv-events-config` `endpoint`),
    /// which the control plane binds; without one the router is blind to its cache.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Its replay socket (`replay_endpoint`), for events missed.
    #[serde(default)]
    pub replay: Option<String>,
    /// The pool it serves in.
    #[serde(default = "colocated")]
    pub role: String,
    /// The model folder (or tokenizer.json) to tokenize its prompts with; by default the
    /// folder the engine reports as its model's root, when this machine can read it.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// Started by this control plane's actuator (`serve --engine-command`): not registered
    /// again at a restart, since its process went with the control plane that started it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub actuated: bool,
    /// How the engine orders its waiting requests (its `--scheduling-policy`). With
    /// `priority`, and class priority in the policy in force, each request is sent its class
    /// as vLLM's `priority` (interactive 0, standard 1, batch 2: lower goes first). Not
    /// checked: vLLM 0.32 takes the field and ignores it when it schedules FCFS.
    #[serde(default)]
    pub scheduling_policy: SchedulingPolicy,
}

/// An engine's `--scheduling-policy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedulingPolicy {
    /// In order of arrival (vLLM's default).
    #[default]
    Fcfs,
    /// By the request's `priority`, then arrival.
    Priority,
}

impl SchedulingPolicy {
    /// The `priority` an engine scheduling by it is sent for a request of `class`.
    pub fn priority(self, class: engine::Class) -> Option<u32> {
        (self == SchedulingPolicy::Priority).then_some(class.index() as u32)
    }
}

fn colocated() -> String {
    "colocated".into()
}

impl std::str::FromStr for EngineSpec {
    type Err = String;

    /// `KIND=URL[,kv-events=ENDPOINT][,replay=ENDPOINT][,role=ROLE][,tokenizer=PATH][,scheduling-policy=POLICY]`.
    fn from_str(arg: &str) -> Result<EngineSpec, String> {
        let mut parts = arg.split(',');
        let head = parts.next().unwrap_or_default();
        let (kind, url) =
            head.split_once('=').ok_or_else(|| format!("`{arg}` is not KIND=URL[,kv-events=ENDPOINT,...]"))?;
        let kind = match kind {
            "vllm" => EngineKind::Vllm,
            "sglang" => EngineKind::Sglang,
            "fleetplane" => {
                return Err("fleetplane engines register themselves (`fleetplane engine --control ADDRESS`)".into())
            }
            other => return Err(format!("unknown engine kind `{other}` (valid: vllm, sglang)")),
        };
        let mut spec = EngineSpec {
            kind,
            url: url.to_string(),
            kv_events: None,
            replay: None,
            role: colocated(),
            tokenizer: None,
            actuated: false,
            scheduling_policy: SchedulingPolicy::Fcfs,
        };
        for part in parts {
            let (key, value) = part.split_once('=').ok_or_else(|| format!("`{part}` in `{arg}` is not KEY=VALUE"))?;
            match key {
                "kv-events" => spec.kv_events = Some(value.to_string()),
                "replay" => spec.replay = Some(value.to_string()),
                "role" => spec.role = value.to_string(),
                "tokenizer" => spec.tokenizer = Some(PathBuf::from(value)),
                "scheduling-policy" => {
                    spec.scheduling_policy = match value {
                        "fcfs" => SchedulingPolicy::Fcfs,
                        "priority" => SchedulingPolicy::Priority,
                        _ => return Err(format!("scheduling-policy: `{value}` is not fcfs or priority")),
                    }
                }
                other => {
                    return Err(format!(
                        "unknown engine option `{other}` (valid: kv-events, replay, role, tokenizer, scheduling-policy)"
                    ))
                }
            }
        }
        spec.validate()?;
        Ok(spec)
    }
}

impl EngineSpec {
    /// Checks what can be checked without reaching the engine; the error names the field.
    pub fn validate(&mut self) -> Result<(), String> {
        if self.kind == EngineKind::Fleetplane {
            return Err("kind: fleetplane engines register themselves".into());
        }
        let url = reqwest::Url::parse(&self.url).map_err(|e| format!("url: `{}` is not a URL: {e}", self.url))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(format!("url: `{}` is not an http(s)://host:port URL", self.url));
        }
        self.url = self.url.trim_end_matches('/').to_string();
        for (name, endpoint) in [("kv_events", &self.kv_events), ("replay", &self.replay)] {
            if let Some(e) = endpoint {
                if !e.starts_with("tcp://") || e.rsplit_once(':').is_none_or(|(_, p)| p.parse::<u16>().is_err()) {
                    return Err(format!("{name}: `{e}` is not a tcp://host:port ZMQ endpoint"));
                }
            }
        }
        if self.replay.is_some() && self.kv_events.is_none() {
            return Err("replay: a replay endpoint needs kv_events too".into());
        }
        if !matches!(self.role.as_str(), "colocated" | "prefill" | "decode") {
            return Err(format!("role: `{}` is not colocated, prefill or decode", self.role));
        }
        Ok(())
    }
}

/// What an engine says about itself when first reached.
#[derive(Clone, Debug)]
pub struct Probed {
    /// The name it serves its model under (`/v1/models` id).
    pub model: String,
    /// Its model folder, as the engine names it.
    pub root: Option<String>,
    pub max_model_len: u64,
    pub block_size: u32,
    pub gpu_blocks: u64,
}

impl Probed {
    /// The largest request it can hold: its KV, bounded by its context length.
    pub fn capacity_tokens(&self) -> u64 {
        let kv = self.gpu_blocks * u64::from(self.block_size);
        if self.max_model_len > 0 {
            kv.min(self.max_model_len)
        } else {
            kv
        }
    }
}

/// How long one call to an engine's health or metrics may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Reads an engine's model and KV geometry; the error names the URL and what failed.
pub async fn probe(http: &reqwest::Client, spec: &EngineSpec) -> Result<Probed, String> {
    let url = &spec.url;
    let models: serde_json::Value = serde_json::from_str(&get(http, url, "/v1/models").await?)
        .map_err(|e| format!("{url}/v1/models is not JSON: {e} (is it an OpenAI API?)"))?;
    let first = &models["data"][0];
    let model = first["id"].as_str().ok_or_else(|| format!("{url}/v1/models lists no model"))?.to_string();
    let page = metrics::parse(&get(http, url, "/metrics").await?);
    if !page.known {
        return Err(format!("{url}/metrics has none of {}'s metrics", spec.kind.name()));
    }
    let (Some(block_size), Some(gpu_blocks)) = (page.block_size, page.gpu_blocks) else {
        return Err(format!("{url}/metrics has no vllm:cache_config_info with block_size and num_gpu_blocks"));
    };
    Ok(Probed {
        model,
        root: first["root"].as_str().map(str::to_string),
        max_model_len: first["max_model_len"].as_u64().unwrap_or(0),
        block_size,
        gpu_blocks,
    })
}

/// The text of `url` + `path`; the error names the URL and what failed.
async fn get(http: &reqwest::Client, url: &str, path: &str) -> Result<String, String> {
    let r = http
        .get(format!("{url}{path}"))
        .timeout(PROBE_TIMEOUT)
        .send()
        .await
        .map_err(|e| format!("cannot reach {url}{path}: {}", error_chain(&e)))?;
    if !r.status().is_success() {
        return Err(format!("{url}{path} answered {}", r.status()));
    }
    r.text().await.map_err(|e| format!("{url}{path}: {e}"))
}

/// A reqwest error with its causes ("connection refused" sits in the source chain).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// What the control plane sent an engine and has not heard the end of: the part of its load
/// that a scrape cannot show yet.
#[derive(Debug, Default, Clone, Copy)]
pub struct InFlight {
    pub requests: u32,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
}

/// One registered engine, shared by its tasks.
pub struct Engine {
    pub spec: EngineSpec,
    pub probed: Probed,
    pub http: reqwest::Client,
    in_flight: Mutex<InFlight>,
    /// Raised when the engine is taken out: its streams stop waiting and are placed again.
    lost: LostSignal,
    /// How its KV event stream has gone.
    pub events: Arc<Mutex<subscriber::EventStats>>,
    /// The watcher and KV event tasks, stopped when the engine is removed.
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        for t in self.tasks.get_mut().unwrap_or_else(|p| p.into_inner()).drain(..) {
            t.abort();
        }
    }
}

impl Engine {
    pub fn new(spec: EngineSpec, probed: Probed, http: reqwest::Client) -> Engine {
        Engine {
            spec,
            probed,
            http,
            in_flight: Mutex::default(),
            lost: LostSignal::new(),
            events: Arc::default(),
            tasks: Mutex::default(),
        }
    }

    fn adjust(&self, f: impl FnOnce(&mut InFlight)) {
        f(&mut lock(&self.in_flight));
    }

    pub fn in_flight(&self) -> InFlight {
        *lock(&self.in_flight)
    }

    /// Tells the engine's streams that it is gone.
    pub fn signal_lost(&self) {
        self.lost.raise();
    }

    pub(in crate::serve) fn lost_signal(&self) -> Lost {
        self.lost.watch()
    }

    pub fn stop_tasks(&self) {
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
    }

    /// Starts its watcher and, with an endpoint, its KV event reader.
    pub fn start(
        self: &Arc<Self>,
        instance: InstanceId,
        sub: Option<subscriber::Subscriber>,
        news: mpsc::UnboundedSender<News>,
    ) {
        let mut tasks = lock(&self.tasks);
        tasks.push(tokio::spawn(watch(instance, self.clone(), news.clone())).abort_handle());
        if let Some(s) = sub {
            let stats = self.events.clone();
            tasks.push(tokio::spawn(subscriber::run(s, instance, self.probed.block_size, news, stats)).abort_handle());
        }
    }
}

/// How often an engine's health is checked and a load report made (the engine's fields from
/// the last scrape, the control plane's own tally of what it has in flight there fresh).
const SCRAPE_EVERY: Duration = Duration::from_millis(250);
/// How often its `/metrics` is read. vLLM renders the page on its API server's event loop
/// (~30 ms on these 2-core machines): read every 250 ms it held the server's requests back,
/// TTFT p90 20 → 124 ms (docs/BENCHMARKS.md, "Simulator fidelity against vLLM").
const METRICS_EVERY: Duration = Duration::from_secs(1);
/// An engine whose health check fails this long is taken out.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(3);

/// Reads the engine's `/health` and `/metrics` until its tasks stop: each scrape a load
/// report; an engine failing its health check for [`HEALTH_TIMEOUT`] is reported lost, and
/// back (its cache empty) when it answers again.
async fn watch(instance: InstanceId, engine: Arc<Engine>, news: mpsc::UnboundedSender<News>) {
    let mut failing_since: Option<Instant> = None;
    let mut lost = false;
    let mut ticker = tokio::time::interval(SCRAPE_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut scraped: Option<(Instant, metrics::Scrape)> = None;
    loop {
        ticker.tick().await;
        match scrape(&engine, &mut scraped).await {
            Ok(load) => {
                // After any failure, not only one it reported: the driver may have taken the
                // engine out meanwhile for its silence (reviving a serving one does nothing).
                if failing_since.take().is_some() {
                    lost = false;
                    let _ = news.send(News::EngineBack { instance });
                }
                let _ = news.send(News::Event(policies::FleetEvent::Load { instance, load }));
            }
            Err(why) => {
                let since = *failing_since.get_or_insert_with(Instant::now);
                if !lost && since.elapsed() >= HEALTH_TIMEOUT {
                    lost = true;
                    engine.signal_lost();
                    let _ = news.send(News::EngineLost { instance, why });
                }
            }
        }
    }
}

/// One health check, and a scrape when the last is [`METRICS_EVERY`] old, as a load report.
async fn scrape(engine: &Engine, scraped: &mut Option<(Instant, metrics::Scrape)>) -> Result<engine::Load, String> {
    let url = &engine.spec.url;
    get(&engine.http, url, "/health").await?;
    let last = match scraped.take() {
        Some((at, s)) if at.elapsed() < METRICS_EVERY => (at, s),
        _ => (Instant::now(), metrics::parse(&get(&engine.http, url, "/metrics").await?)),
    };
    let load = load(&last.1, engine.in_flight(), engine.probed.gpu_blocks);
    *scraped = Some(last);
    Ok(load)
}

/// A load report from a scrape and what the control plane has in flight there: requests it
/// sent that the scrape does not show yet count as waiting, and the tokens left are its own
/// tally (the engine's metrics do not carry them).
pub fn load(s: &metrics::Scrape, sent: InFlight, gpu_blocks: u64) -> engine::Load {
    let total = u32::try_from(gpu_blocks).unwrap_or(u32::MAX);
    engine::Load {
        waiting: s.waiting.max(sent.requests.saturating_sub(s.running)),
        running: s.running,
        kv_used_blocks: (s.kv_usage.clamp(0.0, 1.0) * f64::from(total)).round() as u32,
        kv_total_blocks: total,
        kv_cached_blocks: 0,
        prefill_tokens_left: sent.prefill_tokens,
        decode_tokens_left: sent.decode_tokens,
        admission_paused: false,
    }
}

/// A request's part of an engine's [`InFlight`], taken back as the request progresses.
pub struct Share<'a> {
    engine: &'a Engine,
    prefill: u64,
    decode: u64,
}

impl<'a> Share<'a> {
    /// The share of a request with `prompt_tokens` to compute and `output_tokens` to make.
    pub fn new(engine: &'a Engine, prompt_tokens: u32, output_tokens: u32) -> Share<'a> {
        let (prefill, decode) = (u64::from(prompt_tokens), u64::from(output_tokens));
        engine.adjust(|f| {
            f.requests += 1;
            f.prefill_tokens += prefill;
            f.decode_tokens += decode;
        });
        Share { engine, prefill, decode }
    }

    /// The prompt is done (the first token came).
    pub fn prefilled(&mut self) {
        let p = std::mem::take(&mut self.prefill);
        self.engine.adjust(|f| f.prefill_tokens = f.prefill_tokens.saturating_sub(p));
    }

    pub fn generated(&mut self, tokens: u64) {
        let n = tokens.min(self.decode);
        self.decode -= n;
        self.engine.adjust(|f| f.decode_tokens = f.decode_tokens.saturating_sub(n));
    }
}

impl Drop for Share<'_> {
    fn drop(&mut self) {
        let (p, d) = (self.prefill, self.decode);
        self.engine.adjust(|f| {
            f.requests = f.requests.saturating_sub(1);
            f.prefill_tokens = f.prefill_tokens.saturating_sub(p);
            f.decode_tokens = f.decode_tokens.saturating_sub(d);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_flags_parse_and_bad_ones_are_named() {
        let s: EngineSpec =
            "vllm=http://127.0.0.1:8000/,kv-events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,tokenizer=/m"
                .parse()
                .unwrap();
        assert_eq!(s.kind, EngineKind::Vllm);
        assert_eq!(s.url, "http://127.0.0.1:8000");
        assert_eq!(s.kv_events.as_deref(), Some("tcp://127.0.0.1:5557"));
        assert_eq!(s.replay.as_deref(), Some("tcp://127.0.0.1:5558"));
        assert_eq!(s.tokenizer, Some(PathBuf::from("/m")));
        assert_eq!(s.scheduling_policy, SchedulingPolicy::Fcfs);
        let s: EngineSpec = "vllm=http://x:1,scheduling-policy=priority".parse().unwrap();
        assert_eq!(s.scheduling_policy.priority(engine::Class::Batch), Some(2));
        assert_eq!(s.scheduling_policy.priority(engine::Class::Interactive), Some(0));
        assert_eq!(SchedulingPolicy::Fcfs.priority(engine::Class::Batch), None);
        for (arg, says) in [
            ("vllm", "is not KIND=URL"),
            ("tgi=http://x:1", "unknown engine kind `tgi`"),
            ("fleetplane=127.0.0.1:1", "register themselves"),
            ("vllm=not a url", "url: `not a url` is not a URL"),
            ("vllm=ftp://x:1", "not an http(s)://host:port URL"),
            ("vllm=http://x:1,kv-events=x:1", "kv_events: `x:1` is not a tcp://host:port"),
            ("vllm=http://x:1,replay=tcp://x:2", "needs kv_events"),
            ("vllm=http://x:1,colour=blue", "unknown engine option `colour`"),
            ("vllm=http://x:1,role=mixed", "role: `mixed` is not colocated, prefill or decode"),
            ("vllm=http://x:1,scheduling-policy=lifo", "scheduling-policy: `lifo` is not fcfs or priority"),
        ] {
            let e = arg.parse::<EngineSpec>().unwrap_err();
            assert!(e.contains(says), "{arg}: {e}");
        }
    }

    #[test]
    fn a_load_report_counts_what_the_scrape_does_not_show_yet() {
        let s = metrics::Scrape { running: 2, waiting: 1, kv_usage: 0.5, ..Default::default() };
        let sent = InFlight { requests: 5, prefill_tokens: 300, decode_tokens: 40 };
        let l = load(&s, sent, 100);
        assert_eq!((l.waiting, l.running, l.kv_used_blocks, l.kv_total_blocks), (3, 2, 50, 100));
        assert_eq!((l.prefill_tokens_left, l.decode_tokens_left), (300, 40));
        // The scrape saw more than was sent (another client): its numbers stand.
        let l = load(&metrics::Scrape { running: 4, waiting: 6, ..Default::default() }, sent, 100);
        assert_eq!((l.waiting, l.running), (6, 4));
    }
}
