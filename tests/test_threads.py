"""A CPU run's intra-op threads: the environment's OMP_NUM_THREADS wins, else the node's cores shared among
its processes (moe/backends/threads.py); train.py says which once at start (tests/test_run_output.py)."""
import os

import pytest

from moe.backends.threads import cpu_threads
from moe.errors import UserError


def test_the_environment_wins_over_the_share_of_the_cores():
    assert cpu_threads(2, {"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS=3")
    cores = os.cpu_count() or 1
    count, reason = cpu_threads(2, {})
    assert count == max(1, cores // 2)
    assert reason == f"{cores} cores / 2 processes a node; OMP_NUM_THREADS overrides"


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_a_count_that_is_not_a_positive_whole_number_is_refused(value):
    with pytest.raises(UserError, match=f"OMP_NUM_THREADS='{value}' is not a thread count.*positive whole"):
        cpu_threads(1, {"OMP_NUM_THREADS": value})
