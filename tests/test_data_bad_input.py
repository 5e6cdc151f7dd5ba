"""Every bad-input case gives one clear UserError (field, value, fix) or, with on_bad_row=skip, a count."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe.data import prepare
from moe.data.sample_corpus import corpus_lines
from moe.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SAMPLE_TOK = str(REPO / "data" / "sample")
LINES = corpus_lines(seed=11, num_docs=30)


def prep(tmp_path: Path, **cfg) -> dict:
    cfg = {"tokenizer": SAMPLE_TOK, "seq_len": 16, "val_fraction": 0.0, "output": str(tmp_path / "out"),
           **cfg}
    out = prepare(cfg, progress=False)
    return json.loads((out / "meta.json").read_text())


def fails(tmp_path: Path, match: str, **cfg) -> UserError:
    with pytest.raises(UserError, match=match) as err:
        prep(tmp_path, **cfg)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]
    return err.value


def jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_missing_file(tmp_path):
    err = fails(tmp_path, "does not exist", input=str(tmp_path / "nope.jsonl"))
    assert err.field == "input"


def test_glob_without_matches(tmp_path):
    fails(tmp_path, "matches no files", input=str(tmp_path / "*.jsonl"))


def test_unsupported_and_mixed_file_types(tmp_path):
    (tmp_path / "a.xml").write_text("<a/>")
    fails(tmp_path, "unsupported file type", input=str(tmp_path / "a.xml"))
    (tmp_path / "b.txt").write_text("hello\n")
    jsonl(tmp_path / "c.jsonl", [{"text": "x"}])
    fails(tmp_path, "mixes file types", input=[str(tmp_path / "b.txt"), str(tmp_path / "c.jsonl")])


def test_empty_file_and_empty_dataset(tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    fails(tmp_path, "empty", input=str(tmp_path / "e.jsonl"))
    (tmp_path / "blank.txt").write_text("\n\n\n")
    fails(tmp_path, "no usable rows", input=str(tmp_path / "blank.txt"))


def test_missing_column_names_the_columns_found(tmp_path):
    src = jsonl(tmp_path / "d.jsonl", [{"body": line} for line in LINES])
    err = fails(tmp_path, r"columns: \['body'\]", input=src)
    assert err.field == "text_column"
    fails(tmp_path, "needs a `messages` column", input=src, format="chat")


def test_undecodable_bytes_error_names_the_line_and_skip_counts_it(tmp_path):
    src = tmp_path / "bad.txt"
    src.write_bytes(("\n".join(LINES[:5]) + "\n").encode() + b"caf\xe9 au lait\n" + LINES[5].encode() + b"\n")
    err = fails(tmp_path, "undecodable bytes on line 6", input=str(src))
    assert "on_bad_row=skip" in err.fix
    meta = prep(tmp_path, input=str(src), on_bad_row="skip")
    assert meta["rows"]["skipped"] == {"undecodable_bytes": 1}
    assert meta["rows"]["read"] == 7 and meta["rows"]["used"] == 6


def test_broken_json_line_error_and_skip(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in LINES[:4]) + '{"text": "unterminated\n')
    fails(tmp_path, "bad json on line 5", input=str(src))
    meta = prep(tmp_path, input=str(src), on_bad_row="skip")
    assert meta["rows"]["skipped"] == {"bad_json": 1} and meta["rows"]["used"] == 4


def test_rows_missing_fields_error_or_skip_with_reasons(tmp_path):
    rows = [{"text": t} for t in LINES[:10]] + [{"other": 1}, {"text": ""}, {"text": LINES[10]}]
    src = jsonl(tmp_path / "d.jsonl", rows)
    err = fails(tmp_path, "2 bad rows", input=src)
    assert "row 10 (0-based, in file order): missing_field" in str(err)
    meta = prep(tmp_path, input=src, on_bad_row="skip")
    assert meta["rows"]["skipped"] == {"empty_text": 1, "missing_field": 1}
    assert meta["rows"]["used"] == 11


def test_chat_rows_missing_fields(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"role": "user", "content": "no reply"}]},
            {"messages": None}]
    src = jsonl(tmp_path / "c.jsonl", rows)
    fails(tmp_path, "no_assistant_reply", input=src, format="chat", seq_len=4)
    meta = prep(tmp_path, input=src, format="chat", on_bad_row="skip", seq_len=4)
    assert meta["rows"]["skipped"] == {"missing_field": 1, "no_assistant_reply": 1}


def test_hub_name_offline_says_to_pass_a_local_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = fails(tmp_path, "not reachable", input="HuggingFaceH4/no_robots", format="chat")
    assert "pass a local path" in err.fix


def test_seq_len_longer_than_the_data(tmp_path):
    src = jsonl(tmp_path / "d.jsonl", [{"text": "tiny"}])
    err = fails(tmp_path, "fewer than one block", input=src, seq_len=4096)
    assert err.field == "seq_len"


@pytest.mark.parametrize("cfg, field", [
    ({"format": "xml"}, "format"),
    ({"packing": "zip"}, "packing"),
    ({"on_bad_row": "ignore"}, "on_bad_row"),
    ({"val_fraction": 1.0}, "val_fraction"),
    ({"tokenizer": None}, "tokenizer"),
    ({"vocab_size": 300}, "tokenizer"),
    ({"format": "chat", "chat_template": "{prompt} only"}, "chat_template"),
    ({"assistant_only_loss": True}, "assistant_only_loss"),
    ({"seq_length": 5}, "seq_length"),
])
def test_bad_config_values(tmp_path, cfg, field):
    src = jsonl(tmp_path / "d.jsonl", [{"text": "x"}])
    with pytest.raises(UserError) as err:
        prep(tmp_path, input=src, **cfg)
    assert err.value.field == field and err.value.fix


def test_cli_prints_one_paragraph_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "data_prep.py"), f"input={tmp_path}/missing.jsonl",
                           f"output={tmp_path}/out", f"tokenizer={SAMPLE_TOK}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: input=") and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no .hydra/ or log litter


@pytest.mark.parametrize("suffix", ["jsonl", "csv", "tsv", "txt"])
def test_bytes_that_are_not_utf8_inside_a_field_are_found_before_parsing(tmp_path, suffix):
    """pyarrow parses such a JSON string (or CSV field) and the row broke tokenization later with a
    traceback: the byte check finds it first. error names the line; skip drops it; repair keeps the row
    with U+FFFD for the bad bytes; both counted in meta.json."""
    texts = [t.replace(",", " ").replace("\t", " ").replace('"', "") for t in LINES[:8]]
    if suffix == "jsonl":
        rows, bad = [json.dumps({"text": t}) for t in texts], b'{"text": "caf\xe9 au lait"}'
    else:
        rows, bad = (["text"] if suffix in ("csv", "tsv") else []) + texts, b"caf\xe9 au lait"
    src = tmp_path / f"bad.{suffix}"
    src.write_bytes("".join(r + "\n" for r in rows[:4]).encode() + bad + b"\n"
                    + "".join(r + "\n" for r in rows[4:]).encode())
    err = fails(tmp_path, "has undecodable bytes on line 5 ", input=str(src))
    assert "on_bad_row=repair" in err.fix
    skipped = prep(tmp_path, input=str(src), on_bad_row="skip", overwrite=True)
    assert skipped["rows"]["skipped"] == {"undecodable_bytes": 1} and skipped["rows"]["used"] == 8
    repaired = prep(tmp_path, input=str(src), on_bad_row="repair", overwrite=True)
    assert repaired["rows"]["repaired"] == {"undecodable_bytes": 1} and repaired["rows"]["skipped"] == {}
    assert repaired["rows"]["used"] == 9
