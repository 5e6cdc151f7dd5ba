"""MoEDataModule: offline == online, batches, deterministic sharding, exact resume, model checks."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from moe.config import DataConfig, ModelConfig
from moe.data import MoEDataModule, prepare
from moe.data.sample_corpus import chat_rows, corpus_lines
from moe.data.sampler import StreamSampler, validation_batches
from moe.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SAMPLE_TOK = str(REPO / "data" / "sample")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_DATA_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(corpus_lines(seed=5, num_docs=120)) + "\n")
    return path


def module(cfg: DataConfig, **kw) -> MoEDataModule:
    args = {"micro_batch_size": 4, "accumulate_grad_batches": 1, "max_steps": 6, "seed": 1234,
            "limit_val_batches": 3, **kw}
    dm = MoEDataModule(cfg, **args)
    dm.setup("fit")
    return dm


def batches(loader) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


def test_online_yields_the_same_blocks_and_batches_as_offline(tmp_path, corpus):
    out = prepare({"input": str(corpus), "output": str(tmp_path / "prep"), "tokenizer": SAMPLE_TOK,
                   "seq_len": 32, "val_fraction": 0.1, "seed": 9}, progress=False)
    offline = module(DataConfig(kind="prepared", path=str(out)))
    online = module(DataConfig(kind="online", path=str(corpus), tokenizer=SAMPLE_TOK, seq_len=32,
                               val_fraction=0.1, split_seed=9))
    for split in ("train", "validation"):
        a, b = offline.prepared.splits[split], online.prepared.splits[split]
        assert np.array_equal(a.get(np.arange(len(a)))[0], b.get(np.arange(len(b)))[0])
    assert same(batches(offline.train_dataloader()), batches(online.train_dataloader()))
    assert same(batches(offline.val_dataloader()), batches(online.val_dataloader()))
    assert offline.vocab_size == online.vocab_size == 512
    tok_bytes = (out / "tokenizer" / "tokenizer.json").read_bytes()
    assert (online.tokenizer_dir / "tokenizer.json").read_bytes() == tok_bytes


def test_online_cache_is_reused_and_keyed_by_the_input(tmp_path, corpus):
    cfg = DataConfig(kind="online", path=str(corpus), tokenizer=SAMPLE_TOK, seq_len=32)
    first = module(cfg)
    stamp = (first.dir / "meta.json").stat().st_mtime_ns
    again = MoEDataModule(cfg, 4, 1, 6, 1234, 3)
    assert again.meta is not None and again.dir == first.dir  # opened from cache at __init__
    assert (first.dir / "meta.json").stat().st_mtime_ns == stamp
    corpus.write_text(corpus.read_text() + "One more line.\n")
    assert MoEDataModule(cfg, 4, 1, 6, 1234, 3).dir != first.dir


def test_batches_are_shifted_blocks_with_masked_labels(tmp_path):
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in chat_rows()))
    dm = module(DataConfig(kind="online", path=str(src), format="chat", tokenizer=SAMPLE_TOK, seq_len=64,
                           assistant_only_loss=True, val_fraction=0.0), micro_batch_size=2)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 64)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    ids, mask = dm.prepared.splits["train"].get(dm.train_sampler().step_rows(0))
    assert torch.equal(batch["input_ids"], torch.from_numpy(ids[:, :-1]))
    expected = np.where(mask[:, 1:] == 1, ids[:, 1:], -100)
    assert torch.equal(batch["labels"], torch.from_numpy(expected))
    assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()
    eos = dm.prepared.meta["tokenizer"]["eos_id"]  # EOS ends a reply: it is a target
    assert (batch["labels"] == eos).sum() == (torch.from_numpy(ids[:, 1:]) == eos).sum()


def stream(sampler: StreamSampler) -> list[list[int]]:
    return [b.tolist() for b in sampler]


@pytest.mark.parametrize("dp_size", [1, 2])
def test_resume_continues_the_exact_sequence(dp_size):
    n_items, batch, n = 13, 3, 7  # 2n micro-batches cross several epochs
    for rank in range(dp_size):
        full = stream(StreamSampler(n_items, batch, total=2 * n, seed=5, dp_rank=rank, dp_size=dp_size))
        first = stream(StreamSampler(n_items, batch, total=n, seed=5, dp_rank=rank, dp_size=dp_size))
        rest = StreamSampler(n_items, batch, total=2 * n, seed=5, dp_rank=rank, dp_size=dp_size, start_step=n,
                             start_row=n * batch * dp_size)
        assert len(rest) == 2 * n  # Lightning counts the resumed batches as already fetched
        assert first + stream(rest) == full


@pytest.mark.parametrize("before, after", [((8, 1, 1), (4, 2, 1)), ((4, 1, 2), (2, 1, 4)),
                                           ((3, 2, 2), (2, 1, 1))],
                         ids=["micro 8 -> 4 x accumulate 2", "dp 2 -> dp 4",
                              "6 rows x dp 2 -> 2 rows on one rank"])
def test_a_resume_at_another_batch_geometry_goes_on_at_the_next_row(before, after):
    """The stream's position is rows consumed, so any (micro-batch, accumulation, dp) continues the same
    order of rows exactly: the rows of every rank's steps, concatenated in stream order, are the stream."""
    n_items, steps = 11, 4

    def rows_in_order(micro, accum, dp, total, start_step=0, start_row=0):
        ranks = [StreamSampler(n_items, micro * accum, total=total, seed=3, dp_rank=r, dp_size=dp,
                               start_step=start_step, start_row=start_row) for r in range(dp)]
        return [int(i) for parts in zip(*ranks, strict=True) for i in np.stack(parts, axis=1).reshape(-1)]

    first = rows_in_order(*before, total=steps)
    consumed = steps * before[0] * before[1] * before[2]
    rest = rows_in_order(*after, total=steps + 5, start_step=steps, start_row=consumed)
    whole = StreamSampler(n_items, 1, total=0, seed=3).items(np.arange(len(first) + len(rest)))
    assert first + rest == whole.tolist()


def test_stream_order_epochs_and_rank_sharding():
    n_items, batch, dp = 12, 3, 2
    ranks = [stream(StreamSampler(n_items, batch, total=4, seed=1, dp_rank=r, dp_size=dp)) for r in range(dp)]
    epoch0 = [i for step in range(2) for r in range(dp) for i in ranks[r][step]]
    epoch1 = [i for step in range(2, 4) for r in range(dp) for i in ranks[r][step]]
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))  # each epoch sees every block once
    assert epoch0 != epoch1  # reshuffled with seed + epoch
    perm0 = np.random.default_rng(1).permutation(12)
    interleaved = [perm0[j * dp + r] for r in range(dp) for j in range(6)]
    assert [i for r in range(dp) for step in range(2) for i in ranks[r][step]] == list(interleaved)
    no_shuffle = stream(StreamSampler(5, 2, total=3, seed=1, shuffle=False))
    assert no_shuffle == [[0, 1], [2, 3], [4, 0]]


def test_validation_is_fixed_sharded_and_limited():
    r0, r1 = (validation_batches(11, 2, limit=10, dp_rank=r, dp_size=2) for r in range(2))
    assert [b.tolist() for b in r0] == [[0, 2], [4, 6], [8]]
    assert [b.tolist() for b in r1] == [[1, 3], [5, 7], [9]]
    assert len(validation_batches(11, 2, limit=2)) == 2 and validation_batches(11, 2, limit=0) == []


@pytest.mark.parametrize("dp_size", [1, 2])
def test_datamodule_state_dict_resume_matches_an_uninterrupted_run(corpus, dp_size):
    cfg = DataConfig(kind="online", path=str(corpus), tokenizer=SAMPLE_TOK, seq_len=32)
    steps, accum = 4, 2
    for rank in range(dp_size):
        kw = {"accumulate_grad_batches": accum, "max_steps": 2 * steps, "dp_rank": rank, "dp_size": dp_size}
        dm = module(cfg, **kw)
        full = batches(dm.train_dataloader())
        assert len(full) == 2 * steps  # a batch is an optimizer step's rows: its micro-batches, in order
        stream = StreamSampler(len(dm.prepared.splits["train"]), 4, total=2 * steps * accum, seed=1234,
                               dp_rank=rank, dp_size=dp_size)
        for step, rows in enumerate(full):
            blocks = np.concatenate([stream.step_rows(step * accum + m) for m in range(accum)])
            ids = dm.prepared.splits["train"].get(blocks)[0]
            assert torch.equal(rows["input_ids"], torch.from_numpy(ids[:, :-1]))
        first = module(cfg, **kw)
        first.trainer = SimpleNamespace(global_step=0)
        first.train_dataloader()
        first.trainer.global_step = steps
        state = first.state_dict()
        assert state["rows_consumed"] == steps * accum * 4 * dp_size
        resumed = MoEDataModule(cfg, 4, **{**kw, "seed": 1234, "limit_val_batches": 3})
        resumed.setup("fit")
        resumed.load_state_dict(state)
        resumed.trainer = SimpleNamespace(global_step=steps)  # Lightning restores the step before the loader
        assert same(full[:steps] + batches(resumed.train_dataloader()), full)


def test_dp_ranks_default_to_the_trainer():
    cfg = OmegaConf.structured(DataConfig(path="data/sample/train.txt", tokenizer="data/sample"))
    dm = MoEDataModule(cfg, 4, 1, 2, 1234, 2)
    dm.trainer = SimpleNamespace(global_rank=1, world_size=2, global_step=0, strategy=SimpleNamespace())
    dm.setup("fit")
    assert (dm.dp_rank, dm.dp_size) == (1, 2)
    expected = StreamSampler(len(dm.prepared.splits["train"]), 4, 2, 1234, dp_rank=1, dp_size=2)
    assert [b.tolist() for b in dm.train_sampler()] == [expected.step_rows(i).tolist() for i in range(2)]


@pytest.mark.parametrize("rank, want", [(5, (0, 2)), (13, (1, 2))])
def test_dp_ranks_come_from_the_layout_under_tensor_parallelism(rank, want):
    """With TP 8 over 16 ranks, global rank 5 is data-parallel rank 0 of 2 (its TP group shares the
    batch) and rank 13 is rank 1, as NxD's [PP, DP, TP] order (moe.parallel.dims) puts them."""
    from moe.parallel.dims import ParallelDims

    cfg = OmegaConf.structured(DataConfig(path="data/sample/train.txt", tokenizer="data/sample"))
    dims = ParallelDims(world=16, tp=8, pp=1, ep=1, dp=2, sequence_parallel=True, zero_stage=1,
                        devices_per_node=32, micro_batch_size=4, accumulate_grad_batches=1, seq_len=128,
                        num_layers=4, num_experts=8)
    dm = MoEDataModule(cfg, 4, 1, 2, 1234, 2, dims=dims)
    dm.trainer = SimpleNamespace(global_rank=rank, world_size=16, global_step=0, strategy=SimpleNamespace())
    dm.setup("fit")
    assert (dm.dp_rank, dm.dp_size) == want


def test_sample_preset_loads_with_the_promised_shape():
    preset = OmegaConf.load(REPO / "conf" / "data" / "sample.yaml")
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), preset)
    dm = module(cfg, micro_batch_size=8)
    assert dm.vocab_size == 512 and dm.seq_len == 128
    assert len(dm.prepared.splits["train"]) > 1000 and len(dm.prepared.splits["validation"]) > 20
    dm.check_model(ModelConfig())  # the tiny model fits the sample


def test_check_model_names_the_fix(tmp_path, corpus):
    dm = MoEDataModule(DataConfig(kind="online", path=str(corpus), tokenizer=SAMPLE_TOK, seq_len=1024),
                       4, 1, 2, 1, 1)
    with pytest.raises(UserError, match="model.vocab_size=512") as err:
        dm.check_model(ModelConfig(vocab_size=256))
    assert err.value.field == "model.vocab_size"
    with pytest.raises(UserError, match="max_position_embeddings=1024"):
        dm.check_model(ModelConfig(max_position_embeddings=512))


def test_prepared_dir_checks(tmp_path, corpus, caplog):
    out = prepare({"input": str(corpus), "output": str(tmp_path / "prep"), "tokenizer": SAMPLE_TOK,
                   "seq_len": 32, "val_fraction": 0.1}, progress=False)
    cfg = OmegaConf.structured(DataConfig(kind="prepared", path=str(out), seq_len=128))
    dm = MoEDataModule(cfg, 4, 1, 2, 1, 1)
    assert dm.seq_len == cfg.seq_len == 32  # meta.json wins; cfg.data.seq_len follows it
    with pytest.raises(UserError, match="data.path") as err:
        MoEDataModule(DataConfig(kind="prepared", path=str(tmp_path / "nope")), 4, 1, 2, 1, 1)
    assert "data_prep.py" in err.value.fix
    other = tmp_path / "tok"
    other.mkdir()
    from moe.data.tokenizer import save_tokenizer, train_bpe

    save_tokenizer(train_bpe(["abc abd"] * 3, 260, ["<|endoftext|>"], show_progress=False), other,
                   eos="<|endoftext|>", pad=None)
    with pytest.raises(UserError, match="different vocabulary"):
        MoEDataModule(DataConfig(kind="prepared", path=str(out), tokenizer=str(other)), 4, 1, 2, 1, 1)
    tok_file = out / "tokenizer" / "tokenizer.json"
    tok_file.write_text(tok_file.read_text().replace("<|pad|>", "<|PAD|>"))
    with pytest.raises(UserError, match="changed since data_prep.py"):
        MoEDataModule(DataConfig(kind="prepared", path=str(out)), 4, 1, 2, 1, 1)


def test_online_errors_use_train_side_keys(tmp_path):
    with pytest.raises(UserError) as err:
        MoEDataModule(DataConfig(kind="online", path=str(tmp_path / "x.txt"), tokenizer=SAMPLE_TOK),
                      4, 1, 2, 1, 1)
    assert err.value.field == "data.path"
    with pytest.raises(UserError) as err:
        MoEDataModule(DataConfig(kind="online", path="data/sample/train.txt", tokenizer=None), 4, 1, 2, 1, 1)
    assert err.value.field == "data.tokenizer"
    with pytest.raises(UserError) as err:
        MoEDataModule(DataConfig(kind="streamed"), 4, 1, 2, 1, 1)
    assert err.value.field == "data.kind"
