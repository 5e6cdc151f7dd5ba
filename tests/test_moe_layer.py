"""MoELayer against a token-by-token reference and transformers' Mixtral block; gradients,
dtypes, capacity/eval behaviour, the grouped_mm path and config errors."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from moe.config import ModelConfig, MoEOptConfig
from moe.errors import ConfigError
from moe.model import MoETransformer
from moe.model.moe import MoELayer, RoutingStats, grouped_mm_works
from moe.model.routing import apply_capacity, expert_capacity, load_balance_loss, top_k_routing, z_loss

H, FF, E = 16, 24, 4


def make(k=2, cf=None, **opt):
    torch.manual_seed(0)
    moe_opt = MoEOptConfig(capacity_factor=cf, eval_capacity_factor=cf, min_capacity=0, **opt)
    return MoELayer(H, FF, E, k, moe_opt, init_range=0.2)


def inputs(B=2, S=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


def reference(layer, x_BSH):
    """Token-by-token loop over kept assignments, straight from the definitions."""
    x_TH = x_BSH.reshape(-1, H)
    probs = torch.softmax(x_TH.float() @ layer.router.weight.float().T, -1)
    w, idx = top_k_routing(probs, layer.top_k, layer.normalize_top_k)
    cf = layer.capacity_factor if layer.training else layer.eval_capacity_factor
    cap = expert_capacity(x_TH.shape[0], E, layer.top_k, cf, layer.min_capacity)
    keep = apply_capacity(idx, w, E, cap, layer.drop_policy)
    if layer.normalize_after_drop and cap is not None:  # the kept weights of each token sum to 1
        w = (w * keep) / (w * keep).sum(-1, keepdim=True).clamp(min=1e-12)
    experts = layer.experts
    gate_up, down = experts.layout.as_in_out(experts.gate_up), experts.layout.as_in_out(experts.down)
    rows = []
    for t in range(x_TH.shape[0]):
        y = x_TH.new_zeros(H)
        for j in range(layer.top_k):
            if keep[t, j]:
                e = idx[t, j]
                gate, up = (x_TH[t] @ gate_up[e]).chunk(2)
                y = y + w[t, j] * ((F.silu(gate) * up) @ down[e])
        rows.append(y)
    return torch.stack(rows).view_as(x_BSH), keep


def grads(layer, x, g, fn):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = fn(x)
    (y * g).sum().backward()
    return y.detach(), [x.grad] + [p.grad.clone() for p in layer.parameters()]


CASES = [(2, None, "probs", False), (1, None, "probs", False), (2, 0.75, "probs", False),
         (2, 0.75, "position", False), (1, 1.0, "probs", False), (2, 0.75, "position", True)]


@pytest.mark.parametrize("k,cf,policy,after_drop", CASES)
def test_matches_token_by_token_reference(k, cf, policy, after_drop):
    layer = make(k, cf, drop_policy=policy, normalize_after_drop=after_drop)
    x, g = inputs()
    y, gl = grads(layer, x, g, lambda x: layer(x)[0])
    y_ref, gr = grads(layer, x, g, lambda x: reference(layer, x)[0])
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(gl, gr, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    _, keep = reference(layer, x)
    stats = layer(x)[1]
    torch.testing.assert_close(stats.dropped_fraction, 1 - keep.float().mean())
    if cf is not None:
        assert stats.dropped_fraction > 0  # the case really drops


def test_matches_transformers_mixtral_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    layer = make(2, None)
    cfg = MixtralConfig(hidden_size=H, intermediate_size=FF, num_local_experts=E, num_experts_per_tok=2)
    hf = MixtralSparseMoeBlock(cfg)
    layout = layer.experts.layout
    with torch.no_grad():
        hf.gate.weight.copy_(layer.router.weight)
        # [E, out, in], nn.Linear's order, as transformers stacks them
        gate_up, down = layout.to_out_in(layer.experts.gate_up), layout.to_out_in(layer.experts.down)
        if hasattr(hf.experts, "gate_up_proj"):  # transformers 5: stacked experts
            hf.experts.gate_up_proj.copy_(gate_up)
            hf.experts.down_proj.copy_(down)
        else:  # 4.x: one module per expert, w1 gate, w3 up, w2 down
            for j, expert in enumerate(hf.experts):
                gate, up = gate_up[j].chunk(2, dim=0)
                expert.w1.weight.copy_(gate)
                expert.w3.weight.copy_(up)
                expert.w2.weight.copy_(down[j])
    x, _ = inputs()
    out = hf(x)
    torch.testing.assert_close(layer(x)[0], out[0] if isinstance(out, tuple) else out, atol=1e-5, rtol=1e-5)


def test_top1_router_gets_gradient_from_output_loss():
    layer = make(1, None)
    x, g = inputs()
    (layer(x)[0] * g).sum().backward()  # no aux/z term: only the LM-side path
    raw = layer.router.weight.grad.abs().sum()
    assert raw > 0.1
    # renormalising a single weight makes it the constant 1: the router would learn nothing
    flat = make(1, None, normalize_top_k=True)
    (flat(x)[0] * g).sum().backward()
    assert flat.router.weight.grad.abs().sum() < 1e-4 * raw  # zero up to rounding


def test_every_expert_gets_a_gradient():
    layer = make(2, 1.25)
    x, g = inputs(B=4, S=16)
    y, stats = layer(x)
    assert (stats.tokens_per_expert_E > 0).all()
    ((y * g).sum() + 0.01 * stats.aux_loss + 0.001 * stats.z_loss).backward()
    for e in range(E):
        assert layer.experts.gate_up.grad[e].abs().sum() > 0 and layer.experts.down.grad[e].abs().sum() > 0
    assert layer.router.weight.grad.abs().sum() > 0


def test_stats_match_routing_functions():
    layer = make(2, 1.0)
    x, _ = inputs()
    y, st = layer(x)
    assert isinstance(st, RoutingStats)
    assert {f.name for f in dataclasses.fields(st)} == {
        "aux_loss", "z_loss", "tokens_per_expert_E", "dropped_fraction", "max_load", "mean_load", "entropy"
    }
    logits = x.reshape(-1, H) @ layer.router.weight.T
    probs = torch.softmax(logits, -1)
    _, idx = top_k_routing(probs, 2)
    torch.testing.assert_close(st.aux_loss, load_balance_loss(probs, idx))
    torch.testing.assert_close(st.z_loss, z_loss(logits))
    assert st.tokens_per_expert_E.tolist() == torch.bincount(idx.flatten(), minlength=E).tolist()
    assert st.aux_loss.requires_grad and st.z_loss.requires_grad
    cap = expert_capacity(24, E, 2, 1.0, 0)
    assert st.max_load <= cap and st.mean_load * E == (1 - st.dropped_fraction) * 48


def test_normalize_after_drop_gives_a_token_the_weight_of_its_dropped_expert():
    """NxD's and DeepSpeed's rule: a token that kept one of its two experts gets that expert's output
    at weight 1; with the default (Megatron's) it keeps its pre-drop weight and loses the rest."""
    x, _ = inputs()
    after, before = (make(2, 0.75, drop_policy="position", normalize_after_drop=flag)
                     for flag in (True, False))
    keep = reference(after, x)[1]
    one_kept = keep.sum(-1) == 1
    assert one_kept.any() and (keep.sum(-1) == 2).any()
    y_after, y_before = after(x)[0].reshape(-1, H), before(x)[0].reshape(-1, H)
    torch.testing.assert_close(y_after[~one_kept], y_before[~one_kept])  # nothing dropped: same
    probs = torch.softmax(x.reshape(-1, H) @ after.router.weight.T, -1)
    w, _ = top_k_routing(probs, 2)
    kept_weight = (w * keep).sum(-1)[one_kept, None]
    torch.testing.assert_close(y_before[one_kept], y_after[one_kept] * kept_weight)


def test_capacity_in_training_eval_factor_in_eval():
    torch.manual_seed(0)
    opt = MoEOptConfig(capacity_factor=0.5, eval_capacity_factor=None, min_capacity=0)
    layer = MoELayer(H, FF, E, 1, opt)
    with torch.no_grad():  # every token prefers expert 0
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
    x = torch.rand(1, 8, H) + 0.1  # positive inputs -> expert 0 for all 8 tokens
    y, st = layer(x)
    cap = expert_capacity(8, E, 1, 0.5, 0)  # ceil(8*0.5/4) = 1
    assert cap == 1 and st.tokens_per_expert_E.tolist() == [8, 0, 0, 0]
    torch.testing.assert_close(st.dropped_fraction, torch.tensor(7 / 8))
    assert st.max_load == 1
    kept = y[0].abs().sum(-1) > 0  # dropped tokens get exactly zero (their residual carries them)
    assert kept.sum() == 1
    layer.eval()
    y_eval, st_eval = layer(x)
    assert st_eval.dropped_fraction == 0 and (y_eval[0].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_dtypes(dtype):
    layer = make(2, None)
    x, g = inputs()
    y32 = layer(x)[0]
    layer.to(dtype)
    y, st = layer(x.to(dtype))
    assert y.dtype == dtype and st.aux_loss.dtype == torch.float32
    assert layer.router(x.reshape(-1, H).to(dtype)).dtype == torch.float32  # router in fp32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), y32, atol=tol * y32.abs().max().item(), rtol=tol)
    (y.float() * g).sum().backward()
    assert layer.experts.gate_up.grad.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_path_equals_loop_path(dtype):
    if not grouped_mm_works(torch.device("cpu"), dtype):
        pytest.skip("torch._grouped_mm unusable on this build")
    layer = make(2, 0.75).to(dtype)
    x, g = inputs()
    x, g = x.to(dtype), g.to(dtype)
    layer.experts.use_grouped_mm = True
    y1, g1 = grads(layer, x, g, lambda x: layer(x)[0])
    layer.experts.use_grouped_mm = False
    y2, g2 = grads(layer, x, g, lambda x: layer(x)[0])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip([y1, *g1], [y2, *g2], strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_weights_in_the_activation_equal_weights_at_the_combine(dtype):
    """moe_opt.weights_in_activation moves each routing weight before the (linear) down projection and sums
    a token's k outputs unweighted: a reordering, so fp32 equals today's to rounding and bf16 stays within
    a few of its roundings of the output's scale; outputs and every gradient (the router's through the
    weights), dropless and with drops, on both expert kernels."""
    kernels = (True, False) if grouped_mm_works(torch.device("cpu"), dtype) else (False,)
    x, g = (t.to(dtype) for t in inputs())
    for cf in (None, 0.75):
        today, folded = make(2, cf).to(dtype), make(2, cf, weights_in_activation=True).to(dtype)
        for grouped in kernels:
            today.experts.use_grouped_mm = folded.experts.use_grouped_mm = grouped
            y1, g1 = grads(today, x, g, lambda x, layer=today: layer(x)[0])
            y2, g2 = grads(folded, x, g, lambda x, layer=folded: layer(x)[0])
            for a, b in zip([y1, *g1], [y2, *g2], strict=True):
                scale = a.float().abs().max().item()
                ulps = 2e-6 if dtype == torch.float32 else 4 * 2 ** -8  # bf16: 8 bits of mantissa
                torch.testing.assert_close(b.float(), a.float(), atol=ulps * scale, rtol=0)


def test_shared_expert_is_added():
    torch.manual_seed(0)
    layer = MoELayer(H, FF, E, 2, MoEOptConfig(capacity_factor=None), shared_expert_intermediate_size=8)
    x, _ = inputs()
    y, _ = layer(x)
    shared = layer.shared_expert
    routed = y - shared.down_proj(F.silu(shared.gate_up_proj(x)[..., :8]) * shared.gate_up_proj(x)[..., 8:])
    layer.shared_expert = None
    torch.testing.assert_close(routed, layer(x)[0], atol=1e-6, rtol=1e-5)


def test_jitter_only_in_training():
    layer = make(2, None, jitter_eps=0.5)
    x, _ = inputs()
    plain = make(2, None)
    layer.eval()
    plain.eval()
    torch.testing.assert_close(layer(x)[0], plain(x)[0])
    layer.train()
    assert not torch.equal(layer(x)[1].z_loss, plain(x)[1].z_loss)


def test_parameters_shapes_marks_and_init():
    torch.manual_seed(0)
    layer = MoELayer(64, 128, 8, 2, MoEOptConfig(), init_range=0.02, out_init_std=0.005)
    layout = layer.experts.layout
    assert layer.experts.gate_up.shape == layout.shape(8, 64, 256)
    assert layer.experts.down.shape == layout.shape(8, 128, 64)
    assert layer.router.weight.shape == (8, 64)
    assert all(getattr(p, "is_expert", False) for p in layer.experts.parameters())
    assert not getattr(layer.router.weight, "is_expert", False)
    assert abs(layer.experts.gate_up.std().item() - 0.02) < 0.001
    assert abs(layer.experts.down.std().item() - 0.005) < 0.0003
    assert abs(layer.router.weight.std().item() - 0.02) < 0.003


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"top_k": 5}, "model.top_k"),
        ({"top_k": 0}, "model.top_k"),
        ({"capacity_factor": 0.0}, "moe_opt.capacity_factor"),
        ({"eval_capacity_factor": -1.0}, "moe_opt.eval_capacity_factor"),
        ({"drop_policy": "random"}, "moe_opt.drop_policy"),
        ({"router_dtype": "fp64"}, "moe_opt.router_dtype"),
        ({"jitter_eps": 1.5}, "moe_opt.jitter_eps"),
    ],
)
def test_config_errors(kwargs, field):
    """What the model checks when it is built (moe.config.rules.architecture.validate_model)."""
    top_k = kwargs.pop("top_k", 2)
    with pytest.raises(ConfigError) as err:
        MoETransformer(ModelConfig(hidden_size=H, intermediate_size=FF, num_experts=E, top_k=top_k),
                       MoEOptConfig(**kwargs))
    assert err.value.field == field
    assert "Fix:" in str(err.value)


def same_contract(impl, protocol) -> None:
    """Each of the protocol's methods is on `impl` with the same parameter names and return annotation."""
    import inspect

    for name in (n for n in vars(protocol) if not n.startswith("_")):
        want, have = inspect.signature(getattr(protocol, name)), inspect.signature(getattr(impl, name))
        assert list(have.parameters) == list(want.parameters), (impl, name)
        assert have.return_annotation == want.return_annotation, (impl, name)


def test_the_local_and_all_to_all_dispatchers_implement_the_dispatcher_contract():
    from moe.model.dispatcher import Dispatched, Dispatcher, LocalDispatcher
    from moe.parallel.expert_exchange import AllToAllDispatcher

    for impl in (LocalDispatcher, AllToAllDispatcher):
        same_contract(impl, Dispatcher)
    local = LocalDispatcher()
    assert isinstance(local, Dispatcher)
    assert isinstance(MoELayer(8, 4, 4, 2, MoEOptConfig()).dispatcher, Dispatcher)
    x, idx = torch.randn(5, 8), torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [0, 2]])
    out = local.dispatch(x, idx, None, None, 4)
    assert isinstance(out, Dispatched) and out.rows_MH.shape == (10, 8)
    assert out.counts_E.tolist() == [3, 2, 2, 3]
    y = local.combine(out.rows_MH, torch.full((5, 2), 0.5), out.ctx)
    assert torch.allclose(y, x)  # each token's two rows are itself, weighted 0.5 + 0.5


def test_moe_layer_implements_the_feed_forward_contract():
    from moe.model.moe import MoEFeedForward

    same_contract(MoELayer, MoEFeedForward)
    assert isinstance(MoELayer(8, 4, 4, 2, MoEOptConfig()), MoEFeedForward)
