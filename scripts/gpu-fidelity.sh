#!/usr/bin/env bash
# Calibration and fidelity of the simulator against the CUDA engine, in one go, on a machine
# with NVIDIA GPUs (the lent H200s):
#   1. `fleetplane profile`: the engine's step times over batch shapes (GPU 0 alone);
#   2. the live fleet: PostgreSQL (unpacked from $BIN/pg.tar.xz, see scripts/pg-bundle.sh),
#      `fleetplane serve`, one CUDA engine process per GPU, and `fleetplane replay` of the
#      scenario's trace slice through the gateway;
#   3. `fleetplane latency`: what the live path adds to a request beyond the engine's step
#      (isolated requests of the profile's lone prompt lengths), the simulation's dispatch_ms;
#   4. `fleetplane simulate` of the same scenario with the profile and that dispatch latency.
# Each engine logs the steps it served ($OUT/steps-N.json, a step profile): the cost model
# can be checked against what the engines did under the replay, shape by shape.
# Binaries come from $BIN (default gpu-out/, built by scripts/gpu-build.sh); results go to
# $OUT (default ./gpu-results). The scenario is examples/cuda-fidelity.toml unless $SCENARIO.
# MAX_REQUESTS=N replays only the first N requests (SKIP_REQUESTS=K: requests K..K+N); RATE_SCALE=X scales the arrival rate in both
# (e.g. 0.5 on a machine with one GPU: one engine for a scenario sized for two). DRY_RUN=1 checks the script on a machine without a GPU: two engines with the cost-model
# executor, no profile, the local PostgreSQL left alone if one answers on port 5432.
# ENGINES_PER_GPU=N starts N engines on each GPU (each given GPU_MEMORY_GIB; they share its
# time) and simulates them so (--instances-per-gpu; GPU_SHARE_EFFICIENCY=X passes
# --gpu-share-efficiency). PROFILE=FILE on a GPU machine
# skips the profiling step and calibrates on FILE.
# CALIBRATION_SKIP=K (with MAX_REQUESTS=N, one engine per GPU) first replays requests K..K+N
# through the same fleet, keeps the steps the engines served then ($OUT/calibration-steps.json)
# and simulates the validation slice on them too ($OUT/sim-steps.json): the cost model
# calibrated on served traffic it is not checked against.
set -uo pipefail
BIN=$(realpath "${BIN:-gpu-out}")
OUT=$(realpath -m "${OUT:-gpu-results}")
SCENARIO=${SCENARIO:-examples/cuda-fidelity.toml}
KV_BLOCKS=${KV_BLOCKS:-20000}
GPU_MEMORY_GIB=${GPU_MEMORY_GIB:-70}
mkdir -p "$OUT"
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT

step "machine"
date -u
if [[ ${DRY_RUN:-0} == 1 ]]; then
  gpus=2
  # With PROFILE=FILE the engines' cost model is calibrated on it, as the simulation's is.
  engine_model=(--executor sim --model llama-3.1-8b --gpu h200 ${PROFILE:+--profile "$PROFILE"})
  profile=(${PROFILE:+--profile "$PROFILE"})
  profile_file=${PROFILE:-}
else
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  gpus=$(nvidia-smi -L | wc -l)
  engine_model=(--executor cuda --model random:llama-8b --served-model-name llama-3.1-8b --gpu-memory-gib "$GPU_MEMORY_GIB")
  profile_file=${PROFILE:-$OUT/profile.json}
  profile=(--profile "$profile_file")
  if [[ -z ${PROFILE:-} ]]; then
    step "profile (GPU 0)"
    "$BIN/fleetplane" profile --model random:llama-8b --gpu-memory-gib "$GPU_MEMORY_GIB" --out "$OUT/profile.json" \
      | tee "$OUT/profile.txt" || exit 1
  fi
fi
per_gpu=${ENGINES_PER_GPU:-1}
engines=$((gpus * per_gpu))

step "PostgreSQL"
if [[ ${DRY_RUN:-0} == 1 ]] && pg_isready -h 127.0.0.1 -p 5432 -q; then
  echo "using the local PostgreSQL"
else
  "$(dirname "$0")/gpu-postgres.sh" "$BIN/pg.tar.xz" || exit 1
fi

step "serve and $engines engines on $gpus GPUs"
export FLEETPLANE_ADMIN_TOKEN=fidelity-admin FLEETPLANE_ENGINE_TOKEN=fidelity-engine
export DATABASE_URL=postgres://postgres@127.0.0.1:5432/fleetplane_fidelity_$(date +%s)
slice=()
[[ -n ${MAX_REQUESTS:-} ]] && slice=(--max-requests "$MAX_REQUESTS")
[[ -n ${SKIP_REQUESTS:-} ]] && slice+=(--skip-requests "$SKIP_REQUESTS")
[[ -n ${RATE_SCALE:-} ]] && slice+=(--rate-scale "$RATE_SCALE")
router=$(python3 -c "import tomllib,sys; print(tomllib.load(open(sys.argv[1],'rb'))['routers'][0])" "$SCENARIO")
"$BIN/fleetplane" serve --router "$router" >"$OUT/serve.log" 2>&1 &
pids+=($!)
sleep 2
for ((e = 0; e < engines; e++)); do
  "$BIN/fleetplane" engine "${engine_model[@]}" --device $((e / per_gpu)) --kv-blocks "$KV_BLOCKS" \
    --control 127.0.0.1:50051 --step-log "$OUT/steps-$e.json" \
    >"/tmp/engine-$e.log" 2>&1 &
  pids+=($!)
  # Engines sharing a GPU start one after the other (each sizes its KV from the free memory).
  ((per_gpu > 1)) && sleep 20
done
for _ in $(seq 120); do
  n=$(python3 - <<'PY' 2>/dev/null
import json, os, urllib.request
req = urllib.request.Request("http://127.0.0.1:8080/api/instances",
                             headers={"Authorization": "Bearer " + os.environ["FLEETPLANE_ADMIN_TOKEN"]})
print(sum(1 for i in json.load(urllib.request.urlopen(req))["instances"] if i["state"] == "serving"))
PY
)
  [[ ${n:-0} -ge $engines ]] && break
  sleep 1
done
echo "engines serving: ${n:-0} of $engines"
[[ ${n:-0} -ge $engines ]] || { tail -20 /tmp/engine-*.log "$OUT/serve.log"; exit 1; }

dispatch=()
if [[ -n $profile_file ]]; then
  step "latency of the live path (isolated requests)"
  "$BIN/fleetplane" latency --profile "$profile_file" --served-model llama-3.1-8b --json "$OUT/latency.json" \
    | tee "$OUT/latency.txt" || exit 1
  dispatch=(--dispatch-ms "$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['dispatch_ms'])" "$OUT/latency.json")")
fi

calibration=()
if [[ -n ${CALIBRATION_SKIP:-} ]]; then
  [[ -n ${MAX_REQUESTS:-} && $per_gpu == 1 ]] || { echo "CALIBRATION_SKIP needs MAX_REQUESTS and one engine per GPU"; exit 1; }
  step "calibration replay (requests $CALIBRATION_SKIP.. of the trace)"
  calibration_slice=(--max-requests "$MAX_REQUESTS" --skip-requests "$CALIBRATION_SKIP" ${RATE_SCALE:+--rate-scale "$RATE_SCALE"})
  "$BIN/fleetplane" replay --scenario "$SCENARIO" "${calibration_slice[@]}" --gateway http://127.0.0.1:8080 \
    --json "$OUT/calibration-live.json" | tee "$OUT/calibration-live.txt" || exit 1
  sleep 3 # the engines hand their steps to their logs when idle
  # One profile of every engine's steps so far (the same model and GPU).
  python3 - "$OUT/calibration-steps.json" "$OUT"/steps-*.json <<'PY' || exit 1
import json, sys
logs = [json.load(open(p)) for p in sys.argv[2:]]
merged = dict(logs[0], samples=[s for log in logs for s in log["samples"]],
              source=logs[0]["source"] + f" (+{len(logs) - 1} more engines), calibration slice")
json.dump(merged, open(sys.argv[1], "w"))
print(f"{len(merged['samples'])} steps kept for calibration")
PY
  calibration=(--profile "$OUT/calibration-steps.json")
fi

step "replay through the gateway"
"$BIN/fleetplane" replay --scenario "$SCENARIO" "${slice[@]}" --gateway http://127.0.0.1:8080 --json "$OUT/live.json" \
  | tee "$OUT/live.txt" || exit 1

step "simulate with the profile"
"$BIN/fleetplane" simulate --scenario "$SCENARIO" "${slice[@]}" --instances "$engines" --instances-per-gpu "$per_gpu" \
  --gpu-share-efficiency "${GPU_SHARE_EFFICIENCY:-1}" --kv-blocks "$KV_BLOCKS" \
  "${profile[@]}" "${dispatch[@]}" --json "$OUT/sim.json" | tee "$OUT/sim.txt" || exit 1
if ((${#calibration[@]})); then
  step "simulate with the calibration slice's steps"
  "$BIN/fleetplane" simulate --scenario "$SCENARIO" "${slice[@]}" --instances "$engines" --kv-blocks "$KV_BLOCKS" \
    "${calibration[@]}" "${dispatch[@]}" --json "$OUT/sim-steps.json" | tee "$OUT/sim-steps.txt" || exit 1
fi
step "engine step timing (executor vs whole iteration)"
grep -h "step timing" /tmp/engine-*.log | tail -8
tail -3 /tmp/engine-0.log
