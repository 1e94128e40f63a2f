#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs, on a machine without CUDA (cudarc loads the CUDA
# libraries at run time), into gpu-out/ (ignored by git; carry it to the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
mkdir -p gpu-out
tests=$(cargo test --release -p engine --features cuda --lib --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])' | tail -1)
cp "$tests" gpu-out/engine-tests
cargo build --release -p engine --features cuda --example cuda-check
cp "$CARGO_TARGET_DIR/release/examples/cuda-check" gpu-out/
cargo build --release -p control --bin fleetplane
cp "$CARGO_TARGET_DIR/release/fleetplane" gpu-out/
ls -la gpu-out
