"""Packed blocks <-> Arrow: write splits with `datasets`, read them back memory-mapped.

On disk (a `datasets.DatasetDict.save_to_disk` directory):
  train/, validation/   columns `input_ids` (fixed-size list of seq_len + 1 tokens, uint16 when the
                        vocabulary fits, else int32) and, when some tokens carry no loss, `loss_mask`
                        (fixed-size list of uint8: 1 = this token is a training target), and for rows
                        rendered by the tokenizer's own chat template `doc_starts` (list of int32: the
                        offsets in the block where a row starts, for data.document_mask)
  tokenizer/            the tokenizer the blocks were made with
  meta.json             written last: a directory without it is not a finished output
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from datasets.arrow_writer import ArrowWriter
from datasets.table import MemoryMappedTable

from moe.config.schema import TOKENIZER_TEMPLATE
from moe.data.packing import starts_after_eos
from moe.errors import UserError, first_line

SPLITS = ("train", "validation")


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "int32"


def block_features(block_len: int, dtype: str, with_mask: bool,
                   with_starts: bool = False) -> datasets.Features:
    cols = {"input_ids": datasets.List(datasets.Value(dtype), length=block_len)}
    if with_mask:
        cols["loss_mask"] = datasets.List(datasets.Value("uint8"), length=block_len)
    if with_starts:
        cols["doc_starts"] = datasets.List(datasets.Value("int32"))
    return datasets.Features(cols)


def _offsets_of(starts: np.ndarray) -> pa.ListArray:
    """bool [k, L + 1] row starts -> each block's list of the offsets where a row starts."""
    _, offsets = np.nonzero(starts)
    ends = np.concatenate([[0], np.cumsum(starts.sum(axis=1))]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(ends), pa.array(offsets.astype(np.int32)))


class SplitWriter:
    """Append [k, block_len] block arrays to one Arrow file (`with_starts`: and where each row starts)."""

    def __init__(self, path: Path, block_len: int, dtype: str, with_mask: bool, with_starts: bool = False):
        self.path, self.block_len, self.dtype, self.with_mask = path, block_len, dtype, with_mask
        self.with_starts = with_starts
        self.features = block_features(block_len, dtype, with_mask, with_starts)
        self.writer = ArrowWriter(features=self.features, path=str(path))

    def _fixed(self, arr: np.ndarray, dtype) -> pa.Array:
        flat = pa.array(np.ascontiguousarray(arr, dtype=dtype).ravel())
        return pa.FixedSizeListArray.from_arrays(flat, self.block_len)

    def write(self, blocks: np.ndarray, masks: np.ndarray | None, starts: np.ndarray | None = None) -> None:
        if not len(blocks):
            return
        cols = {"input_ids": self._fixed(blocks, self.dtype)}
        if self.with_mask:
            cols["loss_mask"] = self._fixed(masks, np.uint8)
        if self.with_starts:
            cols["doc_starts"] = _offsets_of(starts)
        self.writer.write_table(pa.table(cols, schema=self.features.arrow_schema))

    def close(self, split: str, fingerprint: str) -> datasets.Dataset:
        self.writer.finalize()
        self.writer.close()
        table = MemoryMappedTable.from_file(str(self.path))
        return datasets.Dataset(table, info=datasets.DatasetInfo(features=self.features),
                                split=datasets.NamedSplit(split), fingerprint=fingerprint)


def save_splits(splits: dict[str, datasets.Dataset], out_dir: Path, one_file_per_split: bool) -> None:
    # An empty split still gets one (empty) file, so every output has train/ and validation/.
    num_shards = {name: 1 for name, ds in splits.items() if one_file_per_split or len(ds) == 0}
    datasets.DatasetDict(splits).save_to_disk(str(out_dir), num_shards=num_shards)


class PackedBlocks:
    """One split's blocks, memory-mapped: `get(idx)` -> (ids [k, L+1] int64, mask [k, L+1] or None);
    `document_starts` says where its documents start."""

    def __init__(self, ds: datasets.Dataset, block_len: int):
        table = ds.data.table if hasattr(ds.data, "table") else ds.data
        self.block_len = block_len
        self.ids = [self._view(c) for c in table.column("input_ids").chunks]
        self.masks = ([self._view(c) for c in table.column("loss_mask").chunks]
                      if "loss_mask" in table.column_names else None)
        self.doc_starts = None  # per chunk: (list offsets, in-block offsets) of the doc_starts column
        if "doc_starts" in table.column_names:
            self.doc_starts = [(c.offsets.to_numpy(), c.values.to_numpy(zero_copy_only=False))
                               for c in table.column("doc_starts").chunks]
        lengths = [len(c) for c in self.ids]
        self.starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def _view(self, chunk: pa.FixedSizeListArray) -> np.ndarray:
        return chunk.flatten().to_numpy(zero_copy_only=True).reshape(-1, self.block_len)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _gather(self, chunks: list[np.ndarray], idx: np.ndarray) -> np.ndarray:
        if len(chunks) == 1:
            return chunks[0][idx]
        which = np.searchsorted(self.starts, idx, side="right") - 1
        out = np.empty((len(idx), self.block_len), dtype=chunks[0].dtype)
        for c in np.unique(which):
            sel = which == c
            out[sel] = chunks[c][idx[sel] - self.starts[c]]
        return out

    def get(self, idx) -> tuple[np.ndarray, np.ndarray | None]:
        idx = np.asarray(idx, dtype=np.int64)
        ids = self._gather(self.ids, idx).astype(np.int64)
        mask = self._gather(self.masks, idx) if self.masks is not None else None
        return ids, mask

    def document_starts(self, idx, ids: np.ndarray, eos_id: int) -> np.ndarray:
        """bool [k, L+1], True where a document starts in blocks `idx` (their `ids`): the recorded row starts
        where the split has them, else the token after each EOS."""
        if self.doc_starts is None:
            return starts_after_eos(ids, eos_id)
        idx = np.asarray(idx, dtype=np.int64)
        out = np.zeros((len(idx), self.block_len), dtype=bool)
        which = np.searchsorted(self.starts, idx, side="right") - 1
        for c in np.unique(which):
            rows = np.flatnonzero(which == c)
            offsets, values = self.doc_starts[c]
            local = idx[rows] - self.starts[c]
            lo, hi = offsets[local], offsets[local + 1]
            counts = hi - lo
            first = np.repeat(lo - (np.cumsum(counts) - counts), counts)
            out[np.repeat(rows, counts), values[first + np.arange(counts.sum())]] = True
        return out


@dataclass
class Prepared:
    path: Path
    meta: dict
    splits: dict[str, PackedBlocks]

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / self.meta["tokenizer"]["dir"]


DAMAGED_FIX = "prepare it again (python data_prep.py ... output=DIR overwrite=true), or restore a copy"
ONLINE_CACHE_ENV = "MOE_DATA_CACHE"


def online_cache_root() -> Path:
    """Where train.py's online packing (data.kind=online) keeps what it builds, one directory per config,
    tokenizer and input files: $MOE_DATA_CACHE, else ~/.cache/moe/data (moe.data.datamodule.cache_root)."""
    return Path(os.environ.get(ONLINE_CACHE_ENV) or Path.home() / ".cache" / "moe" / "data").expanduser()


def damaged(field: str, path: Path, problem: str) -> UserError:
    """Prepared data that cannot be read, as one paragraph. An entry of the online cache is named as such:
    train.py built it and builds it again once it is deleted (a user never ran data_prep.py for it)."""
    path = Path(path)
    if path.parent.absolute() == online_cache_root().absolute():
        return UserError(ONLINE_CACHE_ENV, str(path.parent), f"delete {path} (the next train.py start packs "
                         f"data.path into it again), or set {ONLINE_CACHE_ENV} to another directory",
                         problem=f"holds a damaged entry of the online data cache, {path.name} "
                                 f"(it {problem})")
    return UserError(field, str(path), DAMAGED_FIX, problem=problem)


def read_meta(path: str | Path, field: str = "data.path") -> dict:
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        problem = ("does not exist" if not path.exists()
                   else "has no meta.json (not a finished data_prep.py output)")
        raise UserError(field, str(path), "point it at a directory written by `python data_prep.py input=... "
                        "output=DIR`", problem=problem)
    try:
        meta = json.loads(meta_file.read_text())
        int(meta["seq_len"])
    except (ValueError, KeyError, TypeError) as err:
        raise damaged(field, path, f"has a damaged meta.json ({err})") from err
    return meta


def load_prepared(path: str | Path, field: str = "data.path") -> Prepared:
    """Open a data_prep.py output directory, memory-mapped; a missing, truncated or corrupt shard (or one
    holding fewer blocks than meta.json records) is a UserError naming the directory."""
    path = Path(path)
    meta = read_meta(path, field)
    block_len = meta["seq_len"] + 1
    try:
        dd = datasets.load_from_disk(str(path))
        splits = {name: PackedBlocks(dd[name], block_len) for name in SPLITS if name in dd}
    except (OSError, ValueError, KeyError, pa.ArrowException) as err:
        raise damaged(field, path, f"cannot be read: a shard is missing, cut short or corrupt "
                      f"({type(err).__name__}: {first_line(err)})") from err
    for name, blocks in splits.items():
        recorded = meta.get("splits", {}).get(name, {}).get("blocks")
        if recorded is not None and recorded != len(blocks):
            raise damaged(field, path, f"holds {len(blocks)} {name} blocks where meta.json records "
                          f"{recorded}: a shard is missing or cut short")
    return Prepared(path, meta, splits)


def prepared_facts(data) -> dict:
    """For `data=prepared`, what DIR/meta.json fixes of the data section: {"seq_len": ...}, so validation
    checks the real length (merged into a copy of the config while the run settles it); {} otherwise.

    A missing directory is left for the DataModule to report (a dry run does not need the data). A mixture's
    sources share the first one's seq_len (moe/data/mixture.py refuses another).
    """
    path = data.sources[0].path if data.sources else data.path
    if data.kind == "prepared" and path and (Path(path) / "meta.json").is_file():
        meta = read_meta(path)
        return {"seq_len": int(meta["seq_len"])}
    return {}


def check_document_starts(meta: dict, path: Path, field: str = "data.path") -> None:
    """For data.document_mask: rows rendered by the tokenizer's own chat template may hold EOS tokens inside
    (a turn's end), so their documents are read from the recorded row starts; a dir written before they were
    recorded is refused (other dirs' rows end with their only EOS: documents are read from it)."""
    made_with = meta.get("config", {})
    own_template = made_with.get("format") == "chat" and made_with.get("chat_template") == TOKENIZER_TEMPLATE
    if own_template and "doc_starts" not in meta.get("columns", []):
        problem = ("does not record where its rows start (no doc_starts column; written before data_prep.py "
                   "recorded them): rows rendered by the tokenizer's own chat template may hold the EOS "
                   "token inside, so data.document_mask cannot find where documents end")
        path = Path(path)
        if path.parent.absolute() == online_cache_root().absolute():
            raise UserError(ONLINE_CACHE_ENV, str(path.parent), f"delete {path} (the next train.py start "
                            "packs data.path into it again, recording them), or set data.document_mask=false",
                            problem=f"holds an online data cache entry, {path.name}, that {problem}")
        raise UserError(field, str(path), "prepare it again with data_prep.py (output=DIR overwrite=true), "
                        "which records them, or set data.document_mask=false", problem=problem)
