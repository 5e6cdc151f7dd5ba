"""Trainium 1 (hardware=trn1) through neuronx-distributed v2.28.0: its spec (spec.py), its library's refusals
(rules.py) and what the machine needs (accelerator.py), all readable without NxD or torch; its Backend
(backend.py) and everything it builds with NxD, imported only when a run builds it."""
