#!/bin/bash
# cache-aware variants (one parameter moved each) over the fourteen workloads, seeds 42, 1, 2, 3, exact lengths.
set -u
B=.devbin/dev/fleetplane
D=.devbin/dev
cat $D/wl-b-ex.txt $D/wl-ex.txt > /tmp/wl-all.txt
wc -l /tmp/wl-all.txt
timeout 560 scripts/router-sweep.sh $B /tmp/sw2 16 /tmp/wl-all.txt $D/var/*.toml
echo rc=$?
rm -f /tmp/sw2/*.tmp; ls /tmp/sw2 | wc -l
tar czf $OUT/sw2.tgz -C /tmp/sw2 .
