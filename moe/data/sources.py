"""Input specs -> one `datasets.Dataset` of raw rows.

An input is a file, a glob, a directory of raw files, a directory written by
`datasets.save_to_disk`, a list of those, or a Hugging Face Hub name (only when the
hub is reachable; offline, a clear error says to pass a local path). Files are read
by the `datasets` builders (json, csv, parquet, text). Line-based files (json lines, csv/tsv,
text) are first checked byte by byte: pyarrow's JSON reader accepts bytes that are not UTF-8
inside a string and the row then breaks tokenization, so each file is decoded in one fast pass
and, when that fails, line by line. A line with undecodable bytes is reported (file and line), or
with `on_bad_row=skip` dropped, with `on_bad_row=repair` kept with those bytes replaced by U+FFFD;
either way counted. Broken JSON lines are reported by line, or (skip, repair) dropped and counted.
"""
from __future__ import annotations

import codecs
import glob
import json
import os
import socket
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import datasets

from moe.errors import UserError, write_errno, write_failed
from moe.inputs import encoding_problem, wide_encoding

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv",
            ".txt": "text", ".text": "text"}
LINE_BASED = ("json", "csv", "tsv", "text")
GLOB_CHARS = set("*?[")
TEXT_CHUNK_BYTES = 1 << 20  # what the datasets text loader reads at a time (_load_files)
LOCAL_HINT = ("pass a local path instead: a jsonl/json/parquet/csv/tsv/txt file, a glob, a directory of such "
              "files, or a directory written by datasets' save_to_disk")


@dataclass
class RawData:
    dataset: datasets.Dataset
    kind: str  # json | csv | parquet | text | disk | hub
    sources: list[dict]
    skipped: Counter = field(default_factory=Counter)  # lines dropped while reading (on_bad_row=skip)
    repaired: Counter = field(default_factory=Counter)  # lines kept, bad bytes replaced (on_bad_row=repair)


def _as_list(spec) -> list[str]:
    if isinstance(spec, (str, os.PathLike)):
        return [str(spec)]
    return [str(s) for s in spec]


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _looks_like_path(item: str) -> bool:
    return Path(item).suffix.lower() in BUILDERS or item.startswith(("/", ".", "~")) or item.endswith("/")


def resolve(spec) -> tuple[str, list[str]]:
    """(kind, items): kind is a builder name with its files, `disk` with one dir, or `hub` with one name."""
    items = _as_list(spec)
    files: list[Path] = []
    for item in items:
        path = Path(item).expanduser()
        if path.is_dir():
            if _is_saved_dataset(path):
                if len(items) > 1:
                    raise UserError("input", spec, "pass a save_to_disk directory on its own",
                                    problem="mixes a save_to_disk directory with other inputs")
                return "disk", [str(path)]
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise UserError("input", item, f"put {'/'.join(sorted(BUILDERS))} files in it, or point "
                                "input at the files", problem="is a directory with no data files")
            files += found
        elif path.is_file():
            files.append(path)
        elif GLOB_CHARS & set(item):
            found = sorted(Path(p) for p in glob.glob(os.path.expanduser(item), recursive=True)
                           if Path(p).is_file())
            if not found:
                raise UserError("input", item, "check the pattern and the working directory "
                                f"({os.getcwd()})", problem="matches no files")
            files += found
        elif _looks_like_path(item):
            raise UserError("input", item, f"check the path (working directory: {os.getcwd()})",
                            problem="does not exist")
        else:
            if len(items) > 1:
                raise UserError("input", spec, "pass one hub dataset name on its own", problem="mixes a "
                                f"hub name ({item!r}, not a local path) with other inputs")
            return "hub", [item]
    kinds = {BUILDERS.get(p.suffix.lower()) for p in files}
    if None in kinds:
        bad = next(p for p in files if p.suffix.lower() not in BUILDERS)
        raise UserError("input", str(bad), f"use {', '.join(sorted(BUILDERS))} files",
                        problem="has an unsupported file type")
    if len(kinds) > 1:
        raise UserError("input", spec, "prepare one file type at a time (e.g. only .jsonl files)",
                        problem=f"mixes file types ({', '.join(sorted(kinds))})")
    return kinds.pop(), [str(p) for p in files]


def describe_sources(kind: str, items: list[str]) -> list[dict]:
    """What meta.json records about the inputs (and what an online cache key hashes)."""
    if kind == "hub":
        return [{"hub": items[0]}]
    out = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            out.append({"path": str(path.resolve()), "bytes": sum(p.stat().st_size for p in files)})
        else:
            out.append({"path": str(path.resolve()), "bytes": path.stat().st_size})
    return out


def hub_offline(timeout_s: float = 3.0) -> bool:
    """True when HF_HUB_OFFLINE / HF_DATASETS_OFFLINE say so, or the hub does not answer within timeout_s."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return True
    if getattr(datasets.config, "HF_HUB_OFFLINE", False):
        return True
    host = urlparse(getattr(datasets.config, "HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host or "huggingface.co", 443), timeout=timeout_s).close()
        return False
    except OSError:
        return True


def _pick_split(dd: datasets.DatasetDict, split: str | None, where: str) -> datasets.Dataset:
    names = list(dd)
    if split is None:
        split = "train" if "train" in dd else names[0] if len(names) == 1 else None
        if split is None:
            raise UserError("split", None, f"pick one of {names}, e.g. split={names[0]}",
                            problem=f"is needed: {where} has several splits and none is called train")
    if split not in dd:
        raise UserError("split", split, f"pick one of {names}", problem=f"is not a split of {where}")
    return dd[split]


def load_hub(name: str, hub_config: str | None, split: str | None, cache_dir: str | None) -> datasets.Dataset:
    if hub_offline():
        raise UserError("input", name, LOCAL_HINT, problem="is not an existing local path, so it was taken "
                        "as a Hugging Face Hub dataset name, and the hub is not reachable (offline)")
    try:
        loaded = datasets.load_dataset(name, hub_config, split=split, cache_dir=cache_dir)
    except Exception as err:  # DatasetNotFoundError, ConnectionError, bad config name, ...
        raise UserError("input", name, f"check the dataset name and hub_config, or {LOCAL_HINT}",
                        problem=f"could not be loaded from the hub ({type(err).__name__}: {err})") from err
    return _pick_split(loaded, split, name) if isinstance(loaded, datasets.DatasetDict) else loaded


def load_disk(path: str, split: str | None) -> datasets.Dataset:
    loaded = datasets.load_from_disk(path)
    return _pick_split(loaded, split, path) if isinstance(loaded, datasets.DatasetDict) else loaded


def _bad_lines(path: str, builder: str):
    """Yield (line_no, reason) for lines that do not decode as UTF-8 (or, JSON lines, do not parse)."""
    json_lines = builder == "json" and _first_char(path) != "["
    with open(path, "rb") as f:
        for no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield no, "undecodable_bytes"
                continue
            if json_lines and line.strip():
                try:
                    json.loads(line)
                except ValueError:
                    yield no, "bad_json"


def _undecodable_lines(path: str) -> list[int]:
    """Line numbers (1-based) holding bytes that are not UTF-8: one streaming decode of the file when it
    is clean, else a pass line by line."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                decoder.decode(block)
        decoder.decode(b"", final=True)
        return []
    except UnicodeDecodeError:
        pass
    bad = []
    with open(path, "rb") as f:
        for no, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                bad.append(no)
    return bad


def _checked_bytes(path: str, on_bad_row: str, out_dir: Path, raw: RawData) -> str:
    """`path`, or a copy of it without (skip) or with repaired (repair) lines of undecodable bytes. A file in
    UTF-16 or UTF-32 is refused whatever on_bad_row says: its first line does not decode and every other one
    decodes into text with a NUL between its letters, which would be trained on."""
    wide = wide_encoding(path)
    if wide:
        problem, fix = encoding_problem(path)
        raise UserError("input", path, fix, problem=f"cannot be read: {problem} (on_bad_row=skip or repair "
                        "would keep every line but the first as text with NULs between the letters)")
    bad = set(_undecodable_lines(path))
    if not bad:
        return path
    if on_bad_row == "error":
        raise UserError("input", path, "fix or remove that line, pass on_bad_row=skip to drop such lines or "
                        "on_bad_row=repair to replace the bad bytes with U+FFFD (counted in meta.json)",
                        problem=f"has undecodable bytes on line {min(bad)} ({len(bad)} such lines: not "
                                "UTF-8)")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{len(list(out_dir.iterdir())):05d}-{Path(path).name}"
    with open(path, "rb") as src, open(out, "wb") as dst:
        for no, line in enumerate(src, start=1):
            if no not in bad:
                dst.write(line)
            elif on_bad_row == "repair":
                dst.write(line.decode("utf-8", errors="replace").encode("utf-8"))
    (raw.repaired if on_bad_row == "repair" else raw.skipped)["undecodable_bytes"] += len(bad)
    return str(out)


def _first_char(path: str) -> str:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return chr(head[0]) if head else ""


def _clean_copy(path: str, builder: str, out_dir: Path, skipped: Counter) -> str:
    """Copy `path` without its bad lines into out_dir; count them by reason."""
    bad = dict(_bad_lines(path, builder))
    if not bad:
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{len(list(out_dir.iterdir())):05d}-{Path(path).name}"
    with open(path, "rb") as src, open(out, "wb") as dst:
        for no, raw in enumerate(src, start=1):
            if no in bad:
                skipped[bad[no]] += 1
            else:
                dst.write(raw)
    return str(out)


def builder_args(builder: str) -> tuple[str, dict]:
    """The `datasets` builder and its arguments that read files of kind `builder` (offline and streaming)."""
    # utf-8-sig: a byte-order mark some editors put first (U+FEFF) is dropped, not tokenized into row 0
    kwargs = {"encoding": "utf-8-sig"} if builder in ("text", "csv", "tsv") else {}
    if builder == "tsv":  # datasets' csv builder with tabs
        builder, kwargs["delimiter"] = "csv", "\t"
    if builder == "text":
        # 1 MB read at a time instead of datasets' 10 MB: a chunk's lines live as Python strings while it is
        # converted, and at 10 MB that (with the allocator's leftovers) grew the peak with the file's size
        kwargs.update(keep_linebreaks=False, chunksize=TEXT_CHUNK_BYTES)
    return builder, kwargs


def refuse_bad_bytes(path: str) -> None:
    """on_bad_row=error's byte check of one line-based file (a UserError naming the first bad line)."""
    _checked_bytes(path, "error", Path(path).parent, RawData(None, "", []))


def _load_files(builder: str, files: list[str], cache_dir: Path, num_proc: int) -> datasets.Dataset:
    builder, kwargs = builder_args(builder)
    counts = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False  # local files: no download-count request to the hub
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", cache_dir=str(cache_dir),
                                     num_proc=min(num_proc, len(files)) if num_proc > 1 else None, **kwargs)
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts


def load_raw(spec, *, on_bad_row: str, work_dir: Path, num_proc: int = 1, split: str | None = None,
             hub_config: str | None = None, cache_dir: str | None = None) -> RawData:
    """Load the rows of `spec`; intermediate Arrow files go under work_dir (removed by the caller)."""
    kind, items = resolve(spec)
    sources = describe_sources(kind, items)
    if kind == "hub":
        sources[0].update(config=hub_config, split=split)
        return RawData(load_hub(items[0], hub_config, split, cache_dir), kind, sources)
    if kind == "disk":
        return RawData(load_disk(items[0], split), kind, sources)
    if sum(s["bytes"] for s in sources) == 0:
        raise UserError("input", spec, "point input at files with data in them", problem="is empty (0 bytes)")
    raw = RawData(None, kind, sources)
    if kind in LINE_BASED:
        items = [_checked_bytes(f, on_bad_row, work_dir / "bytes_checked", raw) for f in items]
    skipped = raw.skipped
    try:
        ds = _load_files(kind, items, work_dir / "hf_cache", num_proc)
    except Exception as err:
        refused = next((e for e in (err, err.__cause__) if e is not None and write_errno(e)), None)
        if refused is not None:  # the files were read; their Arrow copy under the output could not be written
            raise write_failed(getattr(refused, "filename", None) or work_dir, refused) from refused
        if kind not in LINE_BASED:
            raise UserError("input", spec, "check the files are valid " + kind,
                            problem=f"could not be read ({type(err).__name__}: {err})") from err
        first_bad = next(((f, *bad) for f in items for bad in _bad_lines(f, kind)), None)
        if first_bad is None:
            cause = err.__cause__ or err
            raise UserError("input", spec,
                            f"check the files are valid {kind} with the same columns in every row",
                            problem=f"could not be read ({type(cause).__name__}: {cause})") from err
        if on_bad_row == "error":
            path, no, reason = first_bad
            raise UserError("input", path, "fix or remove that line, or pass on_bad_row=skip to drop such "
                            "lines (counted in meta.json)",
                            problem=f"has {reason.replace('_', ' ')} on line {no}") from err
        cleaned = [_clean_copy(f, kind, work_dir / "cleaned", skipped) for f in items]
        try:
            ds = _load_files(kind, cleaned, work_dir / "hf_cache_cleaned", num_proc)
        except Exception as err2:
            cause = err2.__cause__ or err2
            raise UserError("input", spec, f"check the files are valid {kind}",
                            problem=f"could not be read after dropping {sum(skipped.values())} bad lines "
                            f"({type(cause).__name__}: {cause})") from err2
    raw.dataset = ds
    return raw
