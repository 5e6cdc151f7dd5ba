"""Files that come from around a run, read so that a damaged one or one in another encoding is one paragraph.

A prompts file saved by a Windows editor (UTF-16), a config file with a YAML slip, an index or a summary
that a crash or an edit left half there: each reader here raises a UserError naming the field that pointed at
the file, the file, where in it the reader stopped (line and column, or the byte that is not UTF-8) and the
fix, instead of the decoder's or parser's traceback. The counterpart of moe/outputs.py (what it writes).
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

from moe.errors import UserError, first_line

# Byte-order marks of the encodings a UTF-8 reader cannot read (longest first: UTF-32's starts as UTF-16's).
BOMS = ((codecs.BOM_UTF32_LE, "UTF-32LE"), (codecs.BOM_UTF32_BE, "UTF-32BE"),
        (codecs.BOM_UTF16_LE, "UTF-16LE"), (codecs.BOM_UTF16_BE, "UTF-16BE"))


def wide_encoding(path: str | Path) -> tuple[str, str] | None:
    """(encoding, the name iconv reads it by) of a text file in UTF-16 or UTF-32, known by its byte-order mark
    or by the NUL bytes such a file of Latin text is full of; None for anything else."""
    with open(path, "rb") as f:
        head = f.read(4096)
    for bom, name in BOMS:
        if head.startswith(bom):
            return name, name[:-2]  # iconv -f UTF-16 reads the mark and drops it
    if len(head) >= 4 and head.count(0) * 4 >= len(head):  # a quarter NULs: no UTF-8 text looks like that
        name = "UTF-16LE" if head[1] == 0 else "UTF-16BE" if head[0] == 0 else "UTF-16"
        return name, name
    return None


def first_undecodable(path: str | Path) -> tuple[int, int, int] | None:
    """(line, column, byte) of the first byte of `path` that is not UTF-8 (1-based); None: it all decodes."""
    data = Path(path).read_bytes()
    try:
        data.decode("utf-8")
        return None
    except UnicodeDecodeError as err:
        line_start = data.rfind(b"\n", 0, err.start) + 1
        return data.count(b"\n", 0, err.start) + 1, err.start - line_start + 1, data[err.start]


def encoding_problem(path: str | Path) -> tuple[str, str]:
    """(what is wrong, how to convert) for a file that is not UTF-8."""
    path = Path(path)
    wide = wide_encoding(path)
    if wide:
        name, source = wide
        return (f"{path} is {name}, not UTF-8",
                f"convert it: iconv -f {source} -t UTF-8 {path} > {path}.utf8 && mv {path}.utf8 {path}")
    where = first_undecodable(path)
    at = f" (byte 0x{where[2]:02x} on line {where[0]}, column {where[1]})" if where else ""
    return (f"{path} is not UTF-8{at}",
            f"save it as UTF-8 (from Latin-1, say: iconv -f LATIN1 -t UTF-8 {path} > {path}.utf8 && "
            f"mv {path}.utf8 {path})")


def read_text(path: str | Path, field: str, value: object = None) -> str:
    """`path`'s text as UTF-8 (a UTF-8 byte-order mark dropped); a file in another encoding is a UserError
    naming `field`=`value` (default: the path), the encoding and how to convert it."""
    path = Path(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        problem, fix = encoding_problem(path)
        raise UserError(field, str(path) if value is None else value, fix,
                        problem=f"cannot be read: {problem}") from err


def position(err: BaseException) -> str:
    """Where a YAML or JSON parser stopped, as "line L, column C" (1-based); "" when it does not say."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)  # yaml: where it stopped
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}"
    if isinstance(err, json.JSONDecodeError):
        return f"line {err.lineno}, column {err.colno}"
    return ""


def parse_error(err: BaseException) -> str:
    """A YAML or JSON parser's complaint in one line, without the file name and position it repeats."""
    problem = getattr(err, "problem", None)
    if problem is not None:  # yaml's MarkedYAMLError: context ("while parsing a block mapping") + problem
        context, mark = getattr(err, "context", None), getattr(err, "context_mark", None)
        if context and mark is not None:
            context += f" at line {mark.line + 1}, column {mark.column + 1}"
        return f"{context}: {problem}" if context else str(problem)
    if isinstance(err, json.JSONDecodeError):
        return err.msg
    return first_line(err)


def damaged(field: str, value: object, path: str | Path, err: BaseException, fix: str,
            what: str = "") -> UserError:
    """A file that does not parse, as one paragraph: `field`=`value` names what pointed at it, then the file,
    the line and column, and the parser's complaint."""
    where = position(err)
    kind = what or ("YAML" if type(err).__module__.startswith("yaml") else "JSON")
    return UserError(field, value, fix, problem=f"cannot be read: {path} is not valid {kind}"
                     f"{' at ' + where if where else ''} ({parse_error(err)})")


def load_json(path: str | Path, field: str, value: object, fix: str) -> Any:
    """json.load of `path` (UTF-8); a damaged or foreign-encoded file as one paragraph (`damaged`)."""
    text = read_text(path, field, value)
    try:
        return json.loads(text)
    except ValueError as err:
        raise damaged(field, value, path, err, fix) from err


def load_yaml(path: str | Path, field: str, value: object, fix: str) -> Any:
    """yaml.safe_load of `path` (UTF-8); a damaged or foreign-encoded file as one paragraph (`damaged`)."""
    import yaml

    text = read_text(path, field, value)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise damaged(field, value, path, err, fix) from err
