"""Resume across layouts (issue L): a checkpoint written by one layout, resumed by another, gives steps 11-20
of the uninterrupted run within TOL (fp32; the layouts reduce in other orders, so not bitwise).

Each source run first proves itself against one process holding the same global batch (tests/_parity.py),
then its step-10 checkpoint is resumed: DDP at ep 4 (one expert pair per rank) by ep 2; DDP at ep 2 on 4
ranks (every expert on 2 replicas: expert-DP 2) by FSDP2 at ep 2 on 2 ranks; FSDP2 HSDP (2 shard groups of
2) by DDP at ep 2. TP with EP folded resumes under EP alone and DDP in tests/test_fsdp2.py.
"""
from __future__ import annotations

import shutil

import pytest

from tests._parity import TOL, TWO_RANKS, assert_same_losses, losses, single_process_baseline, train

FOUR = ("trainer.devices=4", "hardware.devices_per_node=4", "trainer.micro_batch_size=1",
        "moe_opt.aux_loss_group=dp")
SOURCES = {
    "ddp_ep4": ("hardware=cpu", "parallel=ep2", "parallel.ep=4", *FOUR),
    "ddp_ep2_expert_dp2": ("hardware=cpu", "parallel=ep2", *FOUR),
    "fsdp2_hsdp": ("hardware=cpu_fsdp2", "parallel=fsdp2_hsdp", *FOUR),
}
TARGETS = {
    "ddp_ep4": ("hardware=cpu", "parallel=ep2", "moe_opt.aux_loss_group=dp", *TWO_RANKS),
    "ddp_ep2_expert_dp2": ("hardware=cpu_fsdp2", "parallel=fsdp2_ep2", "moe_opt.aux_loss_group=dp",
                           *TWO_RANKS),
    "fsdp2_hsdp": ("hardware=cpu", "parallel=ep2", "moe_opt.aux_loss_group=dp", *TWO_RANKS),
}


@pytest.mark.slow
@pytest.mark.parametrize("source", list(SOURCES))
def test_a_checkpoint_resumes_under_another_layout(tmp_path, tmp_path_factory, source):
    run = tmp_path / source
    train(run, *SOURCES[source])
    assert_same_losses(run, single_process_baseline(tmp_path_factory))
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    for saved in (run / "checkpoints").glob("step-000010.ckpt*"):
        (shutil.copytree if saved.is_dir() else shutil.copy2)(saved, resumed / "checkpoints" / saved.name)
    proc = train(resumed, *TARGETS[source], resume=True)
    assert "step-000010" in proc.stdout
    got, want = losses(resumed), losses(run)[10:]
    assert len(got) == 10
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    print(f"{source} -> {TARGETS[source][:2]}: steps 11-20 within {worst:.2e}")
    assert worst <= TOL

