"""Every bench/ script runs from the repository root of a checkout where the package is not installed (a GPU
image with its own torch: `make gpu-check`, bench/gpu_moe_stack.py), as `python bench/<script>.py`.

Each script is loaded in a fresh interpreter whose import system has no installed `moe` (the editable
install's finder removed, the repository not on the path): what it imports at the top must resolve, and a
script that uses `moe` anywhere must have put the checkout on the path itself.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.conftest import REPO

SCRIPTS = sorted((REPO / "bench").glob("*.py"))

LOAD = """
import importlib.util, json, runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
clean_path = [p for p in sys.path if p not in ("", {repo!r})]
failures = {{}}
for script, uses_moe in json.loads({scripts!r}):
    for name in [m for m in sys.modules if m == "moe" or m.startswith("moe.")]:
        del sys.modules[name]
    sys.path[:] = clean_path
    if importlib.util.find_spec("moe") is not None:
        raise SystemExit("moe is importable before the script ran: the check proves nothing")
    sys.path.insert(0, {bench!r})  # what `python bench/<script>.py` puts first
    try:
        runpy.run_path(script, run_name="bench_import_check")  # its imports, not its main()
        if uses_moe:
            import moe
            assert moe.__file__.startswith({repo!r}), moe.__file__
    except BaseException as err:
        failures[script] = repr(err)
print(json.dumps(failures))
"""


def test_every_bench_script_loads_from_a_checkout_without_the_package_installed(tmp_path):
    """One interpreter (torch imported once); `moe` forgotten and the path reset before each script."""
    scripts = [(str(p), bool(re.search(r"^\s*(from|import) moe\b", p.read_text(), re.M))) for p in SCRIPTS]
    code = LOAD.format(repo=str(REPO), bench=str(REPO / "bench"), scripts=json.dumps(scripts))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(SCRIPTS) >= 11 and failures == {}, failures


def test_make_gpu_check_runs_the_venvs_python_where_there_is_one(tmp_path):
    """A fresh clone's `make gpu-check ARGS=--cpu-smoke` runs on the venv `make setup` made (the system
    python3 may have no torch); without a venv, the image's python3."""
    for venv, python in ((REPO / ".venv", ".venv/bin/python"), (tmp_path / "none", "python3")):
        command = ["make", "-n", "--no-print-directory", "-C", str(REPO), "gpu-check", f"VENV={venv}",
                   "ARGS=--cpu-smoke"]
        said = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        assert said.split()[:3] == [str(venv / "bin/python") if venv.exists() else python,
                                    "bench/gpu_check.py", "--cpu-smoke"]
