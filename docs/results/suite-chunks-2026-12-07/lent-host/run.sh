#!/usr/bin/env bash
# Headline rounds (one at a time, quiet), max-rate on all cores, the million-request suite by block and in chunks.
set -u
B=bench-bin/quiet
O=${OUT:-/tmp/out}; mkdir -p $O
nproc > $O/machine.txt; lscpu | grep -E "Model name|^CPU\(s\)|L3" >> $O/machine.txt; uptime >> $O/machine.txt
S=examples/mooncake-tiers.toml; C=examples/mooncake-tiers-chunks.toml
for round in 1 2 3 4 5; do
  for c in "$S cache-aware" "$C cache-aware" "$S least-outstanding@l1" "$S cache-aware@l1" "$S dynamo-kv@l1" "$C dynamo-kv"; do
    set -- $c
    /usr/bin/time -f "$round $1 $2 %e %U %M" $B/fleetplane simulate --scenario $1 --router $2 --seed 1 > /dev/null 2>> $O/headline.txt
  done
done
for sc in $S $C; do
  /usr/bin/time -f "max-rate $sc %e %U %M" $B/fleetplane max-rate --scenario $sc --precision 0.002 > $O/max-rate-$(basename $sc .toml).txt 2>> $O/max-rate-time.txt
done
uptime >> $O/machine.txt
mkdir -p $O/ceiling
grep -v '^$' scripts/router-workloads.txt | awk '{print $1}' | xargs -P 10 -I{} env RAYON_NUM_THREADS=1 bash scripts/router-ceiling.sh $B/fleetplane $O/ceiling scripts/router-workloads.txt {} > $O/ceiling.log 2>&1 &
( /usr/bin/time -f "%e %U %M" $B/fleetplane-bench suite --cases tiered-cache-aware > $O/suite-ca-block.txt 2>&1 ) &
( /usr/bin/time -f "%e %U %M" $B/fleetplane-bench suite --cases tiered-cache-aware --offload-chunk-tokens 256 > $O/suite-ca-chunks.txt 2>&1 ) &
( /usr/bin/time -f "%e %U %M" $B/fleetplane-bench suite --cases tiered-dynamo-kv > $O/suite-dkv-block.txt 2>&1 ) &
( /usr/bin/time -f "%e %U %M" $B/fleetplane-bench suite --cases tiered-dynamo-kv --offload-chunk-tokens 256 > $O/suite-dkv-chunks.txt 2>&1 ) &
wait
uptime >> $O/machine.txt
