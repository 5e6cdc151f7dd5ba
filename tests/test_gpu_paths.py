"""What differs on a GPU, emulated on this CPU: the three ways every default GPU command died at step 1 on the
first real GPU (one H200, torch 2.11), each through the real training path (train.py's, in this process).

1. FSDP2 on torch <= 2.11 registers its pre-backward hooks on `tree_flatten(output)` (torch v2.11.0
   torch/distributed/fsdp/_fully_shard/_fsdp_state.py `_register_pre_backward_hook`), which sees a dataclass
   as one leaf; torch 2.13 walks dataclasses (`collect_grad_tensors`). A unit whose output no hook reaches
   and whose weights were freed after forward is never gathered again, and its backward reads freed storage
   (an illegal memory access on CUDA). Patched in here; every saved tensor is checked when autograd reads it.
2. Lightning's AMP plugin refuses to clip for an optimizer that unscales inside its step (the fused AdamW on
   CPU and CUDA); DDP clips by itself, unscaling first under 16-mixed.
3. The grouped-GEMM probe ran inside the caller's autocast and failed its fp32 tolerance: the experts fell
   back to a loop over experts for the whole process.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import trained_rows
from torch.utils._pytree import tree_flatten

from moe.model import moe as moe_layer

STEPS = ("trainer.max_steps=3", "trainer.limit_val_batches=0", "trainer.checkpoint_every_n_steps=100",
         "optimizer.warmup_steps=1")


def _register_pre_backward_hook_torch_2_11(self, output):
    """torch v2.11.0's FSDPState._register_pre_backward_hook, verbatim but for names."""
    if not torch.is_grad_enabled():
        return output
    flat_outputs, _ = tree_flatten(output)
    for t in flat_outputs:
        if torch.is_tensor(t) and t.requires_grad:
            t.register_hook(self._pre_backward)
    return output


class FreedStorageRead(AssertionError):
    """Autograd read a saved tensor whose storage FSDP2 had freed."""


def _pack(t: torch.Tensor) -> torch.Tensor:
    return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    """A saved tensor must still own the bytes it views when backward reads it (FSDP2 frees a resharded
    weight with `untyped_storage().resize_(0)`; on CUDA the read is an illegal memory access)."""
    needed = (t.storage_offset() + t.numel()) * t.element_size() if t.numel() else 0
    if t.device.type != "meta" and t.untyped_storage().nbytes() < needed:
        raise FreedStorageRead(f"backward read a saved {tuple(t.shape)} {t.dtype} tensor with freed storage")
    return t


@pytest.mark.parametrize("zero_stage, log_every, logged",
                         [(3, 1, [1, 2, 3]), (2, 1, [1, 2, 3]), (3, 5, [1, 3])],
                         ids=["zero3", "zero2", "zero3_unlogged_step"])
def test_fsdp2_trains_with_torch_2_11_hooks_and_reads_no_freed_storage(train_here, monkeypatch, zero_stage,
                                                                       log_every, logged):
    """An unlogged step (log_every 5: step 2) outputs RoutingStats without their monitoring numbers (None
    fields): the hooks flatten those outputs too."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    monkeypatch.setattr(FSDPState, "_register_pre_backward_hook", _register_pre_backward_hook_torch_2_11)
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            run_dir = train_here("hardware=cpu_fsdp2", "trainer.devices=1",
                                 f"parallel.zero_stage={zero_stage}", *STEPS,
                                 f"trainer.log_every_n_steps={log_every}")
    except FreedStorageRead as e:  # not pytest's traceback: its repr of the freed weight would read it too
        pytest.fail(str(e), pytrace=False)
    rows = trained_rows(run_dir)
    assert [int(r["step"]) for r in rows] == logged
    assert all(math.isfinite(float(r["grad_norm"])) for r in rows)


def test_model_outputs_are_pytree_nodes_whose_tensors_hooks_reach():
    """tree_flatten (what FSDP2 hooks on torch before 2.13) finds the loss tensors inside the outputs."""
    from moe.model.model import ModelOutput
    from moe.model.routing import RoutingStats

    aux, z, lm = (torch.ones((), requires_grad=True) for _ in range(3))
    stats = RoutingStats(aux, z, torch.zeros(4, dtype=torch.long), *torch.zeros(4))
    leaves, spec = tree_flatten(ModelOutput(None, [stats], aux + z, aux, z, lm_loss=lm))
    found = {id(t) for t in leaves if torch.is_tensor(t) and t.requires_grad}
    assert {id(aux), id(z), id(lm)} <= found
    rebuilt = spec.unflatten(leaves)
    assert isinstance(rebuilt, ModelOutput) and rebuilt.routing[0].aux_loss is aux


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_ddp_clips_a_fused_adamw_under_mixed_precision(train_here, precision):
    """python train.py trainer.precision=bf16-mixed died at step 1 (Lightning's AMP clip check); the default
    clipping (optimizer.grad_clip=1.0) now clips by the global norm: the logged norm is unscaled under
    16-mixed (the loss scale starts at 2^16) and the step is taken."""
    run_dir = train_here(f"trainer.precision={precision}", *STEPS)
    rows = trained_rows(run_dir)
    norms = [float(r["grad_norm"]) for r in rows]
    assert len(rows) == 3 and all(math.isfinite(n) and 0 < n < 100 for n in norms), norms


def test_experts_use_the_grouped_gemm_under_bf16_mixed_autocast(train_here, monkeypatch):
    """Each MoE layer's forward in a DDP bf16-mixed step runs torch._grouped_mm twice (gate/up, down), in
    bf16; none runs in fp32, and no expert falls back to the per-expert loop."""
    from moe.config.derived import is_moe_layer
    from tests.conftest import compose_cfg

    if not moe_layer.grouped_mm_works(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this torch build has no grouped GEMM for bf16 on CPU")
    monkeypatch.setattr(moe_layer, "_GROUPED_MM_OK", {})  # probed again, from inside the step's autocast
    calls: list[torch.dtype] = []
    real = torch._grouped_mm

    def counting(x, w, *args, **kwargs):
        calls.append(x.dtype)
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    run_dir = train_here("trainer.precision=bf16-mixed", "trainer.max_steps=1", "trainer.limit_val_batches=0",
                         "trainer.save_checkpoints=false", "optimizer.warmup_steps=0")
    assert json.loads((run_dir / "summary.json").read_text())["expert_kernel"] == "grouped_mm"
    assert not (run_dir / "checkpoints").exists()
    model = compose_cfg().model
    moe_layers = sum(is_moe_layer(i, model) for i in range(model.num_layers))
    probe = 1  # the probe's own forward call, in bf16
    assert calls.count(torch.bfloat16) == 2 * moe_layers + probe, calls
    assert torch.float32 not in calls, calls


@pytest.mark.slow
def test_make_gpu_check_cpu_smoke_trains_its_paths_and_prints_the_table(tmp_path):
    """bench/gpu_check.py's CPU form, two of its paths: the table a GPU run prints, every loss falling."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--steps", "4", "--no-bench",
                           "--only", "ddp_bf16", "fsdp2_zero3", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| ddp_bf16", "| fsdp2_zero3"))]
    assert len(rows) == 2 and all(row.endswith("| grouped_mm | yes |") for row in rows), proc.stdout
    assert "all 2 paths trained and their loss fell" in proc.stdout
