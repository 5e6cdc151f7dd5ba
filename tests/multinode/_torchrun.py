"""Two torchrun "nodes" on this host, as on two machines: one torchrun agent per node, joined by the c10d
rendezvous, each starting its own workers (`torchrun --nnodes=2 --nproc_per_node=K --rdzv-backend=c10d
--rdzv-endpoint=<node 0>:<port> --rdzv-id=<id> --max-restarts=1 train.py ...` on each, docs/CLUSTERS.md).

Node 0 hosts the rendezvous store (`--rdzv-conf=is_host=1`), as the node the endpoint names does; node 1
starts once that store answers, and its workers start MOE_TEST_COLD_START_S later again (a colder node:
tests/multinode/_cold_start.py). Each node has its own address (127.0.0.1, 127.0.0.2: `--local-addr`), which
is also what makes node 0 the rendezvous' rank 0 (the c10d rendezvous orders nodes by address, then agent
pid; `--node-rank` is ignored by it, torchrun says so, and is passed only as a user would). Each node's
output (its agent and its workers) goes to its own file.

TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on both agents: by default (torch >= 2.5) the workers' process group
uses the rendezvous host's own TCPStore, which outlives a restart with every key the previous workers wrote
(pytorch/pytorch#135712): after one node's worker is killed, the restarted workers read their peers' dead
addresses and torchrun's restart hangs in init_process_group (torch 2.13, measured: 300 s and still there).
With it, rank 0 hosts a fresh store for every attempt.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO, free_port

TORCHRUN = Path(sys.executable).with_name("torchrun")
COLD_START = Path(__file__).with_name("_cold_start.py")
TRAIN = REPO / "train.py"
COLD_START_S = 1.5
ADDRESSES = ("127.0.0.1", "127.0.0.2")


def wait_for(condition, timeout: float, what: str, alive=None, interval: float = 0.05):
    """condition()'s first truthy value, polled every `interval` s; AssertionError naming `what` after
    `timeout` s, or at once when `alive()` (optional) says the processes it waits on have ended."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if alive is not None and not alive():
            raise AssertionError(f"the processes ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # the thread or the process ended
            found += [int(p) for p in (task / "children").read_text().split()]
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


class Node:
    """One torchrun agent and the workers it starts; its output in `log`."""

    def __init__(self, index: int, proc: subprocess.Popen, log: Path):
        self.index, self.proc, self.log = index, proc, log

    def workers(self) -> list[int]:
        """The pids of this node's train.py workers now (children of its agent; a cold worker counts once
        it has become train.py)."""
        return [pid for pid in _children(self.proc.pid) if str(TRAIN) in _cmdline(pid)]

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def ranks(self) -> set[int]:
        """The global ranks this node's workers said they had (Lightning's "Initializing distributed")."""
        return {int(r) for r in re.findall(r"Initializing distributed: GLOBAL_RANK: (\d+)", self.output())}


class TwoNodes:
    """`with TwoNodes(overrides, nproc_per_node=K, cwd=..., logs=...) as nodes: nodes.wait()`: node 0's agent,
    then node 1's (slower to start) once node 0's rendezvous store listens. On leaving, anything still
    running is ended (agents, then their workers, which torchrun starts in sessions of their own)."""

    def __init__(self, overrides, *, nproc_per_node: int, cwd: Path, logs: Path, max_restarts: int = 1,
                 timeout: float = 300, env: dict | None = None, node1_extra=()):
        self.overrides, self.nproc = list(overrides), nproc_per_node
        self.node1_extra = list(node1_extra)  # node 1's command only: a node launched with other arguments
        self.cwd, self.logs = Path(cwd), Path(logs)
        self.max_restarts, self.timeout = max_restarts, timeout
        self.port = free_port()
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": "1", "MOE_TEST_COLD_START_S": str(COLD_START_S),
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
        for name in [k for k in self.env if k.startswith(("SLURM_", "TORCHELASTIC_")) or k in (
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")]:
            del self.env[name]  # not a task of an outer launcher
        self.nodes: list[Node] = []

    def command(self, index: int) -> list[str]:
        script = [str(COLD_START), str(TRAIN)] if index == 1 else [str(TRAIN)]
        return [str(TORCHRUN), "--nnodes=2", f"--nproc-per-node={self.nproc}", f"--node-rank={index}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={ADDRESSES[0]}:{self.port}",
                f"--rdzv-id=moe-test-{self.port}", f"--rdzv-conf=is_host={int(index == 0)}",
                f"--local-addr={ADDRESSES[index]}", f"--max-restarts={self.max_restarts}",
                *script, *self.overrides, *(self.node1_extra if index == 1 else [])]

    def _start(self, index: int) -> Node:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"node{index}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(self.command(index), cwd=self.cwd, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return Node(index, proc, log)

    def __enter__(self) -> TwoNodes:
        self.started = time.monotonic()
        self.nodes.append(self._start(0))
        try:
            wait_for(self._store_listens, 60, f"node 0's rendezvous store on port {self.port}",
                     alive=lambda: self.nodes[0].proc.poll() is None)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.tails()}") from None
        self.nodes.append(self._start(1))
        return self

    def _store_listens(self) -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex((ADDRESSES[0], self.port)) == 0

    def running(self) -> bool:
        return all(node.proc.poll() is None for node in self.nodes)

    def wait(self, codes=(0, 0)) -> None:
        """Both agents' exit; AssertionError with both nodes' output unless both exit with `codes` in time."""
        deadline = self.started + self.timeout
        try:
            for node in self.nodes:
                node.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the nodes did not finish within {self.timeout:.0f} s\n{self.tails()}") \
                from None
        got = [node.proc.returncode for node in self.nodes]
        assert got == list(codes), f"torchrun exit codes {got}\n{self.tails()}"

    def tails(self, chars: int = 4000) -> str:
        return "\n".join(f"--- node {n.index} ({n.log}) ---\n{n.output()[-chars:]}" for n in self.nodes)

    def __exit__(self, *exc) -> None:
        workers = [pid for node in self.nodes for pid in node.workers()]
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.terminate()  # the agent stops its workers
        for node in self.nodes:
            try:
                node.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(node.proc.pid, signal.SIGKILL)
                node.proc.wait()
        for pid in workers:
            if str(TRAIN) in _cmdline(pid):  # still that worker (an ended one's pid may be another's now)
                with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
                    os.kill(pid, signal.SIGKILL)
