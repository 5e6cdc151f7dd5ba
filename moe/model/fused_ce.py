"""LM head + cross-entropy in token chunks, gradients computed in the forward: no [tokens, vocab] logits.

The plain training loss materialises the fp32 logits of every token ([N, V]: 512 MiB at 4k tokens
and a 32k vocabulary), then log-softmax writes another [N, V] and the backward a third. Here the
tokens go through in chunks of `chunk_size`: each chunk's logits are made, reduced to its loss,
turned into d(loss)/d(logits) = softmax - one_hot at once, and folded into the gradients of the
hidden states and of the head's weight, then dropped. The backward only scales those gradients
by the incoming one. Same maths, same matmuls (the backward's two are done in the forward), a
chunk of logits in memory at a time (Liger Kernel's FusedLinearCrossEntropy; Apple's
cut-cross-entropy avoids even the chunk).

Without grad (validation, `torch.no_grad`) or when neither input needs one, only the loss is
computed, chunk by chunk.
"""
from __future__ import annotations

import torch

from moe.model.loss import IGNORE_INDEX
from moe.model.moe import autocast_dtype

CE_CHUNK_TOKENS = 1024  # tokens per chunk: [1024, vocab] fp32 logits at a time (128 MiB at 32k)
OUT_DTYPE_MM_DEVICES = ("cuda",)  # where aten::mm takes out_dtype (bf16 inputs, fp32 result; torch >= 2.8)


def linear_cross_entropy(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor,
                         chunk_size: int = CE_CHUNK_TOKENS) -> torch.Tensor:
    """mean over tokens whose label is not -100 of CE(hidden @ weight.T, label), in fp32."""
    if torch.is_grad_enabled() and (hidden_NH.requires_grad or weight_VH.requires_grad):
        return _LinearCrossEntropy.apply(hidden_NH, weight_VH, labels_N, chunk_size)
    safe_N, valid_f, count = _targets(labels_N)
    total = sum(_chunk_losses(hidden_NH[s:s + chunk_size], weight_VH, safe_N[s:s + chunk_size],
                              valid_f[s:s + chunk_size], want_grad=False)[0]
                for s in range(0, hidden_NH.shape[0], chunk_size))
    return total / count


def _targets(labels_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels with -100 replaced by 0, 1.0 where a token carries loss, how many do (at least 1))."""
    valid_N = labels_N != IGNORE_INDEX
    return labels_N.masked_fill(~valid_N, 0), valid_N.to(torch.float32), valid_N.sum().clamp(min=1)


def _chunk_losses(h_CH, weight_VH, labels_C, valid_C, want_grad: bool):
    logits_CV = (h_CH @ weight_VH.T).float()
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    target_C = logits_CV.gather(1, labels_C.unsqueeze(1)).squeeze(1)
    loss = ((lse_C - target_C) * valid_C).sum()
    if not want_grad:
        return loss, None
    grad_CV = torch.exp(logits_CV - lse_C.unsqueeze(1))  # softmax: d(CE)/d(logits) less the one-hot
    grad_CV.scatter_add_(1, labels_C.unsqueeze(1), -torch.ones_like(target_C).unsqueeze(1))
    grad_CV *= valid_C.unsqueeze(1)
    return loss, grad_CV


def _add_weight_grad(grad_w: torch.Tensor, grad_CV: torch.Tensor, h_CH: torch.Tensor,
                     dtype: torch.dtype) -> None:
    """grad_w (fp32) += grad_CV.T @ h_CH. On CUDA, in half precision: on the tensor cores in `dtype` with an
    fp32 result (aten::mm's out_dtype, CUDA only); an fp32 product there is a SIMT GEMM unless TF32 is on
    (H100, torch 2.11: cutlass_80_simt_sgemm, 17% of bench/gpu_moe_stack.py's step, its --profile). On the
    CPU, in fp32 as before (no matrix units to gain, and bf16 GEMMs are slower than fp32 on most hosts)."""
    if grad_w.device.type in OUT_DTYPE_MM_DEVICES and dtype != torch.float32:
        grad_w += torch.mm(grad_CV.T.to(dtype), h_CH.to(dtype), out_dtype=torch.float32)
    else:
        grad_w.addmm_(grad_CV.T, h_CH.float())


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, chunk_size):
        safe_N, valid_f, count = _targets(labels_N)
        ctx.weight_dtype = weight_VH.dtype
        matmul_dtype = autocast_dtype(hidden_NH.device) or weight_VH.dtype  # as the head's matmuls run
        total = hidden_NH.new_zeros((), dtype=torch.float32)
        grad_h = torch.empty_like(hidden_NH) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight_VH, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden_NH.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h_CH = hidden_NH[rows]
            loss, grad_CV = _chunk_losses(h_CH, weight_VH, safe_N[rows], valid_f[rows], want_grad=True)
            total += loss
            if grad_h is not None:
                grad_h[rows] = (grad_CV.to(weight_VH.dtype) @ weight_VH).to(hidden_NH.dtype)
            if grad_w is not None:
                _add_weight_grad(grad_w, grad_CV, h_CH, matmul_dtype)
        scale = 1.0 / count.to(torch.float32)
        ctx.save_for_backward(grad_h, grad_w, scale)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, scale = ctx.saved_tensors
        factor = grad_out * scale  # the mean's 1/count and whatever came from above
        d_hidden = None if grad_h is None else grad_h * factor.to(grad_h.dtype)
        d_weight = None if grad_w is None else (grad_w * factor).to(ctx.weight_dtype)
        return d_hidden, d_weight, None, None
