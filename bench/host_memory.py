"""Peak host RAM of building the model, per rank: the meta-device build against the eager one.

Each case runs in a fresh process, which joins a fake process group of `world` ranks as rank 0
(torch's "fake" backend: the collectives return at once, the tensors are real), builds the run's
LitMoE through its backend (`Backend.build_module`, on the meta device), and parallelises it
(`Backend.parallelize`: experts sharded, then only this rank's shard materialised and filled).
The "eager" case is what training did before: the whole fp32 model built on every rank, then
sharded. Reported: the process's peak resident set (ru_maxrss), parameters held.

    .venv/bin/python bench/host_memory.py
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled (the child below inserts it too)
MODEL = ["model=tiny", "model.vocab_size=32000", "model.hidden_size=1024", "model.intermediate_size=2816",
         "model.num_layers=8", "model.num_heads=16", "model.num_kv_heads=4", "model.num_experts=8"]
CASES = {  # label -> (world, ep, eager)
    "eager build, 1 process (before)": (1, 1, True),
    "meta build, 1 process": (1, 1, False),
    "eager build, rank 0 of ep2 (before)": (2, 2, True),
    "meta build, rank 0 of ep2": (2, 2, False),
    "meta build, rank 0 of ep4": (4, 4, False),
}

CHILD = r"""
import json, resource, sys, time
import torch, torch.distributed as dist
from hydra import compose, initialize_config_dir
from torch.testing._internal.distributed.fake_pg import FakeStore
sys.path.insert(0, {repo!r})
import moe.config
from moe.backends import build_backend
from moe.module.lit_moe import LitMoE
from moe.train.run import settle

world, ep, eager = {world}, {ep}, {eager}
with initialize_config_dir(config_dir={conf!r}, version_base="1.3"):
    cfg = compose("train", overrides={overrides!r} + [f"parallel.ep={{ep}}", f"trainer.devices={{world}}",
                                                     f"hardware.devices_per_node={{world}}"])
settled = settle(cfg)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
torch.set_num_threads(2)
start = time.perf_counter()
backend = build_backend(settled.config, settled.dims)
module = LitMoE(backend) if eager else backend.build_module()
backend.parallelize(module)
seconds = time.perf_counter() - start
held = sum(p.numel() for p in module.parameters())
print(json.dumps({{"maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "params": held, "seconds": seconds}}))
"""


def run_case(world: int, ep: int, eager: bool) -> dict:
    code = CHILD.format(repo=str(REPO), conf=str(REPO / "conf"), overrides=MODEL, world=world, ep=ep,
                        eager=eager)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    print("| case | parameters held | peak host RSS GiB | build s |")
    print("|---|---|---|---|")
    for label, (world, ep, eager) in CASES.items():
        r = run_case(world, ep, eager)
        row = f"| {label} | {r['params'] / 1e9:.3f}B | {r['maxrss_gib']:.2f} | {r['seconds']:.1f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
