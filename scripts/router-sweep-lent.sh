#!/bin/bash
# Prepares a router sweep for a lent many-core host (the device tool's machines: 16 cores, no
# Rust): a stripped `fleetplane`, the workloads with each seed (and any extra flags), the
# policy files and a run script, in bench-bin/sweep (ignored by git; carried by the tool).
#
#   scripts/router-sweep-lent.sh BIN "SEEDS" "EXTRA FLAGS" POLICY.toml...
#   scripts/router-sweep-lent.sh target/release/fleetplane "42 1 2 3" "--max-tokens 4096" a.toml b.toml
#
# Then run `bash bench-bin/sweep/run.sh` there with carry ["bench-bin/sweep"]: it runs
# scripts/router-sweep.sh sixteen searches at a time (the fourteen workloads of
# scripts/router-workloads.txt x seeds x policies; ~560 searches in under four minutes) and
# leaves one archive, $OUT/sweep.tgz (the tool brings back few files, so not one a search).
# Names: WORKLOAD-sSEED__POLICY.txt, max-rate's table.
set -euo pipefail
if [ $# -lt 4 ]; then sed -n '2,13p' "$0"; exit 2; fi
bin=$1 seeds=$2 extra=$3
shift 3
cd "$(dirname "$0")/.."
dir=bench-bin/sweep
rm -rf "$dir" && mkdir -p "$dir/policies"
cp "$bin" "$dir/fleetplane" && strip "$dir/fleetplane"
for p in "$@"; do cp "$p" "$dir/policies/"; done
for s in $seeds; do
  while read -r name args; do
    [ -n "$name" ] && echo "$name-s$s $args --seed $s $extra"
  done < scripts/router-workloads.txt
done > "$dir/workloads.txt"
cat > "$dir/run.sh" <<'RUN'
#!/bin/bash
set -u
d=bench-bin/sweep
timeout 560 scripts/router-sweep.sh $d/fleetplane /tmp/sweep "$(nproc)" $d/workloads.txt $d/policies/*.toml
echo "rc=$? searches done: $(ls /tmp/sweep | grep -vc '\.tmp$')"
rm -f /tmp/sweep/*.tmp
tar czf "$OUT/sweep.tgz" -C /tmp/sweep .
RUN
echo "$(wc -l < "$dir/workloads.txt") workloads x $# policies in $dir ($(du -sh "$dir" | cut -f1))"
