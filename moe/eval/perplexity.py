"""Perplexity of a held-out text file through lm_eval's loglikelihood_rolling: every token of each document
predicted once, from the most context max_length allows (lm_eval/api/model.py:58-97), the document's first
token conditioned on the prefix token (BOS, else EOS). Its `loss` (mean negative log-likelihood per token)
is the validation loss of the model's own forward on the same windows.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from moe.errors import UserError, first_line
from moe.inputs import read_text


def read_documents(path_text: str) -> list[str]:
    """.txt: a document a line (blank lines skipped), as data/sample/train.txt; .jsonl: a `text` field a
    line."""
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise UserError("perplexity_file", path_text, "pass an existing .txt (a document a line) or .jsonl "
                        "(a `text` field a line) file", problem="does not exist")
    lines = [line for line in read_text(path, "perplexity_file", path_text).splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        documents = lines
    else:
        documents = []
        for number, line in enumerate(lines, 1):
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise UserError("perplexity_file", path_text, 'write one {"text": "..."} object a line',
                                problem=f"has a line without a text field (line {number}: "
                                f"{first_line(err)})") from err
            if not isinstance(text, str) or not text.strip():
                raise UserError("perplexity_file", path_text, "make every text a non-empty string",
                                problem=f"has text {text!r} on line {number}")
            documents.append(text)
    if not documents:
        raise UserError("perplexity_file", path_text, "give it at least one non-empty line",
                        problem="is empty")
    return documents


def perplexity(lm, documents: list[str]) -> dict:
    """Token-level loss and perplexity of `documents` under `lm` (a moe.eval.lm.MoELM), with lm_eval's
    wikitext-style word perplexity and bits per byte beside them."""
    from lm_eval.api.instance import Instance

    requests = [Instance("loglikelihood_rolling", doc={}, arguments=(d,), idx=0) for d in documents]
    nll = -sum(lm.loglikelihood_rolling(requests, disable_tqdm=True))
    tokens = sum(len(lm.tok_encode(d)) for d in documents)
    words = sum(len(d.split()) for d in documents)
    num_bytes = sum(len(d.encode("utf-8")) for d in documents)
    return {"documents": len(documents), "tokens": tokens, "loss": nll / tokens,
            "perplexity": math.exp(nll / tokens), "word_perplexity": math.exp(nll / max(words, 1)),
            "bits_per_byte": nll / num_bytes / math.log(2)}
