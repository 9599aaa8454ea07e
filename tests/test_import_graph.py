"""k3rocm's modules import each other without a circle (function-local imports count: they
tie the modules as much as top-level ones do). The settings schema is a leaf of ``serving/``."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

from conftest import REPO

SRC = REPO / "src"


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the k3rocm modules it imports anywhere in its file (``from pkg import mod``
    counts as importing ``pkg.mod`` when that is a module)."""
    files = {_module(p, root): p for p in (root / "k3rocm").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module in files:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                deps |= (subs & files.keys()) or {node.module}
        graph[name] = deps - {name}
    return graph


def test_no_import_circle():
    try:
        order = list(graphlib.TopologicalSorter(import_graph(SRC)).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import circle: {' -> '.join(exc.args[1])}") from None
    assert "k3rocm.serving.config" in order


def test_the_settings_schema_is_a_leaf_of_serving():
    graph = import_graph(SRC)
    assert graph["k3rocm.serving.settings"] == {"k3rocm.serving.fusions",
                                                 "k3rocm.serving.modelfacts", "k3rocm.errors"}
    assert graph["k3rocm.serving.modelfacts"] == graph["k3rocm.errors"] == set()
    assert {"k3rocm.serving.settings", "k3rocm.serving.profiles",
            "k3rocm.serving.modelfacts"} <= graph["k3rocm.serving.config"]


def test_single_node_deploy_imports_nothing_of_scale_out():
    graph = import_graph(SRC)
    single = {m for m in graph if m.startswith("k3rocm.deploy.")
              and not m.startswith("k3rocm.deploy.scale")}
    assert {m: d for m in single if (d := {x for x in graph[m] if ".deploy.scale" in x})} == {}
