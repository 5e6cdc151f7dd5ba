"""The experts' fused SwiGLU kernels (moe/model/fused_swiglu.py), run on the CPU in Triton's interpreter
(tests/_fused_swiglu_probe.py, in a process of its own): the eager formula (moe.model.routing.swiglu) in
fp32, forward and both gradients, with and without the routing weight, rows longer than one block; in bf16
each value within one bf16 ulp of the fp32 arithmetic on the same inputs: the kernels round once (eager
after every op), and the interpreter casts to bf16 by truncation where a GPU rounds to nearest. The product
selects the kernels on CUDA only; where Triton is not installed (the CPU torch wheel) this skips, and
`make test-floor`'s venv (torch 2.9's CUDA build, which ships Triton) runs it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from moe.model import fused_swiglu as fused
from moe.model.routing import swiglu


def test_the_kernels_compute_the_eager_formula_to_one_bf16_ulp():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "_fused_swiglu_probe.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout)
    for weighted in (False, True):
        assert max(errors[f"fp32 weighted={weighted}"]) < 1e-5, errors  # output, d_h (and d_weights)
        # measured 1.95-1.98 units of 2^-8 of the value (the interpreter truncates: up to 2)
        assert max(errors[f"bf16 weighted={weighted}"]) <= 2.0, errors
        assert errors[f"dtypes weighted={weighted}"][:2] == ["torch.bfloat16"] * 2
    assert errors["dtypes weighted=True"][2] == "torch.float32"  # the routing weights' own dtype


def test_the_product_picks_the_eager_formula_off_cuda():
    assert fused.activation(torch.device("cpu"), torch.bfloat16) is swiglu
