"""Write nxd_signatures.json: the real signatures of everything the fakes in this folder define.

The fakes must keep the real APIs' signatures, or a test passing here proves nothing about trn1.
This script reads the real sources (no import: they need Neuron packages) and records, for every
public function, class and method a fake defines, the parameters of the real one: names, kinds
and default values as source text. tests/test_neuron_fakes.py compares the fakes against it.

    git -C neuronx-distributed checkout v2.28.0        # SDK 2.28, the last that trains on trn1
    git -C xla checkout v2.9.0                         # torch-xla under torch-neuronx 2.9
    python tests/fakes/nxd_signatures.py --nxd neuronx-distributed/src --xla xla \\
        --label "neuronx-distributed v2.28.0 (22cadad), torch-xla v2.9.0"

A fake name or method the real release lacks stops the script: the fake invents it. It also
records every name moe/ takes from these packages (imports and module attributes), each checked
to exist in the real release, so that our code cannot lean on something only the fakes have.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

FAKES = Path(__file__).resolve().parent
OUR_CODE = FAKES.parents[1] / "moe"
MANIFEST = FAKES / "nxd_signatures.json"
PACKAGES = ("neuronx_distributed", "torch_xla")
# fake modules with no counterpart in the real release, and why
NOT_IN_RELEASE = {
    "torch_xla.experimental.tpu": "answers Lightning's TPU probe for torch-xla < 2.1 "
    "(lightning/fabric/accelerators/xla.py:80): no TPU here",
}


def module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom in `module` names."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    parent = parts if is_package else parts[:-1]
    parent = parent[: len(parent) - node.level + 1]
    return ".".join(parent + ([node.module] if node.module else []))


def find(root: Path, module: str, name: str, seen=()) -> tuple[str, ast.AST] | None:
    """The real definition of `module.name`, following re-exports: (defining module, node)."""
    path = module_file(root, module)
    if path is None or (module, name) in seen:
        return None
    tree = parse(path)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return module, node
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = absolute(module, path.name == "__init__.py", node)
                    found = find(root, source, alias.name, seen + ((module, name),))
                    if found is None:  # `from pkg import submodule` is not a definition
                        continue
                    return found
    return None


def parameters(fn: ast.FunctionDef) -> list[list]:
    """[[name, kind, default source or None], ...] in order."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [
        [
            arg.arg,
            "positional_only" if i < len(a.posonlyargs) else "positional_or_keyword",
            None if d is None else ast.unparse(d),
        ]
        for i, (arg, d) in enumerate(zip(positional, defaults, strict=True))
    ]
    if a.vararg:
        out.append([a.vararg.arg, "var_positional", None])
    out += [
        [arg.arg, "keyword_only", None if d is None else ast.unparse(d)]
        for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
    ]
    if a.kwarg:
        out.append([a.kwarg.arg, "var_keyword", None])
    return out


def decorators(fn: ast.FunctionDef) -> list[str]:
    return [
        ast.unparse(d)
        for d in fn.decorator_list
        if ast.unparse(d) in ("property", "staticmethod", "classmethod")
    ]


def fake_api() -> dict[str, dict]:
    """Every fake module's public functions and classes, each class's public methods and __init__."""
    api = {}
    for path in sorted(FAKES.rglob("*.py")):
        if path.name == Path(__file__).name:
            continue
        rel = path.relative_to(FAKES).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in parse(path).body:
            if node.name.startswith("_") if hasattr(node, "name") else True:
                continue
            if isinstance(node, ast.FunctionDef):
                api[f"{module}.{node.name}"] = {"module": module, "name": node.name, "methods": None}
            elif isinstance(node, ast.ClassDef):
                methods = [
                    m.name
                    for m in node.body
                    if isinstance(m, ast.FunctionDef) and (not m.name.startswith("_") or m.name == "__init__")
                ]
                api[f"{module}.{node.name}"] = {"module": module, "name": node.name, "methods": methods}
    return api


def our_uses() -> list[str]:
    """Dotted names moe/ imports from the packages, and the attributes it reads off their modules."""
    uses = set()
    for path in OUR_CODE.rglob("*.py"):
        tree = parse(path)
        modules = {}  # local name -> the package module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PACKAGES:
                        uses.add(alias.name)
                        modules[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                for alias in node.names:
                    uses.add(f"{node.module}.{alias.name}")
                    if module_file(FAKES, f"{node.module}.{alias.name}"):
                        modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
            ):
                uses.add(f"{modules[node.value.id]}.{node.attr}")
    return sorted(uses)


def defines(root: Path, module: str, name: str) -> bool:
    """Whether `module.name` exists in the real source: a submodule, a definition or an assignment."""
    if module_file(root, f"{module}.{name}") or find(root, module, name):
        return True
    path = module_file(root, module)
    return path is not None and any(
        isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets)
        for node in parse(path).body
    )


def real_method(root: Path, module: str, cls: ast.ClassDef, method: str) -> dict:
    """The method's signature in `cls` or its bases within the package."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == method:
            return {
                "defined_in": f"{module}.{cls.name}",
                "decorators": decorators(node),
                "parameters": parameters(node),
            }
    for base in cls.bases:
        base_name = ast.unparse(base)
        found = find(root, module, base_name) if "." not in base_name else None
        if found and isinstance(found[1], ast.ClassDef):
            try:
                return real_method(root, found[0], found[1], method)
            except SystemExit:
                continue
    raise SystemExit(f"{module}.{cls.name} has no method {method!r}: the fake invents it")


def build(roots: dict[str, Path], label: str) -> dict:
    entries = {}
    for key, item in fake_api().items():
        package = item["module"].split(".")[0]
        if item["module"] in NOT_IN_RELEASE:
            entries[key] = {"not_in_release": NOT_IN_RELEASE[item["module"]]}
            continue
        found = find(roots[package], item["module"], item["name"])
        if found is None:
            raise SystemExit(f"{key}: not in the real {package} source: the fake invents it")
        module, node = found
        if item["methods"] is None:
            entries[key] = {"defined_in": f"{module}.{node.name}", "parameters": parameters(node)}
        else:
            entries[key] = {
                "defined_in": f"{module}.{node.name}",
                "methods": {m: real_method(roots[package], module, node, m) for m in item["methods"]},
            }
    for use in our_uses():
        module, _, name = use.rpartition(".")
        if module and not defines(roots[use.split(".")[0]], module, name):
            raise SystemExit(f"moe/ uses {use}, which the real release does not have")
    return {"source": label, "signatures": entries, "our_uses": our_uses()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nxd", type=Path, required=True, help="neuronx-distributed's src/ folder")
    parser.add_argument("--xla", type=Path, required=True, help="torch-xla's repository root")
    parser.add_argument("--label", required=True, help="the releases read, for the manifest")
    args = parser.parse_args()
    manifest = build({"neuronx_distributed": args.nxd, "torch_xla": args.xla}, args.label)
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(
        f"wrote {MANIFEST} ({len(manifest['signatures'])} fake names, "
        f"{len(manifest['our_uses'])} used by moe/)"
    )


if __name__ == "__main__":
    main()
