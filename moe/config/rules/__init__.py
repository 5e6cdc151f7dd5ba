"""Every rule of the three configs, by what it governs: the model (rules/model.py), the parallel layout
(rules/layout.py), each backend (rules/backends.py), the rest of a run (rules/run.py), data_prep and infer
(rules/entries.py). moe.config.validate holds the ordered table train.py runs."""
