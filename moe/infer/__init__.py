"""Inference: load a checkpoint or a Mixtral directory, generate, export."""
