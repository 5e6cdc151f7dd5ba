"""How many intra-op threads a CPU process of a run uses, and why: said once when the run starts.

The environment's OMP_NUM_THREADS wins (a user's choice, or the 1 torchrun sets for each of several
processes); without it the node's cores are shared among its processes, so two ranks on two cores
do not each start two threads and fight over them.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from moe.errors import UserError

THREADS_ENV = "OMP_NUM_THREADS"


class Threads(NamedTuple):
    count: int
    reason: str  # what chose the count, for the start-up line


def cpu_threads(processes_per_node: int, environ=os.environ) -> Threads:
    """OMP_NUM_THREADS when set (a UserError unless a positive whole number), else cores // processes."""
    given = environ.get(THREADS_ENV, "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise UserError(THREADS_ENV, given, f"set {THREADS_ENV} to a positive whole number (threads per "
                            "process), or unset it to share the cores among the processes",
                            problem="is not a thread count")
        return Threads(int(given), f"{THREADS_ENV}={given}")
    cores = os.cpu_count() or 1
    count = max(1, cores // processes_per_node)
    processes = f"{processes_per_node} process{'es' if processes_per_node > 1 else ''}"
    return Threads(count, f"{cores} cores / {processes} a node; {THREADS_ENV} overrides")
