"""The choices a config key takes, as types: each a `Literal`, which the schema's field declares
(`Annotated[str, Literal[...]]`: OmegaConf composes it as a str, moe.config.settled checks the run-time value
against it) and whose values the rules check and the messages list (the tuples below, derived, never
restated).

Import-light on purpose (no torch, no backend specs): the model reads ROUTER_DTYPES, infer INFER_DTYPES.
"""
from __future__ import annotations

from typing import Literal, get_args

AcPolicy = Literal["none", "selective", "full", "every_n", "moe_only"]
DropPolicy = Literal["probs", "position"]
RouterDtype = Literal["fp32", "bf16", "fp16"]
PositionEncoding = Literal["rope", "alibi"]
RopeType = Literal["default", "linear", "llama3", "yarn"]  # transformers' rope_type names
Attention = Literal["gqa", "mla"]
QKNorm = Literal["none", "per_head", "full"]  # RMSNorm of queries and keys before RoPE
AuxLossGroup = Literal["ep", "dp"]
LoadBalancingType = Literal["aux_loss", "seq_aux_loss", "none"]
ScoreFunction = Literal["softmax", "sigmoid"]
ExpertActivation = Literal["swiglu", "clamped_swiglu"]
AttentionLayerType = Literal["sliding_attention", "full_attention"]
NeuronPrecision = Literal["auto", "bf16_sr", "mixed", "fp32"]  # auto: moe.config.derived.neuron_precision
SpikeAction = Literal["warn", "skip", "rollback"]
DataKind = Literal["prepared", "online"]
DataFormat = Literal["text", "chat", "sentence"]
Packing = Literal["concat", "pad"]
BadRowPolicy = Literal["error", "skip", "repair"]
InferDtype = Literal["auto", "fp32", "bf16", "fp16"]
# the lm_eval tasks bundled in moe/eval/bundled: the default of python -m moe.eval and of in-run evaluation
BUNDLED_EVAL_TASKS = ("moe_tiny_mc", "moe_tiny_cloze")

__all__ = [  # the types and their values
    "ATTENTION_LAYER_TYPES", "EXPERT_ACTIVATIONS", "AttentionLayerType", "ExpertActivation",
    "AC_POLICIES", "ATTENTIONS", "AUX_LOSS_GROUPS", "BAD_ROW_POLICIES", "BUNDLED_EVAL_TASKS", "DATA_FORMATS",
    "DATA_KINDS",
    "DROP_POLICIES", "INFER_DTYPES", "LOAD_BALANCING_TYPES", "MLA_DIMS", "NEURON_PRECISIONS", "PACKINGS",
    "POSITION_ENCODINGS", "QK_NORMS", "ROPE_TYPES", "ROUTER_DTYPES", "SCORE_FUNCTIONS", "SPIKE_ACTIONS",
    "AcPolicy", "Attention", "AuxLossGroup", "BadRowPolicy", "DataFormat", "DataKind", "DropPolicy",
    "InferDtype", "LoadBalancingType", "NeuronPrecision", "Packing", "PositionEncoding", "QKNorm", "RopeType",
    "RouterDtype", "ScoreFunction", "SpikeAction",
]

AC_POLICIES = get_args(AcPolicy)
DROP_POLICIES = get_args(DropPolicy)
# name -> torch attribute
ROUTER_DTYPES = dict(zip(get_args(RouterDtype), ("float32", "bfloat16", "float16"), strict=True))
POSITION_ENCODINGS = get_args(PositionEncoding)
ROPE_TYPES = get_args(RopeType)
ATTENTIONS = get_args(Attention)
QK_NORMS = get_args(QKNorm)
MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # required by mla
AUX_LOSS_GROUPS = get_args(AuxLossGroup)
LOAD_BALANCING_TYPES = get_args(LoadBalancingType)
SCORE_FUNCTIONS = get_args(ScoreFunction)
EXPERT_ACTIVATIONS = get_args(ExpertActivation)
ATTENTION_LAYER_TYPES = get_args(AttentionLayerType)
NEURON_PRECISIONS = get_args(NeuronPrecision)
SPIKE_ACTIONS = get_args(SpikeAction)
DATA_KINDS = get_args(DataKind)
DATA_FORMATS = get_args(DataFormat)
PACKINGS = get_args(Packing)
BAD_ROW_POLICIES = get_args(BadRowPolicy)
# besides auto: name -> torch attribute
INFER_DTYPES = dict(zip(get_args(InferDtype)[1:], ("float32", "bfloat16", "float16"), strict=True))
