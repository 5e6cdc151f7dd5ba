"""Pipeline parallelism on the torch-native backend (moe.parallel.pipeline, torch.distributed.pipelining).

Fast: how stages are placed and split, that a stage keeps the whole model's parameter names and values,
that router terms reach every stage's routers (moe.model.stage.RouterLossGrad), and every layout the
backend cannot pipeline refused at validation. Slow: on gloo ranks, the real schedules (1F1B,
Interleaved1F1B, InterleavedZeroBubble) over FSDP2 stages, with EP folded over TP at 8 ranks, give the
loss, every gradient of the first step (shards of every stage assembled into canonical tensors) and
every parameter after the second step of one process accumulating the same micro-batches, float32,
1e-5 relative; and train.py runs pipelined and resumes its checkpoint at another pp.
"""
from __future__ import annotations

import pytest
import torch
from conftest import compose_cfg, on_gloo_ranks

from moe.errors import ConfigError
from tests._rank_parity import SEQ, TOL, assert_same_grads_and_params, batches, fsdp2_cfg, one_process
from tests._shards import canonical_pieces

ROWS = 4  # sequences per data-parallel rank and step
PIPELINE = ("trainer.micro_batch_size=2", "trainer.accumulate_grad_batches=2", "model.num_layers=4",
            "moe_opt.z_loss_coeff=0.01")


def _cfg(world: int, *extra: str):
    return fsdp2_cfg(world, *PIPELINE, *extra)


# -- fast ------------------------------------------------------------------------------------------------
def test_stages_are_looped_over_the_pp_ranks_and_split_the_layers_evenly():
    from moe.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(_cfg(2, "parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"))
    assert dims.num_stages == 4
    assert [dims.stage_ids(r) for r in (0, 1)] == [(0, 2), (1, 3)]  # torchtitan's "loop" placement
    assert [list(dims.stage_layers(s)) for s in range(4)] == [[0], [1], [2], [3]]
    one = ParallelDims.from_config(_cfg(2, "parallel.pp=2"))
    assert one.stage_ids(1) == (1,) and list(one.stage_layers(1)) == [2, 3]


def test_a_stage_keeps_the_whole_models_names_and_initial_values():
    from moe.model.model import MoETransformer
    from moe.model.stage import PipelineStageModel
    from moe.parallel.pipeline import StageParts

    cfg = _cfg(1)
    whole = MoETransformer(cfg.model, cfg.moe_opt, init_seed=5)
    with torch.device("meta"):
        parts = [PipelineStageModel(cfg.model, cfg.moe_opt, 5, range(0, 2), first=True, last=False),
                 PipelineStageModel(cfg.model, cfg.moe_opt, 5, range(2, 4), first=False, last=True)]
    for part in parts:
        part.materialize()
    names = {n for part in parts for n, _ in part.named_parameters()}
    assert names == {n for n, _ in whole.named_parameters()}
    for part in parts:
        for name, p in part.named_parameters():
            assert torch.equal(p, whole.get_parameter(name)), name
    assert {n for n, _ in StageParts(parts[1:]).named_parameters()} == {
        n for n, _ in parts[1].named_parameters()}


def test_two_stages_in_one_process_give_the_whole_models_loss_and_every_gradient():
    """The router terms of the first stage never reach the last stage's loss; RouterLossGrad puts their
    gradient into the first stage's backward, weighted as the loss weighs the micro-batch."""
    from moe.model.model import MoETransformer
    from moe.model.stage import PipelineStageModel

    cfg = _cfg(1)
    ids = torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    whole = MoETransformer(cfg.model, cfg.moe_opt, init_seed=5)
    out = whole(ids[:, :-1], labels_BS=ids[:, 1:])
    (out.loss / 2).backward()  # one of 2 micro-batches
    first = PipelineStageModel(cfg.model, cfg.moe_opt, 5, range(0, 2), first=True, last=False)
    last = PipelineStageModel(cfg.model, cfg.moe_opt, 5, range(2, 4), first=False, last=True)
    first.loss_scale = last.loss_scale = 0.5
    hidden = first(ids[:, :-1])
    received = hidden.detach().requires_grad_()
    lm = last(received, labels_BS=ids[:, 1:])
    (lm / 2).backward()
    hidden.backward(received.grad)
    assert lm.item() == pytest.approx(out.lm_loss.item(), rel=1e-6)
    router = sum(part.records[0].router_loss for part in (first, last))
    assert router.item() == pytest.approx(out.router_loss.item(), rel=1e-6)
    for part in (first, last):
        for name, p in part.named_parameters():
            torch.testing.assert_close(p.grad, whole.get_parameter(name).grad, **TOL, msg=name)


@pytest.mark.parametrize("overrides, field", [
    (("parallel.pp_schedule=ZBVZeroBubble",), "parallel.pp_schedule"),
    (("parallel.pp_schedule=Looped",), "parallel.pp_schedule"),
    (("parallel.pp_schedule=InterleavedZeroBubble", "parallel.zero_stage=3"), "parallel.zero_stage"),
    (("parallel.pp_stages_per_rank=2",), "parallel.pp_stages_per_rank"),
    (("parallel.pp_schedule=Interleaved1F1B", "parallel.pp_stages_per_rank=1"),
     "parallel.pp_stages_per_rank"),
    (("parallel.pp_schedule=Interleaved1F1B", "parallel.pp_stages_per_rank=4"), "parallel.pp"),
    (("trainer.accumulate_grad_batches=1",), "trainer.accumulate_grad_batches"),
    (("parallel.pipeline_microbatches=3",), "parallel.pipeline_microbatches"),
])
def test_a_pipeline_the_backend_cannot_run_is_refused(overrides, field):
    from moe.config.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(_cfg(2, "parallel.pp=2", *overrides))
    assert err.value.field == field


def test_expert_offload_is_refused_where_fsdp2_does_not_run_it():
    from moe.config.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("hardware=cpu_deepspeed", "parallel.offload_experts=true"))
    assert err.value.field == "parallel.offload_experts" and "CPUOffloadPolicy" in str(err.value)


def test_a_schedule_only_the_torch_native_backend_runs_is_refused_elsewhere():
    from moe.config.validate import validate

    cfg = compose_cfg("hardware=cpu", "trainer.devices=2", "parallel.pp_schedule=Interleaved1F1B")
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.field == "parallel.pp_schedule"


# -- slow: the real schedules on gloo ranks against one process -------------------------------------------
def _rank(rank: int, world: int, extra: tuple) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moe.backends.fsdp2.backend import fsdp2_plan
    from moe.parallel.apply import WRAPPED
    from moe.parallel.comm import sum_grads
    from moe.parallel.dims import ParallelDims
    from moe.parallel.parallelize import parallelize
    from moe.parallel.pipeline import StageParts, build_pipeline
    from moe.parallel.token_shard import partial_params

    cfg = _cfg(world, *extra)
    dims = ParallelDims.from_config(cfg)
    meshes = dims.meshes("cpu")
    steps = fsdp2_plan(cfg.moe_opt, cfg.parallel, cfg.hardware, dims, meshes, MixedPrecisionPolicy(), "cpu",
                        None)
    pipeline = build_pipeline(cfg.model, cfg.moe_opt, cfg.parallel, cfg.trainer, cfg.hardware, cfg.seed, dims,
                              meshes, lambda part: parallelize(part, cfg.model, cfg.parallel, dims.tp, steps),
                              torch.device("cpu"))
    model = StageParts(pipeline.parts)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    d = dims.dp_rank(rank)
    losses, grads = [], None
    for ids in batches(dims.dp * ROWS):
        mine = ids[d * ROWS:(d + 1) * ROWS]
        pipeline.train(mine[:, :-1], mine[:, 1:])
        if dims.moe_token_split > 1:
            sum_grads(partial_params(model, dims.sequence_parallel), meshes.tp.get_group())
        records = [r for part in pipeline.parts for r in part.records]
        losses.append([r.lm_loss.item() for r in records if r.lm_loss is not None])
        if grads is None:
            named = {n.replace(f"{WRAPPED}.", ""): p.grad for n, p in model.named_parameters()}
            grads = canonical_pieces(model, named, dims.tp, cfg.model)
        opt.step()
        opt.zero_grad()
    params = canonical_pieces(model, {n.replace(f"{WRAPPED}.", ""): p for n, p in model.named_parameters()},
                              dims.tp, cfg.model)
    return {"losses": losses, "grads": grads, "params": params, "dp_rank": d}


def _check(world: int, *extra: str) -> None:
    from moe.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(_cfg(world, *extra))
    out = on_gloo_ranks(world, _rank, world, extra)
    want = one_process(PIPELINE, dims.dp, ROWS, 2, _cfg(1).seed, (("lr", 1e-3),))
    assert_same_grads_and_params(out, want, world)
    last_stage = [r for r in range(world) if out[r]["losses"][0]]
    assert len(last_stage) == dims.dp * dims.tp  # the last stage's ranks hold the losses
    for step in (0, 1):  # each micro-batch's LM loss, averaged over data-parallel ranks, is one process's
        for i in range(2):
            mean = sum(out[r]["losses"][step][i] for r in last_stage) / len(last_stage)
            assert mean == pytest.approx(want["lm_loss"][step][i], rel=1e-5)


@pytest.mark.slow
def test_1f1b_over_two_stages_equals_one_process():
    """Also with the experts offloaded to host memory (FSDP2's CPUOffloadPolicy), whose units reduce their
    gradients after every micro-batch instead of the step's last (moe.parallel.pipeline)."""
    _check(2, "parallel.pp=2")
    _check(2, "parallel.pp=2", "parallel.offload_experts=true")


@pytest.mark.slow
def test_interleaved_schedules_equal_one_process():
    """Interleaved1F1B and the zero-bubble InterleavedZeroBubble (its weight gradients in a pass of their
    own), 4 stages on 2 ranks."""
    _check(2, "parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B")
    _check(2, "parallel.pp=2", "parallel.pp_schedule=InterleavedZeroBubble", "parallel.zero_stage=2")


@pytest.mark.slow
def test_pp2_with_ep2_folded_over_tp2_and_dp2_on_8_ranks_equals_one_process():
    """pp 2 x dp 2 x tp 2, EP 2 folded over TP (each stage's experts over its own EP groups), FSDP2 over
    dp."""
    _check(8, "parallel.pp=2", "parallel.tp=2", "parallel.ep=2", "trainer.devices=8")


# -- slow: train.py pipelined, and its checkpoint resumed at another pp ------------------------------------
PIPELINED = ("hardware=cpu_fsdp2", "parallel.pp=2", "trainer.devices=2", "moe_opt.aux_loss_group=dp",
             "trainer.micro_batch_size=2", "trainer.accumulate_grad_batches=2")


@pytest.fixture(scope="module")
def pipelined_run(tmp_path_factory):
    from tests._parity import train

    run = tmp_path_factory.mktemp("pp") / "pp2"
    train(run, *PIPELINED)
    return run


@pytest.mark.slow
def test_train_py_pipelined_equals_one_process_and_resumes_at_another_pp(tmp_path, pipelined_run):
    """20 steps through Lightning (its accumulation hands the micro-batches over, the schedule runs them,
    clipping, metrics and step checkpoints as usual) give every step's loss of one process accumulating the
    same 2 micro-batches; the step-10 checkpoint (each stage's shards) resumes in one process (pp 1) and
    steps 11-20 equal the uninterrupted run's."""
    import shutil

    from tests._parity import TOL, assert_same_losses, losses, train

    single = tmp_path / "single"
    train(single, "moe_opt.aux_loss_group=dp", "trainer.devices=1", "trainer.micro_batch_size=2",
          "trainer.accumulate_grad_batches=2")
    assert_same_losses(pipelined_run, single)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    step10 = "step-000010.ckpt"
    shutil.copytree(pipelined_run / "checkpoints" / step10, resumed / "checkpoints" / step10)
    proc = train(resumed, "hardware=cpu_fsdp2", "moe_opt.aux_loss_group=dp", "trainer.devices=1",
                 "trainer.micro_batch_size=2", "trainer.accumulate_grad_batches=2", resume=True)
    assert "step-000010" in proc.stdout
    got, want = losses(resumed), losses(pipelined_run)[10:]
    assert len(got) == 10 and max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOL
