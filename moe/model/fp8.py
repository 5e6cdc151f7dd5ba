"""FP8 expert GEMMs (moe_opt.fp8_experts): the experts' grouped GEMMs with float8 e4m3 operands, forward and
backward, in torchao's rowwise recipe (torchao/prototype/moe_training/fp8_grouped_mm.py, _Float8GroupedMM):

- forward  y = x @ W:     x scaled per row (over K), W per expert and output column (over K);
- backward dx = dy @ W^T: dy per row (over N), W per expert and input row (over N);
- backward dW = x^T @ dy: per expert, x and dy per column over that expert's rows.

Scales are amax-based (448 / amax, float8 e4m3's largest value), rounded down to a power of two as torchao
rounds them: a power of two scales exactly, so an e4m3 value times its decode scale is also a bf16 value.
The GEMMs accumulate in fp32 and write bf16; the high-precision inputs are what autograd keeps, as for bf16.

Where it runs: `torch._scaled_grouped_mm` on a card that has FP8 grouped GEMMs (CUDA compute capability 9.0
or later; probed once against the emulation; a GPU without it is refused at start-up, moe.train.environment);
on the CPU the same quantised operands dequantised (exactly, above) and multiplied in fp32 per expert: the
numerics of the card's kernel up to the order of its sums. The FP8 kernel wants each expert's rows to start
at a multiple of 16, so the rows are padded into a buffer of M + 16 E rows, rounded up to 16 (a static size:
no host sync), and read back after.

The layout: the kernel's right operand is column-major, as the stored `[E, out, in]` already runs
(moe.model.expert_layout); the quantised weight is written column-major whatever the stored layout (the cast
copies anyway), and its transpose for dx is a view.
"""
from __future__ import annotations

import itertools

import torch

from moe.model.probing import probing
from moe.model.sync import host_sizes

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
ALIGN = 16  # rows per expert group, and K and N, in multiples of this for the FP8 kernel
AMAX_FLOOR = 1e-12  # an all-zero row scales as if its amax were this (torchao's EPS)
FAST_ACCUM = False  # Hopper's fast FP8 accumulation (torchao uses it; DeepSeek-V3 found it lossy at large K)

_SCALED_GROUPED_MM_OK: dict[str, bool] = {}


def quantize(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 data, fp32 scale) with one scale per slice along `dim` (kept as a size-1 dim): data * scale^-1
    is t to e4m3's resolution."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).float()
    return _cast(t, _power_of_two_scale(amax))


def quantize_per_group(t_PK: torch.Tensor, group_P: torch.Tensor,
                       groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 data [P, K], fp32 scales [groups, K]): one scale per column of each group's rows; group_P says
    which group each row is in (`groups` past the last group: those rows scaled on their own, in no GEMM)."""
    K = t_PK.shape[1]
    amax = torch.zeros(groups + 1, K, dtype=torch.float32, device=t_PK.device)
    amax.scatter_reduce_(0, group_P[:, None].expand(-1, K), t_PK.detach().abs().float(), "amax")
    scales = _power_of_two_scale(amax)
    data, _ = _cast(t_PK, scales[group_P])
    return data, scales[:groups]


def _power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(FP8_MAX / amax.clamp(min=AMAX_FLOOR))))


def _cast(t: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (t.detach().float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def padded_groups(ends_E: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of `rows` rows (sorted by expert; expert e's end at ends_E[e]) goes in a buffer whose
    groups start at multiples of ALIGN: (destination row [rows], the groups' ends in it [E] int32, its
    size). A group's rows end where its padded slot ends (one shift per group); rows past the last group
    go after it, in no group."""
    ends = ends_E.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_ends = torch.cumsum((counts + ALIGN - 1) // ALIGN * ALIGN, 0)
    row = torch.arange(rows, device=ends.device)
    group = torch.searchsorted(ends, row, right=True)  # E for the rows after the last group
    shift = torch.cat([padded_ends - ends, padded_ends[-1:] - ends[-1:]])  # how far each group moves down
    size = (rows + ALIGN * ends.numel() + ALIGN - 1) // ALIGN * ALIGN  # dW's [K, size] rows: 16-byte aligned
    return row + shift[group], padded_ends.to(torch.int32), size


def fp8_grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
    """x_MK rows sorted by expert (expert e's end at ends_E[e], int32) times each expert's w_EKN[e], both
    GEMMs of its backward too, in FP8 -> bf16 [M, N]. Rows after the last expert's: undefined, as in
    torch._grouped_mm."""
    dest_M, padded_ends_E, size = padded_groups(ends_E, x_MK.shape[0])
    x_PK = x_MK.new_zeros(size, x_MK.shape[1]).index_copy(0, dest_M, x_MK)
    return _FP8GroupedMM.apply(x_PK, w_EKN, padded_ends_E).index_select(0, dest_M)


class _FP8GroupedMM(torch.autograd.Function):
    """y = x @ W per expert group, its three GEMMs in FP8 (the recipe above); groups start at multiples of
    ALIGN."""

    @staticmethod
    def forward(ctx, x_PK, w_EKN, ends_E):
        ctx.save_for_backward(x_PK, w_EKN, ends_E)
        x_q, x_scale = quantize(x_PK, dim=-1)  # [P, 1]
        w_q, w_scale = quantize(w_EKN, dim=-2)  # [E, 1, N]
        return _scaled_mm_3d(x_q, x_scale[:, 0], _column_major(w_q), w_scale[:, 0], ends_E)

    @staticmethod
    def backward(ctx, dy_PN):
        x_PK, w_EKN, ends_E = ctx.saved_tensors
        dy_q, dy_scale = quantize(dy_PN, dim=-1)  # [P, 1]
        w_q, w_scale = quantize(w_EKN, dim=-1)  # [E, K, 1]: over N, the dx GEMM's contraction
        dx = _scaled_mm_3d(dy_q, dy_scale[:, 0], w_q.transpose(-2, -1), w_scale[..., 0], ends_E)
        group_P = torch.searchsorted(ends_E.long(), torch.arange(x_PK.shape[0], device=x_PK.device),
                                     right=True)
        E = ends_E.numel()
        x_q, x_scale = quantize_per_group(x_PK, group_P, E)  # [E, K]
        g_q, g_scale = quantize_per_group(dy_PN, group_P, E)  # [E, N]
        dw = _scaled_mm_2d(x_q, x_scale, g_q, g_scale, ends_E)  # [E, K, N]
        return dx.to(x_PK.dtype), dw.to(w_EKN.dtype), None


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _scaled_mm_3d(a_q, a_scale_P, b_q_EKN, b_scale_EN, ends_E) -> torch.Tensor:
    """[P, K] @ [E, K, N] per group -> bf16 [P, N]; the scales are the encode ones (data = value * scale),
    the kernel takes their reciprocals."""
    if fp8_kernel(a_q.device):
        return torch._scaled_grouped_mm(a_q, b_q_EKN, a_scale_P.reciprocal(),
                                        b_scale_EN.reciprocal().contiguous(), offs=ends_E,
                                        out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)
    a = _dequantized(a_q, a_scale_P[:, None])
    b = _dequantized(b_q_EKN, b_scale_EN[:, None, :])
    out = a.new_zeros(a.shape[0], b.shape[-1])
    with torch.autocast(a.device.type, enabled=False):  # fp32 sums, as the kernel's
        for e, (start, end) in enumerate(_bounds(ends_E, a.shape[0])):
            out[start:end] = a[start:end] @ b[e]
    return out.to(torch.bfloat16)


def _scaled_mm_2d(a_q_PK, a_scale_EK, b_q_PN, b_scale_EN, ends_E) -> torch.Tensor:
    """Per group g: a[g rows]^T @ b[g rows] -> bf16 [E, K, N] (the weight gradient)."""
    if fp8_kernel(a_q_PK.device):
        a_KP = a_q_PK.t().contiguous()  # row-major [K, P]
        return torch._scaled_grouped_mm(a_KP, _column_major(b_q_PN), a_scale_EK.reciprocal().reshape(-1),
                                        b_scale_EN.reciprocal().reshape(-1), offs=ends_E,
                                        out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)
    out = torch.zeros(ends_E.numel(), a_q_PK.shape[1], b_q_PN.shape[1], device=a_q_PK.device)
    with torch.autocast(a_q_PK.device.type, enabled=False):  # fp32 sums, as the kernel's
        for e, (start, end) in enumerate(_bounds(ends_E, a_q_PK.shape[0])):
            a_K = _dequantized(a_q_PK[start:end], a_scale_EK[e])
            out[e] = a_K.t() @ _dequantized(b_q_PN[start:end], b_scale_EN[e])
    return out.to(torch.bfloat16)


def _bounds(ends_E: torch.Tensor, rows: int) -> list[tuple[int, int]]:
    """Each group's (start, end) row as Python ints (one sync: the emulation's per-expert loop)."""
    counts = torch.diff(ends_E.long(), prepend=ends_E.new_zeros(1, dtype=torch.long))
    ends = list(itertools.accumulate(host_sizes(counts, int(rows))))
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _dequantized(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """data / scale in fp32: exact (scale is a power of two)."""
    return data.float() / scale


def fp8_kernel(device: torch.device) -> bool:
    """Whether torch._scaled_grouped_mm runs here and agrees with the emulation (what moe_opt.fp8_experts
    needs on a CUDA device); probed once per device."""
    if device.type != "cuda":
        return False
    key = str(device)
    if key not in _SCALED_GROUPED_MM_OK:
        with probing(device.type):  # its reference matmuls in fp32, whatever autocast the caller runs under
            _SCALED_GROUPED_MM_OK[key] = _probe(device)
    return _SCALED_GROUPED_MM_OK[key]


def _probe(device: torch.device) -> bool:
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 32, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(3, 32, 16, generator=gen).to(device, torch.bfloat16)
    ends = torch.tensor([16, 16, 48], dtype=torch.int32, device=device)  # expert 1 gets no rows
    x_q, x_scale = quantize(x, -1)
    w_q, w_scale = quantize(w, -2)
    try:
        got = torch._scaled_grouped_mm(x_q, _column_major(w_q), x_scale[:, 0].reciprocal(),
                                       w_scale[:, 0].reciprocal().contiguous(), offs=ends,
                                       out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    a, b = _dequantized(x_q, x_scale), _dequantized(w_q, w_scale)
    want = torch.cat([a[:16] @ b[0], a[16:] @ b[2]])
    return torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)
