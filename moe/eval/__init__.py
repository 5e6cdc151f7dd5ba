"""Evaluation: lm-evaluation-harness tasks (local files only) and held-out perplexity on our own model."""
