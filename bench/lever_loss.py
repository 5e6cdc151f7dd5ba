"""A lever against today's path: the training loss, step by step, side by side (train.py twice, the lever
off and on, same seed and batches, once per precision; the figures from metrics.csv and summary.json).

- `moe_opt.weights_in_activation=true` (the default lever): the routing weight applied inside the experts'
  SwiGLU (Megatron-Core's weighted SwiGLU) is a reordering of the same product, so the question is only how
  far rounding carries two runs apart over training.
- `moe_opt.fp8_experts=true`: the experts' GEMMs in float8 e4m3 (emulated on the CPU: the card's numerics up
  to the order of its sums), bf16 around them; the question is what e4m3's resolution costs the loss.

    .venv/bin/python bench/lever_loss.py                              # CPU: 32-true and bf16-mixed, 200 steps
    .venv/bin/python bench/lever_loss.py --lever moe_opt.fp8_experts=true --precision bf16-mixed
    python3 bench/lever_loss.py --gpu --precision bf16-mixed          # on a GPU (bench/gpu_lease.sh)
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["trainer.log_every_n_steps=1", "trainer.progress_bar=false", "trainer.save_checkpoints=false"]


def losses(run_dir: Path, *overrides: str) -> tuple[list[float], dict]:
    """Every step's training loss and the summary of one train.py run."""
    command = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", *COMMON, *overrides]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
    with open(run_dir / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row["loss"]]
    return [float(row["loss"]) for row in rows], json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--precision", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--gpu", action="store_true", help="hardware=gpu (one device), else the CPU")
    parser.add_argument("--lever", default="moe_opt.weights_in_activation=true",
                        help="the train.py override whose loss goes beside today's")
    parser.add_argument("overrides", nargs="*", help="more train.py overrides, e.g. model=moe_1b")
    args = parser.parse_args()
    hardware = ["hardware=gpu", "trainer.devices=1"] if args.gpu else []
    print(f"{args.steps} steps of train.py {' '.join(hardware + args.overrides) or '(defaults)'}: training "
          f"loss today and with {args.lever}")
    print("| precision | loss at step 1 / 50% / last: today | ... with the lever | largest |diff| (step) "
          "| mean |diff| | val_loss today / lever | tokens/s today / lever |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="lever-loss-") as tmp:
        for precision in args.precision:
            common = [*hardware, f"trainer.max_steps={args.steps}", f"trainer.precision={precision}",
                      *args.overrides]
            today, s1 = losses(Path(tmp) / f"{precision}-today", *common)
            lever, s2 = losses(Path(tmp) / f"{precision}-lever", *common, args.lever)
            diffs = [abs(a - b) for a, b in zip(today, lever, strict=True)]
            worst = max(range(len(diffs)), key=diffs.__getitem__)
            marks = (0, len(today) // 2 - 1, len(today) - 1)
            print(f"| {precision} | {' / '.join(f'{today[i]:.4f}' for i in marks)} "
                  f"| {' / '.join(f'{lever[i]:.4f}' for i in marks)} | {diffs[worst]:.1e} ({worst + 1}) "
                  f"| {sum(diffs) / len(diffs):.1e} | {s1.get('final_val_loss') or float('nan'):.4f} / "
                  f"{s2.get('final_val_loss') or float('nan'):.4f} | {s1.get('tokens_per_s', 0):,.0f} / "
                  f"{s2.get('tokens_per_s', 0):,.0f} |")


if __name__ == "__main__":
    main()
