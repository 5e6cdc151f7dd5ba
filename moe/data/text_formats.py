"""Rows -> training text: `text`, `sentence` (SST2) and `chat` (no_robots) formats.

Each row renders to one string plus the character spans that carry loss when only
assistant tokens are trained; a row that cannot render gets a reason instead (a short
stable name such as `missing_field`) that `on_bad_row` counts or raises.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe.config.schema import DEFAULT_CHAT_TEMPLATE, TOKENIZER_TEMPLATE
from moe.errors import UserError

# Reasons a row renders to nothing without being bad input.
BENIGN = frozenset({"blank_line"})
ROLES = ("system", "user", "assistant")
TURN_SEPARATOR = "\n"  # between rendered (prompt, completion) turns of one conversation


@dataclass(frozen=True)
class FormatSpec:
    format: str  # text | chat | sentence
    text_column: str = "text"
    chat_template: str = DEFAULT_CHAT_TEMPLATE
    blank_lines_ok: bool = False  # txt inputs: an empty line separates documents, it is not a bad row

    @property
    def template_parts(self) -> tuple[str, str, str]:
        """(before prompt, between prompt and completion, after completion)."""
        head, rest = self.chat_template.split("{prompt}", 1)
        mid, tail = rest.split("{completion}", 1)
        return head, mid, tail


def check_columns(spec: FormatSpec, columns: list[str]) -> None:
    """Raise a UserError naming the missing column(s) and what the format expects."""
    if spec.format == "chat":
        if "messages" in columns or {"prompt", "completion"} <= set(columns):
            return
        raise UserError("format", "chat", "give rows a `messages` list of {role, content} (no_robots schema) "
                        "or `prompt` and `completion` columns, or pick format=text with text_column=NAME",
                        problem=f"needs a `messages` column or `prompt`+`completion` columns; "
                        f"found {columns}")
    column = "sentence" if spec.format == "sentence" else spec.text_column
    if column not in columns:
        fix = (f"set text_column to one of {columns}" if spec.format == "text"
               else "give rows a `sentence` column (GLUE/SST2), or use format=text with text_column=NAME")
        raise UserError("text_column" if spec.format == "text" else "format", column if spec.format == "text"
                        else "sentence", fix, problem=f"is not a column of the input (columns: {columns})")


def needed_columns(spec: FormatSpec, columns: list[str]) -> list[str]:
    """The input columns a format reads (the rest are never converted to Python)."""
    if spec.format == "chat":
        own = ("tools",) if spec.chat_template == TOKENIZER_TEMPLATE else ()  # the template renders them
        return [c for c in ("messages", "prompt", "completion", *own) if c in columns]
    return ["sentence" if spec.format == "sentence" else spec.text_column]


def _plain(value, strip: bool, blank_ok: bool) -> tuple[str | None, str | None]:
    if value is None:
        return None, "missing_field"
    if not isinstance(value, str):
        return None, "not_a_string"
    text = value.strip() if strip else value
    if not text.strip():
        return None, "blank_line" if blank_ok and value == "" else "empty_text"
    return text, None


def _turns_from_messages(messages) -> tuple[list[tuple[str, str]] | None, str | None]:
    """[(prompt, completion), ...] from a no_robots `messages` list; system text joins the first prompt."""
    if not isinstance(messages, list) or not messages:
        return None, "missing_field"
    merged: list[list[str]] = []  # [role, content], consecutive same roles merged
    system = []
    for msg in messages:
        if not isinstance(msg, dict) or msg.get("role") not in ROLES \
                or not isinstance(msg.get("content"), str):
            return None, "bad_message"
        if not msg["content"].strip():
            return None, "empty_message"
        if msg["role"] == "system":
            system.append(msg["content"])
        elif merged and merged[-1][0] == msg["role"]:
            merged[-1][1] += "\n" + msg["content"]
        else:
            merged.append([msg["role"], msg["content"]])
    if not merged or merged[0][0] != "user":
        return None, "no_user_turn"
    if merged[-1][0] != "assistant":
        return None, "no_assistant_reply"
    turns = [(merged[i][1], merged[i + 1][1]) for i in range(0, len(merged), 2)]
    if system:
        turns[0] = ("\n".join(system) + "\n" + turns[0][0], turns[0][1])
    return turns, None


def render_chat(turns: list[tuple[str, str]], parts: tuple[str, str, str]
                ) -> tuple[str, list[tuple[int, int]]]:
    """Template each turn and join them; spans cover each completion and the template text after it."""
    head, mid, tail = parts
    pieces, spans, pos = [], [], 0
    for i, (prompt, completion) in enumerate(turns):
        prefix = (TURN_SEPARATOR if i else "") + head + prompt + mid
        pieces += [prefix, completion + tail]
        pos += len(prefix)
        spans.append((pos, pos + len(completion) + len(tail)))
        pos = spans[-1][1]
    return "".join(pieces), spans


def render_row(row: dict, spec: FormatSpec) -> tuple[str | None, list[tuple[int, int]], str | None]:
    """(text, assistant spans, reason); text is None when the row is skipped for `reason`."""
    if spec.format == "text":
        text, reason = _plain(row.get(spec.text_column), strip=False, blank_ok=spec.blank_lines_ok)
        return text, [], reason
    if spec.format == "sentence":
        text, reason = _plain(row.get("sentence"), strip=True, blank_ok=False)
        return text, [], reason
    if row.get("messages") is not None or "prompt" not in row:
        turns, reason = _turns_from_messages(row.get("messages"))
    else:
        prompt, reason = _plain(row.get("prompt"), strip=False, blank_ok=False)
        completion, reason2 = _plain(row.get("completion"), strip=False, blank_ok=False)
        reason = reason or reason2
        turns = [(prompt, completion)]
    if reason:
        return None, [], reason
    text, spans = render_chat(turns, spec.template_parts)
    return text, spans, None


def render_batch(batch: dict[str, list], spec: FormatSpec):
    """Columnar batch -> (texts, spans, reasons), one entry per row."""
    texts, spans, reasons = [], [], []
    if spec.format != "chat":  # fast path: one column, no per-row dicts
        strip = spec.format == "sentence"
        blank_ok = spec.blank_lines_ok and not strip
        for value in batch["sentence" if strip else spec.text_column]:
            text, reason = _plain(value, strip=strip, blank_ok=blank_ok)
            texts.append(text)
            reasons.append(reason)
        return texts, [[] for _ in texts], reasons
    columns = list(batch)
    n = len(batch[columns[0]]) if columns else 0
    for i in range(n):
        text, span, reason = render_row({c: batch[c][i] for c in columns}, spec)
        texts.append(text)
        spans.append(span)
        reasons.append(reason)
    return texts, spans, reasons
