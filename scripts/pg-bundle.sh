#!/usr/bin/env bash
# Packs this machine's PostgreSQL server (binaries, the libraries they load beyond glibc,
# extensions and share files) into one archive, so that the live fleet can run with its
# database on a GPU machine that has none installed (scripts/gpu-fidelity.sh unpacks it).
# Debian's PostgreSQL finds its share and lib folders relative to its bin folder, so the
# tree keeps Debian's layout under a prefix.
#
# Usage: scripts/pg-bundle.sh OUT.tar.xz
set -euo pipefail
out=$(realpath -m "$1")
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
version=$(basename "$(dirname "$bin")")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
root=$tmp/pg
mkdir -p "$root/usr/lib/postgresql/$version/bin" "$root/usr/share/postgresql" "$root/libs"
for b in postgres initdb pg_ctl pg_isready psql; do cp -L "$bin/$b" "$root/usr/lib/postgresql/$version/bin/"; done
# Extensions initdb and the server load (text search dictionaries, PL/pgSQL, encodings);
# not the LLVM JIT, which is large and off unless asked for.
rsync -a --exclude 'llvmjit*' --exclude bitcode "/usr/lib/postgresql/$version/lib" "$root/usr/lib/postgresql/$version/"
cp -a "/usr/share/postgresql/$version" "$root/usr/share/postgresql/"
# Shared libraries the binaries need, except glibc's own (the GPU machine's is newer).
for b in "$root/usr/lib/postgresql/$version/bin/"*; do
  ldd "$b" | awk '/=> \//{print $3}'
done | sort -u | grep -v -E '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' | while read -r lib; do
  cp -L "$lib" "$root/libs/"
done
echo "$version" > "$root/VERSION"
tar -C "$tmp" -cJf "$out" pg
ls -la "$out"
