#!/bin/bash
# The ceiling of routing on a workload: its max rate at 90% attainment with an ideal shared
# store. Each workload's scenario is run with its L2 gone and its L3 unbounded (1 PB),
# instant (100 TB/s, no latency) and its KV events undelayed, so that every block any GPU
# evicts stays free to load for every instance and a router's hit rate can come as close to
# the infinite-cache bound as its placement lets it. Then the cache-aware run is simulated
# again at its max rate: its hit rate against the bound, and how busy the GPUs are there
# (busy s over held GPU s).
#
#   scripts/router-ceiling.sh BIN OUT WORKLOADS [NAME...]
#   scripts/router-ceiling.sh target/release/fleetplane /tmp/ceiling scripts/router-workloads.txt mooncake8
#
# Writes OUT/NAME.txt (max-rate's table of four routers, then the cache-aware run's summary).
set -euo pipefail
if [ $# -lt 3 ]; then sed -n '2,12p' "$0"; exit 2; fi
bin=$1 out=$2 workloads=$3
shift 3
mkdir -p "$out"
while read -r name args; do
  [ -n "$name" ] || continue
  if [ $# -gt 0 ] && [[ ! " $* " =~ " $name " ]]; then continue; fi
  read -r -a words <<< "$args"
  # max-rate takes the workload's arguments as they are; the run at the max rate, all but
  # the scenario and the rate.
  scenario="" search=() run=()
  for ((i = 0; i < ${#words[@]}; i++)); do
    case "${words[i]}" in
      --scenario) scenario=${words[i + 1]}; i=$((i + 1)) ;;
      --rate-scale) search+=("${words[i]}" "${words[i + 1]}"); i=$((i + 1)) ;;
      *) search+=("${words[i]}"); run+=("${words[i]}") ;;
    esac
  done
  # Beside the original, so that its trace path (relative to the file) still holds.
  ceiling="$(dirname "$scenario")/.ceiling-$name.toml"
  sed -e 's/^tiers = .*/tiers = "l1,l3"/' -e 's/^l3_gib = .*/l3_gib = 1000000/' \
    -e 's/^l3_gbps = .*/l3_gbps = 100000/' -e 's/^l3_latency_us = .*/l3_latency_us = 0/' \
    -e 's/^event_delay_ms = .*/event_delay_ms = 0/' "$scenario" > "$ceiling"
  trap 'rm -f "$ceiling"' EXIT
  grep -q '^l3_gbps = 100000' "$ceiling" || { echo "$scenario: no [kv] l3_gbps line to replace" >&2; exit 1; }
  f="$out/$name.txt"
  "$bin" max-rate --scenario "$ceiling" "${search[@]}" --router cache-aware,least-outstanding,sglang-cache-aware,dynamo-kv,llm-d \
    --target-attainment 0.9 --precision 0.002 > "$f"
  rate=$(awk '$1 == "cache-aware" { print $2 }' "$f")
  echo >> "$f"
  "$bin" simulate --scenario "$ceiling" "${run[@]}" --router cache-aware --rate-scale "$rate" >> "$f"
  rm -f "$ceiling"
  trap - EXIT
done < "$workloads"
