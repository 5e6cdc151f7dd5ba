"""SIGKILL at several points (before the first checkpoint, just after one, half-way through a save),
relaunch the same command: the run ends where the uninterrupted one does, with the same losses step by
step (same data order, nothing trained twice or skipped) and the same parameters within 1e-6 (CPU fp32).
"""
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO

from moe.faults import KILL_DURING_SAVE_ENV, SIGNAL_IN_VALIDATION_ENV

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # signals sent at chosen moments

# Tiny model, 12 optimizer steps of 2 micro-batches, router jitter on (it draws random numbers),
# a checkpoint every 4 steps (keep 2), validation at 6 and 12.
RUN = ("model.hidden_size=64", "model.intermediate_size=64", "model.num_layers=2", "model.num_heads=2",
       "model.num_kv_heads=1", "model.num_experts=4", "moe_opt.jitter_eps=0.01", "trainer.micro_batch_size=2",
       "trainer.accumulate_grad_batches=2", "optimizer.warmup_steps=2", "trainer.max_steps=12",
       "trainer.checkpoint_every_n_steps=4", "trainer.keep_last_checkpoints=2",
       "trainer.val_check_interval=6", "trainer.limit_val_batches=1", "seed=7", "trainer.progress_bar=false",
       "trainer.log_every_n_steps=1")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
TIMEOUT = 900


def train_cmd(run_dir):
    return [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", *RUN]


def run_to_end(run_dir):
    cmd = train_cmd(run_dir)
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)


def launch(run_dir, log, env=ENV, *more):
    with open(log, "ab") as out:
        return subprocess.Popen([*train_cmd(run_dir), *more], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def wait_for(proc, condition, what):
    deadline = time.time() + TIMEOUT
    while not condition():
        assert proc.poll() is None, f"run ended (exit {proc.returncode}) before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def kill(proc):
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL


def rows(run_dir):
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def train_losses(run_dir):
    return [(int(r["step"]), float(r["loss"])) for r in rows(run_dir) if r["loss"]]


def val_losses(run_dir):
    return [(int(r["step"]), float(r["val_loss"])) for r in rows(run_dir) if r["val_loss"]]


def params(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def assert_same_run(run_dir, ref_dir):
    """Same final step, each step once with the reference's loss, same final parameters and loss."""
    got, want = train_losses(run_dir), train_losses(ref_dir)
    assert [s for s, _ in got] == list(range(1, 13))  # every step exactly once
    for (step, loss), (_, ref) in zip(got, want, strict=True):
        assert loss == pytest.approx(ref, abs=1e-6), f"step {step}: loss {loss} vs uninterrupted {ref}"
    assert [s for s, _ in val_losses(run_dir)] == [6, 12]
    for (_, loss), (_, ref) in zip(val_losses(run_dir), val_losses(ref_dir), strict=True):
        assert loss == pytest.approx(ref, abs=1e-6)
    ckpt, ref_ckpt = params(run_dir), params(ref_dir)
    assert ckpt["global_step"] == ref_ckpt["global_step"] == 12
    worst = max((t - ref_ckpt["state_dict"][k]).abs().max().item() for k, t in ckpt["state_dict"].items())
    assert worst <= 1e-6, f"final parameters differ by {worst}"
    summary, ref_summary = (json.loads((d / "summary.json").read_text()) for d in (run_dir, ref_dir))
    assert summary["steps"] == 12
    assert summary["final_loss"] == pytest.approx(ref_summary["final_loss"], abs=1e-6)
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    proc = run_to_end(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_sigkill_before_a_checkpoint_after_one_and_mid_save_then_resume_matches(tmp_path, reference):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    ckpts = run_dir / "checkpoints"
    hook = {**ENV, KILL_DURING_SAVE_ENV: "8"}  # launch 3 kills itself half-way through step-000008.ckpt

    # 1. before the first checkpoint: as soon as step 1 is logged
    proc = launch(run_dir, log, hook)
    wait_for(proc, lambda: train_losses(run_dir), "step 1")
    kill(proc)
    assert not (ckpts / "step-000004.ckpt").exists()

    # 2. just after a checkpoint: the moment step-000004.ckpt is complete (last.ckpt may be mid-write)
    proc = launch(run_dir, log, hook)
    wait_for(proc, lambda: (ckpts / "step-000004.ckpt.meta.json").exists(), "the step-4 checkpoint")
    kill(proc)

    # 3. half-way through writing the step-8 checkpoint (test hook: the process SIGKILLs itself)
    proc = launch(run_dir, log, hook)
    assert proc.wait(timeout=TIMEOUT) == -signal.SIGKILL
    assert (ckpts / "step-000008.ckpt.tmp").exists() and not (ckpts / "step-000008.ckpt").exists()
    assert max(s for s, _ in train_losses(run_dir)) == 8  # step 8 was trained, its checkpoint never landed

    # 4. the same command again finishes the job
    proc = launch(run_dir, log, hook)
    assert proc.wait(timeout=TIMEOUT) == 0, log.read_text()[-3000:]
    assert log.read_text().count("resuming from") == 2  # launches 3 and 4 (launch 2 found no checkpoint)
    assert_same_run(run_dir, reference)
    kept = {p.name for p in ckpts.glob("step-*.ckpt")}  # last 2, plus step 4 if it was the resume point
    assert {"step-000008.ckpt", "step-000012.ckpt"} <= kept <= {"step-000004.ckpt", "step-000008.ckpt",
                                                                "step-000012.ckpt"}


def test_supervisor_relaunches_a_run_killed_mid_save(tmp_path, reference):
    """Killed half-way through step 8's file, under moe.supervise: relaunched, it resumes from step 4
    (last.ckpt, a link, still points there: it is re-pointed only after a file has landed)."""
    run_dir = tmp_path / "run"
    env = {**ENV, KILL_DURING_SAVE_ENV: "8"}
    cmd = [sys.executable, "-m", "moe.supervise", "--max-restarts", "2", "--backoff", "0", "--",
           *train_cmd(run_dir)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=2 * TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    restarts = (run_dir / "restarts.log").read_text().splitlines()
    assert "killed by SIGKILL; restart 1/2" in restarts[0] and "finished after 1 restart(s)" in restarts[-1]
    assert f"resuming from {run_dir / 'checkpoints' / 'step-000004.ckpt'} at step 4" in proc.stdout
    assert_same_run(run_dir, reference)


def test_truncated_checkpoints_at_resume_are_reported_and_the_previous_one_is_used(tmp_path, reference):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir, symlinks=True)
    last = run_dir / "checkpoints" / "last.ckpt"
    assert os.readlink(last) == "step-000012.ckpt"
    newest = run_dir / "checkpoints" / "step-000012.ckpt"  # a crash of the storage, not of the writer
    newest.write_bytes(newest.read_bytes()[:4096])
    proc = run_to_end(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint {newest} is 4096 bytes" in proc.stderr
    assert "(truncated); falling back to the previous checkpoint" in proc.stderr
    assert f"checkpoint {last} " not in proc.stderr  # the link is its target, checked once
    assert f"resuming from {run_dir / 'checkpoints' / 'step-000008.ckpt'}" in proc.stdout
    assert_same_run(run_dir, reference)  # steps 9-12 retrained to the same result


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT],
                         ids=["SIGTERM", "SIGUSR1", "SIGINT"])
def test_preemption_signal_saves_the_step_exits_nonzero_and_resumes_exactly(tmp_path, reference, signum):
    """A SLURM/Kubernetes pre-emption between two scheduled checkpoints: the step in progress is saved,
    the exit status is 128 + the signal (a supervisor never reads it as success), the relaunch ends
    where the uninterrupted run does, with the same losses."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    proc = launch(run_dir, log)
    wait_for(proc, lambda: any(s >= 5 for s, _ in train_losses(run_dir)), "step 5")
    proc.send_signal(signum)
    assert proc.wait(timeout=TIMEOUT) == 128 + signum, log.read_text()[-3000:]
    stopped = params(run_dir)["global_step"]
    assert 5 <= stopped < 12 and (run_dir / "checkpoints" / f"step-{stopped:06d}.ckpt").exists()
    assert f"stopped by {signal.Signals(signum).name} after step {stopped}" in log.read_text()
    proc = launch(run_dir, log)
    assert proc.wait(timeout=TIMEOUT) == 0, log.read_text()[-3000:]
    assert_same_run(run_dir, reference)


def test_a_signal_during_validation_stops_when_that_pass_ends(tmp_path):
    """SIGTERM while step 6's validation runs: the pass ends, step 6 is checkpointed and the run stops
    (exit 143), instead of training step 7 first."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    proc = launch(run_dir, log, env={**ENV, SIGNAL_IN_VALIDATION_ENV: "SIGTERM"})
    assert proc.wait(timeout=TIMEOUT) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert "stopped by SIGTERM after step 6" in log.read_text()
    assert params(run_dir)["global_step"] == 6  # last.ckpt: the validated step, not step 7
    assert [step for step, _ in val_losses(run_dir)] == [6] and max(s for s, _ in train_losses(run_dir)) == 6


def test_sigint_twice_stops_at_once_without_a_traceback(tmp_path):
    """Ctrl-C: the first asks for a checkpointed stop at the step's end, a second one stops now (exit 130);
    the checkpoints already written are whole."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    proc = launch(run_dir, log, ENV, "data.seq_len=512", "model.hidden_size=256")  # steps long enough to
    wait_for(proc, lambda: any(s >= 2 for s, _ in train_losses(run_dir)), "step 2")  # press twice in one
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 128 + signal.SIGINT, log.read_text()[-3000:]
    text = log.read_text()
    assert "second SIGINT: stopping now, without a checkpoint" in text and "Traceback" not in text
    assert not list(run_dir.glob("checkpoints/*.tmp"))
