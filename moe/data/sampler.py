"""Deterministic, resumable training order, sharded over data-parallel ranks, its position kept in rows.

The order is one endless stream over N blocks: stream position i is block
permutation(seed + i // N)[i % N] (identity without shuffle). A training step takes the next
`rows x dp` positions of the stream, whatever the batch geometry: rank r of dp takes positions
p + r, p + r + dp, ... of them. So the stream's position is a number of rows (sequences) consumed by
every rank together, and a run resumed at another micro-batch size, accumulation or data-parallel size
goes on at exactly the next row: nothing repeated, nothing skipped.

A weighted mixture of sources (data.sources) keeps that stream of positions and says which source each
position draws from: positions are cut into chunks of MIXTURE_CHUNK, every chunk holds each source's fixed
quota of slots (the weights' largest-remainder rounding of MIXTURE_CHUNK) in an order shuffled from
(seed, chunk). The j-th draw of source s is block permutation_s(seed + j // N_s)[j % N_s] of that source:
a source that runs out starts a new epoch of itself (Megatron's BlendedDataset wraps its datasets the same
way). Every position's block is a function of the seed and the position alone, so resume stays exact.
"""
from __future__ import annotations

import numpy as np

from moe.config.schema import MIXTURE_CHUNK


def quotas(weights, chunk: int = MIXTURE_CHUNK) -> np.ndarray:
    """Each source's slots in a chunk: the weights' largest-remainder rounding of `chunk` (ties: the
    first)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * chunk
    out = np.floor(exact).astype(np.int64)
    short = chunk - int(out.sum())
    out[np.argsort(-(exact - out), kind="stable")[:short]] += 1
    return out


class Mixture:
    """Stream position -> (source, draw of that source): fixed quotas per chunk, shuffled from the seed."""

    def __init__(self, weights, seed: int, chunk: int = MIXTURE_CHUNK):
        self.quota, self.seed, self.chunk = quotas(weights, chunk), seed, chunk
        self._chunk_index, self._order, self._rank = None, None, None

    def _layout(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk `index`'s source at each slot, and how many slots of that source precede it in the chunk."""
        if self._chunk_index != index:
            order = np.repeat(np.arange(len(self.quota)), self.quota)
            order = order[np.random.default_rng([self.seed, index]).permutation(self.chunk)]
            rank = np.empty(self.chunk, dtype=np.int64)
            for s, q in enumerate(self.quota):
                rank[order == s] = np.arange(q)
            self._chunk_index, self._order, self._rank = index, order, rank
        return self._order, self._rank

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        source, draw = np.empty(len(positions), np.int64), np.empty(len(positions), np.int64)
        chunks = positions // self.chunk
        for index in np.unique(chunks):
            sel = chunks == index
            order, rank = self._layout(int(index))
            slot = positions[sel] % self.chunk
            source[sel] = order[slot]
            draw[sel] = index * self.quota[order[slot]] + rank[slot]
        return source, draw


class SourceOrder:
    """One source's endless order: draw j is block permutation(seed + j // N)[j % N] (identity without
    shuffle); source k > 0 salts its permutations with k, so equal-sized sources are not shuffled alike."""

    def __init__(self, num_items: int, seed: int, shuffle: bool, salt: int = 0):
        if num_items < 1:
            raise ValueError("StreamSampler needs at least one item")
        self.n, self.seed, self.shuffle, self.salt = num_items, seed, shuffle, salt
        self._perm_epoch, self._perm = None, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            seed = self.seed + epoch if self.salt == 0 else [self.seed + epoch, self.salt]
            self._perm = np.random.default_rng(seed).permutation(self.n)
            self._perm_epoch = epoch
        return self._perm

    def items(self, draws: np.ndarray) -> np.ndarray:
        if not self.shuffle:
            return draws % self.n
        out = np.empty(len(draws), dtype=np.int64)
        epochs = draws // self.n
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._permutation(int(epoch))[draws[sel] % self.n]
        return out


class StreamSampler:
    """Yields index arrays: this rank's rows of steps `start_step .. total-1`.

    `rows` is this rank's rows per step (micro-batch size x accumulation); step `start_step` begins at
    stream position `start_row` (the rows every rank consumed before it). `len()` is `total` (the whole
    run), not the number left: Lightning counts the batches a resumed run already consumed as fetched, so
    the two meet exactly at `total`.
    """

    def __init__(self, num_items, rows: int, total: int, seed: int, shuffle: bool = True,
                 dp_rank: int = 0, dp_size: int = 1, start_step: int = 0, start_row: int = 0, weights=None):
        """`num_items`: the block count, or one per source of a mixture drawn by `weights`; a mixture's item
        index is its block's index in the sources' blocks laid end to end."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        sizes = [int(num_items)] if np.ndim(num_items) == 0 else [int(n) for n in num_items]
        self.sources = [SourceOrder(n, seed, shuffle, salt=k) for k, n in enumerate(sizes)]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.mixture = Mixture(weights, seed) if len(sizes) > 1 else None
        self.rows, self.total = rows, total
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.start_step, self.start_row = start_step, start_row

    def items(self, positions: np.ndarray) -> np.ndarray:
        """Item index at each stream position."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.mixture is None:
            return self.sources[0].items(positions)
        source, draw = self.mixture.draws(positions)
        out = np.empty(len(positions), dtype=np.int64)
        for k in np.unique(source):
            sel = source == k
            out[sel] = self.offsets[k] + self.sources[k].items(draw[sel])
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
