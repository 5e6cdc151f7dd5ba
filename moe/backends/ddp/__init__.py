"""Plain PyTorch DDP (hardware=cpu, gpu_ddp...): its spec (spec.py) and its Backend (backend.py, imported only
when a run builds it)."""
