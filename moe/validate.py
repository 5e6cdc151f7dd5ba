"""Cross-field config rules, checked before anything is built.

`validate(cfg)` runs every rule in `RULES` in order; the first broken one raises
`ConfigError(field, value, fix)` naming the dotted key, the value seen and the change that
makes it work. Types and unknown keys are already checked by the typed schema at compose
time (moe/config.py); these are the rules between fields. Nothing here needs a device: a
dry run plans for the layout's own world size (see `moe.parallel.plan.world_size`).
"""
from __future__ import annotations

from moe.errors import ConfigError
from moe.parallel.plan import data_parallel_size, launch_overrides, world_size

AC_POLICIES = ("none", "selective", "full", "every_n", "moe_only")
DROP_POLICIES = ("probs", "position")
STRATEGIES = ("ddp", "deepspeed", "neuron")


def _need(ok: bool, field: str, value, fix: str, problem: str = "is invalid") -> None:
    if not ok:
        raise ConfigError(field, value, fix, problem=problem)


# --------------------------------------------------------------------------- trainer and world


def check_trainer_counts(cfg) -> None:
    t = cfg.trainer
    for key in ("devices", "num_nodes", "micro_batch_size", "accumulate_grad_batches"):
        _need(t[key] >= 1, f"trainer.{key}", t[key], f"set trainer.{key} to 1 or more", "must be at least 1")
    _need(t.max_steps > 0, "trainer.max_steps", t.max_steps, "set trainer.max_steps to a positive number",
          "must be positive")


def check_devices_per_node(cfg) -> None:
    hw = cfg.hardware
    _need(cfg.trainer.devices <= hw.devices_per_node, "trainer.devices", cfg.trainer.devices,
          f"use at most {hw.devices_per_node} devices per node and raise trainer.num_nodes instead",
          f"exceeds hardware.devices_per_node={hw.devices_per_node} ({hw.name})")


def check_degrees(cfg) -> None:
    p = cfg.parallel
    for key in ("tp", "pp", "ep"):
        _need(p[key] >= 1, f"parallel.{key}", p[key], f"set parallel.{key} to 1 or more",
              "must be at least 1")
    _need(p.dp is None or p.dp >= 1, "parallel.dp", p.dp,
          "set parallel.dp to 1 or more, or null to derive it", "must be at least 1")


def check_world_divisible(cfg) -> None:
    p, world = cfg.parallel, world_size(cfg)
    tp_pp = p.tp * p.pp
    key = "pp" if p.tp == 1 else "tp"
    _need(world % tp_pp == 0, f"parallel.{key}", p[key],
          f"launch a multiple of tp*pp = {tp_pp} devices ({launch_overrides(tp_pp, cfg.hardware)}), "
          "or lower parallel.tp / parallel.pp",
          f"(tp*pp = {tp_pp}) does not divide the world size {world}")


def check_dp_matches_world(cfg) -> None:
    p, world = cfg.parallel, world_size(cfg)
    if p.dp is None:
        return
    need = p.tp * p.pp * p.dp
    _need(need == world, "parallel.dp", p.dp,
          f"launch tp*pp*dp = {need} devices ({launch_overrides(need, cfg.hardware)}), "
          "or set parallel.dp=null to derive it from the world",
          f"gives tp*pp*dp = {need} but the world is {world} devices")


def check_ep(cfg) -> None:
    p, m = cfg.parallel, cfg.model
    _need(m.num_experts % p.ep == 0, "parallel.ep", p.ep,
          f"use an ep that divides model.num_experts={m.num_experts}",
          f"does not divide num_experts={m.num_experts}")
    dp = data_parallel_size(cfg)
    least = p.tp * p.pp * p.ep
    _need(dp % p.ep == 0, "parallel.ep", p.ep,
          "expert parallelism is carved out of data parallelism, so launch a multiple of "
          f"tp*pp*ep = {least} devices ({launch_overrides(least, cfg.hardware)}), "
          f"or use an ep that divides dp={dp}",
          f"does not divide the data-parallel size {dp}")


def check_hybrid_shard(cfg) -> None:
    p = cfg.parallel
    if p.hybrid_shard_degree is None:
        return
    dp = data_parallel_size(cfg)
    _need(p.hybrid_shard_degree >= 1 and dp % p.hybrid_shard_degree == 0, "parallel.hybrid_shard_degree",
          p.hybrid_shard_degree,
          f"use a divisor of dp={dp}, or null to shard over the whole data-parallel group",
          f"does not divide the data-parallel size {dp}")
    _need(p.zero_stage >= 1, "parallel.hybrid_shard_degree", p.hybrid_shard_degree,
          "set parallel.zero_stage to 1 or more (it limits the ZeRO shard group), or leave it null",
          "has nothing to shard with zero_stage=0")


def check_global_batch(cfg) -> None:
    t = cfg.trainer
    if t.global_batch_size is None:
        return
    dp = data_parallel_size(cfg)
    got = t.micro_batch_size * t.accumulate_grad_batches * dp
    per_micro = t.micro_batch_size * dp
    if t.global_batch_size % per_micro == 0:
        hint = f"set trainer.accumulate_grad_batches={t.global_batch_size // per_micro}"
    else:
        hint = f"use a multiple of micro_batch_size*dp = {per_micro}"
    _need(got == t.global_batch_size, "trainer.global_batch_size", t.global_batch_size,
          f"{hint}, or set trainer.global_batch_size=null to derive it",
          "!= micro_batch_size*accumulate_grad_batches*dp = "
          f"{t.micro_batch_size}*{t.accumulate_grad_batches}*{dp} = {got}")


# --------------------------------------------------------------------------- parallel features


def check_sequence_parallel(cfg) -> None:
    p = cfg.parallel
    _need(not p.sequence_parallel or p.tp > 1, "parallel.sequence_parallel", p.sequence_parallel,
          "set parallel.sequence_parallel=false, or use tensor parallelism (parallel.tp > 1)",
          "splits activations over the TP group, which needs tp > 1")


def check_zero_stage(cfg) -> None:
    p, hw, m = cfg.parallel, cfg.hardware, cfg.model
    _need(p.zero_stage in (0, 1, 2, 3), "parallel.zero_stage", p.zero_stage, "use 0, 1, 2 or 3",
          "is not a ZeRO stage")
    _need(not (p.zero_stage == 3 and m.num_experts > 1 and hw.strategy == "deepspeed"), "parallel.zero_stage",
          p.zero_stage, "use parallel.zero_stage=2 (or 1) with expert parallelism for the rest",
          "with MoE is refused by DeepSpeed (native MoE is not supported with ZeRO stage 3)")
    _need(not (p.zero_stage > 1 and hw.strategy == "neuron"), "parallel.zero_stage", p.zero_stage,
          "use parallel.zero_stage=1 (neuronx-distributed shards optimizer states only)",
          f"is not available on hardware={hw.name}")
    _need(not (p.zero_stage > 0 and hw.strategy == "ddp"), "parallel.zero_stage", p.zero_stage,
          "use hardware=cpu_deepspeed (or gpu) for ZeRO sharding, or parallel.zero_stage=0",
          f"needs a sharding strategy; hardware={hw.name} runs plain DDP")


def check_model_parallel_support(cfg) -> None:
    p, hw = cfg.parallel, cfg.hardware
    for key in ("tp", "pp"):
        _need(not (p[key] > 1 and hw.strategy == "ddp"), f"parallel.{key}", p[key],
              "use hardware=trn1 (neuronx-distributed has tensor and pipeline parallelism), "
              f"or parallel.{key}=1",
              f"needs tensor/pipeline parallelism, which hardware={hw.name} (DDP) does not have")


def check_model_split(cfg) -> None:
    p, m = cfg.parallel, cfg.model
    _need(m.num_heads % p.tp == 0, "parallel.tp", p.tp,
          f"use a tp that divides model.num_heads={m.num_heads}", f"does not divide num_heads={m.num_heads}")
    _need(m.num_layers % p.pp == 0, "parallel.pp", p.pp,
          f"use a pp that divides model.num_layers={m.num_layers}",
          f"does not divide num_layers={m.num_layers}")


def check_activation_checkpointing(cfg) -> None:
    p = cfg.parallel
    _need(p.activation_checkpointing in AC_POLICIES, "parallel.activation_checkpointing",
          p.activation_checkpointing, f"use one of {', '.join(AC_POLICIES)}", "is not a known policy")
    _need(p.activation_checkpointing_every_n >= 1, "parallel.activation_checkpointing_every_n",
          p.activation_checkpointing_every_n, "use 1 or more", "must be at least 1")


def check_strategy(cfg) -> None:
    hw = cfg.hardware
    _need(hw.strategy in STRATEGIES, "hardware.strategy", hw.strategy, f"use one of {', '.join(STRATEGIES)}",
          "is not a known strategy")


# --------------------------------------------------------------------------- model and routing


def check_attention_shape(cfg) -> None:
    m = cfg.model
    if m.head_dim is None:
        _need(m.hidden_size % m.num_heads == 0, "model.hidden_size", m.hidden_size,
              f"use a multiple of model.num_heads={m.num_heads}, or set model.head_dim",
              f"is not divisible by num_heads={m.num_heads}")
    _need(m.num_kv_heads >= 1 and m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads", m.num_kv_heads,
          f"use a divisor of model.num_heads={m.num_heads}", f"does not divide num_heads={m.num_heads}")


def check_experts(cfg) -> None:
    m = cfg.model
    _need(m.num_experts >= 1, "model.num_experts", m.num_experts, "use 1 or more experts",
          "must be at least 1")
    _need(1 <= m.top_k <= m.num_experts, "model.top_k", m.top_k,
          f"use 1 <= top_k <= model.num_experts={m.num_experts}",
          f"is outside 1..num_experts={m.num_experts}")
    _need(m.moe_layer_frequency >= 1, "model.moe_layer_frequency", m.moe_layer_frequency,
          "use 1 (every layer MoE) or N for an MoE block every N layers", "must be at least 1")


def check_seq_len(cfg) -> None:
    m, seq_len = cfg.model, cfg.data.seq_len
    _need(seq_len <= m.max_position_embeddings, "data.seq_len", seq_len,
          f"use data.seq_len <= {m.max_position_embeddings}, or raise model.max_position_embeddings",
          f"exceeds model.max_position_embeddings={m.max_position_embeddings}")


def check_routing(cfg) -> None:
    r = cfg.moe_opt
    for key in ("capacity_factor", "eval_capacity_factor"):
        _need(r[key] is None or r[key] > 0, f"moe_opt.{key}", r[key],
              "use a positive factor such as 1.25, or null for dropless routing", "must be positive or null")
    _need(r.drop_policy in DROP_POLICIES, "moe_opt.drop_policy", r.drop_policy,
          f"use one of {', '.join(DROP_POLICIES)}", "is not a known drop policy")
    _need(r.router_dtype in ("fp32", "bf16", "fp16"), "moe_opt.router_dtype", r.router_dtype,
          "use fp32 (recommended), bf16 or fp16", "is not a known dtype")


# --------------------------------------------------------------------------- optimizer


def check_learning_rate(cfg) -> None:
    o = cfg.optimizer
    _need(o.lr > 0, "optimizer.lr", o.lr, "use a positive learning rate such as 3e-4", "must be positive")
    _need(0 <= o.min_lr <= o.lr, "optimizer.min_lr", o.min_lr, f"use 0 <= min_lr <= optimizer.lr={o.lr}",
          f"is outside 0..lr={o.lr}")


def check_schedule(cfg) -> None:
    o, max_steps = cfg.optimizer, cfg.trainer.max_steps
    horizon = o.decay_steps or max_steps
    key = "optimizer.decay_steps" if o.decay_steps else "trainer.max_steps"
    _need(0 <= o.warmup_steps <= horizon, "optimizer.warmup_steps", o.warmup_steps,
          f"use at most {key}={horizon} warmup steps (e.g. {max(0, horizon // 10)}), or a longer run",
          f"exceeds {key}={horizon}: the learning rate would never reach optimizer.lr")


RULES = [  # in order: counts, then the hardware, then divisibility of the layout, then the rest
    check_trainer_counts, check_devices_per_node, check_degrees, check_strategy,
    check_model_parallel_support, check_experts, check_world_divisible, check_dp_matches_world, check_ep,
    check_hybrid_shard, check_global_batch, check_sequence_parallel, check_zero_stage, check_model_split,
    check_activation_checkpointing, check_attention_shape, check_seq_len, check_routing,
    check_learning_rate, check_schedule,
]


def validate(cfg) -> None:
    """Raise ConfigError for the first rule the composed config breaks."""
    for rule in RULES:
        rule(cfg)
