"""The default run name: the experiment's, the same for every rank, node and relaunch of one launch.

A launch is one run whoever launches it: torchrun (its own restarts), a Kubeflow PyTorchJob's pod restarts,
SLURM (every task, a requeue), Lightning's own launcher, moe.supervise, or the same command typed again.
So the default name is not the time a process started but a function of what every process of the launch
composes alike: `<model.name>-<digest>`, the digest of the experiment's keys (moe.config.contract: the
fixed and steered keys, the model, the data, the seed, the optimizer, the routing; not the hardware, the
layout, max_steps or logging). Relaunching the same experiment continues its run; changing it starts
another. Inside a SLURM batch job the job's name and id come first, `<job name>-<job id>-<digest>`
(`<job name>-<array job id>_<task id>-<digest>` in an array): a new submission starts a new run, a
requeued job finds its own. Interactive allocations (`salloc`, `srun --pty bash`: job name `bash` or
`interactive`, as Lightning's SLURMEnvironment tells them apart) name runs as outside SLURM.
"""
from __future__ import annotations

import os
import re

from omegaconf import DictConfig, OmegaConf

from moe.config.contract import experiment_digest, schema_defaults

INTERACTIVE_JOB_NAMES = ("bash", "interactive")
EXPERIMENT_SECTIONS = ("model", "moe_opt", "optimizer", "data", "seed")


def slurm_job() -> str | None:
    """`<job name>-<job id>` of the SLURM batch job this process runs in, else None."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    name = os.environ.get("SLURM_JOB_NAME", "")
    if not job or name in INTERACTIVE_JOB_NAMES:
        return None
    if os.environ.get("SLURM_ARRAY_JOB_ID") and "SLURM_ARRAY_TASK_ID" in os.environ:
        job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return f"{_safe(name) or 'slurm'}-{job}"


def default_run_name(_root_: DictConfig) -> str:
    """`${default_run_name:}`: the name of the experiment `_root_` (the composed config) describes."""
    values = {key: OmegaConf.to_container(_root_[key], resolve=True) if OmegaConf.is_config(_root_[key])
              else _root_[key] for key in EXPERIMENT_SECTIONS}
    digest = experiment_digest(values, schema_defaults(OmegaConf.get_type(_root_)))
    return f"{slurm_job() or _safe(str(values['model']['name'])) or 'run'}-{digest}"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def register_run_name_resolver() -> None:
    """`${default_run_name:}` in train_schema's run_name, resolved from the config it sits in (not cached:
    one process may compose several experiments, a sweep's or a test's)."""
    if not OmegaConf.has_resolver("default_run_name"):
        OmegaConf.register_new_resolver("default_run_name", default_run_name, use_cache=False)
