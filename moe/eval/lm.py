"""lm-evaluation-harness's LM interface on our own model (no export): loglikelihood, loglikelihood_rolling and
generate_until, batched, the last through moe.infer.generate's KV cache.

Each request is scored as lm_eval's Hugging Face backend scores it (lm_eval 0.4.13,
lm_eval/models/huggingface.py, cited `hf:LINE` below), so a task's numbers from our model and from its export
loaded by `lm_eval --model hf` are the same: the same tokenization of (context, continuation) (TemplateLM,
lm_eval/api/model.py:393-471), the same left truncation to the context, the same ordering and batching
(lm_eval.models.utils.Collator) and the same greedy check. Two differences, neither changing a number in fp32:
the log-softmax runs in fp32 on the continuation's positions only (hf:1503 takes it over every position in the
model's dtype), and a row's generation stops once its whole decoded text holds a stop string (hf: a stopping
criterion on the last few tokens' text); either way the text is then cut at the first stop string.

Routing is per token (the forward's `generating=True`, dropless): a token's experts never depend on which
other requests share its batch, nor on the padding.
"""
from __future__ import annotations

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from moe.errors import UserError
from moe.infer.generate import generate, left_pad
from moe.model import MoETransformer

MAX_GEN_TOKS = 256  # hf:628, for a generate_until task that names no max_gen_toks


class MoELM(TemplateLM):
    """A MoETransformer (eval mode, on its device) and its tokenizer as an lm_eval LM."""

    def __init__(self, model: MoETransformer, tokenizer, *, batch_size: int = 8,
                 max_length: int | None = None, eos_ids: list[int] | None = None, seed: int = 1234,
                 arrange_experts: bool = True):
        """arrange_experts=False leaves the experts' memory order as it is (moe.infer.generate): a model
        evaluated in the middle of its training keeps the layout its optimizer and DDP hold it in."""
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        # hf:620 resolve_max_length reads the exported config's max_position_embeddings: the same number
        self.max_length = max_length or model.model_config.max_position_embeddings
        self.eos_ids = eos_ids or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self._device = next(model.parameters()).device
        self.generator = torch.Generator(self._device).manual_seed(seed)  # do_sample=true tasks only
        self.arrange_experts = arrange_experts

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id  # hf:606

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and a rolling window's first token condition on: BOS, else EOS (hf:611)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_gen_toks(self) -> int:
        return MAX_GEN_TOKS

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "moe")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:
        """hf:1040: the tokenizer's own special tokens unless told, none when the text starts with BOS."""
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """Right-padded rows (hf:1483 pads on the right: causal attention never lets a pad reach a real token)
        through the model: logits [rows, width, vocab]."""
        width = max(len(r) for r in rows)
        ids_BS = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            ids_BS[b, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        return self.model(ids_BS.to(self._device), generating=True).logits_BSV

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """(sum of the continuation's log-probabilities, whether greedy decoding gives the continuation) per
        (key, context ids, continuation ids), as hf:1329-1572 computes them."""

        def longest_first(req):  # hf:1338
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        def shared_prefix(req):  # hf:1350: requests differing only in a one-token continuation share logits
            return req[-2] + req[-1][:-1]

        order = Collator(requests, sort_fn=longest_first, group_by="contexts", group_fn=shared_prefix)
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood requests")
        for chunk in order.get_batched(n=override_bs or self.batch_size):
            for _, _, continuation in chunk:
                if not 0 < len(continuation) <= self.max_length:  # hf:1417
                    raise UserError("max_length", self.max_length, "raise max_length, or evaluate a model "
                                    "with a longer context",
                                    problem=f"cannot hold a {len(continuation)}-token continuation")
            # hf:1436: the last max_length + 1 tokens, the last one only predicted
            rows = [(context + continuation)[-(self.max_length + 1):][:-1]
                    for _, context, continuation in chunk]
            logits_BSV = self._logits(rows)
            for (key, context, continuation), row, logits_SV in zip(chunk, rows, logits_BSV, strict=True):
                # hf:1191 _select_cont_toks: the positions that predict the continuation
                scored_1CV = torch.log_softmax(logits_SV[len(row) - len(continuation):len(row)].float(),
                                               dim=-1)[None]
                greedy_1C = scored_1CV.argmax(dim=-1)
                for key_, cont, logprobs_1CV in order.get_cache(req_str=key, cxt_toks=context,
                                                                cont_toks=continuation, logits=scored_1CV):
                    cont_1C = torch.tensor(cont, dtype=torch.long, device=logprobs_1CV.device)[None]
                    is_greedy = bool((greedy_1C[:, -cont_1C.shape[1]:] == cont_1C).all())  # hf:1546
                    logprob = float(torch.gather(logprobs_1CV, 2, cont_1C[..., None]).sum())
                    results.append((logprob, is_greedy))
                    if key_ is not None:
                        self.cache_hook.add_partial("loglikelihood", key_, (logprob, is_greedy))
                    bar.update(1)
        bar.close()
        return order.get_original(results)

    def rolling_windows(self, text: str) -> list[tuple[None, list[int], list[int]]]:
        """The text's tokens as disjoint (context, continuation) windows of at most max_length, the first
        conditioned on prefix_token_id (hf:1241-1256): every token predicted once, with the most context."""
        windows = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(text),
                                                     prefix_token=self.prefix_token_id,
                                                     max_seq_len=self.max_length, context_len=1)
        return [(None, *lm_utils.make_disjoint_window(w)) for w in windows]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-likelihood, its windows scored in batches of batch_size (hf:1226-1310)."""
        texts = [req.args[0] for req in requests]
        windows = [(i, w) for i, text in enumerate(texts) for w in self.rolling_windows(text)]
        totals = [0.0] * len(texts)
        for start in tqdm(range(0, len(windows), self.batch_size), disable=disable_tqdm,
                          desc="loglikelihood_rolling batches"):
            batch = windows[start:start + self.batch_size]
            scores = self._loglikelihood_tokens([w for _, w in batch], disable_tqdm=True,
                                                override_bs=len(batch))
            for (i, _), (logprob, _) in zip(batch, scores, strict=True):
                totals[i] += logprob
        for text, total in zip(texts, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    def _holds_any(self, stops: list[str]):
        """generate's `stopped`: the rows whose new text holds one of `stops` (None: no stop strings)."""
        stops = [s for s in stops if s]
        if not stops:
            return None

        def stopped(new_BN: torch.Tensor) -> torch.Tensor:
            texts = (self.tokenizer.decode(row, skip_special_tokens=True) for row in new_BN.tolist())
            return torch.tensor([any(s in text for s in stops) for text in texts])

        return stopped

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context (greedy unless the task samples), cut at the first stop string; requests
        batched by equal generation settings, longest first (hf:1574-1716)."""
        tok = self.tokenizer
        order = Collator([req.args for req in requests],
                         sort_fn=lambda req: (-len(self.tok_encode(req[0])), req[0]),
                         group_by="gen_kwargs", group_fn=lambda req: req[1])
        eos_text = tok.decode(self.eot_token_id, skip_special_tokens=False)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (self.eos_ids or [0])[0]
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until requests")
        for chunk in order.get_batched(n=self.batch_size):
            contexts, settings = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(settings[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = kwargs.pop("max_gen_toks")
            room = self.max_length - max_new  # hf:1644: the context keeps room for what is generated
            if room <= 0:
                raise UserError("max_gen_toks", max_new, f"ask for fewer than max_length={self.max_length} "
                                "new tokens", problem="leaves no room for the context")
            # hf:1065 tok_batch_encode: no special tokens when the first context starts with BOS
            special = {"add_special_tokens": False} if has_bos_prefix(contexts[0], tok.bos_token) else {}
            encoded = [tok.encode(c, **special)[-room:] or [self.prefix_token_id] for c in contexts]
            ids_BS, mask_BS = left_pad(encoded, pad_id)
            sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0.0)) > 0
            out = generate(self.model, ids_BS, mask_BS, max_new_tokens=max_new,
                           temperature=float(kwargs.get("temperature", 0.0)) if sampled else 0.0,
                           top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0),
                           eos_token_id=self.eos_ids, pad_token_id=pad_id, generator=self.generator,
                           vocab_limit=len(tok), stopped=self._holds_any([s for s in until if s != eos_text]),
                           arrange_experts=self.arrange_experts)
            for context, setting, new in zip(contexts, settings, out.tokens, strict=True):
                text = postprocess_generated_text(tok.decode(new, skip_special_tokens=True), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, setting), text)
                bar.update(1)
        bar.close()
        return order.get_original(results)
