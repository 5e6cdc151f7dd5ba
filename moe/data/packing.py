"""Token rows -> fixed blocks of seq_len + 1 tokens.

`concat` is group_texts over the whole split, not per map batch: rows (each already
ending in EOS) are concatenated and cut into blocks, and only the final partial block
is dropped, so tokens in = tokens in blocks + tail dropped. `pad` puts one row in each
block, truncated to the block and padded, with a loss mask that is 0 on the padding.
A block of L + 1 tokens trains inputs block[:-1] against labels block[1:].

Both packers also say where each row (a document, for `data.document_mask`) starts in each block: a bool
[blocks, L + 1] array, True at a row's first token. A row's EOS need not be the only EOS in it (a
tokenizer's own chat template may close every turn with it), so the loader reads documents from these
starts where they were recorded (arrow_io.py's `doc_starts` column), and from EOS tokens otherwise.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class PackStats:
    rows: int = 0
    tokens_in: int = 0  # tokens of the rows, EOS included
    blocks: int = 0
    tokens_in_blocks: int = 0  # non-padding tokens written
    tail_tokens_dropped: int = 0  # concat: the final partial block
    tokens_truncated: int = 0  # pad: tokens past the block end
    padding_tokens: int = 0  # pad: filler tokens
    loss_tokens: int = 0  # label positions that carry loss

    def as_dict(self) -> dict:
        return asdict(self)


def _count_loss(masks: np.ndarray | None, n_blocks: int, block_len: int) -> int:
    return int(masks[:, 1:].sum()) if masks is not None else n_blocks * (block_len - 1)


def starts_after_eos(blocks: np.ndarray, eos_id: int) -> np.ndarray:
    """bool [k, L + 1]: a document starts at each block's first token and after each EOS (how blocks whose
    rows hold EOS only at their end, and dirs written before starts were recorded, are read)."""
    starts = np.ones(blocks.shape, dtype=bool)
    starts[:, 1:] = blocks[:, :-1] == eos_id
    return starts


class ConcatPacker:
    """Feed chunks of concatenated rows in order; get whole blocks back, carrying the remainder."""

    def __init__(self, block_len: int, with_mask: bool):
        self.block_len, self.with_mask = block_len, with_mask
        self.carry_ids = np.zeros(0, np.int32)
        self.carry_mask = np.zeros(0, np.uint8) if with_mask else None
        self.carry_starts = np.zeros(0, np.int64)  # offsets in carry_ids where a row starts
        self.stats = PackStats()

    def add(self, ids: np.ndarray, mask: np.ndarray | None, lengths: np.ndarray):
        """-> (blocks [k, L + 1], loss masks or None, row starts bool [k, L + 1])."""
        self.stats.rows += len(lengths)
        self.stats.tokens_in += len(ids)
        firsts = len(self.carry_ids) + np.cumsum(lengths, dtype=np.int64) - lengths  # each new row's offset
        row_starts = np.concatenate([self.carry_starts, firsts])
        stream = np.concatenate([self.carry_ids, ids]) if len(self.carry_ids) else ids
        n = len(stream) // self.block_len
        cut = n * self.block_len
        blocks = stream[:cut].reshape(n, self.block_len)
        self.carry_ids = stream[cut:]
        starts = np.zeros(cut, dtype=bool)
        starts[row_starts[row_starts < cut]] = True
        self.carry_starts = row_starts[row_starts >= cut] - cut
        masks = None
        if self.with_mask:
            mstream = np.concatenate([self.carry_mask, mask]) if len(self.carry_mask) else mask
            masks = mstream[:cut].reshape(n, self.block_len)
            self.carry_mask = mstream[cut:]
        self.stats.blocks += n
        self.stats.tokens_in_blocks += cut
        self.stats.loss_tokens += _count_loss(masks, n, self.block_len)
        return blocks, masks, starts.reshape(n, self.block_len)

    def finish(self) -> PackStats:
        self.stats.tail_tokens_dropped = len(self.carry_ids)
        return self.stats


class PadPacker:
    """One row a block: truncate to block_len, pad with pad_id, mask out the padding."""

    def __init__(self, block_len: int, pad_id: int):
        self.block_len, self.pad_id = block_len, pad_id
        self.stats = PackStats()

    def add(self, ids: np.ndarray, mask: np.ndarray | None, lengths: np.ndarray):
        """-> (blocks [k, L + 1], loss masks [k, L + 1], row starts: position 0 of each block)."""
        n, L = len(lengths), self.block_len
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        keep = np.minimum(lengths, L)
        blocks = np.full((n, L), self.pad_id, dtype=ids.dtype)
        masks = np.zeros((n, L), dtype=np.uint8)
        # Vectorised scatter: position j of row r is valid when j < keep[r].
        cols = np.arange(L)
        valid = cols[None, :] < keep[:, None]
        src = (starts[:, None] + cols[None, :])[valid]
        blocks[valid] = ids[src]
        masks[valid] = mask[src] if mask is not None else 1
        s = self.stats
        s.rows += n
        s.tokens_in += int(lengths.sum())
        s.blocks += n
        s.tokens_in_blocks += int(keep.sum())
        s.tokens_truncated += int((lengths - keep).sum())
        s.padding_tokens += int((L - keep).sum())
        s.loss_tokens += _count_loss(masks, n, L)
        first = np.zeros((n, L), dtype=bool)
        first[:, 0] = True
        return blocks, masks, first

    def finish(self) -> PackStats:
        return self.stats
