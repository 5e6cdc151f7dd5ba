"""How the routed experts' weights are stored, declared once: every reader asks this module.

The experts are two stacked tensors per MoE layer (moe.model.moe.Experts): `gate_up`, the gate's
and then the up projection's outputs fused along the out dim, and `down`. `EXPERT_LAYOUT` says
the order of their dims; the matmuls want `[E, in, out]` (`as_in_out`), Hugging Face stacks them
`[E, out, in]` (nn.Linear's weight, `to_out_in` / `from_out_in`), and every converter, the
initialisation, the sizes and the checkpoint formats go through the operations here, so a change of
the stored order is a change of `EXPERT_LAYOUT` (the product's default) and nothing else.

The expert dim stays first in every layout: expert parallelism, FSDP, the sharded checkpoints'
placement and the portable checkpoints' gathering slice experts along dim 0.

Checkpoints record the layout they were written in (`LAYOUT_KEY`); `upgraded_checkpoint` turns one
written in another (or, with no record, `UNRECORDED`) into the stored layout wherever a checkpoint
is read, beside moe.model.mlp.upgraded's renames. `storing(layout)` switches the stored layout for a
block of code (tests prove a switch is all it takes; models built inside keep their own).

Apart from the stored layout (shapes, names, checkpoints), a tensor's memory order can differ: `arranged`
re-strides an expert tensor so that its memory runs in another layout's order while its shape and values stay
the stored layout's (a column-major view, no change to any checkpoint). Generation arranges the experts once
in `kernel_order`, the order the matmuls there run fastest from (docs/BENCHMARKS.md, "Expert weight layout").
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

DIMS = ("expert", "in", "out")


@dataclass(frozen=True)
class ExpertLayout:
    """The order of the stacked expert tensors' dims, their names, and gate_up's fused segments."""

    dims: tuple[str, str, str] = DIMS
    names: tuple[str, str] = ("gate_up", "down")  # Experts' parameter names
    module: str = "experts"  # the Experts module in an MoE layer
    block: str = "ffn"  # the MoE layer in a block
    segments: tuple[str, ...] = ("gate", "up")  # gate_up's outputs, in order along its out dim

    def __post_init__(self):
        if sorted(self.dims) != sorted(DIMS) or self.dims[0] != "expert":
            raise ValueError(f"expert layout {self.dims}: want a permutation of {DIMS} with the expert first")

    @property
    def expert_dim(self) -> int:
        return self.dims.index("expert")

    @property
    def in_dim(self) -> int:
        return self.dims.index("in")

    @property
    def out_dim(self) -> int:
        return self.dims.index("out")

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The expert tensors' names in an MoE layer (`experts.gate_up`, `experts.down`): what every name of
        them ends with, in a layer's, a block's or the model's state dict."""
        return tuple(f"{self.module}.{name}" for name in self.names)

    @property
    def suffixes(self) -> tuple[str, ...]:
        """Their names in a block's state dict (`ffn.experts.gate_up`, `ffn.experts.down`), as converters
        key them after `layers.N.`."""
        return tuple(f"{self.block}.{name}" for name in self.layer_names)

    def is_expert_tensor(self, name: str) -> bool:
        return name.endswith(self.layer_names)

    def is_gate_up(self, name: str) -> bool:
        return name.endswith(self.layer_names[0])

    def shape(self, num_experts: int, in_features: int, out_features: int) -> tuple[int, int, int]:
        """The stored shape of E experts mapping in_features -> out_features."""
        sizes = {"expert": num_experts, "in": in_features, "out": out_features}
        return tuple(sizes[d] for d in self.dims)

    def convert(self, w: torch.Tensor, to: ExpertLayout) -> torch.Tensor:
        """`w`, stored in this layout, as `to` stores it (a view)."""
        return w.permute(*(self.dims.index(d) for d in to.dims))

    def convert_shape(self, shape, to: ExpertLayout) -> tuple[int, ...]:
        return tuple(shape[self.dims.index(d)] for d in to.dims)

    def as_in_out(self, w: torch.Tensor) -> torch.Tensor:
        """The [E, in, out] view the grouped GEMM and the per-expert matmuls take (x @ w[e])."""
        return self.convert(w, IN_OUT)

    def from_in_out(self, w: torch.Tensor) -> torch.Tensor:
        return IN_OUT.convert(w, self)

    def to_out_in(self, w: torch.Tensor) -> torch.Tensor:
        """[E, out, in], nn.Linear's order: transformers' stacked `gate_up_proj` / `down_proj`."""
        return self.convert(w, OUT_IN)

    def from_out_in(self, w: torch.Tensor) -> torch.Tensor:
        return OUT_IN.convert(w, self)

    def split_gate_up(self, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """gate_up's segments (gate, up), each in this layout."""
        return w.chunk(len(self.segments), dim=self.out_dim)

    def join_gate_up(self, *segments: torch.Tensor) -> torch.Tensor:
        """gate_up from its segments (gate, up), each in this layout."""
        return torch.cat(segments, dim=self.out_dim)

    def stack_linear(self, weights: list[torch.Tensor]) -> torch.Tensor:
        """Stacked tensor from per-expert nn.Linear weights ([out, in]: HF's w1/w2/w3, a dense MLP's)."""
        return self.from_out_in(torch.stack(weights))


IN_OUT = ExpertLayout(("expert", "in", "out"))
OUT_IN = ExpertLayout(("expert", "out", "in"))

# The product's default: the one place the stored order is chosen. [E, out, in], as transformers and
# torchtitan store them: a training step is as fast from it (within 2%) on every CPU measured, and 2.6-3.3x
# faster in half precision where the CPU lacks bf16 instructions; decoding runs from it too (kernel_order).
# Figures: docs/BENCHMARKS.md, "Expert weight layout".
EXPERT_LAYOUT = OUT_IN
UNRECORDED = IN_OUT  # what a checkpoint without LAYOUT_KEY holds: every one written before it existed
LAYOUT_KEY = "expert_layout"

_stored = [EXPERT_LAYOUT]


def stored() -> ExpertLayout:
    """The layout models built now store their experts in (EXPERT_LAYOUT outside `storing`)."""
    return _stored[-1]


@contextmanager
def storing(layout: ExpertLayout) -> Iterator[ExpertLayout]:
    """Store experts in `layout` inside the block (models, converters, checkpoint reads); not thread-safe."""
    _stored.append(layout)
    try:
        yield layout
    finally:
        _stored.pop()


def memory_order(w: torch.Tensor, layout: ExpertLayout) -> ExpertLayout:
    """The layout `w` (a tensor stored in `layout`) runs in memory: IN_OUT or OUT_IN, whichever its strides
    match (IN_OUT when both or neither do)."""
    in_out = layout.as_in_out(w)
    return OUT_IN if in_out.transpose(1, 2).is_contiguous() and not in_out.is_contiguous() else IN_OUT


def arranged(w: torch.Tensor, layout: ExpertLayout, order: ExpertLayout) -> torch.Tensor:
    """`w` (stored in `layout`), its shape and values unchanged, its memory in `order`'s: `w` itself when it
    already is, else one copy."""
    if memory_order(w, layout) == order:
        return w
    in_order = IN_OUT.convert(layout.as_in_out(w), order).contiguous()
    return layout.from_in_out(order.as_in_out(in_order))


def kernel_order(device: torch.device, dtype: torch.dtype) -> ExpertLayout | None:
    """The memory order the experts' decoding matmuls (a few rows per expert) run fastest from on `device` in
    `dtype`, where it was measured: on the CPU [E, out, in] in every dtype (the right operand column-major:
    bf16 and fp16 15-25x faster where the CPU lacks bf16 instructions, equal with them; fp32's sgemm 3-11%
    faster at 2-3 rows, the rows a decode step gives an expert). None elsewhere (a GPU: not measured, the
    stored order stays; it may answer by dtype). Figures: docs/BENCHMARKS.md, "Expert weight layout"."""
    return OUT_IN if device.type == "cpu" else None


def recorded(checkpoint: dict) -> dict:
    """`checkpoint` (a copy) with the stored layout recorded, as every checkpoint is written."""
    return {**checkpoint, LAYOUT_KEY: list(stored().dims)}


def layout_of(checkpoint: dict) -> ExpertLayout:
    """The layout a checkpoint's expert tensors were written in."""
    dims = checkpoint.get(LAYOUT_KEY)
    return UNRECORDED if dims is None else ExpertLayout(tuple(dims))


def upgraded_state(state: dict, saved: ExpertLayout, name: Callable[[str], str] = str) -> dict:
    """`state` (keys -> tensors, written in `saved`) with its expert tensors in the stored layout (the same
    dict when they already are). `name(key)` is the parameter a key holds (an optimizer state's key names
    a moment of it); only stacked tensors turn (an Adam step count is a scalar)."""
    layout = stored()
    if saved.dims == layout.dims:
        return state
    turns = {k for k, v in state.items() if layout.is_expert_tensor(name(k)) and v.dim() == 3}
    return {k: saved.convert(v, layout).contiguous() if k in turns else v for k, v in state.items()}


def upgraded_checkpoint(checkpoint):
    """In place: a Lightning-style checkpoint's weights and Adam moments in the stored layout, recorded as
    such (moe.checkpoint.sharded upgrades a sharded checkpoint's by name). Its torch optimizer state is keyed
    by number, not name: a moment turns when it is 3-D, as only the stacked experts are among the weights
    (checked on the checkpoint's own state_dict; else the moments stay as they were written)."""
    if not (isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), dict)):
        return checkpoint
    saved, layout, weights = layout_of(checkpoint), stored(), checkpoint["state_dict"]
    checkpoint["state_dict"] = upgraded_state(weights, saved)
    experts_only = all(layout.is_expert_tensor(k) for k, v in weights.items() if v.dim() == 3)
    if saved.dims != layout.dims and experts_only:
        for optimizer in checkpoint.get("optimizer_states") or []:
            for moments in (optimizer.get("state") or {}).values():
                moments.update({k: saved.convert(v, layout).contiguous() for k, v in moments.items()
                                if isinstance(v, torch.Tensor) and v.dim() == 3})
    checkpoint[LAYOUT_KEY] = list(layout.dims)
    return checkpoint
