"""Run by tests/test_fused_swiglu.py in a fresh process: Triton chooses its interpreter (TRITON_INTERPRET=1)
when it is first imported, and a test process may have imported it already (torch.compile does). Prints, as
JSON, each case's largest error of the fused kernels against the eager formula in fp32 (relative) and, in
bf16, in units of a bf16 rounding of the fp32 result, for the output and both gradients."""
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402

from moe.model.fused_swiglu import fused_swiglu  # noqa: E402
from moe.model.routing import swiglu  # noqa: E402


def run(fn, h, w, d_out):
    h = h.clone().requires_grad_()
    w = None if w is None else w.clone().requires_grad_()
    y = fn(h, w)
    y.backward(d_out)
    return [y, h.grad] + ([] if w is None else [w.grad])


def case(weighted: bool, F: int = 1100):  # 1100 columns: two blocks of 1024, the second partial
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(6, 2 * F, generator=gen)
    w = torch.rand(6, 1, generator=gen) if weighted else None
    return h, w, torch.randn(6, F, generator=gen)


results = {}
for weighted in (False, True):
    h, w, d_out = case(weighted)
    exact = run(swiglu, h, w, d_out)
    fp32 = run(fused_swiglu, h, w, d_out)
    results[f"fp32 weighted={weighted}"] = [((a - b).abs().max() / b.abs().max()).item()
                                            for a, b in zip(fp32, exact, strict=True)]
    h16, d_out16 = h.bfloat16(), d_out.bfloat16()
    bf16 = run(fused_swiglu, h16, w, d_out16)
    exact16 = run(swiglu, h16.float(), w, d_out16.float())  # the same bf16 inputs, fp32 arithmetic
    results[f"bf16 weighted={weighted}"] = [((a.float() - b).abs() / (b.abs() * 2**-8 + 1e-6)).max().item()
                                            for a, b in zip(bf16, exact16, strict=True)]
    results[f"dtypes weighted={weighted}"] = [str(t.dtype) for t in bf16]
json.dump(results, sys.stdout)
