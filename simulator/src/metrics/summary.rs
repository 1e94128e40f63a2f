//! What a run reports at its end: the serializable [`Summary`] and its parts.

use crate::slo::Slo;
use serde::{Deserialize, Serialize};

/// What the fleet costs to run: GPU count times the hourly price, over the run's span.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct FleetCost {
    pub gpus: u32,
    pub price_per_gpu_hour: f64,
}

/// Mean and tail of one latency distribution, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
}

/// Tokens per second over the run's span.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenThroughput {
    /// Prompt tokens, cached or computed.
    pub input: f64,
    /// Generated tokens.
    pub output: f64,
}

/// The end-of-run numbers of one run.
///
/// The serialized keys up to `output_tokens` are a documented format (pinned by the test
/// `summary_json_has_the_documented_keys`); new fields go after them. Every float is finite:
/// empty runs give 0.0, never NaN.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests that finished.
    pub requests: u64,
    /// Requests the fleet turned away.
    pub rejected: u64,
    pub ttft_ms: Percentiles,
    /// TTFT of prompts under [`LONG_PROMPT_TOKENS`] tokens, and of the long ones.
    pub ttft_ms_short: Percentiles,
    pub ttft_ms_long: Percentiles,
    /// Finished requests with long prompts.
    pub long_requests: u64,
    /// Over requests with at least two output tokens.
    pub tpot_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub queue_ms: Percentiles,
    /// Requests that met the SLO over all requests, finished or rejected (0.0 to 1.0).
    pub slo_attainment: f64,
    /// Requests that met the SLO per second of span.
    pub goodput_rps: f64,
    pub throughput_tok_s: TokenThroughput,
    /// Prompt tokens served from the prefix cache over all prompt tokens (token-weighted).
    pub cache_hit_rate: f64,
    /// `cache_hit_rate` split by the tier the cached tokens came from (the three add up to it).
    pub hit_rate_by_tier: HitRateByTier,
    /// The hit rate an infinite cache shared by the whole fleet would reach on the same
    /// arrivals: the bound no placement can beat (absent when not measured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_hit_rate: Option<f64>,
    /// GPUs times the span in hours.
    pub gpu_hours: f64,
    /// Dollars per million tokens, input and output together.
    pub cost_per_mtok: f64,
    /// The span: first arrival to last finish.
    pub duration_s: f64,
    pub preemptions: u64,
    /// Times prefills yielded at a chunk boundary (fair prefill).
    pub yields: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Requests that met the SLO.
    pub slo_met: u64,
    /// The targets the attainment was measured against.
    pub slo: Slo,
    /// TTFT of requests asking for fewer than [`LONG_OUTPUT_TOKENS`] output tokens, and
    /// their SLO attainment (over those finished or rejected).
    #[serde(default)]
    pub ttft_ms_short_output: Percentiles,
    #[serde(default)]
    pub slo_attainment_short_output: f64,
    /// Requests (finished or rejected) asking for at least [`LONG_OUTPUT_TOKENS`].
    #[serde(default)]
    pub long_output_requests: u64,
    /// Requests evicted from an instance by the KV high-water protection (a request evicted
    /// twice counts twice), and evicted requests placed again.
    #[serde(default)]
    pub evictions: u64,
    #[serde(default)]
    pub reroutes: u64,
    /// Requests ended early as runaways (the `end` policy).
    #[serde(default)]
    pub ended_runaway: u64,
    /// Time instances spent with admission paused, summed over instances.
    #[serde(default)]
    pub admission_paused_s: f64,
    /// Per request, time queued while admission was paused (zero for most).
    #[serde(default)]
    pub paused_wait_ms: Percentiles,
    /// Disaggregated or autoscaled fleets: pools, scaling decisions and time series (absent
    /// for a fixed colocated fleet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pools: Option<crate::pools::PoolsReport>,
    /// Speculative decoding: the drafter and what it accepted (absent: no speculation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculation: Option<SpeculationReport>,
    /// Seconds instances spent computing steps, summed over instances, and the share of it
    /// that prefill chunks added to the steps their decodes alone would take (what cache hits
    /// can save, with decode work held fixed; see `cost::GpuTime`).
    #[serde(default)]
    pub gpu_busy_s: f64,
    #[serde(default)]
    pub prefill_time_share: f64,
    /// Requests flow control shed (also counted in `rejected`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shed: u64,
    /// Runs with request classes: each class's and each tenant's numbers, held to the
    /// class's SLO (absent otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<GroupSummary>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<GroupSummary>,
    /// Closed-loop agentic sessions (absent for open-loop workloads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions: Option<SessionsSummary>,
}

/// How a closed-loop workload's sessions went.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionsSummary {
    pub started: u64,
    /// Every turn answered.
    pub completed: u64,
    /// Completed with every turn within its class's SLO.
    pub completed_within_slo: u64,
    /// Ended by a turn refused or shed.
    pub failed: u64,
    /// Started but neither completed nor failed when the run stopped (a request limit).
    pub cut: u64,
    /// Turns sent.
    pub turns: u64,
    /// Mean seconds from a completed session's first arrival to its last answer.
    pub mean_duration_s: f64,
    /// Sessions completed within the SLO per GPU-hour of the fleet.
    pub per_gpu_hour: f64,
}

impl SessionsSummary {
    pub fn new(s: &crate::workload::SessionStats, gpu_hours: f64) -> SessionsSummary {
        SessionsSummary {
            started: s.started,
            completed: s.completed,
            completed_within_slo: s.completed_within_slo,
            failed: s.failed,
            cut: s.started - s.completed - s.failed,
            turns: s.turns,
            mean_duration_s: if s.completed > 0 { s.completed_seconds / s.completed as f64 } else { 0.0 },
            per_gpu_hour: if gpu_hours > 0.0 { s.completed_within_slo as f64 / gpu_hours } else { 0.0 },
        }
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One class's or tenant's part of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupSummary {
    pub name: String,
    /// A class's targets (a tenant's requests are each held to their own class's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<Slo>,
    pub requests: u64,
    pub rejected: u64,
    pub shed: u64,
    pub slo_met: u64,
    /// Over its requests finished, rejected or shed.
    pub slo_attainment: f64,
    /// Its requests that met their SLO per second of the run's span.
    pub goodput_rps: f64,
    pub ttft_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub queue_ms: Percentiles,
    pub output_tokens: u64,
}

/// What speculative decoding did in a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpeculationReport {
    /// The drafter preset (`cost::Drafter`).
    pub drafter: String,
    /// Decode steps of one sequence that verified drafts.
    pub verify_steps: u64,
    /// Drafts accepted per such step, as drawn; below `expected_accepted` when steps near the
    /// end of an output verify fewer drafts than the drafter's `verified`.
    pub accepted_per_step: f64,
    /// The acceptance profile's expectation with every draft verified.
    pub expected_accepted: f64,
}

/// Token-weighted shares of prompt tokens served from each tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HitRateByTier {
    pub l1: f64,
    pub l2: f64,
    pub l3: f64,
}
