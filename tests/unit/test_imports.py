"""No import cycles between tidal's packages, lazy (function-level) imports included.

A package is a folder under ``tidal/`` or a top-level module (``driver``, ``session``, ``errors``,
...). Every ``import tidal.x...`` / ``from tidal.x... import`` found anywhere in a file, and every
relative import, is an edge from the file's package to ``x``; imports under ``if TYPE_CHECKING:``
are not (they never run). ``docs/design.md`` says which layer may import which; this test enforces
the part that matters most: the graph has no cycle.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tidal"


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those inside ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)


def package_edges(root: pathlib.Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """``{package: {imported package: ["file:line", ...]}}`` over every import statement in ``root``."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        src = rel.parts[0]
        module = ["tidal", *rel.parts]
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = (module[:-1] if path.name == "__init__.py" else module)[: len(module) - node.level]
                    names = [".".join([*base, node.module] if node.module else base)]
                else:
                    names = [node.module or ""]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "tidal" and len(parts) > 1 and parts[1] != src:
                    edges[src][parts[1]].append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return edges


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return sorted(out)


def test_cycle_finder_finds_long_and_short_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []


def test_edges_see_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "tidal"
    (pkg / "x").mkdir(parents=True)
    (pkg / "y").mkdir()
    (pkg / "x" / "__init__.py").write_text("from ..y import thing\n")
    (pkg / "y" / "m.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tidal.z\n"
        "def f():\n    from tidal.x import g\n    import tidal.errors\n"
    )
    edges = package_edges(pkg)
    assert set(edges["x"]) == {"y"} and set(edges["y"]) == {"x", "errors"}
    assert edges["y"]["x"] == ["tidal/y/m.py:5"]


def test_no_import_cycles_between_packages():
    edges = package_edges()
    assert {"trainer", "checkpoint", "rollout", "cluster", "driver"} <= set(edges)  # the walk saw the code
    found = cycles({src: set(dst) for src, dst in edges.items()})
    where = [
        f"{a} -> {b} ({', '.join(edges[a][b][:3])})"
        for comp in found
        for a in comp
        for b in comp
        if b in edges.get(a, {})
    ]
    assert not found, f"import cycles between packages {found}: " + "; ".join(where)


def test_driver_starts_ray_before_importing_torch_or_transformers():
    """What ``tidal train`` runs before ``ray.init`` (parse, resolve, the memory plan, the session's
    own imports and the actor env) leaves torch, transformers and matplotlib unimported: on a 2-core
    host each costs seconds that would delay Ray's start."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from tidal.cli import _resolved\n"
        "cfg, _ = _resolved([])\n"
        "import tidal.driver, tidal.session\n"
        "from tidal.memory.preload import actor_env\n"
        "from tidal.memory.telemetry import MemoryTimeline, device_used_bytes\n"
        "from tidal.cluster.ray_cluster import prestart_modules, start_warm\n"
        "actor_env(cfg.memory, {}, cfg.cluster.device); device_used_bytes('cpu'); MemoryTimeline()\n"
        "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))\n"
        # The trainer class the driver needs to create the ranks: no DTensor, no sympy (a second and more).
        "from tidal.trainer.base import trainer_class\n"
        "trainer_class('fsdp')\n"
        "print(sorted(m for m in ('sympy', 'torch.distributed.tensor', 'torch._dynamo') if m in sys.modules))\n"
        # The inputs it reads beside Ray's start (tokenizer, prompts, agent): the preset's char tokenizer without
        # transformers (a second of CPU).
        "from tidal.model import resolve_model\n"
        "tidal.session._read_inputs(cfg, resolve_model(cfg.model.model, cfg.model.tokenizer))\n"
        "print(sorted(m for m in ('transformers',) if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, check=True)
    assert out.stdout.split() == ["[]", "[]", "[]"], out.stdout + out.stderr
