"""One run per directory (moe/train/run_lock.py): a second launch into a live run's directory exits 2
naming it and touches nothing; a lock left by a dead run is taken over with one line; a requeued
job waits for its predecessor's lock."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from conftest import FAST_RUN, REPO, run_entry

from moe.train.run_lock import LOCK_NAME, RunLock

HOLD = """
import sys, time
from moe.train.run_lock import RunLock
lock = RunLock(sys.argv[1], None)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
lock.release()
"""


def _holder(run_dir, seconds: float) -> subprocess.Popen:
    """Another process holding the run dir's lock for `seconds` (a live run)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), str(seconds)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_launch_into_a_live_runs_directory_exits_2_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir, 60)
    try:
        before = sorted(p.name for p in run_dir.iterdir())
        proc = run_entry("train.py", f"hydra.run.dir={run_dir}", *FAST_RUN, "trainer.max_steps=2")
        assert proc.returncode == 2, proc.stderr[-2000:]
        says = proc.stderr
        assert "is in use by a live run" in says and f"PID {holder.pid}" in says
        assert socket.gethostname() in says and "since 20" in says and "Traceback" not in says
        assert sorted(p.name for p in run_dir.iterdir()) == before == [LOCK_NAME]  # no .hydra/, no train.log
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_runs_lock_is_taken_over_with_one_line(tmp_path, train_here, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = {"host": "node-7", "pid": 999999, "since": "2026-11-25T03:00:00+00:00"}
    (run_dir / LOCK_NAME).write_text(json.dumps(dead))  # its name, but no process holds the lock
    train_here("trainer.max_steps=2", "trainer.limit_val_batches=0", run_dir=run_dir)
    err = capsys.readouterr().err
    assert "took over the run lock of node-7 PID 999999, since 2026-11-25T03:00:00+00:00" in err
    assert (run_dir / LOCK_NAME).read_text() == ""  # a clean end clears the holder's name


def test_a_requeued_job_waits_for_its_predecessors_lock(tmp_path, train_here, monkeypatch):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir, 2)  # the predecessor winds down for 2 s
    try:
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued: waits up to 120 s (lock_wait_s=null)
        train_here("trainer.max_steps=2", "trainer.limit_val_batches=0", run_dir=run_dir)
        assert (run_dir / "metrics.csv").exists()
    finally:
        holder.wait(timeout=60)


def test_the_lock_names_its_holder_while_the_run_lives(tmp_path):
    lock = RunLock(tmp_path, None)
    try:
        held = json.loads((tmp_path / LOCK_NAME).read_text())
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
    finally:
        lock.release()
