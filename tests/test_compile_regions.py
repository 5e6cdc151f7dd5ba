"""model.compile=true compiles each MoE layer's routing, dispatch, combine and statistics (fullgraph) around
its eager experts: the same numbers as eager, one graph per region for every layer, eager wherever a
collective or a host-read size would sit inside a region (moe.model.moe.MoELayer.compile_regions)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from moe.config.schema import MoEOptConfig
from moe.model.moe import MoELayer


def _layers(n: int, capacity_factor, weights_in_activation: bool = False):
    opt = MoEOptConfig(capacity_factor=capacity_factor, eval_capacity_factor=None, z_loss_coeff=1e-3,
                       weights_in_activation=weights_in_activation)
    torch.manual_seed(0)
    layers = [MoELayer(32, 48, 8, 2, opt) for _ in range(n)]
    for layer in layers:
        layer.experts.use_grouped_mm = True  # the SwiGLU region sits between the grouped GEMMs
    return layers


def _step(layer, x_BSH, autocast: bool = False):
    x_BSH = x_BSH.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y_BSH, stats = layer(x_BSH)
        (y_BSH.float().square().sum() + stats.aux_loss + stats.z_loss).backward()
    return y_BSH, stats, x_BSH.grad


@pytest.mark.parametrize("autocast, fold", [(False, False), (True, False), (True, True)],
                         ids=["fp32", "bf16-mixed", "bf16-mixed-weights-in-activation"])
def test_compiled_regions_equal_eager_with_one_graph_per_region_for_every_layer(autocast, fold):
    """Capacity 1.0 drops assignments: the cut, the dropped rows and the drop statistics compile too. Under
    bf16-mixed (the GPU default) the experts run in bf16 and the compiled elementwise code rounds once where
    eager rounds per op: equal within bf16's resolution. fold: the routing weights ride in the compiled
    SwiGLU (moe_opt.weights_in_activation)."""
    torch._dynamo.reset()
    counters.clear()
    eager = _layers(3, capacity_factor=1.0, weights_in_activation=fold)
    compiled = copy.deepcopy(eager)
    assert all(layer.compile_regions() for layer in compiled)
    x_BSH = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(1))
    tol = {"rtol": 2e-2, "atol": 2e-3} if autocast else {"rtol": 1e-5, "atol": 1e-6}
    for ref, layer in zip(eager, compiled, strict=True):
        y_ref, stats_ref, dx_ref = _step(ref, x_BSH, autocast)
        y, stats, dx = _step(layer, x_BSH, autocast)
        torch.testing.assert_close(y, y_ref, **tol)
        torch.testing.assert_close(dx, dx_ref, **tol)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(layer.get_parameter(name).grad, p.grad, **tol, msg=name)
        for field in ("aux_loss", "z_loss", "tokens_per_expert_E", "dropped_fraction", "max_load", "entropy"):
            torch.testing.assert_close(getattr(stats, field), getattr(stats_ref, field), msg=field)
        assert stats.dropped_fraction > 0  # the capacity cut ran
    # route, finish and the SwiGLU: one graph each, shared by the three layers (no recompile per layer)
    assert counters["stats"]["unique_graphs"] == 3


def test_generation_runs_the_regions_eager():
    """Decoding changes shapes every token: a compiled region would recompile each time."""
    torch._dynamo.reset()
    counters.clear()
    (layer,) = _layers(1, capacity_factor=None)
    layer.compile_regions()
    layer.experts.compiled_activation = False
    layer.eval()
    with torch.no_grad():
        y, stats = layer(torch.randn(1, 1, 32), generating=True)
    assert stats is None and counters["stats"]["unique_graphs"] == 0


@pytest.mark.parametrize("installed", ["dispatcher", "token_shard", "stats_sum"])
def test_the_regions_stay_eager_where_they_would_hold_a_collective(installed):
    """The all-to-all dispatcher reads its split sizes on the host, the TP token split and the statistics
    all-reduce are collectives: compiled whole, a region would break (fullgraph raises). Their SwiGLU still
    compiles."""
    (layer,) = _layers(1, capacity_factor=None)
    setattr(layer, installed, object())
    assert layer.compile_regions() is False and layer.compiled_regions is False
    assert layer.experts.compiled_activation is True


def test_a_dispatch_mode_sees_the_regions_eager():
    """Dynamo refuses to trace under a user dispatch mode (an op counter, torch's MemTracker): with one
    active the layer runs eager, whose every op the mode is there to see."""
    from moe.tools.syncs import counting_syncs

    torch._dynamo.reset()
    counters.clear()
    (layer,) = _layers(1, capacity_factor=1.0)
    layer.compile_regions()
    with counting_syncs() as counter:
        _step(layer, torch.randn(2, 8, 32))
    assert counter.ops > 50 and counter.syncs == [] and counters["stats"]["unique_graphs"] == 0
