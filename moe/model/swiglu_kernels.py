"""The Triton kernels of moe/model/fused_swiglu.py (the experts' SwiGLU, [M, 2F] gate columns first -> [M, F],
each program one row's block of columns, fp32 inside). A module of its own: importing it needs Triton, and
Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) must be chosen before the kernels are defined."""
import triton
import triton.language as tl


@triton.jit
def forward_kernel(h_ptr, w_ptr, out_ptr, F, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(h_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    if HAS_WEIGHTS:
        y = y * tl.load(w_ptr + row)
    tl.store(out_ptr + row * F + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def backward_kernel(h_ptr, w_ptr, d_out_ptr, d_h_ptr, d_w_ptr, F, blocks, HAS_WEIGHTS: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(h_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    d_y = tl.load(d_out_ptr + row * F + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    if HAS_WEIGHTS:
        tl.store(d_w_ptr + row * blocks + block, tl.sum(d_y * silu * up, axis=0))
        d_y = d_y * tl.load(w_ptr + row)
    d_gate = d_y * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = d_y * silu
    tl.store(d_h_ptr + row * 2 * F + cols, d_gate.to(d_h_ptr.dtype.element_ty), mask=mask)
    tl.store(d_h_ptr + row * 2 * F + F + cols, d_up.to(d_h_ptr.dtype.element_ty), mask=mask)
