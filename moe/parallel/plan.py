"""Dry-run planner: the parallel layout and a per-device memory estimate, from config arithmetic.

`python train.py ... dry_run=true` prints `make_plan(cfg).render()`: world size and nodes,
TP/PP/DP/EP group sizes with example ranks in neuronx-distributed's order, parameter
counts, and parameters + gradients + optimizer states + activations per device against
`hardware.device_memory_gib`. Nothing here touches a device, so a 512-NeuronCore layout can
be checked on a laptop. The numbers are estimates (see `activation_bytes`); allocator
fragmentation, communication buffers and compiler scratch space come on top.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 2**30

# --------------------------------------------------------------------------- world and degrees


def world_size(cfg) -> int:
    """Devices the layout runs on: trainer.devices * trainer.num_nodes.

    A dry run plans for the layout itself instead, so big presets can be inspected on one
    machine: tp*pp*dp when parallel.dp is pinned, else at least tp*pp*ep (the smallest world
    where EP fits inside DP, NxD's `world % (tp*pp*ep) == 0`).
    """
    trainer_world = cfg.trainer.devices * cfg.trainer.num_nodes
    if not cfg.dry_run:
        return trainer_world
    p = cfg.parallel
    if p.dp is not None:
        return p.tp * p.pp * p.dp
    return max(trainer_world, p.tp * p.pp * p.ep)


def launch_overrides(world: int, hardware) -> str:
    """The trainer overrides that give `world` devices on this hardware, fewest nodes first."""
    nodes = math.ceil(world / hardware.devices_per_node)
    if world % nodes:
        return f"{world} devices do not split evenly over nodes of {hardware.devices_per_node}"
    return f"trainer.devices={world // nodes} trainer.num_nodes={nodes}"


def data_parallel_size(cfg) -> int:
    """parallel.dp, or world / (tp * pp) when null (integer division; validate checks it divides)."""
    p = cfg.parallel
    return p.dp if p.dp is not None else world_size(cfg) // (p.tp * p.pp)


# --------------------------------------------------------------------------- parameter counts


def is_moe_layer(layer_idx: int, moe_layer_frequency: int) -> bool:
    """Layer i (0-based) is MoE when (i + 1) % frequency == 0, as in moe/model.py's Block."""
    return (layer_idx + 1) % moe_layer_frequency == 0


@dataclass
class ParamBreakdown:
    """Parameter counts by where they live; `experts` is the routed experts of all MoE layers."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding
    final_norm: int
    attention: int  # qkv + o + the two RMSNorms, all layers
    routers: int
    shared_experts: int
    dense_mlp: int  # SwiGLU of the non-MoE layers
    experts: int
    active_experts: int  # top_k of num_experts routed experts per MoE layer
    num_moe_layers: int

    @property
    def total(self) -> int:
        return self.non_expert + self.experts

    @property
    def non_expert(self) -> int:
        return (self.embedding + self.lm_head + self.final_norm + self.attention + self.routers
                + self.shared_experts + self.dense_mlp)

    @property
    def active(self) -> int:
        return self.non_expert + self.active_experts


def param_breakdown(m) -> ParamBreakdown:
    """Exact parameter counts of moe/model.py's MoETransformer for a ModelConfig."""
    H, F, E = m.hidden_size, m.intermediate_size, m.num_experts
    head_dim = m.head_dim or H // m.num_heads
    n_moe = sum(is_moe_layer(i, m.moe_layer_frequency) for i in range(m.num_layers))
    n_dense = m.num_layers - n_moe
    qkv = H * (m.num_heads * head_dim + 2 * m.num_kv_heads * head_dim)
    o_proj = m.num_heads * head_dim * H
    per_expert = H * 2 * F + F * H  # gate_up [H, 2F] + down [F, H]
    return ParamBreakdown(
        embedding=m.vocab_size * H,
        lm_head=0 if m.tie_word_embeddings else m.vocab_size * H,
        final_norm=H,
        attention=m.num_layers * (qkv + o_proj + 2 * H),
        routers=n_moe * E * H,
        shared_experts=n_moe * 3 * H * m.shared_expert_intermediate_size,
        dense_mlp=n_dense * 3 * H * (m.dense_intermediate_size or F),
        experts=n_moe * E * per_expert,
        active_experts=n_moe * m.top_k * per_expert,
        num_moe_layers=n_moe,
    )


def count_params(model_cfg) -> tuple[int, int]:
    """(total, active per token) parameters of the model a ModelConfig builds."""
    b = param_breakdown(model_cfg)
    return b.total, b.active


# --------------------------------------------------------------------------- bytes per value


def state_bytes(cfg) -> tuple[int, int, int, str]:
    """(param, grad, optimizer) bytes per parameter and a one-line reason, from the precision.

    AdamW keeps two moments; mixed precision adds an fp32 master copy (ZeRO paper's 2+2+12).
    """
    hw = cfg.hardware
    precision = str(cfg.trainer.precision or hw.precision)
    if hw.strategy == "neuron":
        if hw.neuron_precision == "bf16_sr":
            return 2, 2, 4, "bf16 + stochastic rounding: bf16 weights, grads and AdamW moments"
        if hw.neuron_precision == "mixed":
            return 2, 4, 12, "mixed: bf16 weights, fp32 grad accumulation, fp32 master + moments"
        return 4, 4, 8, "fp32 weights, grads and moments"
    if precision.startswith("32") or precision.startswith("64"):
        return 4, 4, 8, "fp32 weights, grads and AdamW moments"
    if precision.endswith("-true"):
        return 2, 2, 4, f"{precision}: half-precision weights, grads and moments"
    if hw.strategy == "deepspeed":
        return 2, 2, 12, f"{precision} DeepSpeed: half weights and grads, fp32 master + moments"
    return 4, 4, 8, f"{precision} autocast: fp32 weights, grads and moments"


def activation_dtype_bytes(cfg) -> int:
    precision = str(cfg.trainer.precision or cfg.hardware.precision)
    return 4 if precision.startswith("32") or precision.startswith("64") else 2


# --------------------------------------------------------------------------- activations


def activation_bytes(cfg, micro_batch: int) -> tuple[float, float, str]:
    """Activation bytes kept for backward by one pipeline stage: (first stage, last stage, note).

    Per token and layer, in elements of the activation dtype (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", adapted to no dropout,
    GQA and SwiGLU):
      norms 2h, attention input h, q/k/v h + 2*kv*hd, o_proj input h, scores 2.5*a*s
      (their 5as^2b bytes: attention not fused; flash attention keeps none of it),
      dense SwiGLU input h + gate/up/product 3F,
      MoE input h + fp32 router logits/probs + per assignment (k of them, padded by the
      capacity factor): dispatched input h, gate/up/product 3F, expert output h.
    Under TP the norms/inputs (4h per layer) stay replicated unless sequence_parallel; the
    rest is split by tp. Policies (moe/parallel/apply.py): full keeps each layer's input
    plus one layer's activations while it recomputes; every_n does that for every n-th
    layer; moe_only for MoE layers; selective recomputes the FFN/MoE sub-module of every
    layer. With pp > 1, 1F1B keeps min(pp, micro-batches) micro-batches on the first stage;
    the last stage also holds fp32 logits (s*V/tp per sequence).
    """
    m, p = cfg.model, cfg.parallel
    e = activation_dtype_bytes(cfg)
    s, b, h, t = cfg.data.seq_len, micro_batch, m.hidden_size, p.tp
    head_dim = m.head_dim or h // m.num_heads
    F, Fd = m.intermediate_size, m.dense_intermediate_size or m.intermediate_size
    sp = p.sequence_parallel and t > 1
    cf = cfg.moe_opt.capacity_factor or 1.0  # dropless: one slot per assignment on average

    def split(replicated: float, sharded: float) -> float:  # elements per token on one device
        return (replicated + sharded) / t if sp else replicated + sharded / t

    attn = split(3 * h, (h + 2 * m.num_kv_heads * head_dim) + h + 2.5 * m.num_heads * s)
    dense = split(h, 3 * Fd)
    routed = m.top_k * cf * (2 * h + 3 * F)
    moe = split(h, routed + 3 * m.shared_expert_intermediate_size) + 8 * m.num_experts / e  # + fp32 router
    layer_input = split(h, 0)

    def layer(i: int) -> float:
        ffn = moe if is_moe_layer(i, m.moe_layer_frequency) else dense
        policy = p.activation_checkpointing
        if policy == "full" or (policy == "every_n" and (i + 1) % p.activation_checkpointing_every_n == 0) \
                or (policy == "moe_only" and is_moe_layer(i, m.moe_layer_frequency)):
            return layer_input
        if policy == "selective":
            return attn + layer_input
        return attn + ffn

    layers_per_stage = math.ceil(m.num_layers / p.pp)
    stage = range(layers_per_stage)  # the first stage; stages are alike up to the MoE pattern
    kept = sum(layer(i) for i in stage)
    recompute = max((attn + (moe if is_moe_layer(i, m.moe_layer_frequency) else dense)) - layer(i)
                    for i in stage)  # one checkpointed layer is live again during backward
    tokens = s * b
    microbatches = p.pipeline_microbatches or cfg.trainer.accumulate_grad_batches
    in_flight = min(p.pp, microbatches) if p.pp > 1 else 1
    logits = tokens * m.vocab_size * 4 / t
    note = f"{p.activation_checkpointing} checkpointing, micro-batch {b} x {s} tokens"
    if sp:
        note += ", sequence parallel"
    if p.pp > 1:
        note += f", 1F1B keeps {in_flight} micro-batch(es) on the first stage"
    first = (kept * in_flight + recompute) * tokens * e
    last = (kept + recompute) * tokens * e + logits
    return first, last, note


# --------------------------------------------------------------------------- the plan


@dataclass
class Group:
    name: str
    size: int
    count: int
    first: list[int]


@dataclass
class Memory:
    """GiB per device, worst pipeline stage."""

    params: float
    grads: float
    optimizer: float
    activations: float
    capacity: float
    precision_note: str
    activation_note: str
    sharding_note: str

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def headroom(self) -> float:
        return self.capacity - self.total

    @property
    def verdict(self) -> str:
        """fits below 90% of device memory, tight up to 100%, else does not fit."""
        if self.total <= 0.9 * self.capacity:
            return "fits"
        return "tight" if self.total <= self.capacity else "does not fit"


@dataclass
class Plan:
    model: str
    hardware: str
    parallel: str
    device_name: str
    devices_per_node: int
    world: int
    nodes: int
    trainer_world: int
    tp: int
    pp: int
    dp: int
    ep: int
    expert_dp: int
    zero_stage: int
    groups: list[Group]
    params_total: int
    params_active: int
    global_batch: int
    seq_len: int
    memory: Memory
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        """The dry-run report, one screen."""
        mem = self.memory
        lines = [
            f"dry run: model={self.model} hardware={self.hardware} parallel={self.parallel}",
            f"parameters   {_b(self.params_total)} total, {_b(self.params_active)} active per token "
            f"({100 * self.params_active / self.params_total:.1f}%)",
            f"world        {self.world} x {self.device_name} = {self.nodes} node(s) of "
            f"{self.devices_per_node}",
            f"layout       tp {self.tp} x pp {self.pp} x dp {self.dp} = {self.tp * self.pp * self.dp}; "
            f"ep {self.ep} inside dp, expert-dp {self.expert_dp} = dp / ep; ZeRO stage {self.zero_stage}",
            f"batch        {self.global_batch} sequences x {self.seq_len} tokens = "
            f"{self.global_batch * self.seq_len:,} tokens per optimizer step",
            "groups       size  count  first group (ranks: dense [PP, DP, TP], experts [PP, DP_exp, EP, TP])",
        ]
        for g in self.groups:
            lines.append(f"  {g.name:<10} {g.size:>5}  {g.count:>5}  {_ranks(g.first)}")
        lines += [
            f"memory per device (GiB, estimate; worst pipeline stage) vs {mem.capacity:.1f} GiB",
            f"  parameters {mem.params:>9.2f}  {mem.precision_note}",
            f"  gradients  {mem.grads:>9.2f}",
            f"  optimizer  {mem.optimizer:>9.2f}  {mem.sharding_note}",
            f"  activations{mem.activations:>9.2f}  {mem.activation_note}",
            f"  total      {mem.total:>9.2f}  -> {mem.verdict}, headroom {mem.headroom:.2f} GiB "
            f"({100 * mem.headroom / mem.capacity:.0f}%)",
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def rank_groups(world: int, tp: int, pp: int, dp: int, ep: int) -> list[Group]:
    """Group sizes, counts and the ranks of the first group, in NxD's rank order.

    Dense ranks are laid out [PP, DP, TP] (TP fastest); experts [PP, DP_exp, EP, TP] with
    DP_exp * EP = DP, so an EP group is the first ep members of a DP group.
    """
    expert_dp = dp // ep
    return [
        Group("TP", tp, world // tp, list(range(tp))),
        Group("PP", pp, world // pp, [i * dp * tp for i in range(pp)]),
        Group("DP", dp, world // dp, [i * tp for i in range(dp)]),
        Group("EP", ep, world // ep, [i * tp for i in range(ep)]),
        Group("expert-DP", expert_dp, world // expert_dp, [i * ep * tp for i in range(expert_dp)]),
    ]


def memory_estimate(cfg, dp: int) -> Memory:
    """Parameters, gradients, optimizer states and activations per device, in GiB."""
    m, p = cfg.model, cfg.parallel
    bd = param_breakdown(m)
    ep, tp, pp = p.ep, p.tp, p.pp
    layer_dense = bd.attention + bd.routers + bd.shared_experts + bd.dense_mlp
    outer = bd.embedding + bd.lm_head + bd.final_norm
    if pp > 1:  # first stage holds the embedding, last the norm and lm_head (tied: both keep a copy)
        outer = max(bd.embedding, (bd.lm_head or bd.embedding) + bd.final_norm)
    non_expert = (layer_dense / pp + outer) / tp
    expert = bd.experts / pp / (ep * tp)

    pb, gb, ob, precision_note = state_bytes(cfg)
    expert_dp = dp // ep
    shard = min(dp, p.hybrid_shard_degree or dp)
    expert_shard = min(expert_dp, p.hybrid_shard_degree or expert_dp)

    def sharded(n_dense: float, n_expert: float, stage_needed: int) -> float:
        if p.zero_stage >= stage_needed:
            return n_dense / shard + n_expert / expert_shard
        return n_dense + n_expert

    params = sharded(non_expert, expert, 3) * pb
    grads = sharded(non_expert, expert, 2) * gb
    optimizer = sharded(non_expert, expert, 1) * ob
    first, last, act_note = activation_bytes(cfg, cfg.trainer.micro_batch_size)
    if p.zero_stage >= 1:
        sharding_note = (f"ZeRO-{p.zero_stage}: dense states over {shard} ranks, expert states over "
                         f"{expert_shard} (expert-dp)")
    else:
        sharding_note = "not sharded (ZeRO stage 0)"
    return Memory(
        params=params / GIB, grads=grads / GIB, optimizer=optimizer / GIB,
        activations=max(first, last) / GIB, capacity=float(cfg.hardware.device_memory_gib),
        precision_note=f"{precision_note} ({pb}+{gb}+{ob} bytes/param)",
        activation_note=act_note, sharding_note=sharding_note,
    )


def memory_hints(cfg) -> list[str]:
    """What would lower the estimate, skipping what this hardware cannot do or the config already does."""
    p, hw = cfg.parallel, cfg.hardware
    max_zero = {"ddp": 0, "neuron": 1}.get(hw.strategy, 2 if cfg.model.num_experts > 1 else 3)
    hints = [f"parallel.zero_stage={max_zero} (states shard over dp)"] if p.zero_stage < max_zero else []
    hints.append("more parallel.ep" if hw.strategy == "ddp" else "more parallel.ep / tp / pp")
    if p.activation_checkpointing != "full":
        hints.append("parallel.activation_checkpointing=full")
    if cfg.trainer.micro_batch_size > 1:
        hints.append("a smaller trainer.micro_batch_size")
    return hints


def make_plan(cfg) -> Plan:
    """The layout and memory estimate for a composed, validated config."""
    p, hw = cfg.parallel, cfg.hardware
    world = world_size(cfg)
    dp = data_parallel_size(cfg)
    trainer_world = cfg.trainer.devices * cfg.trainer.num_nodes
    nodes = math.ceil(world / hw.devices_per_node)
    total, active = count_params(cfg.model)
    memory = memory_estimate(cfg, dp)
    notes = []
    if trainer_world != world:
        notes.append(
            f"trainer.devices x trainer.num_nodes = {cfg.trainer.devices} x {cfg.trainer.num_nodes} = "
            f"{trainer_world}; this dry run planned for {world}. To launch: {launch_overrides(world, hw)}"
        )
    if memory.verdict != "fits":
        notes.append("to save memory: " + ", ".join(memory_hints(cfg)))
    return Plan(
        model=cfg.model.name, hardware=hw.name, parallel=p.name, device_name=hw.device_name,
        devices_per_node=hw.devices_per_node, world=world, nodes=nodes, trainer_world=trainer_world,
        tp=p.tp, pp=p.pp, dp=dp, ep=p.ep, expert_dp=dp // p.ep, zero_stage=p.zero_stage,
        groups=rank_groups(world, p.tp, p.pp, dp, p.ep), params_total=total, params_active=active,
        global_batch=cfg.trainer.micro_batch_size * cfg.trainer.accumulate_grad_batches * dp,
        seq_len=cfg.data.seq_len, memory=memory, notes=notes,
    )


def _b(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) <= 8:
        return str(ranks)
    return "[" + ", ".join(map(str, ranks[:6])) + f", ..., {ranks[-1]}]"
