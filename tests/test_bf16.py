"""bf16-mixed on every torch backend: 20 steps of each layout against one fp32 process holding the same global
batch (tests/_parity.py), every step's loss within BF16_TOL.

bf16 keeps 8 bits of mantissa (unit roundoff 2^-8 = 0.4%): each layout's autocast matmuls differ from fp32
by that much per product, and the differences compound over 20 AdamW steps. Gradients are reduced and
accumulated in fp32 on all three backends (FSDP2's reduce_dtype; DeepSpeed's communication_data_type and
grad_accum_dtype (deepspeed_config, moe/backends/deepspeed); DDP reduces what autocast's fp32 weights give).
Measured (2026-11-26): DDP 0.0021, DeepSpeed EP 2 + ZeRO-2 0.0078, FSDP2 TP 2 x EP 2 0.0042 (losses near
5-6: at most 0.15%).
"""
from __future__ import annotations

import pytest

from tests._parity import TWO_RANKS, assert_same_losses, single_process_baseline, train

BF16_TOL = 0.02  # absolute, on losses between 6.3 and 4.9: 0.3-0.4%, bf16's unit roundoff
BF16 = ("trainer.precision=bf16-mixed", "moe_opt.aux_loss_group=dp")
LAYOUTS = {
    "ddp_ep2": ("hardware=cpu", "parallel=ep2", *TWO_RANKS),
    "deepspeed_ep2_zero2": ("hardware=cpu_deepspeed", "parallel=ep2_zero2", *TWO_RANKS),
    "fsdp2_tp2_ep2": ("hardware=cpu_fsdp2", "parallel=fsdp2_tp2", "parallel.ep=2", "trainer.devices=2",
                      "trainer.micro_batch_size=4"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_mixed_matches_the_fp32_one_process_losses(tmp_path, tmp_path_factory, layout):
    single = single_process_baseline(tmp_path_factory)
    train(tmp_path / layout, *BF16, *LAYOUTS[layout])
    worst = assert_same_losses(tmp_path / layout, single, tol=BF16_TOL)
    print(f"{layout}: bf16 within {worst:.4f} of the fp32 one-process losses")
    assert worst > 0  # bf16 did run: an fp32 run of these layouts matches to 1e-4 (tests/test_fsdp2.py)
