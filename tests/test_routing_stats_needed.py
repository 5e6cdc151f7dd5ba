"""Routing statistics are computed only where something reads them (issue O): a loss term whose coefficient
is not 0, the expert bias, or a step that metrics.csv logs (the drop, load and entropy numbers). Skipping
them changes no output, no loss and no gradient, and cuts the layer's aten ops below torchtitan 0.3.0's
105 for the same work (bench/vs_torchtitan.py, docs/BENCHMARKS.md)."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import trained_rows

from moe.config.schema import MoEOptConfig
from moe.tools.syncs import counting_syncs

TORCHTITAN_OPS = 105  # its MoE forward + backward at the bench's shape (docs/BENCHMARKS.md)


def _layer(aux: float, z: float, **opt):
    from moe.model.moe import MoELayer

    torch.manual_seed(0)
    moe_opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, aux_loss_coeff=aux,
                           z_loss_coeff=z, **opt)
    return MoELayer(32, 16, 8, 2, moe_opt, init_range=0.02), moe_opt


def _step(layer, moe_opt, monitor: bool):
    """Output, router loss and every gradient of one forward + backward; its stats; its aten op count."""
    from moe.model.loss import router_loss

    layer.monitor = monitor
    layer.zero_grad(set_to_none=True)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    with counting_syncs() as counter:
        y, stats = layer(x)
        term = router_loss(stats, moe_opt) if stats is not None else 0.0
        (y.pow(2).mean() + term).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return y.detach(), float(term), grads, stats, counter.ops


def test_a_layer_whose_statistics_nothing_reads_computes_none_and_trains_the_same():
    layer, opt = _layer(aux=0.0, z=0.0)
    y_on, _, grads_on, stats_on, ops_on = _step(layer, opt, monitor=True)
    y_off, _, grads_off, stats_off, ops_off = _step(layer, opt, monitor=False)
    assert stats_on is not None and stats_off is None
    assert torch.equal(y_on, y_off)
    for name, grad in grads_on.items():
        torch.testing.assert_close(grads_off[name], grad, rtol=0, atol=0, msg=name)
    assert ops_off <= TORCHTITAN_OPS < ops_on


@pytest.mark.parametrize("opt", [{}, {"load_balancing_type": "seq_aux_loss"}],
                         ids=["aux_loss", "seq_aux_loss"])
def test_the_losses_alone_skip_the_monitoring_numbers_not_the_losses(opt):
    layer, moe_opt = _layer(aux=0.01, z=0.001, **opt)
    y_on, term_on, grads_on, stats_on, ops_on = _step(layer, moe_opt, monitor=True)
    y_off, term_off, grads_off, stats_off, ops_off = _step(layer, moe_opt, monitor=False)
    assert torch.equal(y_on, y_off) and term_off == pytest.approx(term_on, rel=1e-6) and term_on > 0
    for name, grad in grads_on.items():
        torch.testing.assert_close(grads_off[name], grad, rtol=1e-6, atol=1e-9, msg=name)
    assert torch.equal(stats_off.tokens_per_expert_E, stats_on.tokens_per_expert_E)
    assert stats_off.entropy is None and stats_off.dropped_fraction is None and stats_on.entropy > 0
    assert ops_off < ops_on


def test_the_expert_bias_still_reads_its_picks_on_an_unlogged_step():
    layer, moe_opt = _layer(aux=0.0, z=0.0, enable_expert_bias=True, load_balancing_type="none")
    _, _, _, stats, _ = _step(layer, moe_opt, monitor=False)
    assert int(stats.tokens_per_expert_E.sum()) == 2 * 16 * 2 and stats.entropy is None


def test_training_monitors_routing_on_the_steps_it_logs(train_here, monkeypatch):
    """log_every 3 over 4 steps logs steps 1, 3 and 4: only their forwards compute the monitoring numbers,
    and their metrics.csv rows hold them."""
    import moe.model.moe as moe_module

    monitored = []
    real = moe_module.routing_stats

    def recorded(*args, monitor=True, **kwargs):
        monitored.append(monitor)
        return real(*args, monitor=monitor, **kwargs)

    monkeypatch.setattr(moe_module, "routing_stats", recorded)
    run_dir = train_here("trainer.max_steps=4", "trainer.log_every_n_steps=3", "trainer.limit_val_batches=0",
                         "trainer.save_checkpoints=false")
    layers = len(monitored) // 4
    assert monitored == [True] * layers + [False] * layers + [True] * 2 * layers
    rows = trained_rows(run_dir)
    assert [int(r["step"]) for r in rows] == [1, 3, 4]
    for row in rows:
        for key in ("drop_fraction", "max_expert_load", "mean_expert_load", "router_entropy", "aux_loss"):
            assert math.isfinite(float(row[key])), (row["step"], key)
