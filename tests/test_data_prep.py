"""data_prep pipeline on small files the tests write: input kinds, formats, packing, splits, determinism."""
from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest

from moe.data import load_prepared, prep_pipeline, prepare
from moe.data.sample_corpus import chat_rows, corpus_lines
from moe.data.tokenizer import read_tokenizer
from moe.errors import UserError

SAMPLE_TOK = str(Path(__file__).resolve().parents[1] / "data" / "sample")
LINES = corpus_lines(seed=7, num_docs=60)


def prep(tmp_path: Path, name: str = "out", **cfg) -> tuple[Path, dict]:
    cfg = {"tokenizer": SAMPLE_TOK, "seq_len": 16, "val_fraction": 0.0, "output": str(tmp_path / name), **cfg}
    out = prepare(cfg, progress=False)
    return out, json.loads((out / "meta.json").read_text())


def blocks(out: Path, split: str = "train"):
    data = load_prepared(out).splits[split]
    return data.get(np.arange(len(data)))


def token_rows(texts: list[str]) -> list[list[int]]:
    tok, _ = read_tokenizer(SAMPLE_TOK)
    eos = tok.token_to_id("<|endoftext|>")
    return [tok.encode(t, add_special_tokens=False).ids + [eos] for t in texts]


def write_txt(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_concat_is_group_texts_over_the_whole_split_with_exact_token_conservation(tmp_path):
    src = write_txt(tmp_path / "c.txt", LINES[:20] + [""] + LINES[20:])  # one blank line between docs
    out, meta = prep(tmp_path, input=str(src))
    ids, mask = blocks(out)
    stream = np.concatenate([np.array(r) for r in token_rows(LINES)])
    assert mask is None and ids.shape[1] == 17
    assert np.array_equal(ids.ravel(), stream[: ids.size])  # rows in file order, EOS between them
    s = meta["splits"]["train"]
    assert s["tokens_in"] == len(stream) == s["tokens_in_blocks"] + s["tail_tokens_dropped"]
    assert s["blocks"] == len(ids) == len(stream) // 17 and s["tail_tokens_dropped"] == len(stream) % 17
    assert meta["rows"] == {"read": 61, "used": 60, "skipped": {}, "repaired": {}, "blank_lines_ignored": 1}
    assert meta["tokenizer"]["vocab_size"] == 512 and meta["token_dtype"] == "uint16"


def _write_kind(kind: str, tmp_path: Path, rows: list[dict]) -> str:
    ds = datasets.Dataset.from_list(rows)
    if kind == "jsonl":
        ds.to_json(tmp_path / "d.jsonl")
        return str(tmp_path / "d.jsonl")
    if kind == "json":
        (tmp_path / "d.json").write_text(json.dumps(rows))
        return str(tmp_path / "d.json")
    if kind == "parquet":
        ds.to_parquet(tmp_path / "d.parquet")
        return str(tmp_path / "d.parquet")
    if kind == "csv":
        ds.to_csv(tmp_path / "d.csv", index=False)
        return str(tmp_path / "d.csv")
    if kind == "txt":
        return str(write_txt(tmp_path / "d.txt", [r["text"] for r in rows]))
    if kind in ("glob", "dir"):
        (tmp_path / "parts").mkdir()
        for i in range(0, len(rows), 25):  # part-0, part-1, ...: sorted order = row order
            datasets.Dataset.from_list(rows[i:i + 25]).to_json(tmp_path / "parts" / f"part-{i // 25}.jsonl")
        return str(tmp_path / "parts" / "*.jsonl") if kind == "glob" else str(tmp_path / "parts")
    if kind == "save_to_disk":
        datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(tmp_path / "saved")
        return str(tmp_path / "saved")
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["json", "parquet", "csv", "txt", "glob", "dir", "save_to_disk"])
def test_every_input_kind_gives_the_same_blocks_as_jsonl(tmp_path, kind):
    rows = [{"text": line, "label": i % 2} for i, line in enumerate(LINES)]
    ref, _ = prep(tmp_path, "ref", input=_write_kind("jsonl", tmp_path, rows), val_fraction=0.1)
    out, meta = prep(tmp_path, input=_write_kind(kind, tmp_path, rows), val_fraction=0.1)
    for split in ("train", "validation"):
        assert np.array_equal(blocks(out, split)[0], blocks(ref, split)[0]), split
    assert meta["rows"]["used"] == 60


def test_sentence_format_sst2_split_sizes_follow_val_fraction_and_seed(tmp_path):
    rows = [{"sentence": line + " ", "label": i % 2, "idx": i} for i, line in enumerate(LINES[:50])]
    src = _write_kind("parquet", tmp_path, rows)
    out, meta = prep(tmp_path, input=src, format="sentence", val_fraction=0.1, seed=3)
    assert (meta["splits"]["train"]["rows"], meta["splits"]["validation"]["rows"]) == (45, 5)
    _, meta_b = prep(tmp_path, "b", input=src, format="sentence", val_fraction=0.1, seed=4)
    assert meta_b["splits"]["validation"]["tokens_in"] != meta["splits"]["validation"]["tokens_in"]
    # validation rows are exactly the held-out sentences (stripped), in file order
    perm = np.random.default_rng(3).permutation(50)
    held = sorted(perm[:5])
    val_stream = np.concatenate([np.array(r) for r in token_rows([LINES[i] for i in held])])
    assert np.array_equal(blocks(out, "validation")[0].ravel(), val_stream[: len(val_stream) // 17 * 17])


def test_chat_assistant_only_loss_masks_everything_but_replies_and_eos(tmp_path):
    rows = chat_rows()[:6]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, meta = prep(tmp_path, input=str(src), format="chat", assistant_only_loss=True, seq_len=64)
    ids, mask = blocks(out)
    tok, _ = read_tokenizer(SAMPLE_TOK)
    trained = tok.decode([int(t) for t, m in zip(ids.ravel(), mask.ravel(), strict=True) if m],
                         skip_special_tokens=False)
    replies = "".join("".join(m["content"] for m in r["messages"] if m["role"] == "assistant")
                      + "<|endoftext|>" for r in rows)  # EOS closes each conversation
    assert replies.startswith(trained)  # concat: only the dropped tail can be missing
    assert meta["splits"]["train"]["loss_tokens"] == int(mask[:, 1:].sum())
    assert meta["columns"] == ["input_ids", "loss_mask"]


def test_pad_packing_one_row_per_block_truncated_and_masked(tmp_path):
    src = write_txt(tmp_path / "p.txt", LINES[:10])
    out, meta = prep(tmp_path, input=str(src), packing="pad", seq_len=40)
    ids, mask = blocks(out)
    rows = token_rows(LINES[:10])
    assert ids.shape == (10, 41)
    for row, block, m in zip(rows, ids, mask, strict=True):
        keep = min(len(row), 41)
        assert list(block[:keep]) == row[:keep] and m[:keep].all() and not m[keep:].any()
        assert (block[keep:] == 1).all()  # <|pad|>
    s = meta["splits"]["train"]
    assert s["tokens_in"] == sum(map(len, rows)) == s["tokens_in_blocks"] + s["tokens_truncated"]
    assert s["padding_tokens"] == 10 * 41 - s["tokens_in_blocks"]


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_same_input_gives_byte_identical_output(tmp_path):
    src = write_txt(tmp_path / "d.txt", LINES)
    a, _ = prep(tmp_path, "a", input=str(src), val_fraction=0.2)
    b, _ = prep(tmp_path, "b", input=str(src), val_fraction=0.2, num_proc=2, batch_size=7)
    assert _tree(a) == _tree(b)


def test_trained_tokenizer_is_saved_beside_the_blocks(tmp_path):
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in chat_rows()))
    out, meta = prep(tmp_path, input=str(src), format="chat", tokenizer=None, vocab_size=300)
    tok, config = read_tokenizer(out / "tokenizer")
    assert meta["tokenizer"]["vocab_size"] == 300 and config["eos_token"] == "<|endoftext|>"
    assert tok.encode("<|user|>x<|assistant|>").tokens[::2] == ["<|user|>", "<|assistant|>"]
    assert meta["tokenizer"]["source"].startswith("trained")


def test_one_file_per_split(tmp_path):
    out, _ = prep(tmp_path, input=str(write_txt(tmp_path / "d.txt", LINES)), val_fraction=0.1,
                  one_file_per_split=True)
    for split in ("train", "validation"):
        assert [p.name for p in (out / split).glob("*.arrow")] == ["data-00000-of-00001.arrow"]


def test_meta_records_config_and_sources(tmp_path):
    src = write_txt(tmp_path / "d.txt", LINES)
    out, meta = prep(tmp_path, input=str(src), val_fraction=0.1)
    assert meta["sources"] == [{"path": str(src.resolve()), "bytes": src.stat().st_size}]
    assert meta["config"]["seq_len"] == 16 and meta["config"]["val_fraction"] == 0.1
    assert "output" not in meta["config"] and meta["block_len"] == 17
    assert len(meta["tokenizer"]["sha256"]) == 64


def test_output_is_written_atomically(tmp_path, monkeypatch):
    src = str(write_txt(tmp_path / "d.txt", LINES))
    out, _ = prep(tmp_path, input=src)
    with pytest.raises(UserError, match="already exists"):
        prep(tmp_path, input=src)
    prep(tmp_path, input=src, seq_len=8, overwrite=True)
    assert json.loads((out / "meta.json").read_text())["seq_len"] == 8

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep_pipeline, "save_splits", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep(tmp_path, "never", input=src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.txt", "out"]  # no output, no temp dir
