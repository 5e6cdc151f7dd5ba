"""The ranks a process launched (moe.train.local_ranks), against Lightning's own child-process observer
made to look every 0.1 s instead of every 5: once the run has taken the ranks over, the observer never
SIGKILLs rank 0; a launched rank's loss that rank 0 does not report itself within the grace ends the
process with exit 3 and the run's paragraph; one that rank 0 reports leaves its exit to rank 0. The
end-to-end run (train.py, two ranks, gloo): tests/test_collective_failure.py."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from moe.errors import COLLECTIVE_FAILED_EXIT

RANK_0 = """
import os, subprocess, sys, time
from types import SimpleNamespace
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from moe.train import local_ranks

local_ranks.REPORT_GRACE_S = 0.5
rank_1 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(7)"])
launcher = SimpleNamespace(procs=[rank_1])  # as Lightning's launcher holds them, and hands them its observer
_ChildProcessObserver(main_pid=os.getpid(), child_processes=launcher.procs, sleep_period=0.1).start()
ranks = local_ranks.LocalRanks()
ranks.setup(SimpleNamespace(strategy=SimpleNamespace(launcher=launcher)), None, "fit")
assert launcher.procs == [rank_1]  # Lightning's kill() still reaches it
with ranks.watched(lambda what: f"error: {what}. (the run's paragraph)"):
    if sys.argv[1] == "reports":  # rank 0 sees the loss itself (gloo): it leaves the watch, then exits
        rank_1.wait()
    else:  # rank 0 never sees it (a collective that waits on a dead peer)
        time.sleep(30)
time.sleep(1)  # ten looks of the observer
"""


@pytest.mark.parametrize("rank_0, exit_code, says", [
    ("reports", 0, ""),
    ("sees_nothing", COLLECTIVE_FAILED_EXIT,
     "error: local rank 1 (pid {pid}), which this process launched, ended (exit code 7) and rank 0 saw no "
     "collective fail within 0.5 s. (the run's paragraph)"),
])
def test_a_launched_rank_lost_ends_rank_0_with_its_own_exit_not_lightnings_sigkill(rank_0, exit_code, says):
    proc = subprocess.run([sys.executable, "-c", RANK_0, rank_0], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == exit_code, proc.stderr[-2000:]  # Lightning's observer: -9
    if says:
        assert says.split("(pid")[0] in proc.stderr and says.split("{pid}")[1] in proc.stderr, proc.stderr
