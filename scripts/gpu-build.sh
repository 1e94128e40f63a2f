#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs, on a machine without CUDA (cudarc loads the CUDA
# libraries at run time), into gpu-out/ (ignored by git; carry it to the GPU machine).
# GPU_OUT overrides the output folder (e.g. to build from a clean copy of the tree and put
# the binaries into the checkout that travels). Binaries are stripped: the carried tree has
# a size limit and the line tables are not needed there.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
GPU_OUT=${GPU_OUT:-gpu-out}
mkdir -p "$GPU_OUT"
# The test executable a `cargo test --no-run` builds for target kind $1 (and name $2).
test_exe() {
  python3 -c 'import json,sys
kind, name = sys.argv[1], sys.argv[2]
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == [kind] \
            and (not name or m["target"]["name"] == name):
        print(m["executable"])' "$1" "${2:-}" | tail -1
}
tests=$(cargo test --release -p engine-cuda --lib --no-run --message-format=json 2>/dev/null | test_exe lib)
cp "$tests" "$GPU_OUT/engine-tests"
cargo build --release -p engine-cuda --example cuda-check
cp "$CARGO_TARGET_DIR/release/examples/cuda-check" "$GPU_OUT/"
cargo build --release -p control --bin fleetplane
cp "$CARGO_TARGET_DIR/release/fleetplane" "$GPU_OUT/"
engine_test=$(cargo test --release -p control --test cuda_engine --no-run --message-format=json 2>/dev/null \
  | test_exe test cuda_engine)
cp "$engine_test" "$GPU_OUT/control-cuda-engine"
strip "$GPU_OUT"/* 2>/dev/null || true
ls -la "$GPU_OUT"
