"""Relaunch a training command after a crash: `python -m moe.supervise [opts] -- python train.py ...`.

A run killed by a fault (SIGKILL, OOM killer, a hung collective torn down, a lost node)
resumes from its newest good checkpoint when the same command runs again in the same run
dir, so supervision is only: run, and on a non-zero exit wait (exponential back-off) and
run again, up to --max-restarts times, logging each restart to stderr and to
`<run dir>/restarts.log`. Exit 2 is a user error (bad config or input): never retried.

A train.py command without `run_name=` or `hydra.run.dir=` gets a fixed `run_name=` added,
because the default run name is a timestamp and a relaunch would otherwise start a new run.
`resume=false` is honoured on the first launch and turned into `resume=true` on relaunches.
"""
from __future__ import annotations

import argparse
import datetime as dt
import signal
import subprocess
import sys
import time
from pathlib import Path

from moe.errors import describe_exit

USER_ERROR_EXIT = 2  # moe.errors.exit_on_user_error


def _override(cmd: list[str], key: str) -> str | None:
    for arg in cmd:
        if arg.startswith(f"{key}="):
            return arg.split("=", 1)[1]
    return None


def prepare_command(cmd: list[str], now: dt.datetime | None = None) -> tuple:
    """(command to run, run dir if known, note for the user) for a train.py command line."""
    cmd = list(cmd)
    if not any(Path(a).name == "train.py" for a in cmd):
        return cmd, None, None
    note = None
    run_dir = _override(cmd, "hydra.run.dir")
    run_name = _override(cmd, "run_name")
    if run_dir is None and run_name is None:
        run_name = f"supervised_{(now or dt.datetime.now()).strftime('%Y-%m-%d_%H-%M-%S')}"
        cmd.append(f"run_name={run_name}")
        note = (f"added run_name={run_name} so that relaunches resume the same run (pass run_name= or "
                "hydra.run.dir= to choose it)")
    if run_dir is None and run_name is not None and "$" not in run_name:
        run_dir = f"runs/{run_name}"  # conf/train.yaml: hydra.run.dir = runs/${run_name}
    return cmd, Path(run_dir) if run_dir and "$" not in run_dir else None, note


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

    def run(self) -> int:
        """Launch until success, a user error, a signal to the supervisor or --max-restarts; the exit code."""
        forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
        previous = {sig: signal.signal(sig, self._forward) for sig in forwarded}
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> int:
        restarts, cmd = 0, self.cmd
        while True:
            self.proc = subprocess.Popen(cmd)
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
            time.sleep(delay)
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
    cmd, run_dir, note = prepare_command(cmd)
    supervisor = Supervisor(cmd, args.max_restarts, args.backoff, args.max_backoff, args.run_dir or run_dir)
    if note:
        supervisor.log(note)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
