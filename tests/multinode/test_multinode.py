"""Two nodes for real, on one host: two torchrun agents (tests/multinode/_torchrun.py: the c10d rendezvous,
node 1 slower to start, each node's output its own), as a user launches on two machines (docs/CLUSTERS.md).
(a) DDP with expert parallelism across the nodes (one rank a node: the EP group spans them) and (b) FSDP2
HSDP with its replica dimension across the nodes (2 ranks a node shard the weights, the nodes replicate
them) train every step's loss of one process holding the same global batch (tests/_parity.py's setting,
10 steps); (c) one node's worker SIGKILLed after a step checkpoint: torchrun's own restart (--max-restarts=1
on both nodes) resumes the run from that checkpoint, and every step's loss equals the uninterrupted run's,
(a)'s; (d) run without run_name from a working directory of its own, every rank, node and restart writes
the one run dir; (e) nodes launched with different arguments, and torchrun restarts through its shared store
(which a torch bug breaks), are refused on every rank before anything is written. `make test-multinode`."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests._parity import PARITY, TOL, losses, train
from tests.conftest import FAST_RUN, compose_cfg, trained_rows, validated_dims
from tests.multinode._pause_probe import PauseAt
from tests.multinode._torchrun import TwoNodes, wait_for

pytestmark = pytest.mark.multinode

STEPS, EVERY = 10, 4  # checkpoints at steps 4, 8 and 10
SHORT = (f"trainer.max_steps={STEPS}", f"trainer.checkpoint_every_n_steps={EVERY}")
RUN = (*FAST_RUN, *PARITY, *SHORT)  # what every run here shares: tests/_parity.py's setting, 10 steps
EP_ACROSS_NODES = ("hardware=cpu", "parallel=ep2", "trainer.devices=1", "trainer.num_nodes=2",
                   "trainer.micro_batch_size=2")  # 2 ranks x micro-batch 2 = the one process's 4
HSDP_ACROSS_NODES = ("hardware=cpu_fsdp2", "parallel=fsdp2_hsdp", "moe_opt.aux_loss_group=dp",
                     "trainer.devices=2", "trainer.num_nodes=2", "trainer.micro_batch_size=1")  # 4 x 1
TIMEOUT = 300  # per launch of two nodes: 15-140 s here at load average 2-10


def assert_losses_equal(run: Path, reference: Path, tol: float) -> None:
    got, want = losses(run), losses(reference)
    assert len(got) == len(want) == STEPS, (len(got), len(want))
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst <= tol, f"max |loss diff| {worst:.3g} > {tol}: {got} vs {want}"


def on_two_nodes(tmp_path: Path, overrides, nproc_per_node: int) -> tuple[Path, TwoNodes]:
    run_dir = tmp_path / "run"
    overrides = (f"hydra.run.dir={run_dir}", *RUN, "resume=false", *overrides)
    with TwoNodes(overrides, nproc_per_node=nproc_per_node, cwd=tmp_path, logs=tmp_path / "logs",
                  timeout=TIMEOUT) as nodes:
        nodes.wait()
    k = nproc_per_node
    placed = [node.ranks() for node in nodes.nodes]
    assert placed == [set(range(k)), set(range(k, 2 * k))], f"ranks on each node: {placed}\n{nodes.tails()}"
    return run_dir, nodes


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The one-process run with micro-batch 4 that (a) and (b) equal."""
    run_dir = tmp_path_factory.mktemp("one_process") / "run"
    train(run_dir, "trainer.devices=1", "trainer.micro_batch_size=4", *SHORT)
    return run_dir


@pytest.fixture(scope="module")
def ep_across_nodes(tmp_path_factory) -> Path:
    """(a)'s run: DDP with EP 2, rank 0 on node 0 and rank 1 on node 1; the uninterrupted run of (c)."""
    return on_two_nodes(tmp_path_factory.mktemp("ep_across_nodes"), EP_ACROSS_NODES, nproc_per_node=1)[0]


def test_ddp_with_ep_across_two_nodes_equals_one_process(ep_across_nodes, one_process):
    """The EP group is ranks [0, 1], one on each node: every token crosses the nodes' all-to-all."""
    assert validated_dims(compose_cfg(*EP_ACROSS_NODES)).group("EP").ranks == [[0, 1]]
    assert [int(r["step"]) for r in trained_rows(ep_across_nodes)] == list(range(1, STEPS + 1))
    assert_losses_equal(ep_across_nodes, one_process, TOL)
    # each node's rank wrote its own experts into the one checkpoint directory
    last = ep_across_nodes / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in last.resolve().glob("__*_0.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_fsdp2_hsdp_replicated_across_two_nodes_equals_one_process(tmp_path, one_process):
    """The mesh is (dp_replicate 2, dp_shard 2), shard fastest: ranks 0-1 (node 0) shard the weights, so do
    ranks 2-3 (node 1), and the two nodes' replicas all-reduce their gradients across the nodes."""
    shape = validated_dims(compose_cfg(*HSDP_ACROSS_NODES)).mesh_shape()
    assert (shape["dp_replicate"], shape["dp_shard"]) == (2, 2)
    run, _ = on_two_nodes(tmp_path, HSDP_ACROSS_NODES, nproc_per_node=2)
    assert_losses_equal(run, one_process, TOL)


def test_a_worker_killed_on_one_node_is_restarted_by_torchrun_resumes_exactly_in_one_run_dir(
        tmp_path, ep_across_nodes):
    """(c) and (d): (a)'s run without run_name, from a working directory of its own (runs/ is this test's;
    train.py by its absolute path, the bundled data found from the repository). Node 1's worker is held once
    step 5 has ended (step 4's checkpoint written; tests/multinode/_pause_probe.py) and SIGKILLed there; both
    agents restart their workers (node 1's counts it against --max-restarts=1; node 0's worker, its peer
    gone mid-collective, exits 3, or its agent sees node 1 rejoin), which resume from step 4's checkpoint:
    every step once in metrics.csv, each loss the uninterrupted run's. Every rank, node and restart wrote
    the one run dir under runs/."""
    paused = tmp_path / "paused.pid"
    probe = (f"+callbacks.pause._target_={PauseAt.__module__}.PauseAt", f"+callbacks.pause.step={EVERY + 1}",
             "+callbacks.pause.node=1", f"+callbacks.pause.path={paused}")
    with TwoNodes((*RUN, *EP_ACROSS_NODES, *probe), nproc_per_node=1, cwd=tmp_path, logs=tmp_path / "logs",
                  timeout=TIMEOUT) as nodes:
        try:
            wait_for(paused.exists, TIMEOUT, f"node 1's worker to pause after step {EVERY + 1}",
                     alive=nodes.running)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{nodes.tails()}") from None
        victim = int(paused.read_text())
        assert nodes.nodes[1].workers() == [victim], (nodes.nodes[1].workers(), victim)
        os.kill(victim, signal.SIGKILL)
        nodes.wait()

    node1 = nodes.nodes[1].output()
    assert f"failed (exitcode: -9) local_rank: 0 (pid: {victim})" in node1, nodes.tails()  # torchrun saw it
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 1, f"one run dir for every rank, node and restart, not {[p.name for p in runs]}"
    run = runs[0]
    log = (run / "train.log").read_text()
    assert "resuming from " in log and f"step-{EVERY:06d}.ckpt at step {EVERY}" in log, log[-3000:]
    assert [int(r["step"]) for r in trained_rows(run)] == list(range(1, STEPS + 1)), "every step once"
    assert_losses_equal(run, ep_across_nodes, 1e-6)


def test_nodes_launched_with_other_arguments_refuse_before_anything_is_written(tmp_path):
    """(e) Node 1 typed another learning rate: its run would be another (another default run dir, another
    config). Every rank meets rank 0 before Hydra writes (moe.train.launch_world.agree): node 1 names the
    key, rank 0 names node 1, both exit 2, and no run dir exists."""
    with TwoNodes((*RUN, *EP_ACROSS_NODES), nproc_per_node=1, cwd=tmp_path, logs=tmp_path / "logs",
                  max_restarts=0, timeout=TIMEOUT, node1_extra=("optimizer.lr=0.002",)) as nodes:
        nodes.wait(codes=(1, 1))  # torchrun's own exit for a failed worker
    node0, node1 = (node.output() for node in nodes.nodes)
    assert "error: rank 1 (" in node0 and "cannot join this run" in node0, nodes.tails()
    assert "error: this rank (1, " in node1, nodes.tails()
    assert "optimizer.lr=0.002 where rank 0 has 0.001" in node1, nodes.tails()
    assert "train.py\", line" not in node0 + node1 and not (tmp_path / "runs").exists()


def test_torchrun_restarts_through_its_shared_store_are_refused_at_launch(tmp_path):
    """(e) torchrun's default: its workers share the rendezvous host's store, whose keys outlive a restart
    (pytorch/pytorch#135712): a restart would connect to dead peers or hang. With --max-restarts, every rank
    says so at launch, with the fix (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and nothing is written."""
    # both workers reach the check together: with node 1's usual cold start its worker was still starting when
    # node 0's refusal ended the attempt (torchrun stops the other node's workers), on an idle machine always
    with TwoNodes((*RUN, *EP_ACROSS_NODES), nproc_per_node=1, cwd=tmp_path, logs=tmp_path / "logs",
                  timeout=TIMEOUT, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0",
                                        "MOE_TEST_COLD_START_S": "0"}) as nodes:
        nodes.wait(codes=(1, 1))
    for node in nodes.nodes:
        out = node.output()
        assert "error: environment='TORCHELASTIC_MAX_RESTARTS=1' asks torchrun to restart" in out, \
            nodes.tails()
        assert "Fix: export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in out
        assert "train.py\", line" not in out  # torchrun reports its failed workers with its own traceback
    assert not (tmp_path / "runs").exists()
