"""Evaluation: lm-evaluation-harness tasks (local files only) and held-out perplexity on our own model, on a
checkpoint (`python -m moe.eval`, moe.eval.command) or in the run (trainer.eval_every_n_steps,
moe.eval.in_run)."""

# metrics.csv's columns and the loggers' keys of in-run evaluation, eval/<task>/<metric>: here, import-free,
# for the report that reads them
EVAL_PREFIX = "eval/"
