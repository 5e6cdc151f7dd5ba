"""moe_opt.weights_in_activation against today's combine: the training loss, step by step, side by side.

The routing weight applied inside the experts' SwiGLU (Megatron-Core's weighted SwiGLU) is a reordering of
the same product, so the question is only how far rounding carries two runs apart over training. Each
pair is `python train.py` twice on the bundled data (same seed, same batches), once per precision, with
`trainer.log_every_n_steps=1`; the figures come from their metrics.csv and summary.json.

    .venv/bin/python bench/weights_in_activation.py                   # CPU: 32-true and bf16-mixed, 200 steps
    python3 bench/weights_in_activation.py --gpu --precision bf16-mixed   # on a GPU (bench/gpu_lease.sh)
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
    parser.add_argument("overrides", nargs="*", help="more train.py overrides, e.g. model=moe_1b")
    args = parser.parse_args()
    hardware = ["hardware=gpu", "trainer.devices=1"] if args.gpu else []
    print(f"{args.steps} steps of train.py {' '.join(hardware + args.overrides) or '(defaults)'}: training "
          "loss with the weights at the combine (today) and in the SwiGLU (weights_in_activation=true)")
    print("| precision | loss at step 1 / 50% / last: today | ... folded | largest |diff| (step) "
          "| mean |diff| | val_loss today / folded | tokens/s today / folded |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="weights-in-activation-") as tmp:
        for precision in args.precision:
            common = [*hardware, f"trainer.max_steps={args.steps}", f"trainer.precision={precision}",
                      *args.overrides]
            today, s1 = losses(Path(tmp) / f"{precision}-today", *common)
            folded, s2 = losses(Path(tmp) / f"{precision}-folded", *common,
                                "moe_opt.weights_in_activation=true")
            diffs = [abs(a - b) for a, b in zip(today, folded, strict=True)]
            worst = max(range(len(diffs)), key=diffs.__getitem__)
            marks = (0, len(today) // 2 - 1, len(today) - 1)
            print(f"| {precision} | {' / '.join(f'{today[i]:.4f}' for i in marks)} "
                  f"| {' / '.join(f'{folded[i]:.4f}' for i in marks)} | {diffs[worst]:.1e} ({worst + 1}) "
                  f"| {sum(diffs) / len(diffs):.1e} | {s1.get('final_val_loss') or float('nan'):.4f} / "
                  f"{s2.get('final_val_loss') or float('nan'):.4f} | {s1.get('tokens_per_s', 0):,.0f} / "
                  f"{s2.get('tokens_per_s', 0):,.0f} |")


if __name__ == "__main__":
    main()
