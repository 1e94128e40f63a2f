#!/usr/bin/env bash
# Starts PostgreSQL on 127.0.0.1:5432 (trust auth, user postgres) from a bundle made by
# scripts/pg-bundle.sh, on a machine that has none installed (the lent GPU machines): what
# `fleetplane serve` needs there. Runs as an unprivileged user made for it (PostgreSQL refuses
# root). Exits non-zero with the server's log when it does not start.
#
# Usage: scripts/gpu-postgres.sh BUNDLE.tar.xz
set -uo pipefail
bundle=$1
mkdir -p /tmp/pgroot && tar -C /tmp/pgroot -xJf "$bundle" || exit 1
pg=/tmp/pgroot/pg
pgbin=$pg/usr/lib/postgresql/$(cat "$pg/VERSION")/bin
id pgrun >/dev/null 2>&1 || useradd -M pgrun
chmod -R a+rX /tmp/pgroot
mkdir -p /tmp/pgdata && chown pgrun /tmp/pgdata
pgenv=(env LD_LIBRARY_PATH="$pg/libs")
runuser -u pgrun -- "${pgenv[@]}" "$pgbin/initdb" -D /tmp/pgdata -A trust -U postgres >/tmp/initdb.log 2>&1 \
  || { cat /tmp/initdb.log; exit 1; }
runuser -u pgrun -- "${pgenv[@]}" "$pgbin/pg_ctl" -D /tmp/pgdata -l /tmp/pg.log -w \
  -o "-h 127.0.0.1 -p 5432 -k /tmp" start || { cat /tmp/pg.log; exit 1; }
