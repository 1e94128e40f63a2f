//! What the controller knows about each instance, built only from fleet events and its own
//! routing decisions.

use crate::prefix_index::PrefixIndex;
use engine::{InstanceId, Load, Request};

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
    /// Largest request (prompt plus output tokens) the instance can hold.
    pub capacity_tokens: u64,
    /// The last load report.
    pub load: Load,
    /// Tokens (prompt plus output) of requests routed here since that report: the report
    /// cannot know them yet.
    pub routed_since_report: u64,
    /// Requests routed here and not finished.
    pub in_flight: u32,
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
}

/// All instances, indexed by id, and what they cache.
#[derive(Clone, Debug, Default)]
pub struct FleetView {
    instances: Vec<InstanceView>,
    index: PrefixIndex,
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

    /// Serving instances that could hold `request` at all.
    pub fn candidates<'a>(&'a self, request: &'a Request) -> impl Iterator<Item = &'a InstanceView> + 'a {
        self.serving().filter(move |i| request.peak_kv_tokens() <= i.capacity_tokens)
    }

    pub(crate) fn up(&mut self, id: InstanceId, capacity_tokens: u64) {
        let idx = id.0 as usize;
        if self.instances.len() <= idx {
            self.instances.extend((self.instances.len()..=idx).map(|i| InstanceView {
                id: InstanceId(i as u32),
                state: InstanceState::Down,
                capacity_tokens: 0,
                load: Load::default(),
                routed_since_report: 0,
                in_flight: 0,
            }));
        }
        let v = &mut self.instances[idx];
        v.state = InstanceState::Serving;
        v.capacity_tokens = capacity_tokens;
    }
}
