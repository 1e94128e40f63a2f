#!/usr/bin/env bash
# A scenario's workload through a live fleet on this machine, beside the simulator's run of it:
# `fleetplane serve` (PostgreSQL at 127.0.0.1:5432, database fleetplane_live, made afresh), N
# engine processes with the cost-model executor (they step in real time), POLICY put in force
# through the API, then `fleetplane replay` with the flags given; prints the client's table
# (TTFT by class and tenant as the client saw it) and leaves its JSON in OUT.json.
#
#   scripts/live-replay.sh POLICY_JSON ENGINES OUT -- REPLAY_FLAGS...
#   scripts/live-replay.sh '{"router": "cache-aware", "flow": "slo"}' 4 /tmp/slo -- \
#       --scenario examples/classes-two-tenants.toml --max-requests 3000
set -euo pipefail
cd "$(dirname "$0")/.."
policy=$1 engines=$2 out=$3
shift 3
[ "${1:-}" = "--" ] && shift
bin=target/release/fleetplane
[ -x "$bin" ] || cargo build --release -p control
export FLEETPLANE_ADMIN_TOKEN=live-replay-admin FLEETPLANE_ENGINE_TOKEN=live-replay-engine
db=postgres://postgres@127.0.0.1:5432/fleetplane_live
psql -h 127.0.0.1 -U postgres -qc "DROP DATABASE IF EXISTS fleetplane_live" -c "CREATE DATABASE fleetplane_live"
http=127.0.0.1:18080 grpc=127.0.0.1:18051
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
"$bin" serve --listen $http --grpc-listen $grpc --database-url $db > "$out.serve.log" 2>&1 &
pids+=($!)
for i in $(seq 0 $((engines - 1))); do
    "$bin" engine --executor sim --model llama-3.1-8b --control $grpc --name "live-$i" > "$out.engine-$i.log" 2>&1 &
    pids+=($!)
done
api() { curl -sf -H "authorization: Bearer $FLEETPLANE_ADMIN_TOKEN" "$@"; }
for _ in $(seq 60); do
    n=$(api "http://$http/api/instances" 2>/dev/null | python3 -c 'import json,sys; print(sum(i["state"]=="serving" for i in json.load(sys.stdin)["instances"]))' 2>/dev/null || echo 0)
    [ "$n" = "$engines" ] && break
    sleep 1
done
[ "$n" = "$engines" ] || { echo "engines did not all serve:"; tail "$out".*.log; exit 1; }
api -X PUT -H 'content-type: application/json' -d "$policy" "http://$http/api/policies" > /dev/null
"$bin" replay --gateway "http://$http" --json "$out.json" "$@"
