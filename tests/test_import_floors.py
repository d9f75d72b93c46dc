"""Imports point down (DESIGN.md section 8): kernels and models -> cache/ -> runtime/ -> app/, no cycles.

Every module of ulacache_jax is parsed (not imported), and every import in it counts: module-level ones and the
ones inside functions (a function-local import that closes a cycle or points up is the same dependency, only
hidden). Floors: pallas_kernels and models 0, cache 1, runtime 2, app 3. A module may import its own floor or
below. ulacache_jax/__init__.py (the lazy public facade: every public name, whatever its floor) and __main__.py
(the `python -m ulacache_jax` entry point) are exempt as importers; nothing may import the facade for a name, so
a module's dependencies stay visible here. Kernels are leaves: they import nothing of the package but kernels.
"""
from __future__ import annotations

import ast
import os
import pathlib

PKG = "ulacache_jax"
ROOT = pathlib.Path(__file__).resolve().parents[1] / PKG
FLOORS = {"pallas_kernels": 0, "models": 0, "cache": 1, "runtime": 2, "app": 3}
EXEMPT = {PKG, f"{PKG}.__main__"}       # the facade and the entry point import across every floor by design
# (importer, imported) -> why the upward import is deliberate. None today: add one only with its reason.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def modules() -> dict[str, pathlib.Path]:
    """Module name -> file, following the links ulacache_jax/models and ulacache_jax/pallas_kernels (a checkout)."""
    out = {}
    files = [pathlib.Path(d) / f for d, dirs, fs in os.walk(ROOT, followlinks=True) for f in fs if f.endswith(".py")]
    for path in files:
        rel = path.relative_to(ROOT).with_suffix("")
        if "__pycache__" in rel.parts:
            continue
        parts = [p for p in rel.parts if p != "__init__"] if rel.name == "__init__" else list(rel.parts)
        out[".".join([PKG, *parts])] = path
    return out


def imports(name: str, path: pathlib.Path, mods) -> dict[str, int]:
    """The package modules `name` imports (anywhere in the file) -> the line of the first import of each."""
    is_pkg = path.name == "__init__.py"
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the module pkg.sub where there is one, else a name of pkg
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.setdefault(t, node.lineno)
    return out


def floor(name: str) -> int | None:
    parts = name.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def graph():
    mods = modules()
    return mods, {m: imports(m, p, mods) for m, p in mods.items()}


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in edges:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(edges[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_every_module_is_seen():
    mods, edges = graph()
    for name in (f"{PKG}.pallas_kernels.page_lse", f"{PKG}.models.hf_loader", f"{PKG}.cache.decode_layer",
                 f"{PKG}.cache.select.quest", f"{PKG}.runtime.engine", f"{PKG}.runtime.speculative.decoder",
                 f"{PKG}.app.cli"):
        assert name in mods, name
    assert all(floor(m) is not None for m in mods if m not in EXEMPT and m != PKG), \
        [m for m in mods if floor(m) is None and m not in EXEMPT]
    # function-local imports count: the speculative decoder's imports are module-level now, but the walker must
    # see a local one (tokenizer.py imports gguf_loader inside functions)
    assert f"{PKG}.models.gguf_loader" in edges[f"{PKG}.models.tokenizer"]


def test_no_import_cycles():
    _, edges = graph()
    live = {m: {t: ln for t, ln in e.items() if t not in EXEMPT} for m, e in edges.items() if m not in EXEMPT}
    found = cycles(live)
    assert not found, "import cycles (module-level or function-local imports): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_imports_point_down():
    mods, edges = graph()
    bad = []
    for m, targets in edges.items():
        if m in EXEMPT:
            continue
        for t, line in targets.items():
            if t == PKG:
                bad.append(f"{mods[m].relative_to(ROOT.parent)}:{line} {m} imports the facade {PKG} (import the module itself)")
            elif t in EXEMPT:
                bad.append(f"{mods[m].relative_to(ROOT.parent)}:{line} {m} imports {t}")
            elif floor(t) > floor(m) and (m, t) not in ALLOWED_UPWARD:
                bad.append(f"{mods[m].relative_to(ROOT.parent)}:{line} {m} (floor {floor(m)}) imports {t} (floor {floor(t)})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_kernels_are_leaves():
    _, edges = graph()
    bad = [f"{m} imports {t}" for m, targets in edges.items() if m.startswith(f"{PKG}.pallas_kernels")
           for t in targets if not t.startswith(f"{PKG}.pallas_kernels")]
    assert not bad, bad


def test_allowed_exceptions_are_still_needed():
    _, edges = graph()
    stale = [pair for pair in ALLOWED_UPWARD if pair[1] not in edges.get(pair[0], {})]
    assert not stale, f"ALLOWED_UPWARD lists imports that no longer exist: {stale}"
