#!/usr/bin/env python3
"""transformers' speed on the shapes `cuda-check bench llama-8b` measures, for a side-by-side
table in one GPU session (docs/BENCHMARKS.md).

Usage: transformers_speed.py [--compile] [--prefill-only]

LlamaForCausalLM in the Llama 3.1 8B shape with random bf16 weights made on the GPU (no
download). Decode: tokens/s at batch 1, 16, 64 (256 where memory allows) after a 128- or
4096-token context, greedy, one token per sequence per step, timed over 16 steps after 3 warm
ones, with the dynamic cache (eager) and, with --compile, the static cache and
torch.compile (mode reduce-overhead). Prefill: one 2048- and one 8192-token prompt, median of
3 after a warm-up, eager and, with --compile, through torch.compile's default mode (no CUDA
graphs: a forward pass, not generate). --prefill-only skips the decode rows. Prints a
markdown table.
"""
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    max_position_embeddings=131072, tie_word_embeddings=False, torch_dtype="bfloat16")


def timed(fn, runs, warm):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def decode_rate(model, batch, ctx, static):
    steps = 16
    ids = torch.randint(0, 32000, (batch, ctx), device="cuda")
    kwargs = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    if static:
        kwargs["cache_implementation"] = "static"
    # Prefill plus `steps` decode steps, minus the prefill alone: the decode steps' time.
    whole = timed(lambda: model.generate(ids, **kwargs), runs=3, warm=1)
    first = timed(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False,
                                         **({"cache_implementation": "static"} if static else {})), runs=3, warm=1)
    per_step = (whole - first) / (steps - 1)
    return batch / per_step, per_step


def main():
    compile_too = "--compile" in sys.argv
    prefill_only = "--prefill-only" in sys.argv
    torch.manual_seed(0)
    cfg = LlamaConfig(**CONFIG)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    print("transformers", __import__("transformers").__version__, "torch", torch.__version__,
          torch.cuda.get_device_name())
    print("| phase | batch | context | mode | step ms | tokens/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    modes = [("eager, dynamic cache", False)]
    if compile_too and not prefill_only:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
        modes.append(("static cache + torch.compile", True))
    with torch.inference_mode():
        for mode, static in [] if prefill_only else modes:
            for ctx in (128, 4096):
                for batch in (1, 16, 64, 256):
                    try:
                        rate, step = decode_rate(model, batch, ctx, static)
                        print(f"| decode | {batch} | {ctx} | {mode} | {step * 1e3:.2f} | {rate:.0f} |", flush=True)
                    except torch.OutOfMemoryError:
                        torch.cuda.empty_cache()
                        print(f"| decode | {batch} | {ctx} | {mode} | out of memory | |", flush=True)
        forwards = [("eager", model)]
        if compile_too and prefill_only:
            forwards.append(("torch.compile", torch.compile(model)))
        for mode, fwd in forwards:
            for n in (2048, 8192):
                ids = torch.randint(0, 32000, (1, n), device="cuda")
                t = timed(lambda: fwd(ids, use_cache=False, logits_to_keep=1), runs=3, warm=1)
                print(f"| prefill | 1 | {n} | {mode} | {t * 1e3:.2f} | {n / t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
