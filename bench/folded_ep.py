"""EP folded with TP against unfolded TP: one training step's time and expert rows, 4 ranks on this CPU.

Layout: 4 gloo ranks, dp 2 x tp 2, ep 2 (EP groups of 2 consecutive ranks), FSDP2, float32, dropless.
Both variants are the fsdp2 backend's own parallelize steps (moe.backends.fsdp2.backend.fsdp2_plan) in the
same processes, steps interleaved (folded, unfolded, folded, ...): `folded` splits each MoE layer's
tokens over the TP pair (moe.parallel.token_shard); `unfolded` is the same with the split off, what
the backend did before: both TP ranks route and compute every token. Figures: medians over --steps
of a forward + backward (rank 0's wall time), and the rows a MoE layer's experts multiply, summed over
the 4 ranks.

    .venv/bin/python bench/folded_ep.py                # markdown table
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import compose_cfg, on_gloo_ranks  # noqa: E402

WORLD, TP, EP, MICRO, SEQ = 4, 2, 2, 2, 256
MODEL = ("model.vocab_size=1024", "model.hidden_size=256", "model.intermediate_size=1024",
         "model.num_layers=2", "model.num_heads=8", "model.num_kv_heads=2", "model.num_experts=8",
         "model.top_k=2")


def _cfg():
    return compose_cfg("hardware=cpu_fsdp2", f"parallel.tp={TP}", f"parallel.ep={EP}",
                       f"trainer.devices={WORLD}", f"hardware.devices_per_node={WORLD}",
                       f"trainer.micro_batch_size={MICRO}", f"data.seq_len={SEQ}", "moe_opt=dropless", *MODEL)


def _rank(rank: int, steps: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moe.backends.fsdp2.backend import fsdp2_plan
    from moe.model.model import MoETransformer
    from moe.model.moe import Experts
    from moe.parallel.dims import ParallelDims
    from moe.parallel.parallelize import parallelize

    cfg = _cfg()
    dims = ParallelDims.from_config(cfg)
    meshes = dims.meshes("cpu")
    models, rows = {}, {"folded": [], "unfolded": []}
    for name in rows:
        with torch.device("meta"):
            model = MoETransformer(cfg.model, cfg.moe_opt, init_seed=7)
        steps_ = fsdp2_plan(cfg.moe_opt, cfg.parallel, cfg.hardware, dims, meshes, MixedPrecisionPolicy(),
                             "cpu", None)
        if name == "unfolded":
            steps_.token_group = None
        parallelize(model, cfg.model, cfg.parallel, TP, steps_)
        for module in model.modules():
            if isinstance(module, Experts):
                module.register_forward_hook(lambda m, args, out, n=name: rows[n].append(int(args[1].sum())))
        models[name] = model
    gen = torch.Generator().manual_seed(dims.dp_rank(rank))
    ids = torch.randint(0, cfg.model.vocab_size, (MICRO, SEQ + 1), generator=gen)
    times = {name: [] for name in models}
    for step in range(steps + 1):  # the first step of each warms up
        for name, model in models.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            out = model(ids[:, :-1], labels_BS=ids[:, 1:])
            out.loss.backward()
            torch.distributed.barrier()
            if step:
                times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    layers = cfg.model.num_layers
    return {name: {"seconds": statistics.median(times[name]),
                   "rows_per_step": sum(rows[name][:layers]) // layers} for name in models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    out = on_gloo_ranks(WORLD, _rank, args.steps)
    tokens = WORLD // TP * MICRO * SEQ
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; dp {WORLD // TP} x tp {TP}, ep {EP}, {tokens} tokens per step, top-2\n")
    print("| variant | step s (fwd+bwd, rank 0) | expert rows per MoE layer, all ranks "
          "| rows / (tokens x k) |")
    print("|---|---|---|---|")
    for name in ("folded", "unfolded"):
        rows = sum(out[r][name]["rows_per_step"] for r in range(WORLD))
        print(f"| {name} | {out[0][name]['seconds']:.3f} | {rows:,} | {rows / (tokens * 2):.2f} |")


if __name__ == "__main__":
    main()
