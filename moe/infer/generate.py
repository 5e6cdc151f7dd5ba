"""KV-cache generation: one prefill forward, then one token per row per step.

Prompts of different lengths are left-padded into one batch with a 0/1 attention mask.
Pads take positions 0..p-1 of their row, so a row's real tokens sit p positions later
than they would alone; RoPE, ALiBi and the sliding window depend only on distances
between positions, so the shift changes nothing (up to float rounding) and the model
needs no per-row position ids. Routing is forced dropless while generating: with a
capacity limit a token's experts would depend on which other rows share the batch (and
pads would compete for slots); dropless routing is per token, exactly as Mixtral and
the exported Hugging Face model compute it. Routing losses and statistics are skipped
(nothing trains on them here), which halves a decode step of a small model on CPU.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moe.model.moe import arrange_for_generation


@dataclass
class Generation:
    """New tokens per row (cut after the first EOS, which is kept) and timings."""

    tokens: list[list[int]]
    finished: list[bool]  # the row stopped at an EOS
    prompt_tokens: int  # real (unpadded) prompt tokens in the batch
    prefill_s: float  # forward over the prompts, up to the first new token
    decode_s: float  # every later step
    cache_bytes: int = 0  # the KV cache's size at the end (0 without one)

    @property
    def num_new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second, prefill included (what a user waits for)."""
        return self.num_new_tokens / max(self.seconds, 1e-9)


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids_BS, attention_mask_BS), pads on the left, mask 1 = real token."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[b, width - len(p):] = 1
    return ids, mask


def next_token(logits_BV: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row: argmax when temperature == 0, else sample.

    Order as transformers applies its warpers: temperature, then top-k, then top-p
    (the smallest set of tokens whose probability reaches top_p; always at least one).
    """
    if temperature <= 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV.float() / temperature
    if 0 < top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        before_BV = probs_BV.cumsum(-1) - probs_BV  # mass strictly above each token
        drop_sorted = before_BV >= top_p  # keeps the first token always (before = 0)
        drop_BV = drop_sorted.scatter(-1, order_BV, drop_sorted)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    probs_BV = torch.softmax(logits_BV, dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


@contextlib.contextmanager
def generation_mode(model: torch.nn.Module):
    """Eval mode for the duration (the forward's `generating=True` makes routing per-token); restores it."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids_BS: torch.Tensor,
    attention_mask_BS: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    vocab_limit: int | None = None,
    latent_cache: bool = True,
    stopped: Callable[[torch.Tensor], torch.Tensor] | None = None,
    arrange_experts: bool = True,
) -> Generation:
    """Continue each row of `input_ids_BS` (left-padded; mask 1 = real token) by up to max_new_tokens.

    A row stops after it emits any of `eos_token_id`; the loop ends when every row has.
    `use_cache=False` recomputes the whole sequence each step (the reference the cache is
    tested against). `vocab_limit` forbids ids >= it (embedding rows the tokenizer lacks).
    `latent_cache=False`: an MLA model caches the expanded per-head keys and values instead of its
    latent (moe/model/mla.py; the same tokens, for comparison).
    `stopped(new_BN)` (the new tokens so far) says which rows are done besides EOS (a stop string in their
    text): they stop, and take pads from then on, as rows past EOS do; their tokens are kept whole.
    `arrange_experts` first puts the experts' weights in the memory order their matmuls want here
    (moe.model.moe.arrange_for_generation: once per model; shapes and checkpoints unchanged).
    """
    if arrange_experts:
        arrange_for_generation(model)
    param = next(model.parameters())
    device = param.device
    ids_BS = input_ids_BS.to(device)
    B, S = ids_BS.shape
    mask_BS = None
    if attention_mask_BS is not None:
        mask_BS = attention_mask_BS.to(device=device, dtype=torch.long)
        if bool(mask_BS.all()):
            mask_BS = None  # no padding: let attention take its causal fast path
    prompt_tokens = B * S if mask_BS is None else int(mask_BS.sum())
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    eos_t = torch.tensor(eos_ids, dtype=torch.long, device=device)

    def pick(logits_BV: torch.Tensor) -> torch.Tensor:
        if vocab_limit is not None and vocab_limit < logits_BV.shape[-1]:
            logits_BV = logits_BV.clone()
            logits_BV[:, vocab_limit:] = float("-inf")
        return next_token(logits_BV, temperature, top_k, top_p, generator)

    new_BN = torch.empty((B, max_new_tokens), dtype=torch.long, device=device)
    done_B = torch.zeros(B, dtype=torch.bool, device=device)
    steps = 0
    with generation_mode(model):
        _sync(device)
        t0 = time.perf_counter()
        cache = model.new_kv_cache(latent=latent_cache) if use_cache else None
        prefill_s = 0.0
        seq_BS = ids_BS
        pos = 0  # tokens fed to the cache so far
        step_in = ids_BS
        while steps < max_new_tokens:
            if use_cache:
                out = model(step_in, kv_cache=cache, position_offset=pos, attention_mask_BS=mask_BS,
                            generating=True, last_only=True)
                pos += step_in.shape[1]
            else:
                out = model(seq_BS, attention_mask_BS=mask_BS, generating=True, last_only=True)
            tok_B = pick(out.logits_BSV[:, -1])
            tok_B = torch.where(done_B, torch.full_like(tok_B, pad_token_id), tok_B)
            new_BN[:, steps] = tok_B
            steps += 1
            if steps == 1:
                _sync(device)
                prefill_s = time.perf_counter() - t0
            if len(eos_ids):
                done_B |= torch.isin(tok_B, eos_t)
            if stopped is not None:
                done_B |= stopped(new_BN[:, :steps]).to(device)
            if (len(eos_ids) or stopped is not None) and bool(done_B.all()):
                break
            if steps == max_new_tokens:
                break
            step_in = tok_B[:, None]
            if mask_BS is not None:
                mask_BS = torch.cat([mask_BS, torch.ones_like(mask_BS[:, :1])], dim=1)
            if not use_cache:
                seq_BS = torch.cat([seq_BS, step_in], dim=1)
        _sync(device)
        total_s = time.perf_counter() - t0

    tokens, finished = [], []
    for row in new_BN[:, :steps].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos_ids), None)
        tokens.append(row if cut is None else row[: cut + 1])
        finished.append(cut is not None)
    cache_bytes = sum(layer.nbytes for layer in cache) if use_cache else 0
    return Generation(tokens, finished, prompt_tokens, prefill_s, total_s - prefill_s, cache_bytes)
