#!/usr/bin/env bash
# Runs every GPU check of the CUDA engine in one go, on a machine with an NVIDIA GPU, the CUDA
# 13 libraries and python3 with torch + transformers (the lent H200 has them all).
#
# Binaries are built elsewhere (no CUDA needed to build) and found in $BIN (default gpu-out/):
#   engine-tests         the engine-cuda crate's lib test binary
#   cuda-check           engine-cuda/examples/cuda_check.rs
#   fleetplane           the control binary (make-model, engine)
#   control-cuda-engine  control/tests/cuda_engine.rs (the engine process over gRPC)
#   pg.tar.xz            optional, scripts/pg-bundle.sh: PostgreSQL for the P/D engine test
#                        (fleetplane serve needs it; without it that test is skipped)
# Build them with scripts/gpu-build.sh. Results and logs go to $OUT (default ./gpu-results).
#
# Usage: scripts/gpu-check.sh [correctness|speed|all]   (default all)
set -uo pipefail
BIN=${BIN:-gpu-out}
OUT=${OUT:-gpu-results}
MODE=${1:-all}
mkdir -p "$OUT"
WORK=$(mktemp -d)
status=0
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
fail() { echo "FAIL: $*"; status=1; }

step "machine"
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

if [[ $MODE == correctness || $MODE == all ]]; then
  step "engine tests with the cuda feature (GPU tests run here)"
  "$BIN/engine-tests" --test-threads=1 cuda:: 2>&1 | tee "$OUT/engine-tests.log" | tail -30 || fail "engine tests"

  step "the engine process over gRPC, and P/D behind serve (control/tests/cuda_engine.rs)"
  if [[ -f $BIN/pg.tar.xz ]]; then
    "$(dirname "$0")/gpu-postgres.sh" "$BIN/pg.tar.xz" || fail "PostgreSQL"
  fi
  FLEETPLANE_BIN="$BIN/fleetplane" "$BIN/control-cuda-engine" --nocapture 2>&1 | tee "$OUT/engine-process.log" | tail -15 \
    || fail "engine process test"

  for cfg in tiny llama-1b; do
    step "make-model $cfg"
    start=$(date +%s.%N)
    "$BIN/fleetplane" make-model --config "$cfg" --out "$WORK/$cfg" || fail "make-model $cfg"
    python3 -c "import time; print('make-model $cfg: %.1f s' % (time.time() - $start))"
    step "logits and greedy generation vs transformers: $cfg"
    "$BIN/cuda-check" logits "$WORK/$cfg" "$WORK/$cfg-run" 100 40 || fail "cuda-check logits $cfg"
    PYTHONUNBUFFERED=1 python3 scripts/llama_reference.py "$WORK/$cfg" "$WORK/$cfg-run" 2>&1 | grep -v Warning \
      | tee -a "$OUT/reference.log" || fail "reference $cfg"
    step "chunked and prefix-cached prefill vs one shot, and vs the f32 reference: $cfg"
    "$BIN/cuda-check" chunked "$WORK/$cfg" "$WORK/$cfg-chunked" 2>&1 | tee "$WORK/chunked-$cfg.out" \
      | tee -a "$OUT/chunked.log" || fail "cuda-check chunked $cfg"
    PYTHONUNBUFFERED=1 python3 scripts/llama_reference.py chunked "$WORK/$cfg" "$WORK/$cfg-chunked" 2>&1 \
      | grep -v Warning | tee -a "$OUT/chunked.log"
    f32_ok=${PIPESTATUS[0]}
    # Either verdict passes: the one-shot bar (bit-identical chunking, as on tiny) or the f32 one.
    if ! grep -q "vs one-shot.*PASS" "$WORK/chunked-$cfg.out" && [[ $f32_ok != 0 ]]; then fail "chunked $cfg"; fi
    step "CUDA-graph decode vs eager: $cfg"
    "$BIN/cuda-check" graphs "$WORK/$cfg" 2>&1 | tee -a "$OUT/graphs.log" || fail "graphs $cfg"
    rm -rf "$WORK/$cfg"
  done
fi

if [[ $MODE == speed || $MODE == all ]]; then
  step "speed: llama-8b shape, random weights"
  "$BIN/cuda-check" bench llama-8b 2>&1 | tee "$OUT/bench.log" || fail "bench"
fi

rm -rf "$WORK"
step "summary"
grep -h -E "PASS|FAIL|test result|skipped|cuda engine:" "$OUT"/*.log 2>/dev/null
exit $status
