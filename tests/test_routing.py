"""Routing maths on hand-made inputs: exact capacities, drops, weights, losses and stats."""
import math

import pytest
import torch

from moe.config import MoEOptConfig
from moe.config.rules.architecture import validate_routing
from moe.errors import ConfigError
from moe.model.routing import (
    apply_capacity,
    combine,
    dispatch_order,
    expert_capacity,
    inverse_index,
    load_balance_loss,
    router_dtype,
    router_probs,
    routing_stats,
    sort_rows,
    top_k_routing,
    z_loss,
)


@pytest.mark.parametrize(
    "T,E,k,cf,min_cap,expected",
    [
        (10, 4, 2, 1.0, 0, 5),  # ceil(2*10*1.0/4) = 5
        (10, 4, 2, 1.25, 0, 7),  # ceil(6.25)
        (10, 4, 2, 1.25, 8, 8),  # floored at min_capacity
        (4096, 8, 2, 1.25, 4, 1280),
        (4, 2, 2, 2.0, 0, 4),  # ceil(8) capped at T = 4
        (3, 8, 1, 1.0, 4, 3),  # min_capacity also capped at T
        (10, 4, 2, None, 4, None),  # dropless
    ],
)
def test_expert_capacity(T, E, k, cf, min_cap, expected):
    assert expert_capacity(T, E, k, cf, min_cap) == expected


@pytest.mark.parametrize("cf", [0.0, -1.0, float("inf"), float("nan")])
def test_capacity_factor_must_be_positive_and_finite(cf):
    with pytest.raises(ConfigError) as err:
        validate_routing(MoEOptConfig(capacity_factor=cf))
    assert err.value.field == "moe_opt.capacity_factor" and str(err.value.value) == str(cf)


def test_router_probs_in_fp32_from_bf16_logits():
    logits = torch.tensor([[0.0, 1.0]], dtype=torch.bfloat16)
    probs = router_probs(logits)
    assert probs.dtype == torch.float32
    e = math.e
    torch.testing.assert_close(probs, torch.tensor([[1 / (1 + e), e / (1 + e)]]))
    assert router_probs(logits, torch.bfloat16).dtype == torch.bfloat16


def test_router_dtype_names():
    assert router_dtype("fp32") is torch.float32 and router_dtype("bf16") is torch.bfloat16
    with pytest.raises(ConfigError) as err:
        validate_routing(MoEOptConfig(router_dtype="float32"))
    assert err.value.field == "moe_opt.router_dtype"


def test_top2_renormalises_top1_keeps_raw_prob():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]])
    w, idx = top_k_routing(probs, 2)
    assert idx.tolist() == [[0, 1], [2, 1]]
    torch.testing.assert_close(w, torch.tensor([[0.625, 0.375], [0.7 / 0.9, 0.2 / 0.9]]))
    w1, idx1 = top_k_routing(probs, 1)
    assert idx1.tolist() == [[0], [2]]
    torch.testing.assert_close(w1, torch.tensor([[0.5], [0.7]]))
    # the flag overrides the default both ways
    raw = torch.tensor([[0.5, 0.3], [0.7, 0.2]])
    torch.testing.assert_close(top_k_routing(probs, 2, normalize=False)[0], raw)
    torch.testing.assert_close(top_k_routing(probs, 1, normalize=True)[0], torch.ones(2, 1))


# 4 tokens, 3 experts, top-2, capacity 2.
# expert 0 gets (t0 .6) (t1 .7) (t2 .9) (t3 .45); expert 1 gets (t0 .4) (t2 .1) (t3 .55);
# expert 2 gets (t1 .3)
IDX = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
W = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.55, 0.45]])


def test_position_policy_drops_latest_tokens():
    keep = apply_capacity(IDX, W, 3, capacity=2, drop_policy="position")
    # expert 0 keeps t0, t1 (drops t2, t3); expert 1 keeps t0, t2 (drops t3)
    assert keep.tolist() == [[True, True], [True, True], [False, True], [False, False]]


def test_probs_policy_drops_lowest_weights():
    keep = apply_capacity(IDX, W, 3, capacity=2, drop_policy="probs")
    # expert 0 keeps .9 (t2) and .7 (t1); expert 1 keeps .55 (t3) and .4 (t0)
    assert keep.tolist() == [[False, True], [True, True], [True, False], [True, False]]


def test_probs_policy_ties_keep_earlier_token():
    idx = torch.zeros(4, 1, dtype=torch.long)
    w = torch.tensor([[0.5], [0.9], [0.5], [0.5]])
    keep = apply_capacity(idx, w, 2, capacity=2, drop_policy="probs")
    assert keep.flatten().tolist() == [True, True, False, False]


def test_capacity_none_keeps_all_and_unknown_policy_fails():
    assert apply_capacity(IDX, W, 3, None).all()
    with pytest.raises(ConfigError) as err:
        validate_routing(MoEOptConfig(drop_policy="random"))
    assert err.value.field == "moe_opt.drop_policy" and err.value.value == "random"


def test_dispatch_order_sorts_kept_assignments_by_expert():
    keep = apply_capacity(IDX, W, 3, capacity=2, drop_policy="position").flatten()
    order, counts = dispatch_order(IDX.flatten(), 3, keep)
    assert counts.tolist() == [2, 2, 1]
    # flat ids t*k+j: expert 0 -> 0 (t0), 2 (t1); expert 1 -> 1 (t0), 5 (t2); expert 2 -> 3 (t1); then the
    # dropped ones in token order, past every expert's slice (nothing read back to count them)
    assert order.tolist() == [0, 2, 1, 5, 3, 4, 6, 7]
    order_all, counts_all = dispatch_order(IDX.flatten(), 3)
    assert counts_all.tolist() == [4, 3, 1] and order_all.tolist() == [0, 2, 4, 7, 1, 5, 6, 3]


def test_load_balance_loss_is_one_when_balanced():
    E = 4
    probs = torch.full((8, E), 1.0 / E)
    for k in (1, 2):
        idx = torch.arange(8 * k).view(8, k) % E
        torch.testing.assert_close(load_balance_loss(probs, idx), torch.tensor(1.0))


def test_load_balance_loss_known_value_and_hf_is_k_times_ours():
    # E=2, top-1: both tokens pick expert 0 -> f = [1, 0], P = [0.7, 0.3] -> 2 * 0.7 = 1.4
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4]])
    torch.testing.assert_close(load_balance_loss(probs, torch.tensor([[0], [0]])), torch.tensor(1.4))

    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    k = 2
    ours = load_balance_loss(torch.softmax(logits, -1), top_k_routing(torch.softmax(logits, -1), k)[1])
    hf = load_balancing_loss_func((logits,), num_experts=4, top_k=k)
    torch.testing.assert_close(hf, k * ours)


def test_load_balance_gradient_reaches_router_probs_only():
    logits = torch.randn(6, 3, requires_grad=True)
    probs = torch.softmax(logits, -1)
    _, idx = top_k_routing(probs, 2)
    load_balance_loss(probs, idx).backward()
    assert logits.grad.abs().sum() > 0


def test_z_loss_values():
    torch.testing.assert_close(z_loss(torch.zeros(5, 4)), torch.tensor(math.log(4.0) ** 2))
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])  # logsumexp = log 4, log 2
    torch.testing.assert_close(z_loss(logits), torch.tensor((math.log(4.0) ** 2 + math.log(2.0) ** 2) / 2))


def test_routing_stats_hand_made():
    logits = torch.log(W.new_tensor([[0.6, 0.3, 0.1], [0.5, 0.2, 0.3], [0.7, 0.2, 0.1], [0.3, 0.5, 0.2]]))
    probs = router_probs(logits)
    keep = apply_capacity(IDX, W, 3, capacity=2, drop_policy="position")
    st = routing_stats(logits, probs, IDX, keep)
    assert st.tokens_per_expert_E.tolist() == [4, 3, 1]  # before drops
    assert st.tokens_per_expert_E.dtype == torch.long
    torch.testing.assert_close(st.dropped_fraction, torch.tensor(3 / 8))
    torch.testing.assert_close(st.max_load, torch.tensor(2.0))  # after drops: [2, 2, 1]
    torch.testing.assert_close(st.mean_load, torch.tensor(5 / 3))
    entropy = -(probs * probs.log()).sum(-1).mean()
    torch.testing.assert_close(st.entropy, entropy)
    torch.testing.assert_close(st.aux_loss, load_balance_loss(probs, IDX))
    torch.testing.assert_close(st.z_loss, z_loss(logits))
    uniform = routing_stats(torch.zeros(4, 3), router_probs(torch.zeros(4, 3)), IDX, keep)
    torch.testing.assert_close(uniform.entropy, torch.tensor(math.log(3.0)))


def test_row_moves_match_plain_indexing_with_drops():
    """sort_rows/combine (gathers both ways) give the values and grads of index_select/index_add."""
    T, K, H, E = 5, 2, 3, 3
    gen = torch.Generator().manual_seed(0)
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [2, 0]])
    w = torch.rand(T, K, generator=gen)
    keep = apply_capacity(idx, w, E, capacity=2, drop_policy="position")
    order, counts = dispatch_order(idx.flatten(), E, keep.flatten())
    pos = inverse_index(order, T * K, keep.flatten())
    kept = int(counts.sum())
    assert (pos == order.numel()).sum() == (~keep).sum() > 0  # dropped assignments point at the zero row

    x = torch.randn(T, H, generator=gen)
    y_M = torch.randn(order.numel(), H, generator=gen)
    y_M[kept:] = float("nan")  # the experts leave the dropped rows undefined: nothing may read them
    g_M, g_T = torch.randn(order.numel(), H, generator=gen), torch.randn(T, H, generator=gen)

    def run(use_moves):
        xs, ys, ws = x.clone().requires_grad_(), y_M.clone().requires_grad_(), w.clone().requires_grad_()
        if use_moves:
            rows = sort_rows(xs, order, pos, K, drops=True)[:kept]
            out = combine(ys, ws, order, pos, drops=True)
            ((sort_rows(xs, order, pos, K, drops=True) * g_M).sum() + (out * g_T).sum()).backward()
        else:
            token = order[:kept] // K
            rows = xs.index_select(0, token)
            out = torch.zeros(T, H).index_add(0, token, ys[:kept] * ws.flatten()[order[:kept]].unsqueeze(-1))
            ((rows * g_M[:kept]).sum() + (out * g_T).sum()).backward()
        return rows, out, xs.grad, ys.grad[:kept], ws.grad

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b)
