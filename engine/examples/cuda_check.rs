//! Correctness and speed checks of the CUDA executor on a real GPU, run by
//! `scripts/gpu-check.sh` (which compares the `logits` output against transformers).
//!
//! ```text
//! cuda-check logits DIR OUT_PREFIX PROMPT_LEN DECODE   # greedy run; writes OUT_PREFIX.json + .f32
//! cuda-check chunked DIR                               # chunked / prefix-cached prefill vs one shot
//! cuda-check bench CONFIG                              # decode and prefill speed, random weights
//! cuda-check make-model CONFIG DIR                     # as `fleetplane make-model`
//! ```

use engine::cuda::{block_hashes, CudaExecutor, CudaExecutorConfig, LlamaConfig, ModelSource, Sampling};
use engine::{Batch, BatchEntry, BlockId, Dur, Executor, Finished, Instance, Request, RequestId, StepOutput, Time};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("logits") if args.len() == 5 => logits(&args[1], &args[2], parse(&args[3]), parse(&args[4])),
        Some("chunked") if args.len() == 2 => chunked(&args[1]),
        Some("bench") if args.len() == 2 => bench(&args[1]),
        Some("make-model") if args.len() == 3 => make_model(&args[1], &args[2]),
        _ => Err("usage: cuda-check logits DIR OUT_PREFIX PROMPT_LEN DECODE | chunked DIR | bench CONFIG".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn make_model(config: &str, dir: &str) -> Res {
    let cfg = LlamaConfig::preset(config).ok_or(format!("unknown config {config}"))?;
    let w = engine::cuda::synth::write_random_model(std::path::Path::new(dir), &cfg, 0, 5 << 30)
        .map_err(|e| e.to_string())?;
    println!("make-model: {config}: {} files, {} bytes in {dir}", w.files.len(), w.bytes);
    Ok(())
}

fn parse(s: &str) -> u32 {
    s.parse().unwrap_or_else(|_| panic!("not a number: {s}"))
}

type Res = Result<(), String>;

fn executor(dir: &str, max_batch_tokens: u32) -> Result<CudaExecutor, String> {
    let mut cfg = CudaExecutorConfig::new(ModelSource::Dir(PathBuf::from(dir)));
    cfg.gpu_memory_bytes = Some(40 << 30);
    cfg.max_batch_tokens = max_batch_tokens;
    cfg.max_seqs = 16;
    CudaExecutor::new(cfg).map_err(|e| e.to_string())
}

/// A deterministic prompt of ids spread over the vocabulary.
fn prompt(len: u32, vocab: usize, salt: u64) -> Vec<u32> {
    (0..u64::from(len)).map(|i| (engine::ids::mix64(i ^ (salt << 32)) % vocab as u64) as u32).collect()
}

/// Serves requests one after another on one instance (so later ones can hit the prefix
/// cache of earlier ones), each to `output` tokens. Returns each request's Finished record.
fn serve_in_turn(
    exec: &mut CudaExecutor,
    inst: &mut Instance,
    prompts: &[(u64, Vec<u32>)],
    output: u32,
) -> Vec<Finished> {
    let mut done = Vec::new();
    let mut now = Time::ZERO;
    for (id, p) in prompts {
        exec.set_request(RequestId(*id), p.clone(), Sampling::GREEDY);
        let req = Request {
            id: RequestId(*id),
            arrival: now,
            prompt_tokens: p.len() as u32,
            max_output_tokens: output,
            block_hashes: block_hashes(p, exec.block_size()),
            resume: None,
        };
        inst.enqueue(now, req).expect("request fits");
        let mut ev = Vec::new();
        while inst.has_work() {
            let d = inst.begin_step(now, exec).expect("step runs").expect("work");
            now += d + Dur(1);
            inst.end_step(now, &mut done, &mut ev);
        }
    }
    done
}

fn logits(dir: &str, out: &str, prompt_len: u32, decode: u32) -> Res {
    let mut exec = executor(dir, 8192)?;
    exec.capture_logits(true);
    let vocab = exec.model_config().vocab_size;
    let p = prompt(prompt_len, vocab, 1);
    let mut inst = Instance::new(exec.instance_config());
    serve_in_turn(&mut exec, &mut inst, &[(0, p.clone())], decode);
    let rows = exec.captured_logits(RequestId(0)).ok_or("no logits captured")?.to_vec();
    let generated = exec.release(RequestId(0)).ok_or("request vanished")?;
    let mut f = std::fs::File::create(format!("{out}.f32")).map_err(|e| format!("{out}.f32: {e}"))?;
    for r in &rows {
        let bytes: Vec<u8> = r.iter().flat_map(|x| x.to_le_bytes()).collect();
        f.write_all(&bytes).map_err(|e| format!("{out}.f32: {e}"))?;
    }
    let json = serde_json::json!({ "prompt": p, "generated": generated, "rows": rows.len(), "vocab": vocab });
    std::fs::write(format!("{out}.json"), json.to_string()).map_err(|e| format!("{out}.json: {e}"))?;
    println!("logits: {dir}: prompt {prompt_len}, generated {} tokens, {} logit rows", generated.len(), rows.len());
    Ok(())
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den).sqrt()
}

/// Chunked prefill (the prompt computed in chunks, each attending to the KV of the ones
/// before it) and prefix caching (the same prompt again on the same instance: only its tail is
/// computed, over cached KV) against one-shot prefill. Different chunkings run GEMMs of
/// different shapes, whose cuBLAS algorithms round differently, so the bar is the engine's own
/// floor for that: the one-shot prompt batched beside another request (same math, other GEMM
/// shapes). Passes when every error is at most max(1e-2, 1.5 x floor).
fn chunked(dir: &str) -> Res {
    let len = 1000;
    let mut worst = 0.0f64;
    let mut floor = 0.0f64;
    let mut one_shot: Option<(Vec<Vec<f32>>, Vec<u32>)> = None;
    for chunk in [8192, 256, 100] {
        let mut exec = executor(dir, chunk)?;
        exec.capture_logits(true);
        let vocab = exec.model_config().vocab_size;
        let p = prompt(len, vocab, 2);
        let mut inst = Instance::new(exec.instance_config());
        serve_in_turn(&mut exec, &mut inst, &[(0, p.clone())], 8);
        let rows = exec.captured_logits(RequestId(0)).ok_or("no logits")?.to_vec();
        let toks = exec.release(RequestId(0)).ok_or("request vanished")?;
        let done = serve_in_turn(&mut exec, &mut inst, &[(1, p.clone())], 8);
        let cached = done.last().map_or(0, |f| f.cached_total());
        let rows2 = exec.captured_logits(RequestId(1)).ok_or("no logits")?.to_vec();
        let toks2 = exec.release(RequestId(1)).ok_or("request vanished")?;
        if cached == 0 {
            return Err(format!("chunk {chunk}: the repeated prompt found nothing in the prefix cache"));
        }
        let Some((ref_rows, ref_toks)) = &one_shot else {
            // Noise floor: the same one-shot prefill in a batch with another prompt.
            let mut fresh = Instance::new(exec.instance_config());
            for (id, q) in [(2u64, p.clone()), (3, prompt(37, vocab, 3))] {
                exec.set_request(RequestId(id), q.clone(), Sampling::GREEDY);
                let req = Request {
                    id: RequestId(id),
                    arrival: Time::ZERO,
                    prompt_tokens: q.len() as u32,
                    max_output_tokens: 1,
                    block_hashes: block_hashes(&q, exec.block_size()),
                    resume: None,
                };
                fresh.enqueue(Time::ZERO, req).map_err(|e| format!("{:?}", e.0))?;
            }
            let (mut fin, mut ev) = (Vec::new(), Vec::new());
            let d = fresh.begin_step(Time::ZERO, &mut exec).map_err(|e| e.to_string())?.ok_or("no work")?;
            fresh.end_step(Time::ZERO + d, &mut fin, &mut ev);
            let batched = exec.captured_logits(RequestId(2)).ok_or("no logits")?[0].clone();
            floor = rel_err(&batched, &rows[0]);
            let e2 = rel_err(&rows2[0], &rows[0]);
            worst = worst.max(e2);
            println!(
                "chunked: noise floor (one-shot alone vs batched with another prompt) {floor:.2e}; \
                 chunk {chunk}: prefix-cached ({cached} of {len} cached) rel err {e2:.2e}, tokens equal {}",
                toks2 == toks
            );
            one_shot = Some((rows, toks));
            continue;
        };
        let e = rel_err(&rows[0], &ref_rows[0]);
        let e2 = rel_err(&rows2[0], &ref_rows[0]);
        worst = worst.max(e).max(e2);
        println!(
            "chunked: chunk {chunk}: chunked prefill rel err {e:.2e} (tokens equal {}), prefix-cached ({cached} of {len} cached) {e2:.2e} (tokens equal {})",
            &toks == ref_toks,
            &toks2 == ref_toks
        );
    }
    let bar = (1.5 * floor).max(1e-2);
    let pass = worst <= bar;
    println!(
        "chunked: worst relative error {worst:.2e}, bar max(1e-2, 1.5 x floor) = {bar:.2e}: {}",
        if pass { "PASS" } else { "FAIL" }
    );
    if !pass {
        return Err("chunked prefill logits differ from one-shot beyond the noise floor".into());
    }
    Ok(())
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Decode and prefill speed on random weights drawn on the GPU. Batches are built by hand
/// (not by the scheduler) so that their shapes are exactly the ones measured; decode steps
/// attend to `ctx` positions of KV that hold zeros (the bytes read are the same as real KV).
fn bench(config: &str) -> Res {
    let cfg = LlamaConfig::preset(config).ok_or(format!("unknown config {config}"))?;
    let block = 16u32;
    let mut ecfg = CudaExecutorConfig::new(ModelSource::Random { config: cfg.clone(), seed: 1 });
    ecfg.max_batch_tokens = 8192;
    ecfg.max_seqs = 256;
    ecfg.block_size = block;
    let mut exec = CudaExecutor::new(ecfg).map_err(|e| e.to_string())?;
    let kv_blocks = exec.kv_blocks();
    let weight_bytes = cfg.parameters() as f64 * 2.0;
    let kv_token_bytes = (4 * cfg.num_hidden_layers * cfg.kv_dim()) as f64;
    let bw = 4.3e12;
    let gemm_rate = 788e12;
    println!("bench: {config}: {:.2} B params, {kv_blocks} KV blocks of {block} tokens", cfg.parameters() as f64 / 1e9);
    println!("| phase | batch | context | step ms | tokens/s | ceiling tokens/s | share |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let mut out = StepOutput::default();
    let mut next_id = 0u64;
    for ctx in [128u32, 4096] {
        for b in [1u32, 16, 64, 256] {
            let steps = 20u32;
            let blocks_per_seq = (ctx + steps + 8).div_ceil(block);
            if u64::from(blocks_per_seq) * u64::from(b) > u64::from(kv_blocks) {
                println!("| decode | {b} | {ctx} | does not fit ({kv_blocks} blocks) | | | |");
                continue;
            }
            let ids: Vec<RequestId> = (0..b)
                .map(|_| {
                    next_id += 1;
                    RequestId(next_id)
                })
                .collect();
            for &id in &ids {
                exec.set_request(id, vec![7; ctx as usize + 1], Sampling::GREEDY);
            }
            let mut times = Vec::new();
            for step in 0..steps {
                let mut batch = Batch::default();
                for (k, &id) in ids.iter().enumerate() {
                    let len = exec.tokens(id).map_or(0, |t| t.len()) as u32;
                    let start = batch.block_tables.len() as u32;
                    let first = k as u32 * blocks_per_seq;
                    batch.block_tables.extend((first..first + blocks_per_seq).map(BlockId));
                    let mut e = BatchEntry::new(id, len - 1, 1, false);
                    e.blocks = (start, batch.block_tables.len() as u32);
                    batch.entries.push(e);
                }
                out.tokens.clear();
                let d = exec.execute(&batch, &mut out).map_err(|e| e.to_string())?;
                if step >= 3 {
                    times.push(d.as_secs_f64());
                }
            }
            for &id in &ids {
                exec.release(id);
            }
            let t = median(times);
            let bytes = weight_bytes + kv_token_bytes * f64::from(b) * f64::from(ctx);
            let ceiling = f64::from(b) / (bytes / bw);
            let rate = f64::from(b) / t;
            println!(
                "| decode | {b} | {ctx} | {:.2} | {rate:.0} | {ceiling:.0} | {:.0}% |",
                t * 1e3,
                100.0 * rate / ceiling
            );
        }
    }
    for n in [2048u32, 8192] {
        let mut times = Vec::new();
        for rep in 0..4 {
            next_id += 1;
            let id = RequestId(next_id);
            exec.set_request(id, vec![3; n as usize], Sampling::GREEDY);
            let mut batch = Batch::default();
            batch.block_tables.extend((0..n.div_ceil(block)).map(BlockId));
            let mut e = BatchEntry::new(id, 0, n, true);
            e.blocks = (0, batch.block_tables.len() as u32);
            batch.entries.push(e);
            out.tokens.clear();
            let d = exec.execute(&batch, &mut out).map_err(|e| e.to_string())?;
            exec.release(id);
            if rep > 0 {
                times.push(d.as_secs_f64());
            }
        }
        let t = median(times);
        let flops = 2.0 * cfg.parameters() as f64 * f64::from(n)
            + 4.0 * (cfg.num_hidden_layers * cfg.q_dim()) as f64 * f64::from(n) * f64::from(n) / 2.0;
        let ceiling = f64::from(n) / (flops / gemm_rate);
        let rate = f64::from(n) / t;
        println!("| prefill | 1 | {n} | {:.2} | {rate:.0} | {ceiling:.0} | {:.0}% |", t * 1e3, 100.0 * rate / ceiling);
    }
    Ok(())
}
