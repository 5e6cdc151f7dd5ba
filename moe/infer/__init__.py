"""Inference: load a checkpoint or a Mixtral / DeepSeek-V3 directory, generate, export."""
