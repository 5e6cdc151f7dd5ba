"""Every value and cross-field rule of the three configs, and every enumeration they use.

`validate(cfg)` checks a composed `train.py` config before anything is built
(moe.parallel.dims.validated_dims then builds the run's ParallelDims); `validate_model(model,
moe_opt)` is the part a model checks when it is built on its own (tests, imports from Hugging
Face); `validate_prep` and `validate_infer` check `data_prep.py` and `infer.py`. The first
broken rule raises `ConfigError(field, value, fix)` naming the dotted key, the value seen and
the change that makes it work. Types and unknown keys are already checked by the typed schemas
at compose time (moe/config/*.py).

What a backend can do (ZeRO stages, tensor/pipeline parallelism, precisions) is its spec's
(moe/config/specs.py); the rules that refuse what a backend cannot do are here.
"""
from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

from moe.config.derived import (
    PP_SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    data_parallel_size,
    dense_width,
    has_moe_layers,
    head_dim_of,
    launch_overrides,
    neuron_precision,
    planning,
    precision_of,
    stages_per_rank,
    world_of,
)
from moe.config.schema import DEFAULT_CHAT_TEMPLATE, normalizes
from moe.config.specs import SPECS, spec_of
from moe.errors import ConfigError, did_you_mean

# -- enumerations -------------------------------------------------------------------------------
AC_POLICIES = ("none", "selective", "full", "every_n", "moe_only")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # name -> torch attribute
POSITION_ENCODINGS = ("rope", "alibi")
ATTENTIONS = ("gqa", "mla")
MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # required by mla
AUX_LOSS_GROUPS = ("ep", "dp")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
NEURON_PRECISIONS = ("auto", "bf16_sr", "mixed", "fp32")  # auto: moe.config.specs.neuron_precision
SPIKE_ACTIONS = ("warn", "skip", "rollback")
DATA_KINDS = ("prepared", "online")
DATA_FORMATS = ("text", "chat", "sentence")
PACKINGS = ("concat", "pad")
BAD_ROW_POLICIES = ("error", "skip", "repair")
INFER_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # besides auto


def _need(ok: bool, field: str, value, fix: str, problem: str = "is invalid") -> None:
    if not ok:
        raise ConfigError(field, value, fix, problem=problem)


def _finite_number(field: str, value, fix: str) -> None:
    _need(value is None or math.isfinite(value), field, value, fix, "is not a finite number")


def _one_of(field: str, value, choices, what: str) -> None:
    _need(value in choices, field, value, f"use one of {', '.join(choices)}", f"is not a known {what}")


# =============================================================================== model and routing


def validate_model(m, r=None, prefix: str = "model") -> None:
    """The model group (and moe_opt when given): what MoETransformer needs to be built."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "num_experts", "top_k", "moe_layer_frequency", "max_position_embeddings"):
        value = getattr(m, key)
        _need(value >= 1, f"{prefix}.{key}", value, f"set {prefix}.{key} to a positive integer",
              "must be at least 1")
    _one_of(f"{prefix}.attention", m.attention, ATTENTIONS, "attention")
    _one_of(f"{prefix}.position_encoding", m.position_encoding, POSITION_ENCODINGS, "position encoding")
    if m.attention == "mla":
        validate_mla(m, prefix)
    else:
        validate_gqa(m, prefix)
    _need(m.top_k <= m.num_experts, f"{prefix}.top_k", m.top_k,
          f"use 1 <= top_k <= {prefix}.num_experts={m.num_experts}", f"exceeds num_experts={m.num_experts}")
    _need(0 <= m.first_k_dense_replace <= m.num_layers, f"{prefix}.first_k_dense_replace",
          m.first_k_dense_replace, f"use 0 (no leading dense layers) to {prefix}.num_layers={m.num_layers}",
          "is outside [0, num_layers]")
    _need(m.sliding_window is None or m.sliding_window >= 1, f"{prefix}.sliding_window", m.sliding_window,
          "use a positive window or null for full attention")
    for key, fix in (("rope_theta", "use a positive base such as 1e6"),
                     ("init_range", "use a positive std such as 0.02"),
                     ("rms_norm_eps", "use a small positive epsilon such as 1e-5")):
        value = getattr(m, key)
        _finite_number(f"{prefix}.{key}", value, fix)
        _need(value > 0, f"{prefix}.{key}", value, fix, "must be positive")
    _need(m.shared_expert_intermediate_size >= 0, f"{prefix}.shared_expert_intermediate_size",
          m.shared_expert_intermediate_size, "use 0 (no shared expert) or a positive width")
    _need(m.dense_intermediate_size is None or m.dense_intermediate_size >= 1,
          f"{prefix}.dense_intermediate_size", m.dense_intermediate_size,
          "use a positive width or null (= intermediate_size)")
    if r is not None:
        validate_routing(r)
        validate_groups(m, r, prefix)


def validate_gqa(m, prefix: str) -> None:
    """Grouped-query attention: heads of head_dim, kv heads shared by groups of q heads."""
    if m.head_dim is None:
        _need(m.hidden_size % m.num_heads == 0, f"{prefix}.hidden_size", m.hidden_size,
              f"use a multiple of {prefix}.num_heads={m.num_heads}, or set {prefix}.head_dim",
              f"is not divisible by num_heads={m.num_heads}")
    else:
        _need(m.head_dim >= 1, f"{prefix}.head_dim", m.head_dim, "set a positive head_dim or null")
    _need(m.num_heads % m.num_kv_heads == 0, f"{prefix}.num_kv_heads", m.num_kv_heads,
          f"use a divisor of {prefix}.num_heads={m.num_heads} (GQA shares a kv head by a group of q heads)",
          f"does not divide num_heads={m.num_heads}")
    head_dim = head_dim_of(m)
    _need(m.position_encoding != "rope" or head_dim % 2 == 0, f"{prefix}.head_dim", head_dim,
          "RoPE rotates pairs of dims: use an even head_dim", "is odd")


def validate_mla(m, prefix: str) -> None:
    """Multi-head latent attention: its latent and head dims set, RoPE on an even number of dims."""
    deepseek_v3 = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    for key in MLA_DIMS:
        value = getattr(m, key)
        _need(value is not None and value >= 1, f"{prefix}.{key}", value,
              f"set {prefix}.{key} to a positive integer (DeepSeek-V3: {deepseek_v3[key]}; "
              f"model=tiny_deepseek_v3 sets every MLA key), or use {prefix}.attention=gqa",
              "is required by attention=mla")
    _need(m.q_lora_rank is None or m.q_lora_rank >= 1, f"{prefix}.q_lora_rank", m.q_lora_rank,
          "use a positive rank (DeepSeek-V3: 1536), or null for one q_proj without a latent")
    _need(m.qk_rope_head_dim % 2 == 0, f"{prefix}.qk_rope_head_dim", m.qk_rope_head_dim,
          "RoPE rotates pairs of dims: use an even qk_rope_head_dim (DeepSeek-V3: 64)", "is odd")
    _need(m.position_encoding == "rope", f"{prefix}.position_encoding", m.position_encoding,
          f"use rope with {prefix}.attention=mla", "is not built into MLA (its position is a RoPE key)")


def validate_groups(m, r, model_prefix: str = "model") -> None:
    """Group-limited routing needs groups that tile the experts and can hold the top_k choices."""
    groups, chosen = r.num_groups, r.group_top_k
    if groups is None:
        _need(chosen is None, "moe_opt.group_top_k", chosen,
              "set moe_opt.num_groups too, or group_top_k=null",
              "needs moe_opt.num_groups")
        return
    _need(groups >= 1 and m.num_experts % groups == 0, "moe_opt.num_groups", groups,
          f"use a divisor of {model_prefix}.num_experts={m.num_experts}, or null for no groups",
          f"does not divide num_experts={m.num_experts}")
    _need(chosen is not None and 1 <= chosen <= min(groups, m.top_k), "moe_opt.group_top_k", chosen,
          f"use 1 <= group_top_k <= min(num_groups={groups}, top_k={m.top_k})",
          "must pick between 1 group and as many groups as a token picks experts")
    per_group = m.num_experts // groups
    _need(chosen * per_group >= m.top_k, "moe_opt.group_top_k", chosen,
          f"pick at least {-(-m.top_k // per_group)} groups of {per_group} experts for top_k={m.top_k}",
          f"leaves fewer than top_k={m.top_k} experts to choose from")


def validate_routing(r, prefix: str = "moe_opt") -> None:
    for key in ("capacity_factor", "eval_capacity_factor"):
        value = getattr(r, key)
        _finite_number(f"{prefix}.{key}", value, "use a factor such as 1.25, or null for dropless routing")
        _need(value is None or value > 0, f"{prefix}.{key}", value,
              "use a positive factor (1.0-2.0 is usual), or null for dropless routing",
              "must be positive or null")
    _need(r.min_capacity >= 0, f"{prefix}.min_capacity", r.min_capacity, "use 0 or more",
          "must not be negative")
    _one_of(f"{prefix}.drop_policy", r.drop_policy, DROP_POLICIES, "drop policy")
    for key in ("aux_loss_coeff", "z_loss_coeff"):
        value = getattr(r, key)
        _finite_number(f"{prefix}.{key}", value, "use a coefficient such as 0.01, or 0 to turn the loss off")
        _need(value >= 0, f"{prefix}.{key}", value, "use 0 or a positive coefficient", "must not be negative")
    jitter_fix = "use a value in [0, 1), e.g. 0.01; 0 turns jitter off"
    _finite_number(f"{prefix}.jitter_eps", r.jitter_eps, jitter_fix)
    _need(0 <= r.jitter_eps < 1, f"{prefix}.jitter_eps", r.jitter_eps, jitter_fix, "is outside [0, 1)")
    _one_of(f"{prefix}.router_dtype", r.router_dtype, tuple(ROUTER_DTYPES), "router dtype (fp32 recommended)")
    _one_of(f"{prefix}.aux_loss_group", r.aux_loss_group, AUX_LOSS_GROUPS, "load-balance group")
    _one_of(f"{prefix}.load_balancing_type", r.load_balancing_type,
            LOAD_BALANCING_TYPES, "load-balancing type")
    _one_of(f"{prefix}.score_function", r.score_function, SCORE_FUNCTIONS,
            "score function")
    scaling = r.topk_scaling_factor
    _finite_number(f"{prefix}.topk_scaling_factor", scaling, "use a positive factor such as 2.5, or null")
    _need(scaling is None or scaling > 0, f"{prefix}.topk_scaling_factor", scaling,
          "use a positive factor such as 2.5 (DeepSeek-V3), or null", "must be positive or null")
    rate = r.bias_update_rate
    _finite_number(f"{prefix}.bias_update_rate", rate, "use a small positive rate such as 1e-3")
    _need(rate >= 0, f"{prefix}.bias_update_rate", rate, "use a small positive rate such as 1e-3 (Megatron's "
          "default), or moe_opt.enable_expert_bias=false", "must not be negative")


# =============================================================================== train.py


def check_trainer_counts(cfg) -> None:
    t = cfg.trainer
    for key in ("devices", "num_nodes", "micro_batch_size", "accumulate_grad_batches"):
        _need(t[key] >= 1, f"trainer.{key}", t[key], f"set trainer.{key} to 1 or more", "must be at least 1")
    _need(t.max_steps > 0, "trainer.max_steps", t.max_steps, "set trainer.max_steps to a positive number",
          "must be positive")
    for key in ("log_every_n_steps", "val_check_interval", "checkpoint_every_n_steps",
                "keep_last_checkpoints"):
        _need(t[key] >= 1, f"trainer.{key}", t[key], f"set trainer.{key} to 1 or more", "must be at least 1")
    _need(t.limit_val_batches >= 0, "trainer.limit_val_batches", t.limit_val_batches,
          "use 0 (no validation) or more batches", "must not be negative")


def check_backend(cfg) -> None:
    hw = cfg.hardware
    _one_of("hardware.strategy", hw.strategy, tuple(SPECS), "strategy")
    _need(cfg.trainer.devices <= hw.devices_per_node, "trainer.devices", cfg.trainer.devices,
          f"use at most {hw.devices_per_node} devices per node and raise trainer.num_nodes instead",
          f"exceeds hardware.devices_per_node={hw.devices_per_node} ({hw.name})")
    _one_of("hardware.neuron_precision", hw.neuron_precision, NEURON_PRECISIONS, "Neuron precision preset")
    spec = spec_of(cfg)
    precision = precision_of(cfg)
    if spec.precisions is None:
        _need(cfg.trainer.precision is None, "trainer.precision", cfg.trainer.precision,
              "leave trainer.precision=null and pick hardware.neuron_precision "
              f"({', '.join(NEURON_PRECISIONS)})",
              f"is not used by {spec.library} (hardware={hw.name})")
    else:
        key = "trainer.precision" if cfg.trainer.precision else "hardware.precision"
        _need(precision in spec.precisions, key, precision, f"use one of {', '.join(spec.precisions)}",
              f"is not a precision the {spec.library} backend runs")


def check_degrees(cfg) -> None:
    p = cfg.parallel
    for key in ("tp", "pp", "ep"):
        _need(p[key] >= 1, f"parallel.{key}", p[key], f"set parallel.{key} to 1 or more",
              "must be at least 1")
    _need(p.dp is None or p.dp >= 1, "parallel.dp", p.dp,
          "set parallel.dp to 1 or more, or null to derive it", "must be at least 1")


def check_backend_degrees(cfg) -> None:
    """A degree the backend would ignore is refused, so no run silently trains another layout."""
    p, hw, spec = cfg.parallel, cfg.hardware, spec_of(cfg)
    capable = {"tp": spec.tensor_parallel, "pp": spec.pipeline_parallel}
    for key, able in capable.items():
        if p[key] > 1 and not able:
            others = [s.name for s in SPECS.values()
                      if (s.tensor_parallel if key == "tp" else s.pipeline_parallel)]
            raise ConfigError(f"parallel.{key}", p[key],
                              f"set parallel.{key}=1 (use parallel.ep and data parallelism), or a backend "
                              f"that has it (hardware.strategy: {', '.join(others)}; e.g. hardware=trn1)",
                              problem=f"is not implemented by {spec.library} (hardware={hw.name})")


def check_pp_schedule(cfg) -> None:
    """Only the torch-native backend picks a pipeline schedule; NxD runs its own 1F1B."""
    p = cfg.parallel
    if len(spec_of(cfg).pp_schedules) > 1:
        return
    _need(p.pp_schedule == "1F1B" and p.pp_stages_per_rank in (None, 1), "parallel.pp_schedule",
          p.pp_schedule, "leave parallel.pp_schedule=1F1B and parallel.pp_stages_per_rank=null, or use the "
          "torch-native backend (hardware=gpu_fsdp2, trn2, cpu_fsdp2) for other schedules",
          f"is not chosen on {spec_of(cfg).library}: neuronx-distributed runs its own 1F1B schedule")


def check_offload(cfg) -> None:
    """parallel.offload_experts is FSDP2's CPUOffloadPolicy on the experts' units (the torch-native
    backend's)."""
    p = cfg.parallel
    if not p.offload_experts:
        return
    _need(spec_of(cfg).offload_experts, "parallel.offload_experts", True,
          "use the torch-native backend (hardware=gpu_fsdp2 or gpu_a100_fsdp2), or "
          "parallel.offload_experts=false",
          f"is FSDP2's CPUOffloadPolicy, which {spec_of(cfg).library} does not run (DeepSpeed's own "
          "offload is not built here)")
    _need(has_moe_layers(cfg.model), "parallel.offload_experts", True, "set parallel.offload_experts=false",
          f"has no experts to offload in model={cfg.model.name}")


def check_overlap_comm(cfg) -> None:
    """parallel.overlap_comm is a DeepSpeed ZeRO setting."""
    p = cfg.parallel
    if p.overlap_comm is None:
        return
    _need(spec_of(cfg).overlap_comm, "parallel.overlap_comm", p.overlap_comm,
          "leave parallel.overlap_comm=null, or use DeepSpeed (hardware=gpu or cpu_deepspeed)",
          f"is DeepSpeed's ZeRO setting, which {spec_of(cfg).library} does not have")


def check_world_divisible(cfg) -> None:
    p, world = cfg.parallel, world_of(cfg)
    tp_pp = p.tp * p.pp
    key = "pp" if p.tp == 1 else "tp"
    _need(world % tp_pp == 0, f"parallel.{key}", p[key],
          f"launch a multiple of tp*pp = {tp_pp} devices "
          f"({launch_overrides(tp_pp, cfg.hardware.devices_per_node)}), or lower parallel.tp / parallel.pp",
          f"(tp*pp = {tp_pp}) does not divide the world size {world}")


def check_dp_matches_world(cfg) -> None:
    p, world = cfg.parallel, world_of(cfg)
    if p.dp is None:
        return
    need = p.tp * p.pp * p.dp
    _need(need == world, "parallel.dp", p.dp,
          f"launch tp*pp*dp = {need} devices ({launch_overrides(need, cfg.hardware.devices_per_node)}), "
          "or set parallel.dp=null to derive it from the world",
          f"gives tp*pp*dp = {need} but the world is {world} devices")


def check_ep(cfg) -> None:
    p, m = cfg.parallel, cfg.model
    _need(m.num_experts % p.ep == 0, "parallel.ep", p.ep,
          f"use an ep that divides model.num_experts={m.num_experts}",
          f"does not divide num_experts={m.num_experts}")
    dp = data_parallel_size(cfg)
    if spec_of(cfg).ep_folds_tp:  # EP folded with TP (moe.parallel.dims)
        _check_folded_ep(cfg, dp)
        return
    least = p.tp * p.pp * p.ep
    _need(dp % p.ep == 0, "parallel.ep", p.ep,
          "expert parallelism is carved out of data parallelism, so launch a multiple of "
          f"tp*pp*ep = {least} devices ({launch_overrides(least, cfg.hardware.devices_per_node)}), "
          f"or use an ep that divides dp={dp}",
          f"does not divide the data-parallel size {dp}")


def _check_folded_ep(cfg, dp: int) -> None:
    """The torch-native backend's EP groups are ep consecutive ranks of the dp x tp ones; each MoE layer
    splits its micro-batch's tokens over the TP group."""
    p, t = cfg.parallel, cfg.trainer
    _need(p.ep % p.tp == 0 or p.tp % p.ep == 0, "parallel.ep", p.ep,
          f"use an ep that is a multiple of parallel.tp={p.tp} (EP groups of whole TP groups, e.g. "
          f"ep={2 * p.tp if p.tp > 1 else 2}) or a divisor of it",
          f"neither divides nor is a multiple of tp={p.tp}: EP groups are consecutive ranks and must hold "
          "whole TP groups or lie inside one")
    _need((dp * p.tp) % p.ep == 0, "parallel.ep", p.ep,
          f"use an ep that divides dp x tp = {dp * p.tp}, or launch a multiple of "
          f"{p.pp * max(p.ep, p.tp)} devices",
          f"does not divide the {dp * p.tp} ranks (dp {dp} x tp {p.tp}) expert parallelism folds")
    tokens = t.micro_batch_size * cfg.data.seq_len
    if p.tp > 1 and has_moe_layers(cfg.model):
        _need(tokens % p.tp == 0, "trainer.micro_batch_size", t.micro_batch_size,
              f"use a micro-batch size and data.seq_len whose product divides by parallel.tp={p.tp}",
              f"gives {tokens} tokens per micro-batch, which the MoE layers cannot split evenly over the "
              f"{p.tp} TP ranks")


def check_hybrid_shard(cfg) -> None:
    p, spec = cfg.parallel, spec_of(cfg)
    if p.hybrid_shard_degree is None:
        return
    _need(spec.hybrid_shard, "parallel.hybrid_shard_degree", p.hybrid_shard_degree,
          f"set parallel.hybrid_shard_degree=null ({spec.library} shards ZeRO state over the whole "
          "data-parallel group), or use the fsdp2 backend, which has HSDP (hardware=gpu_fsdp2, trn2, "
          "cpu_fsdp2)",
          f"is not implemented by {spec.library} (hardware={cfg.hardware.name})")
    dp = data_parallel_size(cfg)
    _need(p.hybrid_shard_degree >= 1 and dp % p.hybrid_shard_degree == 0, "parallel.hybrid_shard_degree",
          p.hybrid_shard_degree, f"use a divisor of dp={dp}, or null to shard over the data-parallel group",
          f"does not divide the data-parallel size {dp}")


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


def check_sequence_parallel(cfg) -> None:
    p = cfg.parallel
    _need(not p.sequence_parallel or p.tp > 1, "parallel.sequence_parallel", p.sequence_parallel,
          "set parallel.sequence_parallel=false, or use tensor parallelism (parallel.tp > 1)",
          "splits activations over the TP group, which needs tp > 1")


def check_zero_stage(cfg) -> None:
    p, hw, spec = cfg.parallel, cfg.hardware, spec_of(cfg)
    _need(p.zero_stage in (0, 1, 2, 3), "parallel.zero_stage", p.zero_stage, "use 0, 1, 2 or 3",
          "is not a ZeRO stage")
    if p.zero_stage <= spec.max_zero_stage:
        return
    if spec.max_zero_stage == 0:
        fix = "use hardware=cpu_deepspeed (or gpu) for ZeRO sharding, or parallel.zero_stage=0"
    else:
        why = spec.zero_limit.format(library=spec.library)
        fix = f"use parallel.zero_stage={spec.max_zero_stage} ({why})"
    raise ConfigError("parallel.zero_stage", p.zero_stage, fix,
                      problem=f"is not available with {spec.library} (hardware={hw.name})")


def check_model_split(cfg) -> None:
    p, m = cfg.parallel, cfg.model
    _need(m.num_heads % p.tp == 0, "parallel.tp", p.tp,
          f"use a tp that divides model.num_heads={m.num_heads}", f"does not divide num_heads={m.num_heads}")
    _need(m.num_layers % p.pp == 0, "parallel.pp", p.pp,
          f"use a pp that divides model.num_layers={m.num_layers}",
          f"does not divide num_layers={m.num_layers}")


def check_activation_checkpointing(cfg) -> None:
    p = cfg.parallel
    _one_of("parallel.activation_checkpointing", p.activation_checkpointing, AC_POLICIES, "policy")
    _need(p.activation_checkpointing_every_n >= 1, "parallel.activation_checkpointing_every_n",
          p.activation_checkpointing_every_n, "use 1 or more", "must be at least 1")


def check_model(cfg) -> None:
    validate_model(cfg.model, cfg.moe_opt)


def check_hf_start(cfg) -> None:
    """model.init_from_hf / upcycle_from_hf: one of them; fine-grained upcycling (granularity g) starts
    equal to the dense model only with the top-k weights scaled by g (moe/hf/dense.py)."""
    m = cfg.model
    upcycle = m.get("upcycle_from_hf")
    _need(not (m.init_from_hf and upcycle), "model.upcycle_from_hf", upcycle,
          "set only one of model.init_from_hf (a Mixtral or DeepSeek-V3 directory) and "
          "model.upcycle_from_hf (a dense one)", "is set together with model.init_from_hf")
    g = m.get("upcycle_granularity", 1)
    if upcycle and g > 1:
        scaling = cfg.moe_opt.get("topk_scaling_factor")
        _need(scaling == g, "moe_opt.topk_scaling_factor", scaling,
              f"set moe_opt.topk_scaling_factor={g}: each of a copy's {g} slices then gets weight "
              f"1/{g} x {g}, and the start equals the dense model",
              f"does not match model.upcycle_granularity={g}")


def check_seq_len(cfg) -> None:
    m, seq_len = cfg.model, cfg.data.seq_len
    _need(seq_len >= 1, "data.seq_len", seq_len, "use a positive sequence length such as 2048",
          "must be positive")
    _need(seq_len <= m.max_position_embeddings, "data.seq_len", seq_len,
          f"use data.seq_len <= {m.max_position_embeddings}, or raise model.max_position_embeddings",
          f"exceeds model.max_position_embeddings={m.max_position_embeddings}")


def check_data(cfg) -> None:
    d = cfg.data
    _one_of("data.kind", d.kind, DATA_KINDS, "data kind")
    _one_of("data.format", d.format, DATA_FORMATS, "data format")
    _finite_number("data.val_fraction", d.val_fraction, "use a fraction in [0, 1), e.g. 0.05")
    _need(0 <= d.val_fraction < 1, "data.val_fraction", d.val_fraction, "use a fraction in [0, 1), e.g. 0.05",
          "is outside [0, 1)")
    _need(d.num_workers >= 0, "data.num_workers", d.num_workers,
          "use 0 (load in the training process) or more", "must not be negative")
    if d.format == "chat":
        check_chat_template("data.chat_template", d.chat_template)


def check_optimizer(cfg) -> None:
    o = cfg.optimizer
    for key in ("lr", "min_lr", "eps", "weight_decay", "grad_clip"):
        _finite_number(f"optimizer.{key}", o[key], f"use a finite optimizer.{key}")
    _need(o.lr > 0, "optimizer.lr", o.lr, "use a positive learning rate such as 3e-4", "must be positive")
    _need(0 <= o.min_lr <= o.lr, "optimizer.min_lr", o.min_lr, f"use 0 <= min_lr <= optimizer.lr={o.lr}",
          f"is outside 0..lr={o.lr}")
    _need(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optimizer.betas", list(o.betas),
          "use two values in [0, 1), e.g. [0.9, 0.95]", "are not AdamW betas")
    _need(o.eps > 0, "optimizer.eps", o.eps, "use a small positive epsilon such as 1e-8", "must be positive")
    _need(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, "use 0 or more, e.g. 0.1",
          "must not be negative")
    _need(o.grad_clip >= 0, "optimizer.grad_clip", o.grad_clip,
          "use a positive max norm such as 1.0, or 0 for off", "must not be negative")


def check_schedule(cfg) -> None:
    o = cfg.optimizer
    _need(o.decay_steps is None or o.decay_steps >= 1, "optimizer.decay_steps", o.decay_steps,
          "use a positive step count, or null for trainer.max_steps", "must be at least 1")
    _need(o.warmup_steps >= 0, "optimizer.warmup_steps", o.warmup_steps,
          "use 0 (no warm-up) or a positive step count", "must not be negative")
    # longer than the decay horizon (a short run with the default): moe.module.optim.warmup_of clamps it


def check_guard(cfg) -> None:
    """The loss-spike and NaN guard's keys in the trainer group (moe/train/guard.py)."""
    t = cfg.trainer
    _one_of("trainer.spike_action", t.spike_action, SPIKE_ACTIONS, "spike action")
    _finite_number("trainer.spike_factor", t.spike_factor, "use e.g. 3.0, or 0 to turn detection off")
    _need(t.spike_factor == 0 or t.spike_factor > 1, "trainer.spike_factor", t.spike_factor,
          "use a multiple of the running mean above 1 (e.g. 3.0), or 0 to turn detection off",
          "would flag ordinary steps as spikes")
    _need(t.spike_window >= 1, "trainer.spike_window", t.spike_window, "use 1 or more steps (e.g. 50)",
          "must be at least 1")
    _need(t.spike_max_rollbacks >= 0, "trainer.spike_max_rollbacks", t.spike_max_rollbacks, "use 0 or more",
          "must not be negative")
    _need(t.save_checkpoints or t.spike_action != "rollback", "trainer.spike_action", t.spike_action,
          "use trainer.spike_action=skip or warn, or trainer.save_checkpoints=true",
          "rolls back to the last checkpoint, and trainer.save_checkpoints=false writes none")
    _need(t.max_nonfinite_steps >= 0, "trainer.max_nonfinite_steps", t.max_nonfinite_steps,
          "use 0 (never stop) or more (e.g. 10)", "must not be negative")


def check_instantiables(cfg) -> None:
    """logger.<name> and callbacks.<name>: nodes with a `_target_`, as Hydra instantiates them."""
    for group in ("logger", "callbacks"):
        for name, node in (cfg.get(group) or {}).items():
            target = node.get("_target_") if hasattr(node, "get") else None
            _need(isinstance(target, str) and "." in target, f"{group}.{name}._target_", target,
                  f"give {group}.{name} a `_target_` naming a class, e.g. "
                  + ("lightning.pytorch.loggers.TensorBoardLogger" if group == "logger"
                     else "lightning.pytorch.callbacks.LearningRateMonitor"),
                  "is missing or not a dotted class path")


def check_neuron(cfg) -> None:
    """What neuronx-distributed 2.28 (the last release that trains on trn1) cannot do, refused with why.

    Lines are src/neuronx_distributed/ at v2.28.0; docs/TRAINIUM.md explains each choice.
    """
    p, m, r, t = cfg.parallel, cfg.model, cfg.moe_opt, cfg.trainer
    _need(t.devices >= 2 or planning(cfg), "trainer.devices", t.devices,
          "use 2 or more NeuronCores per node (a trn1.2xlarge has 2, a trn1.32xlarge 32)",
          "is too few: neuronx-distributed's XLA strategy fails with a single device (Lightning "
          "XLAStrategy.setup_distributed)")
    _need(m.attention == "gqa", "model.attention", m.attention,
          "use model.attention=gqa on trn1, or train MLA with hardware=gpu, gpu_fsdp2 or trn2",
          "is not built on trn1: the backend swaps the fused qkv_proj for neuronx-distributed's "
          "ColumnParallelLinear (moe/backends/neuron/layers.py), and NxD v2.28.0 has no latent attention "
          "(its attention projection is GQAQKVColumnParallelLinear, modules/qkv_linear.py:371)")
    _need(m.num_kv_heads % p.tp == 0, "parallel.tp", p.tp,
          f"use a tp that divides model.num_kv_heads={m.num_kv_heads}",
          f"does not divide num_kv_heads={m.num_kv_heads}: each rank holds whole KV heads (no KV "
          "replication)")
    _need(not m.tie_word_embeddings, "model.tie_word_embeddings", True, "set model.tie_word_embeddings=false",
          "is not supported on trn1 (the embedding and the LM head are separate parallel layers)")
    _need(m.shared_expert_intermediate_size == 0, "model.shared_expert_intermediate_size",
          m.shared_expert_intermediate_size, "use 0 on trn1", "is not wired to neuronx-distributed's MoE")
    _need(p.activation_checkpointing != "every_n", "parallel.activation_checkpointing", "every_n",
          "use none, full, moe_only or selective on trn1",
          "has no neuronx-distributed equivalent (it checkpoints by module class)")
    _need(not r.enable_expert_bias, "moe_opt.enable_expert_bias", True,
          "use the load-balance loss on trn1 (moe_opt.aux_loss_coeff), or hardware=gpu / cpu",
          "is not available on trn1: neuronx-distributed's router has no selection bias "
          "(modules/moe/routing.py:155 RouterTopK)")
    _need(r.load_balancing_type == "aux_loss", "moe_opt.load_balancing_type", r.load_balancing_type,
          "use aux_loss on trn1 (set aux_loss_coeff=0 to turn it off)",
          "is not wired to neuronx-distributed's MoE layer (moe/backends/neuron/moe_layer.py)")
    _need(r.num_groups is None, "moe_opt.num_groups", r.num_groups, "set moe_opt.num_groups=null on trn1",
          "is not available on trn1: neuronx-distributed's RouterTopK has no group-limited routing "
          "(modules/moe/routing.py:155-205)")
    _need(r.topk_scaling_factor is None, "moe_opt.topk_scaling_factor", r.topk_scaling_factor,
          "set moe_opt.topk_scaling_factor=null on trn1",
          "is not available on trn1: neuronx-distributed's ExpertMLPs takes the affinities as they are")
    check_neuron_precision(cfg)
    if p.ep > 1:
        check_neuron_expert_parallel(cfg)
    nxd_routing = "or use moe_opt=nxd (neuronx-distributed's routing)"
    if r.capacity_factor is not None:
        _need(r.drop_policy == "position", "moe_opt.drop_policy", r.drop_policy,
              f"set moe_opt.drop_policy=position, {nxd_routing}",
              "is not neuronx-distributed's: it drops the latest tokens (modules/moe/expert_mlps_v2.py:"
              "514-528)")
        _need(r.min_capacity == 0, "moe_opt.min_capacity", r.min_capacity,
              f"set moe_opt.min_capacity=0, {nxd_routing}",
              "has no neuronx-distributed equivalent (capacity min(ceil(T*k*cf/E), T), "
              "expert_mlps_v2.py:498-501)")
        _need(r.normalize_after_drop or not normalizes(r.normalize_top_k, m.top_k),
              "moe_opt.normalize_after_drop", r.normalize_after_drop,
              f"set moe_opt.normalize_after_drop=true, {nxd_routing}",
              "is not neuronx-distributed's: it renormalises the top-k weights over the experts a capacity "
              "kept (expert_mlps_v2.py:299-318)")
    _need(r.eval_capacity_factor == r.capacity_factor, "moe_opt.eval_capacity_factor", r.eval_capacity_factor,
          f"set moe_opt.eval_capacity_factor={r.capacity_factor}, {nxd_routing}",
          "differs from capacity_factor, and neuronx-distributed's MoE has one capacity factor")
    _need(r.jitter_eps == 0, "moe_opt.jitter_eps", r.jitter_eps, f"set moe_opt.jitter_eps=0, {nxd_routing}",
          "is not supported on trn1 (NxD's router jitter writes into its input, "
          "modules/moe/routing.py:92-97)")
    _need(r.router_dtype == "fp32", "moe_opt.router_dtype", r.router_dtype, "use fp32 on trn1",
          "is not supported on trn1 (NxD's router runs in fp32)")
    _need(r.aux_loss_group == "ep", "moe_opt.aux_loss_group", r.aux_loss_group, "use ep on trn1",
          "is not supported on trn1 (load balance over one data-parallel rank's tokens only)")
    _need(not (m.top_k == 1 and r.normalize_top_k), "moe_opt.normalize_top_k", True,
          "leave moe_opt.normalize_top_k null or false with top_k=1",
          "with top_k=1 is refused by neuronx-distributed (expert_mlps_v2.py:270-271)")


def check_neuron_precision(cfg) -> None:
    """NxD's MoE computes its slot indices in float64 (expert_mlps_v2.py:285-294, :518, :531-545):
    XLA_USE_BF16=1 (bf16_sr) runs them in bf16, exact for integers up to 256 only, which misplaces
    most tokens' slots; XLA_DOWNCAST_BF16=1 (mixed) runs them in float32, exact up to 2**24 slots."""
    m, t = cfg.model, cfg.trainer
    precision = neuron_precision(cfg)
    moe_layers = has_moe_layers(m)
    fix = ("use hardware.neuron_precision=mixed (bf16 compute, fp32 master weights; float64 runs as float32) "
           "or fp32, or auto, which picks mixed for MoE models")
    _need(not (moe_layers and precision == "bf16_sr"), "hardware.neuron_precision", "bf16_sr", fix,
          "would corrupt neuronx-distributed's MoE routing: XLA_USE_BF16=1 turns its float64 slot arithmetic "
          "(modules/moe/expert_mlps_v2.py:285-294, 518, 531-545) into bf16, exact for counts up to 256 only")
    slots = m.num_experts * t.micro_batch_size * cfg.data.seq_len  # the largest slot index, at capacity T
    _need(not (moe_layers and precision == "mixed" and slots > 2**24), "trainer.micro_batch_size",
          t.micro_batch_size, "use hardware.neuron_precision=fp32, or fewer tokens per micro-batch",
          f"gives {slots:,} MoE slots (num_experts x micro_batch_size x seq_len), past 2**24, where "
          "float32 (mixed precision's float64) stops counting exactly")


def check_neuron_expert_parallel(cfg) -> None:
    """What neuronx-distributed's training-time expert parallelism (EP carved out of data parallelism,
    the capacity path's all-to-all, moe/backends/neuron/moe_layer.py) needs; lines are v2.28.0's."""
    p, m, r = cfg.parallel, cfg.model, cfg.moe_opt
    _need(r.capacity_factor is not None, "moe_opt.capacity_factor", None,
          "set moe_opt.capacity_factor (e.g. 2.0, moe_opt=nxd) with parallel.ep > 1 on trn1, or "
          "parallel.ep=1 for dropless",
          "(dropless) is not expert-parallel in neuronx-distributed's training: its blockwise path runs "
          "this rank's experts on this rank's tokens only, with no all-to-all (modules/moe/"
          "expert_mlps_v2.py:713-716, 776-781), which is right for inference, where every rank holds the "
          "same tokens")
    full = m.num_experts / m.top_k
    _need(r.capacity_factor < full, "moe_opt.capacity_factor", r.capacity_factor,
          f"use a capacity factor below num_experts / top_k = {full:g} with parallel.ep > 1 (e.g. 2.0)",
          f"is at least num_experts / top_k = {full:g}, which neuronx-distributed turns into full capacity "
          "(expert_mlps_v2.py:268-269): every token through every local expert, with no all-to-all under "
          "expert parallelism (modules/moe/experts.py:172-174, 182-189)")
    _need(p.zero_stage == 1, "parallel.zero_stage", p.zero_stage,
          "set parallel.zero_stage=1 with parallel.ep > 1 on trn1 (NxD's expert-parallel ZeRO-1, "
          "NeuronEPZero1Optimizer; every trn1 preset uses it)",
          "cannot be resumed with expert parallelism: without ZeRO-1 neuronx-distributed saves the optimizer "
          "state of expert-parallel rank 0 only (the first rank of each data-parallel group, "
          "trainer/checkpoint.py:765-770, :580) and loads every rank's own _ep_rank_ file (:923-924)")
    _need(p.tp != 4, "parallel.tp", p.tp, "use tp 2 or 8 with parallel.ep > 1 on trn1",
          "with expert parallelism is refused by neuronx-distributed on trn1 (its TP 4 groups are not "
          "contiguous; parallel_layers/parallel_state.py:605-606)")


def check_fsdp2(cfg) -> None:
    """What the torch-native backend (moe/backends/fsdp2.py) does not do, refused with what to use."""
    p, m = cfg.parallel, cfg.model
    dp = data_parallel_size(cfg)
    _need(p.zero_stage >= 2 or dp == 1, "parallel.zero_stage", p.zero_stage,
          "set parallel.zero_stage=3 (each block's gathered weights freed after its forward) or 2 (kept "
          "until its backward: more memory, one all-gather fewer)",
          "is not what FSDP2 does: it shards weights, gradients and optimizer states over the data-parallel "
          "ranks (use hardware=gpu, DeepSpeed, for ZeRO-1)")
    if p.hybrid_shard_degree:
        _need(p.hybrid_shard_degree * p.tp % p.ep == 0, "parallel.hybrid_shard_degree", p.hybrid_shard_degree,
              f"use one whose product with parallel.tp={p.tp} is a multiple of parallel.ep={p.ep}",
              "must hold whole expert-parallel groups (each HSDP shard group holds every expert)")
    if p.sequence_parallel and p.tp > 1:
        _need(cfg.data.seq_len % p.tp == 0, "data.seq_len", cfg.data.seq_len,
              f"use a sequence length divisible by parallel.tp={p.tp}, or parallel.sequence_parallel=false",
              f"cannot be split evenly over the {p.tp} TP ranks of sequence parallelism")
    _need(not m.tie_word_embeddings, "model.tie_word_embeddings", True, "set model.tie_word_embeddings=false",
          "is not supported on the fsdp2 backend (FSDP2 would shard the embedding and the LM head apart)")
    if p.tp > 1 and m.attention == "gqa":
        _need(m.num_kv_heads % p.tp == 0, "parallel.tp", p.tp,
              f"use a tp that divides model.num_kv_heads={m.num_kv_heads}",
              f"does not divide num_kv_heads={m.num_kv_heads}: each rank holds whole KV heads")
    if p.pp > 1:
        _check_fsdp2_pipeline(cfg)
    if p.tp > 1:
        width = dense_width(m)
        _need(width % p.tp == 0, "parallel.tp", p.tp, f"use a tp that divides the dense MLP width {width}",
              f"does not divide the dense MLP width {width}")
        _need(m.position_encoding == "rope", "model.position_encoding", m.position_encoding,
              "use rope with tensor parallelism on the fsdp2 backend, or parallel.tp=1",
              "is not split over TP ranks (ALiBi's slopes are per head)")


def _check_fsdp2_pipeline(cfg) -> None:
    """torch.distributed.pipelining's limits (torch/distributed/pipelining/schedules.py: 1F1B needs as many
    micro-batches as stages, the looped schedules whole rounds of pp) and what this product runs of it."""
    p, t, m = cfg.parallel, cfg.trainer, cfg.model
    _need(p.pp_schedule not in ("ZBVZeroBubble", "DualPipeV"), "parallel.pp_schedule", p.pp_schedule,
          "use InterleavedZeroBubble (zero bubble on looped stages), or Interleaved1F1B",
          "is refused: validation runs through the schedule, and torch 2.13's V-shaped schedules fail in "
          "eval() (pipelining/stage.py:419, \"can't steal_bwd_input if this stage doesn't have backward\")")
    _one_of("parallel.pp_schedule", p.pp_schedule, PP_SCHEDULES, "pipeline schedule")
    schedule = p.pp_schedule
    per_rank = stages_per_rank(schedule, p.pp_stages_per_rank)
    single = schedule.lower() in SINGLE_STAGE_SCHEDULES
    if single:
        _need(per_rank == 1, "parallel.pp_stages_per_rank", per_rank,
              "set parallel.pp_stages_per_rank=1 (or null)",
              f"is not what {schedule} runs: one stage per pp rank")
    else:
        _need(per_rank >= 2, "parallel.pp_stages_per_rank", per_rank,
              "set parallel.pp_stages_per_rank=2 or more (or null), or parallel.pp_schedule=1F1B",
              f"is too few for {schedule}, which interleaves several stages on each pp rank")
    stages = p.pp * per_rank
    _need(m.num_layers % stages == 0, "parallel.pp", p.pp,
          f"use a pp (times parallel.pp_stages_per_rank={per_rank}) that divides model.num_layers="
          f"{m.num_layers}",
          f"gives {stages} pipeline stages, which do not split {m.num_layers} layers evenly")
    if "ZeroBubble" in schedule:
        _need(p.zero_stage == 2, "parallel.zero_stage", p.zero_stage,
              "set parallel.zero_stage=2 (each stage's weights stay gathered from its forward to its "
              "backward, torchtitan's default under pipelining)",
              f"frees the gathered weights after each forward, and {schedule}'s split weight-gradient pass "
              "then finds none of them (pipelining/_backward.py stage_backward_input: the gradients of every "
              "stage but the first would be lost)")
    n = p.pipeline_microbatches or t.accumulate_grad_batches
    field, value = (("parallel.pipeline_microbatches", p.pipeline_microbatches) if p.pipeline_microbatches
                    else ("trainer.accumulate_grad_batches", t.accumulate_grad_batches))
    rows = t.micro_batch_size * t.accumulate_grad_batches
    _need(rows % n == 0, field, value, f"use a number of micro-batches that divides the {rows} sequences a "
          "rank takes per step (trainer.micro_batch_size x trainer.accumulate_grad_batches)",
          f"does not split the step's {rows} sequences evenly")
    _need(n >= p.pp and (single or n % p.pp == 0), field, value,
          f"use at least {p.pp} micro-batches{'' if single else f', a multiple of parallel.pp={p.pp}'} (more "
          "micro-batches also shrink the pipeline bubble)",
          f"is not a number of micro-batches {schedule} runs over {p.pp} pipeline ranks")


def check_waits(cfg) -> None:
    """How long a launch waits for the run dir's lock (moe/train/run_lock.py), and a rank for a peer in a
    collective (moe.parallel.comm.set_collective_timeout)."""
    wait = cfg.get("lock_wait_s")
    _need(wait is None or wait >= 0, "lock_wait_s", wait,
          "use 0 or more seconds, or null (120 s for a requeued SLURM job, else no wait)",
          "must not be negative")
    timeout = cfg.parallel.collective_timeout_s
    _need(timeout > 0, "parallel.collective_timeout_s", timeout,
          "use a positive number of seconds (production: minutes, e.g. 1800; tests: a few seconds)",
          "must be positive")


def check_planning(cfg) -> None:
    """What the plan and the run's figures rest on: a skew below balance or a negative fixed cost means
    nothing, a device without peak FLOPS or memory divides MFU and the memory verdict by zero."""
    skew = cfg.routing_skew
    _need(skew >= 1.0, "routing_skew", skew, "use 1.0 (perfect balance) or more, e.g. the default 2.0",
          "puts the hottest expert below its balanced share")
    fixed = cfg.hardware.fixed_memory_gib
    _need(fixed >= 0, "hardware.fixed_memory_gib", fixed, "use 0 or more GiB", "is negative")
    hw = cfg.hardware
    _need(hw.peak_tflops > 0, "hardware.peak_tflops", hw.peak_tflops,
          "use the device's dense peak in TFLOPS (H100 SXM bf16: 989), which MFU divides by",
          "must be positive")
    _need(hw.device_memory_gib > 0, "hardware.device_memory_gib", hw.device_memory_gib,
          "use the device's memory in GiB (H100: 80)", "must be positive")


def check_simulate(cfg) -> None:
    """simulate=true runs the torch model's own code path for one rank (moe/tools/simulate.py)."""
    if not cfg.simulate:
        return
    p, world = cfg.parallel, world_of(cfg)
    if (p.tp > 1 or p.pp > 1) and not spec_of(cfg).simulated_model_parallel:
        raise ConfigError("simulate", True,
                          "use dry_run=true for this layout's plan (make test-neuron measures trn1's at "
                          "reduced width, docs/TRAINIUM.md), or the torch-native backend for TP and PP "
                          "(hardware=gpu_fsdp2 or trn2, which simulate)",
                          f"runs the torch model's own code path; tensor/pipeline parallelism "
                          f"(tp={p.tp}, pp={p.pp}) here is neuronx-distributed's, whose process "
                          "groups need the Neuron runtime, or a process per rank in its CPU mode "
                          "(parallel_layers/parallel_state.py:797-818)")
    _need(0 <= cfg.simulate_rank < world, "simulate_rank", cfg.simulate_rank, f"use a rank in 0..{world - 1}",
          f"is not a rank of the {world}-device world")


# Nodes whose keys are free-form (a logger's or a callback's constructor arguments; Hydra's own node).
FREE_FORM = ("logger", "callbacks", "hydra")


SEED_RANGE = (0, 2**32 - 1)  # what numpy's generators (and Lightning's seed_everything) accept


def check_seed(field: str, value) -> None:
    low, high = SEED_RANGE
    _need(isinstance(value, int) and low <= value <= high, field, value,
          f"use a whole number from {low} to {high}", "is not a seed numpy accepts")


def check_seeds(cfg) -> None:
    """train.py's seeds: the run's (model init, data order, dropout) and the validation split's."""
    check_seed("seed", cfg.seed)
    check_seed("data.split_seed", cfg.data.split_seed)


def check_known_keys(cfg) -> None:
    """Refuse keys the typed schema does not define: `+trainer.max_step=5` adds one silently otherwise."""
    from moe.config.schema import TrainConfig

    if not isinstance(cfg, DictConfig):
        return  # a TrainConfig dataclass has no other keys
    schema = OmegaConf.structured(TrainConfig)

    def walk(node, known, path: str) -> None:
        if not isinstance(node, DictConfig) or not isinstance(known, DictConfig):
            return
        if OmegaConf.get_type(known) is dict:  # a dict-typed field: any key
            return
        for key in node.keys():
            where = f"{path}.{key}" if path else str(key)
            if key not in known and where not in FREE_FORM:
                options = ", ".join(sorted(str(k) for k in known.keys()))
                guess = did_you_mean(key, known.keys())
                hint = f"did you mean {path + '.' if path else ''}{guess}? Else " if guess else ""
                fix = f"{hint}remove it or use one of the keys of {path or 'the root'}: {options}"
                raise ConfigError(where, "???" if OmegaConf.is_missing(node, key) else node[key], fix,
                                  problem="is not a key of the config schema (a `+` override adds keys "
                                          "silently; every key is in docs/CONFIG.md)")
            if where not in FREE_FORM and not where.startswith(tuple(f"{f}." for f in FREE_FORM)):
                walk(node[key], known[key], where)

    walk(cfg, schema, "")


def check_finite(cfg) -> None:
    """Every number must be finite: nan/inf pass the type check and fail mid-run (or silently)."""

    def walk(node, path: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            where = f"{path}.{key}" if path else str(key)
            if isinstance(value, dict | list):
                walk(value, where)
            elif isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(where, value, "give a finite number (see docs/CONFIG.md for its range)",
                                  problem="is not a finite number")

    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    walk(OmegaConf.to_container(node, resolve=False), "")  # interpolations: their targets are checked


# the rules one backend adds, by hardware.strategy (its spec, moe.config.specs, says what it can do; these
# say what its library refuses, with the fix)
BACKEND_RULES = {"neuron": check_neuron, "fsdp2": check_fsdp2}


def check_backend_rules(cfg) -> None:
    rules = BACKEND_RULES.get(cfg.hardware.strategy)
    if rules is not None:
        rules(cfg)


RULES = [  # in order: keys and numbers, counts, then the hardware, then divisibility of the layout, the rest
    check_known_keys, check_finite, check_seeds,
    check_trainer_counts, check_backend, check_degrees, check_backend_degrees, check_pp_schedule,
    check_offload,
    check_overlap_comm,
    check_model,
    check_world_divisible, check_dp_matches_world, check_ep, check_hybrid_shard, check_global_batch,
    check_sequence_parallel, check_zero_stage, check_model_split, check_activation_checkpointing,
    check_seq_len, check_data, check_optimizer, check_schedule, check_guard, check_instantiables,
    check_backend_rules, check_hf_start, check_planning, check_simulate, check_waits,
]


def validate(cfg) -> None:
    """Raise ConfigError for the first rule the composed config breaks."""
    for rule in RULES:
        rule(cfg)


# =============================================================================== data_prep.py


def check_chat_template(field: str, template: str) -> None:
    for slot in ("{prompt}", "{completion}"):
        _need(template.count(slot) == 1, field, template,
              f"put {slot} exactly once in the template, e.g. {DEFAULT_CHAT_TEMPLATE!r}",
              f"must contain {slot} once")
    _need(template.index("{prompt}") < template.index("{completion}"), field, template,
          "put {prompt} before {completion}", "has the completion before the prompt")


def validate_prep(cfg) -> None:
    """data_prep.py's keys (moe/config/data_prep.py PrepConfig); names are top level there."""
    check_seed("seed", cfg.seed)
    _need(cfg.input not in (None, "", []), "input", cfg.input,
          "pass input=PATH (file, glob, directory) or a hub dataset name", "is required")
    _one_of("format", cfg.format, DATA_FORMATS, "format")
    _one_of("packing", cfg.packing, PACKINGS, "packing mode")
    _one_of("on_bad_row", cfg.on_bad_row, BAD_ROW_POLICIES, "bad-row policy")
    _need(cfg.seq_len >= 1, "seq_len", cfg.seq_len, "use a positive length, e.g. 2048", "is too small")
    _finite_number("val_fraction", cfg.val_fraction, "use a fraction in [0, 1), e.g. 0.1")
    _need(0.0 <= cfg.val_fraction < 1.0, "val_fraction", cfg.val_fraction,
          "use a fraction in [0, 1), e.g. 0.1", "is out of range")
    for key in ("num_proc", "batch_size"):
        _need(getattr(cfg, key) >= 1, key, getattr(cfg, key), "use 1 or more", "must be positive")
    _need(cfg.vocab_size is None or cfg.vocab_size > 256, "vocab_size", cfg.vocab_size,
          "use more than 256 (a byte-level BPE holds the 256 bytes and its special tokens), e.g. 32000",
          "is too small for a byte-level BPE")
    _need((cfg.tokenizer is None) != (cfg.vocab_size is None), "tokenizer", cfg.tokenizer,
          "pass tokenizer=DIR (a directory with tokenizer.json) or vocab_size=N (train a byte-level BPE "
          "on the input), not both",
          "is required" if cfg.tokenizer is None else f"and vocab_size={cfg.vocab_size} are both set")
    if cfg.format == "chat":
        check_chat_template("chat_template", cfg.chat_template)
    else:
        _need(not cfg.assistant_only_loss, "assistant_only_loss", True,
              "use format=chat, or set assistant_only_loss=false", f"needs format=chat, not {cfg.format}")


# =============================================================================== infer.py


def validate_infer(cfg) -> None:
    """infer.py's sampling and dtype keys (moe/config/infer.py InferConfig)."""
    checks = [("max_new_tokens", cfg.max_new_tokens >= 0, "use 0 or more"),
              ("temperature", math.isfinite(cfg.temperature) and cfg.temperature >= 0,
               "use 0 (greedy) or a positive value such as 0.8"),
              ("top_k", cfg.top_k >= 0, "use 0 (off) or a positive count such as 50"),
              ("top_p", math.isfinite(cfg.top_p) and 0 < cfg.top_p <= 1, "use a value in (0, 1], 1 = off"),
              ("batch_size", cfg.batch_size >= 1, "use 1 or more")]
    for name, ok, fix in checks:
        _need(ok, name, getattr(cfg, name), fix)
    check_seed("seed", cfg.seed)
    _one_of("dtype", cfg.dtype, ("auto", *INFER_DTYPES), "dtype")
