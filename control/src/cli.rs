//! Flags shared by `simulate` and `max-rate`. Each flag, when given, overrides the same
//! setting of the `--scenario` file; unset flags leave the file's value (or the default).

use crate::Failure;
use anyhow::Context;
use clap::Args;
use cost::{CpMode, UnknownName};
use simulator::policy_file::PolicyFile;
use simulator::scenario::flow::{FlowEntry, FlowSection};
use simulator::scenario::tiers::KvSection;
use simulator::scenario::{
    FleetSection, PoolsSection, Scenario, SchedulerSection, Settings, SloSection, WorkloadSection,
};
use simulator::workload::MaxTokens;
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct SimFlags {
    /// Scenario file (TOML) with any of the settings below; flags override it.
    #[arg(long, value_name = "FILE.toml")]
    pub scenario: Option<PathBuf>,

    /// Policy file (TOML, or JSON if it ends in .json), as `fleetplane tune` writes it: its
    /// router with its parameters runs in place of the scenario's routers, and its scheduling
    /// and autoscaler settings override the scenario's and the flags'.
    #[arg(long, value_name = "FILE", conflicts_with = "router")]
    pub policy: Option<PathBuf>,

    /// Trace to replay: Mooncake JSONL (timestamp, input_length, output_length, hash_ids) or
    /// Azure LLM CSV (TIMESTAMP, ContextTokens, GeneratedTokens).
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,

    /// Trace format: mooncake or azure [default: from the extension, .jsonl or .csv].
    #[arg(long, value_name = "FORMAT")]
    pub format: Option<String>,

    /// Engine instances in the fleet [default: 8].
    #[arg(long, value_name = "N")]
    pub instances: Option<u32>,

    /// Model served: llama-3.1-8b, llama-3.1-70b, qwen3-32b, deepseek-v3 or vllm-tiny [default: llama-3.1-8b].
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,

    /// GPU of each instance: a100, h100, h200, b200 (or cpu-2core, for vLLM on CPUs) [default: h100].
    #[arg(long, value_name = "NAME")]
    pub gpu: Option<String>,

    /// Tensor-parallel degree inside one attention rank [default: 1]. An instance has
    /// tp x dp-attention GPUs.
    #[arg(long, value_name = "N")]
    pub tp: Option<u32>,

    /// Attention data-parallel ranks per instance: each keeps only its own requests' KV
    /// (SGLang's --dp N --enable-dp-attention) [default: 1].
    #[arg(long, value_name = "N")]
    pub dp_attention: Option<u32>,

    /// Expert-parallel degree of an MoE: 1 or the instance's GPUs [default: 1].
    #[arg(long, value_name = "N")]
    pub ep: Option<u32>,

    /// Context-parallel replicas per instance: each prefills a zig-zag shard of every prompt
    /// and keeps that shard's KV [default: 1]. An instance has tp x dp-attention x cp GPUs.
    #[arg(long, value_name = "N")]
    pub cp: Option<u32>,

    /// How context-parallel replicas exchange K/V: ring (blocks travel round a ring,
    /// overlapped with attention) or allgather (the whole K/V gathered before attention)
    /// [default: ring].
    #[arg(long, value_name = "MODE", value_parser = parse_cp_mode)]
    pub cp_mode: Option<CpMode>,

    /// Speculative decoding: none, or a drafter preset, eagle3 (autoregressive), dflash
    /// (parallel) or dspark (semi-autoregressive); see docs/LAYOUTS.md for their assumed
    /// acceptance and cost [default: none]. `NAME@eagle3` (or `@dflash`, `@dspark`, `@nospec`)
    /// in --router overrides it per run.
    #[arg(long, value_name = "DRAFTER")]
    pub spec: Option<String>,

    /// Routers to compare, comma-separated: round-robin, least-outstanding, power-of-two,
    /// cache-aware, sglang-cache-aware, dynamo-kv, llm-d [default: least-outstanding]. Each
    /// runs on the same arrivals. `NAME@l1` (or `@l1+l2`, ...) runs it on other KV tiers than
    /// --kv-tiers, e.g. an L1-only baseline beside a tiered fleet; `NAME@fair` / `@fcfs` with
    /// another prefill scheduler, `NAME@hw` / `@nohw` with or without KV high-water
    /// protection, `NAME@dspark` / `@nospec` with or without a drafter (variants join with `+`).
    #[arg(long, value_name = "NAME[,NAME...]", value_delimiter = ',')]
    pub router: Option<Vec<String>>,

    /// Flow control at the controller, each rule a run of every router: `none`, `slo` (ours:
    /// priority bands, least attained service between tenants, room by predicted queue,
    /// decode step and KV; engines admit by class) or `llm-d` (llm-d's flow control); see
    /// [flow] in a scenario for parameters [default: none, and no flow runs named].
    #[arg(long, value_name = "RULE[,RULE...]", value_delimiter = ',')]
    pub flow: Option<Vec<String>>,

    /// Keep only this tenant's requests of the scenario's [workload.classes] (the same
    /// requests at the same times as in the mixed run: its load alone, for comparison).
    #[arg(long, value_name = "NAME")]
    pub only_tenant: Option<String>,

    /// Seed of every random choice (synthetic arrivals, power-of-two draws) [default: 42].
    /// The same seed and inputs give byte-identical JSON.
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,

    /// Multiply the trace's arrival rate by X (arrival times are divided by X) [default: 1].
    #[arg(long, value_name = "X")]
    pub rate_scale: Option<f64>,

    /// Replay only the first N requests of the trace.
    #[arg(long, value_name = "N")]
    pub max_requests: Option<u64>,

    /// Leave out the trace's first N requests; the rest start at time zero (with
    /// --max-requests: another slice of the same trace).
    #[arg(long, value_name = "N")]
    pub skip_requests: Option<u64>,

    /// What clients ask as max_tokens, all the router and the engines' load reports know of an
    /// output before it ends: `exact` (the trace's own output lengths, known in advance: no
    /// live router has them) or N (every client bounds its output at N tokens; it still ends
    /// where the trace says, and one the trace has longer is asked for in full) [default: exact].
    #[arg(long, value_name = "exact|N")]
    pub max_tokens: Option<MaxTokens>,

    /// Time-to-first-token target of the SLO, in milliseconds [default: 2000].
    #[arg(long, value_name = "MS")]
    pub ttft_slo_ms: Option<f64>,

    /// Time-per-output-token target of the SLO, in milliseconds [default: 100].
    #[arg(long, value_name = "MS")]
    pub tpot_slo_ms: Option<f64>,

    /// Tokens per KV block [default: 16].
    #[arg(long, value_name = "N")]
    pub block_size: Option<u32>,

    /// Token budget of one engine iteration (decode tokens plus prefill chunk) [default: 8192].
    #[arg(long, value_name = "N")]
    pub max_batch_tokens: Option<u32>,

    /// KV blocks per instance [default: what the GPU memory left by the weights holds].
    #[arg(long, value_name = "N")]
    pub kv_blocks: Option<u32>,

    /// Step profile measured on the engine (`fleetplane profile`): the cost model's
    /// efficiencies and step overhead are fitted to it.
    #[arg(long, value_name = "FILE.json")]
    pub profile: Option<PathBuf>,

    /// The live path's latency per request outside the engines' steps (gateway, routing,
    /// gRPC, streaming), in ms: requests reach the router this much after they arrive.
    /// `fleetplane latency` measures it on a live fleet [default: 0].
    #[arg(long, value_name = "MS")]
    pub dispatch_ms: Option<f64>,

    /// Engines sharing one GPU (each given its share of memory: set --kv-blocks); their steps
    /// take turns on it, as the driver time-slices processes without MPS [default: 1].
    #[arg(long, value_name = "N")]
    pub instances_per_gpu: Option<u32>,

    /// With --instances-per-gpu: the share of the GPU's time left to steps while several
    /// engines' steps overlap, the rest lost to context switches [default: 1; an H200
    /// measured 0.89].
    #[arg(long, value_name = "SHARE")]
    pub gpu_share_efficiency: Option<f64>,

    /// KV tiers: l1 (GPU memory only), l1,l2 (plus host memory per instance) or l1,l2,l3
    /// (plus a store shared by the fleet) [default: l1].
    #[arg(long, value_name = "TIERS")]
    pub kv_tiers: Option<String>,

    /// Host memory for KV per instance (L2), in GiB [default: 128].
    #[arg(long, value_name = "GIB")]
    pub l2_gib: Option<f64>,

    /// Size of the shared KV store (L3) for the whole fleet, in GiB [default: 4096].
    #[arg(long, value_name = "GIB")]
    pub l3_gib: Option<f64>,

    /// Delay of KV events between an instance and the router, in ms [default: 5].
    #[arg(long, value_name = "MS")]
    pub kv_event_delay_ms: Option<f64>,

    /// Tokens of one entry of L2 and L3, an offload chunk (vLLM's offloaded block size,
    /// LMCache's chunk: 256): a multiple of the block size dividing a page of 32 blocks
    /// [default: one block].
    #[arg(long, value_name = "TOKENS")]
    pub offload_chunk_tokens: Option<u32>,

    /// How each engine shares its prefill budget: fcfs (in order of admission) or fair
    /// (prompts that fit one chunk first, quotas for long ones; see [scheduler] in a
    /// scenario for its knobs) [default: fcfs].
    #[arg(long, value_name = "NAME")]
    pub prefill_scheduler: Option<String>,

    /// KV high-water protection: share of KV blocks in use (0 to 1] at which an instance
    /// stops admitting new requests (and routers avoid it) until use falls to
    /// --kv-low-water [default: off]. `NAME@hw` / `NAME@nohw` in --router turn it on / off
    /// per run.
    #[arg(long, value_name = "SHARE")]
    pub kv_high_water: Option<f64>,

    /// Share of KV blocks in use at which a paused instance admits again, below
    /// --kv-high-water [default: 80% of it].
    #[arg(long, value_name = "SHARE")]
    pub kv_low_water: Option<f64>,

    /// Output tokens a request may generate on an instance before it counts as a runaway:
    /// above the high-water mark, runaways are evicted and placed on another instance (or
    /// ended, with `runaway_action = "end"` in [scheduler]) [default: none].
    #[arg(long, value_name = "N")]
    pub runaway_output_tokens: Option<u32>,

    /// Fleet layout: colocated (every instance prefills and decodes) or pd (a prefill pool
    /// hands each request's KV to a decode pool) [default: colocated].
    #[arg(long, value_name = "MODE")]
    pub mode: Option<String>,

    /// Prefill instances at the start (--mode pd) [default: 1].
    #[arg(long, value_name = "N")]
    pub prefill_instances: Option<u32>,

    /// Decode instances at the start (--mode pd) [default: 1].
    #[arg(long, value_name = "N")]
    pub decode_instances: Option<u32>,

    /// Pool sizing (--mode pd): none, fixed-xpyd (whole groups of X prefill + Y decode) or
    /// slo-load (each pool from its SLO load) [default: none].
    #[arg(long, value_name = "NAME")]
    pub autoscaler: Option<String>,

    /// Seconds from asking for an instance to its serving [default: 10].
    #[arg(long, value_name = "S")]
    pub startup_s: Option<f64>,

    /// GPUs the fleet may hold at once, starting and draining instances included
    /// [default: --instances x GPUs per instance].
    #[arg(long, value_name = "G")]
    pub gpu_budget: Option<u32>,

    /// fixed-xpyd's group, X prefill and Y decode instances [default: the starting pools' ratio].
    #[arg(long, value_name = "X:Y")]
    pub xpyd: Option<String>,
}

impl SimFlags {
    fn as_scenario(&self) -> Scenario {
        Scenario {
            seed: self.seed,
            routers: self.router.as_ref().map(|r| r.iter().map(|s| s.as_str().into()).collect()),
            fleet: FleetSection {
                instances: self.instances,
                model: self.model.clone(),
                gpu: self.gpu.clone(),
                tp: self.tp,
                dp_attention: self.dp_attention,
                ep: self.ep,
                cp: self.cp,
                cp_mode: self.cp_mode,
                spec: self.spec.clone(),
                block_size: self.block_size,
                max_batch_tokens: self.max_batch_tokens,
                max_seqs: None,
                kv_blocks: self.kv_blocks,
                profile: self.profile.clone(),
                dispatch_ms: self.dispatch_ms,
                instances_per_gpu: self.instances_per_gpu,
                gpu_share_efficiency: self.gpu_share_efficiency,
            },
            workload: WorkloadSection {
                trace: self.trace.clone(),
                format: self.format.clone(),
                rate_scale: self.rate_scale,
                skip_requests: self.skip_requests,
                max_requests: self.max_requests,
                synthetic: None,
                phased: None,
                agentic: None,
                classes: None,
                max_tokens: self.max_tokens,
            },
            slo: SloSection { ttft_ms: self.ttft_slo_ms, tpot_ms: self.tpot_slo_ms },
            kv: KvSection {
                tiers: self.kv_tiers.clone(),
                l2_gib: self.l2_gib,
                l3_gib: self.l3_gib,
                event_delay_ms: self.kv_event_delay_ms,
                offload_chunk_tokens: self.offload_chunk_tokens,
                ..KvSection::default()
            },
            scheduler: SchedulerSection {
                prefill: self.prefill_scheduler.clone(),
                kv_high_water: self.kv_high_water,
                kv_low_water: self.kv_low_water,
                runaway_output_tokens: self.runaway_output_tokens,
                ..SchedulerSection::default()
            },
            cost: None,
            pools: PoolsSection {
                mode: self.mode.clone(),
                prefill_instances: self.prefill_instances,
                decode_instances: self.decode_instances,
                autoscaler: self.autoscaler.clone(),
                startup_s: self.startup_s,
                gpu_budget: self.gpu_budget,
                xpyd: self.xpyd.clone(),
                ..PoolsSection::default()
            },
            flow: FlowSection { rules: self.flow.as_ref().map(|r| r.iter().cloned().map(FlowEntry::Name).collect()) },
        }
    }

    /// The scenario file (if any) with the flags and then the policy file laid over it,
    /// resolved and checked.
    pub fn settings(&self) -> Result<Settings, Failure> {
        self.scenario()?.resolve().context("invalid settings").map_err(Failure::Input)
    }

    /// The scenario these flags describe, before it is resolved.
    pub fn scenario(&self) -> Result<Scenario, Failure> {
        let base = match &self.scenario {
            Some(path) => Scenario::load(path).map_err(|e| Failure::Input(e.into()))?,
            None => Scenario::default(),
        };
        let mut scenario = base.overlay(self.as_scenario());
        if let Some(tenant) = &self.only_tenant {
            let Some(classes) = scenario.workload.classes.as_mut() else {
                return Err(Failure::Input(anyhow::anyhow!(
                    "--only-tenant {tenant}: the scenario has no [workload.classes]"
                )));
            };
            classes.only_tenant = Some(tenant.clone());
        }
        match &self.policy {
            None => Ok(scenario),
            Some(path) => {
                let policy = PolicyFile::load(path).map_err(|e| Failure::Input(e.into()))?;
                policy.overlay(scenario).with_context(|| format!("policy {}", path.display())).map_err(Failure::Input)
            }
        }
    }
}

/// One line that says what is about to run, seed first, so that a run can be replayed.
pub fn describe(s: &Settings) -> String {
    let source = match &s.workload {
        simulator::scenario::WorkloadSource::Trace { path, .. } => path.display().to_string(),
        simulator::scenario::WorkloadSource::Synthetic(c) => format!("synthetic ({} requests)", c.requests),
        simulator::scenario::WorkloadSource::Phased(c) => c.describe(),
        simulator::scenario::WorkloadSource::Agentic(c) => format!("agentic ({} closed-loop sessions)", c.sessions),
    };
    let block_tokens = u64::from(s.instance.block_size);
    let mut tiers = String::new();
    if s.instance.l2_blocks > 0 {
        tiers += &format!(", L2 {} tokens per instance", u64::from(s.instance.l2_blocks) * block_tokens);
    }
    if let Some(l3) = s.tiers.l3_blocks {
        tiers += &format!(", L3 {} tokens shared", u64::from(l3) * block_tokens);
    }
    if s.tiers.chunk_blocks > 1 && (s.instance.l2_blocks > 0 || s.tiers.l3_blocks.is_some()) {
        tiers += &format!(" (in chunks of {} tokens)", u64::from(s.tiers.chunk_blocks) * block_tokens);
    }
    let calibrated = match &s.calibration {
        Some(c) => format!(
            " | calibrated on {} samples ({}): GEMM {:.0}%, attention {:.1}%{}, HBM {:.0}% of peak (KV {:.0}%), {:.0} us/step \
             (+{:.0} us with prefill, +{:.1} us per sequence); \
             step time error median {:.1}% (uncalibrated {:.1}%), p90 {:.1}%, max {:.1}%{}",
            c.samples,
            c.source,
            100.0 * c.compute_efficiency,
            100.0 * c.attention_efficiency,
            if c.serial_attention { " after the GEMMs" } else { "" },
            100.0 * c.memory_efficiency,
            100.0 * c.kv_memory_efficiency,
            c.step_overhead_us,
            c.prefill_step_overhead_us,
            c.sequence_overhead_us,
            100.0 * c.median_error,
            100.0 * c.uncalibrated_median_error,
            100.0 * c.p90_error,
            100.0 * c.max_error,
            c.decode_table
                .as_ref()
                .map(|t| {
                    format!(
                        "; decode-only steps priced from its {} decode steps ({} batch sizes)",
                        t.samples(),
                        t.batch_sizes()
                    )
                })
                .unwrap_or_default(),
        ),
        None => String::new(),
    };
    let spec = s.drafter.map(|d| format!(", drafter {}", d.name)).unwrap_or_default();
    let dispatch =
        if s.dispatch.0 > 0 { format!(", dispatch {:.2} ms", s.dispatch.as_secs_f64() * 1e3) } else { String::new() };
    let max_tokens = match s.max_tokens {
        MaxTokens::Exact => String::new(),
        MaxTokens::Bound(n) => format!(", clients' max_tokens {n}"),
    };
    // The step budget when it is not vLLM's default (a policy's or the scenario's).
    let budget = match s.instance.max_batch_tokens {
        n if n == engine::InstanceConfig::default().max_batch_tokens => String::new(),
        n => format!(", steps of {n} tokens"),
    };
    let sharing = if s.instances_per_gpu > 1 {
        format!(
            ", {} instances per GPU ({:.0}% of it while steps overlap)",
            s.instances_per_gpu,
            100.0 * s.gpu_share_efficiency
        )
    } else {
        String::new()
    };
    format!(
        "seed={} | {} x {} on {} ({}{spec}), KV {} tokens per instance{budget}{tiers}{dispatch}{sharing} | {} at rate x{}{}{max_tokens}{calibrated}",
        s.seed,
        s.instances,
        s.cost.model().name,
        s.cost.gpu().name,
        layout(s.cost.deployment()),
        // Blocks set by hand (engines with a memory budget) replace what the GPU would hold.
        match s.instance.total_blocks == s.cost.kv_blocks(s.instance.block_size) {
            true => s.cost.kv_capacity_tokens(),
            false => u64::from(s.instance.total_blocks) * block_tokens,
        },
        source,
        s.rate_scale,
        match (s.skip_requests, s.max_requests) {
            (Some(k), Some(n)) => format!(", requests {k}..{}", k + n),
            (Some(k), None) => format!(", from request {k}"),
            (None, Some(n)) => format!(", first {n} requests"),
            (None, None) => String::new(),
        },
    )
}

/// `TP 8`, or `TP 1 x DP-attention 8, EP 8: 8 GPUs` for a layout with attention DP or EP,
/// or `TP 2 x CP 4 (ring): 8 GPUs` under context parallelism.
pub fn layout(d: cost::Deployment) -> String {
    let cp = if d.cp > 1 { format!(" x CP {} ({})", d.cp, d.cp_mode.name()) } else { String::new() };
    if d.dp_attention == 1 && d.ep == 1 && d.cp == 1 {
        format!("TP {}", d.tp)
    } else if d.dp_attention == 1 && d.ep == 1 {
        format!("TP {}{cp}: {} GPUs", d.tp, d.gpus())
    } else {
        format!("TP {} x DP-attention {}, EP {}{cp}: {} GPUs", d.tp, d.dp_attention, d.ep, d.gpus())
    }
}

/// `--cp-mode`: ring or allgather.
pub fn parse_cp_mode(s: &str) -> Result<CpMode, UnknownName> {
    s.parse()
}
