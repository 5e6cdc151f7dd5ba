"""Relaunch a training command after a crash: `python -m moe.supervise [opts] -- python train.py ...`.

A run killed by a fault (SIGKILL, OOM killer, a hung collective torn down, a lost node)
resumes from its newest good checkpoint when the same command runs again in the same run
dir, so supervision is only: run, and on a non-zero exit wait (exponential back-off) and
run again, up to --max-restarts times, logging each restart to stderr and to
`<run dir>/restarts.log`. Exit 2 is a user error (bad config or input): never retried.

The command is relaunched as it is: train.py's default run name is the experiment's (moe/config/run_name.py),
the same at every launch, so a relaunch resumes the same run with or without `run_name=`; the run dir
(for restarts.log) is what train.py composes from the command's arguments.
`resume=false` is honoured on the first launch and turned into `resume=true` on relaunches.

The command runs in a process group of its own, so a Ctrl-C at the terminal (which signals the whole
foreground group) reaches it once, forwarded by the supervisor, not twice: train.py reads a second SIGINT as
"stop now, without a checkpoint". Its standard input is /dev/null: a command in a background group that read
the terminal would be stopped (SIGTTIN) instead of running. A signal during the back-off wait stops
supervision at once, without a relaunch.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from moe.errors import describe_exit

USER_ERROR_EXIT = 2  # moe.errors.exit_on_user_error
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)  # SIGHUP: the terminal closed
# Popen's process_group is Python 3.11's; setpgrp in the child is what it does (one thread here)
OWN_PROCESS_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


class _StopWaiting(Exception):
    """A signal came during the back-off wait: supervision ends without a relaunch."""


def prepare_command(cmd: list[str]) -> tuple[list[str], Path | None]:
    """(command to run, its run dir if known) for a command line that launches train.py: the run dir Hydra
    will make for the arguments after train.py, composed as train.py's preflight composes them."""
    script = next((i for i, a in enumerate(cmd) if Path(a).name == "train.py"), None)
    if script is None:
        return list(cmd), None
    from moe.errors import UserError
    from moe.train.preflight import compose_config, hydra_command

    conf = str(Path(cmd[script]).resolve().parent / "conf")
    try:
        where = hydra_command(cmd[script + 1:], conf, "train")
        if where is None or where[3]:
            return list(cmd), None
        overrides, config_dir, config_name, _ = where
        return list(cmd), compose_config(overrides, config_dir, config_name)[1]
    except (UserError, SystemExit):  # train.py itself says what is wrong, and exits 2
        return list(cmd), None


def relaunch_command(cmd: list[str]) -> list[str]:
    """The command for a relaunch: a run that started fresh must now resume."""
    return ["resume=true" if a == "resume=false" else a for a in cmd]


class Supervisor:
    def __init__(self, cmd: list[str], max_restarts: int, backoff: float, max_backoff: float,
                 run_dir: Path | None = None):
        self.cmd, self.run_dir = cmd, run_dir
        self.max_restarts, self.backoff, self.max_backoff = max_restarts, backoff, max_backoff
        self.proc: subprocess.Popen | None = None
        self.stopping: int | None = None  # a signal the supervisor itself received
        self.backing_off = False  # between two launches: a signal ends the wait

    def log(self, message: str) -> None:
        line = f"[{dt.datetime.now().isoformat(timespec='seconds')}] supervise: {message}"
        print(line, file=sys.stderr, flush=True)
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / "restarts.log", "a") as f:
                f.write(line + "\n")

    def _forward(self, signum, frame) -> None:
        self.stopping = signum
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)
        elif self.backing_off:
            raise _StopWaiting

    def run(self) -> int:
        """Launch until success, a user error, a signal to the supervisor or --max-restarts; the exit code."""
        previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED}
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> int:
        restarts, cmd = 0, self.cmd
        while True:
            # its own process group: a terminal's Ctrl-C reaches it through _forward only, once
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, **OWN_PROCESS_GROUP)
            code = self.proc.wait()
            if code == 0:
                if restarts:
                    self.log(f"finished after {restarts} restart(s)")
                return 0
            if self.stopping is not None:
                self.log(f"stopped by {signal.Signals(self.stopping).name}; the command ended with "
                         f"{describe_exit(code)}; not restarting")
                return code if code > 0 else 128 + (-code)
            if code == USER_ERROR_EXIT:
                print("supervise: not restarting: the command failed with a user error (exit 2); fix it and "
                      "launch again", file=sys.stderr, flush=True)
                return code
            if restarts >= self.max_restarts:
                self.log(f"{describe_exit(code)}; giving up after {restarts} restart(s) (--max-restarts "
                         f"{self.max_restarts})")
                return code if code > 0 else 128 + (-code)
            restarts += 1
            delay = min(self.max_backoff, self.backoff * 2 ** (restarts - 1))
            self.log(f"{describe_exit(code)}; restart {restarts}/{self.max_restarts} in {delay:g}s")
            self.backing_off = True
            try:
                if self.stopping is None:
                    time.sleep(delay)
            except _StopWaiting:
                pass
            finally:
                self.backing_off = False
            if self.stopping is not None:
                self.log(f"stopped by {signal.Signals(self.stopping).name} while waiting to relaunch; not "
                         "restarting")
                return 128 + self.stopping
            cmd = relaunch_command(cmd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe.supervise",
                                     description="Relaunch a training command after a crash, with back-off.",
                                     usage="%(prog)s [--max-restarts N] [--backoff S] -- python train.py ...")
    parser.add_argument("--max-restarts", type=int, default=10, help="relaunches before giving up (10)")
    parser.add_argument("--backoff", type=float, default=10.0,
                        help="seconds before the first relaunch, doubled each time (10)")
    parser.add_argument("--max-backoff", type=float, default=600.0, help="longest wait (600)")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="where restarts.log goes (default: read from run_name= / hydra.run.dir=)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after --")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        print("error: command='' is missing. Fix: put the training command after `--`, e.g. "
              "python -m moe.supervise -- python train.py run_name=big", file=sys.stderr)
        return USER_ERROR_EXIT
    if "-m" in cmd or "--multirun" in cmd:
        print("error: command='-m' (Hydra multirun) cannot be supervised as one run. Fix: supervise each run "
              "separately, or the SLURM sweep (sweeps/capacity_factor_slurm.yaml), which requeues each job",
              file=sys.stderr)
        return USER_ERROR_EXIT
    if args.max_restarts < 0 or args.backoff < 0:
        print(f"error: --max-restarts={args.max_restarts} --backoff={args.backoff} must not be negative. "
              "Fix: pass 0 or more", file=sys.stderr)
        return USER_ERROR_EXIT
    cmd, run_dir = prepare_command(cmd)
    return Supervisor(cmd, args.max_restarts, args.backoff, args.max_backoff, args.run_dir or run_dir).run()


if __name__ == "__main__":
    sys.exit(main())
