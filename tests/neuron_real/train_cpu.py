"""`python train.py ARGS` with neuronx-distributed in CPU mode: the harness patches (cpu_mode.py), then
train.py itself, unchanged, under torchrun (NxD's Lightning strategy takes ranks from its env)."""

import runpy
import sys
from pathlib import Path

import cpu_mode  # noqa: F401

TRAIN = Path(__file__).resolve().parents[2] / "train.py"
sys.argv = [str(TRAIN), *sys.argv[1:]]
runpy.run_path(str(TRAIN), run_name="__main__")
