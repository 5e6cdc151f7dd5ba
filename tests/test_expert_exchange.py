"""Expert parallelism on 2 gloo processes equals one process holding every expert.

Convention checked here (the one DDP uses): each rank's loss is a mean over its own
tokens and the global objective is the mean over ranks. So versus one process on all
tokens: input grads * 1/ep, replicated (router) grads averaged over ranks, and an
expert's grad on its owning rank (which sums every rank's contribution through the
all-to-all backward) divided by ep. Aux/z losses and stats are the global values.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from conftest import on_gloo_ranks

from moe.config import MoEOptConfig
from moe.model.moe import MoELayer
from moe.model.routing import load_balance_loss, router_probs, top_k_routing, z_loss
from moe.parallel.apply import apply_ep, apply_load_balance_group
from moe.parallel.comm import even_splits, exchange_counts, exchange_rows

TOL = {"atol": 1e-5, "rtol": 1e-5}



def _check_exchange(rank, world):
    """Uneven rows out and back, counts exchanged, backward = reverse all-to-all."""
    counts = [[1, 3], [0, 2]][rank]  # rows this rank sends to rank 0, rank 1
    x = (torch.arange(sum(counts) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank).requires_grad_()
    recv_counts, sent, received = exchange_counts(torch.tensor(counts), dist.group.WORLD, x.shape[0])
    assert recv_counts.tolist() == [[1, 0], [3, 2]][rank] and sent == counts
    assert received == [[1, 0], [3, 2]][rank]
    y = exchange_rows(x, sent, received, dist.group.WORLD)
    expected = [[[0.0, 1.0]], [[2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [100.0, 101.0], [102.0, 103.0]]][rank]
    assert y.tolist() == expected
    y.backward(y.detach())  # each row's grad is its own value: it must land on the row it came from
    assert torch.equal(x.grad, x.detach())
    back = exchange_rows(y, received, sent, dist.group.WORLD)
    assert torch.equal(back, x.detach())  # the return trip restores the sender's order

    buf = torch.arange(8, dtype=torch.float32).view(4, 2) + 100 * rank  # fixed-size: 2 rows per rank
    splits = even_splits(buf.shape[0], dist.group.WORLD)
    out = exchange_rows(buf, splits, splits, dist.group.WORLD)
    expected = [[[0, 1], [2, 3], [100, 101], [102, 103]], [[4, 5], [6, 7], [104, 105], [106, 107]]][rank]
    assert out.tolist() == expected


def _check_against_one_process(rank, world, k, cf, policy, shared=0, eval_mode=False, fold=False):
    """fold: the EP layer applies the routing weights in its experts' SwiGLU (each row's weight travels
    with it), the one-process layer at the combine."""
    E, H, F, B, S = 4, 8, 12, 2, 8
    torch.manual_seed(0)
    opt = MoEOptConfig(capacity_factor=cf, eval_capacity_factor=cf, min_capacity=0, drop_policy=policy)
    ref = MoELayer(H, F, E, k, opt, shared_expert_intermediate_size=shared, init_range=0.3)
    ep = copy.deepcopy(ref)
    ep.weights_in_activation = fold
    apply_ep(ep, dist.group.WORLD)
    lo, hi = rank * E // world, (rank + 1) * E // world
    assert ep.experts.gate_up.shape[0] == hi - lo and all(p.is_expert for p in ep.experts.parameters())
    torch.testing.assert_close(ep.experts.down, ref.experts.down[lo:hi])
    if eval_mode:
        ref.eval()
        ep.eval()
    gen = torch.Generator().manual_seed(1)
    X, G = torch.randn(world, B, S, H, generator=gen), torch.randn(world, B, S, H, generator=gen)
    ca, cz = 0.1, 0.01

    # expert parallel: this rank's tokens only
    x = X[rank].clone().requires_grad_()
    y, st = ep(x)
    ((y * G[rank]).sum(-1).mean() + ca * st.aux_loss + cz * st.z_loss).backward()

    # one process: every rank's tokens; capacity counts each rank's tokens apart, as under EP
    Xr = X.clone().requires_grad_()
    if cf is None:
        y_ref = ref(Xr.view(world * B, S, H))[0].view_as(X)
        dropped = torch.tensor(0.0)
    else:
        outs = [ref(Xr[r]) for r in range(world)]
        y_ref = torch.stack([o[0] for o in outs])
        dropped = torch.stack([o[1].dropped_fraction for o in outs]).mean()
        assert dropped > 0  # the case really drops
    logits = ref.router(Xr.reshape(-1, H))
    probs = router_probs(logits)
    idx = top_k_routing(probs, k)[1]
    aux_ref, z_ref = load_balance_loss(probs, idx), z_loss(logits)
    ((y_ref * G).sum(-1).mean() + ca * aux_ref + cz * z_ref).backward()

    torch.testing.assert_close(y, y_ref[rank], **TOL)
    torch.testing.assert_close(st.aux_loss, aux_ref, **TOL)
    torch.testing.assert_close(st.z_loss, z_ref, **TOL)
    assert st.tokens_per_expert_E.tolist() == torch.bincount(idx.flatten(), minlength=E).tolist()
    torch.testing.assert_close(st.dropped_fraction, dropped, **TOL)
    torch.testing.assert_close(st.entropy, torch.special.entr(probs).sum(-1).mean(), **TOL)

    torch.testing.assert_close(x.grad / world, Xr.grad[rank], **TOL)
    torch.testing.assert_close(ep.experts.gate_up.grad / world, ref.experts.gate_up.grad[lo:hi], **TOL)
    torch.testing.assert_close(ep.experts.down.grad / world, ref.experts.down.grad[lo:hi], **TOL)
    replicated = [(n, p) for n, p in ep.named_parameters() if not getattr(p, "is_expert", False)]
    ref_params = dict(ref.named_parameters())
    for name, p in replicated:
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad / world, ref_params[name].grad, **TOL)


def _check_stats_group(rank, world):
    """Load-balance group without EP (all experts replicated): losses and stats over every rank's tokens."""
    torch.manual_seed(0)
    layer = MoELayer(8, 12, 4, 2, MoEOptConfig(capacity_factor=None), init_range=0.3)
    ref = copy.deepcopy(layer)
    apply_load_balance_group(layer, dist.group.WORLD)
    X = torch.randn(world, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    _, st = layer(X[rank])
    (st.aux_loss + st.z_loss).backward()
    _, st_ref = ref(X.view(-1, 8, 8))
    (st_ref.aux_loss + st_ref.z_loss).backward()
    for name in ("aux_loss", "z_loss", "entropy", "dropped_fraction", "max_load", "mean_load"):
        torch.testing.assert_close(getattr(st, name), getattr(st_ref, name), **TOL)
    assert torch.equal(st.tokens_per_expert_E, st_ref.tokens_per_expert_E)
    grad = layer.router.weight.grad.clone()
    dist.all_reduce(grad)
    torch.testing.assert_close(grad / world, ref.router.weight.grad, **TOL)


def _cases(rank, world, cases):
    for case in cases:
        if case == "exchange":
            _check_exchange(rank, world)
        elif case == "stats_group":
            _check_stats_group(rank, world)
        else:
            _check_against_one_process(rank, world, **case)


def _spawn(cases, world=2):
    on_gloo_ranks(world, _cases, world, cases)


@pytest.mark.slow  # aborted (SIGABRT in a gloo child) on the first full-suite run of fresh clones only
def test_ep2_equals_one_process_dropless_and_capacity():
    _spawn(
        [
            "exchange",
            "stats_group",
            {"k": 2, "cf": None, "policy": "probs"},
            {"k": 2, "cf": 1.0, "policy": "probs"},
        ]
    )


@pytest.mark.slow
def test_ep2_more_routing_variants():
    _spawn(
        [
            {"k": 1, "cf": 1.0, "policy": "position", "shared": 6},
            {"k": 1, "cf": None, "policy": "probs", "shared": 6, "fold": True},
            {"k": 2, "cf": 1.0, "policy": "position", "eval_mode": True},
            {"k": 3, "cf": 0.75, "policy": "probs", "fold": True},
        ]
    )
