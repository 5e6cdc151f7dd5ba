"""DeepSpeed ZeRO-1/2 with expert parallelism (hardware=gpu, cpu_deepspeed): its spec (spec.py) and its
Backend (backend.py, which imports deepspeed, only when a run builds it)."""
