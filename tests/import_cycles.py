#!/usr/bin/env python3
"""Lists import cycles between the Rust modules of each crate of the workspace; exits 1 if any.

A module is a file (`a/b.rs` or `a/b/mod.rs` is module `a::b`). Module A imports B when A's file
names B's items through `crate::`, `super::` or a `use` of a sibling (`self::`); a module naming
its own ancestor or descendant is containment, not an import, and is not counted. A cycle is a
strongly connected group of two or more modules. Usage: python3 tests/import_cycles.py
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRATES = {"fsdp-app": ROOT / "src", "models": ROOT / "models/src", "ops": ROOT / "models/ops/src", "kernels": ROOT / "models/kernels/src"}
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_GROUP = re.compile(r"\buse\s+(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*)\}", re.S)


def modules(src: Path) -> dict:
    """Module path (tuple) -> file, for every .rs file of a crate."""
    found = {}
    for f in src.rglob("*.rs"):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] in ("mod", "lib", "main"):
            parts = parts[:-1]
        found[tuple(parts)] = f
    return found


def resolve(mods: dict, here: tuple, head: str, rest: list) -> tuple:
    """The longest module prefix a path names, from module `here`."""
    if head == "crate":
        base = ()
    elif head == "super":
        base = here[:-1]
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    else:
        base = here
    best = base
    for i in range(1, len(rest) + 1):
        if base + tuple(rest[:i]) in mods:
            best = base + tuple(rest[:i])
    return best


def edges(mods: dict) -> dict:
    out = {m: set() for m in mods}
    for m, f in mods.items():
        text = re.sub(r"//[^\n]*", "", f.read_text())
        refs = [(h, [p for p in r.split("::") if p]) for h, r in PATH.findall(text)]
        for h, prefix, group in USE_GROUP.findall(text):
            base = [p for p in prefix.split("::") if p]
            for item in re.split(r"[,\s]+", re.sub(r"\{[^}]*\}", "", group)):
                if item and item != "self":
                    refs.append((h, base + item.split("::")))
        for head, rest in refs:
            target = resolve(mods, m, head, rest)
            contained = target[: len(m)] == m or m[: len(target)] == target
            if not contained:
                out[m].add(target)
    return out


def cycles(graph: dict) -> list:
    """Strongly connected components of two or more nodes (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def main() -> int:
    total = 0
    for crate, src in CRATES.items():
        mods = modules(src)
        for comp in cycles(edges(mods)):
            total += 1
            print(f"{crate}: cycle: " + " <-> ".join("::".join(m) or "(root)" for m in comp))
    print(f"import cycles: {total}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
