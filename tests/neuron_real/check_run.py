"""After two train.py runs on neuronx-distributed's real code: `python check_run.py STRAIGHT RESUMED`.

STRAIGHT trained to the end; RESUMED started from STRAIGHT's first checkpoint (NxD's
load_checkpoint: weights, optimizer, Lightning's state). Checks, on one process:

- RESUMED's steps after the checkpoint log the same loss and gradient norm as STRAIGHT's;
- STRAIGHT's newest checkpoint, its tensor-parallel shards joined by moe/tools/consolidate.py into
  one portable file, evaluates the validation batches to the validation loss the run logged
  (the model NxD trained, read back without NxD).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from moe.config.layout import Layout
from moe.data import MoEDataModule
from moe.infer.load import model_from_checkpoint
from moe.model.loss import lm_loss
from moe.tools.convert_nxd import convert


def rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def main(straight: Path, resumed: Path) -> int:
    problems = []
    first = {r["step"]: r for r in rows(straight) if r["loss"]}
    again = {r["step"]: r for r in rows(resumed) if r["loss"]}
    for step, row in again.items():
        for key in ("loss", "grad_norm"):
            if row[key] != first[step][key]:
                problems.append(f"step {step} {key}: resumed {row[key]} vs straight {first[step][key]}")

    portable = convert(str(straight), str(straight / "converted.ckpt"))
    model, cfg = model_from_checkpoint(portable)
    data = MoEDataModule(
        cfg.data,
        micro_batch_size=cfg.trainer.micro_batch_size,
        accumulate_grad_batches=cfg.trainer.accumulate_grad_batches,
        max_steps=cfg.trainer.max_steps,
        seed=cfg.seed,
        limit_val_batches=cfg.trainer.limit_val_batches,
        layout=Layout.from_config(OmegaConf.create(cfg)),
        dp_rank=0,
        dp_size=1,
    )
    data.setup("validate")
    with torch.no_grad():
        losses = [lm_loss(model(b["input_ids"]).logits_BSV, b["labels"]) for b in data.val_dataloader()]
    ours = torch.stack(losses).mean().item()
    logged = float([r["val_loss"] for r in rows(straight) if r["val_loss"]][-1])
    if abs(ours - logged) > 1e-4 * abs(logged):
        problems.append(f"validation loss of the converted checkpoint {ours:.6f} vs logged {logged:.6f}")
    print(
        f"resumed steps {sorted(again, key=int)} match; converted checkpoint validation loss {ours:.6f}, "
        f"logged {logged:.6f}"
        if not problems
        else "\n".join(problems)
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
