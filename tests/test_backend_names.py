"""What a backend can do is asked of its spec (moe.config.specs) and what an accelerator needs of the
environment's table (moe.train.environment.ACCELERATOR_CHECKS): no code outside moe/backends and the spec
table compares a backend's or an accelerator's name, so a new backend is one spec and its own files."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from moe.config.specs import SPECS

REPO = Path(__file__).resolve().parents[1]
ALLOWED = ("moe/backends/", "moe/config/specs.py")


def _names() -> set[str]:
    presets = (REPO / "conf/hardware").glob("*.yaml")
    accelerators = {yaml.safe_load(p.read_text()).get("accelerator") for p in presets}
    return (set(SPECS) | accelerators) - {None, "cpu"}  # "cpu" is also a torch device type: caught below


def test_no_backend_or_accelerator_name_is_compared_outside_the_backends():
    names = "|".join(sorted(_names()))
    patterns = [
        re.compile(rf"""[=!]=\s*["']({names})["']"""),  # x == "fsdp2"
        re.compile(rf"""["']({names})["']\s*[=!]="""),  # "fsdp2" == x
        re.compile(rf"""\bin\s*[(\[{{][^)\]}}]*["']({names})["']"""),  # x in ("fsdp2", ...)
        re.compile(r"\b(strategy|accelerator)\s*(==|!=|\bin\b|\bnot in\b)"),  # hardware.accelerator == "cpu"
        re.compile(r"\bspec(_of\([^)]*\))?\.name\s*[=!]="),  # spec.name == ...
    ]
    found = []
    for path in sorted((REPO / "moe").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith(ALLOWED):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in patterns):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "ask the backend's spec instead:\n" + "\n".join(found)


def test_every_spec_names_a_backend_class_of_its_own_name():
    import importlib

    for name, spec in SPECS.items():
        module, cls = spec.backend.split(":")
        backend = getattr(importlib.import_module(module), cls)
        assert backend.name == name == spec.name
