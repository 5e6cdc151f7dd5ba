"""The model and moe_opt groups: what MoETransformer needs to be built (moe.model checks them itself,
from a config or a Hugging Face directory; train.py checks them with the rest)."""
from __future__ import annotations

from moe.config.choices import (
    ATTENTION_LAYER_TYPES,
    ATTENTIONS,
    AUX_LOSS_GROUPS,
    DROP_POLICIES,
    EXPERT_ACTIVATIONS,
    LOAD_BALANCING_TYPES,
    MLA_DIMS,
    POSITION_ENCODINGS,
    QK_NORMS,
    ROPE_TYPES,
    ROUTER_DTYPES,
    SCORE_FUNCTIONS,
)
from moe.config.derived import (
    head_dim_of,
    rotary_dim_of,
)
from moe.config.rules.refusals import finite_number, need, one_of


def validate_model(m, r=None, prefix: str = "model") -> None:
    """The model group (and moe_opt when given): what MoETransformer needs to be built."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "num_experts", "top_k", "moe_layer_frequency", "max_position_embeddings"):
        value = getattr(m, key)
        need(value >= 1, f"{prefix}.{key}", value, f"set {prefix}.{key} to a positive integer",
             "must be at least 1")
    one_of(f"{prefix}.attention", m.attention, ATTENTIONS, "attention")
    one_of(f"{prefix}.position_encoding", m.position_encoding, POSITION_ENCODINGS, "position encoding")
    one_of(f"{prefix}.qk_norm", m.qk_norm, QK_NORMS, "query/key norm")
    if m.attention == "mla":
        validate_mla(m, prefix)
    else:
        validate_gqa(m, prefix)
    need(m.top_k <= m.num_experts, f"{prefix}.top_k", m.top_k,
         f"use 1 <= top_k <= {prefix}.num_experts={m.num_experts}", f"exceeds num_experts={m.num_experts}")
    need(0 <= m.first_k_dense_replace <= m.num_layers, f"{prefix}.first_k_dense_replace",
         m.first_k_dense_replace, f"use 0 (no leading dense layers) to {prefix}.num_layers={m.num_layers}",
         "is outside [0, num_layers]")
    need(m.sliding_window is None or m.sliding_window >= 1, f"{prefix}.sliding_window", m.sliding_window,
         "use a positive window or null for full attention")
    for key, fix in (("rope_theta", "use a positive base such as 1e6"),
                     ("init_range", "use a positive std such as 0.02"),
                     ("rms_norm_eps", "use a small positive epsilon such as 1e-5")):
        value = getattr(m, key)
        finite_number(f"{prefix}.{key}", value, fix)
        need(value > 0, f"{prefix}.{key}", value, fix, "must be positive")
    validate_rope(m, prefix)
    validate_partial_rotary(m, prefix)
    need(m.shared_expert_intermediate_size >= 0, f"{prefix}.shared_expert_intermediate_size",
         m.shared_expert_intermediate_size, "use 0 (no shared expert) or a positive width")
    need(not m.shared_expert_gate or m.shared_expert_intermediate_size > 0, f"{prefix}.shared_expert_gate",
         True, f"set {prefix}.shared_expert_intermediate_size to the shared expert's width, or "
         "shared_expert_gate=false",
         "gates a shared expert the model does not have (shared_expert_intermediate_size=0)")
    validate_dense_layers(m, prefix)
    need(m.dense_intermediate_size is None or m.dense_intermediate_size >= 1,
         f"{prefix}.dense_intermediate_size", m.dense_intermediate_size,
         "use a positive width or null (= intermediate_size)")
    validate_layer_types(m, prefix)
    validate_mtp(m, prefix)
    validate_gpt_oss_pieces(m, r, prefix)
    if r is not None:
        validate_routing(r)
        validate_groups(m, r, prefix)


def validate_dense_layers(m, prefix: str) -> None:
    """model.dense_layers: distinct layer indices of this model."""
    layers = list(m.dense_layers or ())
    bad = [i for i in layers if not 0 <= i < m.num_layers]
    need(not bad, f"{prefix}.dense_layers", layers,
         f"list 0-based layer indices below {prefix}.num_layers={m.num_layers}, or null",
         f"holds {bad}, outside the model's layers")
    need(len(set(layers)) == len(layers), f"{prefix}.dense_layers", layers, "list each layer once",
         "repeats a layer")


def validate_mtp(m, prefix: str) -> None:
    """model.mtp_layers and model.mtp_loss_weight: a count of depths and a weight, neither negative; the
    depths' blocks follow the layers after the last (their index num_layers + k), which a per-layer
    attention pattern does not name."""
    need(isinstance(m.mtp_layers, int) and m.mtp_layers >= 0, f"{prefix}.mtp_layers", m.mtp_layers,
         "use 0 (no multi-token prediction) or the number of extra tokens to predict (DeepSeek-V3: 1)",
         "must be a whole number, 0 or more")
    finite_number(f"{prefix}.mtp_loss_weight", m.mtp_loss_weight, "use a weight such as 0.1 (DeepSeek-V3's)")
    need(m.mtp_loss_weight >= 0, f"{prefix}.mtp_loss_weight", m.mtp_loss_weight,
         "use a weight such as 0.1 (DeepSeek-V3's), or 0 to train the depths without their loss",
         "must not be negative")
    need(not m.mtp_layers or m.attention_layer_types is None, f"{prefix}.mtp_layers", m.mtp_layers,
         f"set {prefix}.mtp_layers=0, or {prefix}.attention_layer_types=null",
         f"adds blocks after the {m.num_layers} layers that attention_layer_types describes, which name no "
         "attention for them")


def validate_layer_types(m, prefix: str) -> None:
    """model.attention_layer_types: one known type per layer, and a window for the sliding ones."""
    types = m.attention_layer_types
    if types is None:
        return
    need(len(types) == m.num_layers, f"{prefix}.attention_layer_types", list(types),
         f"give one entry per layer ({prefix}.num_layers={m.num_layers}), or null",
         f"has {len(types)} entries")
    for kind in types:
        one_of(f"{prefix}.attention_layer_types", kind, ATTENTION_LAYER_TYPES, "attention layer type")
    need(m.sliding_window is not None or "sliding_attention" not in types, f"{prefix}.sliding_window", None,
         f"set {prefix}.sliding_window (the sliding_attention layers' window), or make every layer "
         "full_attention", "leaves the sliding_attention layers without a window")


def validate_gpt_oss_pieces(m, r, prefix: str) -> None:
    """Attention biases and sinks (GQA only), the experts' activation and biases, and what the experts'
    FP8 and weighted-activation paths cannot compute with them."""
    one_of(f"{prefix}.expert_activation", m.expert_activation, EXPERT_ACTIVATIONS, "expert activation")
    for key in ("swiglu_alpha", "swiglu_limit"):
        value = getattr(m, key)
        finite_number(f"{prefix}.{key}", value, "use gpt-oss's value (1.702 and 7.0)")
        need(value > 0, f"{prefix}.{key}", value, "use gpt-oss's value (1.702 and 7.0)", "must be positive")
    if m.attention == "mla":
        for key in ("qkv_bias", "o_bias", "attention_sinks"):
            need(not getattr(m, key), f"{prefix}.{key}", True, f"set {prefix}.{key}=false with attention=mla",
                 "is built into GQA attention only")
    if r is None:
        return
    gpt_oss_experts = m.expert_proj_bias or m.expert_activation != "swiglu"
    need(not (r.fp8_experts and gpt_oss_experts), "moe_opt.fp8_experts", True,
         "set moe_opt.fp8_experts=false with expert_proj_bias or clamped_swiglu",
         "has no path for the experts' biases or the clamped SwiGLU (moe/model/fp8.py)")
    need(not (r.weights_in_activation and m.expert_proj_bias), "moe_opt.weights_in_activation", True,
         f"set moe_opt.weights_in_activation=false with {prefix}.expert_proj_bias",
         "would weight the experts' output before the down projection's bias is added; gpt-oss weights "
         "the whole output, bias included")


def validate_gqa(m, prefix: str) -> None:
    """Grouped-query attention: heads of head_dim, kv heads shared by groups of q heads."""
    if m.head_dim is None:
        need(m.hidden_size % m.num_heads == 0, f"{prefix}.hidden_size", m.hidden_size,
             f"use a multiple of {prefix}.num_heads={m.num_heads}, or set {prefix}.head_dim",
             f"is not divisible by num_heads={m.num_heads}")
    else:
        need(m.head_dim >= 1, f"{prefix}.head_dim", m.head_dim, "set a positive head_dim or null")
    need(m.num_heads % m.num_kv_heads == 0, f"{prefix}.num_kv_heads", m.num_kv_heads,
         f"use a divisor of {prefix}.num_heads={m.num_heads} (GQA shares a kv head by a group of q heads)",
         f"does not divide num_heads={m.num_heads}")
    head_dim = head_dim_of(m)
    need(m.position_encoding != "rope" or head_dim % 2 == 0, f"{prefix}.head_dim", head_dim,
         "RoPE rotates pairs of dims: use an even head_dim", "is odd")


# The scaling keys each rope_type reads (transformers' _validate_<type>_rope_parameters,
# modeling_rope_utils.py at 5.24), besides rope_factor; "required" ones must be set.
ROPE_KEYS = {
    "default": {},
    "linear": {},
    "llama3": {"rope_original_max_position_embeddings": "required", "rope_low_freq_factor": "required",
               "rope_high_freq_factor": "required"},
    "yarn": {"rope_original_max_position_embeddings": "required", "rope_beta_fast": "optional",
             "rope_beta_slow": "optional", "rope_mscale": "optional", "rope_mscale_all_dim": "optional",
             "rope_attention_factor": "optional", "rope_truncate": "optional"},
}
ROPE_SCALING_KEYS = ("rope_original_max_position_embeddings", "rope_beta_fast", "rope_beta_slow",
                     "rope_mscale", "rope_mscale_all_dim", "rope_attention_factor", "rope_truncate",
                     "rope_low_freq_factor", "rope_high_freq_factor")
ROPE_EXAMPLE = {"rope_original_max_position_embeddings": "DeepSeek-V3 and gpt-oss: 4096, Llama 3.1: 8192",
                "rope_low_freq_factor": "Llama 3.1: 1", "rope_high_freq_factor": "Llama 3.1: 4"}


def validate_rope(m, prefix: str) -> None:
    """RoPE scaling: a known rope_type on RoPE, a factor >= 1, the keys its type needs set and no key it
    does not read (a key set for another type would silently do nothing)."""
    one_of(f"{prefix}.rope_type", m.rope_type, ROPE_TYPES, "RoPE type")
    if m.rope_type == "default":
        need(m.rope_factor == 1.0, f"{prefix}.rope_factor", m.rope_factor,
             f"set {prefix}.rope_type (linear, llama3 or yarn) to scale RoPE, or rope_factor=1.0",
             "is read by a scaled rope_type only, and rope_type is default")
    else:
        need(m.position_encoding == "rope", f"{prefix}.rope_type", m.rope_type,
             f"use rope_type=default with {prefix}.position_encoding={m.position_encoding}",
             "scales RoPE, which this model does not use")
        finite_number(f"{prefix}.rope_factor", m.rope_factor, "use a factor >= 1 such as 8 (Llama 3.1) or 40")
        need(m.rope_factor >= 1.0, f"{prefix}.rope_factor", m.rope_factor,
             "use a factor >= 1: the context extension over the original one (DeepSeek-V3: 40)",
             "is below 1")
    keys = ROPE_KEYS[m.rope_type]
    for key in ROPE_SCALING_KEYS:
        value = getattr(m, key)
        if key not in keys:
            need(value is None, f"{prefix}.{key}", value, f"set it to null, or use the rope_type that reads "
                 f"it ({' or '.join(t for t, k in ROPE_KEYS.items() if key in k)})",
                 f"is not read by rope_type={m.rope_type}")
        elif keys[key] == "required":
            need(value is not None, f"{prefix}.{key}", value,
                 f"set {prefix}.{key} ({ROPE_EXAMPLE[key]})", f"is required by rope_type={m.rope_type}")
        if value is not None and key != "rope_truncate":
            finite_number(f"{prefix}.{key}", value, f"set {prefix}.{key} to a positive number or null")
            need(value > 0, f"{prefix}.{key}", value, f"set {prefix}.{key} to a positive number or null",
                 "must be positive")
    if m.rope_type == "llama3":
        low, high = m.rope_low_freq_factor, m.rope_high_freq_factor
        need(high > low, f"{prefix}.rope_high_freq_factor", high,
             f"use a value above rope_low_freq_factor={low} (Llama 3.1: 1 and 4)",
             "must exceed rope_low_freq_factor (their difference divides the smoothing ramp)")
    if m.rope_type == "yarn":
        fast, slow = m.rope_beta_fast or 32, m.rope_beta_slow or 1
        need(fast >= slow, f"{prefix}.rope_beta_fast", m.rope_beta_fast,
             f"use a value >= rope_beta_slow={slow} (null = 32, with beta_slow null = 1)",
             "is below rope_beta_slow: the YaRN ramp would run backwards")


def validate_partial_rotary(m, prefix: str) -> None:
    """model.partial_rotary_factor: a fraction in (0, 1] of a GQA head that gives RoPE a whole, even number
    of dims (transformers truncates head_dim * factor: modeling_rope_utils.py:181 at 5.24)."""
    key, factor = f"{prefix}.partial_rotary_factor", m.partial_rotary_factor
    finite_number(key, factor, "use a fraction in (0, 1] such as 0.5 (GLM-4.5), or 1.0 for full RoPE")
    need(0 < factor <= 1, key, factor, "use a fraction in (0, 1] such as 0.5 (GLM-4.5), or 1.0 for full RoPE",
         "is outside (0, 1]")
    if factor == 1.0:
        return
    need(m.attention == "gqa", key, factor, f"use 1.0 with {prefix}.attention={m.attention} (MLA's rotated "
         "dims are qk_rope_head_dim)", "is read by GQA attention only")
    need(m.position_encoding == "rope", key, factor,
         f"use 1.0 with {prefix}.position_encoding={m.position_encoding}", "applies to RoPE only")
    head_dim, rotary = head_dim_of(m), rotary_dim_of(m)
    need(rotary >= 2 and rotary % 2 == 0, key, factor,
         f"use a factor whose int({head_dim} x factor) is even and at least 2, such as 0.5",
         f"rotates int(head_dim={head_dim} x {factor}) = {rotary} dims; RoPE rotates pairs")


def validate_mla(m, prefix: str) -> None:
    """Multi-head latent attention: its latent and head dims set, RoPE on an even number of dims."""
    deepseek_v3 = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    for key in MLA_DIMS:
        value = getattr(m, key)
        need(value is not None and value >= 1, f"{prefix}.{key}", value,
             f"set {prefix}.{key} to a positive integer (DeepSeek-V3: {deepseek_v3[key]}; "
             f"model=tiny_deepseek_v3 sets every MLA key), or use {prefix}.attention=gqa",
             "is required by attention=mla")
    need(m.q_lora_rank is None or m.q_lora_rank >= 1, f"{prefix}.q_lora_rank", m.q_lora_rank,
         "use a positive rank (DeepSeek-V3: 1536), or null for one q_proj without a latent")
    need(m.qk_rope_head_dim % 2 == 0, f"{prefix}.qk_rope_head_dim", m.qk_rope_head_dim,
         "RoPE rotates pairs of dims: use an even qk_rope_head_dim (DeepSeek-V3: 64)", "is odd")
    need(m.position_encoding == "rope", f"{prefix}.position_encoding", m.position_encoding,
         f"use rope with {prefix}.attention=mla", "is not built into MLA (its position is a RoPE key)")
    need(m.qk_norm == "none", f"{prefix}.qk_norm", m.qk_norm,
         f"set {prefix}.qk_norm=none with {prefix}.attention=mla, or use attention=gqa",
         "is a GQA option (MLA's projections are latents)")  # GQA's biases and sinks: validate_gpt_oss_pieces


def validate_groups(m, r, model_prefix: str = "model") -> None:
    """Group-limited routing needs groups that tile the experts and can hold the top_k choices."""
    groups, chosen, scored_by = r.num_groups, r.group_top_k, r.group_score_experts
    if groups is None:
        for key, value in (("group_top_k", chosen), ("group_score_experts", scored_by)):
            need(value is None, f"moe_opt.{key}", value, f"set moe_opt.num_groups too, or {key}=null",
                 "needs moe_opt.num_groups")
        return
    need(groups >= 1 and m.num_experts % groups == 0, "moe_opt.num_groups", groups,
         f"use a divisor of {model_prefix}.num_experts={m.num_experts}, or null for no groups",
         f"does not divide num_experts={m.num_experts}")
    need(chosen is not None and 1 <= chosen <= min(groups, m.top_k), "moe_opt.group_top_k", chosen,
         f"use 1 <= group_top_k <= min(num_groups={groups}, top_k={m.top_k})",
         "must pick between 1 group and as many groups as a token picks experts")
    per_group = m.num_experts // groups
    need(chosen * per_group >= m.top_k, "moe_opt.group_top_k", chosen,
         f"pick at least {-(-m.top_k // per_group)} groups of {per_group} experts for top_k={m.top_k}",
         f"leaves fewer than top_k={m.top_k} experts to choose from")
    need(scored_by is None or 1 <= scored_by <= per_group, "moe_opt.group_score_experts", scored_by,
         f"use 1 <= group_score_experts <= {per_group} (a group's experts), or null for top_k/group_top_k",
         "must sum between 1 score and all of a group's")


def validate_routing(r, prefix: str = "moe_opt") -> None:
    for key in ("capacity_factor", "eval_capacity_factor"):
        value = getattr(r, key)
        finite_number(f"{prefix}.{key}", value, "use a factor such as 1.25, or null for dropless routing")
        need(value is None or value > 0, f"{prefix}.{key}", value,
             "use a positive factor (1.0-2.0 is usual), or null for dropless routing",
             "must be positive or null")
    need(r.min_capacity >= 0, f"{prefix}.min_capacity", r.min_capacity, "use 0 or more",
         "must not be negative")
    one_of(f"{prefix}.drop_policy", r.drop_policy, DROP_POLICIES, "drop policy")
    for key in ("aux_loss_coeff", "z_loss_coeff"):
        value = getattr(r, key)
        finite_number(f"{prefix}.{key}", value, "use a coefficient such as 0.01, or 0 to turn the loss off")
        need(value >= 0, f"{prefix}.{key}", value, "use 0 or a positive coefficient", "must not be negative")
    jitter_fix = "use a value in [0, 1), e.g. 0.01; 0 turns jitter off"
    finite_number(f"{prefix}.jitter_eps", r.jitter_eps, jitter_fix)
    need(0 <= r.jitter_eps < 1, f"{prefix}.jitter_eps", r.jitter_eps, jitter_fix, "is outside [0, 1)")
    one_of(f"{prefix}.router_dtype", r.router_dtype, tuple(ROUTER_DTYPES), "router dtype (fp32 recommended)")
    one_of(f"{prefix}.aux_loss_group", r.aux_loss_group, AUX_LOSS_GROUPS, "load-balance group")
    one_of(f"{prefix}.load_balancing_type", r.load_balancing_type,
           LOAD_BALANCING_TYPES, "load-balancing type")
    one_of(f"{prefix}.score_function", r.score_function, SCORE_FUNCTIONS,
           "score function")
    scaling = r.topk_scaling_factor
    finite_number(f"{prefix}.topk_scaling_factor", scaling, "use a positive factor such as 2.5, or null")
    need(scaling is None or scaling > 0, f"{prefix}.topk_scaling_factor", scaling,
         "use a positive factor such as 2.5 (DeepSeek-V3), or null", "must be positive or null")
    rate = r.bias_update_rate
    finite_number(f"{prefix}.bias_update_rate", rate, "use a small positive rate such as 1e-3")
    need(rate >= 0, f"{prefix}.bias_update_rate", rate, "use a small positive rate such as 1e-3 (Megatron's "
         "default), or moe_opt.enable_expert_bias=false", "must not be negative")
