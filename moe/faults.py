"""Fault injection for tests: kill a process half-way through writing a checkpoint, or make a rank die
or stall in an expert-parallel all-to-all.

Not for real runs. A test sets `MOE_TEST_KILL_DURING_SAVE` in the environment of a training process
it launches ("<step>", or "<step>:<file name>"): the save of that step's checkpoint then writes half
of its temporary file, fsyncs it and SIGKILLs its own process, once per run dir (a marker file next
to the checkpoints remembers it fired). tests/test_kill_resume.py and tests/test_supervise.py use it
to show that a kill mid-save leaves the previous checkpoint to resume from.

`MOE_TEST_FAULT_IN_ALL_TO_ALL` ("<rank>:<call>:kill" or "<rank>:<call>:stall:<seconds>"): global rank
<rank> SIGKILLs itself, or sleeps, as it enters its <call>-th expert-parallel all-to-all (1-based), once
per process; tests/test_collective_failure.py shows the peer then stops naming the rank and collective.
`MOE_TEST_SIGNAL_IN_VALIDATION` ("SIGTERM", "SIGINT", ...): the process signals itself during its first
validation pass (tests/test_kill_resume.py).
`MOE_TEST_PAUSE_BEFORE_RENAME` ("<file or directory name>"): a write of the product to a path of that name
(moe.outputs.atomic_path and publish, moe.checkpoint.io.atomic_torch_save) says so on stderr with its
temporary file or directory written, and waits before renaming it into place, so that a test can press
Ctrl-C there (tests/test_around_the_run.py). Unset, nothing happens.
"""
from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

KILL_DURING_SAVE_ENV = "MOE_TEST_KILL_DURING_SAVE"
FAULT_IN_ALL_TO_ALL_ENV = "MOE_TEST_FAULT_IN_ALL_TO_ALL"
_ALL_TO_ALL_CALLS = {"count": 0}


SIGNAL_IN_VALIDATION_ENV = "MOE_TEST_SIGNAL_IN_VALIDATION"


def maybe_signal_in_validation(batch_idx: int) -> None:
    """`MOE_TEST_SIGNAL_IN_VALIDATION` ("SIGTERM", ...): the process signals itself as its first validation
    pass starts its first batch (once per process)."""
    name = os.environ.get(SIGNAL_IN_VALIDATION_ENV)
    if not name or batch_idx != 0 or _SIGNALLED["done"]:
        return
    _SIGNALLED["done"] = True
    print(f"{SIGNAL_IN_VALIDATION_ENV}: sending {name} to this process during validation", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), getattr(signal, name))


_SIGNALLED = {"done": False}


def maybe_fail_in_all_to_all(group) -> None:
    spec = os.environ.get(FAULT_IN_ALL_TO_ALL_ENV)
    if not spec:
        return
    import time

    import torch.distributed as dist

    rank, call, action, *rest = spec.split(":")
    if dist.get_rank() != int(rank):
        return
    _ALL_TO_ALL_CALLS["count"] += 1
    if _ALL_TO_ALL_CALLS["count"] != int(call):
        return
    print(f"{FAULT_IN_ALL_TO_ALL_ENV}: rank {rank} {action}s in its all-to-all #{call}", file=sys.stderr,
          flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(rest[0]) if rest else 3600.0)


def maybe_kill_during_save(obj: Any, path: Path, tmp: Path, step: int | None) -> None:
    spec = os.environ.get(KILL_DURING_SAVE_ENV)
    if not spec or step is None:
        return
    import torch

    want_step, _, want_name = spec.partition(":")
    marker = path.with_name(f".{KILL_DURING_SAVE_ENV}-{step}")
    if int(want_step) != step or (want_name and want_name != path.name) or marker.exists():
        return
    marker.touch()
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    with open(tmp, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
    print(f"{KILL_DURING_SAVE_ENV}: killing this process half-way through writing {tmp}", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


PAUSE_BEFORE_RENAME_ENV = "MOE_TEST_PAUSE_BEFORE_RENAME"


def maybe_pause_before_rename(tmp: Path, path: Path) -> None:
    """`MOE_TEST_PAUSE_BEFORE_RENAME=<name>`: before `tmp` is renamed to `path` (named <name>), say so on
    stderr and wait (600 s at most): a test signals the process there, its temporary file or directory
    written."""
    if os.environ.get(PAUSE_BEFORE_RENAME_ENV) != Path(path).name:
        return
    sys.stderr.write(f"{PAUSE_BEFORE_RENAME_ENV}: {tmp} written, waiting before renaming it to {path}\n")
    sys.stderr.flush()
    time.sleep(600)
