//! Prometheus series, all named `fleetplane_*`, served at `/metrics`.

use prometheus_client::encoding::{text::encode, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassOutcome {
    pub class: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabel {
    pub class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabel {
    pub tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InstanceLabels {
    pub instance: String,
    pub pool: String,
}

pub struct Metrics {
    registry: Registry,
    pub requests: Family<Outcome, Counter>,
    pub tokens_generated: Counter,
    pub prompt_tokens: Counter,
    pub cached_prompt_tokens: Counter,
    pub ttft_seconds: Histogram,
    pub route_seconds: Histogram,
    pub replaced: Counter,
    pub in_flight: Gauge,
    pub instances_serving: Gauge,
    pub kv_usage: Family<InstanceLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub waiting: Family<InstanceLabels, Gauge>,
    pub leader: Gauge,
    /// Load_P and Load_D of a P/D fleet (absent in a colocated one).
    pub load: Family<PoolLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub pool_instances: Family<PoolState, Gauge>,
    /// Engines by kind (fleetplane, vllm, sglang) and state.
    pub engines: Family<KindState, Gauge>,
    /// The controller's `unmatched_ends`: 0 unless the fleet broke its contract.
    pub unmatched_ends: Gauge,
    /// Flow control: requests by class and what became of them on arrival or release.
    pub flow_requests: Family<ClassOutcome, Counter>,
    /// Requests waiting for room, by class.
    pub flow_queued: Family<ClassLabel, Gauge>,
    /// TTFT seen by the gateway, by class, and requests finished by tenant.
    pub class_ttft_seconds: Family<ClassLabel, Histogram>,
    pub tenant_requests: Family<TenantLabel, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindState {
    pub kind: String,
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabel {
    pub pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolState {
    pub pool: String,
    pub state: String,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("fleetplane");
        let requests = Family::<Outcome, Counter>::default();
        registry.register("gateway_requests", "Gateway requests by outcome", requests.clone());
        let tokens_generated = Counter::default();
        registry.register("generated_tokens", "Tokens streamed to clients", tokens_generated.clone());
        let prompt_tokens = Counter::default();
        registry.register("prompt_tokens", "Prompt tokens of finished requests", prompt_tokens.clone());
        let cached_prompt_tokens = Counter::default();
        registry.register(
            "cached_prompt_tokens",
            "Prompt tokens served from the prefix cache (any tier)",
            cached_prompt_tokens.clone(),
        );
        let ttft_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register("ttft_seconds", "Time to first token seen by the gateway", ttft_seconds.clone());
        let route_seconds = Histogram::new(exponential_buckets(1e-6, 2.0, 16));
        registry.register(
            "route_decision_seconds",
            "Time the controller takes to route a request and hand it to the task that streams it",
            route_seconds.clone(),
        );
        let replaced = Counter::default();
        registry.register("requests_replaced", "Requests placed again after their engine was lost", replaced.clone());
        let in_flight = Gauge::default();
        registry.register("gateway_in_flight", "Requests being streamed by the gateway", in_flight.clone());
        let instances_serving = Gauge::default();
        registry.register("instances_serving", "Engines registered and serving", instances_serving.clone());
        let kv_usage = Family::<InstanceLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register("instance_kv_usage_ratio", "KV blocks in use over KV blocks per engine", kv_usage.clone());
        let waiting = Family::<InstanceLabels, Gauge>::default();
        registry.register("instance_waiting_requests", "Requests queued per engine", waiting.clone());
        let leader = Gauge::default();
        registry.register("leader", "1 when this replica holds the leader lock", leader.clone());
        let load = Family::<PoolLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register("pool_slo_load", "SLO load of a P/D pool (Load_P, Load_D): 1 is at the target", load.clone());
        let pool_instances = Family::<PoolState, Gauge>::default();
        registry.register(
            "pool_instances",
            "Engines of a P/D pool by state (serving, starting, draining)",
            pool_instances.clone(),
        );
        let engines = Family::<KindState, Gauge>::default();
        registry.register("engines", "Engines by kind (fleetplane, vllm, sglang) and state", engines.clone());
        let unmatched_ends = Gauge::default();
        registry.register(
            "controller_unmatched_ends",
            "Request ends the controller had not counted in flight on that engine (0 unless the fleet broke its contract)",
            unmatched_ends.clone(),
        );
        let flow_requests = Family::<ClassOutcome, Counter>::default();
        registry.register(
            "flow_requests",
            "Requests by class and flow control's outcome (placed, queued, shed, queue_full, refused)",
            flow_requests.clone(),
        );
        let flow_queued = Family::<ClassLabel, Gauge>::default();
        registry.register(
            "flow_queued_requests",
            "Requests waiting for room at the controller, by class",
            flow_queued.clone(),
        );
        let class_ttft_seconds = Family::<ClassLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.001, 2.0, 16))
        });
        registry.register(
            "class_ttft_seconds",
            "Time to first token seen by the gateway, by class",
            class_ttft_seconds.clone(),
        );
        let tenant_requests = Family::<TenantLabel, Counter>::default();
        registry.register("tenant_requests", "Requests finished, by tenant", tenant_requests.clone());
        Metrics {
            flow_requests,
            flow_queued,
            class_ttft_seconds,
            tenant_requests,
            registry,
            engines,
            unmatched_ends,
            requests,
            tokens_generated,
            prompt_tokens,
            cached_prompt_tokens,
            ttft_seconds,
            route_seconds,
            replaced,
            in_flight,
            instances_serving,
            kv_usage,
            waiting,
            leader,
            load,
            pool_instances,
        }
    }

    pub fn request(&self, outcome: &str) {
        self.requests.get_or_create(&Outcome { outcome: outcome.to_string() }).inc();
    }

    pub fn flow(&self, class: engine::Class, outcome: &str) {
        let labels = ClassOutcome { class: class.name().to_string(), outcome: outcome.to_string() };
        self.flow_requests.get_or_create(&labels).inc();
    }

    /// Requests of `class` flow control ended with `outcome` so far.
    pub fn flow_count(&self, class: engine::Class, outcome: &str) -> u64 {
        let labels = ClassOutcome { class: class.name().to_string(), outcome: outcome.to_string() };
        self.flow_requests.get_or_create(&labels).get()
    }

    /// Requests waiting at the controller, by [`engine::Class::index`].
    pub fn set_queued(&self, queued: [usize; 3]) {
        for (class, n) in engine::Class::ALL.iter().zip(queued) {
            self.flow_queued.get_or_create(&ClassLabel { class: class.name().to_string() }).set(n as i64);
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
