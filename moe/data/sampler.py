"""Deterministic, resumable training order, sharded over data-parallel ranks, its position kept in rows.

The order is one endless stream over N blocks: stream position i is block
permutation(seed + i // N)[i % N] (identity without shuffle). A training step takes the next
`rows x dp` positions of the stream, whatever the batch geometry: rank r of dp takes positions
p + r, p + r + dp, ... of them. So the stream's position is a number of rows (sequences) consumed by
every rank together, and a run resumed at another micro-batch size, accumulation or data-parallel size
goes on at exactly the next row: nothing repeated, nothing skipped.
"""
from __future__ import annotations

import numpy as np


class StreamSampler:
    """Yields index arrays: this rank's rows of steps `start_step .. total-1`.

    `rows` is this rank's rows per step (micro-batch size x accumulation); step `start_step` begins at
    stream position `start_row` (the rows every rank consumed before it). `len()` is `total` (the whole
    run), not the number left: Lightning counts the batches a resumed run already consumed as fetched, so
    the two meet exactly at `total`.
    """

    def __init__(self, num_items: int, rows: int, total: int, seed: int, shuffle: bool = True,
                 dp_rank: int = 0, dp_size: int = 1, start_step: int = 0, start_row: int = 0):
        if num_items < 1:
            raise ValueError("StreamSampler needs at least one item")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        self.n, self.rows, self.total = num_items, rows, total
        self.seed, self.shuffle = seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.start_step, self.start_row = start_step, start_row
        self._perm_epoch, self._perm = None, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng(self.seed + epoch).permutation(self.n)
            self._perm_epoch = epoch
        return self._perm

    def items(self, positions: np.ndarray) -> np.ndarray:
        """Block index at each stream position."""
        if not self.shuffle:
            return positions % self.n
        out = np.empty(len(positions), dtype=np.int64)
        epochs = positions // self.n
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._permutation(int(epoch))[positions[sel] % self.n]
        return out

    def rows_before(self, step: int) -> int:
        """Stream position where `step` begins: the rows every rank consumed before it."""
        return self.start_row + (step - self.start_step) * self.rows * self.dp_size

    def step_rows(self, step: int) -> np.ndarray:
        """Block indices of this rank's rows of `step`."""
        local = np.arange(self.rows, dtype=np.int64)
        return self.items(self.rows_before(step) + local * self.dp_size + self.dp_rank)

    def __iter__(self):
        for step in range(self.start_step, self.total):
            yield self.step_rows(step)

    def __len__(self) -> int:
        return self.total


def validation_batches(num_items: int, micro_batch_size: int, limit: int, dp_rank: int = 0,
                       dp_size: int = 1) -> list[np.ndarray]:
    """Fixed validation micro-batches of one rank: items r, r+dp, ... (equal count on every rank)."""
    per_rank = num_items // dp_size
    items = np.arange(per_rank, dtype=np.int64) * dp_size + dp_rank
    batches = [items[i:i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
    return batches[:max(limit, 0)]
