"""With a real Lightning Trainer: checkpoint at step N, resume to 2N == one 2N run, batch for batch.

Checks what the DataModule relies on in Lightning 2.6: `load_state_dict` runs before the
train dataloader is built, and the fetcher counts resumed batches against `len()`.
"""
from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from moe.config import DataConfig
from moe.data import MoEDataModule

REPO = Path(__file__).resolve().parents[1]


class Recorder(L.LightningModule):
    """A bigram model that records the first token of every row of each batch (a step's) it trains on."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(512, 512)
        self.seen: list[list[int]] = []

    def training_step(self, batch, _):
        self.seen.append(batch["input_ids"][:, 0].tolist())
        logits = self.emb(batch["input_ids"])
        labels = batch["labels"].flatten()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels, ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path: Path, max_steps: int, stop_at: int | None = None, ckpt: str | None = None,
        cfg: DataConfig | None = None) -> list:
    cfg = cfg or DataConfig(path=str(REPO / "data/sample/train.txt"), tokenizer=str(REPO / "data/sample"))
    dm = MoEDataModule(cfg, micro_batch_size=2, accumulate_grad_batches=2, max_steps=max_steps, seed=7,
                       limit_val_batches=0)
    model = Recorder()
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=stop_at or 10**9, save_top_k=-1, save_last=True)
    trainer = L.Trainer(max_steps=stop_at or max_steps, accelerator="cpu",  # a batch is a step (2 x 2 rows)
                        devices=1, use_distributed_sampler=False, check_val_every_n_epoch=None,
                        limit_val_batches=0,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[checkpoints], num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    assert trainer.global_step == (stop_at or max_steps)
    return model.seen


def test_lightning_resume_continues_the_stream(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_DATA_CACHE", str(tmp_path / "cache"))
    full = fit(tmp_path / "a", max_steps=6)
    first = fit(tmp_path / "b", max_steps=6, stop_at=3)  # as if killed after the step-3 checkpoint
    rest = fit(tmp_path / "c", max_steps=6, ckpt=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    assert len(full) == 6 and all(len(rows) == 4 for rows in full) and first + rest == full


def test_lightning_resume_continues_a_streaming_stream(tmp_path, monkeypatch):
    """data.streaming=true (an IterableDataset, shuffled by a seeded buffer): the same kill and relaunch."""
    monkeypatch.setenv("MOE_DATA_CACHE", str(tmp_path / "cache"))
    cfg = DataConfig(path=str(REPO / "data/sample/train.txt"), tokenizer=str(REPO / "data/sample"),
                     streaming=True, shuffle_buffer=16)
    full = fit(tmp_path / "a", max_steps=6, cfg=cfg)
    first = fit(tmp_path / "b", max_steps=6, stop_at=3, cfg=cfg)
    rest = fit(tmp_path / "c", max_steps=6, ckpt=str(tmp_path / "b" / "ckpt" / "last.ckpt"), cfg=cfg)
    assert len(full) == 6 and all(len(rows) == 4 for rows in full) and first + rest == full
