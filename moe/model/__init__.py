"""The model: one decoder every backend trains (model.py), its attention (attention.py: GQA; mla.py:
latent attention), its MoE layer (moe.py), routing maths (routing.py), token dispatch (dispatch.py),
the training objective (loss.py), sizes (size.py) and Hugging Face adapters (hf.py, hf_deepseek.py)."""
from moe.model.model import (
    Attention,
    Block,
    KVCache,
    MLAttention,
    ModelOutput,
    MoETransformer,
    RMSNorm,
    SwiGLU,
    alibi_slopes,
    apply_rope,
    attention_mask,
    rope_cos_sin,
)

__all__ = ["Attention", "Block", "KVCache", "MLAttention", "ModelOutput", "MoETransformer", "RMSNorm",
           "SwiGLU", "alibi_slopes", "apply_rope", "attention_mask", "rope_cos_sin"]
