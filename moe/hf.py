"""Kept import path: Hugging Face interop lives in moe/model/hf.py (Mixtral) and moe/model/upcycle.py
(dense Mistral/Llama -> MoE)."""
from moe.model.hf import from_hf, model_config_from_hf, moe_opt_from_hf, to_hf
from moe.model.upcycle import upcycle

__all__ = ["from_hf", "model_config_from_hf", "moe_opt_from_hf", "to_hf", "upcycle"]
