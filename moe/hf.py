"""Kept import path: Hugging Face Mixtral interop lives in moe/model/hf.py."""
from moe.model.hf import from_hf, model_config_from_hf, moe_opt_from_hf, to_hf

__all__ = ["from_hf", "model_config_from_hf", "moe_opt_from_hf", "to_hf"]
