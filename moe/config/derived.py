"""Values derived from a config, each defined once: what every stage reads instead of recomputing it.

Pure arithmetic on the composed config (no torch, no process group): the precision a run trains in,
a head's width, the dense MLPs' width, which layers are MoE, the trn1 precision preset, the world
size and the data-parallel degree a layout plans for. moe.parallel.dims.ParallelDims builds on the
last two; the validator, the model, the planner and the backends read the rest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def precision_of(trainer, hardware) -> str:
    """The Lightning precision the run trains in: trainer.precision, else the hardware's."""
    return str(trainer.precision or hardware.precision)


@dataclass(frozen=True)
class Precision:
    """trainer.precision decoded once (Lightning's names: "32-true", "bf16-mixed", "16-true", ...); dtypes
    are torch's attribute names (import-light: `getattr(torch, name)` where torch is at hand)."""

    name: str
    half: str | None  # the run's half type, "bfloat16" or "float16"; None for a 32- or 64-bit run
    mixed: bool  # -mixed: fp32 weights, the half type under autocast

    @classmethod
    def parse(cls, name: str) -> Precision:
        half = "bfloat16" if name.startswith("bf16") else "float16" if name.startswith("16") else None
        return cls(name, half, name.endswith("-mixed"))

    @property
    def param_dtype(self) -> str:
        """The weights' dtype at rest (Lightning's; an engine may cast them, moe.config.specs)."""
        if self.half is None:
            return "float64" if self.name.startswith("64") else "float32"
        return "float32" if self.mixed else self.half

    @property
    def autocast_dtype(self) -> str | None:
        return self.half if self.mixed else None

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element: the half type's 2, else 4 (a 64-bit run is planned as fp32)."""
        return 2 if self.half else 4


def precision(trainer, hardware) -> Precision:
    return Precision.parse(precision_of(trainer, hardware))


def head_dim_of(m) -> int:
    """GQA's head dim (model.head_dim, or hidden_size / num_heads)."""
    return m.head_dim or m.hidden_size // m.num_heads


def rotary_dim_of(m) -> int:
    """The dims of a GQA head RoPE rotates: int(head_dim * partial_rotary_factor), as transformers computes
    it (modeling_rope_utils.py:179-181 at 5.24); the rest of the head passes through."""
    return int(head_dim_of(m) * m.partial_rotary_factor)


def attention_dims(m) -> tuple[int, int]:
    """(query/key dims, value dims) of one attention head: head_dim twice for GQA; for MLA
    qk_nope_head_dim + qk_rope_head_dim and v_head_dim."""
    if m.attention == "mla":
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return head_dim_of(m), head_dim_of(m)


def window_of(m, layer_idx: int) -> int | None:
    """Layer i's attention window: model.sliding_window, unless model.attention_layer_types makes the
    layer full_attention (None: full causal attention)."""
    types = m.attention_layer_types
    return None if types is not None and types[layer_idx] == "full_attention" else m.sliding_window


def dense_width(m) -> int:
    """The intermediate width of the dense (non-MoE) MLPs: model.dense_intermediate_size, else the
    experts'."""
    return m.dense_intermediate_size or m.intermediate_size


def is_moe_layer(layer_idx: int, m) -> bool:
    """Layer i (0-based) of ModelConfig m is MoE when i >= first_k_dense_replace, (i + 1) %
    moe_layer_frequency == 0 and i is not in dense_layers: frequency 2 makes layers 1, 3, 5... MoE;
    first_k_dense_replace=3 makes layers 0-2 dense (DeepSeek-V3); dense_layers lists any others (Qwen's
    mlp_only_layers, which transformers applies with the same frequency rule: `decoder_sparse_step`)."""
    return (layer_idx >= m.first_k_dense_replace and (layer_idx + 1) % m.moe_layer_frequency == 0
            and layer_idx not in (m.dense_layers or ()))


def num_blocks(m) -> int:
    """The decoder blocks a model holds: its num_layers, then one per multi-token-prediction depth
    (model.mtp_layers), depth d's block being layer num_layers + d (DeepSeek-V3's layer 61), MoE or dense by
    is_moe_layer as any layer."""
    return m.num_layers + m.mtp_layers


def has_moe_layers(m) -> bool:
    return any(is_moe_layer(i, m) for i in range(m.num_layers))


def neuron_precision(hardware, model) -> str:
    """hardware.neuron_precision with `auto` resolved: `mixed` for a model with MoE layers, `bf16_sr`
    for a dense one. neuronx-distributed computes MoE slot indices in float64 (v2.28.0
    modules/moe/expert_mlps_v2.py:285-294, :518, :531-545, a cumulative count of tokens per expert);
    XLA_USE_BF16=1 (bf16_sr) turns float64 into bf16, exact for integers up to 256 only, while
    XLA_DOWNCAST_BF16=1 (mixed) turns it into float32, exact up to 2**24 (docs/TRAINIUM.md)."""
    preset = hardware.neuron_precision
    if preset != "auto":
        return preset
    return "mixed" if has_moe_layers(model) else "bf16_sr"


def planning(dry_run: bool, simulate: bool) -> bool:
    """True for runs that plan a layout without launching it (dry_run, simulate)."""
    return bool(dry_run or simulate)


def trainer_world(trainer) -> int:
    """Devices the trainer launches on: trainer.devices * trainer.num_nodes."""
    return trainer.devices * trainer.num_nodes


def world_of(trainer, parallel, planning: bool) -> int:
    """Devices the layout runs on: trainer.devices * trainer.num_nodes.

    A dry run or a simulation plans for the layout itself instead, so big presets can be
    inspected on one machine: tp*pp*dp when parallel.dp is pinned, else at least tp*pp*ep
    (the smallest world where EP fits inside DP, NxD's `world % (tp*pp*ep) == 0`).
    """
    if not planning:
        return trainer_world(trainer)
    p = parallel
    if p.dp is not None:
        return p.tp * p.pp * p.dp
    return max(trainer_world(trainer), p.tp * p.pp * p.ep)


def data_parallel_size(parallel, world: int) -> int:
    """Every data-parallel rank: parallel.dp when pinned, else world / (tp * pp); EP is carved out of it."""
    p = parallel
    return p.dp if p.dp is not None else world // (p.tp * p.pp)


def launch_overrides(world: int, devices_per_node: int) -> str:
    """The trainer overrides that give `world` devices on nodes of `devices_per_node`, fewest nodes first."""
    nodes = math.ceil(world / devices_per_node)
    if world % nodes:
        return f"{world} devices do not split evenly over nodes of {devices_per_node}"
    return f"trainer.devices={world // nodes} trainer.num_nodes={nodes}"


def stages_per_rank(schedule: str, configured: int | None) -> int:
    """parallel.pp_stages_per_rank, or its default: 1 for a one-stage schedule, 2 for a looped one."""
    if configured is not None:
        return configured
    return 1 if schedule.lower() in SINGLE_STAGE_SCHEDULES else 2


SINGLE_STAGE_SCHEDULES = ("1f1b", "gpipe")
PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble")


def pipeline_in_flight(schedule: str, pp: int, per_rank: int, n: int) -> float:
    """Micro-batches whose activations the first pp rank keeps at its peak, in units of all its layers,
    as torch 2.13's schedules run them (torch/distributed/pipelining/schedules.py): GPipe every one; 1F1B
    min(n, stages) on the first stage (:1052-1055); the interleaved ones their rank-0 warm-up
    (_get_warmup_ops, :2872-2888; factor 2 for Interleaved1F1B, 1 for InterleavedZeroBubble, :2961, :3079)
    plus the steady state's one forward, each of 1 / per_rank of the rank's layers."""
    if schedule == "GPipe":
        return float(n)
    if per_rank == 1:
        return float(min(n, pp))
    per_round = n // max(1, n // pp)
    factor = 2 if schedule == "Interleaved1F1B" else 1
    warmup = min((per_rank - 1) * per_round + factor * (pp - 1), n * per_rank)
    return min(warmup + 1, n * per_rank) / per_rank


def layers_per_stage(num_layers: int, pp: int) -> int:
    """Layers on one pp rank (all its stages together)."""
    return math.ceil(num_layers / pp)


def expert_dp_size(dp: int, tp: int, ep: int, ep_folds_tp: bool) -> int:
    """Ranks holding the same experts: dp / ep (the 16-GPU recipe's "DP 2" at EP 8), dp * tp / ep when
    EP folds TP (torchtitan's efsdp)."""
    return dp * tp // ep if ep_folds_tp else dp // ep


def hottest_rank_load(experts_here: int, skew: float) -> float:
    """Rows a rank holding `experts_here` experts receives when one of them is the hottest, at `skew` times
    its share (routing_skew), over a balanced rank's: the planner's and the simulation's one assumption."""
    return (experts_here - 1 + skew) / experts_here
