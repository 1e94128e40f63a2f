//! The live fleet: engine processes reached over gRPC, behind the same [`Fleet`] trait as the
//! simulator's. Dispatching a request starts its token stream on a task; what the streams and
//! the engines' event streams learn comes back to the driver as [`News`].

use crate::engine_proc::Sampling;
use crate::proto::{self, engine_client::EngineClient};
use engine::{InstanceId, Request, RequestId, Time};
use policies::{Command, DispatchError, Fleet, FleetEvent, Route};
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

/// What a request's client receives.
#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    Tokens(Vec<u32>),
    /// The last message: why it ended, and the prompt tokens the cache served by tier on
    /// `instance`, the engine that finished it.
    Done {
        finish_reason: String,
        cached_tokens: [u32; 3],
        instance: InstanceId,
    },
    /// The request failed after it started; the message says why.
    Failed(String),
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
}

/// What the fleet's tasks report to the driver.
#[derive(Debug)]
pub enum News {
    Event(FleetEvent),
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberState {
    Serving,
    Draining,
    Down,
}

/// One engine as the control plane knows it.
pub struct Member {
    pub id: InstanceId,
    pub address: String,
    pub pool: String,
    pub info: proto::EngineInfo,
    pub state: MemberState,
    pub load: engine::Load,
    pub last_seen: Instant,
    client: EngineClient<Channel>,
    events_task: Option<tokio::task::AbortHandle>,
}

impl Member {
    pub fn capacity_tokens(&self) -> u64 {
        self.info.capacity_tokens
    }
}

/// Placements a request gets before it fails (the first and two after lost engines).
pub const MAX_ATTEMPTS: u32 = 3;

pub struct LiveFleet {
    members: BTreeMap<InstanceId, Member>,
    /// Payloads of requests routed but not yet dispatched.
    staged: HashMap<RequestId, Payload>,
    events: Vec<FleetEvent>,
    news: mpsc::UnboundedSender<News>,
}

impl LiveFleet {
    pub fn new(news: mpsc::UnboundedSender<News>) -> LiveFleet {
        LiveFleet { members: BTreeMap::new(), staged: HashMap::new(), events: Vec::new(), news }
    }

    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    pub fn member(&self, id: InstanceId) -> Option<&Member> {
        self.members.get(&id)
    }

    pub fn member_mut(&mut self, id: InstanceId) -> Option<&mut Member> {
        self.members.get_mut(&id)
    }

    /// Keeps `payload` for the request's dispatch.
    pub fn stage(&mut self, id: RequestId, payload: Payload) {
        self.staged.insert(id, payload);
    }

    /// Takes back a payload whose request could not be routed.
    pub fn unstage(&mut self, id: RequestId) -> Option<Payload> {
        self.staged.remove(&id)
    }

    /// Records an engine's (re)registration; returns whether it is new or came back, in which
    /// case the controller hears `InstanceUp` and the fleet starts reading its events.
    pub fn join(&mut self, id: InstanceId, address: String, pool: String, info: proto::EngineInfo) -> bool {
        let now = Instant::now();
        if let Some(m) = self.members.get_mut(&id) {
            m.last_seen = now;
            if m.state != MemberState::Down && m.address == address {
                return false;
            }
        }
        let url = format!("http://{address}");
        let Ok(endpoint) = Channel::from_shared(url.clone()) else {
            tracing::warn!("engine address {address} is not a valid URI");
            return false;
        };
        let client = EngineClient::new(endpoint.connect_lazy());
        let events_task = Some(tokio::spawn(read_events(id, client.clone(), self.news.clone())).abort_handle());
        let capacity_tokens = info.capacity_tokens;
        let member = Member {
            id,
            address,
            pool,
            info,
            state: MemberState::Serving,
            load: engine::Load::default(),
            last_seen: now,
            client,
            events_task,
        };
        if let Some(old) = self.members.insert(id, member) {
            if let Some(t) = old.events_task {
                t.abort();
            }
        }
        self.events.push(FleetEvent::InstanceUp { instance: id, capacity_tokens });
        true
    }

    /// Marks an engine gone.
    pub fn lose(&mut self, id: InstanceId) {
        if let Some(m) = self.members.get_mut(&id) {
            if m.state != MemberState::Down {
                m.state = MemberState::Down;
                if let Some(t) = m.events_task.take() {
                    t.abort();
                }
                self.events.push(FleetEvent::InstanceDown { instance: id });
            }
        }
    }
}

impl Fleet for LiveFleet {
    fn dispatch(&mut self, _now: Time, request: Request, route: &Route) -> Result<(), (DispatchError, Request)> {
        let instance = route.prefill;
        let Some(m) = self.members.get(&instance).filter(|m| m.state == MemberState::Serving) else {
            return Err((DispatchError::NotServing { instance }, request));
        };
        let Some(payload) = self.staged.remove(&request.id) else {
            // The gateway stages every payload before routing; a missing one is a bug there.
            tracing::error!("{} dispatched without its tokens", request.id);
            return Err((DispatchError::NotServing { instance }, request));
        };
        tokio::spawn(stream_request(instance, m.client.clone(), request, payload, self.news.clone()));
        Ok(())
    }

    fn apply(&mut self, _now: Time, command: &Command) {
        match *command {
            Command::Drain { instance } => {
                if let Some(m) = self.members.get_mut(&instance) {
                    if m.state == MemberState::Serving {
                        m.state = MemberState::Draining;
                        self.events.push(FleetEvent::InstanceDraining { instance });
                        let mut client = m.client.clone();
                        tokio::spawn(async move {
                            if let Err(e) = client.drain(proto::DrainRequest {}).await {
                                tracing::warn!(%instance, "drain failed: {e}");
                            }
                        });
                    }
                }
            }
            // The live fleet is colocated: its engines never hand off a prefill, so the
            // controller has nothing to transfer, and no scaling policy runs in it yet (a
            // process actuator is the next step, docs/LIVE.md).
            Command::Start { role } => tracing::warn!(?role, "no actuator: cannot start an engine"),
            Command::Transfer { request, .. } => {
                tracing::error!(%request, "KV transfer asked of a colocated live fleet; ignored")
            }
        }
    }

    fn poll_events(&mut self, out: &mut Vec<FleetEvent>) {
        out.append(&mut self.events);
    }
}

/// Reads an engine's load reports and KV events until the stream ends.
async fn read_events(instance: InstanceId, mut client: EngineClient<Channel>, news: mpsc::UnboundedSender<News>) {
    let why = match client.events(proto::EventsRequest { min_interval_ms: 0 }).await {
        Err(e) => format!("cannot open its event stream: {e}"),
        Ok(stream) => {
            let mut stream = stream.into_inner();
            loop {
                match stream.next().await {
                    None => break "its event stream ended".to_string(),
                    Some(Err(e)) => break format!("its event stream failed: {e}"),
                    Some(Ok(event)) => match event.kind {
                        Some(proto::engine_event::Kind::Load(load)) => {
                            let _ = news.send(News::Event(FleetEvent::Load { instance, load: load.into() }));
                        }
                        Some(proto::engine_event::Kind::Kv(batch)) => {
                            let mut events = Vec::with_capacity(batch.events.len());
                            for e in &batch.events {
                                match engine::kv::KvEvent::try_from(e) {
                                    Ok(e) => events.push((instance, e)),
                                    Err(e) => tracing::warn!(%instance, "bad KV event skipped: {e}"),
                                }
                            }
                            let _ = news.send(News::Event(FleetEvent::Kv { events }));
                        }
                        None => tracing::warn!(%instance, "engine event without a kind"),
                    },
                }
            }
        }
    };
    let _ = news.send(News::EngineLost { instance, why });
}

/// Streams one request from its engine to its client.
async fn stream_request(
    instance: InstanceId,
    mut client: EngineClient<Channel>,
    request: Request,
    mut payload: Payload,
    news: mpsc::UnboundedSender<News>,
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
    };
    let failure = match client.generate(wire).await {
        Err(status) if status.code() == tonic::Code::InvalidArgument => {
            let _ = payload.out.send(Delta::Failed(format!("{instance} refused the request: {}", status.message())));
            let _ = news.send(News::Event(FleetEvent::RequestFinished { instance, request: request.id }));
            return;
        }
        Err(status) => format!("{instance} did not take the request: {}", status.message()),
        Ok(stream) => {
            let mut stream = stream.into_inner();
            loop {
                let next = tokio::select! {
                    next = stream.next() => next,
                    // The client went away: dropping the stream cancels the call, and the
                    // engine drops the request.
                    () = payload.out.closed() => {
                        let _ = news.send(News::Event(FleetEvent::RequestFinished { instance, request: request.id }));
                        return;
                    }
                };
                match next {
                    Some(Ok(chunk)) => {
                        if !chunk.tokens.is_empty() {
                            payload.generated.extend_from_slice(&chunk.tokens);
                            let _ = payload.out.send(Delta::Tokens(chunk.tokens));
                        }
                        if chunk.finish_reason == "evicted" {
                            break format!("{instance} evicted it under KV pressure");
                        }
                        if !chunk.finish_reason.is_empty() {
                            let mut cached_tokens = [0; 3];
                            for (c, v) in cached_tokens.iter_mut().zip(&chunk.cached_tokens) {
                                *c = *v;
                            }
                            let _ = payload.out.send(Delta::Done {
                                finish_reason: chunk.finish_reason,
                                cached_tokens,
                                instance,
                            });
                            let _ =
                                news.send(News::Event(FleetEvent::RequestFinished { instance, request: request.id }));
                            return;
                        }
                    }
                    Some(Err(status)) => break format!("{instance} failed mid-stream: {}", status.message()),
                    None => break format!("{instance} closed the stream before the request finished"),
                }
            }
        }
    };
    let _ = news.send(News::Replace { from: instance, request, payload, why: failure });
}
