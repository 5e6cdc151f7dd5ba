"""data.streaming: blocks packed from the files as training reads them are data_prep.py's blocks, split,
ordered and sharded as the offline stream is, and a resume at another batch geometry goes on at the next
row."""
from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_cfg

from moe.config import DataConfig
from moe.config.validate import validate
from moe.data import MoEDataModule, prepare
from moe.data.arrow_io import load_prepared
from moe.data.sample_corpus import chat_rows, corpus_lines
from moe.data.sampler import StreamSampler
from moe.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[1]
SAMPLE_TOK = str(REPO / "data" / "sample")
VAL = 5


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_DATA_CACHE", str(tmp_path / "cache"))


def two_files(tmp_path: Path, chat: bool) -> str:
    """Two input files (a stream crosses from one to the next), as a glob."""
    if chat:
        rows = [json.dumps(r) for r in chat_rows()]
        parts = [rows[:9], rows[9:]]
        name = "part{}.jsonl"
    else:
        lines = corpus_lines(seed=5, num_docs=40)
        parts = [lines[:15], lines[15:]]
        name = "part{}.txt"
    for k, part in enumerate(parts):
        (tmp_path / name.format(k)).write_text("\n".join(part) + "\n")
    return str(tmp_path / name.format("*"))


def streaming_module(cfg: DataConfig, **kw) -> MoEDataModule:
    args = {"micro_batch_size": 2, "accumulate_grad_batches": 1, "max_steps": 4, "seed": 3,
            "limit_val_batches": 100, "dp_rank": 0, "dp_size": 1, **kw}
    dm = MoEDataModule(cfg, **args)
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_blocks_are_the_offline_blocks(tmp_path, chat):
    """shuffle=false: validation is the offline blocks [0, VAL), training every later block in order, over
    more than one pass; batches (inputs, labels with masks) equal the offline ones bit for bit."""
    path, seq_len = two_files(tmp_path, chat), 16 if chat else 24
    chat_keys = {"format": "chat", "assistant_only_loss": True} if chat else {}
    out = prepare({"input": path, "output": str(tmp_path / "prep"), "tokenizer": SAMPLE_TOK,
                   "val_fraction": 0.0, "seq_len": seq_len, **chat_keys}, progress=False)
    offline = load_prepared(out).splits["train"]
    n = len(offline)
    cfg = DataConfig(kind="online", path=path, tokenizer=SAMPLE_TOK, streaming=True, shuffle=False,
                     streaming_val_blocks=VAL, seq_len=seq_len, **chat_keys)
    rows = 2 * 3
    steps = (n - VAL) // rows + 3  # past the end of a pass: the next pass starts over
    dm = streaming_module(cfg, micro_batch_size=2, accumulate_grad_batches=3, max_steps=steps)
    assert dm.meta["tokenizer"]["vocab_size"] == load_prepared(out).meta["tokenizer"]["vocab_size"]
    train = list(dm.train_dataloader())
    val = list(dm.val_dataloader())
    want_val = [offline.get(np.arange(k, min(k + 2, VAL))) for k in range(0, VAL, 2)]
    assert [b["input_ids"].tolist() for b in val] == [ids[:, :-1].tolist() for ids, _ in want_val]
    sampler = StreamSampler(n - VAL, rows, total=steps, seed=3, shuffle=False)
    order = VAL + sampler.items(np.arange(steps * rows))
    assert order.max() == n - 1 and (np.diff(order) < 0).any()  # a whole pass, and the next begun
    for step, batch in enumerate(train):
        ids, mask = offline.get(order[step * rows:(step + 1) * rows])
        labels = ids[:, 1:].copy()
        if mask is not None:
            labels[mask[:, 1:] == 0] = -100
        assert torch.equal(batch["input_ids"], torch.from_numpy(ids[:, :-1]))
        assert torch.equal(batch["labels"], torch.from_numpy(labels))
    assert len(train) == steps
    if chat:  # assistant_only_loss: the masks travel with the blocks
        assert (torch.cat([b["labels"] for b in train]) == -100).any()


def rows_seen(cfg: DataConfig, micro: int, accum: int, dp: int, steps: int, start_step: int = 0,
              start_row: int = 0) -> list[list[int]]:
    """The rows (first four tokens of each) every rank trains on, step by step, in stream order."""
    out = [[] for _ in range(start_step, steps)]
    for rank in range(dp):
        dm = streaming_module(cfg, micro_batch_size=micro, accumulate_grad_batches=accum, max_steps=steps,
                              dp_rank=rank, dp_size=dp)
        dm.start_row = start_row
        dm.trainer = type("T", (), {"global_step": start_step})()
        for k, batch in enumerate(dm.train_dataloader()):
            for j, row in enumerate(batch["input_ids"][:, :4].tolist()):
                out[k].append((j * dp + rank, row))
    return [[row for _, row in sorted(step)] for step in out]


def test_streaming_resume_at_another_geometry_continues_the_shuffled_stream(tmp_path):
    """shuffle=true (a seeded buffer): 3 steps at micro 2 x accum 2 x dp 2 (24 rows), then a relaunch from
    rows_consumed at micro 3 x accum 1 x dp 1 trains exactly the next rows of one uninterrupted stream."""
    path = two_files(tmp_path, chat=False)
    cfg = DataConfig(kind="online", path=path, tokenizer=SAMPLE_TOK, streaming=True, shuffle=True,
                     shuffle_buffer=8, streaming_val_blocks=VAL, seq_len=24)
    first = rows_seen(cfg, micro=2, accum=2, dp=2, steps=3)
    dm = streaming_module(cfg, micro_batch_size=2, accumulate_grad_batches=2, max_steps=3, dp_size=2)
    dm.trainer = type("T", (), {"global_step": 0})()
    dm.train_dataloader()
    dm.trainer.global_step = 3
    state = dm.state_dict()
    assert state["rows_consumed"] == 24
    resumed = MoEDataModule(cfg, 3, 1, max_steps=10, seed=3, limit_val_batches=0, dp_rank=0, dp_size=1)
    resumed.setup("fit")
    resumed.load_state_dict(state)
    rest = rows_seen(cfg, micro=3, accum=1, dp=1, steps=10, start_step=0, start_row=resumed.start_row)
    whole = [ids[:4].tolist() for ids, _, _ in islice(dm.stream.train(), 24 + 30)]
    assert sum(first, []) + sum(rest, []) == whole
    in_order = DataConfig(kind="online", path=path, tokenizer=SAMPLE_TOK, streaming=True, shuffle=False,
                          streaming_val_blocks=VAL, seq_len=24)
    assert whole != [ids[:4].tolist() for ids, _, _ in islice(streaming_module(in_order).stream.train(), 54)]


@pytest.mark.parametrize("override, field", [
    (["data.kind=prepared", "data.path=/x"], "data.kind"),
    (["data.num_workers=2"], "data.num_workers"),
    (["data.streaming_val_blocks=-1"], "data.streaming_val_blocks"),
    (["data.shuffle_buffer=0"], "data.shuffle_buffer"),
])
def test_streaming_refusals_name_the_field(override, field):
    cfg = compose_cfg("data.streaming=true", *override)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.field == field


def test_streaming_start_up_names_a_wrong_column_and_a_short_corpus(tmp_path):
    """The first batch of rows is read at start-up: a missing column or a corpus shorter than one block is
    refused there, under its data.* key, not in the middle of training."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "some words here"}\n' * 4)
    cfg = DataConfig(kind="online", path=str(rows), tokenizer=SAMPLE_TOK, streaming=True, seq_len=8)
    with pytest.raises(UserError) as err:
        streaming_module(cfg)
    assert err.value.field == "data.text_column"
    short = tmp_path / "short.txt"
    short.write_text("a few words\n")
    cfg = DataConfig(kind="online", path=str(short), tokenizer=SAMPLE_TOK, streaming=True, seq_len=64)
    with pytest.raises(UserError) as err:
        streaming_module(cfg)
    assert err.value.field == "data.seq_len"
