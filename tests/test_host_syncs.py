"""Host syncs of a training step, counted by moe.tools.syncs (a dispatch mode, and Tensor.tolist).

Budgets (issue L): at most one per MoE layer forward under expert parallelism (the all-to-all split sizes
dropless, the group's capacity with one), none when activation checkpointing recomputes the layer (it
reuses the forward's), none in one process (dropless or with a capacity: the dropped assignments sort past
the experts' slices, so the kept count is never read), none in gradient clipping.
"""
from __future__ import annotations

import pytest
import torch
from conftest import on_gloo_ranks

from moe.config.schema import ModelConfig, MoEOptConfig
from moe.tools.syncs import counting_syncs

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_layers=2, num_heads=4,
                  num_kv_heads=2, num_experts=8, top_k=2)


def _model(moe_opt: MoEOptConfig, ep_group=None, policy: str = "none"):
    from moe.model.model import MoETransformer
    from moe.parallel.apply import apply_ac, apply_ep

    torch.manual_seed(0)
    model = MoETransformer(CFG, moe_opt, init_seed=1)
    if ep_group is not None:
        apply_ep(model, ep_group)
    return apply_ac(model, policy)


def _step_syncs(model, *, backward: bool) -> tuple[int, int]:
    """(syncs in the forward, syncs in the backward) of one micro-batch."""
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    with counting_syncs() as forward:
        out = model(ids[:, :-1], labels_BS=ids[:, 1:])
    with counting_syncs() as backward_syncs:
        if backward:
            out.loss.backward()
    return len(forward.syncs), len(backward_syncs.syncs)


def _ep_rank(rank: int, capacity: float | None, policy: str) -> tuple[int, int]:
    import torch.distributed as dist

    moe_opt = MoEOptConfig(capacity_factor=capacity, eval_capacity_factor=capacity)
    return _step_syncs(_model(moe_opt, dist.group.WORLD, policy), backward=True)


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [None, 1.0], ids=["dropless", "capacity"])
@pytest.mark.parametrize("policy", ["none", "full"])
def test_an_expert_parallel_moe_forward_syncs_once_and_its_recomputation_never(capacity, policy):
    out = on_gloo_ranks(2, _ep_rank, capacity, policy)
    moe_layers = CFG.num_layers
    for forward, backward in out.values():
        assert forward == moe_layers  # one per MoE layer: the split sizes, or the group's capacity
        assert backward == 0  # full checkpointing recomputes each layer with its forward's values


@pytest.mark.parametrize("capacity", [None, 0.5], ids=["dropless", "capacity"])
def test_the_one_process_path_never_syncs(capacity):
    from moe.model.moe import MoELayer

    model = _model(MoEOptConfig(capacity_factor=capacity, eval_capacity_factor=capacity), policy="full")
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layer.monitor = True
    assert _step_syncs(model, backward=True) == (0, 0)
    assert all(m.experts.kernel == "grouped_mm" for m in layers)
    dropped = [float(s.dropped_fraction) for s in _routing(model)]
    assert (min(dropped) > 0) == (capacity is not None)


def _routing(model):
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    return model(ids[:, :-1], labels_BS=ids[:, 1:]).routing


def test_gradient_clipping_never_syncs():
    from moe.model.moe import Experts
    from moe.parallel.grad_norm import clip_local_grads, global_grad_norm

    model = _model(MoEOptConfig(capacity_factor=None, eval_capacity_factor=None))
    _step_syncs(model, backward=True)
    experts = [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    with counting_syncs() as clipping:
        norm = global_grad_norm(model.parameters(), experts)
        clip_local_grads(model.parameters(), norm, max_norm=1e-3)
    assert clipping.syncs == []
    want = torch.nn.utils.get_total_norm([g for g in before.values()])
    torch.testing.assert_close(norm, want)
    for name, p in model.named_parameters():  # clipped as torch's clip_grad_norm_ would
        torch.testing.assert_close(p.grad, before[name] * (1e-3 / (want + 1e-6)), msg=name)


def test_a_training_step_computes_the_gradient_norm_once(train_here, monkeypatch):
    """The metrics, the spike guard and the clipping read one norm a step: each computation is a pass over
    every gradient, a collective and a host sync."""
    from moe.backends.base import Backend

    calls = []
    real = Backend.grad_norm

    def counted(self, module):
        calls.append(module.trainer.global_step)
        return real(self, module)

    monkeypatch.setattr(Backend, "grad_norm", counted)
    train_here("trainer.max_steps=3", "trainer.limit_val_batches=0", "trainer.save_checkpoints=false",
               "trainer.accumulate_grad_batches=2", "trainer.micro_batch_size=4")
    assert calls == [0, 1, 2]


GUARD_OFF = ("trainer.skip_nonfinite=false", "trainer.spike_factor=0")  # the spike guard's checks off


@pytest.mark.parametrize("guard, reads", [((), [1, 2, 3, 4]), (GUARD_OFF, [1, 4])],
                         ids=["guard_checks_on", "guard_checks_off"])
def test_a_training_step_reads_its_statistics_back_once_and_only_where_they_are_read(
        train_here, monkeypatch, guard, reads):
    """The spike guard and metrics.csv read one set of step means (one collective, one host read a step). A
    step that is not logged reads nothing back, unless the guard's checks are on: they decide from every
    step's loss (moe.train.guard.SpikeGuard.skips). Logged here: steps 1 and 4 (the first and the last)."""
    from moe.backends.base import Backend
    from moe.module.train_step import TrainStep

    reduced, synced = [], {}  # the steps (1-based) that summed over ranks; each step's host syncs
    real_reduce, real_step = Backend.all_reduce, TrainStep.__call__

    def counted_reduce(self, module, tensor, op, stage_only=False):
        if op == "sum":
            reduced.append(len(synced))
        return real_reduce(self, module, tensor, op, stage_only)

    def counted_step(self, rows):
        synced[len(synced) + 1] = []
        with counting_syncs() as counter:
            loss = real_step(self, rows)
        synced[len(synced)] = counter.syncs
        return loss

    monkeypatch.setattr(Backend, "all_reduce", counted_reduce)
    monkeypatch.setattr(TrainStep, "__call__", counted_step)
    train_here("trainer.max_steps=4", "trainer.limit_val_batches=0", "trainer.save_checkpoints=false",
               "trainer.log_every_n_steps=10", *guard)
    assert reduced == reads  # the step means' sum over ranks
    assert [step for step, syncs in synced.items() if syncs] == reads, synced
