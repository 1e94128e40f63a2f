//! The live fleet: engine processes reached over gRPC, behind the same [`Fleet`] trait as the
//! simulator's. Dispatching a request starts its token stream on a task; what the streams and
//! the engines' event streams learn comes back to the driver as [`News`].

use super::actuator::Actuator;
use super::news::{Delta, News, Parked, Payload};
use super::stream::{stream_request, LostSignal, Reporter};
use super::vllm::{self, EngineKind};
use crate::engine_auth::{EngineLink, Present};
use crate::proto;
use engine::{InstanceId, ModelId, Request, RequestId, Time};
use policies::{Command, DispatchError, Fleet, FleetEvent, Role, Route, TransferHints};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberState {
    Serving,
    Draining,
    Down,
}

impl MemberState {
    pub fn name(self) -> &'static str {
        match self {
            MemberState::Serving => "serving",
            MemberState::Draining => "draining",
            MemberState::Down => "down",
        }
    }
}

/// One engine as the control plane knows it.
pub struct Member {
    pub id: InstanceId,
    pub address: String,
    pub pool: String,
    pub role: Role,
    pub info: proto::EngineInfo,
    pub state: MemberState,
    pub load: engine::Load,
    pub last_seen: Instant,
    link: Link,
    events_task: Option<tokio::task::AbortHandle>,
    /// A task is waiting for this draining engine to empty (see [`super::actuator`]).
    pub drain_watched: bool,
    /// The scheduling the engine last reported (`None` until its first load report).
    pub scheduling: Option<proto::Scheduling>,
}

/// How the control plane reaches an engine.
#[derive(Clone)]
enum Link {
    /// `fleetplane engine`: our gRPC protocol, and the signal its streams watch.
    Grpc(Box<EngineLink>, LostSignal),
    /// An engine with its own OpenAI API (vLLM, SGLang).
    Http(Arc<vllm::Engine>),
}

impl Member {
    pub fn capacity_tokens(&self) -> u64 {
        self.info.capacity_tokens
    }

    /// Its gRPC client; `None` for engines that are not ours.
    pub fn client(&self) -> Option<EngineLink> {
        match &self.link {
            Link::Grpc(c, _) => Some((**c).clone()),
            Link::Http(_) => None,
        }
    }

    pub fn kind(&self) -> EngineKind {
        match &self.link {
            Link::Grpc(..) => EngineKind::Fleetplane,
            Link::Http(e) => e.spec.kind,
        }
    }

    /// An engine that is not ours.
    pub fn external(&self) -> Option<&Arc<vllm::Engine>> {
        match &self.link {
            Link::Http(e) => Some(e),
            Link::Grpc(..) => None,
        }
    }
}

/// A pool's name as engines register it.
pub fn role_by_name(pool: &str) -> Option<Role> {
    [Role::Colocated, Role::Prefill, Role::Decode].into_iter().find(|r| r.name() == pool)
}

/// Placements a request gets before it fails (the first and two after lost engines).
pub const MAX_ATTEMPTS: u32 = 3;

pub struct LiveFleet {
    /// The engine token each call to an engine of ours carries.
    present: Present,
    /// Served models' names, indexed by their `ModelId`.
    models: Vec<String>,
    members: BTreeMap<InstanceId, Member>,
    /// Prefilled requests waiting for a decode engine.
    parked: BTreeMap<RequestId, Parked>,
    events: Vec<FleetEvent>,
    report: Reporter,
    /// The link between prefill and decode engines, for the modelled transfer time.
    transfer: Option<TransferHints>,
    /// Starts and stops engine processes (`None`: the fleet is what registers).
    actuator: Option<Box<dyn Actuator>>,
    /// The scheduling of the policy in force, sent to every engine that joins (`None`: the
    /// engines keep their own).
    scheduling: Option<proto::Scheduling>,
}

impl LiveFleet {
    /// A fleet whose calls to engines of ours present `present`'s token.
    pub fn new(news: mpsc::UnboundedSender<News>, present: Present) -> LiveFleet {
        LiveFleet {
            present,
            models: Vec::new(),
            members: BTreeMap::new(),
            parked: BTreeMap::new(),
            events: Vec::new(),
            report: Reporter { news, latencies: false, clock: Instant::now() },
            transfer: None,
            actuator: None,
            scheduling: None,
        }
    }

    /// The scheduling of the policy in force (`None`: the engines' own).
    pub fn scheduling(&self) -> Option<&proto::Scheduling> {
        self.scheduling.as_ref()
    }

    /// Puts a scheduling in force on every engine now, and on each that joins later.
    pub fn set_scheduling(&mut self, scheduling: proto::Scheduling) {
        for m in self.members.values().filter(|m| m.state != MemberState::Down) {
            if let Some(client) = m.client() {
                tokio::spawn(configure(m.id, client, scheduling.clone()));
            }
        }
        self.scheduling = Some(scheduling);
    }

    /// What the controller needs of the fleet: latencies of finished requests (for the SLO
    /// load), and the link a hand-off's KV crosses.
    pub fn configure(&mut self, latencies: bool, transfer: Option<TransferHints>) {
        self.report.latencies = latencies;
        self.transfer = transfer;
    }

    pub fn set_actuator(&mut self, actuator: Box<dyn Actuator>) {
        self.actuator = Some(actuator);
    }

    pub fn actuator(&self) -> Option<&dyn Actuator> {
        self.actuator.as_deref()
    }

    /// The clock the hub reads `now` from (the start of the fleet).
    pub fn clock(&self) -> Instant {
        self.report.clock
    }

    pub fn news(&self) -> mpsc::UnboundedSender<News> {
        self.report.news.clone()
    }

    /// Keeps a prefilled request until the controller sends it on.
    pub fn park(&mut self, parked: Parked) {
        self.parked.insert(parked.request.id, parked);
    }

    /// Takes note of engine processes that exited by themselves: one that never registered
    /// will not come (the controller may ask again), one that did is gone. Returns those gone.
    pub fn check_actuated(&mut self) -> Vec<InstanceId> {
        let Some(a) = &mut self.actuator else { return Vec::new() };
        let mut gone = Vec::new();
        for (address, role) in a.exited() {
            match self.members.values().find(|m| m.address == address).map(|m| m.id) {
                Some(id) => gone.push(id),
                None => self.events.push(FleetEvent::StartFailed { role }),
            }
        }
        for &id in &gone {
            self.lose(id);
        }
        gone
    }

    /// Stops the process of a drained engine (when the actuator started it) and marks it gone.
    pub fn retire(&mut self, id: InstanceId) {
        let holds_parked = self.parked.values().any(|p| p.from == id);
        let Some(m) = self.members.get_mut(&id) else { return };
        m.drain_watched = false;
        if m.state != MemberState::Draining || (holds_parked && m.external().is_some()) {
            // A prefill engine that is not ours holds the KV of requests not yet paired
            // (they pull it from there): it is watched again at the next tick.
            return;
        }
        if let Some(a) = &mut self.actuator {
            a.stop(&m.address);
        }
        if m.external().is_some_and(|e| e.spec.actuated) {
            // Its process is gone for good: nothing will register it again.
            self.remove(id);
        } else {
            self.lose(id);
        }
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

    /// An engine serving `model` with another block size than `block_size`: the index could
    /// not match one's prompts against the other's blocks.
    pub fn block_size_conflict(&self, model: &str, block_size: u32) -> Option<&Member> {
        self.members
            .values()
            .find(|m| m.state != MemberState::Down && m.info.model == model && m.info.block_size != block_size)
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
        let Some(role) = role_by_name(&pool) else {
            tracing::warn!("engine pool `{pool}` is not a role");
            return false;
        };
        let client = self
            .present
            .link(endpoint.connect_lazy())
            .max_decoding_message_size(crate::proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(crate::proto::MAX_MESSAGE_BYTES);
        let events_task = Some(tokio::spawn(read_events(id, client.clone(), self.news())).abort_handle());
        let member = Member {
            id,
            address,
            pool,
            role,
            info,
            state: MemberState::Serving,
            load: engine::Load::default(),
            last_seen: now,
            link: Link::Grpc(Box::new(client.clone()), LostSignal::new()),
            events_task,
            drain_watched: false,
            scheduling: None,
        };
        if let Some(s) = &self.scheduling {
            tokio::spawn(configure(id, client, s.clone()));
        }
        self.insert(member);
        true
    }

    /// Adds an operator-registered engine with its own API (its tasks already started), or
    /// replaces the record of one registered again.
    pub fn join_external(&mut self, id: InstanceId, engine: Arc<vllm::Engine>, info: proto::EngineInfo) {
        let role = role_by_name(&engine.spec.role).unwrap_or(Role::Colocated);
        let member = Member {
            id,
            address: engine.spec.url.clone(),
            pool: engine.spec.role.clone(),
            role,
            info,
            state: MemberState::Serving,
            load: engine::Load::default(),
            last_seen: Instant::now(),
            link: Link::Http(engine),
            events_task: None,
            drain_watched: false,
            scheduling: None,
        };
        self.insert(member);
    }

    fn insert(&mut self, member: Member) {
        let id = member.id;
        self.intern_model(&member.info.model);
        if let Some(old) = self.members.insert(id, member) {
            if let Some(t) = old.events_task {
                t.abort();
            }
            if let Link::Http(e) = old.link {
                e.stop_tasks();
            }
        }
        let announced = self.announcement(&self.members[&id]);
        self.events.extend(announced);
    }

    /// What tells a controller of a serving member, in order: its model, its role, and that
    /// it is up (on joining and on coming back).
    pub fn announcement(&self, m: &Member) -> [FleetEvent; 3] {
        let (instance, model) = (m.id, self.model_id(&m.info.model).unwrap_or_default());
        [
            FleetEvent::InstanceModel { instance, model },
            FleetEvent::InstanceRole { instance, role: m.role },
            FleetEvent::InstanceUp { instance, capacity_tokens: m.capacity_tokens() },
        ]
    }

    /// Gives a served model's name its controller id ([`LiveFleet::model_id`]) on first sight.
    fn intern_model(&mut self, name: &str) {
        if !self.models.iter().any(|m| m == name) {
            self.models.push(name.to_string());
        }
    }

    /// The controller's id of `name`, if an engine of it ever joined.
    pub fn model_id(&self, name: &str) -> Option<ModelId> {
        self.models.iter().position(|m| m == name).map(|k| ModelId(k as u32))
    }

    /// An operator-registered engine answers again: it serves with an empty cache (it may
    /// have restarted), as a newly joined one.
    pub fn revive(&mut self, id: InstanceId) -> bool {
        let Some(m) = self.members.get_mut(&id).filter(|m| m.state == MemberState::Down && m.external().is_some())
        else {
            return false;
        };
        m.state = MemberState::Serving;
        m.last_seen = Instant::now();
        self.events.push(FleetEvent::Kv { instance: id, events: vec![engine::kv::KvEvent::Cleared].into() });
        let announced = self.announcement(&self.members[&id]);
        self.events.extend(announced);
        true
    }

    /// Forgets an operator-registered engine for good (its tasks stop).
    pub fn remove(&mut self, id: InstanceId) -> bool {
        self.lose(id);
        match self.members.remove(&id) {
            Some(m) => {
                if let Link::Http(e) = &m.link {
                    e.stop_tasks();
                }
                true
            }
            None => false,
        }
    }

    /// Stops routing to a serving engine; returns whether it was serving. An engine that says
    /// in its heartbeat that another control plane drained it comes here too.
    pub fn mark_draining(&mut self, instance: InstanceId) -> bool {
        let Some(m) = self.members.get_mut(&instance).filter(|m| m.state == MemberState::Serving) else {
            return false;
        };
        m.state = MemberState::Draining;
        self.events.push(FleetEvent::InstanceDraining { instance });
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
                // Its streams stop waiting on it and are placed again.
                match &m.link {
                    Link::Http(e) => e.signal_lost(),
                    Link::Grpc(_, lost) => lost.raise(),
                }
                self.events.push(FleetEvent::InstanceDown { instance: id });
            }
        }
    }
}

impl LiveFleet {
    /// Moves a parked request's KV from `from` to `to` on a task of its own.
    fn transfer(&mut self, request: RequestId, from: InstanceId, to: InstanceId) {
        let links = self.members.get(&from).zip(self.members.get(&to)).map(|(f, t)| (f.link.clone(), t.link.clone()));
        let parked = self.parked.remove(&request);
        let (Some(parked), Some(links)) = (parked, links) else {
            // The request is no longer here (its client left, or a policy change re-sent a
            // request already on its way): close the transfer the controller opened.
            self.events.push(FleetEvent::TransferDone { request, from, to });
            self.events.push(FleetEvent::RequestFinished { instance: to, request, output: None });
            return;
        };
        let report = self.report.clone();
        match links {
            (Link::Grpc(from_client, _), Link::Grpc(to_client, to_lost)) => {
                let transfer_us = self.transfer.map_or(0, |t| t.time(parked.kv_tokens).0);
                let to_lost = to_lost.watch();
                let (from_client, to_client) = (*from_client, *to_client);
                let carry = super::transfer::Carry { parked, to, from_client, to_client, to_lost, transfer_us, report };
                tokio::spawn(carry.run());
            }
            (Link::Http(_), Link::Http(engine)) => {
                tokio::spawn(vllm::relay::decode(to, engine, parked, report));
            }
            _ => {
                // Registration keeps a P/D pair to one kind; this is a fleet changed meanwhile.
                self.events.push(FleetEvent::TransferDone { request, from, to });
                let why = format!("{from} and {to} are engines of different kinds: no KV hand-off between them");
                let _ = parked.payload.out.send(Delta::Failed(why));
                report.finished(to, &parked.request, &parked.payload, false);
            }
        }
    }

    /// A P/D engine of another kind than `kind` (a hand-off moves KV between engines of one
    /// kind only: ours over gRPC, vLLM's through its KV connector).
    pub fn pd_kind_conflict(&self, kind: EngineKind, role: Role) -> Option<&Member> {
        (role != Role::Colocated).then_some(())?;
        self.members.values().find(|m| m.state != MemberState::Down && m.role != Role::Colocated && m.kind() != kind)
    }
}

impl Fleet for LiveFleet {
    type Payload = Payload;

    fn dispatch(
        &mut self,
        _now: Time,
        request: Request,
        mut payload: Payload,
        route: &Route,
    ) -> Result<(), (DispatchError, Request, Payload)> {
        let instance = route.prefill;
        let Some(m) = self.members.get(&instance).filter(|m| m.state == MemberState::Serving) else {
            return Err((DispatchError::NotServing { instance }, request, payload));
        };
        payload.class_priority = self.scheduling.as_ref().is_some_and(|s| s.class_priority == Some(true));
        match &m.link {
            Link::Grpc(client, lost) => {
                let lost = lost.watch();
                tokio::spawn(stream_request(instance, (**client).clone(), lost, request, payload, self.report.clone()));
            }
            Link::Http(engine) => {
                let step = if m.role == Role::Prefill { vllm::relay::Step::Prefill } else { vllm::relay::Step::Whole };
                tokio::spawn(vllm::relay::run(instance, engine.clone(), request, payload, self.report.clone(), step));
            }
        }
        Ok(())
    }

    fn apply(&mut self, _now: Time, command: &Command) {
        match *command {
            Command::Drain { instance } => {
                if self.mark_draining(instance) {
                    // An engine that is not ours has no drain call: it only stops getting work.
                    let Some(mut client) = self.members[&instance].client() else { return };
                    tokio::spawn(async move {
                        if let Err(e) = client.drain(proto::DrainRequest {}).await {
                            tracing::warn!(%instance, "drain failed: {e}");
                        }
                    });
                }
            }
            Command::Start { role } => match &mut self.actuator {
                Some(a) => {
                    if let Err(e) = a.start(role) {
                        tracing::error!(?role, "cannot start an engine: {}", control::describe(&*e));
                    }
                }
                None => tracing::warn!(?role, "no actuator (serve --actuator): cannot start an engine"),
            },
            Command::Transfer { request, from, to } => self.transfer(request, from, to),
        }
    }

    fn poll_events(&mut self, out: &mut Vec<FleetEvent>) {
        out.append(&mut self.events);
    }
}

/// Reads an engine's load reports and KV events until the stream ends.
async fn read_events(instance: InstanceId, mut client: EngineLink, news: mpsc::UnboundedSender<News>) {
    let why = match client.events(proto::EventsRequest { min_interval_ms: 0 }).await {
        Err(e) => format!("cannot open its event stream: {e}"),
        Ok(stream) => {
            let mut stream = stream.into_inner();
            let mut scheduling = None;
            loop {
                match stream.next().await {
                    None => break "its event stream ended".to_string(),
                    Some(Err(e)) => break format!("its event stream failed: {e}"),
                    Some(Ok(event)) => match event.kind {
                        Some(proto::engine_event::Kind::Load(mut load)) => {
                            if let Some(reported) = load.scheduling.take() {
                                if scheduling.as_ref() != Some(&reported) {
                                    scheduling = Some(reported.clone());
                                    let _ = news.send(News::Scheduling { instance, scheduling: reported });
                                }
                            }
                            let _ = news.send(News::Event(FleetEvent::Load { instance, load: load.into() }));
                        }
                        Some(proto::engine_event::Kind::Kv(batch)) => {
                            let mut events = engine::kv::KvEvents::new();
                            for e in &batch.events {
                                if let Err(e) = e.decode_into(&mut events) {
                                    tracing::warn!(%instance, "bad KV event skipped: {e}");
                                }
                            }
                            let _ = news.send(News::Event(FleetEvent::Kv { instance, events }));
                        }
                        None => tracing::warn!(%instance, "engine event without a kind"),
                    },
                }
            }
        }
    };
    let _ = news.send(News::EngineLost { instance, why });
}

/// Sends an engine the policy's scheduling; it reports the change in its next load report.
async fn configure(instance: InstanceId, mut client: EngineLink, scheduling: proto::Scheduling) {
    if let Err(e) = client.configure(scheduling).await {
        tracing::warn!(%instance, "cannot configure the engine's scheduling: {}: {}", e.code(), e.message());
    }
}
