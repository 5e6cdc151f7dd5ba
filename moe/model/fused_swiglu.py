"""The experts' SwiGLU as one Triton kernel each way, for the eager path on CUDA (model.compile=false, and the
recomputation under activation checkpointing): silu(gate) * up [* routing weight] from the grouped GEMM's
[M, 2F] output, gate columns first.

Eager PyTorch runs it as three elementwise kernels forward (silu, the product, the weight) and more backward,
each reading and writing [M, F] or [M, 2F] in bf16; the H100 profile of the Mixtral stack put elementwise
multiplies at 8% of a step. Here the forward reads [M, 2F] once and writes [M, F]; the backward reads it and
the output's gradient once and writes the input's gradient, plus one partial sum per row and block for the
routing weight's gradient. The sums are fp32 and each output is rounded once, as torch.compile's fused kernel
does (model.compile=true: `region(swiglu, True)`), where eager rounds after every op.

Selected by `activation(...)`: on CUDA with Triton importable, where a probe against the eager formula passes
(once per device and dtype), unless `ENABLED` is set False (bench/gpu_moe_stack.py --swiglu eager, the peer);
the eager formula (moe.model.routing.swiglu) everywhere else. Tests run the kernels on the CPU in Triton's
interpreter (TRITON_INTERPRET=1), where Triton is installed.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from moe.model.probing import probing
from moe.model.routing import swiglu

BLOCK = 1024  # columns of one row per program
ENABLED = True  # False: the eager formula on CUDA too (a bench's peer)

_WORKS: dict[tuple[str, torch.dtype], bool] = {}


def activation(device: torch.device, dtype: torch.dtype) -> Callable:
    """The SwiGLU the eager experts run on `device` in `dtype`: the fused kernel where it works, else
    swiglu."""
    # under torch.compile its own fused kernel; under a dispatch mode (fake tensors, trackers) every op seen
    if not ENABLED or device.type != "cuda" or torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return swiglu
    key = (str(device), dtype)
    if key not in _WORKS:  # the first forward may be an eval's, or recomputed under activation checkpointing
        with probing(device.type):
            _WORKS[key] = _probe(device, dtype)
    return fused_swiglu if _WORKS[key] else swiglu


def fused_swiglu(h_M2F: torch.Tensor, weights_M1: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up (* weights), gate the first half of the columns; [M, F] in h's dtype."""
    return _FusedSwiGLU.apply(h_M2F, weights_M1)


class _FusedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_M2F, weights_M1):
        h = h_M2F.contiguous()
        M, F = h.shape[0], h.shape[1] // 2
        w = None if weights_M1 is None else weights_M1.reshape(M).float().contiguous()
        out = h.new_empty(M, F)
        forward_kernel, _ = _kernels()
        forward_kernel[(M, -(-F // BLOCK))](h, w if w is not None else h, out, F, HAS_WEIGHTS=w is not None,
                                           BLOCK=BLOCK)
        ctx.save_for_backward(h, w)
        ctx.weights_dtype = None if weights_M1 is None else weights_M1.dtype
        return out

    @staticmethod
    def backward(ctx, d_out_MF):
        h, w = ctx.saved_tensors
        M, F = h.shape[0], h.shape[1] // 2
        blocks = -(-F // BLOCK)
        d_out = d_out_MF.contiguous()
        d_h = torch.empty_like(h)
        d_w_parts = torch.empty(M, blocks, dtype=torch.float32, device=h.device)
        _, backward_kernel = _kernels()
        backward_kernel[(M, blocks)](h, w if w is not None else h, d_out, d_h, d_w_parts, F, blocks,
                                     HAS_WEIGHTS=w is not None, BLOCK=BLOCK)
        d_w = None if w is None else d_w_parts.sum(1, keepdim=True).to(ctx.weights_dtype)
        return d_h, d_w


def _kernels():
    """The two kernels, imported at first use: Triton reads TRITON_INTERPRET when it defines a kernel, and
    only a CUDA run (or a test) needs Triton at all."""
    from moe.model.swiglu_kernels import backward_kernel, forward_kernel

    return forward_kernel, backward_kernel


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernels against the eager formula on a small case, forward and backward (one rounding apart)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(5, 2 * 40, generator=gen).to(device, dtype).requires_grad_()
        w = torch.rand(5, 1, generator=gen).to(device).requires_grad_()
        d_out = torch.randn(5, 40, generator=gen).to(device, dtype)
        got = fused_swiglu(h, w)
        grads = torch.autograd.grad(got, (h, w), d_out)
        hf, wf = h.detach().float().requires_grad_(), w.detach().requires_grad_()
        want = swiglu(hf, wf)
        want_grads = torch.autograd.grad(want, (hf, wf), d_out.float())
        pairs = [(got, want), *zip(grads, want_grads, strict=True)]
        return all(torch.allclose(a.float(), b, rtol=2e-2, atol=2e-2) for a, b in pairs)
    except Exception:  # noqa: BLE001  (a Triton build or driver that cannot compile it: the eager formula)
        return False
