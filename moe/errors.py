"""User-facing errors: one paragraph naming the field, the value and the fix.

Entry points catch `UserError` and exit 2 without a traceback, so a bad config or a missing
file reads like advice rather than a crash; the paragraph (or an unexpected traceback) is also
written to the run's train.log.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import signal
import sys
from pathlib import Path


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


# The file system refused a write: a full disk or quota, a file-size limit, a read-only or forbidden place.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


def write_errno(err: BaseException) -> int | None:
    """The errno of a refused write, from an OSError or from the text a library wrapped it in (pyarrow's
    IOError without errno, safetensors' "File too large (os error 27)"); None for anything else."""
    number = getattr(err, "errno", None)
    if number is None:
        found = re.search(r"os error (\d+)|code: (\d+)", str(err))
        number = int(found.group(1) or found.group(2)) if found else None
        if number is None:
            number = next((e for e in WRITE_ERRNOS if os.strerror(e) in str(err)), None)
    return number if number in WRITE_ERRNOS else None


class WriteFailed(UserError):
    """The file system refused a write (moe.errors.write_failed): its field names a path, not a config key."""


def write_failed(path: str | Path, err: BaseException, field: str = "file", cleaned: str = "") -> WriteFailed:
    """A refused write as one paragraph: the path, the errno and the fix. Exit 2, not 3: the user must make
    room (or point the run elsewhere) before a relaunch can do better, so a supervisor must not retry it.
    `cleaned` says what was removed so that nothing half-written remains."""
    number = write_errno(err) or getattr(err, "errno", None)
    reason = os.strerror(number) if number else first_line(err)
    name = errno.errorcode.get(number, "") if number else ""
    where = Path(path).parent if str(path) else Path(".")
    fix = (f"free space or fix permissions under {where} (df -h {where}; ls -ld {where}), or write elsewhere "
           "(a run: hydra.run.dir=...), then relaunch the same command: a run resumes from its newest "
           "complete checkpoint")
    return WriteFailed(field, str(path), fix,
                       problem=f"could not be written ({reason}{': ' + name if name else ''})"
                               f"{'; ' + cleaned if cleaned else ''}")


COLLECTIVE_FAILED_EXIT = 3  # a peer rank died or stalled: retryable (moe.tools.supervise relaunches)


class CollectiveFailed(Exception):
    """A collective this rank waited in failed: a peer died (its connection closed) or stalled beyond
    parallel.collective_timeout_s. Not the user's to fix, and nothing is half-written: relaunching the
    same command resumes from the newest good checkpoint."""

    def __init__(self, rank: int, collective: str, cause: BaseException):
        self.rank, self.collective = rank, collective
        super().__init__(f"rank {rank} stopped in {collective}: {first_line(cause, 240)}")


INTERRUPTED_EXIT = 130  # 128 + SIGINT: what a shell reports for Ctrl-C, and what train.py exits with
INTERRUPTED_DEFAULT = ("stopped before it finished; nothing was left half-written (every file is written "
                       "under a temporary name and renamed into place)")


@contextlib.contextmanager
def on_interrupt(left: str):
    """A Ctrl-C while the block runs ends the command with one line saying `left`: what it leaves behind and
    what was cleaned ("output=DIR was not written: its temporary directory was removed"). The innermost
    block's words win; exit_on_user_error prints them."""
    try:
        yield
    except KeyboardInterrupt as err:
        if not hasattr(err, "left"):
            err.left = left
        raise


def interrupted(err: KeyboardInterrupt) -> str:
    """The one line a command stopped by Ctrl-C ends with (exit 130, as train.py's)."""
    return f"interrupted (Ctrl-C): {getattr(err, 'left', INTERRUPTED_DEFAULT)}"


def _stop_at_once(signum, frame) -> None:
    os.write(2, b"second Ctrl-C: stopping now\n")
    os._exit(INTERRUPTED_EXIT)


def exit_on_user_error(main):
    """Wrap an entry point: a UserError prints one paragraph to stderr and exits 2; Ctrl-C (KeyboardInterrupt)
    prints one line (`interrupted (Ctrl-C): <what is left>`, see on_interrupt) and exits 130; a second Ctrl-C
    while the process ends stops it at once."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt as err:
            with contextlib.suppress(ValueError):  # not the main thread: Python delivers signals to it only
                signal.signal(signal.SIGINT, _stop_at_once)
            line = interrupted(err)
            print(line, file=sys.stderr, flush=True)
            log_to_files(line, level=logging.WARNING)
            sys.exit(INTERRUPTED_EXIT)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            log_to_files(f"error: {err}")
            sys.exit(2)
        except OSError as err:
            if write_errno(err) is None:
                log_to_files("the run stopped on an unexpected error", exc_info=sys.exc_info())
                raise
            message = write_failed(err.filename2 or err.filename or "", err)  # a copy's target is filename2
            print(f"error: {message}", file=sys.stderr)
            log_to_files(f"error: {message}")
            sys.exit(2)
        except Exception:
            log_to_files("the run stopped on an unexpected error", exc_info=sys.exc_info())
            raise

    return wrapper


def describe_exit(code: int) -> str:
    """A process's return code in words: "exit code 3", "killed by SIGKILL"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def log_to_files(message: str, level: int = logging.ERROR, exc_info=None) -> None:
    """A message the console has already shown, into the log files of the root logger (Hydra's
    `<run dir>/train.log`), so the file keeps the whole story."""
    record = logging.LogRecord("moe", level, __file__, 0, message, None, exc_info)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            try:
                handler.handle(record)
            except (OSError, UserError):  # the log file is what could not be written: the console said it
                pass


def stop_when_a_log_file_cannot_be_written() -> None:
    """The root logger's files (Hydra's `<run dir>/train.log`) raise when the disk refuses a line, instead of
    logging's default of printing "--- Logging error ---" with a traceback on every record and going on."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handleError = functools.partial(_raise_log_write_error, handler)


def _raise_log_write_error(handler: logging.FileHandler, record: logging.LogRecord) -> None:
    err = sys.exc_info()[1]
    if err is not None and write_errno(err) is not None:
        raise write_failed(handler.baseFilename, err) from err
    logging.FileHandler.handleError(handler, record)
