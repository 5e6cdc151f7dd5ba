"""A short CPU run writes the run-dir contract (metrics.csv, summary.json, checkpoints) and learns."""
import csv
import json

import pytest
import torch
from conftest import trained_rows

from moe.train.metrics import METRIC_COLUMNS

SHORT = ("trainer.max_steps=40", "trainer.val_check_interval=20", "trainer.checkpoint_every_n_steps=20")


def rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_short_run_writes_outputs_and_loss_falls(train_run):
    run_dir, proc = train_run(*SHORT)
    for noise in ("litlogger", "LeafSpec"):  # known Lightning/torch noise is filtered out
        assert noise not in proc.stdout + proc.stderr
    with open(run_dir / "metrics.csv", newline="") as f:
        assert next(csv.reader(f)) == METRIC_COLUMNS
    train = trained_rows(run_dir)
    assert [int(r["step"]) for r in train] == list(range(1, 41))
    first, last = float(train[0]["loss"]), float(train[-1]["loss"])
    assert last < first - 1.0, f"loss did not fall: {first} -> {last}"
    for r in train:
        assert float(r["lm_loss"]) <= float(r["loss"])
        assert 0.9 < float(r["aux_loss"]) < 2.0  # 1.0 = balanced (Switch normalisation)
        assert 0.0 <= float(r["drop_fraction"]) <= 1.0
        assert float(r["tokens_per_s"]) > 0 and float(r["grad_norm"]) > 0 and float(r["lr"]) > 0
        counts = json.loads(r["tokens_per_expert"])
        assert len(counts) == 4 and all(len(layer) == 8 for layer in counts)  # tiny: 4 MoE layers, 8 experts
        assert all(sum(layer) == 2 * int(r["tokens_per_forward"]) for layer in counts)  # top-2
    val = [r for r in rows(run_dir) if r["val_loss"]]
    assert [int(r["step"]) for r in val] == [20, 40]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40
    assert summary["final_loss"] == pytest.approx(last)
    assert summary["best_loss"] <= summary["final_loss"]
    assert summary["final_val_loss"] == pytest.approx(float(val[-1]["val_loss"]))
    assert summary["tokens_seen"] == 40 * 8 * 128
    assert summary["tokens_per_s"] > 0 and summary["peak_memory_mib"] > 0
    assert summary["config"]["model.name"] == "tiny" and summary["config"]["moe_opt.capacity_factor"] == 1.25

    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 40
    assert (run_dir / ".hydra" / "config.yaml").exists()


@pytest.mark.slow  # two processes
def test_two_process_ddp_run(train_run, tmp_path):
    """Also: the val_loss Lightning's loggers and callbacks get is metrics.csv's, the mean over both ranks."""
    probe = tmp_path / "val_loss"
    run_dir, proc = train_run("parallel=dp2", "trainer.devices=2", "trainer.max_steps=20",
                              "trainer.micro_batch_size=4", "trainer.val_check_interval=10",
                              "+callbacks.val_probe._target_=tests._val_probe.ValLossProbe",
                              f"+callbacks.val_probe.path={probe}", timeout=600)
    logged = [json.loads(probe.with_name(f"val_loss.{rank}.json").read_text()) for rank in (0, 1)]
    in_csv = [float(r["val_loss"]) for r in rows(run_dir) if r["val_loss"]]
    assert len(in_csv) == 2 and logged[0] == logged[1] == pytest.approx(in_csv, abs=1e-6)
    assert "sync_dist=True" not in proc.stderr + proc.stdout  # Lightning's warning about a rank's own value
    train = trained_rows(run_dir)
    assert [int(r["step"]) for r in train] == list(range(1, 21))
    assert float(train[-1]["loss"]) < float(train[0]["loss"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tokens_seen"] == 20 * 2 * 4 * 128  # global batch = micro 4 x dp 2
