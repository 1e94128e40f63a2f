#!/usr/bin/env bash
# The ceiling (perfect cache) and the real tiers, five routers, at seeds 1-3: one search a core.
set -u
B=bench-bin/ceil/fleetplane
O=${OUT:-/tmp/out}; mkdir -p /tmp/ceil/perfect /tmp/ceil/real
awk '{print $1}' bench-bin/ceil/workloads.txt | xargs -P 8 -I{} env RAYON_NUM_THREADS=1 bash scripts/router-ceiling.sh $B /tmp/ceil/perfect bench-bin/ceil/workloads.txt {} 2> /tmp/ceil/perfect.log &
while read -r name args; do echo "$name $args"; done < bench-bin/ceil/workloads.txt | xargs -P 8 -L 1 bash -c 'n=$0; shift; RAYON_NUM_THREADS=1 '$B' max-rate "$@" --router cache-aware,least-outstanding,sglang-cache-aware,dynamo-kv,llm-d --target-attainment 0.9 --precision 0.002 > /tmp/ceil/real/$n.txt 2>&1' &
wait
tar -C /tmp -czf $O/ceil.tgz ceil
