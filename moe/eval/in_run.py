"""In-run evaluation (`trainer.eval_every_n_steps`): lm_eval tasks on the model a run trains, after every N-th
optimizer step, through the same adapter as `python -m moe.eval` (moe.eval.lm.MoELM) on the module's own
model, as `eval/<task>/<metric>` (the metric named as eval.json names it).

Training is the same with it as without, step for step: the evaluation runs between two steps, under no_grad,
with every random generator it could draw from (Python's, NumPy's, torch's on the CPU and on each CUDA device)
saved before and restored after, the model back in the mode it was in and its MoE layers' monitors as they
were; it never touches the training data. Every rank evaluates its own whole replica (config rule
check_in_run_eval: the ddp strategy without tp/pp/ep), so no rank waits on another and all get the same
numbers; rank 0 writes them (moe.train.metrics.RunMetrics).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from moe.eval import EVAL_PREFIX
from moe.parallel.apply import moe_layers


def metric_key(task: str, metric: str) -> str:
    return f"{EVAL_PREFIX}{task}/{metric}"


@contextlib.contextmanager
def rng_kept():
    """Every global random generator as it was on entry, whatever the body draws or seeds."""
    python, numpy_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def model_kept(model: torch.nn.Module):
    """The model's train/eval mode and its MoE layers' monitor flags as they were on entry."""
    training = model.training
    monitors = [(layer, layer.monitor) for layer in moe_layers(model)]
    try:
        yield
    finally:
        model.train(training)
        for layer, monitor in monitors:
            layer.monitor = monitor


@contextlib.contextmanager
def quiet():
    """lm_eval's INFO lines and progress bars (tqdm, on stderr: lm_eval turns them off only off rank 0) kept
    out of the run's console; the run says the numbers in one line. Its warnings still reach the log."""
    lm_eval_log = logging.getLogger("lm_eval")
    level = lm_eval_log.level
    lm_eval_log.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        lm_eval_log.setLevel(level)


@contextlib.contextmanager
def results_on_every_rank():
    """lm_eval returns results only where LOCAL_RANK is 0 (lm_eval/evaluator.py:385, for tensor-parallel
    launches where every rank reports lm.rank 0); here each rank evaluates a whole replica of its own, so
    each is its rank 0 meanwhile."""
    local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        if local_rank is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = local_rank


class InRunEval:
    """The tasks of `trainer` (TrainConfig.trainer's eval_* keys) on the run's model, read with the tokenizer
    in `tokenizer_dir` (the one the run's data was made with). Built before training starts, so a task name
    that is not there or a missing lm_eval is refused before the first step."""

    def __init__(self, trainer, tokenizer_dir: str | Path, seed: int):
        from moe.data.tokenizer import load_hf_tokenizer
        from moe.eval.command import import_lm_eval
        from moe.eval.tasks import check_names, task_manager

        import_lm_eval()
        self.every = trainer.eval_every_n_steps
        self.tasks = list(trainer.eval_tasks)
        self.limit, self.batch_size, self.seed = trainer.eval_limit, trainer.eval_batch_size, seed
        self.manager = task_manager(list(trainer.eval_task_dirs))
        check_names(self.manager, self.tasks, list(trainer.eval_task_dirs))
        self.tokenizer = load_hf_tokenizer(tokenizer_dir, field="data.tokenizer")

    def due(self, step: int) -> bool:
        """Whether the evaluation runs after optimizer step `step` (1-based)."""
        return step % self.every == 0

    def __call__(self, module, trainer) -> tuple[dict[str, float], float]:
        """({eval/<task>/<metric>: value}, seconds) of the module's model as it is now."""
        from moe.eval.command import evaluate_tasks, task_summary
        from moe.eval.lm import MoELM

        started = time.perf_counter()
        model = module.model
        with rng_kept(), model_kept(model), quiet(), results_on_every_rank(), torch.no_grad(), \
                trainer.precision_plugin.forward_context():
            eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
            lm = MoELM(model, self.tokenizer, batch_size=self.batch_size, eos_ids=eos, seed=self.seed,
                       arrange_experts=False)  # the training model's parameters stay as training holds them
            results = evaluate_tasks(lm, self.manager, self.tasks, num_fewshot=None, limit=self.limit,
                                     seed=self.seed)
        values = {metric_key(task, metric): float(value)
                  for task, row in task_summary(results).items() for metric, value in row.items()
                  if metric != "samples" and not metric.endswith("_stderr") and value is not None}
        return values, time.perf_counter() - started
