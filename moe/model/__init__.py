"""The model: one decoder every backend trains (model.py), its MoE layer (moe.py), routing maths
(routing.py), token dispatch (dispatch.py), the training objective (loss.py), sizes (size.py) and
Hugging Face state-dict adapters (hf.py)."""
from moe.model.model import (
    Attention,
    Block,
    KVCache,
    ModelOutput,
    MoETransformer,
    RMSNorm,
    SwiGLU,
    alibi_slopes,
    apply_rope,
    attention_mask,
    rope_cos_sin,
)

__all__ = ["Attention", "Block", "KVCache", "ModelOutput", "MoETransformer", "RMSNorm", "SwiGLU",
           "alibi_slopes", "apply_rope", "attention_mask", "rope_cos_sin"]
