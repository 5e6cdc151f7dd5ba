"""RMSNorm, as Mixtral and DeepSeek compute it (fp32 inside, cast back)."""
from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32, cast back, times weight (transformers' LlamaRMSNorm,
    Qwen3MoeRMSNorm, OlmoeRMSNorm: models/qwen3_moe/modeling_qwen3_moe.py:295-300 at 5.24)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as Mixtral does)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
