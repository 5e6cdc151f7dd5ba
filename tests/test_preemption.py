"""SIGTERM mid-run: the step is checkpointed and train.py exits 143, not 0 (fast; the exact-resume
check with SIGTERM and SIGUSR1 is in tests/test_kill_resume.py, slow)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import torch
from conftest import FAST_RUN, REPO


def test_sigterm_saves_the_current_step_and_exits_143(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", *FAST_RUN,
           "trainer.max_steps=200", "trainer.checkpoint_every_n_steps=1000", "trainer.limit_val_batches=0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, deadline = run_dir / "metrics.csv", time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):  # header + 3 steps
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, output[-3000:]
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert 3 <= last["global_step"] < 200
    assert (run_dir / "checkpoints" / f"step-{last['global_step']:06d}.ckpt").exists()
    assert "stopped by SIGTERM" in output and not (run_dir / "summary.json").exists()


def test_sigusr1_in_a_slurm_job_without_scontrol_says_to_resubmit(monkeypatch, capsys):
    """A container started by SLURM often lacks its client tools: the requeue is reported, not a traceback."""
    from moe.train.preemption import requeue

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    requeue(5)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "SIGUSR1 after step 5: checkpoint saved; requeueing SLURM job 77"
    assert out[1].startswith("requeue of SLURM job 77: not requeued (") and out[1].endswith(
        "resubmit the job to resume from its checkpoint")
