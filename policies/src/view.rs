//! What the controller knows about each instance, built only from fleet events and its own
//! routing decisions, the latency targets the driver holds the fleet to, and how much of their
//! bounds outputs use.

use crate::flow::Targets;
use crate::output_share::OutputShare;
use crate::prefix_index::PrefixIndex;
use engine::{InstanceId, Load, ModelId, Request, Time};

/// Which phase of a request an instance serves. A colocated fleet has only `Colocated`
/// instances; a disaggregated one has a prefill pool and a decode pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Prefill and decode on the same instance.
    #[default]
    Colocated,
    /// Computes prompts and hands their KV to a decode instance.
    Prefill,
    /// Takes prompts' KV by transfer and generates their output.
    Decode,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Colocated => "colocated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstanceState {
    Serving,
    Draining,
    Down,
}

/// One instance as the routers see it.
#[derive(Clone, Debug, PartialEq)]
pub struct InstanceView {
    pub id: InstanceId,
    pub state: InstanceState,
    /// The phase it serves (routers only ever see instances of the role being routed to).
    pub role: Role,
    /// The model it serves: only requests for it come here.
    pub model: ModelId,
    /// Largest request (prompt plus output tokens) the instance can hold.
    pub capacity_tokens: u64,
    /// The last load report.
    pub load: Load,
    /// Tokens (prompt plus output) of requests routed here since that report: the report
    /// cannot know them yet.
    pub routed_since_report: u64,
    /// Prompt tokens of the requests routed here since that report.
    pub prompt_since_report: u64,
    /// Requests routed here and not finished.
    pub in_flight: u32,
    /// Whether the instance has announced itself (a role or `up`); slots made for instances
    /// not yet heard of, below a higher id that was, have not.
    announced: bool,
}

impl InstanceView {
    /// Work the instance still has to do, in tokens: prompt tokens to compute and tokens to
    /// generate, as last reported, plus what was routed since.
    pub fn outstanding_tokens(&self) -> u64 {
        self.load.prefill_tokens_left + self.load.decode_tokens_left + self.routed_since_report
    }

    pub fn is_serving(&self) -> bool {
        self.state == InstanceState::Serving
    }

    /// Whether its last report said it paused admission (KV use above its high-water mark):
    /// a request sent there would wait until use falls to the low-water mark.
    pub fn admission_paused(&self) -> bool {
        self.load.admission_paused
    }
}

/// Which instances a request may go to (see [`FleetView::candidates`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CandidateRule {
    peak_kv_tokens: u64,
    avoid: Option<InstanceId>,
    /// Only instances of this role qualify.
    role: Role,
    /// Only instances serving the request's model qualify.
    model: ModelId,
    /// The best rank among the instances that fit; only instances of that rank qualify.
    rank: u8,
}

impl CandidateRule {
    /// How bad a fitting instance is as a destination: one pausing admission is worse than
    /// the instance the request is leaving, which is worse than any other.
    fn rank(avoid: Option<InstanceId>, v: &InstanceView) -> u8 {
        2 * u8::from(v.admission_paused()) + u8::from(avoid == Some(v.id))
    }

    fn fits(&self, v: &InstanceView) -> bool {
        v.is_serving() && v.role == self.role && v.model == self.model && self.peak_kv_tokens <= v.capacity_tokens
    }

    pub fn admits(&self, v: &InstanceView) -> bool {
        self.fits(v) && CandidateRule::rank(self.avoid, v) == self.rank
    }
}

/// All instances, indexed by id, and what they cache.
#[derive(Clone, Debug, Default)]
pub struct FleetView {
    instances: Vec<InstanceView>,
    index: PrefixIndex,
    /// The instance a request being placed again has just left, if any: the last choice.
    pub(crate) avoid: Option<InstanceId>,
    /// The role a new request is routed to: `Prefill` once any instance has that role.
    pub(crate) route_role: Role,
    /// Each class's latency targets (by [`engine::Class::index`]), once the driver has set
    /// them: what the fleet is held to.
    pub(crate) targets: Option<[Targets; 3]>,
    /// When the request being routed is routed.
    pub(crate) now: Time,
    /// How much of their bounds the outputs that ended used.
    pub(crate) outputs: OutputShare,
}

impl FleetView {
    /// Which instance caches which prefix, as far as their KV events have told (empty unless
    /// the router asked for KV events).
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    pub(crate) fn index_mut(&mut self) -> &mut PrefixIndex {
        &mut self.index
    }

    /// The share of their bounds (`max_tokens`) that outputs used lately, at most 1; 1 before
    /// any ended (see [`OutputShare`]).
    pub fn output_share(&self) -> f64 {
        self.outputs.share()
    }

    /// `request`'s class's TTFT target in seconds; `None` where the fleet has no targets.
    pub fn ttft_target_s(&self, request: &Request) -> Option<f64> {
        Some(self.targets?[request.service.class.index()].ttft.as_secs_f64())
    }

    /// Seconds `request` has left to its first token under its class's TTFT target (negative
    /// once past it); `None` where the fleet has no targets.
    pub fn ttft_left_s(&self, request: &Request) -> Option<f64> {
        Some(self.ttft_target_s(request)? - self.now.since(request.arrival).as_secs_f64())
    }

    pub fn all(&self) -> &[InstanceView] {
        &self.instances
    }

    pub fn get(&self, id: InstanceId) -> Option<&InstanceView> {
        self.instances.get(id.0 as usize)
    }

    pub(crate) fn get_mut(&mut self, id: InstanceId) -> Option<&mut InstanceView> {
        self.instances.get_mut(id.0 as usize)
    }

    pub fn serving(&self) -> impl Iterator<Item = &InstanceView> {
        self.instances.iter().filter(|i| i.is_serving())
    }

    pub fn serving_count(&self) -> usize {
        self.serving().count()
    }

    /// Where `request` may go: the serving instances that could hold it at all, and among
    /// them the least bad class that is not empty: those admitting, other than the one a
    /// re-placed request just left; else that one, if it admits again; else those that
    /// paused admission (KV above the high-water mark; the one it left last), which a router
    /// then ranks by its own rule (the least bad of them by its measure).
    pub fn candidates<'a>(&'a self, request: &'a Request) -> impl Iterator<Item = &'a InstanceView> + 'a {
        self.admitted(self.candidate_rule(request))
    }

    /// The instances `rule` admits, in id order: [`FleetView::candidates`] for a router that
    /// keeps the rule (its computation is a pass over the fleet).
    pub fn admitted(&self, rule: CandidateRule) -> impl Iterator<Item = &InstanceView> + '_ {
        self.instances.iter().filter(move |v| rule.admits(v))
    }

    /// The test behind [`FleetView::candidates`], for routers that walk the instances
    /// themselves.
    pub fn candidate_rule(&self, request: &Request) -> CandidateRule {
        let mut rule = CandidateRule {
            peak_kv_tokens: request.peak_kv_tokens(),
            avoid: self.avoid,
            role: self.route_role,
            model: request.model,
            rank: 0,
        };
        rule.rank = self
            .instances
            .iter()
            .filter(|v| rule.fits(v))
            .map(|v| CandidateRule::rank(self.avoid, v))
            .min()
            .unwrap_or(0);
        rule
    }

    /// Gives instance `id` a role (before its `up`); once any instance is a prefill
    /// instance, new requests are routed to the prefill pool. Returns whether `id` was new.
    pub(crate) fn set_role(&mut self, id: InstanceId, role: Role) -> bool {
        // Engines started together register in any order: the slot of a lower id may exist
        // already without the instance having been heard of.
        let new = !self.get(id).is_some_and(|v| v.announced);
        self.ensure(id);
        let v = &mut self.instances[id.0 as usize];
        v.role = role;
        v.announced = true;
        if role == Role::Prefill {
            self.route_role = Role::Prefill;
        }
        new
    }

    pub(crate) fn set_model(&mut self, id: InstanceId, model: ModelId) {
        self.ensure(id);
        self.instances[id.0 as usize].model = model;
    }

    pub(crate) fn up(&mut self, id: InstanceId, capacity_tokens: u64) {
        self.ensure(id);
        let v = &mut self.instances[id.0 as usize];
        v.state = InstanceState::Serving;
        v.capacity_tokens = capacity_tokens;
        v.announced = true;
    }

    /// Makes room for instance `id` (instances not yet heard of are down).
    fn ensure(&mut self, id: InstanceId) {
        let idx = id.0 as usize;
        if self.instances.len() <= idx {
            self.instances.extend((self.instances.len()..=idx).map(|i| InstanceView {
                id: InstanceId(i as u32),
                state: InstanceState::Down,
                role: Role::Colocated,
                model: ModelId::default(),
                capacity_tokens: 0,
                load: Load::default(),
                routed_since_report: 0,
                prompt_since_report: 0,
                in_flight: 0,
                announced: false,
            }));
        }
    }

    /// The role new requests are routed to: `Prefill` in a disaggregated fleet.
    pub fn route_role(&self) -> Role {
        self.route_role
    }
}
