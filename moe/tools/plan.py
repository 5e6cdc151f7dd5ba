"""Dry-run planner: the parallel layout and a per-device memory estimate, from config arithmetic.

`python train.py ... dry_run=true` prints `make_plan(cfg, dims).render()`: world size and
nodes, TP/PP/DP/EP group sizes with example ranks in neuronx-distributed's order (the run's
ParallelDims), parameter counts (moe.config.size), and parameters + gradients + optimizer states +
activations per device against `hardware.device_memory_gib`, with the bytes per parameter
the backend's spec gives. Nothing here touches a device, so a 512-NeuronCore layout can
be checked on a laptop. The numbers are estimates (see `activation_bytes`); allocator
fragmentation, communication buffers and compiler scratch space come on top.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moe.backends.registry import spec_of
from moe.config.derived import (
    attention_dims,
    dense_width,
    hottest_rank_load,
    is_moe_layer,
    launch_overrides,
    layers_per_stage,
    num_blocks,
    pipeline_in_flight,
    stages_per_rank,
    trainer_world,
)
from moe.config.size import param_breakdown
from moe.config.specs import BackendSpec
from moe.model.fused_ce import CE_CHUNK_TOKENS
from moe.parallel.dims import ParallelDims

GIB = 2**30


# --------------------------------------------------------------------------- activations


def activation_bytes(model, moe_opt, parallel, hardware, trainer, dims: ParallelDims, routing_skew: float,
                     micro_batch: int) -> tuple[float, float, str]:
    """Activation bytes kept for backward by one pipeline stage: (first stage, last stage, note).

    Per token and layer, in elements of the activation dtype (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", adapted to no dropout,
    GQA and SwiGLU):
      norms 2h, attention input h, q/k/v h + 2*kv*hd, o_proj input h, scores 2.5*a*s
      (their 5as^2b bytes: attention not fused, as under XLA on trn1; the torch backends'
      scaled_dot_product_attention keeps none of it, BackendSpec.fused_attention);
      MLA instead of q/k/v and o_proj input: q and the expanded k and v a*(2*qk + 2*v) with
      o_proj's input, and the latents in and out of their norms 2*(kv_lora_rank + q_lora_rank),
      dense SwiGLU input h + gate and up 2F, silu(gate) F, their product F (4F; NxD's MLPs 3F),
      MoE input h + fp32 router logits/probs + per assignment (k of them, padded by the
      capacity factor): dispatched input h, the SwiGLU's 4F, expert output h.
    Under TP the norms/inputs (4h per layer) stay replicated unless sequence_parallel; the
    rest is split by tp. Policies (moe/parallel/apply.py): full keeps each layer's input
    plus one layer's activations while it recomputes; every_n does that for every n-th
    layer; moe_only for MoE layers; selective recomputes the core attention (its scores) of
    every layer and the experts' MLPs (the MoE layer keeps its input, the router's output and the
    dispatched rows in and out, 2h per assignment). Where the backend checkpoints the MoE layer
    itself (NxD, BackendSpec.ac_wraps_moe_layer), moe_only keeps each MoE block's attention and the
    MoE layer's input, selective the same less the attention scores. With pp > 1, 1F1B keeps
    min(pp, micro-batches) micro-batches on the first stage; the last stage also holds fp32 logits
    (s*V/tp per sequence), or with BackendSpec.fused_cross_entropy one chunk's (CE_CHUNK_TOKENS)
    and the LM head's fp32 gradient, which the chunked head computes in the forward.
    """
    m, p, spec = model, parallel, spec_of(hardware)
    e = spec.activation_bytes(model, hardware, trainer)
    s, b, h, t = dims.seq_len, micro_batch, m.hidden_size, dims.tp
    qk_dim, v_dim = attention_dims(m)
    F, Fd = m.intermediate_size, dense_width(m)
    sp = dims.sequence_parallel
    cf = moe_opt.capacity_factor or 1.0  # dropless: one slot per assignment on average
    load = hot_rank_load(moe_opt, dims, routing_skew)

    def split(replicated: float, sharded: float) -> float:  # elements per token on one device
        return (replicated + sharded) / t if sp else replicated + sharded / t

    scores = 0.0 if spec.fused_attention else split(0, 2.5 * m.num_heads * s)
    if m.attention == "mla":  # per head: q, the expanded k and v, o's input; the latents stay whole under TP
        latents = 2 * (m.kv_lora_rank + (m.q_lora_rank or 0))
        attn = split(3 * h + latents, m.num_heads * (2 * qk_dim + 2 * v_dim)) + scores
    else:
        attn = split(3 * h, (h + 2 * m.num_kv_heads * qk_dim) + h) + scores
    swiglu = spec.mlp_activations
    dense = split(h, swiglu * Fd)
    routed = m.top_k * cf * (2 * h + swiglu * F) * load
    router = 8 * m.num_experts / e  # fp32 logits and probabilities
    moe = split(h, routed + swiglu * m.shared_expert_intermediate_size) + router
    moe_selective = split(h, m.top_k * cf * 2 * h) + router  # expert MLP internals recomputed
    layer_input = split(h, 0)
    policy, moe_layer_alone = p.activation_checkpointing, spec.ac_wraps_moe_layer

    def layer(i: int) -> float:
        is_moe = is_moe_layer(i, m)
        ffn = moe if is_moe else dense
        if moe_layer_alone and policy in ("moe_only", "selective"):  # NxD: the MoE layer keeps its input
            return attn - (scores if policy == "selective" else 0) + (layer_input if is_moe else dense)
        if policy == "full" or (policy == "every_n" and (i + 1) % p.activation_checkpointing_every_n == 0) \
                or (policy == "moe_only" and is_moe):
            return layer_input
        if policy == "selective":
            return attn - scores + (moe_selective if is_moe else dense)
        return attn + ffn

    # the first stage; the others alike but for MoE. The multi-token-prediction depths' blocks are layers
    # too (pp is 1 with them), and each depth also keeps its two norms' outputs and their concatenation (4h)
    stage = range(layers_per_stage(num_blocks(m), dims.pp))
    kept = sum(layer(i) for i in stage) + m.mtp_layers * split(4 * h, 0)
    recompute = max((attn + (moe if is_moe_layer(i, m) else dense)) - layer(i)
                    for i in stage)  # one checkpointed layer is live again during backward
    tokens = s * b
    microbatches = p.pipeline_microbatches or dims.accumulate_grad_batches
    in_flight = 1.0
    schedule = spec.pipeline_schedule(p)  # torch.distributed.pipelining's, or NxD's 1F1B
    if dims.pp > 1:
        per_rank = stages_per_rank(schedule, p.pp_stages_per_rank)
        in_flight = pipeline_in_flight(schedule, dims.pp, per_rank, microbatches)
    if spec.fused_cross_entropy:  # a chunk's fp32 logits and softmax, the head's fp32 gradient
        # one more head gradient per multi-token-prediction depth: each loss holds its own to the backward
        heads = 1 + m.mtp_layers
        chunk = min(tokens, CE_CHUNK_TOKENS)
        logits = 2 * chunk * m.vocab_size * 4 + heads * m.vocab_size * m.hidden_size * 4
    else:
        logits = 2 * tokens * m.vocab_size * 4 / t  # fp32 logits and the cross-entropy's log-probabilities
    note = f"{p.activation_checkpointing} checkpointing, micro-batch {b} x {s} tokens"
    if load != 1.0:
        note += f", the hottest expert's rank at {load:.2f}x the rows (routing_skew)"
    if sp:
        note += ", sequence parallel"
    if dims.pp > 1:
        note += f", {schedule} keeps {in_flight:g} micro-batch(es) on the first stage"
    first = (kept * in_flight + recompute) * tokens * e
    last = (kept + recompute) * tokens * e + logits
    return first, last, note


def hot_rank_load(moe_opt, dims: ParallelDims, routing_skew: float) -> float:
    """Rows the rank holding the hottest expert receives, over a balanced rank's: its other experts at their
    share, the hot one at `routing_skew` times (dropless expert parallelism; a capacity caps every expert at
    its slots, and one process gets every row whatever the routing)."""
    if moe_opt.capacity_factor is not None or dims.ep == 1:
        return 1.0
    return hottest_rank_load(dims.num_experts // dims.ep, routing_skew)


# --------------------------------------------------------------------------- the plan


@dataclass
class Memory:
    """GiB per device, worst pipeline stage."""

    params: float
    grads: float
    optimizer: float
    activations: float
    step: float  # the optimizer step's transient (fp32 update buffers; DeepSpeed: the fp32 grad partition)
    grads_in_step: bool  # whether the gradients are still live during the step
    comm: float  # held through the backward: DeepSpeed's reduce bucket, FSDP2's gathered weights
    capacity: float
    precision_note: str
    activation_note: str
    sharding_note: str
    fixed: float = 0.0  # outside the tensors: runtime, communication buffers (hardware.fixed_memory_gib)
    sharded_backward: bool = False  # gradients reduce-scattered unit by unit in the backward (FSDP2, no PP)
    host_per_node: float = 0.0  # offloaded states (parallel.offload_experts) in each node's host memory
    host_capacity: float | None = None  # hardware.host_memory_gib

    @property
    def total(self) -> float:
        """Weights and optimizer state, plus the larger of the two phases: backward (gradients,
        activations, communication buffers) and the optimizer step (its transient, with the
        gradients where they stay)."""
        step = self.step + (self.grads if self.grads_in_step else 0.0)
        # FSDP2 (sharded_backward): gradients appear layer by layer as the backward frees the activations
        # layer by layer, so the two peak at opposite ends of it, not together
        backward = (max(self.grads, self.activations) if self.sharded_backward else
                    self.grads + self.activations) + self.comm
        return self.fixed + self.params + self.optimizer + max(backward, step)

    @property
    def headroom(self) -> float:
        return self.capacity - self.total

    @property
    def verdict(self) -> str:
        """fits below 90% of device memory, tight up to 100%, else does not fit."""
        return _verdict(self.total, self.capacity)

    @property
    def host_verdict(self) -> str:
        return _verdict(self.host_per_node, self.host_capacity) if self.host_capacity else "unknown"


def _verdict(used: float, capacity: float) -> str:
    if used <= 0.9 * capacity:
        return "fits"
    return "tight" if used <= capacity else "does not fit"


@dataclass
class Plan:
    model: str
    hardware: str
    parallel: str
    device_name: str
    dims: ParallelDims
    trainer_world: int
    params_total: int
    params_active: int
    memory: Memory
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        """The dry-run report, one screen."""
        mem, d = self.memory, self.dims
        lines = [
            f"dry run: model={self.model} hardware={self.hardware} parallel={self.parallel}",
            f"parameters   {_b(self.params_total)} total, {_b(self.params_active)} active per token "
            f"({100 * self.params_active / self.params_total:.1f}%)",
            f"world        {d.world} x {self.device_name} = {d.nodes} node(s) of {d.devices_per_node}",
            f"layout       tp {d.tp} x pp {d.pp} x dp {d.dp} = {d.tp * d.pp * d.dp}; " + (
                f"ep {d.ep} folded over dp x tp, expert-dp {d.expert_dp} = dp x tp / ep"
                + (f" (MoE tokens split over tp {d.tp})" if d.tp > 1 else "") if d.ep_folds_tp else
                f"ep {d.ep} inside dp, expert-dp {d.expert_dp} = dp / ep") + f"; ZeRO stage {d.zero_stage}",
            f"batch        {d.global_batch} sequences x {d.seq_len} tokens = "
            f"{d.tokens_per_step:,} tokens per optimizer step",
            "groups       size  count  nodes              first group (ranks: dense [PP, DP, TP], experts "
            + ("[PP, DP_exp, EP] over DP x TP)" if d.ep_folds_tp else "[PP, DP_exp, EP, TP])"),
        ]
        for g in d.rank_groups():
            spans = max(d.nodes_spanned(ranks) for ranks in g.ranks)
            where = "1" if spans == 1 else f"{spans} (crosses nodes)"
            lines.append(f"  {g.name:<10} {g.size:>5}  {g.count:>5}  {where:<17}  {_ranks(g.ranks[0])}")
        lines += [
            f"memory per device (GiB, estimate; worst pipeline stage) vs {mem.capacity:.1f} GiB per "
            f"{self.device_name}",
            f"  parameters {mem.params:>9.2f}  {mem.precision_note}",
            f"  gradients  {mem.grads:>9.2f}",
            f"  optimizer  {mem.optimizer:>9.2f}  {mem.sharding_note}",
            f"  activations{mem.activations:>9.2f}  {mem.activation_note}",
            f"  comm       {mem.comm:>9.2f}  held through the backward: DeepSpeed's reduce bucket, "
            "FSDP2's gathered weights",
            f"  step       {mem.step:>9.2f}  optimizer-step buffers (the peak is the larger of backward "
            "and step)",
            f"  fixed      {mem.fixed:>9.2f}  runtime context, communication buffers, allocator reserve "
            "(hardware.fixed_memory_gib)",
            f"  total      {mem.total:>9.2f}  -> {mem.verdict}, headroom {mem.headroom:.2f} GiB "
            f"({100 * mem.headroom / mem.capacity:.0f}%)",
        ]
        if mem.host_per_node:
            of = (f" of {mem.host_capacity:g} GiB -> {mem.host_verdict}" if mem.host_capacity
                  else " (hardware.host_memory_gib unset: not checked)")
            lines.append(f"host memory per node (GiB): {mem.host_per_node:.0f} offloaded expert weights, "
                         f"gradients and AdamW states (FSDP2 CPUOffloadPolicy){of}")
        lines += [n if n.startswith("warning: ") else f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def memory_estimate(model, moe_opt, parallel, hardware, trainer, dims: ParallelDims,
                    routing_skew: float) -> Memory:
    """Parameters, gradients, optimizer states and activations per device, in GiB."""
    p = parallel
    bd = param_breakdown(model)
    ep, tp, pp, dp = dims.ep, dims.tp, dims.pp, dims.dp
    layer_dense = bd.attention + bd.routers + bd.shared_experts + bd.dense_mlp
    outer = bd.embedding + bd.lm_head + bd.final_norm + bd.mtp  # mtp: its depths' own (pp is 1 with them)
    if pp > 1:  # first stage holds the embedding, last the norm and lm_head (tied: both keep a copy)
        outer = max(bd.embedding, (bd.lm_head or bd.embedding) + bd.final_norm)
    spec = spec_of(hardware)
    if spec.tp_splits_all_weights:
        non_expert = (layer_dense / pp + outer) / tp
    else:  # TP splits attention and dense MLPs; the rest is whole on every TP rank
        non_expert = ((bd.attention + bd.dense_mlp) / tp + bd.routers + bd.shared_experts) / pp + outer
    # experts: E/ep of them on a rank, split by TP (NxD) or, folded (fsdp2), sharded over the ranks
    # holding the same ones (dims.expert_dp, TP ranks included)
    expert = bd.experts / pp / (ep if dims.ep_folds_tp else ep * tp)

    bytes_ = spec.state_bytes(model, parallel, hardware, trainer)
    pb, gb, ob = bytes_.param, bytes_.grad, bytes_.optimizer
    shard = min(dp, p.hybrid_shard_degree or dp)
    expert_shard = min(dims.expert_dp, p.hybrid_shard_degree or dims.expert_dp)
    if spec.hybrid_shard and p.hybrid_shard_degree:  # its shard groups hold whole EP groups (FSDP2's HSDP)
        expert_shard = p.hybrid_shard_degree * tp // ep
    weights_from = spec.weights_sharded_from

    def sharded(n_dense: float, n_expert: float, stage_needed: int) -> float:
        if p.zero_stage >= stage_needed:
            return n_dense / shard + n_expert / expert_shard
        return n_dense + n_expert

    # offloaded experts (FSDP2's CPUOffloadPolicy) keep their states in host memory: the device holds
    # only their gathered copy while a block runs (comm)
    offloaded = expert if p.offload_experts else 0.0
    on_device = expert - offloaded
    params = sharded(non_expert, on_device, weights_from) * pb
    grads = sharded(non_expert, on_device, 2) * gb
    if pp > 1 and spec.pp_accumulates_full_grads:  # offloaded experts reduce every micro-batch
        grads = (non_expert + on_device) * 4
    optimizer = sharded(non_expert, on_device, 1) * ob
    step = sharded(non_expert, on_device, 1) * bytes_.step
    host = offloaded / expert_shard * (pb + gb + ob) * hardware.devices_per_node
    first, last, act_note = activation_bytes(model, moe_opt, parallel, hardware, trainer, dims, routing_skew,
                                             trainer.micro_batch_size)
    if p.zero_stage >= weights_from:
        replicas = f", {dp // shard} HSDP replicas" if dp > shard else ""
        sharding_note = (f"{spec.library}: dense states over {shard} ranks, expert states over "
                         f"{expert_shard} (the ranks holding the same experts){replicas}")
    elif p.zero_stage >= 1:
        sharding_note = (f"ZeRO-{p.zero_stage}: dense states over {shard} ranks, expert states over "
                         f"{expert_shard} (expert-dp)")
    else:
        sharding_note = "not sharded (ZeRO stage 0)"
    return Memory(
        params=params / GIB, grads=grads / GIB, optimizer=optimizer / GIB,
        activations=max(first, last) / GIB, step=step / GIB, grads_in_step=bytes_.grads_in_step,
        comm=spec.comm_buffer_bytes(model, parallel, hardware, trainer, dp) / GIB,
        capacity=float(hardware.device_memory_gib),
        precision_note=f"{bytes_.note} ({pb}+{gb}+{ob} bytes/param)",
        activation_note=act_note, sharding_note=sharding_note,
        fixed=float(hardware.fixed_memory_gib),
        sharded_backward=spec.sharded_backward and pp == 1,
        host_per_node=host / GIB, host_capacity=hardware.host_memory_gib,
    )


def memory_hints(parallel, trainer, spec: BackendSpec) -> list[str]:
    """What would lower the estimate, skipping what this backend cannot do or the config already does."""
    hints = [f"parallel.zero_stage={spec.max_zero_stage} (states shard over dp)"] \
        if parallel.zero_stage < spec.max_zero_stage else []
    able = {"ep": True, "tp": spec.tensor_parallel, "pp": spec.pipeline_parallel}
    degrees = [key for key, ok in able.items() if ok]
    hints.append("more " + " / ".join(f"parallel.{d}" for d in degrees))
    if parallel.hybrid_shard_degree:
        hints.append("a larger parallel.hybrid_shard_degree (null: shard over every data-parallel rank)")
    if parallel.activation_checkpointing != "full":
        hints.append("parallel.activation_checkpointing=full")
    if trainer.micro_batch_size > 1:
        hints.append("a smaller trainer.micro_batch_size")
    return hints


def make_plan(cfg, dims: ParallelDims) -> Plan:
    """The layout and memory estimate for a composed, validated config."""
    p, hw, spec = cfg.parallel, cfg.hardware, spec_of(cfg.hardware)
    launched = trainer_world(cfg.trainer)
    sizes = param_breakdown(cfg.model)
    memory = memory_estimate(cfg.model, cfg.moe_opt, p, hw, cfg.trainer, dims, cfg.routing_skew)
    notes = []
    if launched != dims.world:
        notes.append(
            f"trainer.devices x trainer.num_nodes = {cfg.trainer.devices} x {cfg.trainer.num_nodes} = "
            f"{launched}; this dry run planned for {dims.world}. To launch: "
            f"{launch_overrides(dims.world, hw.devices_per_node)}"
        )
    if memory.verdict != "fits":
        notes.append(f"warning: {memory.total:.2f} GiB is above 90% of the {memory.capacity:g} GiB of a "
                     f"{hw.device_name}; to save memory: " + ", ".join(memory_hints(p, cfg.trainer, spec)))
    if memory.host_verdict in ("tight", "does not fit"):
        notes.append(f"warning: the offloaded states take {memory.host_per_node:.0f} GiB of host memory per "
                     f"node, above 90% of its {memory.host_capacity:g} GiB: more nodes, or a smaller model")
    return Plan(model=cfg.model.name, hardware=hw.name, parallel=p.name, device_name=hw.device_name,
                dims=dims, trainer_world=launched, params_total=sizes.total,
                params_active=sizes.active, memory=memory, notes=notes)


def _b(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) <= 8:
        return str(ranks)
    return "[" + ", ".join(map(str, ranks[:6])) + f", ..., {ranks[-1]}]"
