"""Training: the run (run.py), the LightningModule (module.py), optimizer, metrics, guard, checkpoints."""
