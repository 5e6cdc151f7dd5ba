"""Deterministic, resumable training order, sharded over data-parallel ranks.

The order is one endless stream over N blocks: stream position i is block
permutation(seed + i // N)[i % N] (identity without shuffle). Rank r of dp takes
positions r, r + dp, r + 2dp, ...; its micro-batch n is its positions [n*B, (n+1)*B).
Every rank and every restart computes the same stream, so resuming after c
micro-batches (per rank) continues it with nothing repeated or skipped.
"""
from __future__ import annotations

import numpy as np


class StreamSampler:
    """Yields index arrays: micro-batches `start .. total-1` of rank `dp_rank`.

    `len()` is `total` (the whole run), not the number left: Lightning counts the batches
    a resumed run already consumed as fetched, so the two meet exactly at `total`.
    """

    def __init__(self, num_items: int, micro_batch_size: int, total: int, seed: int, shuffle: bool = True,
                 dp_rank: int = 0, dp_size: int = 1, start: int = 0):
        if num_items < 1:
            raise ValueError("StreamSampler needs at least one item")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        self.n, self.batch, self.total = num_items, micro_batch_size, total
        self.seed, self.shuffle = seed, shuffle
        self.dp_rank, self.dp_size, self.start = dp_rank, dp_size, start
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

    def micro_batch(self, n: int) -> np.ndarray:
        """Block indices of this rank's micro-batch n."""
        local = np.arange(n * self.batch, (n + 1) * self.batch, dtype=np.int64)
        return self.items(local * self.dp_size + self.dp_rank)

    def __iter__(self):
        for n in range(self.start, self.total):
            yield self.micro_batch(n)

    def __len__(self) -> int:
        return self.total


def validation_batches(num_items: int, micro_batch_size: int, limit: int, dp_rank: int = 0,
                       dp_size: int = 1) -> list[np.ndarray]:
    """Fixed validation micro-batches of one rank: items r, r+dp, ... (equal count on every rank)."""
    per_rank = num_items // dp_size
    items = np.arange(per_rank, dtype=np.int64) * dp_size + dp_rank
    batches = [items[i:i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
    return batches[:max(limit, 0)]
