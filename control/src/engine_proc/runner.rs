//! The engine's iteration loop on its own thread: the engine crate's scheduler and KV cache,
//! stepped in real time, with each step's tokens streamed to the requests' gRPC streams.
//!
//! With the cost-model executor a step sleeps for the time the model predicts (so a whole
//! fleet runs on one machine and behaves like GPUs would); a GPU executor takes the time it
//! takes. Commands arrive on a channel; nothing else touches the [`Instance`].

use crate::proto::{self, FinishReason, GenerateChunk};
use engine::{BlockId, Evicted, Executor, Finished, Instance, Request, RequestId, Time};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, oneshot};
use tonic::Status;

/// Sampling parameters of one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
}

/// What computes the engine's steps: the executor, plus what a token-producing executor needs
/// to know about each request.
pub trait Backend: Send {
    fn executor(&mut self) -> &mut dyn Executor;
    /// Whether a step lasts the time the executor predicts (a cost model) rather than the
    /// time its call took (a GPU).
    fn paced(&self) -> bool;
    /// A request was queued with these prompt tokens (a GPU executor keeps them).
    fn admit(&mut self, _id: RequestId, _prompt: &[u32], _sampling: Sampling) {}
    /// A request left the engine.
    fn release(&mut self, _id: RequestId) {}
    /// The cost model's names of the model and GPU the steps run on, for a step log.
    fn shape(&self) -> Option<(&'static str, &'static str)> {
        None
    }
    /// Facts about the executor worth logging beside the step timing (a GPU executor's
    /// CUDA graphs: how many were captured and replayed).
    fn notes(&self) -> String {
        String::new()
    }
    /// The KV of parked request `id` (its first `tokens` tokens, in `blocks`) as bytes a decode
    /// engine's [`Backend::import`] takes; empty when the KV has no bytes (a cost model's is
    /// only accounted).
    fn export_kv(&mut self, _id: RequestId, _blocks: &[BlockId], _tokens: u32) -> Result<Vec<u8>, String> {
        Ok(Vec::new())
    }
    /// Takes a request prefilled elsewhere: its KV into `blocks` (reserved for it) and what
    /// the executor keeps per request, so that it decodes on as it would have there.
    fn import(&mut self, _request: &Imported<'_>, _blocks: &[BlockId]) -> Result<(), String> {
        Ok(())
    }
}

/// A prefilled request arriving from a prefill engine, as a [`Backend`] takes it.
pub struct Imported<'a> {
    pub id: RequestId,
    /// The prompt as the prefill engine computed it, and the tokens it generated.
    pub prompt: &'a [u32],
    pub generated: &'a [u32],
    pub sampling: Sampling,
    /// The prefill engine's [`Backend::export_kv`] bytes.
    pub kv: &'a [u8],
}

/// Where a request's chunks go.
pub type ChunkSender = mpsc::UnboundedSender<Result<GenerateChunk, Status>>;

pub enum Command {
    Generate {
        request: Request,
        prompt: Vec<u32>,
        sampling: Sampling,
        out: ChunkSender,
    },
    /// The state of a prefilled request parked here, for a decode engine (see [`super::handoff`]).
    Export {
        id: RequestId,
        reply: oneshot::Sender<Result<proto::Handoff, Status>>,
    },
    /// Takes a prefilled request's KV from another engine and decodes the rest of it.
    Import {
        import: Import,
        reply: oneshot::Sender<Result<(), Status>>,
    },
    /// The KV of a parked request has been sent: free it here.
    Release {
        id: RequestId,
        reply: oneshot::Sender<bool>,
    },
    /// An operator's scheduling (checked by [`crate::scheduling::resolve`]), put in force
    /// between two steps; the reply is the scheduling in force after it.
    Configure {
        prefill: engine::PrefillPolicy,
        kv_protection: Option<engine::KvProtection>,
        /// Class priority, and its cap on lower classes' chunks.
        class_priority: (bool, Option<u32>),
        program_hold: Option<engine::ProgramHold>,
        /// The step budget (`None`: the one the engine started with; above it: capped).
        max_batch_tokens: Option<u32>,
        reply: oneshot::Sender<proto::Scheduling>,
    },
}

/// A hand-off arriving at a decode engine.
pub struct Import {
    pub request: Request,
    pub sampling: Sampling,
    /// The prompt as the prefill engine computed it, and the tokens it generated there.
    pub prompt: Vec<u32>,
    pub generated: Vec<u32>,
    /// The KV's bytes (empty from a cost-model engine, whose KV has none).
    pub kv: Vec<u8>,
    /// When the KV will have arrived, from its start: the link's modelled time for a KV
    /// without bytes; one with bytes has arrived once it is copied in.
    pub transfer: Duration,
    pub out: ChunkSender,
}

/// State the gRPC service reads without going through the loop.
pub struct Shared {
    pub events: broadcast::Sender<proto::EngineEvent>,
    pub draining: AtomicBool,
    pub in_flight: AtomicU32,
}

impl Shared {
    pub fn new() -> Arc<Shared> {
        let (events, _) = broadcast::channel(4096);
        Arc::new(Shared { events, draining: AtomicBool::new(false), in_flight: AtomicU32::new(0) })
    }
}

/// How often an idle engine still reports its load (a heartbeat for the control plane).
const IDLE_REPORT: Duration = Duration::from_millis(250);
/// Load reports at most this often while busy.
const BUSY_REPORT: Duration = Duration::from_millis(5);

pub(super) struct Stream {
    pub(super) out: ChunkSender,
    pub(super) seed: u64,
    /// Output tokens of the request so far, on every engine (the index of its next token).
    pub(super) produced: u32,
    /// A prefill engine keeps the prompt and the tokens it streamed, for the hand-off.
    pub(super) prompt: Vec<u32>,
    pub(super) sent: Vec<u32>,
}

pub struct Runner {
    pub(super) instance: Instance,
    pub(super) backend: Box<dyn Backend>,
    pub(super) shared: Arc<Shared>,
    pub(super) streams: BTreeMap<RequestId, Stream>,
    /// A prefill engine: requests stop after their first token and park with their KV.
    prefill_only: bool,
    /// Prefilled requests parked here until their KV is sent, with their tokens.
    pub(super) parked: BTreeMap<RequestId, super::handoff::Parked>,
    /// Imported requests whose KV is on its way, and when it lands (engine time).
    pub(super) landing: Vec<(Time, RequestId)>,
    /// How long a prefilled request may wait for its transfer.
    parked_limit: Duration,
    /// The step budget the engine started with: its buffers are sized for it, so an
    /// operator's budget is capped there.
    started_batch_tokens: u32,
    clock: Instant,
    last_report: Instant,
    timing: StepTiming,
    step_log: Option<StepLog>,
}

/// What the engine's steps cost, logged every [`StepTiming::EVERY`] while busy: the
/// executor's own time against the whole iteration's (the scheduler, streaming tokens, load
/// reports and KV events around it), which a profile measured on the executor alone
/// does not include.
struct StepTiming {
    since: Instant,
    steps: u32,
    executor_s: f64,
    iteration_s: f64,
}

impl StepTiming {
    const EVERY: Duration = Duration::from_secs(10);

    fn new() -> StepTiming {
        StepTiming { since: Instant::now(), steps: 0, executor_s: 0.0, iteration_s: 0.0 }
    }

    /// Adds a step; true when a period is over and [`StepTiming::log`] is due.
    fn record(&mut self, executor: engine::Dur, iteration: Duration) -> bool {
        self.steps += 1;
        self.executor_s += executor.as_secs_f64();
        self.iteration_s += iteration.as_secs_f64();
        self.since.elapsed() >= Self::EVERY
    }

    fn log(&mut self, notes: &str) {
        let n = f64::from(self.steps.max(1));
        let (executor_ms, iteration_ms) = (self.executor_s / n * 1e3, self.iteration_s / n * 1e3);
        tracing::info!(
            steps = self.steps,
            executor_ms = format!("{executor_ms:.3}"),
            iteration_ms = format!("{iteration_ms:.3}"),
            host_ms = format!("{:.3}", iteration_ms - executor_ms),
            "step timing (means){}{notes}",
            if notes.is_empty() { "" } else { "; " }
        );
        *self = StepTiming::new();
    }
}

/// `engine --step-log FILE`: every step the engine served (its batch aggregates and the
/// executor's time) as a step profile, which `simulate --profile` calibrates on and against
/// which a calibrated cost model can be checked (`simulate --check-steps`). The loop hands
/// its steps over every [`StepTiming::EVERY`] while busy and when it goes idle; a thread of
/// the log's own rewrites the file, so the loop never waits for the disk or the JSON.
pub struct StepLog {
    to_writer: std::sync::mpsc::Sender<Vec<engine::StepSample>>,
    pending: Vec<engine::StepSample>,
}

impl StepLog {
    /// The most steps kept (the first ones): about 130 bytes each in the file.
    const MAX_STEPS: usize = 200_000;

    /// Writes `header` (the model, GPU, block size and source; no step yet) to `path`, which
    /// says at once whether the file can be written, and starts the writer.
    pub fn start(path: std::path::PathBuf, mut header: engine::StepProfile) -> std::io::Result<StepLog> {
        std::fs::write(&path, serde_json::to_vec(&header).map_err(std::io::Error::other)?)?;
        let (to_writer, steps) = std::sync::mpsc::channel::<Vec<engine::StepSample>>();
        std::thread::Builder::new().name("step-log".into()).spawn(move || {
            while let Ok(batch) = steps.recv() {
                let room = Self::MAX_STEPS.saturating_sub(header.samples.len());
                header.samples.extend(batch.into_iter().take(room));
                Self::write(&path, &header);
            }
        })?;
        Ok(StepLog { to_writer, pending: Vec::new() })
    }

    fn record(&mut self, stats: &engine::BatchStats, executor: engine::Dur) {
        self.pending.push(engine::StepSample::new(stats, executor.as_secs_f64()));
    }

    /// Hands the steps since the last flush to the writer.
    fn flush(&mut self) {
        if !self.pending.is_empty() {
            // A writer that is gone (it cannot have failed but by panicking) loses the log only.
            let _ = self.to_writer.send(std::mem::take(&mut self.pending));
        }
    }

    /// Writes the file whole, through a temporary one so that a reader never sees half of it.
    fn write(path: &std::path::Path, profile: &engine::StepProfile) {
        let tmp = path.with_extension("json.tmp");
        let written = serde_json::to_vec(profile)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            tracing::warn!("cannot write the step log {}: {e}", path.display());
        }
    }
}

impl Runner {
    /// `prefill_only`: a prefill engine, whose prefilled requests wait at most `parked_limit`
    /// to be sent on.
    pub fn new(
        mut instance: Instance,
        backend: Box<dyn Backend>,
        shared: Arc<Shared>,
        prefill_only: bool,
        parked_limit: Duration,
    ) -> Runner {
        instance.record_kv_events();
        let clock = Instant::now();
        let started_batch_tokens = instance.config().max_batch_tokens;
        Runner {
            instance,
            started_batch_tokens,
            backend,
            shared,
            streams: BTreeMap::new(),
            prefill_only,
            parked: BTreeMap::new(),
            landing: Vec::new(),
            parked_limit,
            clock,
            last_report: clock,
            timing: StepTiming::new(),
            step_log: None,
        }
    }

    /// Logs every step into `log` (see [`StepLog`]).
    pub fn with_step_log(mut self, log: Option<StepLog>) -> Runner {
        self.step_log = log;
        self
    }

    pub(super) fn now(&self) -> Time {
        Time(self.clock.elapsed().as_micros() as u64)
    }

    /// Runs until the command channel closes and the last request is done.
    pub fn run(mut self, commands: Receiver<Command>) {
        let mut finished = Vec::new();
        let mut evicted = Vec::new();
        let mut kv = engine::kv::KvEvents::new();
        // When the last step ended: an iteration runs from there to the next step's end.
        let mut last_end: Option<Instant> = None;
        loop {
            self.land_transfers();
            self.expire_parked(self.parked_limit);
            if !self.instance.has_work() {
                last_end = None;
                if let Some(log) = &mut self.step_log {
                    log.flush();
                }
                match commands.recv_timeout(self.idle_wait(IDLE_REPORT)) {
                    Ok(c) => self.handle(c),
                    Err(RecvTimeoutError::Timeout) => {
                        self.report_load();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            self.take_commands(&commands);
            self.cancel_abandoned();
            let start = self.now();
            let paced = self.backend.paced();
            match self.instance.begin_step(start, self.backend.executor()) {
                Ok(Some(d)) => {
                    let end = if paced {
                        let at = self.clock + Duration::from_micros(start.0 + d.0);
                        std::thread::sleep(at.saturating_duration_since(Instant::now()));
                        start + d
                    } else {
                        self.now()
                    };
                    if let Some(log) = &mut self.step_log {
                        log.record(&self.instance.batch().stats, d);
                    }
                    self.instance.end_step(end, &mut finished, &mut evicted);
                    let ended = Instant::now();
                    if let Some(previous) = last_end {
                        if self.timing.record(d, ended - previous) {
                            self.timing.log(&self.backend.notes());
                            if let Some(log) = &mut self.step_log {
                                log.flush();
                            }
                        }
                    }
                    last_end = Some(ended);
                    self.stream_tokens();
                    self.retire(&mut finished, &mut evicted);
                    self.park_handoffs();
                }
                // Work is queued but none can run (e.g. admission paused): wait for news.
                Ok(None) => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => {
                    tracing::error!("step failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            self.instance.drain_kv_events(&mut kv);
            if !kv.is_empty() {
                let kind = proto::engine_event::Kind::Kv(proto::KvEvents::from(&kv));
                kv.clear();
                // No subscriber yet: the control plane learns the cache from later events.
                let _ = self.shared.events.send(proto::EngineEvent { kind: Some(kind) });
            }
            if self.last_report.elapsed() >= BUSY_REPORT || !self.instance.has_work() {
                // Requests that arrived during the step go into the report: the control plane
                // stops counting what it routed here once a report comes, so a report that
                // left them in the channel would hide them for a whole (long) step.
                self.take_commands(&commands);
                self.report_load();
            }
        }
    }

    /// Handles every command waiting in the channel.
    fn take_commands(&mut self, commands: &Receiver<Command>) {
        while let Ok(c) = commands.try_recv() {
            self.handle(c);
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Generate { request, prompt, sampling, out } => {
                let id = request.id;
                if self.streams.contains_key(&id) {
                    let _ = out.send(Err(Status::already_exists(format!("{id} is already running here"))));
                    return;
                }
                self.backend.admit(id, &prompt, sampling);
                let now = self.now();
                let queued = if self.prefill_only {
                    self.instance.enqueue_prefill_only(now, request)
                } else {
                    self.instance.enqueue(now, request)
                };
                match queued {
                    Ok(()) => {
                        self.shared.in_flight.fetch_add(1, Ordering::Relaxed);
                        let prompt = if self.prefill_only { prompt } else { Vec::new() };
                        let stream = Stream { out, seed: sampling.seed, produced: 0, prompt, sent: Vec::new() };
                        self.streams.insert(id, stream);
                    }
                    Err((why, _)) => {
                        self.backend.release(id);
                        let _ = out.send(Err(Status::invalid_argument(why.to_string())));
                    }
                }
            }
            Command::Export { id, reply } => {
                let _ = reply.send(self.export(id));
            }
            Command::Import { import, reply } => {
                let _ = reply.send(self.import(import));
            }
            Command::Release { id, reply } => {
                let _ = reply.send(self.release(id));
            }
            Command::Configure { prefill, kv_protection, class_priority, program_hold, max_batch_tokens, reply } => {
                let now = self.now();
                self.instance.set_scheduling(now, prefill, kv_protection);
                let budget = crate::scheduling::budget_in_force(max_batch_tokens, self.started_batch_tokens);
                self.instance.set_max_batch_tokens(budget);
                self.instance.set_class_priority(class_priority.0, class_priority.1);
                self.instance.set_program_hold(now, program_hold);
                let scheduling = crate::scheduling::of(self.instance.config());
                tracing::info!(?scheduling, "scheduling in force");
                let _ = reply.send(scheduling);
                // The control plane learns the change from the next report: send it now.
                self.report_load();
            }
        }
    }

    /// Drops the requests whose client stopped reading (the gateway closed the stream): they
    /// would hold KV and batch slots to the end of their output for nobody.
    fn cancel_abandoned(&mut self) {
        let gone: Vec<RequestId> = self
            .streams
            .iter()
            .filter(|&(&id, s)| s.out.is_closed() && !self.is_landing(id))
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            let now = self.now();
            if self.instance.cancel(now, id) {
                tracing::info!(request = %id, "client gone: request cancelled");
            }
            self.backend.release(id);
            self.streams.remove(&id);
            self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Sends each token of the step to its request's stream. A sampling executor's tokens
    /// come in the order of `emitted`; a cost model samples none, and the engine makes up
    /// deterministic ones.
    fn stream_tokens(&mut self) {
        let sampled = &self.instance.step_output().tokens;
        for (k, id) in self.instance.emitted().iter().enumerate() {
            let Some(s) = self.streams.get_mut(id) else { continue };
            let token = sampled.get(k).copied().unwrap_or_else(|| synthetic_token(s.seed, *id, s.produced));
            s.produced += 1;
            if self.prefill_only {
                s.sent.push(token);
            }
            // A client that went away no longer reads; the request still runs to its end.
            let _ = s.out.send(Ok(GenerateChunk { tokens: vec![token], ..Default::default() }));
        }
    }

    fn retire(&mut self, finished: &mut Vec<Finished>, evicted: &mut Vec<Evicted>) {
        for f in finished.drain(..) {
            let reason = if f.ended.is_some() { FinishReason::CutShort } else { FinishReason::Length };
            self.close(f.request.id, reason, f.cached_tokens.to_vec());
        }
        for e in evicted.drain(..) {
            self.close(e.request.id, FinishReason::Evicted, Vec::new());
        }
    }

    pub(super) fn close(&mut self, id: RequestId, reason: FinishReason, cached_tokens: Vec<u32>) {
        self.backend.release(id);
        if let Some(s) = self.streams.remove(&id) {
            self.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
            let chunk = GenerateChunk { finish_reason: reason.into(), cached_tokens, ..GenerateChunk::default() };
            let _ = s.out.send(Ok(chunk));
        }
    }

    fn report_load(&mut self) {
        self.last_report = Instant::now();
        let mut load = proto::Load::from(self.instance.load());
        load.scheduling = Some(crate::scheduling::of(self.instance.config()));
        let kind = proto::engine_event::Kind::Load(load);
        let _ = self.shared.events.send(proto::EngineEvent { kind: Some(kind) });
    }
}

/// Vocabulary of the made-up tokens a cost-model engine streams.
pub const SYNTHETIC_VOCAB: u32 = 32_000;

/// A token for position `k` of a request's output: deterministic in the request's seed, so
/// a replayed run streams the same text.
pub fn synthetic_token(seed: u64, id: RequestId, k: u32) -> u32 {
    (engine::ids::mix64(seed ^ engine::ids::mix64(id.0 ^ (u64::from(k) << 40))) % u64::from(SYNTHETIC_VOCAB)) as u32
}
