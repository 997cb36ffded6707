#!/usr/bin/env python3
"""Checks that no two files of a crate import each other, directly or around a circle.

For each crate of the workspace and the bindings, every file is a module (`a/b.rs` and
`a/b/mod.rs` are `a::b`; `lib.rs` and `main.rs` the root). An edge goes from a file to the
deepest module a path of it names: `crate::...` anywhere, and `super::...` or `self::...` in
its top-level `use` declarations. Edges to the file's own ancestors are not counted (a child
uses what its parent declares), nor paths inside inline test modules. Exits 1, printing each circle, when one is found.
"""

import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOTS = [
    "src",
    "src/kvlink-events/src",
    "ffi/c/src",
    "ffi/python/src",
    "tools/kvlink-bench/src",
    "tools/kvlink-soak/src",
    "tools/kvlink-events/src",
]
# The kvlink crate's root holds the events crate's directory, which is a crate of its own.
SKIP = {"src": "kvlink-events"}


def module_of(rel: pathlib.Path) -> tuple:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "mod" or (len(parts) == 1 and parts[0] in ("lib", "main")):
        parts.pop()
    return tuple(parts)


def use_paths(tree: str, prefix: str = "") -> list:
    """The paths of a use tree (`a::{b, c::{d, e}}` is a::b, a::c::d, a::c::e)."""
    tree = tree.strip()
    brace = tree.find("{")
    if brace < 0:
        return [prefix + tree.split(" as ")[0].strip()]
    head = prefix + tree[:brace]
    body = tree[brace + 1 : tree.rfind("}")]
    items, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += (ch == "{") - (ch == "}")
        cur += ch
    items.append(cur)
    return [p for item in items if item.strip() for p in use_paths(item, head)]


def without_test_modules(code: str) -> str:
    """The file without its inline `#[cfg(test)] mod x { ... }` blocks (tests may use any
    sibling)."""
    while m := re.search(r"^#\[cfg\(test\)\]\s*\nmod \w+ \{", code, re.M):
        depth, end = 0, len(code)
        for i in range(m.end() - 1, len(code)):
            depth += (code[i] == "{") - (code[i] == "}")
            if depth == 0:
                end = i + 1
                break
        code = code[: m.start()] + code[end:]
    return code


def references(text: str) -> list:
    """The paths a file names outside its test modules: `crate::` paths anywhere, and its
    top-level `use` paths."""
    code = without_test_modules(re.sub(r"//[^\n]*", "", text))
    found = ["crate::" + m for m in re.findall(r"\bcrate::((?:[a-z_][a-z0-9_]*::)*[a-z_][a-z0-9_]*)", code)]
    for m in re.finditer(r"^(?:pub(?:\([^)]*\))? )?use ([^;]+);", code, re.M):
        found += [p for p in use_paths(m.group(1)) if p.startswith(("super::", "self::"))]
    return found


def resolve(path: str, here: tuple, modules: set):
    """The deepest module of the crate that `path`, named in module `here`, points into."""
    segs = path.split("::")
    base: tuple = ()
    if segs[0] == "crate":
        segs = segs[1:]
    else:
        base = here
        while segs and segs[0] in ("self", "super"):
            base = base[:-1] if segs.pop(0) == "super" else base
    target = base
    for s in segs:
        if target + (s,) not in modules:
            break
        target += (s,)
    return target


def crate_graph(root: pathlib.Path, skip: str | None = None) -> dict:
    files = {}
    for path in sorted(root.rglob("*.rs")):
        rel = path.relative_to(root)
        if skip and rel.parts[0] == skip:
            continue
        files[module_of(rel)] = path
    modules = set(files)
    graph = {}
    for mod, path in files.items():
        # A file that declares inline modules (`mod tests { ... }`) reads `super::` from them
        # as its own items: only its top-level `use` declarations are read for `super::`.
        edges = set()
        for p in references(path.read_text()):
            t = resolve(p, mod, modules)
            if t != mod and t != mod[: len(t)]:
                edges.add(t)
        graph[mod] = edges
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


bad, counted = [], 0
for r in ROOTS:
    g = crate_graph(REPO / r, SKIP.get(r))
    counted += len(g)
    for comp in cycles(g):
        names = ["::".join(m) or "(root)" for m in comp]
        bad.append(f"{r}: {' <-> '.join(names)}")
if bad:
    print("cycles: files that import each other:", *bad, sep="\n  ")
    sys.exit(1)
print(f"cycles: none ({counted} files in {len(ROOTS)} crates)")
