"""moe: training Mixture-of-Experts language models with Lightning and Hydra."""
__version__ = "0.1.0"
