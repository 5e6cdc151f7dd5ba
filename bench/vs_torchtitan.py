"""Our MoE layer beside torchtitan 0.3.0's, on the same shapes and weights, on this CPU (docs/BENCHMARKS.md).

torchtitan is not a dependency (its pins conflict with ours: datasets < 4.8); install it and the few modules
its MoE layer imports into a directory of their own, then run:

    .venv/bin/pip install --target .bench-deps --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro \
        docstring_parser triton
    PYTHONPATH=.bench-deps .venv/bin/python bench/vs_torchtitan.py

Both layers: Mixtral-style top-2 softmax routing renormalised over the two picks, SwiGLU experts through
torch._grouped_mm, dropless, one process, bf16 weights (torchtitan's experts compute in bf16 whatever the
weights; ours in the weights' dtype; our router in fp32, theirs in the weights'). Same expert and router
weights (ours gate|up and down in moe.model.expert_layout's order, theirs w1/w3 [E, F, H] and w2 [E, H, F]).
`--expert-layout in_out out_in` measures ours with the experts stored [E, in, out] (the default) and
[E, out, in] (torchtitan's order, what torch._scaled_grouped_mm wants for FP8), one row each; without
torchtitan installed only our rows are printed. Columns: forward
+ backward wall time (median of repeats), aten ops and host syncs in one forward + backward
(moe.tools.syncs), the GPU kernels it launches (torch.profiler; on a GPU only), peak memory of the step
(torch's MemTracker on the CPU, what the tensors would hold on a device; the allocator's peak on a GPU),
and a short training run's losses (each layer fits the same frozen random teacher from the same start).
`--compile` compiles both: ours as model.compile=true does (MoELayer.compile_regions), torchtitan's whole
layer fullgraph, as it compiles its blocks; dispatch modes do not trace, so ops, syncs and the CPU's peak are
not counted then.
Ours is measured twice: as on a training step that metrics.csv does not log (no routing statistics: no loss
term reads them here, the coefficients are 0 as torchtitan's load_balance_coeff=None), and as on a logged
step (the drop, load and entropy numbers and the per-expert counts metrics.csv records), which torchtitan's
forward never computes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from moe.model.expert_layout import IN_OUT, OUT_IN, ExpertLayout, storing  # noqa: E402
from moe.tools.syncs import counting_syncs  # noqa: E402

LAYOUTS = {"in_out": IN_OUT, "out_in": OUT_IN}


def ours(hidden: int, width: int, experts: int, top_k: int, seed: int, monitor: bool = False,
         compiled: bool = False, layout: ExpertLayout = IN_OUT):
    """Our layer, its experts stored in `layout`; `monitor`: as on a logged step (MoELayer.monitor);
    `compiled`: its regions compiled as model.compile=true compiles them (MoELayer.compile_regions)."""
    from moe.config.schema import MoEOptConfig
    from moe.model.moe import MoELayer

    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    torch.manual_seed(seed)
    with storing(layout):
        layer = MoELayer(hidden, width, experts, top_k, opt, init_range=0.02)
    layer.experts.use_grouped_mm = True
    layer.monitor = monitor
    if compiled:
        layer.compile_regions()
    return layer.to(torch.bfloat16)


def theirs(layer, hidden: int, width: int, experts: int, top_k: int, compiled: bool = False):
    """torchtitan's MoE holding `layer`'s weights; `compiled`: fullgraph, as torchtitan compiles each block
    (torchtitan/distributed/compile.py:70)."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    config = MoE.Config(
        num_experts=experts, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=hidden, hidden_dim=width, num_experts=experts),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=experts, top_k=top_k)),
        router=TokenChoiceTopKRouter.Config(num_experts=experts, top_k=top_k, score_func="softmax",
                                            route_norm=True,
                                            gate=Linear.Config(in_features=hidden, out_features=experts)))
    moe = config.build().to(torch.bfloat16)
    with torch.no_grad():
        experts = layer.experts
        w1, w3 = OUT_IN.split_gate_up(experts.layout.to_out_in(experts.gate_up.detach()))
        inner = moe.routed_experts.inner_experts
        inner.w1_EFD.copy_(w1)
        inner.w3_EFD.copy_(w3)
        inner.w2_EDF.copy_(experts.layout.to_out_in(experts.down.detach()))
        moe.router.gate.weight.copy_(layer.router.weight.detach())
    if compiled:
        moe.compile(fullgraph=True)
    return moe


def run(module, x):
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def measure(name, module, x, repeats: int, compiled: bool = False) -> dict:
    """`compiled`: the op counter and the CPU's MemTracker are dispatch modes, under which dynamo does not
    trace: the ops, syncs and the CPU's peak are left out ("-")."""
    from torch.distributed._tools.mem_tracker import MemTracker

    cuda = x.device.type == "cuda"

    def step():
        module.zero_grad(set_to_none=True)
        run(module, x).float().pow(2).mean().backward()
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up (grouped_mm probe, allocator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    kernels = device_kernels(step) if cuda else "-"
    ops = syncs = "-"
    if not compiled:  # (fullgraph code under a dispatch mode raises)
        with counting_syncs() as counter:
            step()
        ops, syncs = counter.ops, len(counter.syncs)
    if cuda:  # what the card's allocator held at the step's peak, the weights and their gradients included
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = torch.cuda.max_memory_allocated()
    elif compiled:  # MemTracker is a dispatch mode too
        peak = None
    else:
        tracker = MemTracker()
        tracker.track_external(module, x)
        with tracker:
            step()
        peak = max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    return {"name": name, "ms": 1e3 * statistics.median(times), "ops": ops, "syncs": syncs,
            "kernels": kernels, "peak_mib": "-" if peak is None else f"{peak / 2**20:.1f}"}


def device_kernels(step) -> int:
    """GPU kernels one forward + backward launches (torch.profiler): what fusion saves, eager or compiled."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
    return sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA)


def fit(module, teacher, steps: int, tokens: int, hidden: int, device) -> list[float]:
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x = torch.randn(1, tokens, hidden, generator=gen).to(device, torch.bfloat16)
        with torch.no_grad():
            target = teacher(x.float())
        loss = (run(module, x).float() - target).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--width", type=int, default=896)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (make gpu-check)")
    parser.add_argument("--compile", action="store_true",
                        help="both compiled: ours as model.compile=true does, torchtitan's fullgraph as its "
                             "blocks (ops, syncs and the CPU's peak not counted: their trackers run eager)")
    parser.add_argument("--expert-layout", nargs="+", choices=sorted(LAYOUTS), default=["in_out"],
                        help="how our experts are stored: in_out [E, in, out] (the default), out_in "
                             "[E, out, in]; several: a row each")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    h, f, e, k, device = args.hidden, args.width, args.experts, args.top_k, torch.device(args.device)
    c = args.compile
    layouts = [LAYOUTS[name] for name in args.expert_layout]
    mine = ours(h, f, e, k, seed=0, compiled=c, layout=layouts[0]).to(device)
    try:
        titan = theirs(mine, h, f, e, k, compiled=c).to(device)
    except ImportError as err:  # not a dependency (see above)
        titan, note = None, f"torchtitan not measured ({err})"
    x = torch.randn(1, args.tokens, h, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    if titan is not None:
        with torch.no_grad():
            diff = (run(mine, x).float() - run(titan, x).float()).abs().max().item()
        note = f"outputs differ by {diff:.2e} at most (the routers' dtypes)"
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{card}, torch {torch.__version__}; shapes: hidden {h}, expert width {f}, {e} experts top-{k}, "
          f"{args.tokens} tokens, bf16{', both compiled' if c else ''}; {note}")
    columns = ("layer", "fwd+bwd ms", "aten ops", "host syncs", "GPU kernels", "peak MiB",
               "loss at step 1 / 10 / last")
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    torch.manual_seed(3)
    teacher = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.Tanh(), torch.nn.Linear(h, h)).to(device)
    rows = []
    for layout in layouts:
        dims = "[E, " + ", ".join(layout.dims[1:]) + "]"

        def fresh(monitor=False, layout=layout):
            return ours(h, f, e, k, 0, monitor=monitor, compiled=c, layout=layout).to(device)

        rows += [(f"ours (moe.model.moe.MoELayer), experts {dims}", fresh(), fresh),
                 (f"ours, a logged step (+ routing statistics), experts {dims}", fresh(monitor=True),
                  lambda fresh=fresh: fresh(monitor=True))]
    if titan is not None:
        rows.append(("torchtitan 0.3.0 (models.common.moe.MoE)", titan,
                     lambda: theirs(ours(h, f, e, k, seed=0), h, f, e, k, compiled=c)))
    for name, module, fresh in rows:
        row = measure(name, module, x, args.repeats, compiled=c)
        losses = fit(fresh().to(device), teacher, args.steps, args.tokens // 4, h, device)
        cells = (row["name"], f"{row['ms']:.1f}", row["ops"], row["syncs"], row["kernels"], row["peak_mib"],
                 f"{losses[0]:.4f} / {losses[9]:.4f} / {losses[-1]:.4f}")
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
