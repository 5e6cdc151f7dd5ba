"""Each GPU experiment preset's layout: which groups stay on a node's NVLink and which cross nodes, and
the expert-matmul work per token before and after folding EP with TP (docs/SCALE.md, section 4).

From the configs alone (moe.parallel.dims.ParallelDims, the planner's groups; nothing runs):

    .venv/bin/python bench/scale_layouts.py

Expert-matmul FLOPs per token: forward + backward (3 x the forward's 2 x 3 x hidden x expert width
multiply-adds per routed expert) over every MoE layer, summed over the ranks that compute them. Without
folding every TP rank of a group pushes the same tokens through whole experts (moe/parallel/
tensor_parallel.py before issue J): tp times the work; folded, each TP rank routes its own share.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from moe.config.size import param_breakdown  # noqa: E402
from moe.parallel.dims import ParallelDims  # noqa: E402
from moe.train.preflight import compose_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PRESETS = ["moe64_top2_gpu_dp2_ep8", "mixtral_8x7b_gpu_fsdp2", "mixtral_8x22b_gpu_fsdp2",
           "deepseek_v3_gpu_fsdp2", "switch_1t_gpu_fsdp2"]


def expert_gflops_per_token(cfg) -> float:
    m = cfg.model
    routed = m.top_k * 3 * m.hidden_size * m.intermediate_size  # gate, up, down
    return 3 * 2 * routed * param_breakdown(m).num_moe_layers / 1e9


def layout(name: str) -> dict:
    cfg, _ = compose_config([f"experiment={name}"], str(REPO / "conf"), "train")
    dims = ParallelDims.from_config(cfg)
    groups = [g for g in dims.rank_groups() if g.size > 1]
    spans = {g.name: max(dims.nodes_spanned(ranks) for ranks in g.ranks) for g in groups}
    nvlink = [f"{g.name} {g.size}" for g in groups if spans[g.name] == 1]
    across = [f"{g.name} {g.size} ({spans[g.name]} nodes)" for g in groups if spans[g.name] > 1]
    flops = expert_gflops_per_token(cfg)
    unfolded = flops * (dims.tp if dims.tp > 1 else 1)
    return {"preset": name, "world": f"{dims.nodes} x {dims.devices_per_node}",
            "degrees": f"pp {dims.pp} x dp {dims.dp} x tp {dims.tp}, ep {dims.ep}",
            "nvlink": ", ".join(nvlink) or "-", "across": ", ".join(across) or "-",
            "before": unfolded, "after": flops}


def main() -> None:
    print("| preset | nodes x GPUs | degrees | groups on one node (NVLink) | groups across nodes | "
          "expert GFLOP/token unfolded | folded |")
    print("|---|---|---|---|---|---|---|")
    for name in PRESETS:
        r = layout(name)
        print(f"| `{r['preset']}` | {r['world']} | {r['degrees']} | {r['nvlink']} | {r['across']} | "
              f"{r['before']:.1f} | {r['after']:.1f} |")


if __name__ == "__main__":
    main()
