"""Helpers for the multi-process equivalence tests: a rank's (maybe sharded) tensors as canonical pieces,
and every rank's pieces assembled into the whole tensors one process holds."""
from __future__ import annotations

import torch


def canonical_pieces(model, tensors: dict, tp: int, model_cfg) -> dict:
    """name -> [(offsets, piece)]: this rank's parts of `tensors` (live, maybe sharded), canonical layout."""
    from moe.parallel.placement import Where, pieces, where_by_name

    wheres = where_by_name(model, model_cfg, tp)
    return {name: [(offsets, part.detach().clone()) for part, offsets in pieces(t, wheres.get(name, Where()))]
            for name, t in tensors.items()}


def assemble(per_rank: list[dict], shapes: dict) -> dict:
    full = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
    for parts in per_rank:
        for name, pieces in parts.items():
            for offsets, piece in pieces:
                full[name][tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape, strict=True))] = piece
    return full
