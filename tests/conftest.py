"""Shared test helpers: run the real entry points in a subprocess, as users do."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAST_RUN = ("trainer.progress_bar=false", "trainer.log_every_n_steps=1")


def run_entry(script: str, *overrides: str, timeout: int = 600, env: dict | None = None, check: bool = False):
    """Run `python <script> overrides...` from the repo root; returns the CompletedProcess."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                **(env or {})}
    proc = subprocess.run([sys.executable, str(REPO / script), *overrides], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(overrides)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


@pytest.fixture
def train_run(tmp_path):
    """`train_run(*overrides)` trains into tmp_path/run and returns (run_dir, CompletedProcess)."""

    def _run(*overrides: str, run_dir: Path | None = None, check: bool = True, **kw):
        run_dir = run_dir or tmp_path / "run"
        proc = run_entry("train.py", f"hydra.run.dir={run_dir}", *FAST_RUN, *overrides, check=check, **kw)
        return run_dir, proc

    return _run
