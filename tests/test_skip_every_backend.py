"""A skipped step skips on every backend: the spike guard's skip (moe.module.train_step: `guard.skips`, then
`backend.skip_update`) leaves the weights and the optimizer state bit for bit as they were, on DDP, FSDP2,
FSDP2 pipelined, DeepSpeed with each optimizer it steps with (ZeRO-0 and ZeRO-1 in fp32
and bf16, ZeRO-2 in bf16), and trn1 (on neuronx-distributed's real code:
tests/neuron_real, `make test-neuron`), and a non-finite gradient under a finite loss is caught on each; the
next step updates.

One real train.py run per backend, 4 steps of the tiny model: step 2's gradient made non-finite on rank 0
(a hook on a backward), step 3 skipped by the guard with a finite gradient (the rollback ledger), step 4
as usual; tests/neuron_real/skip_probe.py has the probe, the verdict and why each step is made so (run.sh
runs the same check on neuronx-distributed's real code).
"""
from __future__ import annotations

import pytest

from tests.conftest import FAST_RUN, run_entry
from tests.neuron_real.skip_probe import STEPS, problems, write_ledger

TINY = ("model.hidden_size=32", "model.intermediate_size=32", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "model.num_experts=4", "data.seq_len=16", "trainer.micro_batch_size=2",
        f"trainer.max_steps={STEPS}", "optimizer.warmup_steps=1", "trainer.limit_val_batches=0",
        "trainer.save_checkpoints=false", "trainer.spike_factor=0", "seed=3")
TWO = ("trainer.devices=2", "hardware.devices_per_node=2")
DEEPSPEED = ("hardware=cpu_deepspeed", "parallel=ep2", *TWO)  # experts in DeepSpeed's MoE groups too
slow = pytest.mark.slow  # two processes, 10-30 s each
BF16 = ("trainer.precision=bf16-mixed",)

CASES = [  # (overrides, the subprocess's environment: None trains in this process)
    pytest.param(("hardware=cpu", "trainer.devices=1"), None, id="ddp_1_rank"),
    pytest.param(("hardware=cpu_fsdp2", *TWO), {}, id="fsdp2", marks=slow),
    pytest.param(("hardware=cpu_fsdp2", "parallel.pp=2", "trainer.accumulate_grad_batches=2", *TWO), {},
                 id="fsdp2_pp2", marks=slow),
    # each of DeepSpeed's optimizers once (moe/backends/deepspeed/backend.py _optimizer_kind): the client's
    # own (ZeRO-0 fp32), FP16_Optimizer (ZeRO-0 bf16), DeepSpeedZeroOptimizer at stage 1 in fp32 and at
    # stage 2 in bf16 (its gradients partitioned), BF16_Optimizer (ZeRO-1 bf16, fp32 accumulation)
    *[pytest.param((*DEEPSPEED, f"parallel.zero_stage={zero}", *precision), {},
                   id=f"deepspeed_zero{zero}_{'bf16' if precision else 'fp32'}", marks=slow)
      for zero, precision in ((0, ()), (0, BF16), (1, ()), (1, BF16), (2, BF16))],
    # trn1: the same probe on neuronx-distributed's real code, ZeRO-1 with mixed precision's fp32 gradient
    # accumulation (the gradients in `main_grad`), in `make test-neuron` (tests/neuron_real/run.sh skip_py)
]


@pytest.mark.parametrize("overrides, env", CASES)
def test_a_skipped_step_leaves_weights_and_optimizer_state_and_the_next_one_updates(
        overrides, env, tmp_path, train_here):
    run_dir, probe = tmp_path / "run", tmp_path / "probe"
    write_ledger(run_dir)
    args = (*TINY, *overrides, "+callbacks.skip._target_=tests.neuron_real.skip_probe.SkipProbe",
            f"+callbacks.skip.out={probe}")
    if env is None:
        train_here(*args, run_dir=run_dir)
    else:
        run_entry("train.py", f"hydra.run.dir={run_dir}", *FAST_RUN, *args, env=env, timeout=900, check=True)
    assert problems(run_dir, probe, world=2 if "trainer.devices=2" in overrides else 1) == []
