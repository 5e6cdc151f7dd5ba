"""The launcher's world: who started this process, whether that is what the config asks, and the launch's
agreement, all before anything is written (train.py's preflight).

- `check_launch_world`: the processes a launcher started match trainer.devices x trainer.num_nodes, its
  variables are whole (torchrun's, SLURM's, Lightning's multi-node form), and the port this process is to
  open for the rendezvous is free. Each mismatch is one paragraph and exit 2, never a hang: a world of the
  wrong size waits in its rendezvous for ranks that never come.
- `agree`: under torchrun, every node composes its own command, so rank 0 decides (its config, its run dir,
  its verdict on the run dir) and every other rank follows before Hydra writes anything: a rank whose
  composed config differs exits 2 naming the keys, and so does rank 0; a refusal of rank 0's is every
  rank's. The exchange goes through torchrun's own store (the agent's, which workers join as clients:
  torch/distributed/rendezvous.py `_create_c10d_store`), keyed by the launch and its restart.
Lightning's own launcher starts its ranks after rank 0 has passed these checks, with rank 0's run dir;
SLURM runs one command on every task, so its tasks compose alike.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys

from moe.errors import COLLECTIVE_FAILED_EXIT, UserError

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT")
TORCHRUN_ONLY = ("GROUP_RANK", "LOCAL_WORLD_SIZE", "ROLE_RANK", "GROUP_WORLD_SIZE",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")
SAME_ARGUMENTS = ("launch every node with the same train.py arguments (and the same repository and data "
                  "paths); nothing was written")
TORCHRUN_FIX = ("launch it with torchrun (it sets them all), or unset them and let train.py launch its own "
                "ranks")


def torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def srun() -> bool:
    """Lightning's test for a SLURM task (its SLURMEnvironment): srun's variables, not an interactive job."""
    return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def launched_by_rank_zero() -> bool:
    """A rank Lightning's own launcher started (LOCAL_RANK > 0 without torchrun or srun): rank 0 checked the
    launch before it started this one."""
    return not torchrun() and not srun() and int(os.environ.get("LOCAL_RANK") or 0) > 0


def end_with_rank_zero() -> None:
    """A rank Lightning's own launcher started ends when rank 0, its parent, does, however rank 0 ends (a
    SIGKILL included): the kernel sends it SIGKILL then (Linux's PR_SET_PDEATHSIG), instead of leaving it to
    wait in a collective for a peer that is gone until its timeout. Checkpoints are written whole or not at
    all, so nothing is left half-written."""
    import ctypes
    import signal

    if not launched_by_rank_zero() or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1  # linux/prctl.h
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # rank 0 ended before the request was made: this rank was handed to init
        os._exit(COLLECTIVE_FAILED_EXIT)


def launcher_name() -> str:
    """Who started this process, for the run's records (launches.json)."""
    if torchrun():
        return "torchrun"
    if srun():
        return "slurm"
    return "lightning" if "LOCAL_RANK" in os.environ or "NODE_RANK" in os.environ else "python"


def check_launch_world(devices: int, num_nodes: int) -> None:
    """What the launcher set, against trainer.devices x trainer.num_nodes, and the rendezvous port."""
    world = devices * num_nodes
    if torchrun():
        _check_torchrun(devices, num_nodes)
    elif srun():
        _check_srun(devices, num_nodes)
    else:
        _check_plain(devices, num_nodes)
    if world > 1 and not torchrun():  # torchrun's agent holds the store; here rank 0 opens it
        _check_port_free()


def _check_torchrun(devices: int, num_nodes: int) -> None:
    missing = [name for name in TORCHRUN_VARS if not os.environ.get(name)]
    if missing:
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        raise UserError("environment", f"TORCHELASTIC_RUN_ID={run_id}", TORCHRUN_FIX,
                        problem=f"says torchrun started this process, but {', '.join(missing)} "
                                f"{'is' if len(missing) == 1 else 'are'} not set: torchrun's variables are "
                                "half set (copied from another shell?)")
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if local != devices or world != devices * num_nodes:
        nodes = world // local if local and world % local == 0 else f"{world}/{local}"
        raise UserError(
            "trainer.devices", devices,
            f"launch torchrun with --nproc_per_node={devices} on each of {num_nodes} node(s) "
            f"(--nnodes={num_nodes}), or set trainer.devices={local} trainer.num_nodes={nodes} to match it",
            problem=f"x trainer.num_nodes={num_nodes} asks for {devices * num_nodes} processes, {devices} a "
                    f"node, and torchrun started WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local} on this node: "
                    "the world would wait in its rendezvous for ranks that never come")
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    if restarts and world > 1 and shares_agent_store():
        raise UserError(
            "environment", f"TORCHELASTIC_MAX_RESTARTS={restarts}",
            "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and launch torchrun with --rdzv-backend=c10d on "
            "every node (its restarts then rendezvous in a fresh store; docs/CLUSTERS.md), or "
            "--max-restarts=0 and relaunch with python -m moe.supervise or your scheduler",
            problem="asks torchrun to restart its workers, and they share its rendezvous store (torch 2.5+ "
                    "with c10d, always with the static rendezvous), which keeps the failed attempt's "
                    "addresses: the restarted ranks connect to dead peers or wait for them "
                    "(pytorch/pytorch#135712; seen here on one node and on two)")


def shares_agent_store() -> bool:
    """torchrun's workers meet in its agent's store (torch/distributed/rendezvous.py `_create_c10d_store`),
    not one rank 0 opens."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _check_srun(devices: int, num_nodes: int) -> None:
    per_node, nodes = os.environ.get("SLURM_NTASKS_PER_NODE"), os.environ.get("SLURM_NNODES")
    ntasks = int(os.environ.get("SLURM_NTASKS") or 1)
    if ntasks > 1 and per_node is None:
        raise UserError("environment", f"SLURM_NTASKS={ntasks}",
                        f"use srun --ntasks-per-node={devices} (with --nodes), as Lightning requires",
                        problem="was set by srun --ntasks without --ntasks-per-node, which Lightning cannot "
                                "map to nodes")
    per_node_count = int(per_node.split("(")[0]) if per_node else 1  # SLURM writes "2(x3)" for a repeat
    if per_node_count != devices or (nodes and int(nodes) != num_nodes):
        raise UserError(
            "trainer.devices", devices,
            f"set trainer.devices={per_node_count} trainer.num_nodes={nodes or 1} (the sbatch scripts in "
            "slurm/ pass $SLURM_NTASKS_PER_NODE and $SLURM_NNODES), or change the allocation",
            problem=f"x trainer.num_nodes={num_nodes} does not match the SLURM allocation: "
                    f"--ntasks-per-node={per_node_count}, --nodes={nodes or 1}")


def _check_plain(devices: int, num_nodes: int) -> None:
    stray = [name for name in TORCHRUN_ONLY if name in os.environ]
    if stray or "RANK" in os.environ:
        names = ", ".join(stray + (["RANK"] if "RANK" in os.environ else []))
        raise UserError("environment", names, TORCHRUN_FIX,
                        problem="is set, but not by torchrun (no TORCHELASTIC_RUN_ID): torchrun's variables "
                                "are half set, and Lightning would start ranks of its own beside them")
    world = os.environ.get("WORLD_SIZE")
    if world is not None and int(world) != devices * num_nodes:
        raise UserError("trainer.devices", devices, f"set trainer.devices and trainer.num_nodes to give "
                        f"{world} processes, or unset WORLD_SIZE",
                        problem=f"x trainer.num_nodes={num_nodes} asks for {devices * num_nodes} processes "
                                f"and WORLD_SIZE={world} is set")
    if num_nodes > 1 and not (os.environ.get("MASTER_ADDR") and "NODE_RANK" in os.environ):
        missing = [name for name in ("MASTER_ADDR", "NODE_RANK") if name not in os.environ]
        raise UserError("trainer.num_nodes", num_nodes,
                        "launch each node with torchrun (docs/CLUSTERS.md) or srun, or set MASTER_ADDR, "
                        "MASTER_PORT and NODE_RANK on each node (Lightning's multi-node form)",
                        problem=f"spans nodes, and {', '.join(missing)} "
                                f"{'is' if len(missing) == 1 else 'are'} not set: every node would take "
                                "itself for node 0 and wait for the others")


def rendezvous_port() -> int | None:
    """The port rank 0 will open for the rendezvous: MASTER_PORT, or under SLURM the one Lightning derives
    from the job id; None where Lightning picks a free one itself."""
    if os.environ.get("MASTER_PORT"):
        return int(os.environ["MASTER_PORT"])
    if srun():
        from lightning.fabric.plugins.environments import SLURMEnvironment

        return SLURMEnvironment().main_port
    return None


def _check_port_free() -> None:
    from moe.ranks import is_rank_zero

    port = rendezvous_port()
    if port is None or not is_rank_zero():
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore server binds
        try:
            probe.bind(("", port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            raise port_taken(port) from None


def port_taken(port: int | None) -> UserError:
    return UserError("MASTER_PORT", port, "set MASTER_PORT to a free port, or unset it (train.py's own "
                     "launcher then picks a free one; torchrun: --master_port / --rdzv-endpoint)",
                     problem="is in use on this host by another process (another run's rendezvous?): rank 0 "
                             "could not open the run's rendezvous there; the ranks it launched were stopped")


def port_in_use(err: BaseException) -> bool:
    """torch's TCPStore server could not listen on its port (c10d's message names EADDRINUSE)."""
    return "EADDRINUSE" in str(err) or "address already in use" in str(err).lower()


# -- torchrun: rank 0 decides, every rank follows ---------------------------------------------------------
def follows_rank_zero() -> bool:
    """A rank other than 0 of a torchrun launch (`agree`): rank 0 judges the run dir for every rank (the lock,
    the checkpoints, the resume contract)."""
    return torchrun() and int(os.environ.get("WORLD_SIZE") or 1) > 1 and os.environ.get("RANK", "0") != "0"


def agree(config: dict, run_dir: str, verdict: tuple[int, str] | None) -> tuple[int, str] | None:
    """Under torchrun with more than one rank: rank 0's (config, run dir, verdict) is every rank's. `verdict`
    is this rank's own: None (go on) or (exit code, what to print). Returns what this rank does before
    Hydra: the same, or rank 0's decision (its message is rank 0's to print: ""), or exit 2 where the ranks
    composed different runs. They meet in torchrun's store where its workers share it (one attempt only:
    check_launch_world refuses restarts there), else in one rank 0 opens on MASTER_PORT for the exchange and
    closes again before its process group opens it there anew."""
    if not torchrun() or int(os.environ.get("WORLD_SIZE") or 1) == 1:
        return verdict
    from torch.distributed import TCPStore

    from moe.parallel.comm import RENDEZVOUS_TIMEOUT

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosts = rank == 0 and not shares_agent_store()
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=hosts,
                     timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)
    try:
        return _agree(store, f"moe/launch/{os.environ['TORCHELASTIC_RUN_ID']}/", rank, world,
                      {"config": config, "run_dir": run_dir, "host": socket.gethostname()}, verdict)
    finally:
        del store  # the server (rank 0's) closes: its port is the process group's next


def _agree(store, prefix: str, rank: int, world: int, mine: dict,
           verdict: tuple[int, str] | None) -> tuple[int, str] | None:
    from moe.parallel.comm import RENDEZVOUS_TIMEOUT

    if rank == 0:
        store.set(prefix + "decision", json.dumps({**mine, "verdict": verdict}, default=str))
        keys = [prefix + f"answer/{r}" for r in range(1, world)]
        store.wait(keys, RENDEZVOUS_TIMEOUT)  # every rank has read the decision: the store may close
        refused = [answer for answer in (json.loads(store.get(key)) for key in keys)
                   if answer["differs"] or answer["failed"]]
        if verdict is not None or not refused:
            return verdict
        first = refused[0]
        why = first["failed"] or f"it composed another run than rank 0: {'; '.join(first['differs'])}"
        return 2, (f"error: rank {first['rank']} ({first['host']}) cannot join this run ({len(refused)} of "
                   f"{world - 1} other ranks): {why}. Fix: {SAME_ARGUMENTS}")
    decision = json.loads(store.get(prefix + "decision"))
    differs = _differences(decision, mine) if verdict is None else []
    failed = verdict[1].removeprefix("error: ")[:300] if verdict is not None else None
    store.set(prefix + f"answer/{rank}", json.dumps({"rank": rank, "host": mine["host"], "differs": differs,
                                                     "failed": failed}))
    if verdict is not None:
        return verdict
    if differs:
        return 2, (f"error: this rank ({rank}, {mine['host']}) composed another run than rank 0 "
                   f"({decision['host']}): {'; '.join(differs)}. Fix: {SAME_ARGUMENTS}")
    if decision["verdict"] is not None:
        return decision["verdict"][0], ""  # rank 0 says why
    return None


def _differences(decision: dict, mine: dict) -> list[str]:
    from moe.config.contract import flat

    theirs, ours = flat(decision["config"]), flat(json.loads(json.dumps(mine["config"], default=str)))
    found = [f"{key}={ours.get(key)!r} where rank 0 has {theirs.get(key)!r}"
             for key in sorted(set(theirs) | set(ours)) if theirs.get(key) != ours.get(key)]
    if decision["run_dir"] != mine["run_dir"]:
        found.insert(0, f"run dir {mine['run_dir']} where rank 0 has {decision['run_dir']}")
    return found
