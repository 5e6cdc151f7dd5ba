"""simulate=true for the full-size presets, side by side with the dry-run planner: docs/SCALE.md's table.

Each case runs `python train.py <overrides> simulate=true` in its own process (one fake process
group per process) and reads its simulation.json.

    .venv/bin/python bench/simulate_presets.py              # every case, a markdown table
    .venv/bin/python bench/simulate_presets.py --only moe_1b
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASES = {  # label -> train.py overrides
    "moe64_top2_gpu_dp2_ep8 (experiment)": ["experiment=moe64_top2_gpu_dp2_ep8"],
    "mixtral_8x7b_gpu_fsdp2 (experiment, fsdp2): 16 GPUs, ep 8, FSDP2 over 16": [
        "experiment=mixtral_8x7b_gpu_fsdp2"],
    "moe_1b, 1 GPU": ["hardware=gpu", "model=moe_1b", "trainer.devices=1", "trainer.micro_batch_size=4",
                      "data.seq_len=2048"],
    "mixtral_8x7b, 2x8 GPUs dp2_ep8": ["hardware=gpu", "model=mixtral_8x7b", "parallel=dp2_ep8",
                                       "trainer.devices=8", "trainer.num_nodes=2",
                                       "trainer.micro_batch_size=1", "data.seq_len=4096"],
    "deepseek_moe_16b + deepseek_v3 routing, 8 GPUs ep8": [
        "hardware=gpu", "model=deepseek_moe_16b", "moe_opt=deepseek_v3", "parallel.ep=8", "trainer.devices=8",
        "trainer.micro_batch_size=1", "data.seq_len=4096", "parallel.zero_stage=1"],
    "deepseek_v3_gpu_fsdp2 (experiment, fsdp2): 512 GPUs, ep 64": ["experiment=deepseek_v3_gpu_fsdp2"],
    "mixtral_8x22b_gpu_fsdp2 (experiment, fsdp2): 64 GPUs, tp 2 x ep 8, HSDP 16": [
        "experiment=mixtral_8x22b_gpu_fsdp2"],
    "mixtral_8x7b_trn2 (experiment, fsdp2): 128 trn2 cores, tp 4 x ep 8, HSDP 16": [
        "experiment=mixtral_8x7b_trn2"],
    # seed 003's 1T recipe, one rank of each kind of pipeline stage: first (embeddings, 4 micro-batches in
    # flight under 1F1B), second (3), last (LM head and loss, 1)
    **{f"switch_1t_gpu_fsdp2 (experiment, fsdp2 + pp 4, experts offloaded): rank {rank}": [
        "experiment=switch_1t_gpu_fsdp2", f"simulate_rank={rank}"] for rank in (0, 16, 48)},
}
# the kinds MemTracker files them under, and FSDPMemTracker (the fsdp2 backend)
KINDS = {"param": ("Parameter", "Sharded Param"), "act": ("Activation",), "optim": ("Optstate", "OptState")}
# (an offloading run's device figures leave out what sits in host memory: the "Host" entry)


def run_case(overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides, "simulate=true",
                               f"hydra.run.dir={tmp}"], cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{overrides} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        result = json.loads((Path(tmp) / "simulation.json").read_text())
        result["wall_s"] = time.perf_counter() - start
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the cases whose label contains this text")
    args = parser.parse_args()
    print("| case | world | params on the rank | simulated peak GiB (param / act / optim) | planner GiB "
          "| planner vs simulation | wall s |")
    print("|---|---|---|---|---|---|---|")
    for label, overrides in CASES.items():
        if args.only and args.only not in label:
            continue
        r = run_case(overrides)
        kinds = r["breakdown_gib"]
        parts = " / ".join(f"{sum(kinds.get(k, 0.0) for k in names):.1f}" for names in KINDS.values())
        share = f"{r['params_local'] / 1e9:.3f}B of {r['params_total'] / 1e9:.2f}B"
        print(f"| {label} | {r['world_size']} | {share} "
              f"| {r['peak_memory_gib']:.2f} ({parts}) | {r['planned_peak_memory_gib']:.2f} "
              f"| {100 * r['planner_error']:+.1f}% | {r['wall_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
