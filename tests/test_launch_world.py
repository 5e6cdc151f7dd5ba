"""The launcher's world, before anything is written: what torchrun, srun or Lightning's multi-node form set
must match trainer.devices x trainer.num_nodes and be whole, and the rendezvous port must be free; each
mismatch is one paragraph and exit 2 with no run dir, never a rendezvous that waits for ranks that never
come. train.py runs in this process (its real __main__: preflight, Hydra), with the launcher's variables."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import FAST_RUN, REPO, run_entry
from test_bad_inputs import assert_user_error

LAUNCHERS = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
             "SLURM_NNODES", "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_PROCID", "TORCHELASTIC_RESTART_COUNT")
TORCHRUN = {"TORCHELASTIC_RUN_ID": "run-1", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """The test process's own environment names no launcher (CI may run under one)."""
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)


def train_py(tmp_path, *overrides, env):
    proc = run_entry("train.py", f"hydra.run.dir={tmp_path / 'run'}", *overrides, env=env, here=True)
    assert not (tmp_path / "run").exists(), "a refused launch left a run dir"
    return proc.returncode, proc.stderr


CASES = [
    ("torchrun started more processes than the config asks for",
     {**TORCHRUN, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, ["trainer.devices=2"],
     "trainer.devices", "2", "torchrun started WORLD_SIZE=4, LOCAL_WORLD_SIZE=2",
     "trainer.devices=2 trainer.num_nodes=2"),
    ("torchrun started fewer processes a node than trainer.devices",
     {**TORCHRUN, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, ["trainer.devices=2", "parallel=dp2"],
     "trainer.devices", "2", "LOCAL_WORLD_SIZE=1", "--nproc_per_node=2"),
    ("torchrun's variables half set",
     {"TORCHELASTIC_RUN_ID": "run-1", "RANK": "0", "WORLD_SIZE": "2"}, ["trainer.devices=2", "parallel=dp2"],
     "environment", "'TORCHELASTIC_RUN_ID=run-1'", "LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, "
     "MASTER_PORT are not set", "launch it with torchrun"),
    ("torchrun's variables without torchrun",
     {"RANK": "1", "LOCAL_WORLD_SIZE": "2"}, [], "environment", "'LOCAL_WORLD_SIZE, RANK'", "not by torchrun",
     "unset them"),
    ("WORLD_SIZE against the config's world",
     {"WORLD_SIZE": "4"}, ["trainer.devices=2", "parallel=dp2"], "trainer.devices", "2",
     "asks for 2 processes and WORLD_SIZE=4 is set", "unset WORLD_SIZE"),
    ("several nodes without a node rank or a master address",
     {}, ["trainer.num_nodes=2", "parallel=dp2"], "trainer.num_nodes", "2",
     "MASTER_ADDR, NODE_RANK are not set", "launch each node with torchrun"),
    ("srun tasks a node against trainer.devices",
     {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_JOB_ID": "7",
      "SLURM_JOB_NAME": "moe", "SLURM_PROCID": "0"},
     ["trainer.devices=1", "trainer.num_nodes=2", "parallel=dp2"],
     "trainer.devices", "1", "--ntasks-per-node=2, --nodes=2", "trainer.devices=2 trainer.num_nodes=2"),
    ("srun --ntasks without --ntasks-per-node",
     {"SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "moe", "SLURM_PROCID": "0"},
     ["trainer.devices=2", "parallel=dp2"], "environment", "'SLURM_NTASKS=2'", "without --ntasks-per-node",
     "--ntasks-per-node=2"),
]


@pytest.mark.parametrize("case, env, overrides, field, value, problem, fix", CASES, ids=[c[0] for c in CASES])
def test_a_launcher_world_the_config_does_not_ask_for_is_refused(tmp_path, case, env, overrides, field, value,
                                                                  problem, fix):
    code, err = train_py(tmp_path, *overrides, env=env)
    assert_user_error(code, err, field, value, fix, problem)


@pytest.fixture
def taken_port():
    """A port another process listens on, as a second run's rendezvous would."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def test_a_rendezvous_port_in_use_is_refused_before_the_run_starts(tmp_path, taken_port):
    code, err = train_py(tmp_path, "parallel=dp2", "trainer.devices=2", env={"MASTER_PORT": str(taken_port)})
    assert_user_error(code, err, "MASTER_PORT", str(taken_port), "set MASTER_PORT to a free port",
                      "is in use on this host")


def test_a_port_taken_after_the_preflight_stops_the_launched_ranks_and_exits_2(tmp_path, taken_port,
                                                                               train_here):
    """The port is taken between the preflight's look and the rendezvous (train() without the preflight):
    rank 0 reports the port, not a lost peer, and the rank it launched is stopped rather than left waiting."""
    from moe.errors import UserError

    run_dir = tmp_path / "race"
    with pytest.raises(UserError) as err:
        train_here("parallel=dp2", "trainer.devices=2", run_dir=run_dir, env={"MASTER_PORT": str(taken_port)})
    assert err.value.field == "MASTER_PORT" and "the ranks it launched were stopped" in str(err.value)
    deadline = time.monotonic() + 20
    while _ranks_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ranks_of(run_dir), "the launched rank 1 was left running"


@pytest.mark.slow
@pytest.mark.serial  # "gone within seconds"
def test_a_rank_lightning_launched_ends_with_rank_0_however_rank_0_ends(tmp_path):
    """rank 0 SIGKILLed (nothing of it runs to stop its ranks): the rank it launched is gone within seconds
    (the kernel's PR_SET_PDEATHSIG), instead of waiting in its rendezvous or a collective for a peer that is
    gone, up to parallel.collective_timeout_s."""
    run_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", "parallel=dp2",
               "trainer.devices=2", "trainer.max_steps=100000", *FAST_RUN]
    rank0 = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _ranks_of(run_dir, "train_ddp_process_1") and time.monotonic() < deadline:
            assert rank0.poll() is None, "rank 0 ended before it launched rank 1"
            time.sleep(0.1)
        launched = _ranks_of(run_dir, "train_ddp_process_1")
        assert launched, "rank 0 launched no rank within 120 s"
        time.sleep(1.0)  # rank 1 past its start-up, in the launch or the fit
        rank0.kill()
        rank0.wait()
        deadline = time.monotonic() + 10
        while _ranks_of(run_dir, "train_ddp_process_1") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _ranks_of(run_dir, "train_ddp_process_1"), "rank 1 outlived rank 0"
    finally:
        rank0.kill()
        for pid in _ranks_of(run_dir):
            os.kill(int(pid), signal.SIGKILL)


def _ranks_of(run_dir, name: str = "") -> list[str]:
    found = subprocess.run(["pgrep", "-f", f"hydra.run.dir=\"?{run_dir}\"? .*{name}"], capture_output=True,
                           text=True)
    return found.stdout.split()


def table_rows() -> list[tuple[str, str, int, str]]:
    """This module's cases as rows of docs/FAULT_TOLERANCE.md's "Around a run" table (made by
    tests/test_around_the_run.py): case, command, exit status, the first line asserted."""
    rows = [(case, " ".join([*(f"{k}={v}" for k, v in env.items()), "train.py", *overrides]), 2,
             f"error: {field}={value} ... {problem} ... Fix: ... {fix} ...")
            for case, env, overrides, field, value, problem, fix in CASES]
    port = "error: MASTER_PORT={port} is in use on this host ... Fix: set MASTER_PORT to a free port ..."
    rows.append(("a rendezvous port in use is refused before the run starts",
                 "MASTER_PORT=<taken> train.py parallel=dp2 trainer.devices=2", 2, port))
    rows.append(("a port taken after the preflight stops the launched ranks and exits 2",
                 "train() with MASTER_PORT=<taken> parallel=dp2 trainer.devices=2", 2,
                 port.replace("...", "... the ranks it launched were stopped", 1)))
    return rows
