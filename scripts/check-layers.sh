#!/usr/bin/env bash
# The layers of the crate have one direction: a module imports only modules of its own
# layer or below, the top-level modules form no cycle, and no two files of one module
# import each other (a parent and its own submodules excepted). Reads the `crate::` and
# `super::` paths of every file under SRC (default: src/); exits 1 naming each offence.
#
#   bash scripts/check-layers.sh [SRC]
set -euo pipefail
src="${1:-$(dirname "$0")/../src}"
exec python3 - "$src" <<'PY'
import os, re, sys
from collections import defaultdict

SRC = sys.argv[1]
# Higher numbers sit higher; an import may only point to the same number or lower.
LAYERS = {
    "main": 9, "cli": 9, "bench_serve": 9,
    "protocol": 8, "cluster": 8,
    "engine": 7, "generate": 7,
    "actors": 6,
    "runner": 5, "api": 5,
    "model": 4,
    "kernels": 3,
    # The pure cores: no device, no actors, no model.
    "sched": 1, "spec": 1, "sampling": 1, "structured": 1, "eplb": 1, "step": 1, "route": 1,
    "error": 0, "sync": 0,
}

def module_of(rel):
    parts = rel[:-3].split(os.sep)
    if parts[-1] == "mod":
        parts = parts[:-1]
    if parts == ["lib"]:
        return ()
    return tuple(parts)

files = {}
for root, _, names in os.walk(SRC):
    for n in names:
        if n.endswith(".rs"):
            path = os.path.join(root, n)
            files[module_of(os.path.relpath(path, SRC))] = path
known = set(files)

def resolve(path):
    """The longest prefix of `path` that is a file module."""
    for k in range(len(path), 0, -1):
        if path[:k] in known:
            return path[:k]
    return None

comment = re.compile(r"//.*$")
crate_path = re.compile(r"\bcrate((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
super_use = re.compile(r"^(?:pub(?:\([a-z]+\))? )?use ((?:super::)+)([A-Za-z_][A-Za-z0-9_:]*)")

edges = defaultdict(set)  # file module -> file modules it imports
for mod, path in files.items():
    if not mod:
        continue
    # A file's own module for `super::`: its parent for a plain file, also for mod.rs.
    for line in open(path, encoding="utf-8"):
        code = comment.sub("", line)
        for m in crate_path.finditer(code):
            target = resolve(tuple(m.group(1).strip(":").split("::")))
            if target and target != mod:
                edges[mod].add(target)
        # Indented `use super::` belongs to an inline module (tests): its own file.
        m = super_use.match(code)
        if m:
            ups = m.group(1).count("super::")
            base = mod[: len(mod) - ups]
            target = resolve(base + tuple(m.group(2).split("::")))
            if target and target != mod:
                edges[mod].add(target)

problems = []
for mod, targets in sorted(edges.items()):
    top = mod[0]
    if top not in LAYERS:
        problems.append(f"src/{'/'.join(mod)}: top-level module `{top}` has no layer in check-layers.sh")
        continue
    for t in sorted(targets):
        tt = t[0]
        if tt not in LAYERS:
            continue
        if tt != top and LAYERS[tt] > LAYERS[top]:
            problems.append(
                f"{'::'.join(mod)} imports {'::'.join(t)}: `{top}` (layer {LAYERS[top]}) "
                f"may not import `{tt}` (layer {LAYERS[tt]})")

def ancestor(a, b):
    return b[: len(a)] == a

for a, targets in sorted(edges.items()):
    for b in sorted(targets):
        if a < b and a in edges.get(b, ()) and not ancestor(a, b) and not ancestor(b, a):
            problems.append(f"{'::'.join(a)} and {'::'.join(b)} import each other")

# Cycles among top-level modules (same-layer ones included).
top_edges = defaultdict(set)
for a, targets in edges.items():
    for b in targets:
        if a[0] != b[0]:
            top_edges[a[0]].add(b[0])
state = {}
def visit(n, stack):
    state[n] = 1
    stack.append(n)
    for m in sorted(top_edges[n]):
        if state.get(m) == 1:
            problems.append("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
        elif m not in state:
            visit(m, stack)
    stack.pop()
    state[n] = 2
for n in sorted(list(top_edges)):
    if n not in state:
        visit(n, [])

for p in problems:
    print("check-layers:", p)
if problems:
    sys.exit(1)
print(f"check-layers: {len(files)} files, {sum(len(t) for t in edges.values())} imports, layers hold")
PY
