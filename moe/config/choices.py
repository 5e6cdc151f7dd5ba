"""The choices a config key takes, by name: what the rules check a value against and what the code reads.

Import-light on purpose (no torch, no backend specs): the model reads ROUTER_DTYPES, infer INFER_DTYPES.
"""
from __future__ import annotations

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
