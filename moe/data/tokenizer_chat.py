"""Chat rows rendered with the tokenizer's own Jinja chat template (`chat_template: tokenizer`).

transformers' `apply_chat_template` renders the conversation; the loss mask comes from rendering
prefixes, because most released templates lack the `{% generation %}` markers that
`return_assistant_tokens_mask` needs. For assistant message k:

- start: the messages before k, rendered with `add_generation_prompt=True` (ends with the assistant header);
- end: the messages up to and including k, rendered without it (ends with the template's end of turn).

Both, tokenized, must be prefixes of the whole conversation's token ids; the tokens between them are
what the assistant generated and are trained, except whitespace the template writes after the turn's
last special token (Qwen's `\\n` after `<|im_end|>`), which the model never generates. A template
for which the prefix property fails (Qwen3's, which renders its last assistant turn with an empty
`<think>` block) is refused: its masks would be wrong.
"""
from __future__ import annotations

import json
from pathlib import Path

from moe.config.schema import DEFAULT_CHAT_TEMPLATE
from moe.errors import UserError, first_line

NOT_PREFIX = "template_not_prefix"  # a template problem, refused whatever on_bad_row says
TEMPLATE_ERROR = "template_error"  # the template refused the row (raise_exception, a missing field)


def without_nulls(value):
    """`value` without None-valued dict keys: Arrow gives every message every key any message has."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def conversation(row: dict) -> tuple[list[dict] | None, list | None, str | None]:
    """(messages, tools, reason) of a chat row: `messages` (+ optional `tools`), or `prompt`/`completion`."""
    if row.get("messages") is None and isinstance(row.get("prompt"), str):
        prompt, completion = row.get("prompt"), row.get("completion")
        if not isinstance(completion, str):
            return None, None, "missing_field" if completion is None else "not_a_string"
        if not prompt.strip() or not completion.strip():
            return None, None, "empty_text"
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], None, None
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return None, None, "missing_field"
    clean = []
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            return None, None, "bad_message"
        msg = without_nulls(msg)
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list, dict)):
            return None, None, "bad_message"
        blank = content is None or isinstance(content, str) and not content.strip()
        if blank and not msg.get("tool_calls"):
            return None, None, "empty_message"
        clean.append(msg)
    roles = [m["role"] for m in clean]
    if "assistant" not in roles or roles[-1] != "assistant":
        return None, None, "no_assistant_reply"
    if "user" not in roles[:roles.index("assistant")]:
        return None, None, "no_user_turn"
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            return None, None, "bad_tools"
    if tools is not None and not isinstance(tools, list):
        return None, None, "bad_tools"
    return clean, without_nulls(tools) if tools else None, None


def load_template_tokenizer(path: str | Path, field: str = "chat_template"):
    """The transformers tokenizer of `path`, which must carry a chat template (tokenizer_config.json's
    `chat_template` or a chat_template.jinja beside it)."""
    from moe.data.tokenizer import load_hf_tokenizer

    hf = load_hf_tokenizer(path, "tokenizer")
    if not getattr(hf, "chat_template", None):
        raise UserError(field, "tokenizer", f"add a chat_template to {Path(path) / 'tokenizer_config.json'} "
                        "(or a chat_template.jinja beside it), or set the template in the config, e.g. "
                        f"{DEFAULT_CHAT_TEMPLATE!r}", problem=f"selects the tokenizer's own chat template, "
                        f"and the tokenizer {path} has none")
    return hf


def template_text(hf) -> str:
    """The template string apply_chat_template uses by default (a named set's `default`)."""
    template = hf.chat_template
    return template["default"] if isinstance(template, dict) else template


def render(hf, messages: list[dict], tools=None, generation_prompt: bool = False) -> str:
    """`messages` as the tokenizer's template writes them; with `generation_prompt`, up to the assistant
    header (training's untrained prefix, and what infer.py prompts a model with)."""
    return hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                  add_generation_prompt=generation_prompt)


def _is_prefix(prefix: list, whole: list) -> bool:
    return len(prefix) <= len(whole) and whole[:len(prefix)] == prefix


class ChatTemplateEncoder:
    """Row -> (token ids, loss mask) with the tokenizer's template; the transformers tokenizer (for
    rendering) loads lazily, so the encoder pickles cheaply into `Dataset.map` workers."""

    def __init__(self, tok, tokenizer_dir: str, eos_id: int):
        self.tok, self.tokenizer_dir, self.eos_id = tok, str(tokenizer_dir), eos_id
        self._hf = None
        added = tok.get_added_tokens_decoder()
        self.special_ids = {i for i, t in added.items() if t.special}

    @property
    def hf(self):
        if self._hf is None:
            self._hf = load_template_tokenizer(self.tokenizer_dir)
        return self._hf

    def texts(self, messages: list[dict], tools) -> tuple[str, list[tuple[str, str]]]:
        """(whole conversation, [(start, end) text of each assistant turn]); template errors propagate."""
        whole = render(self.hf, messages, tools)
        turns = [(render(self.hf, messages[:k], tools, True), render(self.hf, messages[:k + 1], tools))
                 for k, m in enumerate(messages) if m["role"] == "assistant"]
        return whole, turns

    def encode(self, row: dict) -> tuple[list[int], list[int], str | None]:
        """(ids, mask, None), or ([], [], reason) for a row that cannot be encoded."""
        messages, tools, reason = conversation(row)
        if reason:
            return [], [], reason
        try:
            whole, turns = self.texts(messages, tools)
        except Exception:  # jinja2's TemplateError (raise_exception), a field the template needs
            return [], [], TEMPLATE_ERROR
        if not all(e.startswith(s) and whole.startswith(e) for s, e in turns):
            return [], [], NOT_PREFIX
        encs = self.tok.encode_batch([whole, *(t for pair in turns for t in pair)], add_special_tokens=False)
        ids = encs[0].ids
        mask = [0] * len(ids)
        last_span = []
        for j in range(len(turns)):
            start, end = encs[1 + 2 * j].ids, encs[2 + 2 * j].ids
            if not (_is_prefix(start, end) and _is_prefix(end, ids)):
                return [], [], NOT_PREFIX
            last_span = self.trained(end[len(start):])
            for i in range(len(start), len(start) + len(last_span)):
                mask[i] = 1
        # The template's own EOS ends the row (Mistral's `</s>`, Qwen's `<|im_end|>` before its newline):
        # nothing appended. Else EOS separates rows (concat packing); trained only when no special token
        # closed the last turn (it is then the stop).
        end = len(ids)
        while end and not self.tok.decode(ids[end - 1:end], skip_special_tokens=False).strip():
            end -= 1
        if end and ids[end - 1] == self.eos_id:
            return ids, mask, None
        closed = any(t in self.special_ids for t in last_span)
        return ids + [self.eos_id], mask + [0 if closed else 1], None

    def trained(self, span: list[int]) -> list[int]:
        """A turn's generated tokens: the span less whitespace written after its last special token."""
        last = max((i for i, t in enumerate(span) if t in self.special_ids), default=None)
        if last is None:
            return span
        tail = span[last + 1:]
        return span if self.tok.decode(tail, skip_special_tokens=False).strip() else span[:last + 1]

    def explain(self, row: dict) -> str:
        """Why `row` failed to encode, in words (for the error naming the first such row)."""
        messages, tools, reason = conversation(row)
        if reason:
            return reason
        try:
            whole, turns = self.texts(messages, tools)
        except Exception as err:
            return f"{TEMPLATE_ERROR}: the template refused it ({first_line(err)})"
        for j, (start, end) in enumerate(turns, 1):
            for part, what in ((start, "the messages before it, with the generation prompt"),
                               (end, "the messages up to its end")):
                if not whole.startswith(part):
                    pairs = zip(part, whole, strict=False)  # `part` may be longer than the whole
                    at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(part), len(whole)))
                    return (f"assistant turn {j}: {what}, render as {part[at:at + 40]!r} at character {at} "
                            f"where the whole conversation has {whole[at:at + 40]!r}")
        return ("the rendered turns are text prefixes of the whole conversation, but their tokens are not "
                "prefixes of its tokens (a token merges across a turn boundary)")
