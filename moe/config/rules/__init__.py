"""Every rule of the three configs, by what it governs: the model (rules/architecture.py), the parallel
layout (rules/layout.py), each backend (rules/backends.py), the rest of a run (rules/training.py),
data_prep and infer (rules/entries.py); the ways a rule refuses a value (rules/refusals.py).
moe.config.validate holds the ordered table train.py runs."""
