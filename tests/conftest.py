"""Shared test helpers: run the real entry points in a subprocess, as users do."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FAST_RUN = ("trainer.progress_bar=false", "trainer.log_every_n_steps=1")


def run_entry(script: str, *overrides: str, timeout: int = 600, env: dict | None = None, check: bool = False):
    """Run `python <script> overrides...` from the repo root; returns the CompletedProcess."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                **(env or {})}
    proc = subprocess.run([sys.executable, str(REPO / script), *overrides], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        command = f"{script} {' '.join(overrides)}"
        output = f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        raise AssertionError(f"{command} exited {proc.returncode}:\n{output}")
    return proc


@pytest.fixture
def train_run(tmp_path):
    """`train_run(*overrides)` trains into tmp_path/run and returns (run_dir, CompletedProcess)."""

    def _run(*overrides: str, run_dir: Path | None = None, check: bool = True, **kw):
        run_dir = run_dir or tmp_path / "run"
        proc = run_entry("train.py", f"hydra.run.dir={run_dir}", *FAST_RUN, *overrides, check=check, **kw)
        return run_dir, proc

    return _run


def free_port() -> int:
    """A free TCP port on loopback, for a test's own torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops on a shared 2-core box: one intra-op thread avoids spin-wait stalls (often 10x faster).

    Use with `pytestmark = pytest.mark.usefixtures("one_thread")`.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
