"""The learning-rate schedule and AdamW parameter groups users configure in optimizer/."""
import math

import pytest
import torch
from omegaconf import OmegaConf

from moe.config import OptimizerConfig
from moe.module.optim import (
    build_optimizer,
    build_scheduler,
    fit_scheduler_states,
    lr_at,
    param_groups,
    warmup_note,
)


def opt_cfg(**kw):
    return OmegaConf.structured(OptimizerConfig(**kw))


def test_warmup_is_linear_then_cosine_reaches_the_floor():
    cfg = opt_cfg(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(10, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.1 + 0.9 * 0.5)  # half way down the cosine
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)
    assert lr_at(500, cfg, 110) == pytest.approx(0.1)  # flat at the floor after decay_steps


def test_decay_steps_overrides_max_steps():
    cfg = opt_cfg(lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=20)
    assert lr_at(10, cfg, 1000) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(20, cfg, 1000) == pytest.approx(0.0)


def test_scheduler_applies_lr_at_each_step():
    model = torch.nn.Linear(4, 4)
    cfg = opt_cfg(lr=0.5, min_lr=0.05, warmup_steps=3)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, max_steps=10)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([lr_at(s, cfg, 10) for s in range(10)])


def test_a_schedule_saved_with_other_param_groups_resumes_at_its_step():
    """DeepSpeed splits experts into groups of their own: its 4-group schedule state, restored into a
    2-group optimizer (another backend), keeps the step and gives every group the schedule's lr there."""
    cfg = opt_cfg(lr=0.5, min_lr=0.05, warmup_steps=3)
    saved = {"lr_schedulers": [{"last_epoch": 7, "_step_count": 8, "base_lrs": [0.5] * 4,
                                "_last_lr": [lr_at(7, cfg, 10)] * 4, "lr_lambdas": [None] * 4}]}
    optimizer = build_optimizer(torch.nn.Linear(4, 4), cfg)  # weights decayed, biases not: 2 groups
    scheduler = build_scheduler(optimizer, cfg, max_steps=10)
    fit_scheduler_states(saved, [scheduler], cfg, max_steps=10)
    scheduler.load_state_dict(saved["lr_schedulers"][0])
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([lr_at(7, cfg, 10)] * 2)
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([lr_at(8, cfg, 10)] * 2)


def test_norms_and_biases_skip_weight_decay():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = param_groups(model, weight_decay=0.1, no_decay_norms_and_biases=True)
    by_name = {g["name"]: g for g in groups}
    assert [p.shape for p in by_name["decay"]["params"]] == [torch.Size([4, 4])]
    assert len(by_name["no_decay"]["params"]) == 3 and by_name["no_decay"]["weight_decay"] == 0.0
    assert len(param_groups(model, 0.1, False)) == 1
    optimizer = build_optimizer(model, opt_cfg(betas=[0.8, 0.9], eps=1e-5))
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9) and optimizer.param_groups[0]["eps"] == 1e-5


def test_a_short_run_clamps_the_default_warmup_to_a_tenth_and_says_so():
    """trainer.max_steps=10 with the default 20 warm-up steps: the lr still reaches its peak."""
    cfg = opt_cfg(lr=1.0, min_lr=0.1, warmup_steps=20)
    lrs = [lr_at(step, cfg, max_steps=10) for step in range(10)]
    assert lrs[0] == pytest.approx(1.0) and lrs[-1] < lrs[0]  # warm-up of 1 step, then decay
    assert "warming up over 1 steps" in warmup_note(cfg, 10)
    assert warmup_note(cfg, 300) is None
