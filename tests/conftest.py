"""Shared test helpers: run the real entry points in a subprocess, as users do."""
from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FAST_RUN = ("trainer.progress_bar=false", "trainer.log_every_n_steps=1")

# A suite started in the background by a non-interactive shell (`make test-slow &`, `(pytest ... &)`)
# inherits SIGINT ignored, and exec keeps an ignored signal ignored: every command a test starts would ignore
# the Ctrl-C the Ctrl-C tests press, and pause until its own timeout. A handler is reset to the default at
# exec, so each command starts as it would from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def run_entry(script: str, *overrides: str, timeout: int = 600, env: dict | None = None, check: bool = False,
              here: bool = False):
    """Run `python <script> overrides...` from the repo root; returns the CompletedProcess. `here=True` runs
    the script's own `__main__` in this process (run_here): for a test whose subject is what the command
    prints and its exit code, one process, no signals, in a tenth of the time."""
    if here:
        proc = run_here(script, *overrides, env=env)
        if check and proc.returncode != 0:
            command = f"{script} {' '.join(overrides)}"
            raise AssertionError(f"{command} exited {proc.returncode}:\n{proc.stderr[-5000:]}")
        return proc
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                **(env or {})}
    proc = subprocess.run([sys.executable, str(REPO / script), *overrides], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        command = f"{script} {' '.join(overrides)}"
        output = f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        raise AssertionError(f"{command} exited {proc.returncode}:\n{output}")
    return proc


def run_here(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python <script> args` without a new interpreter: the script's real `__main__` code (runpy) with
    sys.argv set, stdout and stderr captured, SystemExit's code as the return code (an uncaught exception:
    its traceback and 1, as Python exits). The environment, working directory, logging handlers, thread
    count, Hydra's global state and any process group are restored afterwards."""
    import io
    import logging
    import runpy
    import traceback

    from hydra.core.global_hydra import GlobalHydra

    saved_argv, saved_cwd = sys.argv, os.getcwd()
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [str(REPO / script), *args]
    os.chdir(REPO)
    code = 0
    try:
        with restored_process_state(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(REPO / script), run_name="__main__")
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                if isinstance(exit_.code, str):
                    print(exit_.code, file=sys.stderr)
            except Exception:  # noqa: BLE001  (as the interpreter would: the traceback, exit 1)
                traceback.print_exc()
                code = 1
    finally:
        for handler in root.handlers[:]:
            if handler not in saved_handlers:
                root.removeHandler(handler)
                handler.close()
        root.handlers[:], root.level = saved_handlers, saved_level
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        GlobalHydra.instance().clear()
    return subprocess.CompletedProcess([script, *args], code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def restored_process_state(env: dict | None = None):
    """An entry point run in this process (run_here, train_here), offline and with `env` set: the environment,
    the thread count, Hydra's run config and any default process group (the fsdp2 backend makes one even on
    one process) are as they were afterwards."""
    from hydra.core.hydra_config import HydraConfig

    saved_env, threads = dict(os.environ), torch.get_num_threads()
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
        HydraConfig.instance().cfg = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def trained_rows(run_dir: Path) -> list[dict]:
    """metrics.csv's rows of training steps (a validation-only row has no loss), by the product's reader."""
    from moe.train.metrics import read_metrics

    return [row for row in read_metrics(Path(run_dir) / "metrics.csv") if row["loss"]]


@pytest.fixture
def train_run(tmp_path):
    """`train_run(*overrides)` trains into tmp_path/run and returns (run_dir, CompletedProcess)."""

    def _run(*overrides: str, run_dir: Path | None = None, check: bool = True, **kw):
        run_dir = run_dir or tmp_path / "run"
        proc = run_entry("train.py", f"hydra.run.dir={run_dir}", *FAST_RUN, *overrides, check=check, **kw)
        return run_dir, proc

    return _run


@pytest.fixture
def train_here(tmp_path):
    """`train_here(*overrides, run_dir=None, env=None)` trains through moe.train.run.train in this process,
    with the config train.py's task gets (Hydra's run dir set; `env` set meanwhile): for tests that are not
    about the command line, no subprocess and no interpreter start-up. Returns the run dir; the environment,
    the thread count, Hydra's global state and the default process group are restored after each run."""
    from moe.eval.in_run import InRunEval
    from moe.train.preflight import compose_config
    from moe.train.run import train

    def _run(*overrides: str, run_dir: Path | None = None, env: dict | None = None) -> Path:
        run_dir = run_dir or tmp_path / "run"
        with restored_process_state(env):
            cfg, _ = compose_config([f"hydra.run.dir={run_dir}", *FAST_RUN, *overrides], str(REPO / "conf"),
                                    "train")
            return train(cfg, run_dir, in_run_eval=InRunEval)

    return _run


def compose_cfg(*overrides: str, hydra: bool = False):
    """train.py's config for these overrides, as Hydra composes it (its Compose API: no run dir);
    `hydra=True` keeps Hydra's own node (sweeper, launcher, run dir)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import moe.config  # noqa: F401  (registers the typed schemas with Hydra)

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra)


def validated_dims(cfg):
    """Every rule of moe.config.validate, then the run's ParallelDims: what train's settle does after its
    environment and data checks."""
    from moe.config.validate import validate
    from moe.parallel.dims import ParallelDims

    validate(cfg)
    return ParallelDims.from_config(cfg)


def single_process_module(cfg):
    """A LitMoE built on its own, eagerly, in one process, with DDP's one-rank backend; `cfg` a config or
    the plain dict a checkpoint stores."""
    from moe.backends.ddp.backend import DDPBackend
    from moe.config.settled import settled_config
    from moe.module import LitMoE
    from moe.parallel.dims import ParallelDims

    cfg = settled_config(cfg)
    return LitMoE(DDPBackend(cfg, ParallelDims.from_config(cfg)))


def free_port() -> int:
    """A free TCP port on loopback, for a test's own torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_gloo_ranks(world: int, body, *args) -> dict:
    """`body(rank, *args)` (a module-level function) on `world` spawned processes joined by one gloo
    process group on a fresh port; returns {rank: what body returned}. A rank that raises fails the test."""
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(_gloo_rank, args=(world, free_port(), body, args, out), nprocs=world, join=True)
    return dict(out)


def _gloo_rank(rank: int, world: int, port: int, body, args: tuple, out: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # several processes on a shared 2-core machine; tiny shapes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out[rank] = body(rank, *args)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops on a shared 2-core box: one intra-op thread avoids spin-wait stalls (often 10x faster).

    Use with `pytestmark = pytest.mark.usefixtures("one_thread")`.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def file_size_limit(size: int):
    """Writes past `size` bytes fail as on a full disk: a real refusal by the kernel (RLIMIT_FSIZE: EFBIG;
    Python ignores SIGXFSZ), for this process and what it starts, until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
