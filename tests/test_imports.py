"""The import graph of moe/: no cycles, and no stage imports a later one (docs/ARCHITECTURE.md).

Every `import moe...` counts, at module level or inside a function: a function-level import that
runs back up the stages is the same dependency, only hidden.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

# The stages, lowest first: a module may import its own stage and earlier ones only.
STAGES = {"errors": 0, "paths": 0, "ranks": 0, "outputs": 0, "inputs": 0, "faults": 0, "config": 1, "data": 2,
          "model": 2, "hf": 3, "parallel": 4, "checkpoint": 5, "module": 6, "backends": 7, "train": 8,
          "infer": 9, "eval": 10, "tools": 11}
KEPT_PATHS = {"moe.moe_layer", "moe.report", "moe.supervise"}  # re-exports of older import paths: the top
# A backend's declarations, read by the validator and the planner without its library: its spec, its library's
# refusals and the registry listing them (moe/backends/registry.py). They sit at the config stage: they import
# config and lower only, and their packages' __init__s import nothing (tests/test_backend_names.py).
DECLARATIONS = re.compile(r"moe\.backends\.(registry|\w+\.(spec|rules))")


def modules() -> dict[str, Path]:
    found = {}
    for path in (REPO / "moe").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The moe modules `name` imports (a `from pkg import mod` counts as mod)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if not node.level else ".".join(
                name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                + [node.module])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("moe.") and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def stage(module: str) -> float:
    if module in KEPT_PATHS:
        return float("inf")
    if DECLARATIONS.fullmatch(module):
        return STAGES["config"]
    return STAGES[module.split(".")[1]] if module.count(".") else -1


def test_every_package_has_a_stage():
    assert {m.split(".")[1] for m in graph() if m.count(".") and m not in KEPT_PATHS} <= set(STAGES)


def test_no_module_imports_a_later_stage():
    upward = sorted(f"{m} -> {t}" for m, targets in graph().items() for t in targets if stage(t) > stage(m))
    assert upward == []


def test_no_import_cycles():
    edges, cycles, seen = graph(), [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycles.append(path[path.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        for target in sorted(edges[node]):
            visit(target, path + [node])

    for node in sorted(edges):
        visit(node, [])
    assert cycles == []


def test_the_model_imports_its_own_rules_not_the_run_table_nor_the_backends_specs():
    """moe/model checks a model config with moe.config.rules.architecture; the whole table
    (moe.config.validate) and what backends can do (moe.backends.registry, moe.config.specs) are the
    run's, so building a model never loads them."""
    edges, reached, todo = graph(), set(), [m for m in graph() if m.startswith("moe.model")]
    while todo:
        module = todo.pop()
        for target in edges[module] - reached:
            reached.add(target)
            todo.append(target)
    assert "moe.config.rules.architecture" in reached
    assert not reached & {"moe.config.validate", "moe.config.specs", "moe.config.rules.backends",
                          "moe.backends.registry"}
