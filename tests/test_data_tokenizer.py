"""Tokenizer directories and the bundled sample: deterministic, loadable by transformers offline."""
from __future__ import annotations

from pathlib import Path

import pytest

from moe.data import tokenizer as tk
from moe.data.sample_corpus import SPECIAL_TOKENS, write_sample
from moe.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample"
SAMPLE_FILES = ["train.txt", "chat.jsonl", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json"]


def test_sample_regenerates_byte_identically(tmp_path):
    write_sample(tmp_path)
    for name in SAMPLE_FILES:
        assert (tmp_path / name).read_bytes() == (SAMPLE / name).read_bytes(), name


def test_sample_is_small_and_has_the_promised_shape():
    total = sum(p.stat().st_size for p in SAMPLE.iterdir() if p.is_file())
    assert total < 2_000_000
    assert 300_000 <= (SAMPLE / "train.txt").stat().st_size <= 600_000
    tok, config = tk.read_tokenizer(SAMPLE)
    assert tk.vocab_size(tok) == 512
    assert config["eos_token"] == "<|endoftext|>" and config["pad_token"] == "<|pad|>"
    for special in SPECIAL_TOKENS:
        assert tok.encode(f"a{special}b").tokens.count(special) == 1


def test_transformers_autotokenizer_loads_the_dir_offline_and_agrees(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(SAMPLE))
    tok, _ = tk.read_tokenizer(SAMPLE)
    text = "<|user|>\nWhat is 2 plus 3?\n<|assistant|>\n2 plus 3 is 5.<|endoftext|>"
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text, add_special_tokens=False).ids
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == tok.token_to_id("<|endoftext|>")
    assert hf.pad_token_id == tok.token_to_id("<|pad|>")
    assert hf.decode(tok.encode("Tom liked to run.").ids) == "Tom liked to run."


def test_train_bpe_is_deterministic_and_sized_exactly(tmp_path):
    texts = [f"the {w} sat on the mat number {i}" for i, w in enumerate(["cat", "dog", "bird"] * 50)]
    shas = []
    for run in range(2):
        tok = tk.train_bpe(texts, 300, ["<|endoftext|>", "<|pad|>"], show_progress=False)
        assert tk.vocab_size(tok) == 300
        shas.append(tk.save_tokenizer(tok, tmp_path / str(run), eos="<|endoftext|>", pad="<|pad|>"))
    assert shas[0] == shas[1] == tk.file_sha256(tmp_path / "0" / "tokenizer.json")


def test_train_bpe_too_small_vocab_is_a_user_error():
    with pytest.raises(UserError, match="vocab_size=100"):
        tk.train_bpe(["abc"], 100, ["<|endoftext|>"])


def test_template_markers_are_registered_as_special_tokens():
    tok = tk.train_bpe(["plain text only"] * 5, 270, ["<|endoftext|>"], show_progress=False)
    before = tk.vocab_size(tok)
    markers = tk.template_markers("<|user|>\n{prompt}\n<|assistant|>\n{completion}")
    assert markers == ["<|user|>", "<|assistant|>"]
    assert tk.add_special_tokens(tok, markers) == markers
    assert tk.vocab_size(tok) == before + 2
    assert tok.encode("<|user|>\nhi").tokens[0] == "<|user|>"
    assert tk.add_special_tokens(tok, markers) == []  # idempotent


def test_missing_tokenizer_dir_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="has no tokenizer.json"):
        tk.read_tokenizer(tmp_path)
