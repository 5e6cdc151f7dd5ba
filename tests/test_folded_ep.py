"""EP folded with TP on the torch-native backend (moe.parallel.token_shard): each TP rank routes its share
of the tokens over an EP group of consecutive ranks; the run equals one process holding the global batch.

A tiny model (a dense layer, then 2 MoE layers of 8 experts, top-2, a shared expert, dropless,
load-balance statistics over every rank) trains two AdamW steps on fixed batches. Every rank's
loss, every gradient of the first step (FSDP2 shards assembled into canonical tensors; elementwise)
and every parameter tensor after the second (in norm) equal one process's to 1e-5 relative, float32;
the experts' row counters show each token meets each of its k experts once across all ranks
(unfolded TP: tp times that).
"""
from __future__ import annotations

import pytest
import torch
from conftest import on_gloo_ranks

from tests._rank_parity import SEQ, assert_same_grads_and_params, batches, fsdp2_cfg, one_process
from tests._shards import canonical_pieces

MICRO = 2  # sequences per data-parallel rank
# AdamW's eps above the gradients' rounding (TOL's atol): with torch's 1e-8, a gradient of 4e-8 that
# 8 ranks sum in another order (4.1e-8 vs 4.2e-8, within atol) moves its weight by 0.80 vs 0.81 lr,
# since Adam normalises by |g| + eps; that one element outweighed a 1e-5 norm bound on 8 ranks
ADAM = (("lr", 1e-3), ("eps", 1e-6))


def _cfg(world: int, tp: int, ep: int, *extra: str):
    return fsdp2_cfg(world, f"parallel.tp={tp}", f"parallel.ep={ep}", f"trainer.micro_batch_size={MICRO}",
                     "model.num_layers=3", *extra)


def _loss(model, ids):
    out = model(ids[:, :-1], labels_BS=ids[:, 1:])
    return out.loss


def _rank(rank: int, world: int, tp: int, ep: int, extra: tuple) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moe.backends.fsdp2.backend import fsdp2_plan
    from moe.model.model import MoETransformer
    from moe.model.moe import Experts
    from moe.parallel.apply import WRAPPED
    from moe.parallel.comm import sum_grads
    from moe.parallel.dims import ParallelDims
    from moe.parallel.parallelize import parallelize
    from moe.parallel.token_shard import partial_params

    cfg = _cfg(world, tp, ep, *extra)
    dims = ParallelDims.from_config(cfg)
    meshes = dims.meshes("cpu")
    with torch.device("meta"):
        model = MoETransformer(cfg.model, cfg.moe_opt, init_seed=7)
    steps = fsdp2_plan(cfg.moe_opt, cfg.parallel, cfg.hardware, dims, meshes, MixedPrecisionPolicy(), "cpu",
                        None)
    parallelize(model, cfg.model, cfg.parallel, tp, steps)
    rows = []
    for module in model.modules():
        if isinstance(module, Experts):
            module.register_forward_hook(lambda m, args, out: rows.append(int(args[1].sum())))
    opt = torch.optim.AdamW(model.parameters(), **dict(ADAM), foreach=False)
    d = dims.dp_rank(rank)
    losses, grads = [], None
    for ids in batches(dims.dp * MICRO):
        loss = _loss(model, ids[d * MICRO:(d + 1) * MICRO])
        loss.backward()
        sum_grads(partial_params(model, dims.sequence_parallel), meshes.tp.get_group())
        losses.append(loss.item())
        if grads is None:
            named = {n.replace(f"{WRAPPED}.", ""): p.grad for n, p in model.named_parameters()}
            grads = canonical_pieces(model, named, tp, cfg.model)
        opt.step()
        opt.zero_grad()
    params = canonical_pieces(model, {n: p for n, p in model.named_parameters()}, tp, cfg.model)
    return {"losses": losses, "grads": grads, "params": params, "rows": rows[:2]}  # step 1's 2 layers


def _check(world: int, tp: int, ep: int, *extra: str) -> None:
    out = on_gloo_ranks(world, _rank, world, tp, ep, extra)
    dp = world // tp
    want = one_process((f"trainer.micro_batch_size={MICRO}", "model.num_layers=3", *extra), dp, MICRO, 1, 7,
                       ADAM)
    assert_same_grads_and_params(out, want, world)
    for step in (0, 1):  # each TP group's ranks agree; the data-parallel mean is one process's loss
        per_dp = [out[r]["losses"][step] for r in range(0, world, tp)]
        assert all(out[r]["losses"][step] == out[r - r % tp]["losses"][step] for r in range(world))
        assert sum(per_dp) / dp == pytest.approx(want["loss"][step][0], rel=1e-5)
    tokens = world // tp * MICRO * SEQ
    k = 2
    for layer in (0, 1):  # every assignment computed once, on one rank
        assert sum(out[r]["rows"][layer] for r in range(world)) == tokens * k


@pytest.mark.slow
def test_tp2_ep2_on_4_ranks_equals_one_process():
    _check(4, 2, 2)


@pytest.mark.slow
def test_tp2_ep4_on_8_ranks_equals_one_process():
    _check(8, 2, 4)


@pytest.mark.slow
def test_tp2_without_ep_and_sequence_balance_loss_equal_one_process():
    """ep 1: each TP rank runs every expert on its half of the tokens; the sequence-wise balance loss
    sees whole sequences again."""
    _check(2, 2, 1, "moe_opt.load_balancing_type=seq_aux_loss")


SP = "parallel.sequence_parallel=true"


@pytest.mark.slow
def test_sequence_parallel_tp2_ep2_on_4_ranks_equals_one_process():
    """Activations split along the sequence between blocks: norms, the MoE layer and the LM loss on each
    rank's chunk, attention and the dense MLP gathering it."""
    _check(4, 2, 2, SP)


@pytest.mark.slow
def test_sequence_parallel_tp2_with_sequence_balance_loss_equals_one_process():
    _check(2, 2, 1, SP, "moe_opt.load_balancing_type=seq_aux_loss")
