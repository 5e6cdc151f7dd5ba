"""Lightning's and DeepSpeed's private members used from moe/ (issue S): each is a promise their next release
may break. The count may only fall; every use left says why on its line (`# private: ...`).

A use is a method `def _name` in a class that subclasses one of theirs, `self._name` there, or `x._name`
anywhere, where `_name` is private in their source; on anything but `self` in one of their classes, names
that torch defines or reads too (`_modules`, `_ddp_params_and_buffers_to_ignore`) are torch's business.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import deepspeed
import lightning
import torch
from conftest import REPO

LIMIT = 8  # uses left; lower it when you remove one
LIBRARIES = ("lightning", "deepspeed")
DEFINED = re.compile(r"(?:def\s+|self\.|^)(_[a-z][a-z0-9_]*)\b", re.M)
DEFINED_OR_READ = re.compile(r"(?:def\s+|\.|^)(_[a-z][a-z0-9_]*)\b", re.M)


def private_names(roots: list[Path], pattern: re.Pattern) -> set[str]:
    return {name for root in roots for path in root.rglob("*.py")
            for name in pattern.findall(path.read_text())}


def their_names() -> tuple[set[str], set[str]]:
    """(private names of Lightning and DeepSpeed, those of them torch does not use)"""
    lightning_dir, deepspeed_dir = Path(lightning.__file__).parent, Path(deepspeed.__file__).parent
    torch_dir = Path(torch.__file__).parent
    theirs = private_names([lightning_dir / "pytorch", lightning_dir / "fabric", deepspeed_dir / "runtime",
                            deepspeed_dir / "utils", deepspeed_dir / "moe"], DEFINED)
    torch_names = private_names([torch_dir / d for d in ("nn", "distributed", "optim")], DEFINED_OR_READ)
    return theirs, theirs - torch_names - {"_exit"}


def uses(path: Path, theirs: set[str], not_torch: set[str]) -> set[int]:
    tree = ast.parse(path.read_text())
    imported = set()  # the names our module binds to their objects
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                module = (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
                if module.startswith(LIBRARIES):
                    imported.add(alias.asname or alias.name.split(".")[0])
    found: set[int] = set()

    def visit(node: ast.AST, in_theirs: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_theirs
            if isinstance(child, ast.ClassDef):
                inside = any(ast.unparse(base).split(".")[0] in imported for base in child.bases)
            if isinstance(child, ast.FunctionDef) and in_theirs and child.name in theirs:
                found.add(child.lineno)
            if isinstance(child, ast.Attribute) and child.attr.startswith("_"):
                on_self = isinstance(child.value, ast.Name) and child.value.id in ("self", "cls")
                if child.attr in (theirs if on_self and in_theirs else set() if on_self else not_torch):
                    found.add(child.lineno)
            visit(child, inside)

    visit(tree, False)
    return found


def test_private_members_of_lightning_and_deepspeed_only_fall_and_each_says_why():
    theirs, not_torch = their_names()
    found = []
    for path in sorted((REPO / "moe").rglob("*.py")):
        lines = path.read_text().splitlines()
        where = path.relative_to(REPO)
        found += [f"{where}:{n}: {lines[n - 1].strip()}" for n in uses(path, theirs, not_torch)]
    listing = "\n".join(sorted(found))
    assert len(found) <= LIMIT, f"{len(found)} uses of private members (at most {LIMIT}):\n{listing}"
    unexplained = [use for use in found if "# private:" not in use]
    assert not unexplained, "say why on the line (`# private: ...`):\n" + "\n".join(unexplained)
