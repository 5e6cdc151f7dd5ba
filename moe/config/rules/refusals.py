"""The three ways a rule refuses a value (one paragraph: field, value, problem, fix), and seeds."""
from __future__ import annotations

import math

from moe.errors import ConfigError


def need(ok: bool, field: str, value, fix: str, problem: str = "is invalid") -> None:
    if not ok:
        raise ConfigError(field, value, fix, problem=problem)


def finite_number(field: str, value, fix: str) -> None:
    need(value is None or math.isfinite(value), field, value, fix, "is not a finite number")


def one_of(field: str, value, choices, what: str) -> None:
    need(value in choices, field, value, f"use one of {', '.join(choices)}", f"is not a known {what}")


SEED_RANGE = (0, 2**32 - 1)  # what numpy's generators (and Lightning's seed_everything) accept


def check_seed(field: str, value) -> None:
    low, high = SEED_RANGE
    need(isinstance(value, int) and low <= value <= high, field, value,
         f"use a whole number from {low} to {high}", "is not a seed numpy accepts")
