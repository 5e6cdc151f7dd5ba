"""User-facing errors: one paragraph naming the field, the value and the fix.

Entry points catch `UserError` and exit 2 without a traceback, so a bad config or a missing
file reads like advice rather than a crash; the paragraph (or an unexpected traceback) is also
written to the run's train.log.
"""
from __future__ import annotations

import functools
import logging
import sys


class UserError(Exception):
    """Something the user can fix: names what is wrong, the value seen and the fix."""

    def __init__(self, field: str, value: object, fix: str, problem: str = "is invalid"):
        self.field, self.value, self.fix, self.problem = field, value, fix, problem
        super().__init__(f"{field}={value!r} {problem}. Fix: {fix}")


class ConfigError(UserError, ValueError):
    """A config value that cannot work; also a ValueError so model code can raise it."""


def did_you_mean(word: str, options) -> str | None:
    """The option closest to a misspelt `word` ("max_stesp" -> "max_steps"), or None when none is close."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return close[0] if close else None


def first_line(err: BaseException, limit: int = 200) -> str:
    """An exception's first line (its type's name when it has no text), for a one-paragraph message."""
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:limit]


COLLECTIVE_FAILED_EXIT = 3  # a peer rank died or stalled: retryable (moe.tools.supervise relaunches)


class CollectiveFailed(Exception):
    """A collective this rank waited in failed: a peer died (its connection closed) or stalled beyond
    parallel.collective_timeout_s. Not the user's to fix, and nothing is half-written: relaunching the
    same command resumes from the newest good checkpoint."""

    def __init__(self, rank: int, collective: str, cause: BaseException):
        self.rank, self.collective = rank, collective
        super().__init__(f"rank {rank} stopped in {collective}: {first_line(cause, 240)}")


def exit_on_user_error(main):
    """Wrap an entry point: a UserError prints one paragraph to stderr and exits 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            log_to_files(f"error: {err}")
            sys.exit(2)
        except Exception:
            log_to_files("the run stopped on an unexpected error", exc_info=sys.exc_info())
            raise

    return wrapper


def log_to_files(message: str, level: int = logging.ERROR, exc_info=None) -> None:
    """A message the console has already shown, into the log files of the root logger (Hydra's
    `<run dir>/train.log`), so the file keeps the whole story."""
    record = logging.LogRecord("moe", level, __file__, 0, message, None, exc_info)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
