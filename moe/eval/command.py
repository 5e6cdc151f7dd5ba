"""What `python -m moe.eval` does: load a model as infer.py does, run lm_eval tasks on it through moe.eval.lm
and score a held-out text file, print one table, write eval.json atomically.

Everything a user can get wrong (a task name lm_eval would download, a missing file, an output it cannot
write) is refused before the model loads.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from omegaconf import OmegaConf

from moe.config.infer import InferConfig
from moe.config.rules.entries import validate_eval
from moe.errors import UserError, on_interrupt
from moe.eval.tasks import check_names, stay_offline, task_manager
from moe.outputs import atomic_path

EVAL_FILE = "eval.json"
BOOTSTRAP_ITERS = 1000  # resamples for the stderr of metrics without a closed form (perplexity)
MODEL_KEYS = ("ckpt", "hf_dir", "runs_dir", "tokenizer", "device", "dtype", "allow_pickle")  # infer.py's


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint (file or sharded directory) lies in: <run>/checkpoints/<name>."""
    checkpoint = checkpoint.resolve()
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None


def output_path(cfg, checkpoint: Path | None) -> Path | None:
    """Where eval.json goes: output=, else the checkpoint's run dir; None: the console only."""
    if cfg.output:
        path = Path(cfg.output).expanduser()
    else:
        run_dir = run_dir_of(checkpoint) if checkpoint is not None else None
        path = run_dir / EVAL_FILE if run_dir is not None else None
    if path is None:
        return None
    if path.is_dir():
        raise UserError("output", cfg.output, f"name a file, e.g. {path / EVAL_FILE}",
                        problem="is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError("output", str(path), "pick a path this user can write",
                        problem=f"cannot be written: no directory for it ({err.strerror})") from err
    if not os.access(path.parent, os.W_OK):
        raise UserError("output", str(path), "pick a path this user can write",
                        problem="cannot be written (no write permission)")
    return path


def task_summary(results: dict) -> dict:
    """lm_eval's results as {task: {metric: value, metric_stderr: value, samples: n}} (the `none` filter's
    metrics under their own names, another filter's as `metric,filter`)."""
    summary = {}
    for task, metrics in results["results"].items():
        row = {}
        for key, value in metrics.items():
            if "," not in key:
                continue
            metric, kept = key.split(",", 1)
            row[metric if kept == "none" else key] = value if isinstance(value, (int, float)) else None
        samples = results.get("n-samples", {}).get(task)
        if samples:
            row["samples"] = samples["effective"]
        summary[task] = row
    return summary


def evaluate_tasks(lm, manager, tasks: list[str], *, num_fewshot: int | None, limit: int | None,
                   seed: int) -> dict:
    """lm_eval's simple_evaluate on `lm` (an LM object: no model of lm_eval's is built)."""
    from lm_eval.evaluator import simple_evaluate

    return simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                           bootstrap_iters=BOOTSTRAP_ITERS, log_samples=False, task_manager=manager,
                           random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                           fewshot_random_seed=seed)


def import_lm_eval():
    """lm_eval, offline (nothing it runs may reach the network), or the fix when it is not installed."""
    stay_offline()  # before lm_eval (and so datasets) is imported
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # lm_eval's bootstrap stderr: in this process, no pool
    try:
        import lm_eval
    except ImportError as err:
        raise UserError("lm_eval", "not installed", "pip install -c constraints.txt -e '.[eval]' (make setup "
                        "installs it)", problem="is needed by evaluation (python -m moe.eval, "
                        "trainer.eval_every_n_steps)") from err
    return lm_eval


def run(cfg) -> dict:
    """python -m moe.eval: returns what eval.json holds (also written where output_path says, and printed)."""
    lm_eval = import_lm_eval()
    from lm_eval.utils import make_table

    from moe.checkpoint.trust import set_allow_pickle
    from moe.eval.lm import MoELM
    from moe.eval.perplexity import perplexity, read_documents
    from moe.infer.command import load

    validate_eval(cfg)
    set_allow_pickle(cfg.allow_pickle)
    documents = read_documents(cfg.perplexity_file) if cfg.perplexity_file else None
    manager = task_manager(list(cfg.task_dirs)) if cfg.tasks else None
    if manager is not None:
        check_names(manager, list(cfg.tasks), list(cfg.task_dirs))
    elif documents is None:
        raise UserError("tasks", [], "name a task (e.g. tasks=[moe_tiny_mc]) or pass perplexity_file=FILE",
                        problem="is empty and there is no perplexity_file: nothing to evaluate")
    source = {k: cfg[k] for k in MODEL_KEYS}
    checkpoint = None
    if cfg.ckpt and not cfg.hf_dir:
        from moe.infer.load import resolve_checkpoint

        checkpoint = resolve_checkpoint(cfg.ckpt, cfg.runs_dir)
        source["ckpt"] = str(checkpoint)
    out = output_path(cfg, checkpoint)
    loaded = load(OmegaConf.merge(OmegaConf.structured(InferConfig), source))
    lm = MoELM(loaded.model, loaded.tokenizer, batch_size=cfg.batch_size, max_length=cfg.max_length,
               eos_ids=loaded.eos_ids, seed=cfg.seed)
    started = time.perf_counter()
    param = next(loaded.model.parameters())
    record = {"model": loaded.source, "tokenizer": str(loaded.tokenizer_dir), "device": str(param.device),
              "dtype": str(param.dtype).removeprefix("torch."), "max_length": lm.max_length,
              "lm_eval_version": lm_eval.__version__, "limit": cfg.limit, "tasks": {}}
    with on_interrupt("evaluation stopped; eval.json was not written" if out else "evaluation stopped"):
        if manager is not None:
            results = evaluate_tasks(lm, manager, cfg.tasks, num_fewshot=cfg.num_fewshot, limit=cfg.limit,
                                     seed=cfg.seed)
            record["tasks"] = task_summary(results)
            record["num_fewshot"] = results.get("n-shot", {})
            print(make_table(results))
            if results.get("groups"):
                print(make_table(results, "groups"))
        if documents is not None:
            record["perplexity"] = {"file": str(cfg.perplexity_file), **perplexity(lm, documents)}
            p = record["perplexity"]
            print(f"perplexity_file={cfg.perplexity_file}: {p['documents']} documents, {p['tokens']} tokens, "
                  f"loss {p['loss']:.4f}, perplexity {p['perplexity']:.3f}, word perplexity "
                  f"{p['word_perplexity']:.3f}, {p['bits_per_byte']:.4f} bits per byte")
    record["seconds"] = round(time.perf_counter() - started, 3)
    if out is not None:
        with atomic_path(out) as tmp:
            tmp.write_text(json.dumps(record, indent=2) + "\n")
        print(f"results -> {out}")
    else:
        print("results not written: the model is not in a run directory; pass output=FILE to keep them")
    return record
