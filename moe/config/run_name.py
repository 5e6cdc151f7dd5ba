"""The default run name: the launch time, or the SLURM batch job's name and id.

Under `srun` every task composes its own config, a second or more apart, so a timestamp would give
each its own run dir; and a requeued job (pre-emption, `scontrol requeue`) must find the checkpoints
of its first start. A batch job's id is the same for every task and across requeues, so inside one
the default is `<job name>-<job id>` (`<job name>-<array job id>_<task id>` in an array). Interactive
allocations (`salloc`, `srun --pty bash`: job name `bash` or `interactive`, as Lightning's
SLURMEnvironment tells them apart) keep the timestamp, so two runs typed there do not share a dir.
"""
from __future__ import annotations

import os
import re
from datetime import datetime

from omegaconf import OmegaConf

INTERACTIVE_JOB_NAMES = ("bash", "interactive")


def default_run_name() -> str:
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    name = os.environ.get("SLURM_JOB_NAME", "")
    if not job or name in INTERACTIVE_JOB_NAMES:
        return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    if os.environ.get("SLURM_ARRAY_JOB_ID") and "SLURM_ARRAY_TASK_ID" in os.environ:
        job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', name) or 'slurm'}-{job}"


def register_run_name_resolver() -> None:
    """`${default_run_name:}` in train_schema's run_name; resolved once per process (Hydra's run dir)."""
    if not OmegaConf.has_resolver("default_run_name"):
        OmegaConf.register_new_resolver("default_run_name", default_run_name, use_cache=True)
