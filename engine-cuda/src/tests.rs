//! GPU tests: each returns early (and says so) when no GPU is usable here, so CI without a
//! GPU passes them vacuously; on the H200 `scripts/gpu-check.sh` runs them for real.

use super::kernels::{compile, KernelShape, SOURCES};
use super::*;
use engine::ids::RequestId;
use engine::{Executor, Instance, Request, StepOutput, Time};
use std::path::PathBuf;

fn skip(what: &str) -> bool {
    if gpu_available() {
        return false;
    }
    eprintln!("skipping {what}: no CUDA driver or GPU here");
    true
}

fn tiny_model(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fleetplane-gpu-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    synth::write_random_model(&dir, &LlamaConfig::preset("tiny").unwrap(), 5, u64::MAX).unwrap();
    dir
}

/// A tiny model written to a fresh folder and an executor over it with a 2 GiB budget, steps
/// of up to 512 tokens and 8 sequences, capturing logits for the comparisons.
fn tiny_executor(name: &str) -> (PathBuf, CudaExecutor) {
    let dir = tiny_model(name);
    let mut cfg = CudaExecutorConfig::new(ModelSource::Dir(dir.clone()));
    cfg.gpu_memory_bytes = Some(2 << 30);
    cfg.max_batch_tokens = 512;
    cfg.max_seqs = 8;
    let mut exec = CudaExecutor::new(cfg).unwrap();
    exec.capture_logits(true);
    (dir, exec)
}

#[test]
fn every_kernel_compiles_with_nvrtc() {
    // Needs NVRTC only, not a GPU: syntax errors would otherwise show only on the device.
    // SAFETY: only probes whether the library can be loaded.
    #[allow(unsafe_code)]
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("skipping every_kernel_compiles_with_nvrtc: NVRTC not found");
        return;
    }
    for (head_dim, group) in [(64, 2), (128, 4), (128, 8), (256, 8)] {
        for (file, src) in SOURCES {
            compile(file, src, KernelShape { head_dim, block_size: 16, group }, "compute_90").unwrap();
        }
    }
}

/// Runs `prompts` to completion on an instance over `exec`, returning each one's output.
fn serve(exec: &mut CudaExecutor, prompts: &[Vec<u32>], output: u32, max_batch_tokens: u32) -> Vec<Vec<u32>> {
    let mut inst = Instance::new(engine::InstanceConfig { max_batch_tokens, ..exec.instance_config() });
    for (i, p) in prompts.iter().enumerate() {
        let id = RequestId(i as u64);
        exec.set_request(id, p.clone(), Sampling::GREEDY);
        let req = Request {
            id,
            arrival: Time::ZERO,
            prompt_tokens: p.len() as u32,
            max_output_tokens: output,
            ends_after: None,
            block_hashes: block_hashes(p, exec.block_size()),
            resume: None,
            service: Default::default(),
            model: Default::default(),
        };
        inst.enqueue(Time::ZERO, req).unwrap();
    }
    let (mut fin, mut ev) = (Vec::new(), Vec::new());
    let mut now = Time::ZERO;
    while inst.has_work() {
        let d = inst.begin_step(now, exec).unwrap().expect("work to do");
        now += d + engine::Dur(1);
        inst.end_step(now, &mut fin, &mut ev);
        // The engine checks itself only in its own tests (or with its `invariants` feature).
        inst.check_invariants();
    }
    (0..prompts.len()).map(|i| exec.tokens(RequestId(i as u64)).unwrap()[prompts[i].len()..].to_vec()).collect()
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn chunked_and_prefix_cached_prefill_give_the_one_shot_logits() {
    if skip("chunked_and_prefix_cached_prefill_give_the_one_shot_logits") {
        return;
    }
    let (dir, mut exec) = tiny_executor("chunked");
    let prompt: Vec<u32> = (0..200).map(|i| (i * 37 + 11) % 512).collect();
    // One shot: the whole prompt in one step.
    let one = serve(&mut exec, std::slice::from_ref(&prompt), 4, 512);
    let reference = exec.captured_logits(RequestId(0)).unwrap().to_vec();
    exec.release(RequestId(0));
    // Chunked: 64-token chunks, each attending to the KV of the chunks before it.
    let chunked = serve(&mut exec, std::slice::from_ref(&prompt), 4, 64);
    let got = exec.captured_logits(RequestId(0)).unwrap().to_vec();
    exec.release(RequestId(0));
    assert_eq!(one, chunked);
    for (a, b) in got.iter().zip(&reference) {
        assert!(rel_err(a, b) < 1e-2, "chunked logits differ: {}", rel_err(a, b));
    }
    // The same prompt twice in one batch: the two copies compute side by side (the prefix
    // cache hit of a later request is checked by `cuda-check chunked`, which keeps one
    // instance across requests).
    let outs = serve(&mut exec, &[prompt.clone(), prompt.clone()], 4, 512);
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[0], one[0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn greedy_decode_matches_recomputing_the_whole_sequence() {
    if skip("greedy_decode_matches_recomputing_the_whole_sequence") {
        return;
    }
    let (dir, mut exec) = tiny_executor("decode");
    let prompt: Vec<u32> = (0..40).map(|i| (i * 13 + 1) % 512).collect();
    let out = serve(&mut exec, std::slice::from_ref(&prompt), 8, 512);
    let decoded = exec.captured_logits(RequestId(0)).unwrap().to_vec();
    exec.release(RequestId(0));
    // Prefill of prompt + the first 7 outputs must reproduce the 8th decode step's logits.
    let mut longer = prompt.clone();
    longer.extend(&out[0][..7]);
    serve(&mut exec, std::slice::from_ref(&longer), 1, 512);
    let full = exec.captured_logits(RequestId(0)).unwrap()[0].clone();
    let e = rel_err(&decoded[7], &full);
    assert!(e < 1e-2, "decode vs prefill logits: relative error {e}");
    // A batch of several sequences decodes each as it would alone.
    let prompts: Vec<Vec<u32>> = (0..4).map(|k| (0..(20 + 9 * k)).map(|i| (i * 7 + k * 3) % 512).collect()).collect();
    let together = serve(&mut exec, &prompts, 6, 512);
    for (k, p) in prompts.iter().enumerate() {
        exec.release(RequestId(k as u64));
        assert_eq!(serve(&mut exec, std::slice::from_ref(p), 6, 512)[0], together[k], "sequence {k}");
        exec.release(RequestId(0));
    }
    let mut o = StepOutput::default();
    let err = exec.execute(&engine::Batch::default(), &mut o);
    assert!(err.is_ok());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Serves `prompts` together (steps of up to `max_batch_tokens`) to `output` tokens with the
/// executor's current settings; returns each request's output and captured logits rows.
fn serve_capturing(
    exec: &mut CudaExecutor,
    prompts: &[Vec<u32>],
    output: u32,
    max_batch_tokens: u32,
) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let outs = serve(exec, prompts, output, max_batch_tokens);
    (0..prompts.len())
        .map(|i| {
            let id = RequestId(i as u64);
            let rows = exec.captured_logits(id).unwrap().to_vec();
            exec.release(id);
            (outs[i].clone(), rows)
        })
        .collect()
}

#[test]
fn graph_replayed_decode_gives_the_eager_logits_bit_for_bit() {
    if skip("graph_replayed_decode_gives_the_eager_logits_bit_for_bit") {
        return;
    }
    let (dir, mut exec) = tiny_executor("graphs");
    // Three sequences (a bucket of 4: one padding row) and one alone (a bucket of 1).
    let three: Vec<Vec<u32>> =
        (0..3).map(|k| (0..(30 + 11 * k)).map(|i| (i * 5 + k * 17 + 3) % 512).collect()).collect();
    let one = vec![(0..57).map(|i| (i * 29 + 7) % 512).collect::<Vec<u32>>()];
    for prompts in [&three, &one] {
        exec.set_decode_graphs(DecodeGraphs::On);
        let (_, replayed_before, _) = exec.graph_stats();
        let graphed = serve_capturing(&mut exec, prompts, 8, 512);
        let (_, replayed, failure) = exec.graph_stats();
        assert!(failure.is_none(), "graph capture failed: {failure:?}");
        assert!(replayed > replayed_before, "no decode step was replayed from a graph");
        exec.set_decode_graphs(DecodeGraphs::PaddedEager);
        let padded = serve_capturing(&mut exec, prompts, 8, 512);
        exec.set_decode_graphs(DecodeGraphs::Off);
        let eager = serve_capturing(&mut exec, prompts, 8, 512);
        for k in 0..prompts.len() {
            // Replay runs the very launches of the padded eager step: identical bits.
            assert_eq!(graphed[k], padded[k], "sequence {k}: graph replay differs from the same launches run eagerly");
            // Unpadded, the GEMMs have fewer rows and may round differently; tokens agree.
            assert_eq!(graphed[k].0, eager[k].0, "sequence {k}");
            for (a, b) in graphed[k].1.iter().zip(&eager[k].1) {
                assert!(rel_err(a, b) < 1e-2, "sequence {k}: graph vs unpadded eager {}", rel_err(a, b));
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn split_attention_matches_the_reference_kernel() {
    if skip("split_attention_matches_the_reference_kernel") {
        return;
    }
    let (dir, mut exec) = tiny_executor("split");
    // Contexts from a few keys to several hundred: one split, many splits, partial tiles; the
    // longest prompt takes three steps, beside the others' decodes (mixed steps).
    let prompts: Vec<Vec<u32>> = [5usize, 33, 130, 400, 1100]
        .iter()
        .map(|&n| (0..n as u32).map(|i| (i * 41 + n as u32) % 512).collect())
        .collect();
    exec.set_attention(Attention::Split);
    let split = serve_capturing(&mut exec, &prompts, 6, 512);
    exec.set_attention(Attention::Reference);
    let reference = serve_capturing(&mut exec, &prompts, 6, 512);
    assert_eq!(compare_outputs("split", &split, &reference), 0, "split vs reference attention: tokens differ");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The fused GEMV path of steps of up to 4 tokens (norm, RoPE and KV write, SiLU-mul and the
/// residual adds inside the projections) against cuBLAS and the separate kernels: one request
/// alone (steps of 1 row), three together (bucket 4: a padding row), and prompts of 3 tokens
/// and of 1 whose prefill itself takes the GEMV path (and the tiled attention kernel); also
/// bit for bit between graph replay and the same launches run eagerly on the GEMV path.
#[test]
fn the_gemv_path_of_small_steps_matches_cublas_and_the_separate_kernels() {
    if skip("the_gemv_path_of_small_steps_matches_cublas_and_the_separate_kernels") {
        return;
    }
    let (dir, mut exec) = tiny_executor("gemv");
    let alone = vec![(0..45).map(|i| (i * 19 + 2) % 512).collect::<Vec<u32>>()];
    let three: Vec<Vec<u32>> =
        (0..3).map(|k| (0..(20 + 13 * k)).map(|i| (i * 11 + k * 7 + 1) % 512).collect()).collect();
    // Prompts whose prefill step has 3 tokens and 1 token (the GEMV path, prefill attention).
    let (short, single) = (vec![vec![7, 300, 41]], vec![vec![123]]);
    for prompts in [&alone, &three, &short, &single] {
        exec.set_small_step_rows(SMALL_STEP_ROWS);
        exec.set_decode_graphs(DecodeGraphs::On);
        let gemv = serve_capturing(&mut exec, prompts, 8, 512);
        exec.set_decode_graphs(DecodeGraphs::PaddedEager);
        let padded = serve_capturing(&mut exec, prompts, 8, 512);
        assert_eq!(gemv, padded, "graph replay of the GEMV path differs from its eager launches");
        exec.set_small_step_rows(0);
        exec.set_decode_graphs(DecodeGraphs::On);
        let cublas = serve_capturing(&mut exec, prompts, 8, 512);
        assert_eq!(compare_outputs("gemv", &gemv, &cublas), 0, "GEMV vs cuBLAS path: tokens differ");
    }
    let (_, _, failure) = exec.graph_stats();
    assert!(failure.is_none(), "graph capture failed: {failure:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Logits within bf16 rounding of the reference's, request by request, up to and including
/// the first token that differs (after it the two runs decode different sequences); returns
/// how many requests' tokens differ. Kernels that round differently can flip a near-tie: the
/// flipped row's logits are still compared, so a flip from a real error fails here.
fn compare_outputs(what: &str, got: &[(Vec<u32>, Vec<Vec<f32>>)], reference: &[(Vec<u32>, Vec<Vec<f32>>)]) -> usize {
    let mut differ = 0;
    for (k, (s, r)) in got.iter().zip(reference).enumerate() {
        let same = s.0.iter().zip(&r.0).take_while(|(a, b)| a == b).count();
        differ += usize::from(same < s.0.len().max(r.0.len()));
        let mut worst = 0.0f64;
        for (a, b) in s.1.iter().zip(&r.1).take(same + 1) {
            worst = worst.max(rel_err(a, b));
        }
        eprintln!("{what}: sequence {k}: tokens equal for {same} of {}, logits rel err {worst:.2e}", r.0.len());
        assert!(worst < 1e-2, "sequence {k}: {what} vs the reference: logits rel err {worst}");
    }
    differ
}

#[test]
fn tiled_prefill_attention_matches_the_reference_kernel_in_mixed_steps() {
    if skip("tiled_prefill_attention_matches_the_reference_kernel_in_mixed_steps") {
        return;
    }
    let (dir, mut exec) = tiny_executor("tiled");
    // Steps of at most 100 tokens: prompts of 1 to 15 tokens (tiles mostly empty), one and a
    // half tiles, and long prompts chunked over their own earlier chunks, side by side with
    // the short prompts' decodes and each other's chunks.
    let prompts: Vec<Vec<u32>> = [1usize, 7, 15, 16, 17, 65, 230, 700]
        .iter()
        .map(|&n| (0..n as u32).map(|i| (i * 29 + 3 * n as u32) % 512).collect())
        .collect();
    exec.set_attention(Attention::Tiled);
    let tiled = serve_capturing(&mut exec, &prompts, 5, 100);
    exec.set_attention(Attention::Reference);
    let reference = serve_capturing(&mut exec, &prompts, 5, 100);
    compare_outputs("tiled", &tiled, &reference);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `prefill_attention_tc` against `paged_attention` on random queries and caches, for
/// head_dim 64 and 128: one step of two leading decodes (not the tiled kernel's: their rows
/// must stay untouched) and then prompt chunks of every kind: cold and over cached prefixes
/// (block-aligned or not), tiny ones, exact and partial tiles, a decode after a chunk, with
/// every sequence's blocks scattered over the pool.
#[test]
#[allow(unsafe_code)] // Two kernel launches with buffers sized for their grids.
fn the_tensor_core_prefill_kernel_matches_the_reference_kernel() {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    use engine::batch::{Batch, BatchEntry};
    use engine::ids::{mix64, BlockId};
    if skip("the_tensor_core_prefill_kernel_matches_the_reference_kernel") {
        return;
    }
    let gpu = Gpu::open(0).unwrap();
    let bs = 16usize;
    // (cached context, new tokens, prefill?)
    let entries: [(usize, usize, bool); 14] = [
        (300, 1, false),
        (17, 1, false),
        (0, 200, true),
        (37, 64, true),
        (64, 130, true),
        (1000, 77, true),
        (5, 15, true),
        (9, 1, false),
        (0, 1, true),
        (0, 64, true),
        (3, 17, true),
        (130, 3, true),
        (0, 700, true),
        (63, 1, true),
    ];
    let blocks: Vec<usize> = entries.iter().map(|&(c, n, _)| (c + n).div_ceil(bs)).collect();
    let num_blocks: usize = blocks.iter().sum::<usize>() + 3;
    // A fixed shuffle of the pool's blocks over the sequences.
    let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, (mix64(i as u64) % (i as u64 + 1)) as usize);
    }
    let mut batch = Batch::default();
    let mut next = 0;
    for (i, (&(ctx, new, prefill), &nb)) in entries.iter().zip(&blocks).enumerate() {
        let start = batch.block_tables.len() as u32;
        batch.block_tables.extend(pool[next..next + nb].iter().map(|&b| BlockId(b)));
        next += nb;
        let mut e = BatchEntry::new(RequestId(i as u64), ctx as u32, new as u32, prefill);
        e.blocks = (start, batch.block_tables.len() as u32);
        batch.entries.push(e);
    }
    let seqs: Vec<Vec<u32>> = entries.iter().map(|&(c, n, _)| vec![0; c + n]).collect();
    let layout = StepLayout::build(&batch, bs as u32, num_blocks as u32, |id| Some(&seqs[id.0 as usize][..])).unwrap();
    assert_eq!(layout.leading_decodes, 2);
    let t = layout.tokens();
    let tiles = layout.prefill_tiles.len() / 2;
    // Random bf16 in [-amp, amp).
    let random = |n: usize, salt: u64, amp: f32| -> Vec<u16> {
        (0..n as u64)
            .map(|i| {
                let u = (mix64(i ^ (salt << 40)) >> 40) as f32 / (1u64 << 24) as f32;
                half::bf16::from_f32(amp * (2.0 * u - 1.0)).to_bits()
            })
            .collect()
    };
    for (head_dim, n_kv, group) in [(64usize, 2usize, 2usize), (128, 2, 4)] {
        let n_heads = n_kv * group;
        let kernels =
            kernels::Kernels::load(&gpu.ctx, &gpu.arch, KernelShape { head_dim, block_size: bs, group }).unwrap();
        let tc = kernels.prefill_attention_tc.as_ref().expect("built for head_dim <= 128");
        let qkv_dim = (n_heads + 2 * n_kv) * head_dim;
        let cache_elems = num_blocks * bs * n_kv * head_dim;
        let up = |host: &[u16], what: &str| {
            let mut d = gpu.zeros::<u16>(host.len(), what).unwrap();
            gpu.upload(host, &mut d, what).unwrap();
            d
        };
        let up_i32 = |host: &[i32], what: &str| {
            let mut d = gpu.zeros::<i32>(host.len().max(1), what).unwrap();
            gpu.upload(host, &mut d, what).unwrap();
            d
        };
        // Queries up to ±3 so that some rows' softmax is peaked.
        let qkv = up(&random(t * qkv_dim, 1, 3.0), "qkv");
        let k_cache = up(&random(cache_elems, 2, 1.0), "k cache");
        let v_cache = up(&random(cache_elems, 3, 1.0), "v cache");
        let pos = up_i32(&layout.positions, "positions");
        let tok_seq = up_i32(&layout.tok_seq, "token sequences");
        let table_start = up_i32(&layout.table_start, "table starts");
        let tables = up_i32(&layout.block_tables, "block tables");
        let tile_buf = up_i32(&layout.prefill_tiles, "tiles");
        // Outputs start as NaN bit patterns: a row the kernel should write and did not shows.
        let nan = vec![0xffffu16; t * n_heads * head_dim];
        let mut want = up(&nan, "reference output");
        let mut got = up(&nan, "tiled output");
        let (nh, nkv, scale) = (n_heads as i32, n_kv as i32, 1.0f32 / (head_dim as f32).sqrt());
        let reference =
            LaunchConfig { grid_dim: (t as u32, n_heads as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        let mut b = gpu.stream.launch_builder(&kernels.paged_attention);
        b.arg(&qkv).arg(&k_cache).arg(&v_cache).arg(&pos).arg(&tok_seq).arg(&table_start).arg(&tables);
        b.arg(&mut want).arg(&nh).arg(&nkv).arg(&scale);
        unsafe { b.launch(reference) }.unwrap();
        let tiled =
            LaunchConfig { grid_dim: (n_heads as u32, tiles as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        let mut b = gpu.stream.launch_builder(tc);
        b.arg(&qkv).arg(&k_cache).arg(&v_cache).arg(&pos).arg(&tok_seq).arg(&table_start).arg(&tables);
        b.arg(&tile_buf).arg(&mut got).arg(&nh).arg(&nkv).arg(&scale);
        unsafe { b.launch(tiled) }.unwrap();
        let (mut w, mut g) = (nan.clone(), nan.clone());
        gpu.download(&want, &mut w, "reference output").unwrap();
        gpu.download(&got, &mut g, "tiled output").unwrap();
        let row = n_heads * head_dim;
        let widen = |x: &[u16]| x.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect::<Vec<f32>>();
        for tok in 0..t {
            let (a, r) = (widen(&g[tok * row..(tok + 1) * row]), widen(&w[tok * row..(tok + 1) * row]));
            if tok < layout.leading_decodes {
                assert!(
                    g[tok * row..(tok + 1) * row].iter().all(|&x| x == 0xffff),
                    "head_dim {head_dim}: decode row {tok} written"
                );
                continue;
            }
            let e = rel_err(&a, &r);
            assert!(
                e < 1e-2,
                "head_dim {head_dim}: token {tok} (position {}): relative error {e}",
                layout.positions[tok]
            );
        }
    }
}

/// `sample_rows` on the GPU draws what the host rule ([`sample_with`]) draws for the same
/// uniform numbers: rows of one logit vector with stratified draws `(k + ½) / n`, plain
/// temperature sampling and a top-p nucleus; a greedy row is left as it was.
#[test]
#[allow(unsafe_code)] // One kernel launch with buffers sized for its arguments.
fn the_sampling_kernel_draws_as_the_host_rule() {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    if skip("the_sampling_kernel_draws_as_the_host_rule") {
        return;
    }
    let gpu = Gpu::open(0).unwrap();
    let kernels =
        kernels::Kernels::load(&gpu.ctx, &gpu.arch, KernelShape { head_dim: 64, block_size: 16, group: 2 }).unwrap();
    let vocab = 5003usize;
    // Logits that bf16 holds exactly, with a few ties.
    let row: Vec<f32> =
        (0..vocab).map(|i| half::bf16::from_f32(4.0 * ((i % 4001) as f32 * 0.37).sin()).to_f32()).collect();
    let bits: Vec<u16> = row.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
    let n = 512usize;
    for (temperature, top_p) in [(0.8f32, 1.0f32), (1.0, 0.9), (0.5, 0.5)] {
        let s = Sampling { temperature, top_p, seed: 0 };
        let mut logits = gpu.zeros::<u16>((n + 1) * vocab, "logits").unwrap();
        let host: Vec<u16> = (0..=n).flat_map(|_| bits.iter().copied()).collect();
        gpu.upload(&host, &mut logits, "logits").unwrap();
        let u: Vec<f32> = (0..n).map(|k| (k as f32 + 0.5) / n as f32).collect();
        let mut params: Vec<f32> = u.iter().flat_map(|&u| [temperature, top_p, u]).collect();
        params.extend([0.0, 1.0, 0.5]); // a greedy row: left alone
        let mut p = gpu.zeros::<f32>(params.len(), "params").unwrap();
        gpu.upload(&params, &mut p, "params").unwrap();
        let mut out = gpu.zeros::<u32>(n + 1, "out").unwrap();
        gpu.upload(&vec![u32::MAX; n + 1], &mut out, "out").unwrap();
        let v = vocab as i32;
        let cfg = LaunchConfig { grid_dim: ((n + 1) as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let mut b = gpu.stream.launch_builder(&kernels.sample_rows);
        b.arg(&logits).arg(&v).arg(&p).arg(&mut out);
        unsafe { b.launch(cfg) }.unwrap();
        let mut got = vec![0u32; n + 1];
        gpu.download(&out, &mut got, "out").unwrap();
        assert_eq!(got[n], u32::MAX, "the greedy row was written");
        let want: Vec<u32> = u.iter().map(|&u| sample_with(&row, &s, u)).collect();
        // f32 sums on the GPU against f64 on the host may part at a cumulative boundary.
        let differ = (0..n).filter(|&k| got[k] != want[k]).count();
        assert!(differ <= 2, "T {temperature} top-p {top_p}: {differ} of {n} draws differ");
        let distinct = got[..n].iter().collect::<std::collections::BTreeSet<_>>().len();
        assert!(distinct > 20, "draws spread over the distribution: {distinct}");
    }
}

/// Steps `inst` over `exec` until it has nothing to run; returns the time it went idle.
fn run_idle(inst: &mut Instance, exec: &mut CudaExecutor, mut now: Time) -> Time {
    let (mut fin, mut ev) = (Vec::new(), Vec::new());
    while inst.has_work() {
        let d = inst.begin_step(now, exec).unwrap().expect("work to do");
        now += d + engine::Dur(1);
        inst.end_step(now, &mut fin, &mut ev);
        // The engine checks itself only in its own tests (or with its `invariants` feature).
        inst.check_invariants();
    }
    assert!(ev.is_empty(), "nothing is evicted");
    now
}

fn request(id: u64, prompt: &[u32], output: u32, block_size: u32) -> Request {
    Request {
        id: RequestId(id),
        arrival: Time::ZERO,
        prompt_tokens: prompt.len() as u32,
        max_output_tokens: output,
        ends_after: None,
        block_hashes: block_hashes(prompt, block_size),
        resume: None,
        service: Default::default(),
        model: Default::default(),
    }
}

/// P/D between two executors of one model: requests prefilled on one (a prefix-cache hit
/// among them), their KV exported through host memory and imported into blocks the other's
/// instance reserved, decode there to exactly the tokens one executor serving them alone
/// gives: greedy and sampled, in hand-offs of several chunks. A payload exported again from
/// the receiver is the same bytes; a mismatched payload is refused before anything is written.
#[test]
fn a_request_handed_off_between_executors_decodes_as_on_one() {
    if skip("a_request_handed_off_between_executors_decodes_as_on_one") {
        return;
    }
    let (dir, mut one) = tiny_executor("handoff");
    let mut cfg = CudaExecutorConfig::new(ModelSource::Dir(dir.clone()));
    cfg.gpu_memory_bytes = Some(2 << 30);
    cfg.max_batch_tokens = 512;
    cfg.max_seqs = 8;
    let mut two = CudaExecutor::new(cfg).unwrap();
    one.set_staging_tokens(7);
    two.set_staging_tokens(5);
    let bs = one.block_size();
    let a: Vec<u32> = (0..100).map(|i| (i * 37 + 11) % 512).collect();
    let c: Vec<u32> = (0..37).map(|i| (i * 13 + 5) % 512).collect();
    // b shares a's first 64 tokens (4 full blocks): a prefix-cache hit where a was prefilled.
    let b: Vec<u32> = a[..64].iter().copied().chain((0..40).map(|i| (i * 7 + 300) % 512)).collect();
    let sampled = Sampling { temperature: 0.8, top_p: 0.9, seed: 5 };
    // Two rounds: a and c together, then b alone.
    let rounds: [Vec<(u64, &[u32], Sampling)>; 2] =
        [vec![(1, &a, Sampling::GREEDY), (2, &c, sampled)], vec![(3, &b, Sampling::GREEDY)]];
    let output = 8;

    // One executor doing everything, the rounds in turn on one instance.
    let mut alone = Instance::new(one.instance_config());
    let mut now = Time::ZERO;
    let mut want = std::collections::BTreeMap::new();
    for round in &rounds {
        for &(id, prompt, s) in round {
            one.set_request(RequestId(id), prompt.to_vec(), s);
            alone.enqueue(now, request(id, prompt, output, bs)).unwrap();
        }
        now = run_idle(&mut alone, &mut one, now);
        for &(id, _, _) in round {
            want.insert(id, one.release(RequestId(id)).unwrap());
        }
    }
    assert!(want.values().all(|t| t.len() == output as usize));

    // Prefill on `one`, decode on `two`.
    let mut p = Instance::new(one.instance_config());
    let mut d = Instance::new(two.instance_config());
    for round in &rounds {
        for &(id, prompt, s) in round {
            one.set_request(RequestId(id), prompt.to_vec(), s);
            p.enqueue_prefill_only(now, request(id, prompt, output, bs)).unwrap();
        }
        now = run_idle(&mut p, &mut one, now);
        let mut handoffs = Vec::new();
        p.take_handoffs(&mut handoffs);
        assert_eq!(handoffs.len(), round.len());
        for h in handoffs {
            let id = h.request.id;
            let &(_, prompt, s) = round.iter().find(|r| r.0 == id.0).unwrap();
            if id.0 == 3 {
                let cached = h.request.resume.as_deref().map_or(0, |r| r.cached_tokens[0]);
                assert_eq!(cached, 64, "b found a's prefix cached on the prefill side");
            }
            let payload = one.export_kv(p.parked_blocks(id).unwrap(), h.kv_tokens).unwrap();
            assert_eq!(payload.len(), 32 + h.kv_tokens as usize * one.kv_shape().token_bytes());
            // The body is the pool's rows in the documented order.
            let (k, v, layer_elems) = one.kv_to_host().unwrap();
            let table: Vec<u32> = p.parked_blocks(id).unwrap().iter().map(|b| b.0).collect();
            let host = transfer::gather_host(&one.kv_shape(), &k, &v, layer_elems, &table, bs, h.kv_tokens);
            assert!(payload[32..] == host[..], "{id}: the gather kernel's body differs from the host layout");
            let generated = one.release(id).unwrap();
            assert_eq!(generated.len(), 1, "the prefill samples the first token");
            d.receive_transfer(now, h.request.clone()).unwrap();
            let blocks = d.parked_blocks(id).unwrap().to_vec();
            // Refused before anything is written: another model's shape, a wrong length.
            let shape = transfer::KvShape { layers: 3, ..one.kv_shape() };
            let header = transfer::KvHeader { shape, block_size: bs, tokens: h.kv_tokens };
            let mut other = Vec::new();
            header.encode(&mut other);
            other.resize(header.payload_bytes(), 0);
            let err = two.import_request(id, prompt.to_vec(), &generated, s, &blocks, &other).unwrap_err();
            assert!(err.to_string().contains("layer count is 3, this model's is 2"), "{err}");
            let err = two.import_request(id, prompt[1..].to_vec(), &generated, s, &blocks, &payload).unwrap_err();
            assert!(err.to_string().contains("needs the KV of"), "{err}");
            assert!(two.tokens(id).is_none(), "a refused import registers nothing");
            two.import_request(id, prompt.to_vec(), &generated, s, &blocks, &payload).unwrap();
            assert_eq!(two.export_kv(&blocks, h.kv_tokens).unwrap(), payload, "{id}: the KV landed bit for bit");
            assert!(d.finish_transfer(now, id));
            assert!(p.release_handoff(now, id));
        }
        now = run_idle(&mut d, &mut two, now);
        for &(id, prompt, _) in round {
            // The first token came from `one`, the other seven from `two`.
            let got = two.release(RequestId(id)).unwrap();
            assert_eq!(got, want[&id], "request {id} ({} prompt tokens): P/D against one executor", prompt.len());
        }
    }
    assert_eq!((p.kv().used_blocks(), d.kv().used_blocks()), (0, 0));
    assert_eq!(p.in_flight() + d.in_flight(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}
