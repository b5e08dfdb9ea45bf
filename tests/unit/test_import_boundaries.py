"""The package's import graph: no torch on the router side, no cycles, no arrow pointing up.

The layer order (DESIGN §2, issue 16) is, bottom to top::

    0  the root modules: errors, percentiles, the compiled core, and the neutral
       plumbing every front shares (asgi, auth, process, ratelimit), and the engine
       model that simulate and engine-sim share (timing, engine_model)
    1  events, hashing, endpoints          (wire format, content hash, addresses)
    2  cache, router                       (worker-side cache, global index)
    3  server, state, gateway, relay, doctor        (the product: what a deployment runs)
       tools                                        (offline: record, replay, inspect, decision replay)
       sim, engine_sim, loadgen, bench              (the lab: what exists to evaluate the product)
    4  cli                                 (the command line that composes them)

Across layer 3 the product never imports the lab or the offline tools
(``PRODUCT`` below), so what a deployment runs can be read on its own.

A module may import from its own layer or below, never from above. Inside a
layer, packages may use each other, but the package graph stays acyclic (the
gateway is a part the server composes, so ``server -> gateway`` and never
back). Every ``import`` counts, lazy ones inside functions and ones under
``TYPE_CHECKING`` too: a lazy import hides a cycle, it does not remove it.
The walk is static (``ast``), so it sees imports that a test run never reaches.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import tokenspeed_router

PACKAGE = "tokenspeed_router"
ROOT = Path(tokenspeed_router.__file__).parent

LAYERS: dict[str, int] = {
    "": 0, "errors": 0, "percentiles": 0, "_native": 0,
    "asgi": 0, "auth": 0, "process": 0, "ratelimit": 0, "timing": 0, "engine_model": 0,
    "events": 1, "hashing": 1, "endpoints": 1,
    "cache": 2, "router": 2,
    "server": 3, "state": 3, "gateway": 3, "relay": 3, "sim": 3, "engine_sim": 3, "loadgen": 3,
    "bench": 3, "doctor": 3, "tools": 3, "epp": 3,
    "cli": 4,
}
#: what a deployment runs (``serve``, ``relay``, ``doctor``) and the layers below it
PRODUCT = {"", "errors", "percentiles", "_native", "asgi", "auth", "process", "ratelimit",
           "events", "hashing", "endpoints", "cache", "router", "server", "state", "gateway", "relay", "doctor",
           "epp"}
#: what exists to evaluate the product, and the offline tools
LAB = {"sim", "engine_sim", "loadgen", "bench", "timing", "engine_model", "tools"}


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str) -> str:
    """The layer unit of ``module``: its subpackage or root module ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path, module: str) -> set[str]:
    """Every ``tokenspeed_router`` module that ``path`` imports, relative imports resolved."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            found.add(target)
            # ``from tokenspeed_router.x import y`` may name the submodule x.y
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                if (ROOT / Path(*candidate.split(".")[1:])).with_suffix(".py").exists() or (
                    ROOT / Path(*candidate.split(".")[1:]) / "__init__.py"
                ).exists():
                    found.add(candidate)
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p, _module_name(p)) for p in sorted(ROOT.rglob("*.py"))}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        for target in targets:
            a, b = _part(module), _part(target)
            if a != b and a and b:  # the package's own __init__ is only a version string
                edges[a].add(b)
    return edges


def _is_init_reexport(module: str, target: str) -> bool:
    """A package ``__init__`` importing its own submodules (re-exports) is not a cycle edge."""
    return target.startswith(module + ".")


def test_every_part_has_a_layer() -> None:
    parts = {_part(m) for m in _graph()}
    assert parts <= set(LAYERS), f"give these a layer in LAYERS: {sorted(parts - set(LAYERS))}"


def test_no_import_points_up_the_layers() -> None:
    upward = sorted(
        f"{module} -> {target} (layer {LAYERS[_part(module)]} imports layer {LAYERS[_part(target)]})"
        for module, targets in _graph().items()
        for target in targets
        if LAYERS[_part(target)] > LAYERS[_part(module)]
    )
    assert not upward, "imports pointing up the layer order:\n" + "\n".join(upward)


def test_the_product_never_imports_the_lab() -> None:
    assert PRODUCT | LAB | {"cli"} == set(LAYERS) and not PRODUCT & LAB
    leaks = sorted(f"{module} -> {target}" for module, targets in _graph().items() if _part(module) in PRODUCT
                   for target in targets if _part(target) in LAB)
    assert not leaks, "the serving side imports the lab or the offline tools:\n" + "\n".join(leaks)


def test_package_graph_has_no_cycle() -> None:
    assert _cycles(_package_edges(_graph())) == []


def test_module_graph_has_no_cycle() -> None:
    graph = _graph()
    edges = {m: {t for t in ts if t in graph and t != m and not _is_init_reexport(m, t)} for m, ts in graph.items()}
    # a submodule importing its package's __init__ while __init__ re-exports it is the
    # usual Python pattern only when the submodule needs a re-export; we never do that
    assert _cycles(edges) == []


def test_the_walk_sees_cycles_and_upward_arrows() -> None:
    """The checks themselves can fail (a test that cannot fail is a defect)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _package_edges({f"{PACKAGE}.gateway.app": {f"{PACKAGE}.server.api"}}) == {"gateway": {"server"}}
    assert LAYERS[_part(f"{PACKAGE}.cli")] > LAYERS[_part(f"{PACKAGE}.server.http")]


def test_router_side_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import tokenspeed_router, tokenspeed_router.events, tokenspeed_router.hashing\n"
        "import tokenspeed_router.router, tokenspeed_router.cli\n"
        "import tokenspeed_router.relay, tokenspeed_router.relay.cli_relay, tokenspeed_router.relay.metrics\n"
        "assert 'torch' not in sys.modules, 'torch imported by the router side'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
