"""The fakes of neuronx-distributed and torch-xla keep the real signatures (tests/fakes/README.md).

tests/fakes/nxd_signatures.json holds the real ones, read from neuronx-distributed v2.28.0 and
torch-xla v2.9.0 by tests/fakes/nxd_signatures.py; a fake that adds, drops, renames or reorders
a parameter, or changes a default, fails here, as does a fake name the real release lacks.
"""

from __future__ import annotations

import ast
import json

import pytest

from tests.fakes import nxd_signatures as sig

RECORD = json.loads(sig.MANIFEST.read_text())
MANIFEST = RECORD["signatures"]
FAKE_API = sig.fake_api()


def fake_node(module: str, name: str) -> ast.AST:
    path = sig.module_file(sig.FAKES, module)
    return next(n for n in sig.parse(path).body if getattr(n, "name", None) == name)


def fake_method(cls: ast.ClassDef, method: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)


def test_every_fake_name_is_in_the_manifest_and_back():
    assert sorted(FAKE_API) == sorted(MANIFEST)


@pytest.mark.parametrize("key", sorted(k for k, v in MANIFEST.items() if "not_in_release" not in v))
def test_fake_keeps_the_real_signature(key):
    item, real = FAKE_API[key], MANIFEST[key]
    node = fake_node(item["module"], item["name"])
    if item["methods"] is None:
        assert sig.parameters(node) == real["parameters"], real["defined_in"]
        return
    assert sorted(item["methods"]) == sorted(real["methods"])
    for method, real_method in real["methods"].items():
        where = f"{real_method['defined_in']}.{method}"
        fake = fake_method(node, method)
        assert sig.parameters(fake) == real_method["parameters"], where
        assert sig.decorators(fake) == real_method["decorators"], where


def test_moe_uses_only_names_the_real_release_has():
    """Each name moe/ takes from neuronx-distributed or torch-xla was found in the real source when
    the manifest was made; a new one needs `python tests/fakes/nxd_signatures.py` again."""
    assert set(sig.our_uses()) <= set(RECORD["our_uses"])
