"""The torch-native backend, FSDP2 + DTensor TP + EP on one mesh (hardware=gpu_fsdp2, trn2, cpu_fsdp2): its
spec (spec.py), its library's refusals (rules.py) and its Backend (backend.py, imported only when a run
builds it)."""
