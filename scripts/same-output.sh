#!/usr/bin/env bash
# Checks that two fleetplane binaries simulate every example scenario to byte-identical JSON
# (what an optimisation must keep): `scripts/same-output.sh OLD NEW [MAX_REQUESTS]`.
# Prints one line per example and exits non-zero if any differs.
set -euo pipefail
old=$1 new=$2 max=${3:-2000}
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
for scenario in examples/*.toml; do
    name=$(basename "$scenario" .toml)
    case "$name" in live-*|cuda-*) continue ;; esac  # replayed against live engines, not simulated here
    "$old" simulate --scenario "$scenario" --max-requests "$max" --json "$out/$name.old.json" >/dev/null 2>"$out/$name.old.err" || { echo "$name: old binary failed: $(tail -1 "$out/$name.old.err")"; status=1; continue; }
    "$new" simulate --scenario "$scenario" --max-requests "$max" --json "$out/$name.new.json" >/dev/null 2>"$out/$name.new.err" || { echo "$name: new binary failed: $(tail -1 "$out/$name.new.err")"; status=1; continue; }
    if cmp -s "$out/$name.old.json" "$out/$name.new.json"; then
        echo "$name: identical"
    else
        echo "$name: DIFFERS"
        status=1
    fi
done
exit $status
