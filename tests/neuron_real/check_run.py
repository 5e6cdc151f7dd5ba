"""After two train.py runs on neuronx-distributed's real code: `python check_run.py STRAIGHT RESUMED`.

STRAIGHT trained to the end; RESUMED started from STRAIGHT's first checkpoint (NxD's
load_checkpoint: weights, optimizer, Lightning's state). Checks, on one process:

- RESUMED's steps after the checkpoint log the same loss and gradient norm as STRAIGHT's;
- STRAIGHT's newest checkpoint, its tensor- (and expert-) parallel shards joined by
  moe/tools/convert_nxd.py into one portable file, evaluates every data-parallel rank's validation
  batches to the validation loss the run logged (the model NxD trained, read back without NxD);
- that file exported as a transformers Mixtral directory (safetensors; infer.py export_hf), loaded by
  transformers' MixtralForCausalLM, gives the validation loss of the same model without drops
  (Mixtral's routing is dropless): the experts of every expert-parallel rank are where Mixtral
  expects them.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from moe.data import MoEDataModule
from moe.infer.export import export_hf
from moe.infer.load import model_from_checkpoint
from moe.model.loss import lm_loss
from moe.parallel.dims import ParallelDims
from moe.tools.convert_nxd import convert

TOLERANCE = 1e-4  # relative: the run logged its validation loss from fp32 sums over ranks


def rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def validation_batches(cfg) -> list[dict]:
    """Every data-parallel rank's validation micro-batches, as the run's ranks read them."""
    dims = ParallelDims.from_config(OmegaConf.create(cfg))
    batches = []
    for dp_rank in range(dims.dp):
        data = MoEDataModule(cfg.data, micro_batch_size=cfg.trainer.micro_batch_size,
                             accumulate_grad_batches=cfg.trainer.accumulate_grad_batches,
                             max_steps=cfg.trainer.max_steps, seed=cfg.seed,
                             limit_val_batches=cfg.trainer.limit_val_batches, dims=dims,
                             dp_rank=dp_rank, dp_size=dims.dp)
        data.setup("validate")
        batches += list(data.val_dataloader())
    return batches


def main(straight: Path, resumed: Path) -> int:
    problems = []
    first = {r["step"]: r for r in rows(straight) if r["loss"]}
    again = {r["step"]: r for r in rows(resumed) if r["loss"]}
    for step, row in again.items():
        for key in ("loss", "grad_norm"):
            if row[key] != first[step][key]:
                problems.append(f"step {step} {key}: resumed {row[key]} vs straight {first[step][key]}")

    # beside the run, not in it: nothing is written into a run directory (moe.outputs)
    portable = convert(str(straight), f"{straight}-converted.ckpt", overwrite=True)
    model, cfg = model_from_checkpoint(portable)
    batches = validation_batches(cfg)
    logged = float([r["val_loss"] for r in rows(straight) if r["val_loss"]][-1])
    with torch.no_grad():
        ours = torch.stack([lm_loss(model(b["input_ids"]).logits_BSV, b["labels"]) for b in batches]).mean()
    if abs(ours.item() - logged) > TOLERANCE * abs(logged):
        problems.append(f"validation loss of the converted checkpoint {ours.item():.6f} vs logged "
                        f"{logged:.6f}")
    summary = f"validation loss logged {logged:.6f}, converted checkpoint {ours.item():.6f}"
    if cfg.model.position_encoding == "rope":  # what Mixtral's architecture holds
        from transformers import AutoModelForCausalLM

        from moe.parallel.apply import moe_layers

        hf_dir = export_hf(model, f"{straight}-hf", straight / "tokenizer", overwrite=True)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
        for layer in moe_layers(model):
            layer.eval_capacity_factor = None
        with torch.no_grad():
            dropless = torch.stack([lm_loss(model(b["input_ids"]).logits_BSV, b["labels"]) for b in batches])
            hf_loss = torch.stack([lm_loss(hf(b["input_ids"]).logits, b["labels"]) for b in batches])
        dropless, hf_loss, name = dropless.mean().item(), hf_loss.mean().item(), type(hf).__name__
        if abs(hf_loss - dropless) > 1e-5 * abs(dropless):
            problems.append(f"{name} from {hf_dir}: validation loss {hf_loss:.6f} vs ours without drops "
                            f"{dropless:.6f}")
        summary += f"; without drops {dropless:.6f}, transformers {name} {hf_loss:.6f}"
    print(f"summary: resumed steps {sorted(again, key=int)} match; {summary}" if not problems else
          "\n".join(f"problem: {p}" for p in problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
