#!/usr/bin/env bash
# fleetplane's simulator beside NVIDIA Dynamo's (the `dynamo-mocker` crate) on the same
# Mooncake trace and fleet, timed in alternating runs (docs/BENCHMARKS.md, "Side by side
# with NVIDIA's simulator").
#
#   scripts/dynamo-side-by-side.sh                 # builds both, 3 rounds
#   ROUNDS=5 FP_BIN=target/release/fleetplane DYN_BIN=/path/dynamo-side scripts/dynamo-side-by-side.sh
#
# Environment (all optional):
#   FP_BIN      a built `fleetplane`; else `cargo build --release -p control` (target dir
#               FP_TARGET, default ./target)
#   DYN_BIN     a built `dynamo-side` (bench/dynamo-side); else built with `cargo build
#               --release --locked` there (target dir DYN_TARGET, default bench/dynamo-side/target)
#   ROUNDS      rounds of the four cases, alternating (default 3)
#   KV_BLOCKS   KV blocks per worker for dynamo-mocker; default: fleetplane's own L1 capacity
#               for Llama-3.1-8B on one H100 with block size 16 (`fleetplane capacity`)
#   LIMIT_S     each run is killed after this many seconds (default 300); the script stops
#   OUT         where the logs go (default target/dynamo-side-by-side)
#   TIERED_REQUESTS  if set to N > 0, two more cases on the trace's first N requests: dynamo-mocker
#               with its host (G2) and cluster-shared (G3) KV tiers sized as the scenario's L2
#               and L3, against fleetplane cache-aware on L1+L2+L3 (dynamo-mocker's tiers are
#               slow: keep N small, e.g. 300)
#
# Cases, each timed with /usr/bin/time -f '%e %U %M':
#   dynamo-kv-router   dynamo-mocker, 8 workers, its KV router, block size 16, KV_BLOCKS,
#                      max_num_batched_tokens 8192, max_num_seqs 256 (Mooncake's 512-token hash blocks)
#   fp-dynamo-kv@l1    fleetplane simulate --scenario examples/mooncake-tiers.toml --router dynamo-kv@l1
#   fp-cache-aware     ... --router cache-aware (L1+L2+L3: the headline configuration)
#   fp-least-outstanding@l1  ... --router least-outstanding@l1
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
TRACE=traces/mooncake-conversation.jsonl # the trace examples/mooncake-tiers.toml replays
LIMIT_S=${LIMIT_S:-300}
OUT=${OUT:-target/dynamo-side-by-side}
SCENARIO=examples/mooncake-tiers.toml
WORKERS=8
BLOCK_SIZE=16
MAX_BATCHED_TOKENS=8192
MAX_NUM_SEQS=256
mkdir -p "$OUT"

if [[ ! -x /usr/bin/time ]]; then
    echo "needs /usr/bin/time (apt-get install time)" >&2
    exit 2
fi

if [[ -z "${FP_BIN:-}" ]]; then
    CARGO_TARGET_DIR=${FP_TARGET:-target} cargo build --release -p control >&2
    FP_BIN=${FP_TARGET:-target}/release/fleetplane
fi
if [[ -z "${DYN_BIN:-}" ]]; then
    DYN_TARGET=${DYN_TARGET:-$PWD/bench/dynamo-side/target}
    (cd bench/dynamo-side && CARGO_TARGET_DIR=$DYN_TARGET cargo build --release --locked >&2)
    DYN_BIN=$DYN_TARGET/release/dynamo-side
fi

if [[ -z "${KV_BLOCKS:-}" ]]; then
    # fleetplane's L1 for the scenario's model and GPU: its KV tokens per instance in blocks
    # of 16 (what `simulate` gives each instance when the scenario sets no kv_blocks).
    tokens=$("$FP_BIN" capacity --model llama-3.1-8b --gpu h100 --json /dev/stdout \
        | grep -o '"kv_capacity_tokens_per_instance": *[0-9]*' | grep -o '[0-9]*$')
    KV_BLOCKS=$((tokens / BLOCK_SIZE))
fi
[[ -n "$KV_BLOCKS" ]] || { echo "could not read the KV blocks per instance; set KV_BLOCKS" >&2; exit 2; }

CASES=(dynamo-kv-router fp-dynamo-kv@l1 fp-cache-aware fp-least-outstanding@l1)
TIERED_REQUESTS=${TIERED_REQUESTS:-0}
if ((TIERED_REQUESTS > 0)); then
    # The scenario's L2 and L3 in blocks, from the line `simulate` prints first.
    line=$("$FP_BIN" simulate --scenario "$SCENARIO" --router cache-aware --max-requests 1 | sed -n 1p)
    l2=$(grep -o 'L2 [0-9]* tokens' <<<"$line" | cut -d' ' -f2)
    l3=$(grep -o 'L3 [0-9]* tokens' <<<"$line" | cut -d' ' -f2)
    [[ -n "$l2" && -n "$l3" ]] || { echo "could not read L2/L3 from: $line" >&2; exit 2; }
    L2_BLOCKS=$((l2 / BLOCK_SIZE))
    L3_BLOCKS=$((l3 / BLOCK_SIZE))
    head -n "$TIERED_REQUESTS" "$TRACE" >"$OUT/trace-head.jsonl"
    CASES+=(dynamo-tiers-head fp-cache-aware-head)
fi

run_case() { # case round
    local case=$1 round=$2 log="$OUT/$1.$2.log" timing="$OUT/$1.$2.time"
    local cmd
    case $case in
        dynamo-kv-router)
            cmd=("$DYN_BIN" "$TRACE" --workers "$WORKERS" --router kv --block-size "$BLOCK_SIZE"
                --kv-blocks "$KV_BLOCKS" --max-batched-tokens "$MAX_BATCHED_TOKENS" --max-num-seqs "$MAX_NUM_SEQS"
                --trace-block-size 512) ;;
        dynamo-tiers-head)
            cmd=("$DYN_BIN" "$OUT/trace-head.jsonl" --workers "$WORKERS" --router kv --block-size "$BLOCK_SIZE"
                --kv-blocks "$KV_BLOCKS" --max-batched-tokens "$MAX_BATCHED_TOKENS" --max-num-seqs "$MAX_NUM_SEQS"
                --trace-block-size 512 --host-blocks "$L2_BLOCKS" --g3-blocks "$L3_BLOCKS") ;;
        fp-cache-aware-head)
            cmd=("$FP_BIN" simulate --scenario "$SCENARIO" --router cache-aware --max-requests "$TIERED_REQUESTS") ;;
        fp-*)
            cmd=("$FP_BIN" simulate --scenario "$SCENARIO" --router "${case#fp-}") ;;
    esac
    echo "round $round: $case: ${cmd[*]}" >&2
    if ! timeout "$LIMIT_S" /usr/bin/time -f '%e %U %M' -o "$timing" "${cmd[@]}" >"$log" 2>&1; then
        echo "$case failed or ran past ${LIMIT_S}s; log: $log" >&2
        tail -5 "$log" >&2
        exit 1
    fi
}

requests_of() { # case round
    local log="$OUT/$1.$2.log"
    case $1 in
        dynamo-*) grep -o 'SUMMARY.* requests=[0-9]*' "$log" | grep -o '[0-9]*$' ;;
        *) awk '$1 == "requests" { print $2; exit }' "$log" ;;
    esac
}

echo "$(date -u '+%F %T UTC'); load average before: $(cut -d' ' -f1-3 /proc/loadavg); KV blocks per worker: $KV_BLOCKS${L2_BLOCKS:+, G2 $L2_BLOCKS per worker, G3 $L3_BLOCKS}" | tee "$OUT/summary.txt"
for ((r = 1; r <= ROUNDS; r++)); do
    for c in "${CASES[@]}"; do
        run_case "$c" "$r"
    done
done
echo "$(date -u '+%F %T UTC'); load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/summary.txt"

{
    echo
    echo "| case | round | wall s | user s | peak RSS MiB | requests | simulated req/s |"
    echo "| --- | --- | --- | --- | --- | --- | --- |"
    for c in "${CASES[@]}"; do
        for ((r = 1; r <= ROUNDS; r++)); do
            read -r wall user rss <"$OUT/$c.$r.time"
            n=$(requests_of "$c" "$r")
            awk -v c="$c" -v r="$r" -v w="$wall" -v u="$user" -v m="$rss" -v n="$n" \
                'BEGIN { printf "| %s | %d | %.2f | %.2f | %.0f | %d | %.0f |\n", c, r, w, u, m / 1024, n, n / w }'
        done
    done
} | tee -a "$OUT/summary.txt"

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
field() { # case column(1 wall, 2 user, 3 rss KiB)
    for ((r = 1; r <= ROUNDS; r++)); do cut -d' ' -f"$2" "$OUT/$1.$r.time"; done | median
}

{
    echo
    echo "Medians of $ROUNDS rounds; ratio = dynamo-mocker's median wall (user) / the case's"
    echo "(the -head cases against dynamo-tiers-head, the others against dynamo-kv-router):"
    echo
    echo "| case | wall s | user s | peak RSS MiB | simulated req/s | dynamo / this, wall | dynamo / this, user |"
    echo "| --- | --- | --- | --- | --- | --- | --- |"
    for c in "${CASES[@]}"; do
        ref=dynamo-kv-router
        [[ $c == *-head ]] && ref=dynamo-tiers-head
        dw=$(field "$ref" 1)
        du=$(field "$ref" 2)
        w=$(field "$c" 1)
        u=$(field "$c" 2)
        m=$(field "$c" 3)
        n=$(requests_of "$c" 1)
        awk -v c="$c" -v w="$w" -v u="$u" -v m="$m" -v n="$n" -v dw="$dw" -v du="$du" \
            'BEGIN { printf "| %s | %.2f | %.2f | %.0f | %.0f | %.2f× | %.2f× |\n", c, w, u, m / 1024, n / w, dw / w, du / u }'
    done
} | tee -a "$OUT/summary.txt"
echo "logs and summary in $OUT" >&2
