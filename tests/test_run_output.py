"""What a run shows a cluster user: each line once, a line per logged step in SLURM-style (non-TTY)
output and in train.log, a progress bar over optimizer steps, errors in train.log, the checkpoint a
resume starts from, last.ckpt as a link, and the optional loggers working from the command line."""
import os

import pytest
from conftest import run_entry

from moe.train import console
from moe.train.console import StepProgressBar, step_line

TINY = ["model.hidden_size=32", "model.intermediate_size=32", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "model.num_experts=4", "trainer.micro_batch_size=2", "data.seq_len=32",
        "optimizer.warmup_steps=1", "trainer.val_check_interval=100", "trainer.limit_val_batches=1"]


def train_cli(run_dir, *overrides, check=True, env=None):
    proc = run_entry("train.py", f"hydra.run.dir={run_dir}", *TINY, *overrides, timeout=300, check=check,
                     env=env)
    return proc, proc.stdout + proc.stderr


def test_non_tty_output_has_each_line_once_and_a_line_per_logged_step(tmp_path):
    run_dir = tmp_path / "run"
    _, out = train_cli(run_dir, "trainer.max_steps=6", "trainer.log_every_n_steps=2",
                       "trainer.checkpoint_every_n_steps=3", env={"OMP_NUM_THREADS": "1"})
    assert out.count("threads: 1 per process (OMP_NUM_THREADS=1)") == 1  # the environment's count wins
    assert out.count("GPU available") == 1 and out.count("`Trainer.fit` stopped") == 1  # was twice
    for noise in ("Epoch 0", "💡", "LeafSpec", "Traceback"):
        assert noise not in out, out
    steps = [line.split(" - ", 1)[1].split(" loss")[0]
             for line in out.splitlines() if "moe.train.steps" in line]
    assert steps == ["step 1/6", "step 2/6", "step 4/6", "step 6/6"]
    log = (run_dir / "train.log").read_text()
    assert "step 6/6 loss " in log and " lr " in log and " tok/s " in log and " drop " in log
    assert f"run dir: {run_dir}" in log and "GPU available" in log  # Lightning's too, via Hydra's handler

    # relaunch with more steps: says which checkpoint and step it resumes from, once, without Lightning's
    # "checkpoint directory is not empty" warning
    _, out = train_cli(run_dir, "trainer.max_steps=8", "trainer.log_every_n_steps=2",
                       "trainer.checkpoint_every_n_steps=3")
    assert f"resuming from {run_dir / 'checkpoints' / 'step-000006.ckpt'} at step 6" in out
    assert "exists and is not empty" not in out
    assert "resuming from" in (run_dir / "train.log").read_text()
    ckpts = run_dir / "checkpoints"
    assert os.readlink(ckpts / "last.ckpt") == "step-000008.ckpt"  # a link, not a second full copy
    assert sorted(p.name for p in ckpts.glob("*.ckpt") if not p.is_symlink()) == [
        "step-000006.ckpt", "step-000008.ckpt"]  # keep_last_checkpoints=2
    assert not (ckpts / "last.ckpt.meta.json").exists()


def test_an_error_after_the_run_started_is_also_in_train_log(tmp_path):
    run_dir = tmp_path / "run"
    proc, out = train_cli(run_dir, "optimizer.lr=1e30", "trainer.max_steps=20", "trainer.spike_factor=0",
                          "trainer.max_nonfinite_steps=2", check=False)
    assert proc.returncode == 2 and "Traceback" not in out, out
    error = next(line for line in proc.stderr.splitlines() if line.startswith("error: "))
    assert error.startswith("error: trainer.max_nonfinite_steps=2 reached")
    assert error in (run_dir / "train.log").read_text()
    assert not (run_dir / "summary.json").exists()


def test_the_progress_bar_counts_optimizer_steps_out_of_max_steps(tmp_path, monkeypatch):
    from test_spike_guard import config

    from moe.train.run import train

    bars = []
    monkeypatch.setattr(console, "bar_shown", lambda progress_bar: progress_bar)  # as on a terminal
    original = StepProgressBar.__init__
    monkeypatch.setattr(StepProgressBar, "__init__",
                        lambda self, *a, **kw: (bars.append(self), original(self, *a, **kw))[1])
    train(config("trainer.max_steps=3", "trainer.accumulate_grad_batches=2", "trainer.progress_bar=true"),
          tmp_path)
    (bar,) = bars
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.completed, task.total) == (3, 3)  # 6 batches, 3 optimizer steps: never "6/3"
    assert "step" in task.description and "Epoch" not in task.description


def test_step_line_reads_like_a_log_line():
    row = {"step": 40, "loss": 4.97312, "lr": 3e-4, "tokens_per_s": 4732.6, "drop_fraction": 0.0213,
           "grad_norm": float("nan")}
    assert step_line(row, 300) == "step 40/300 loss 4.9731 lr 3.00e-04 tok/s 4733 drop 2.1% grad_norm -"


@pytest.mark.parametrize("logger, made", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_optional_loggers_run_from_the_command_line(tmp_path, logger, made):
    """Their save_dir interpolates ${hydra:runtime.output_dir}, which train.py's preflight must resolve."""
    run_dir = tmp_path / "run"
    train_cli(run_dir, f"logger={logger}", "trainer.max_steps=2")
    assert any((run_dir / made).rglob("*")), sorted(p.name for p in run_dir.iterdir())
