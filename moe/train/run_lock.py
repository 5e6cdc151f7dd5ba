"""One run per directory: an OS advisory lock (flock) on `<run dir>/.run.lock` for the run's lifetime.

The launching rank (rank zero) takes it before training and keeps it until the run ends; the kernel
drops it when the process dies, however it dies. The file also names its holder (host, PID, since
when), so a second launch into a live run's directory is refused (exit 2) naming the run it would
have trained beside, and a launch that finds the name of a holder that is gone (crashed, SIGKILLed,
a node lost) takes the lock over with one line saying so. A requeued job may start while its
predecessor still winds down: `lock_wait_s` (null: 120 s when SLURM says the job was requeued, else
none) is how long a launch waits for the lock before giving up.

flock is the OS's lock (fcntl.flock); on NFS, Linux maps it to POSIX byte-range locks, which the
server tracks, so two nodes sharing a run directory exclude each other too.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from moe.errors import UserError

LOCK_NAME = ".run.lock"
REQUEUED_WAIT_S = 120.0


def wait_of(lock_wait_s: float | None) -> float:
    """Seconds to wait for a held lock: the setting, else 120 for a requeued SLURM job, else 0."""
    if lock_wait_s is not None:
        return float(lock_wait_s)
    return REQUEUED_WAIT_S if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0 else 0.0


def _holder(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode("utf-8", errors="replace").strip()
    try:
        found = json.loads(text) if text else None
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _describe(holder: dict | None) -> str:
    if not holder:
        return "a run that did not say who it is"
    return f"{holder.get('host', '?')} PID {holder.get('pid', '?')}, since {holder.get('since', '?')}"


def _lock(run_dir: Path, wait_s: float) -> int:
    """An open descriptor of the lock file with the lock held, or UserError once wait_s has passed."""
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = _holder(fd)
                os.close(fd)
                waited = f" (waited {wait_s:g} s)" if wait_s else ""
                raise UserError(
                    "hydra.run.dir", str(run_dir),
                    "let that run finish, or stop it, then launch again (the next launch resumes from its "
                    "newest checkpoint); or train into another directory: run_name=NAME or "
                    "hydra.run.dir=DIR; a requeued job can wait for its predecessor with lock_wait_s=SECONDS",
                    problem=f"is in use by a live run: {_describe(holder)}{waited}") from None
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))


def check_free(run_dir: Path, lock_wait_s: float | None) -> None:
    """Before Hydra touches the run dir: refuse one a live run holds. Takes the lock for a moment only."""
    if (Path(run_dir) / LOCK_NAME).is_file():
        os.close(_lock(Path(run_dir), wait_of(lock_wait_s)))  # closing the descriptor drops the lock


class RunLock:
    """Held from `acquire` to `release` (or the process's end)."""

    def __init__(self, run_dir: Path, lock_wait_s: float | None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.fd = _lock(self.run_dir, wait_of(lock_wait_s))
        previous = _holder(self.fd)
        if previous:  # a holder that ended cleanly clears its name: this one is gone without doing so
            print(f"note: took over the run lock of {_describe(previous)}; that run is no longer running",
                  file=sys.stderr)
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(me).encode(), 0)
        os.fsync(self.fd)

    def release(self) -> None:
        """Clear the holder's name (a clean end), then drop the lock."""
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)
        os.close(self.fd)
        self.fd = None
