"""The cluster engine for real: a SLURM cluster of two nodes on this host (tests/slurm/cluster.sh, Debian's
slurmctld, a slurmd per node and munge) runs the sbatch scripts users submit (slurm/, docs/CLUSTERS.md,
docs/TRAINIUM.md): (a) 2 tasks on one node with parallel=dp2 train; (b) the same job pre-empted with SIGUSR1
mid-run saves, requeues itself and its requeued start resumes with the uninterrupted run's losses, step for
step; (c) a submitit sweep runs each point as a SLURM job; (d) the trn1 form (srun of torchrun per node)
trains at 2 processes; (e) the GPU script at --nodes=2, a task on each node, trains (a)'s first steps.
`make test-slurm`; about 2 minutes (a requeued job is started at once: `scontrol update StartTime=now`).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, compose_cfg, trained_rows

pytestmark = pytest.mark.slurm

STEPS = 12
RUN = ("hardware=cpu", "parallel=dp2", f"trainer.max_steps={STEPS}", "trainer.checkpoint_every_n_steps=100",
       "trainer.progress_bar=false", "trainer.log_every_n_steps=1", "optimizer.warmup_steps=2")
ON_CPU = ("--nodes=1", "--cpus-per-task=1", "--gpus-per-node=0")  # the script asks for GPUs; none here
TIMEOUT = 300


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The cluster, started for this module and stopped after; yields the environment its clients need."""
    env = {**os.environ, "SLURM_TEST_DIR": str(tmp_path_factory.mktemp("slurm")), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    for name in [k for k in env if k.startswith("SLURM_") and k != "SLURM_TEST_DIR"]:
        del env[name]  # not a job of an outer SLURM
    script = REPO / "tests" / "slurm" / "cluster.sh"
    started = subprocess.run(["bash", str(script), "start"], env=env, capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    env["SLURM_CONF"] = started.stdout.strip().split("=", 1)[1]
    yield env
    subprocess.run(["bash", str(script), "stop"], env=env)


def sbatch(env, *args) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def job_field(env, job: str, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith(f"{field}=")), "")


def wait_until_done(env, job: str, log: Path) -> str:
    deadline = time.time() + TIMEOUT
    while (state := job_field(env, job, "JobState")) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.time() < deadline, f"job {job} still {state}:\n{read(log)}"
        time.sleep(1)
    assert state == "COMPLETED", f"job {job} {state}:\n{read(log)}"
    return state


def release_when_requeued(env, job: str, log: Path) -> None:
    """A requeued job waits for a begin time SLURM sets a minute or two ahead (idle time, nothing of ours
    runs): once it is pending again, start it now, as an administrator would (`scontrol update
    StartTime=now`); what is tested, the requeue and the resume, is the same."""
    deadline = time.time() + TIMEOUT
    while job_field(env, job, "Restarts") != "1":
        assert time.time() < deadline, f"job {job} was not requeued:\n{read(log)}"
        time.sleep(0.2)
    if job_field(env, job, "JobState") == "PENDING":
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True)


def read(path: Path) -> str:
    return path.read_text()[-4000:] if path.exists() else "(no output)"


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r["loss"])) for r in trained_rows(run_dir)]


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """(a): slurm/train_gpu.sbatch at 2 tasks, parallel=dp2: both ranks in one world, the run trains."""
    out = tmp_path_factory.mktemp("a")
    job = sbatch(slurm, *ON_CPU, "--ntasks-per-node=2", f"--output={out}/job.out", "slurm/train_gpu.sbatch",
                 *RUN, f"hydra.run.dir={out}/run")
    wait_until_done(slurm, job, out / "job.out")
    assert "MEMBER: 2/2" in read(out / "job.out")
    got = losses(out / "run")
    assert [s for s, _ in got] == list(range(1, STEPS + 1)) and got[-1][1] < got[0][1]
    return got


def test_the_gpu_sbatch_script_trains_two_tasks_as_one_dp2_world(uninterrupted):
    assert len(uninterrupted) == STEPS


def test_sigusr1_saves_requeues_and_the_requeued_job_resumes_step_for_step(slurm, uninterrupted, tmp_path):
    """(b): `scancel --signal=USR1` mid-run: the step is checkpointed, rank 0 requeues the job, and the
    requeued start (same job id, so the same default run dir, runs/moe-gpu-<id>-<digest>) resumes from it."""
    log = tmp_path / "job.out"
    job = sbatch(slurm, *ON_CPU, "--ntasks-per-node=2", "--open-mode=append", f"--output={log}",
                 "slurm/train_gpu.sbatch", *RUN)
    digest = compose_cfg(*RUN).run_name.rsplit("-", 1)[1]  # the experiment's: the same inside the job
    run_dir = REPO / "runs" / f"moe-gpu-{job}-{digest}"
    try:
        deadline = time.time() + TIMEOUT
        while not any(s >= 3 for s, _ in losses(run_dir)):
            assert job_field(slurm, job, "JobState") in ("PENDING", "RUNNING"), read(log)
            assert time.time() < deadline, read(log)
            time.sleep(0.1)
        subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True)
        release_when_requeued(slurm, job, log)
        wait_until_done(slurm, job, log)
        assert job_field(slurm, job, "Restarts") == "1", read(log)
        text = log.read_text()
        assert f"checkpoint saved; requeueing SLURM job {job}" in text  # then SLURM ends the job's processes
        assert "resuming from" in text
        got = losses(run_dir)
        assert [s for s, _ in got] == list(range(1, STEPS + 1)), "every step once"
        for (step, loss), (_, ref) in zip(got, uninterrupted, strict=True):
            assert loss == pytest.approx(ref, abs=1e-6), f"step {step}: {loss} vs uninterrupted {ref}"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_a_submitit_sweep_runs_each_point_as_a_slurm_job(slurm, tmp_path):
    """(c): `train.py -m +sweep=capacity_factor_slurm` with CPU-sized overrides: one job per point."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "train.py", "-m", "+sweep=capacity_factor_slurm", "hardware=cpu",
         "trainer.devices=1", "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1",
         "hydra.launcher.partition=test",
         "trainer.max_steps=3", "trainer.progress_bar=false", "trainer.log_every_n_steps=1",
         "moe_opt.capacity_factor=1.0,null",
         f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=slurm, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for point in ("0", "1"):
        assert [s for s, _ in losses(sweep / point)] == [1, 2, 3]
        assert (sweep / point / "summary.json").exists()
    assert len(list((sweep / ".submitit").glob("*_*/*_log.out"))) == 2, "each point its own SLURM job"


def test_the_trn1_launch_form_srun_of_torchrun_trains_at_two_processes(slurm, tmp_path):
    """(d): slurm/train_trn1.sbatch (one task per node, torchrun starts the ranks), 2 per node, on CPU."""
    env = {**slurm, "VENV": str(Path(sys.executable).parents[1]), "NPROC_PER_NODE": "2",
           "MASTER_PORT": "29531"}
    log = tmp_path / "job.out"
    job = sbatch(env, "--nodes=1", "--cpus-per-task=2", f"--output={log}", "slurm/train_trn1.sbatch",
                 "hardware=cpu", "parallel=dp2", "trainer.max_steps=3", "trainer.progress_bar=false",
                 "trainer.log_every_n_steps=1",
                 f"hydra.run.dir={tmp_path}/run")
    wait_until_done(env, job, log)
    assert "MEMBER: 2/2" in read(log)
    assert [s for s, _ in losses(tmp_path / "run")] == [1, 2, 3]


def test_the_gpu_sbatch_script_at_two_nodes_trains_the_one_node_runs_steps(slurm, uninterrupted, tmp_path):
    """(e): slurm/train_gpu.sbatch at --nodes=2 --ntasks-per-node=1 (trainer.num_nodes=2 from SLURM_NNODES,
    Lightning's MASTER_ADDR the job's first node): one dp2 world across the two nodes' slurmd trains (a)'s
    run, whose 2 tasks shared one node. Its first 3 steps: their learning rates (the 2-step warm-up, then the
    peak) do not depend on max_steps, and a process here has 2 intra-op threads (cores / tasks per node: two
    processes on 2 cores run 10x slower than (a)'s one thread each), so matmuls sum in another order from
    (a)'s, 2e-6 apart by step 4 (measured)."""
    log = tmp_path / "job.out"
    job = sbatch(slurm, "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0",
                 f"--output={log}", "slurm/train_gpu.sbatch", *RUN, "trainer.max_steps=3",
                 f"hydra.run.dir={tmp_path}/run")
    wait_until_done(slurm, job, log)
    assert job_field(slurm, job, "NumNodes") == "2", job_field(slurm, job, "NodeList")
    text = read(log)
    assert "MEMBER: 1/2" in text and "MEMBER: 2/2" in text, text
    got = losses(tmp_path / "run")
    assert [s for s, _ in got] == [1, 2, 3]
    for (step, loss), (_, ref) in zip(got, uninterrupted[:3], strict=True):
        assert loss == pytest.approx(ref, abs=1e-5), f"step {step}: {loss} at 2 nodes vs {ref} at 1"
