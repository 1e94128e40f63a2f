#!/bin/bash
# Max rate at 90% attainment of every workload in a list with every variant's policy file:
# one search a thread, JOBS at once, skipping outputs already there (a sweep stopped halfway
# goes on where it stopped). The workloads docs/ROUTERS.md measures are scripts/router-workloads.txt
# (one line each: a name and max-rate's arguments).
#
#   scripts/router-sweep.sh BIN OUT JOBS WORKLOADS POLICY.toml...
#   scripts/router-sweep.sh target/release/fleetplane /tmp/sweep 2 scripts/router-workloads.txt a.toml b.toml
#
# Writes OUT/WORKLOAD__POLICY.txt (POLICY without .toml), max-rate's table.
set -euo pipefail
if [ $# -lt 5 ]; then sed -n '2,9p' "$0"; exit 2; fi
bin=$1 out=$2 jobs=$3 workloads=$4
shift 4
mkdir -p "$out"
export RAYON_NUM_THREADS=1 BIN=$bin OUT=$out
while read -r name args; do
  [ -n "$name" ] || continue
  for policy in "$@"; do
    v=$(basename "$policy" .toml)
    [ -s "$out/${name}__$v.txt" ] || echo "$name $policy $args"
  done
done < "$workloads" |
  xargs -P "$jobs" -L 1 bash -c '
    name=$0 policy=$1; shift
    f="$OUT/${name}__$(basename "$policy" .toml).txt"
    if "$BIN" max-rate --target-attainment 0.9 --precision 0.002 "$@" --policy "$policy" > "$f.tmp" 2>&1
    then mv "$f.tmp" "$f"; else echo "failed: $name $policy (see $f.tmp)" >&2; fi'
