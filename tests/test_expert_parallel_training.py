"""Expert parallelism in training under plain DDP (hardware=cpu): parity, gradients, sharded checkpoints.

Fast tests check the expert-gradient reduction and the portable-file gather/slice (DeepSpeed's
format) on a real 2-process gloo group; the slow ones train 20 steps with 2 processes, compare
every step's loss with one process holding the same global batch (tests/_parity.py), and resume
the sharded checkpoints (moe/checkpoint/sharded.py) at another expert-parallel degree.
"""
from __future__ import annotations

import math
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import on_gloo_ranks

from moe.parallel.expert_grads import reduce_expert_grads
from moe.parallel.expert_state import (
    _gather,
    _local_slice,
    gather_full_experts,
    slice_local_experts,
    slice_local_optimizer_states,
)
from tests._parity import TOL, TWO_RANKS, assert_same_losses, losses, rows, single_process_baseline, train


def _two_rank_body(rank: int):
    group = dist.new_group([0, 1])
    # expert grads: rank r holds sum of its EP group's token grads; result = sum / dp world
    p = torch.nn.Parameter(torch.zeros(2, 3))
    p.grad = torch.full((2, 3), float(rank + 1))
    q = torch.nn.Parameter(torch.zeros(4))  # no grad on this rank: joins the all-reduce with zeros
    q.grad = None if rank == 0 else torch.ones(4)
    reduce_expert_grads([p, q], group, dp_world_size=2)
    full = _gather(torch.full((1, 2), float(rank)), group)  # experts [rank] -> all experts
    mine = _local_slice(torch.arange(4.0).view(4, 1), 2, group)  # all 4 experts -> this rank's 2
    return (p.grad.tolist(), q.grad.tolist(), full.tolist(), mine.flatten().tolist(),
            _checkpoint_round_trip(rank, group))


def _checkpoint_round_trip(rank: int, group):
    """Save gathers both ranks' experts, load slices each back; the live optimizer is untouched."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.full((1, 2), float(rank)))
    model.w.is_expert = True
    opt = torch.optim.AdamW(model.parameters())
    model.w.grad = torch.full((1, 2), rank + 1.0)
    opt.step()
    fake = SimpleNamespace(state_dict=model.state_dict, _trainer=True,
                           trainer=SimpleNamespace(optimizers=[opt]))
    ckpt = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]}
    gather_full_experts(fake, ckpt, group, 2)
    saved_w = ckpt["state_dict"]["w"].tolist()
    saved_m = ckpt["optimizer_states"][0]["state"][0]["exp_avg"].tolist()
    live_m = opt.state[model.w]["exp_avg"].shape[0]
    slice_local_experts(fake, ckpt, group)
    slice_local_optimizer_states(fake, ckpt, group)
    back = (ckpt["state_dict"]["w"].tolist(), ckpt["optimizer_states"][0]["state"][0]["exp_avg"].tolist())
    return saved_w, saved_m, live_m, back, opt.state[model.w]["exp_avg"].tolist()


def test_expert_grad_reduction_and_checkpoint_gather_slice_on_two_ranks():
    out = on_gloo_ranks(2, _two_rank_body)
    for rank in (0, 1):
        p_grad, q_grad, full, mine, (saved_w, saved_m, live_m, back, own_m) = out[rank]
        assert p_grad == [[1.5] * 3] * 2  # (1 + 2) / 2
        assert q_grad == [0.5] * 4  # (0 + 1) / 2
        assert full == [[0.0, 0.0], [1.0, 1.0]]
        assert mine == [2.0 * rank, 2.0 * rank + 1]
        assert len(saved_w) == len(saved_m) == 2 and live_m == 1  # checkpoint: both; optimizer: its own
        assert saved_m[rank] == own_m[0] and saved_m[0] != saved_m[1]
        assert back == ([saved_w[rank]], own_m)


EP2 = ("hardware=cpu", "parallel=ep2", *TWO_RANKS)


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    """20 steps of DDP with EP 2 on 2 ranks (checkpoints at 10 and 20), trained once for the tests below,
    which copy it before changing anything."""
    run = tmp_path_factory.mktemp("ep2") / "ep2"
    train(run, *EP2)
    return run


def _copy(run, to):
    shutil.copytree(run, to, symlinks=True)  # last.ckpt is a link, as the run left it
    return to


@pytest.mark.slow
def test_ep2_ddp_matches_single_process_and_its_sharded_checkpoint_reads_whole(ep2_run, tmp_path_factory):
    single = single_process_baseline(tmp_path_factory)
    run = ep2_run
    assert_same_losses(run, single)
    pairs = zip(rows(run), rows(single), strict=True)
    norms = [(float(a["grad_norm"]), float(b["grad_norm"])) for a, b in pairs]
    assert all(abs(a - b) <= 1e-3 * b for a, b in norms)  # expert grads summed over the EP group

    # each rank wrote its own 4 experts; read back whole, the checkpoint holds all 8 and their moments
    from moe.checkpoint.picker import read_checkpoint
    from tests.conftest import single_process_module

    last = run / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and sorted(p.name for p in last.resolve().glob("__*_0.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    ckpt = read_checkpoint(last)
    assert ckpt["state_dict"]["model.layers.0.ffn.experts.gate_up"].shape[0] == 8
    module = single_process_module(ckpt["hyper_parameters"]["cfg"])
    module.load_state_dict(ckpt["state_dict"], strict=True)
    reference = torch.load(single / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    diff = max((module.state_dict()[k] - v).abs().max().item() for k, v in reference["state_dict"].items())
    assert diff < 1e-3, diff  # same weights as the single-process run after 20 Adam steps
    moments = [s["exp_avg"] for s in ckpt["optimizer_states"][0]["state"].values() if s["exp_avg"].dim() == 3]
    assert moments and all(m.shape[0] == 8 for m in moments)


@pytest.mark.slow
def test_dp2_with_global_batch_load_balancing_matches_single_process(tmp_path, tmp_path_factory):
    single = single_process_baseline(tmp_path_factory)
    run = tmp_path / "dp2"
    train(run, "hardware=cpu", "parallel=dp2", "moe_opt.aux_loss_group=dp", *TWO_RANKS)
    assert_same_losses(run, single)


AT_EP1 = ("parallel=dp2", "moe_opt.aux_loss_group=dp")  # load balance over both ranks, as ep2's EP group


@pytest.mark.slow
@pytest.mark.parametrize("resume_parallel", [("parallel=ep2",), AT_EP1], ids=["at_ep2", "at_ep1"])
def test_sharded_checkpoint_at_ep2_resumes_at_ep1_and_ep2_with_the_same_losses(tmp_path, ep2_run,
                                                                               resume_parallel):
    """Saved at step 10 by 2 ranks holding 4 experts each; resumed by 2 ranks holding 4 (ep2) or all 8
    (dp2, read whole; load balance over both ranks, as ep2's EP group gives): steps 11-20 equal the
    uninterrupted run's."""
    run = ep2_run
    uninterrupted = losses(run)
    resumed_run = tmp_path / "resumed"
    step_10 = "checkpoints/step-000010.ckpt"
    shutil.copytree(run / step_10, resumed_run / step_10)
    proc = train(resumed_run, "hardware=cpu", *resume_parallel, *TWO_RANKS, resume=True)
    assert "step-000010" in proc.stdout
    resumed = losses(resumed_run)
    assert len(resumed) == 10
    assert max(abs(a - b) for a, b in zip(resumed, uninterrupted[10:], strict=True)) <= TOL


FOUR_RANKS = ("trainer.devices=4", "hardware.devices_per_node=4", "trainer.micro_batch_size=1",
              "moe_opt.aux_loss_group=dp")


@pytest.mark.slow
@pytest.mark.parametrize("backend", [("hardware=cpu_deepspeed", "parallel.zero_stage=1"),
                                     ("hardware=cpu_deepspeed", "parallel.zero_stage=2")],
                         ids=["zero1", "zero2"])
def test_four_ranks_with_expert_data_parallel_2_match_single_process(tmp_path, tmp_path_factory, backend):
    """ep 2 on 4 ranks: two EP groups, so every expert has 2 replicas whose gradients the expert-DP
    all-reduce must sum (2 ranks with ep 2 have one replica, and pass without that reduction). DDP's run
    is tests/test_resume_layouts.py's, which also resumes it."""
    single = single_process_baseline(tmp_path_factory)
    run = tmp_path / "ep2x2"
    train(run, *backend, "parallel=ep2", *FOUR_RANKS)
    assert_same_losses(run, single)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [("moe_opt.capacity_factor=1.0", "moe_opt.eval_capacity_factor=1.0")],
                         ids=["capacity"])
def test_ep2_trains_with_capacity_drops_and_in_bf16(tmp_path, tmp_path_factory, extra):
    """Capacity mode under EP (fixed buffers, the group's capacity) drops tokens and trains (bf16 under EP:
    tests/test_bf16.py)."""
    single = single_process_baseline(tmp_path_factory)
    run = tmp_path / "ep2"
    train(run, "hardware=cpu", "parallel=ep2", *TWO_RANKS, *extra)
    got, want = losses(run), losses(single)
    assert len(got) == len(want) and all(math.isfinite(x) for x in got) and got[-1] < got[0]
    if "capacity" in extra[0]:
        assert max(float(r["drop_fraction"]) for r in rows(run)) > 0
    else:
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 5e-2
