"""Each backend lives in one package (moe/backends/<name>/: its spec, its library's refusals, what its machine
needs, its Backend), and the shared code asks moe.backends.registry (by hardware.strategy) and
moe.backends.accelerators (by hardware.accelerator) instead of naming one: no code outside moe/backends
compares a backend's or an accelerator's name, and the config layer, the environment check and the
checkpoint formats hold no such name at all, so a new backend is its own package and one line of the
registry."""
from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import yaml

from moe.backends.registry import BACKENDS, SPECS

REPO = Path(__file__).resolve().parents[1]
ALLOWED = ("moe/backends/",)
# the layers every backend shares: what they need of one they ask the registry
SHARED = ("moe/config/", "moe/train/environment.py", "moe/checkpoint/")
# the schema's defaults are conf/hardware/cpu.yaml's (plain DDP on the CPU), for a config built in code
SCHEMA_DEFAULTS = {("moe/config/schema.py", "ddp")}


def _presets() -> list[dict]:
    return [yaml.safe_load(p.read_text()) | {"name": p.stem} for p in (REPO / "conf/hardware").glob("*.yaml")]


def _names() -> set[str]:
    accelerators = {preset.get("accelerator") for preset in _presets()}
    return (set(SPECS) | accelerators) - {None, "cpu"}  # "cpu" is also a torch device type: caught below


def _sources(prefixes: tuple[str, ...]):
    for path in sorted((REPO / "moe").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith(prefixes):
            yield relative, path


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
    for relative, path in _sources(("moe/",)):
        if relative.startswith(ALLOWED):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in patterns):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "ask the backend's spec instead:\n" + "\n".join(found)


def test_the_shared_layers_hold_no_backend_name_nor_import_a_backend():
    """A name as a whole string (a table's key, a default, an argument) in the config layer, the environment
    check or the checkpoint formats is knowledge of that backend outside its package; so is an import of
    its package: they ask moe.backends.registry or moe.backends.accelerators. (Messages may name a
    preset, `hardware=trn1`, inside their text.)"""
    names = _names() | {preset["name"] for preset in _presets()} - {"cpu"}
    asked = {"moe.backends.registry", "moe.backends.accelerators"}
    found = []
    for relative, path in _sources(SHARED):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names and (relative, node.value) not in \
                    SCHEMA_DEFAULTS:
                found.append(f"{relative}:{node.lineno}: {node.value!r}")
            module = node.module if isinstance(node, ast.ImportFrom) else None
            imported = [a.name for a in node.names] if isinstance(node, ast.Import) else [module or ""]
            for name in imported:
                if name.startswith("moe.backends") and name not in asked:
                    found.append(f"{relative}:{node.lineno}: import {name}")
    assert not found, "ask moe.backends.registry (or .accelerators) instead:\n" + "\n".join(found)


def test_each_backend_is_one_package():
    """The registry's entry of a backend, its spec (spec.py's SPEC), its library's refusals and its Backend
    class, all in moe/backends/<its package>/."""
    for name, registered in BACKENDS.items():
        module, cls = registered.spec.backend.split(":")
        package = module.rpartition(".")[0]
        assert package.startswith("moe.backends.") and package.count(".") == 2, module
        assert importlib.import_module(f"{package}.spec").SPEC is registered.spec, name
        if registered.rules is not None:
            assert registered.rules.__module__ == f"{package}.rules", name
        backend = getattr(importlib.import_module(module), cls)
        assert backend.name == name == registered.spec.name


def test_validation_and_planning_read_the_backends_without_their_libraries():
    """A dry run on a laptop: the validator, the registry (every spec and refusal) and the environment check
    import no torch, Lightning or backend library (each package's __init__ is empty; its Backend is imported
    only when a run builds it)."""
    code = ("import sys, moe.config.validate, moe.backends.registry, moe.train.environment; "
            "print(sorted(m for m in ('torch', 'lightning', 'deepspeed', 'neuronx_distributed', 'torch_xla') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# trn1's words: its checkpoint format (neuronx-distributed's directory) is its package's
NXD_WORDS = re.compile(r"nxd|neuronx|neuron|trn1|xla", re.IGNORECASE)
REGISTERS = "moe.backends.checkpoint_formats"


def test_the_checkpoint_layer_names_no_backends_format():
    """The checkpoint layer reads trn1's checkpoints through a format its package registers
    (moe/backends/neuron/nxd_checkpoint.py, by moe.backends.checkpoint_formats): no file of moe/checkpoint
    names it, its library or its machine, in code, comments or docstrings."""
    found = [f"{relative}:{number}: {line.strip()}" for relative, path in _sources(("moe/checkpoint/",))
             for number, line in enumerate(path.read_text().splitlines(), 1) if NXD_WORDS.search(line)]
    assert not found, "keep it in moe/backends/neuron/ and register it:\n" + "\n".join(found)


def test_every_module_that_picks_or_reads_checkpoints_registers_the_backends_formats():
    """A command that reads a run's checkpoints (train's resume and preflight, infer.py, consolidation)
    finds a trn1 run's without building a Neuron backend: each module that imports the picker imports
    moe.backends.checkpoint_formats, whose import registers every backend's format."""
    missing = []
    for relative, path in _sources(("moe/",)):
        if relative.startswith("moe/checkpoint/"):
            continue
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        if "moe.checkpoint.picker" in imported and REGISTERS not in imported:
            missing.append(relative)
    assert not missing, f"import {REGISTERS} where the picker is imported:\n" + "\n".join(missing)


def test_a_fresh_process_finds_a_trn1_run_s_checkpoint_through_infer(tmp_path):
    """infer.py ckpt=RUN_DIR on a trn1 run, in a process that builds no backend: its newest complete NxD
    directory is found (not the unfinished one after it, nor the portable file before it) and its step
    read."""
    import torch

    checkpoints = tmp_path / "run" / "checkpoints"
    for step, done in ((3, True), (6, True), (9, False)):
        directory = checkpoints / f"step-{step:06d}.ckpt"
        (directory / "model").mkdir(parents=True)
        torch.save({"global_step": step}, directory / "user_content.pt")
        if done:
            (directory / "done").write_text("")
    torch.save({"global_step": 1, "state_dict": {}}, checkpoints / "step-000001.ckpt")
    code = ("import sys; from moe.infer.load import resolve_checkpoint; "  # infer.py ckpt='s own path
            "from moe.checkpoint.picker import verify_checkpoint; "
            "path = resolve_checkpoint(sys.argv[1], 'runs'); "
            "print(path.name, verify_checkpoint(path), 'neuronx_distributed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                         cwd=REPO)
    assert out.stdout.split() == ["step-000006.ckpt", "6", "False"], out.stdout + out.stderr
