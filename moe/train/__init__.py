"""Training: what train.py runs, around the LightningModule (moe/module/) and the backends (moe/backends/).

    preflight.py      train.py's checks before Hydra writes anything; run.py settles the config and trains
    environment.py    what the machine must offer (packages, CUDA, keys)
    callbacks.py      the run's callbacks and loggers: metrics.py (metrics.csv, summary.json), guard.py (the
                      loss-spike guard), step_checkpoint.py, preemption.py, seed.py (per-micro-batch seeds)
    console.py        what a run prints; run_lock.py one live run per run dir
"""
