#!/usr/bin/env bash
# The layers of the crate have one direction: a module imports only modules of its own
# layer or below, the top-level modules form no cycle, and no files import each other in a
# loop of any length (a parent and its own submodules excepted), inside a folder too.
# Reads every `use` tree of every file under SRC (default: src/), grouped and nested ones
# included, and every `crate::`, `super::` and `self::` path in code (not in comments or
# strings; `super::` counted from the inline module it is written in); exits 1 naming
# each offence.
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
    "engine": 7,
    "actors": 6,
    "runner": 5, "api": 5, "store": 5,
    "model": 4,
    "kernels": 3,
    # The pure cores: no device, no actors, no model.
    "sched": 1, "spec": 1, "sampling": 1, "structured": 1, "eplb": 1, "step": 1, "route": 1,
    "error": 0, "sync": 0, "notice": 0,
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


def code_only(text):
    """`text` without comments, string and char literals (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    out.append("\n" if text[i] == "\n" else "")
                    i += 1
        elif (m := re.compile(r'b?r(#*)"').match(text, i)) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find('"' + m.group(1), m.end())
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'":
            m = re.compile(r"'(\\[^']{1,10}|[^\\'])'").match(text, i)
            if m:
                out.append("' '")
                i = m.end()
            else:  # a lifetime
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand(tree):
    """A `use` tree's paths: `a::{b, c::{d, self}}` -> a::b, a::c::d, a::c."""
    tree = tree.strip()
    parts, depth, start = [], 0, 0
    for k, ch in enumerate(tree):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(tree[start:k])
            start = k + 1
    parts.append(tree[start:])
    out = []
    for p in (p.strip() for p in parts):
        if not p:
            continue
        if "{" in p:
            prefix, inner = p.split("{", 1)
            prefix = prefix.rstrip().rstrip(":").rstrip(":")
            for q in expand(inner[: inner.rfind("}")]):
                out.append(prefix if q == "self" else (f"{prefix}::{q}" if prefix else q))
        else:
            out.append(re.sub(r"\s+as\s+\w+$", "", p).replace(" ", ""))
    return out


use_stmt = re.compile(r"\buse\s+([^;]+);")
expr_path = re.compile(r"(?<![\w$])((?:super::)+|crate::|self::)([A-Za-z_]\w*(?:::[A-Za-z_]\w*)*)")
inline_mod = re.compile(r"\bmod\s+\w+\s*\{")


def inline_depths(code):
    """For each offset of `code`, how many inline `mod x { .. }` blocks enclose it."""
    depths, stack, depth = [0] * (len(code) + 1), [], 0
    opens = {m.end() - 1 for m in inline_mod.finditer(code)}
    for k, ch in enumerate(code):
        if ch == "{":
            depth += 1
            if k in opens:
                stack.append(depth)
        elif ch == "}":
            if stack and stack[-1] == depth:
                stack.pop()
            depth -= 1
        depths[k] = len(stack)
    return depths


def target_of(mod, inline, path):
    """The file module `path` (written in `mod`, inside `inline` inline modules) names."""
    segs = path.split("::")
    if segs[0] == "crate":
        return resolve(tuple(segs[1:]))
    if segs[0] == "self":
        return None if inline else resolve(mod + tuple(segs[1:]))
    if segs[0] == "super":
        ups = 0
        while ups < len(segs) and segs[ups] == "super":
            ups += 1
        if ups <= inline:
            return None
        ups -= inline
        return resolve(mod[: len(mod) - ups] + tuple(segs[ups + inline:]))
    return None


edges = defaultdict(set)  # file module -> file modules it imports
for mod, path in files.items():
    if not mod:
        continue
    code = code_only(open(path, encoding="utf-8").read())
    depths = inline_depths(code)
    uses = []
    for m in use_stmt.finditer(code):
        uses.append((m.start(), m.end()))
        for p in expand(m.group(1)):
            t = target_of(mod, depths[m.start()], p)
            if t and t != mod:
                edges[mod].add(t)
    rest = list(code)
    for a, b in uses:
        rest[a:b] = " " * (b - a)
    rest = "".join(rest)
    for m in expr_path.finditer(rest):
        t = target_of(mod, depths[m.start()], m.group(1) + m.group(2))
        if t and t != mod:
            edges[mod].add(t)

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


# Loops between files: a parent and its own submodules excepted (a folder's mod.rs
# declares them), any other cycle of imports is one, at any depth.
file_edges = {a: {b for b in bs if not ancestor(a, b) and not ancestor(b, a)} for a, bs in edges.items()}
index, low, on, stack, sccs = {}, {}, set(), [], []
sys.setrecursionlimit(10000)


def strong(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(file_edges.get(v, ())):
        if w not in index:
            strong(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            sccs.append(sorted(comp))


for v in sorted(file_edges):
    if v not in index:
        strong(v)


def a_cycle(comp):
    """One cycle through the component's first file, by breadth-first search."""
    members, first = set(comp), comp[0]
    prev, frontier = {first: None}, [first]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(file_edges.get(v, ())):
                if w == first:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [first]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def name(m):
    return "::".join(m)


for comp in sccs:
    cyc = a_cycle(comp)
    if len(comp) == 2:
        problems.append(f"{name(comp[0])} and {name(comp[1])} import each other")
    else:
        problems.append("import loop between files: " + " -> ".join(name(m) for m in cyc)
                        + f" (a loop of {len(comp)} files: {', '.join(name(m) for m in comp)})")

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
