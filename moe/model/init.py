"""Parameter initialisation: one rule, and values that do not depend on how the model is split.

Rule (as Mixtral's and Megatron's): normal(0, init_range) for every weight, output
projections (o_proj, dense down_proj, expert down, shared-expert down) at init_range /
sqrt(2 * num_layers), norm weights 1, biases 0 (gpt-oss's attention sinks: normal(0, init_range), as
transformers' GptOssPreTrainedModel._init_weights).

Every parameter draws from its own generator, seeded from (the model's base seed, its name),
and every expert of a stacked expert tensor from (base seed, name, global expert index). A
rank that holds only experts [a, b) of a layer, or only one pipeline stage, therefore gets
exactly the values one process would give those parameters, without drawing the rest
(moe.model.model.MoETransformer draws the base seed from torch's global generator, so
`torch.manual_seed(s)` still fixes a model, and ranks seeded alike agree).
"""
from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from moe.model.expert_layout import EXPERT_LAYOUT, IN_OUT, stored

# down_proj: dense and shared; the experts' down (EXPERT_LAYOUT.names: gate_up, down)
OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", EXPERT_LAYOUT.layer_names[1])


def init_stds(model_cfg) -> tuple[float, float]:
    """(std of weights, std of output projections) for a ModelConfig."""
    return model_cfg.init_range, model_cfg.init_range / math.sqrt(2 * model_cfg.num_layers)


def draw_base_seed() -> int:
    """A base seed from torch's global CPU generator (also under a meta device or fake tensors)."""
    with unset_fake_temporarily():
        return int(torch.randint(2**62, (1,), generator=torch.default_generator, device="cpu"))


def parameter_seed(base_seed: int, name: str, expert: int | None = None) -> int:
    key = f"{base_seed}/{name}" + ("" if expert is None else f"/{expert}")
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def normal_values(seed: int, shape, std: float, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """normal(0, std) from a generator seeded with `seed`, drawn in fp32 on `device`, cast to `dtype`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen).to(dtype)


def std_of(name: str, std: float, out_std: float) -> float | None:
    """The init std of the parameter called `name` (None: a norm weight, initialised to 1)."""
    if name.endswith("norm.weight"):
        return None
    return out_std if name.endswith(OUTPUT_PROJECTIONS) else std


def initial_values(name: str, shape, base_seed: int, std: float, out_std: float, *,
                   first_expert: int | None = None, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """The values parameter `name` starts from; experts (first_expert given) are drawn one by one, each
    [in, out] whatever the stored layout (moe.model.expert_layout), so a layout change keeps the values."""
    if name.endswith("bias"):  # projections' and the router's biases (model.qkv_bias, ...) start at zero
        return torch.zeros(shape, device=device, dtype=dtype)
    sigma = std_of(name, std, out_std)
    if sigma is None:
        return torch.ones(shape, device=device, dtype=dtype)
    if first_expert is None:
        return normal_values(parameter_seed(base_seed, name), shape, sigma, device, dtype)
    layout = stored()
    in_out = layout.convert_shape(shape, IN_OUT)
    values = torch.stack([normal_values(parameter_seed(base_seed, name, first_expert + e), in_out[1:], sigma,
                                        device, dtype) for e in range(in_out[0])])
    return layout.from_in_out(values).contiguous()


@torch.no_grad()
def initialize(module: nn.Module, base_seed: int, std: float, out_std: float) -> None:
    """Fill every parameter of `module` (names as `named_parameters` gives them) from the rule.

    Parameters on the meta device are left for later (moe.model.model.MoETransformer.materialize).
    Expert tensors carry `first_expert` (their global index of row 0, moe.model.moe.Experts).
    """
    for name, p in module.named_parameters():
        if p.is_meta:
            continue
        first = getattr(p, "first_expert", None) if getattr(p, "is_expert", False) else None
        p.copy_(initial_values(name, p.shape, base_seed, std, out_std, first_expert=first, device=p.device,
                               dtype=p.dtype))
