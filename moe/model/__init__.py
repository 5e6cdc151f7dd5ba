"""The model: one decoder every backend trains (model.py), its attention (attention.py: GQA; mla.py:
latent attention), its MoE layer (moe.py), the dense MLP (mlp.py), routing maths (routing.py), token
dispatch (dispatcher.py) and the training objective (loss.py). Sizes are config facts (moe/config/size.py);
Hugging Face adapters live in moe/hf/."""
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
