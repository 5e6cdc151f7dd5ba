"""The ranks this process launched (`python train.py trainer.devices=N` without torchrun or srun: Lightning's
subprocess launcher starts ranks 1..N-1 as its children), watched by the run instead of by Lightning.

Lightning's child-process observer SIGKILLs this process, rank 0, at its first look (every 5 s) after a
launched rank exits non-zero (lightning/fabric/strategies/launchers/subprocess_script.py:205, :234 in 2.6.6;
the same in 2.5). That races rank 0's own report of the lost peer, which gloo gives within milliseconds:
the run ended with exit 3 and its paragraph, or with -9 (137) and sometimes no paragraph, by chance. So
once the ranks have joined, `LocalRanks` takes them over: the observer keeps the list it was given
(launchers/subprocess_script.py:102 passes `launcher.procs` itself), emptied, and finishes at its next look;
the launcher gets a new list with the same processes, so its `kill` (Lightning's Ctrl-C path) still
reaches them. A thread of ours then does the observer's job without the race: when a launched rank exits
non-zero during the fit, rank 0 has REPORT_GRACE_S to fail in a collective and report it (the fit ends,
and the watch with it); a rank 0 that sees nothing (NCCL may wait on a dead peer until its timeout) is
stopped by the thread, with the same paragraph and exit 3, after killing the other ranks it launched.
Under torchrun, srun or the Neuron launcher this process launched nobody and nothing here acts.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from lightning.pytorch.callbacks import Callback

from moe.errors import COLLECTIVE_FAILED_EXIT, describe_exit, log_to_files

REPORT_GRACE_S = 10.0  # gloo reports a dead peer in milliseconds; NCCL may not until the collective's timeout
POLL_S = 0.2


class LocalRanks(Callback):
    """Adopts the launched ranks at the fit's `setup` (after the process group formed: a rank lost while
    joining is still Lightning's to handle) and watches them while `watched()` is open."""

    def __init__(self):
        self.procs: list = []
        self._paragraph: Callable[[str], str] | None = None  # while the fit runs: what the run prints
        self._report_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        launcher = trainer.strategy.launcher
        launched = getattr(launcher, "procs", None)
        if not launched:  # launched nobody (torchrun, srun; or a later fit of this process: launched before)
            return
        self.procs = list(launched)
        launched.clear()  # the observer's list: empty, so its next look finds nothing to kill
        launcher.procs = self.procs  # the launcher's own kill() still reaches them
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="moe-local-ranks", daemon=True)
            self._thread.start()

    @contextmanager
    def watched(self, paragraph: Callable[[str], str]) -> Iterator[None]:
        """While open, a launched rank's failure that rank 0 does not report itself within REPORT_GRACE_S
        ends this process: `paragraph(what happened)` on stderr and in the log files, exit 3. Leaving it,
        whichever way, stands the thread down: rank 0 reports (or finished) itself."""
        with self._report_lock:
            self._paragraph = paragraph
        try:
            yield
        finally:
            with self._report_lock:
                self._paragraph = None

    def stop(self, trainer=None) -> None:
        """SIGKILL the launched ranks still running: a stalled one would keep this process from exiting until
        its own collective timed out. Not SIGTERM: a pre-emption save would wait on the lost peer;
        checkpoints are atomic, so nothing is left half-written. `trainer`: also the ranks its launcher
        started that were not adopted yet (the fit failed while they joined)."""
        launched = getattr(trainer.strategy.launcher, "procs", None) if trainer is not None else None
        unadopted = list(launched or [])
        if launched:
            # Lightning's observer holds this list: a rank killed here must not make it SIGKILL this process
            # too (launchers/subprocess_script.py:234), which would replace its exit status
            launched.clear()
        for proc in [*self.procs, *unadopted]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            lost = [(rank, proc) for rank, proc in enumerate(self.procs, start=1) if proc.poll()]
            if not lost or self._paragraph is None:
                continue
            deadline = time.monotonic() + REPORT_GRACE_S
            while time.monotonic() < deadline and self._paragraph is not None:
                time.sleep(POLL_S)
            with self._report_lock:  # held to the exit: the fit cannot end (and report) meanwhile
                if self._paragraph is None:
                    continue  # rank 0 reported it, or the fit ended
                rank, proc = lost[0]
                message = self._paragraph(
                    f"local rank {rank} (pid {proc.pid}), which this process launched, ended "
                    f"({describe_exit(proc.returncode)}) and rank 0 saw no collective fail within "
                    f"{REPORT_GRACE_S:g} s")
                print(message, file=sys.stderr, flush=True)
                log_to_files(message)
                self.stop()
                os._exit(COLLECTIVE_FAILED_EXIT)


LOCAL_RANKS = LocalRanks()  # one per process: the ranks a process launched stay its own across fits
