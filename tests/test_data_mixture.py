"""Weighted mixtures (data.sources): proportions, determinism, exact resume, one source == data.path,
refusals."""
from __future__ import annotations

import csv

import numpy as np
import pytest
from conftest import REPO
from test_bad_inputs import assert_user_error, run_train
from test_data_resume import fit

from moe.config import DataConfig
from moe.config.schema import DataSource
from moe.data import MoEDataModule, prepare
from moe.data.sample_corpus import corpus_lines
from moe.data.sampler import StreamSampler
from moe.tools.report import load_run, report_run

SAMPLE_TOK = str(REPO / "data" / "sample")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Three prepared dirs of the sample tokenizer (seq_len 16), one of seq_len 32, one of another
    tokenizer."""
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for name, seed, seq_len, tok in (("a", 1, 16, SAMPLE_TOK), ("b", 2, 16, SAMPLE_TOK),
                                     ("c", 3, 16, SAMPLE_TOK),
                                     ("long", 4, 32, SAMPLE_TOK), ("other", 5, 16, None)):
        text = root / f"{name}.txt"
        text.write_text("\n".join(corpus_lines(seed=seed, num_docs=40 + 20 * seed)) + "\n")
        tokenizer = {"tokenizer": tok} if tok else {"vocab_size": 300}
        out[name] = prepare({"input": str(text), "output": str(root / name), "seq_len": seq_len,
                             "val_fraction": 0.1, **tokenizer}, progress=False)
    return out


def mixture(dirs, *names, weights=None, **extra) -> DataConfig:
    weights = weights or [1.0] * len(names)
    return DataConfig(kind="prepared", sources=[DataSource(path=str(dirs[n]), weight=w) for n, w in
                                                zip(names, weights, strict=True)], **extra)


def test_proportions_within_binomial_tolerance():
    sizes, weights, n = [700, 50, 3000], [0.5, 0.3, 0.2], 5000
    offsets = np.cumsum([0] + sizes[:-1])
    for start in (0, 123_456):  # from the start, and a window across a chunk boundary
        items = StreamSampler(sizes, 1, total=0, seed=9, weights=weights).items(np.arange(start, start + n))
        counts = np.bincount(np.searchsorted(offsets, items, side="right") - 1, minlength=3)
        for count, w in zip(counts, weights, strict=True):
            assert abs(count - n * w) <= 4 * np.sqrt(n * w * (1 - w)), (start, counts)
    # the 50-block source wrapped into new epochs: every block drawn, each about equally often
    items = StreamSampler(sizes, 1, total=0, seed=9, weights=weights).items(np.arange(n))
    small = np.bincount(items[(items >= 700) & (items < 750)] - 700, minlength=50)
    assert small.min() >= small.max() - 1


def test_seeded_stream_and_sharded_resume():
    sizes, weights = [40, 25, 60], [2.0, 1.0, 1.0]
    whole = StreamSampler(sizes, 1, total=0, seed=4, weights=weights).items(np.arange(600))
    again = StreamSampler(sizes, 1, total=0, seed=4, weights=weights).items(np.arange(600))
    other = StreamSampler(sizes, 1, total=0, seed=5, weights=weights).items(np.arange(600))
    assert (whole == again).all() and not (whole == other).all()
    # 5 steps of 3 rows x dp 2, then resumed at 4 rows x dp 3 from rows_consumed=30: the same stream
    first = [StreamSampler(sizes, 3, total=5, seed=4, dp_rank=r, dp_size=2, weights=weights)
             for r in range(2)]
    rest = [StreamSampler(sizes, 4, total=10, seed=4, dp_rank=r, dp_size=3, start_step=5, start_row=30,
                          weights=weights) for r in range(3)]
    seen = []
    for ranks in (first, rest):
        for steps in zip(*[list(s) for s in ranks], strict=True):
            seen += np.stack(steps, axis=1).ravel().tolist()  # rank r holds positions p + r, p + r + dp, ...
    assert seen == whole[:len(seen)].tolist()


def test_one_source_is_data_path_bit_for_bit(dirs):
    def batches(cfg):
        dm = MoEDataModule(cfg, micro_batch_size=4, accumulate_grad_batches=2, max_steps=30, seed=3,
                           limit_val_batches=2)
        dm.setup()
        return list(dm.train_dataloader()) + list(dm.val_dataloader())

    one = batches(mixture(dirs, "a"))
    path = batches(DataConfig(kind="prepared", path=str(dirs["a"])))
    assert len(one) == len(path) == 32
    for x, y in zip(one, path, strict=True):
        assert all(torch_equal(x[k], y[k]) for k in ("input_ids", "labels"))


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


def test_lightning_kill_and_relaunch_gives_the_same_mixed_stream(dirs, tmp_path):
    cfg = lambda: mixture(dirs, "a", "b", "c", weights=[0.5, 0.3, 0.2])  # noqa: E731
    full = fit(tmp_path / "a", max_steps=6, cfg=cfg())
    first = fit(tmp_path / "b", max_steps=6, stop_at=3, cfg=cfg())
    rest = fit(tmp_path / "c", max_steps=6, ckpt=str(tmp_path / "b" / "ckpt" / "last.ckpt"), cfg=cfg())
    assert len(full) == 6 and first + rest == full


@pytest.mark.parametrize("case", ["weight", "seq_len", "tokenizer", "both", "no_path", "online", "missing"])
def test_bad_mixtures_are_refused(dirs, tmp_path, case):
    a, b = dirs["a"], dirs["b"]
    overrides = {
        "weight": (f"data.sources=[{{path: {a}, weight: 0.7}}, {{path: {b}, weight: 0}}]",
                   "data.sources[1].weight", "0.0", "use a positive weight"),
        "seq_len": (f"data.sources=[{{path: {a}}}, {{path: {dirs['long']}}}]", "data.sources[1].path",
                    repr(str(dirs["long"])), "seq_len=16"),
        "tokenizer": (f"data.sources=[{{path: {a}}}, {{path: {dirs['other']}}}]", "data.sources[1].path",
                      repr(str(dirs["other"])), f"tokenizer={a / 'tokenizer'}"),
        "both": (f"data.sources=[{{path: {a}}}]", "data.path", repr(str(b)), "drop data.path"),
        "no_path": ("data.sources=[{weight: 1}]", "data.sources[0].path", "None", "data_prep.py output dir"),
        "online": (f"data.sources=[{{path: {a}}}]", "data.kind", "'online'", "train with data=prepared"),
        "missing": (f"data.sources=[{{path: {a}}}, {{path: {tmp_path / 'nowhere'}}}]", "data.sources[1].path",
                    repr(str(tmp_path / "nowhere")), "python data_prep.py"),
    }
    sources, field, value, fix = overrides[case]
    extra = {"both": ["data=prepared", f"data.path={b}"], "online": ["data=sample"]}.get(
        case, ["data=prepared"])
    code, err = run_train(tmp_path / "run", *extra, sources)
    assert_user_error(code, err, field, value, fix)
    assert not (tmp_path / "run").exists()


def test_validation_loss_per_source_in_metrics_csv(dirs, tmp_path):
    """Each source's validation batches are its own; metrics.csv has val_loss/<name> beside val_loss, whose
    micro-batches are theirs together (2 each here, so val_loss is their mean)."""
    sources = (f"data.sources=[{{path: {dirs['a']}, weight: 0.7}}, "
               f"{{path: {dirs['b']}, weight: 0.3, name: bee}}]")
    code, err = run_train(tmp_path / "run", "data=prepared", sources, "trainer.max_steps=2",
                          "trainer.val_check_interval=2", "trainer.limit_val_batches=2",
                          "trainer.micro_batch_size=2", "trainer.save_checkpoints=false",
                          "trainer.progress_bar=false")
    assert code == 0, err
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames[-2:] == ["val_loss/a", "val_loss/bee"]
        val = [r for r in reader if r["val_loss"]]
    assert [int(r["step"]) for r in val] == [2]
    a, b, both = (float(val[0][k]) for k in ("val_loss/a", "val_loss/bee", "val_loss"))
    assert 0 < a != b > 0 and both == pytest.approx((a + b) / 2, rel=1e-6)
    report_run(load_run(tmp_path / "run"))  # the run report lists them too
    text = (tmp_path / "run" / "report.md").read_text()
    table = f"## Validation loss by source\n\n| step | a | bee |\n|---|---|---|\n| 2 | {a:.4f} | {b:.4f} |"
    assert table in text
