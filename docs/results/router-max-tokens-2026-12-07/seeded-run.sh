#!/bin/bash
# Seeded router sweeps on a 16-core host: clients' max_tokens 4096 (all five routers), then exact (cache-aware, least-outstanding).
set -u
B=.devbin/dev/fleetplane
D=.devbin/dev
nproc
timeout 540 bash -c "scripts/router-sweep.sh $B /tmp/sw/mt 16 $D/wl-mt.txt $D/ca.toml $D/lo.toml $D/sg.toml $D/dy.toml $D/lm.toml; scripts/router-sweep.sh $B /tmp/sw/ex 16 $D/wl-ex.txt $D/ca.toml $D/lo.toml $D/sg.toml $D/dy.toml $D/lm.toml; scripts/router-sweep.sh $B /tmp/sw/bmt 16 $D/wl-b-mt.txt $D/ca.toml $D/lo.toml $D/sg.toml $D/dy.toml $D/lm.toml; scripts/router-sweep.sh $B /tmp/sw/bex 16 $D/wl-b-ex.txt $D/ca.toml $D/lo.toml $D/sg.toml $D/dy.toml $D/lm.toml"
echo rc=$?
ls /tmp/sw/mt | wc -l; ls /tmp/sw/ex 2>/dev/null | wc -l
rm -f /tmp/sw/*/*.tmp; ls /tmp/sw/* | wc -l
tar czf $OUT/sw.tgz -C /tmp/sw .
