"""DeepSpeed plugin: its config, MoE param groups, and (slow) real CPU training over gloo.

hardware=cpu_deepspeed runs the same MoEDeepSpeedStrategy as hardware=gpu on CPU processes,
so ZeRO-1/2, DeepSpeed's expert groups and the checkpoint format are exercised for real.
The first use compiles small DeepSpeed ops into TORCH_EXTENSIONS_DIR (a few minutes, once).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import compose_cfg

import moe.config  # noqa: F401  (registers the typed schemas with Hydra)
from moe.backends.deepspeed.backend import DeepSpeedBackend, MoEDeepSpeedStrategy, deepspeed_config
from moe.checkpoint.picker import read_checkpoint
from moe.config.validate import validate
from moe.errors import ConfigError, UserError
from moe.model import MoETransformer
from moe.module.optim import build_optimizer
from tests._parity import TOL, TWO_RANKS, assert_same_losses, losses, rows, single_process_baseline, train

REPO = Path(__file__).resolve().parents[1]


def _deepspeed_config(*overrides: str) -> dict:
    cfg = compose_cfg(*overrides)
    return deepspeed_config(cfg.parallel, cfg.optimizer, cfg.trainer, cfg.hardware)


def test_config_from_parallel_optimizer_and_trainer_groups():
    config = _deepspeed_config("hardware=cpu_deepspeed", "parallel=ep2", "parallel.zero_stage=2",
                               "trainer.micro_batch_size=3", "optimizer.grad_clip=0.5")
    zero = config["zero_optimization"]
    assert zero["stage"] == 2 and zero["contiguous_gradients"] and zero["reduce_scatter"]  # MoE needs both
    assert zero["overlap_comm"] is False  # CPU: no streams to overlap on
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["gradient_clipping"] == 0.5
    assert "fp16" not in config and "bf16" not in config  # 32-true
    assert "gradient_accumulation_steps" not in config  # Lightning sets it from accumulate_grad_batches


def test_gpu_precisions():
    bf16 = _deepspeed_config("hardware=gpu", "parallel=dp2_ep8")
    assert bf16["bf16"] == {"enabled": True}
    # gradients reduced and accumulated in fp32 (Megatron-Core's and torchtitan's choice)
    assert bf16["communication_data_type"] == "fp32" and bf16["data_types"] == {"grad_accum_dtype": "fp32"}
    no_zero = _deepspeed_config("hardware=gpu", "parallel.zero_stage=0")
    assert no_zero["communication_data_type"] == "fp32"
    assert "data_types" not in no_zero  # DeepSpeed refuses fp32 accumulation of bf16 weights without ZeRO
    fp16 = _deepspeed_config("hardware=gpu", "trainer.precision=16-mixed")["fp16"]
    assert fp16["enabled"] and fp16["loss_scale"] == 0 and fp16["initial_scale_power"] == 16  # dynamic
    gpu = _deepspeed_config("hardware=gpu", "parallel=dp2_ep8")
    assert gpu["zero_optimization"]["overlap_comm"] and gpu["zero_optimization"]["stage"] == 1


def test_zero3_with_moe_and_hybrid_shard_are_refused():
    with pytest.raises(ConfigError, match="parallel.zero_stage=3 is not available with DeepSpeed") as info:
        validate(compose_cfg("hardware=gpu", "trainer.devices=8", "parallel.zero_stage=3"))
    assert "ZeRO-3 does not support MoE" in info.value.fix
    with pytest.raises(ConfigError, match="parallel.hybrid_shard_degree=2 is not implemented by DeepSpeed"):
        validate(compose_cfg("hardware=gpu", "trainer.devices=8", "parallel.zero_stage=1",
                             "parallel.hybrid_shard_degree=2"))


def backend_of(*overrides: str) -> DeepSpeedBackend:
    from moe.train.run import settled_of

    settled = settled_of(compose_cfg(*overrides))
    return DeepSpeedBackend(settled.config, settled.dims)


def test_lightning_fills_accumulation_into_the_config():
    strategy = backend_of("hardware=cpu_deepspeed", "parallel.zero_stage=1").trainer_parts().strategy
    assert isinstance(strategy, MoEDeepSpeedStrategy)
    strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(accumulate_grad_batches=4,
                                                                         gradient_clip_val=1.0))
    strategy._format_batch_size_and_grad_accum_config()
    assert strategy.config["gradient_accumulation_steps"] == 4
    assert strategy.config["gradient_clipping"] == 1.0


def test_regroup_marks_experts_and_splits_param_groups():
    backend = backend_of("hardware=cpu_deepspeed", "parallel=ep2", "trainer.devices=2")
    model = MoETransformer(backend.cfg.model, backend.cfg.moe_opt)
    optimizer = build_optimizer(model, backend.cfg.optimizer)
    backend.trainer_parts().strategy._lightning_module = SimpleNamespace(parameters=model.parameters)
    backend.prepare_optimizer(optimizer)

    experts = [p for p in model.parameters() if getattr(p, "is_expert", False)]
    assert experts and all(p.allreduce is False and p.group_name == "ep_size_2" for p in experts)
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert set(groups) == {"decay", "no_decay", "ep_size_2"}  # no empty MoE group for the norms
    assert groups["ep_size_2"]["moe"] is True and groups["ep_size_2"]["weight_decay"] == 0.1
    assert {id(p) for p in groups["ep_size_2"]["params"]} == {id(p) for p in experts}
    seen = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # each parameter exactly once


def test_missing_deepspeed_is_a_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(UserError, match="pip install deepspeed -c constraints.txt"):
        backend_of("hardware=gpu")


# ------------------------------------------------------------------------ real CPU training (slow)


ZERO2 = ("hardware=cpu_deepspeed", "parallel=ep2", "parallel.zero_stage=2", *TWO_RANKS)


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory):
    """20 steps of DeepSpeed ZeRO-2 with EP 2 on 2 ranks, trained once: its parity test reads it, the resume
    test copies it."""
    run = tmp_path_factory.mktemp("zero2") / "ds"
    train(run, *ZERO2)
    return run


@pytest.mark.parametrize("parallel", [  # dp2_zero1 in the fast suite: one two-process parity of DeepSpeed's
    pytest.param(("parallel=ep2",), id="ep2", marks=pytest.mark.slow),  # ZeRO off: expert-DP all-reduce,
    # our global-norm fp32 clipping
    pytest.param(("parallel=ep2", "parallel.zero_stage=2"), id="ep2_zero2",  # expert partitions over the
                 marks=pytest.mark.slow),  # expert-DP group (zero2_run)
    pytest.param(("parallel=dp2", "parallel.zero_stage=1", "moe_opt.aux_loss_group=dp"), id="dp2_zero1"),
])
def test_cpu_deepspeed_matches_single_process(tmp_path, tmp_path_factory, request, parallel):
    single = single_process_baseline(tmp_path_factory)
    if parallel == ("parallel=ep2", "parallel.zero_stage=2"):
        run = request.getfixturevalue("zero2_run")
    else:
        run = tmp_path / "ds"
        train(run, "hardware=cpu_deepspeed", *parallel, *TWO_RANKS)
    assert_same_losses(run, single)
    for got, want in zip(rows(run), rows(single), strict=True):  # DeepSpeed's own norm, before clipping
        assert abs(float(got["grad_norm"]) - float(want["grad_norm"])) <= 1e-3 * float(want["grad_norm"])
    last = run / "checkpoints" / "last.ckpt"
    ckpt = read_checkpoint(last)
    assert ckpt["state_dict"]["model.layers.0.ffn.experts.gate_up"].shape[0] == 8  # read whole: all experts
    target = last.resolve()  # last.ckpt links to the newest step; its ZeRO partitions sit beside that
    partitions = last / "per_rank" if last.is_dir() else target.with_name(target.name + ".zero")
    assert sorted(p.name for p in partitions.glob("*.pt")) == ["rank_00000.pt", "rank_00001.pt"]  # ZeRO state
    if not last.is_dir():  # the portable format's partitions: each with its sidecar, verified with the file
        assert {p.name for p in partitions.glob("*.meta.json")} == {"rank_00000.pt.meta.json",
                                                                   "rank_00001.pt.meta.json"}
    assert last.is_dir() == ("parallel=ep2" in parallel)  # EP: each rank wrote its experts (sharded)


@pytest.mark.slow
def test_cpu_deepspeed_zero2_resume_restores_partitions(tmp_path, zero2_run):
    run = tmp_path / "ds"
    shutil.copytree(zero2_run, run, symlinks=True)  # last.ckpt is a link, as the run left it
    args = ZERO2
    uninterrupted = losses(run)
    ckpts = run / "checkpoints"
    (ckpts / "last.ckpt").unlink()  # as if killed after the step-10 save: a link, then the step-20 dir
    shutil.rmtree(ckpts / "step-000020.ckpt")
    proc = train(run, *args, resume=True)
    assert "step-000010" in proc.stdout
    assert "optimizer state not restored" not in proc.stdout + proc.stderr
    resumed = losses(run)
    assert max(abs(a - b) for a, b in zip(resumed, uninterrupted, strict=True)) <= TOL


@pytest.mark.slow
def test_a_resume_at_another_world_size_restores_the_weights_and_restarts_adam(tmp_path):
    """ZeRO partitions are cut for one world size: resumed on 4 ranks (dp 4, ep 2) from a 2-rank save,
    they cannot be resharded. The weights can (the checkpoint is canonical): the run says the optimizer
    state was not restored, the first resumed step's loss is the uninterrupted run's (same weights, same
    global batch, load balance over every rank) and training goes on."""
    run = tmp_path / "ds"
    two = ("hardware=cpu_deepspeed", "parallel=ep2", "parallel.zero_stage=2", "moe_opt.aux_loss_group=dp",
           *TWO_RANKS)
    train(run, *two)
    uninterrupted = losses(run)
    ckpts = run / "checkpoints"
    (ckpts / "last.ckpt").unlink()
    shutil.rmtree(ckpts / "step-000020.ckpt")
    four = ("hardware=cpu_deepspeed", "parallel=ep2", "parallel.zero_stage=2", "moe_opt.aux_loss_group=dp",
            "trainer.devices=4", "hardware.devices_per_node=4", "trainer.micro_batch_size=1")
    proc = train(run, *four, resume=True)
    said = proc.stdout + proc.stderr
    assert "step-000010" in proc.stdout
    assert "optimizer state not restored (saved with {'world_size': 2" in said
    assert "'world_size': 4" in said and "Adam moments start from zero" in said
    resumed = losses(run)
    assert abs(resumed[10] - uninterrupted[10]) <= TOL and len(resumed) == 20
