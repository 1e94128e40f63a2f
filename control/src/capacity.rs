//! `fleetplane capacity`: what one node holds and how fast it steps, for a model on a GPU
//! under a deployment layout, straight from the cost model (no trace, no simulation).
//!
//! KV capacity follows the layout (see `cost::Deployment`): under TP an MLA
//! model's latent is replicated on every rank, under attention DP each rank keeps only its
//! own requests' KV, and GQA's KV heads split under TP. The largest batch at a context
//! counts whole requests per DP rank (a request's KV never straddles ranks). Step times are
//! the roofline's, for the shapes below: one sequence's prefill chunk (under attention DP a
//! lone chunk runs on one rank), the same tokens split evenly over the DP ranks, and decode
//! steps at batch 1 and at the largest batch; and one `--context`-token prompt prefilled in
//! `--chunk`-token chunks, as an engine with chunked prefill runs it (each chunk attends to
//! the ones before it). Under context parallelism (`--cp`) the last line also says how much
//! of the K/V exchange stays exposed and how much K/V one GPU holds per layer for it.

use crate::cli::{layout, parse_cp_mode};
use crate::Failure;
use anyhow::{anyhow, Context};
use clap::Args as ClapArgs;
use cost::{drafter_by_name, gpu_by_name, model_by_name, CostModel, CostParams, CpMode, Deployment};
use engine::{BatchEntry, BatchStats, RequestId};
use serde::Serialize;
use simulator::report::write_json;
use std::path::PathBuf;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Model: llama-3.1-8b, llama-3.1-70b, qwen3-32b or deepseek-v3.
    #[arg(long, value_name = "NAME")]
    pub model: String,

    /// GPU: a100, h100, h200 or b200.
    #[arg(long, value_name = "NAME")]
    pub gpu: String,

    /// GPUs of one node; it holds node / (tp x dp-attention) instances.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub gpus: u32,

    /// Tensor-parallel degree inside one attention rank.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub tp: u32,

    /// Attention data-parallel ranks per instance (SGLang's --dp N --enable-dp-attention).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub dp_attention: u32,

    /// Expert-parallel degree of an MoE: 1 or the instance's GPUs.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub ep: u32,

    /// Context-parallel replicas per instance; an instance has tp x dp-attention x cp GPUs.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub cp: u32,

    /// How context-parallel replicas exchange K/V: ring or allgather.
    #[arg(long, value_name = "MODE", default_value = "ring", value_parser = parse_cp_mode)]
    pub cp_mode: CpMode,

    /// Context of each request for the largest batch and the decode steps, and the length of
    /// the prompt whose whole prefill is timed, in tokens.
    #[arg(long, value_name = "TOKENS", default_value_t = 32768)]
    pub context: u32,

    /// Tokens of the prefill chunk whose step time is printed, and the chunk size of the
    /// `--context` prompt's prefill.
    #[arg(long, value_name = "TOKENS", default_value_t = 8192)]
    pub chunk: u32,

    /// Speculative decoding preset to price: eagle3, dflash or dspark (a calculation on the
    /// decode steps above; see cost::Drafter for the assumptions).
    #[arg(long, value_name = "NAME")]
    pub spec: Option<String>,

    /// Sequences per decode step for --spec, besides batch 1.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub spec_batch: u32,

    /// Write the numbers as JSON (kv_capacity_tokens_per_node, _per_gpu, ...).
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
}

/// Everything printed, as written to `--json`. Times in milliseconds; `None` where the
/// largest batch is empty (the context does not fit one rank).
#[derive(Debug, Serialize)]
struct Capacity {
    model: &'static str,
    gpu: &'static str,
    tp: u32,
    dp_attention: u32,
    ep: u32,
    cp: u32,
    cp_mode: &'static str,
    #[serde(skip)]
    deployment: Deployment,
    gpus_per_instance: u32,
    gpus_per_node: u32,
    instances_per_node: u32,
    weight_bytes_per_gpu: u64,
    kv_bytes_per_token_per_gpu: u64,
    kv_capacity_tokens_per_instance: u64,
    kv_capacity_tokens_per_gpu: u64,
    kv_capacity_tokens_per_node: u64,
    context_tokens: u32,
    /// Requests of `context_tokens` one instance holds at once.
    largest_batch: u64,
    prefill_chunk_tokens: u32,
    prefill_step_ms: f64,
    /// The chunk's tokens as `dp_attention` equal sequences, one per rank.
    prefill_split_step_ms: f64,
    decode_step_ms_batch_1: f64,
    decode_step_ms_largest_batch: Option<f64>,
    decode_tokens_per_s_largest_batch: Option<f64>,
    /// One prompt of `context_tokens` prefilled alone in chunks of `prefill_chunk_tokens`.
    prefill_context_ms: f64,
    prefill_context_tokens_per_s: f64,
    /// Context-parallel K/V exchange left exposed over that whole prefill (zero at cp 1).
    prefill_context_cp_exposed_ms: f64,
    /// K/V of one layer one GPU holds at once during the last chunk's attention: the whole
    /// layer's without CP and under all-gather CP, two ring blocks under ring CP.
    prefill_context_peak_kv_bytes_per_layer: f64,
    /// With `--spec`: the drafter, and its TPOT at batch 1 and at `--spec-batch`.
    speculative: Option<Speculative>,
}

#[derive(Debug, Serialize)]
struct Speculative {
    drafter: &'static str,
    drafted_tokens: usize,
    verified_tokens: u32,
    accepted_tokens_per_step: f64,
    /// `(batch, plain TPOT ms, speculative TPOT ms)` at batch 1 and at `--spec-batch`.
    tpot_ms: Vec<(u32, f64, f64)>,
}

pub fn run(args: Args) -> Result<(), Failure> {
    let c = capacity(&args).map_err(Failure::Input)?;
    print!("{}", table(&c));
    if let Some(path) = &args.json {
        write_json(path, &c).map_err(|e| Failure::Output(e.into()))?;
    }
    Ok(())
}

fn capacity(args: &Args) -> anyhow::Result<Capacity> {
    let model = model_by_name(&args.model)?;
    let gpu = gpu_by_name(&args.gpu)?;
    let deployment =
        Deployment { tp: args.tp, dp_attention: args.dp_attention, ep: args.ep, cp: args.cp, cp_mode: args.cp_mode };
    let cost = CostModel::new(model, gpu, deployment, CostParams::default()).context("invalid layout")?;
    let per_instance = cost.gpus();
    if args.gpus == 0 || !args.gpus.is_multiple_of(per_instance) {
        return Err(anyhow!(
            "--gpus {}: a node must hold whole instances of {per_instance} GPUs ({})",
            args.gpus,
            layout(deployment)
        ));
    }
    if args.context == 0 || args.chunk == 0 {
        return Err(anyhow!("--context and --chunk must be at least 1 token"));
    }
    let instances = args.gpus / per_instance;
    let tokens = cost.kv_capacity_tokens();
    let dp = deployment.dp_attention;
    // Capacity is a whole number of tokens per rank times the ranks.
    let per_rank = tokens / u64::from(dp);
    let largest_batch = per_rank / u64::from(args.context) * u64::from(dp);
    let ms = |stats: &BatchStats| cost.step_time(stats).as_secs_f64() * 1e3;
    let split = (args.chunk / dp).max(1);
    let decode_largest = (largest_batch > 0).then(|| ms(&decode(largest_batch, args.context)));
    let speculative = match &args.spec {
        None => None,
        Some(name) => {
            let d = drafter_by_name(name)?;
            let tpot_ms = [1, args.spec_batch.max(1)]
                .map(|b| {
                    let s = d.step(&cost, b, args.context);
                    (b, s.plain_tpot_s * 1e3, s.tpot_s * 1e3)
                })
                .to_vec();
            Some(Speculative {
                drafter: d.name,
                drafted_tokens: d.acceptance.len(),
                verified_tokens: d.verified,
                accepted_tokens_per_step: d.expected_accepted(),
                tpot_ms,
            })
        }
    };
    let (mut prefill_context_ms, mut exposed_ms, mut peak_bytes) = (0.0, 0.0, 0.0);
    let mut done = 0;
    while done < args.context {
        let n = args.chunk.min(args.context - done);
        let mut chunk = BatchStats::default();
        chunk.add(&entry(done, n, true));
        prefill_context_ms += ms(&chunk);
        let layer = cost.cp_prefill_layer(u64::from(done), u64::from(n));
        exposed_ms += layer.exposed_s * f64::from(model.layers) * 1e3;
        peak_bytes = layer.peak_kv_bytes;
        done += n;
    }
    Ok(Capacity {
        model: model.name,
        gpu: gpu.name,
        tp: deployment.tp,
        dp_attention: dp,
        ep: deployment.ep,
        cp: deployment.cp,
        cp_mode: deployment.cp_mode.name(),
        deployment,
        gpus_per_instance: per_instance,
        gpus_per_node: args.gpus,
        instances_per_node: instances,
        weight_bytes_per_gpu: cost.weight_bytes_per_gpu(),
        kv_bytes_per_token_per_gpu: cost.kv_bytes_per_token_per_gpu(),
        kv_capacity_tokens_per_instance: tokens,
        kv_capacity_tokens_per_gpu: tokens / u64::from(per_instance),
        kv_capacity_tokens_per_node: tokens * u64::from(instances),
        context_tokens: args.context,
        largest_batch,
        prefill_chunk_tokens: args.chunk,
        prefill_step_ms: ms(&prefill(&[args.chunk])),
        prefill_split_step_ms: ms(&prefill(&vec![split; dp as usize])),
        decode_step_ms_batch_1: ms(&decode(1, args.context)),
        decode_step_ms_largest_batch: decode_largest,
        decode_tokens_per_s_largest_batch: decode_largest.map(|t| largest_batch as f64 / t * 1e3),
        prefill_context_ms,
        prefill_context_tokens_per_s: f64::from(args.context) / prefill_context_ms * 1e3,
        prefill_context_cp_exposed_ms: exposed_ms,
        prefill_context_peak_kv_bytes_per_layer: peak_bytes,
        speculative,
    })
}

/// Fresh prompts, one chunk each, of the given lengths.
fn prefill(chunks: &[u32]) -> BatchStats {
    let mut s = BatchStats::default();
    for &n in chunks {
        s.add(&entry(0, n, true));
    }
    s
}

/// `seqs` decode steps, each after `context` tokens.
fn decode(seqs: u64, context: u32) -> BatchStats {
    let mut s = BatchStats::default();
    for _ in 0..seqs {
        s.add(&entry(context, 1, false));
    }
    s
}

fn entry(context_tokens: u32, new_tokens: u32, is_prefill: bool) -> BatchEntry {
    BatchEntry::new(RequestId(0), context_tokens, new_tokens, is_prefill)
}

fn table(c: &Capacity) -> String {
    let d = c.deployment;
    let mut out = format!(
        "{} on {} ({}): {} GPUs per instance, {} instance(s) per {}-GPU node\n",
        c.model,
        c.gpu,
        layout(d),
        c.gpus_per_instance,
        c.instances_per_node,
        c.gpus_per_node
    );
    out += "| quantity | value |\n| --- | --- |\n";
    let mut row = |k: String, v: String| out += &format!("| {k} | {v} |\n");
    row("weights per GPU".into(), format!("{:.1} GB", c.weight_bytes_per_gpu as f64 / 1e9));
    row("KV bytes per token per GPU".into(), thousands(c.kv_bytes_per_token_per_gpu));
    row("KV capacity per instance, tokens".into(), thousands(c.kv_capacity_tokens_per_instance));
    row("KV capacity per GPU, tokens".into(), thousands(c.kv_capacity_tokens_per_gpu));
    row("KV capacity per node, tokens".into(), thousands(c.kv_capacity_tokens_per_node));
    row(format!("largest batch at {} tokens of context, per instance", thousands(c.context_tokens.into())), {
        thousands(c.largest_batch)
    });
    row(format!("prefill step, one {}-token chunk", thousands(c.prefill_chunk_tokens.into())), {
        format!("{:.1} ms", c.prefill_step_ms)
    });
    if c.dp_attention > 1 {
        let split = thousands(u64::from((c.prefill_chunk_tokens / c.dp_attention).max(1)));
        row(format!("prefill step, {} prompts of {split} tokens, one per DP rank", c.dp_attention), {
            format!("{:.1} ms", c.prefill_split_step_ms)
        });
    }
    row("decode step, batch 1".into(), format!("{:.1} ms", c.decode_step_ms_batch_1));
    let largest = match (c.decode_step_ms_largest_batch, c.decode_tokens_per_s_largest_batch) {
        (Some(ms), Some(tps)) => format!("{ms:.1} ms ({tps:.0} tokens/s per instance)"),
        _ => "n/a: the context does not fit one rank".into(),
    };
    row(format!("decode step, batch {}", thousands(c.largest_batch)), largest);
    let (context, chunk) = (thousands(c.context_tokens.into()), thousands(c.prefill_chunk_tokens.into()));
    row(format!("prefill of one {context}-token prompt in {chunk}-token chunks"), {
        format!("{:.1} ms ({:.0} tokens/s)", c.prefill_context_ms, c.prefill_context_tokens_per_s)
    });
    if c.cp > 1 {
        row(format!("  of which CP K/V exchange exposed ({})", c.cp_mode), {
            format!("{:.1} ms", c.prefill_context_cp_exposed_ms)
        });
    }
    row("  peak K/V per layer per GPU for attention, last chunk".into(), {
        format!("{:.1} MB", c.prefill_context_peak_kv_bytes_per_layer / 1e6)
    });
    if let Some(s) = &c.speculative {
        row(format!("speculative decoding ({}): drafted, verified, accepted per step", s.drafter), {
            format!("{}, {}, {:.2} (+1 bonus token)", s.drafted_tokens, s.verified_tokens, s.accepted_tokens_per_step)
        });
        for &(batch, plain, spec) in &s.tpot_ms {
            row(format!("  TPOT at batch {batch}, context {context}: plain, speculative"), {
                format!("{plain:.2} ms, {spec:.2} ms ({:+.1}%)", (spec / plain - 1.0) * 100.0)
            });
        }
    }
    out
}

/// `1234567` as `1,234,567`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}
