#!/usr/bin/env python3
"""Heap at massif's peak snapshot, by the first project function on each allocation's stack
(the deepest frame that is a function of this workspace's crates), largest first:

    valgrind --tool=massif --massif-out-file=massif.out target/release/fleetplane-bench suite ...
    scripts/massif-by-fn.py massif.out [TOP]
"""
import re
import sys
from collections import defaultdict

CRATES = ("engine", "engine_cuda", "policies", "cost", "simulator", "control", "fleetplane", "fleetplane_bench")
# A project function's path starts with its crate (an impl's with `<crate::`); generic std
# functions instantiated with project types (`push_mut<engine::...>`) are not.
PROJECT = re.compile(r"^<?(" + "|".join(CRATES) + r")::")
NODE = re.compile(r"^(\s*)n(\d+): (\d+) (.*)$")


def peak_tree(path):
    """The lines of the peak snapshot (the last detailed one if none is marked peak)."""
    snaps, cur = [], None
    for line in open(path):
        if line.startswith("snapshot="):
            cur = {"lines": []}
            snaps.append(cur)
        elif cur is not None:
            if line.startswith("mem_heap_B="):
                cur["heap"] = int(line.split("=")[1])
            elif line.startswith("heap_tree="):
                cur["tree"] = line.split("=")[1].strip()
            cur["lines"].append(line.rstrip("\n"))
    peaks = [s for s in snaps if s.get("tree") == "peak"] or [s for s in snaps if s.get("tree") == "detailed"]
    if not peaks:
        sys.exit(f"{path}: no detailed snapshot")
    return peaks[-1]


def project_frame(desc):
    """The frame's function if it is the workspace's, else None."""
    fn = re.sub(r"^0x[0-9A-Fa-f]+: ", "", desc)
    return fn if PROJECT.match(fn) else None


def attribute(lines):
    nodes = []
    for line in lines:
        m = NODE.match(line)
        if m:
            nodes.append((int(m.group(2)), int(m.group(3)), m.group(4)))
    out = defaultdict(int)

    def skip(i):
        j = i + 1
        for _ in range(nodes[i][0]):
            j = skip(j)
        return j

    def walk(i):
        kids, size, desc = nodes[i]
        frame = project_frame(desc)
        if frame:
            out[frame] += size
            return skip(i)
        if kids == 0:
            out["(outside the workspace) " + desc[:100]] += size
            return i + 1
        j = i + 1
        for _ in range(kids):
            j = walk(j)
        return j

    j = 1  # nodes[0] is the whole heap
    for _ in range(nodes[0][0]):
        j = walk(j)
    return out


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    snap = peak_tree(sys.argv[1])
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    out = attribute(snap["lines"])
    total = sum(out.values())
    print(f"heap {snap['heap'] / 1e6:.1f} MB at the {snap['tree']} snapshot")
    for fn, b in sorted(out.items(), key=lambda x: -x[1])[:top]:
        print(f"{b / 1e6:8.1f} MB {100 * b / total:5.1f}%  {fn}")


main()
