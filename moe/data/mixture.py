"""A weighted mixture's prepared sources (data.sources): their names, their shared tokenizer and length, and
their blocks laid end to end so one item index reaches every source's blocks (moe/data/sampler.py draws
the indices by weight)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from moe.data.arrow_io import SPLITS, PackedBlocks, Prepared, load_prepared, read_meta
from moe.errors import UserError
from moe.paths import local_path


def source_dirs(sources) -> list[tuple[Path, dict]]:
    """Each source's directory and meta.json; refused where one's tokenizer or seq_len differs from the
    first's (its blocks would mean other token ids or another length)."""
    opened = []
    for k, source in enumerate(sources):
        path = Path(local_path(source.path)).expanduser().absolute()
        opened.append((path, read_meta(path, f"data.sources[{k}].path")))
    first_dir, first = opened[0]
    for k, (path, meta) in enumerate(opened[1:], start=1):
        if meta["tokenizer"]["sha256"] != first["tokenizer"]["sha256"]:
            raise UserError(f"data.sources[{k}].path", str(path),
                            "prepare it again with data_prep.py "
                            f"tokenizer={first_dir / first['tokenizer']['dir']} (the tokenizer of "
                            f"data.sources[0], {first_dir}), or drop it from the mixture",
                            problem="was tokenized with another tokenizer than data.sources[0] "
                            "(tokenizer.json sha256 differs): one model cannot read both")
        if meta["seq_len"] != first["seq_len"]:
            raise UserError(f"data.sources[{k}].path", str(path),
                            f"prepare it again with data_prep.py seq_len={first['seq_len']} (the length of "
                            f"data.sources[0], {first_dir}), or drop it from the mixture",
                            problem=f"holds blocks of seq_len {meta['seq_len']}, data.sources[0] of "
                            f"{first['seq_len']}")
    return opened


class MixedBlocks:
    """Several sources' blocks of one split as one: item i is block i - start[k] of source k."""

    def __init__(self, parts: list[PackedBlocks | None]):
        self.parts = parts
        self.sizes = [len(p) if p is not None else 0 for p in parts]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def source_of(self, idx) -> np.ndarray:
        return np.searchsorted(self.starts, np.asarray(idx, dtype=np.int64), side="right") - 1

    def get(self, idx) -> tuple[np.ndarray, np.ndarray | None]:
        """(ids [k, L+1] int64, mask [k, L+1] or None): a source without a loss mask trains on every token."""
        idx = np.asarray(idx, dtype=np.int64)
        which = self.source_of(idx)
        pieces = {int(k): self.parts[k].get(idx[which == k] - self.starts[k]) for k in np.unique(which)}
        width = next(iter(pieces.values()))[0].shape[1]
        ids = np.empty((len(idx), width), dtype=np.int64)
        masked = any(mask is not None for _, mask in pieces.values())
        mask = np.ones((len(idx), width), dtype=np.uint8) if masked else None
        for k, (part_ids, part_mask) in pieces.items():
            ids[which == k] = part_ids
            if part_mask is not None:
                mask[which == k] = part_mask
        return ids, mask


    def document_starts(self, idx, ids: np.ndarray, eos_id: int) -> np.ndarray:
        """bool [k, L+1]: where documents start, each block read as its own source reads it."""
        idx = np.asarray(idx, dtype=np.int64)
        which = self.source_of(idx)
        out = np.empty(ids.shape, dtype=bool)
        for k in np.unique(which):
            sel = which == k
            out[sel] = self.parts[k].document_starts(idx[sel] - self.starts[k], ids[sel], eos_id)
        return out


def load_mixture(opened: list[tuple[Path, dict]]) -> Prepared:
    """Every source memory-mapped; each split's blocks laid end to end in data.sources' order."""
    loaded = [load_prepared(path, f"data.sources[{k}].path") for k, (path, _) in enumerate(opened)]
    splits = {name: MixedBlocks([p.splits.get(name) for p in loaded]) for name in SPLITS
              if any(name in p.splits for p in loaded)}
    return Prepared(opened[0][0], opened[0][1], splits)
