//! What every handler and task of `fleetplane serve` shares: [`App`].

use super::auth::Auth;
use super::hub::Hub;
use super::lock::lock;
use super::metrics::Metrics;
use super::store::Store;
use super::{history, policy, pools, vllm};
use crate::tokenizer;
use policies::ControllerConfig;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Semaphore;

/// Everything the handlers share.
pub struct App {
    pub(super) hub: Mutex<Hub>,
    pub metrics: Arc<Metrics>,
    pub auth: Auth,
    pub store: Store,
    pub replica: String,
    pub leader: Arc<AtomicBool>,
    pub(super) simulations: Semaphore,
    /// Policy version in force (0: the command line's).
    pub(super) policy_version: std::sync::atomic::AtomicI32,
    /// The pool flags of a P/D fleet (`None`: colocated), which a policy's autoscaler takes
    /// its hysteresis from.
    pub pool_args: Option<pools::PoolArgs>,
    /// Requests the gateway finished recently, for the history's windowed statistics.
    pub recorder: history::Recorder,
    /// The console's time series: one sample a second, the last fifteen minutes.
    pub history: history::History,
    /// Each model's tokenizer, where the fleet has one.
    pub tokenizers: tokenizer::Tokenizers,
    /// The HTTP client for engines with their own API.
    /// Presents the engine token on calls to engines of ours.
    pub engine_token: crate::engine_auth::Present,
    pub http: reqwest::Client,
    /// Engines named to this replica that do not serve yet, by URL: their spec and why.
    pub pending_engines: Mutex<std::collections::BTreeMap<String, (vllm::EngineSpec, String)>>,
    /// What the API and the history read from memory, so that they answer while PostgreSQL
    /// does not.
    pub known: Mutex<Known>,
}

/// The stored state this replica serves reads of from memory: read at start, after each
/// write through this replica, and every 2 s from the database (what other replicas wrote).
#[derive(Clone, Debug, Default)]
pub struct Known {
    /// SLO targets (TTFT ms, TPOT ms).
    pub slo: (f64, f64),
    /// The latest policy version: (version, policy, author, when).
    pub policy: Option<(i32, serde_json::Value, String, String)>,
    /// The pools' rows (name, role, bounds).
    pub pools: Vec<serde_json::Value>,
}

impl Known {
    /// Takes a policy version read from the database, unless a newer one is known.
    pub fn learn_policy(&mut self, p: Option<(i32, serde_json::Value, String, String)>) {
        if p.as_ref().map(|p| p.0) >= self.policy.as_ref().map(|k| k.0) {
            self.policy = p;
        }
    }
}

impl App {
    pub fn lock_hub(&self) -> MutexGuard<'_, Hub> {
        // A panic while routing leaves the controller usable: its state changes are atomic.
        lock(&self.hub)
    }

    /// Puts a stored policy version in force, unless a newer one already is: the router and
    /// autoscaler in the controller, the scheduling on every engine (and each that joins).
    pub fn apply_policy(&self, set: policy::PolicySet, version: i32) {
        if self.policy_version.fetch_max(version, Ordering::SeqCst) > version {
            return;
        }
        let mut hub = self.lock_hub();
        let pools = match (hub.pools, set.autoscaler) {
            (Some(p), Some(autoscaler)) => Some(policies::PdConfig { autoscaler, ..p }),
            (pools, _) => pools,
        };
        if hub.config.router != set.router || hub.pools != pools {
            let config = ControllerConfig { router: set.router, ..hub.config.clone() };
            hub.set_policy(config, pools);
            let autoscaler = pools.map(|p| p.autoscaler.name());
            tracing::info!(router = set.router.label(), ?autoscaler, version, "policy in force");
        }
        hub.set_flow(set.flow.flow, set.class_slo);
        let class_priority = set.flow.class_priority;
        let scheduling = crate::proto::Scheduling {
            class_priority: class_priority.then_some(true),
            lower_class_step_tokens: hub.lower_class_step_tokens().filter(|_| class_priority),
            ..set.scheduling
        };
        let scheduling = crate::scheduling::with_program_hold(scheduling, set.flow.program_hold);
        if hub.fleet.scheduling() != Some(&scheduling) {
            tracing::info!(?scheduling, version, "engine scheduling in force");
            hub.fleet.set_scheduling(scheduling);
            super::registry::reprice(&mut hub, "the policy's step budget");
        }
    }
}
