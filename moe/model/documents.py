"""Documents packed into one block that do not see each other (`data.document_mask`).

Concat packing (moe/data/packing.py) joins rows, each ending in EOS, into blocks. With document masking a
token sees only the earlier tokens of its own document (block-causal attention), its RoPE position counts
from its document's first token, and no label crosses a boundary: the label after an EOS (the next
document's first token) carries no loss. This is Megatron's `reset_attention_mask`, `reset_position_ids`
and `eod_mask_loss` (megatron/core/datasets/gpt_dataset.py `_get_ltor_masks_and_position_ids`), and
torchtitan's block-causal mask. A document's tokens then get exactly the logits and loss they would get
run alone.

A document is a packed row. The data loader reads where each starts in a block: the starts the packer
recorded (rows rendered by the tokenizer's own chat template, which may hold EOS tokens inside), else the
token after each EOS (a row's only EOS is its last token; moe.data.packing.starts_after_eos). It turns
them into `document_ids` [B, S] (`document_ids_from_starts`), the model turns those into `Documents`
(positions and masks), and each attention layer asks it for its mask: a boolean [B, 1, S, S] for SDPA,
or a flex_attention BlockMask (CUDA, where flex_attention exists).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100


def document_ids_from_starts(starts_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] int32 from bool [B, S] document starts: the index of each token's document in its row (a
    row's first token starts its first document, recorded or not)."""
    starts = starts_BS.clone()
    starts[:, 0] = True
    return (starts.to(torch.int32).cumsum(-1) - 1).to(torch.int32)


def positions_in_documents(doc_ids_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] int64: each token's distance from its document's first token in the row (0 at a start)."""
    S = doc_ids_BS.shape[-1]
    index = torch.arange(S, device=doc_ids_BS.device).expand_as(doc_ids_BS)
    starts = torch.ones_like(doc_ids_BS, dtype=torch.bool)
    starts[:, 1:] = doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - first


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Documents:
    """One forward's document layout over the full sequence (under sequence parallelism too: attention
    gathers the sequence before it reads the mask and positions). `use_flex`: attend with flex_attention's
    BlockMask instead of SDPA's dense mask (None: where it runs compiled, on CUDA)."""

    ids_BS: torch.Tensor
    use_flex: bool | None = None
    positions_BS: torch.Tensor = field(init=False)
    _dense: dict = field(default_factory=dict, init=False, repr=False)
    _blocks: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        self.positions_BS = positions_in_documents(self.ids_BS)
        if self.use_flex is None:
            self.use_flex = self.ids_BS.is_cuda and flex_available()

    def allowed(self, window: int | None) -> torch.Tensor:
        """bool [B, 1, S, S], True = may attend: same document, causal, and within `window` positions."""
        if window not in self._dense:
            ids = self.ids_BS
            S = ids.shape[-1]
            pos = torch.arange(S, device=ids.device)
            ok = (pos[None, :] <= pos[:, None])[None] & (ids[:, :, None] == ids[:, None, :])
            if window is not None:
                ok = ok & (pos[None, :] > pos[:, None] - window)[None]
            self._dense[window] = ok[:, None]
        return self._dense[window]

    def block_mask(self, window: int | None):
        """flex_attention's BlockMask of the same rule (one for all heads)."""
        if window not in self._blocks:
            from torch.nn.attention.flex_attention import create_block_mask

            ids = self.ids_BS

            def mask_mod(b, h, q, kv):
                ok = (kv <= q) & (ids[b, q] == ids[b, kv])
                return ok & (kv > q - window) if window is not None else ok

            B, S = ids.shape
            self._blocks[window] = create_block_mask(mask_mod, B, None, S, S, device=ids.device)
        return self._blocks[window]


@dataclass
class FlexDocumentMask:
    """What CoreAttention reads, in place of SDPA's mask, to attend with flex_attention: the documents, the
    layer's window and its ALiBi slopes (None for RoPE)."""

    documents: Documents
    window: int | None
    alibi_slopes: torch.Tensor | None = None

    def attend(self, q, k, v, scale: float | None, enable_gqa: bool) -> torch.Tensor:
        """flex_attention under the document mask; ALiBi as a score_mod adding -slope * distance (the bias
        CausalSelfAttention._mask gives SDPA). Compiled on CUDA (its fused kernel), eager elsewhere (torch's
        reference implementation of the same maths, which the tests compare with SDPA)."""
        from torch.nn.attention.flex_attention import flex_attention

        score_mod = None
        if self.alibi_slopes is not None:
            slopes = self.alibi_slopes

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + slopes[h] * (kv_idx - q_idx).to(torch.float32)

        attend = _compiled_flex() if q.is_cuda else flex_attention
        return attend(q, k, v, score_mod=score_mod, block_mask=self.documents.block_mask(self.window),
                      scale=scale, enable_gqa=enable_gqa)


_COMPILED = []


def _compiled_flex():
    if not _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED[0]


def packed_documents(batch: dict) -> Documents | None:
    """The Documents of a training batch that carries `document_ids` (data.document_mask), else None."""
    ids = batch.get("document_ids")
    return None if ids is None else Documents(ids)
