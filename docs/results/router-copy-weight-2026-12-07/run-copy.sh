#!/bin/bash
# cache-aware copy-weight variants and combinations, fourteen workloads, seeds 42, 1, 2, 3: exact lengths (var3) and max_tokens 4096 (var3mt).
set -u
B=.devbin/dev/fleetplane
D=.devbin/dev
cat $D/wl-b-ex.txt $D/wl-ex.txt > /tmp/wl-ex-all.txt
cat $D/wl-b-mt.txt $D/wl-mt.txt > /tmp/wl-mt-all.txt
timeout 560 bash -c "scripts/router-sweep.sh $B /tmp/sw3 16 /tmp/wl-ex-all.txt $D/var3/*.toml; scripts/router-sweep.sh $B /tmp/sw3 16 /tmp/wl-mt-all.txt $D/var3mt/*.toml"
echo rc=$?
rm -f /tmp/sw3/*.tmp; ls /tmp/sw3 | wc -l
tar czf $OUT/sw3.tgz -C /tmp/sw3 .
