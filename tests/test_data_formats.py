"""Row rendering: the chat template text exactly, assistant spans, and bad-row reasons."""
from __future__ import annotations

import pytest

from moe.data.text_formats import FormatSpec, check_columns, render_batch, render_row
from moe.errors import UserError

CHAT = FormatSpec("chat")


def test_chat_prompt_completion_renders_the_default_template_exactly():
    text, spans, reason = render_row({"prompt": "Hi there", "completion": "Hello!"}, CHAT)
    assert reason is None
    assert text == "<|user|>\nHi there\n<|assistant|>\nHello!"
    assert [text[a:b] for a, b in spans] == ["Hello!"]


def test_chat_messages_no_robots_schema_with_system_and_two_turns():
    row = {"prompt": "ignored when messages exist", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
    ]}
    text, spans, reason = render_row(row, CHAT)
    assert reason is None
    assert text == ("<|user|>\nBe brief.\n2+2?\n<|assistant|>\n4"
                    "\n<|user|>\nAnd 3+3?\n<|assistant|>\n6")
    assert [text[a:b] for a, b in spans] == ["4", "6"]


def test_custom_template_trailing_text_is_part_of_the_assistant_span():
    spec = FormatSpec("chat", chat_template="### Q: {prompt}\n### A: {completion}</s>")
    text, spans, _ = render_row({"prompt": "why", "completion": "because"}, spec)
    assert text == "### Q: why\n### A: because</s>"
    assert [text[a:b] for a, b in spans] == ["because</s>"]


def test_braces_in_content_are_kept_verbatim():
    text, _, _ = render_row({"prompt": "f'{x}'", "completion": "{completion}"}, CHAT)
    assert text == "<|user|>\nf'{x}'\n<|assistant|>\n{completion}"


@pytest.mark.parametrize("row, reason", [
    ({"messages": []}, "missing_field"),
    ({"messages": None, "prompt": "p", "completion": None}, "missing_field"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant_reply"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "no_user_turn"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "bad_message"),
    ({"messages": [{"role": "user", "content": 3}]}, "bad_message"),
    ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "x"}]},
     "empty_message"),
])
def test_bad_chat_rows_get_a_reason(row, reason):
    assert render_row(row, CHAT) == (None, [], reason)


def test_text_and_sentence_formats():
    texts, _, reasons = render_batch({"body": ["a b", None, "", 7]}, FormatSpec("text", text_column="body"))
    assert texts == ["a b", None, None, None]
    assert reasons == [None, "missing_field", "empty_text", "not_a_string"]
    texts, _, reasons = render_batch({"sentence": ["hide new secretions from the parental units ", " "]},
                                     FormatSpec("sentence"))
    assert texts == ["hide new secretions from the parental units", None]
    assert reasons == [None, "empty_text"]


def test_blank_txt_lines_are_benign_only_for_txt_inputs():
    _, _, reasons = render_batch({"text": ["x", ""]}, FormatSpec("text", blank_lines_ok=True))
    assert reasons == [None, "blank_line"]


@pytest.mark.parametrize("spec, columns, field", [
    (FormatSpec("text", text_column="body"), ["text"], "text_column"),
    (FormatSpec("sentence"), ["text", "label"], "format"),
    (CHAT, ["prompt", "category"], "format"),
])
def test_missing_columns_name_the_field_and_the_columns_found(spec, columns, field):
    with pytest.raises(UserError) as err:
        check_columns(spec, columns)
    assert err.value.field == field
    assert str(columns) in str(err.value)
