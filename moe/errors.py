"""User-facing errors: one paragraph naming the field, the value and the fix.

Entry points catch `UserError` and exit non-zero without a traceback, so a bad
config or a missing file reads like advice rather than a crash.
"""
from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """Something the user can fix: names what is wrong, the value seen and the fix."""

    def __init__(self, field: str, value: object, fix: str, problem: str = "is invalid"):
        self.field, self.value, self.fix, self.problem = field, value, fix, problem
        super().__init__(f"{field}={value!r} {problem}. Fix: {fix}")


class ConfigError(UserError, ValueError):
    """A config value that cannot work; also a ValueError so model code can raise it."""


def exit_on_user_error(main):
    """Wrap an entry point: a UserError prints one paragraph to stderr and exits 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    return wrapper
