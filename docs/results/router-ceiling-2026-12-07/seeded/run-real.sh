#!/usr/bin/env bash
set -u
B=bench-bin/ceil/fleetplane
O=${OUT:-/tmp/out}; mkdir -p /tmp/ceil/real
while read -r name args; do echo "$name $args"; done < bench-bin/ceil/workloads.txt | xargs -P 15 -L 1 bash -c 'n=$0; RAYON_NUM_THREADS=1 '$B' max-rate "$@" --router cache-aware,least-outstanding,sglang-cache-aware,dynamo-kv,llm-d --target-attainment 0.9 --precision 0.002 > /tmp/ceil/real/$n.txt 2>&1'
tar -C /tmp -czf $O/real.tgz ceil/real
