"""The experts' weight layout: one MoE layer's training step (forward + backward) and decoding step (no-grad
forward of a few tokens) with the experts stored [E, in, out] and [E, out, in], per dtype.

    OMP_NUM_THREADS=1 python bench/expert_layout.py --dtype fp32 bf16 fp16
    ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 python bench/expert_layout.py  # as without bf16 instructions
    python bench/expert_layout.py --device cuda --dtype bf16 fp8 --train-tokens 16384 --hidden 4096 \
        --width 14336

fp8 is bf16 weights with moe_opt.fp8_experts (both grouped GEMMs in FP8: torch._scaled_grouped_mm on a card
with it, its emulation elsewhere, which says nothing about speed).

Both layouts hold the same weights and run the same code (torch._grouped_mm through
moe.model.moe.Experts); the layouts alternate run by run so the load of a shared machine hits both
alike. Figures: median and best wall ms, median CPU ms (this process) of --repeats runs after a warm-up.
"arranged" is the product's stored layout (moe.model.expert_layout.EXPERT_LAYOUT) after
moe.model.moe.arrange_for_generation (its memory in moe.model.expert_layout.kernel_order's order, its shape
and checkpoints unchanged), as generation runs it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from moe.config.schema import MoEOptConfig  # noqa: E402
from moe.model.expert_layout import EXPERT_LAYOUT, IN_OUT, OUT_IN, storing  # noqa: E402
from moe.model.moe import MoELayer, arrange_for_generation  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def layer(args, layout, name: str) -> MoELayer:
    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    torch.manual_seed(0)
    with storing(layout):
        moe = MoELayer(args.hidden, args.width, args.experts, args.top_k, opt, init_range=0.02)
    moe.monitor = False
    moe.experts.fp8 = name == "fp8"
    return moe.to(device=args.device, dtype=DTYPES[name])


def timed(fns: dict, repeats: int, device: torch.device) -> dict:
    """name -> (median wall ms, best wall ms, median CPU ms), the callables interleaved."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for fn in fns.values():
        fn()
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[k].append(1e3 * (time.perf_counter() - t0))
            cpu[k].append(1e3 * (time.process_time() - c0))
    return {k: (statistics.median(wall[k]), min(wall[k]), statistics.median(cpu[k])) for k in fns}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--width", type=int, default=1024, help="expert width (gate_up is [512, 2048] by default)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--train-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", choices=list(DTYPES), nargs="+", default=list(DTYPES))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    device = args.device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
        mkldnn = torch.backends.mkldnn.is_available()
        where = f"1 thread; oneDNN bf16 reported {mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported()}"
    else:
        where = torch.cuda.get_device_name(device)
    print(f"# torch {torch.__version__}, {where}; hidden {args.hidden}, expert width {args.width}, "
          f"{args.experts} experts top-{args.top_k}; stored default {list(EXPERT_LAYOUT.dims)}; median of "
          f"{args.repeats}")
    print("| dtype | step | tokens | [E, in, out] ms (best) | [E, out, in] ms (best) | "
          "stored, arranged ms (best) | CPU ms in_out / out_in / arranged |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(1)
    for name in args.dtype:
        dtype = DTYPES[name]
        io, oi = layer(args, IN_OUT, name), layer(args, OUT_IN, name)
        arranged = layer(args, EXPERT_LAYOUT, name)
        arrange_for_generation(arranged)
        x = torch.randn(1, args.train_tokens, args.hidden, generator=gen).to(device=device, dtype=dtype)

        def train(m, x=x):
            def step():
                m.zero_grad(set_to_none=True)
                m(x)[0].float().pow(2).mean().backward()
            return step

        r = timed({"io": train(io), "oi": train(oi)}, args.repeats, device)
        print(f"| {name} | fwd+bwd | {args.train_tokens} | {r['io'][0]:.2f} ({r['io'][1]:.2f}) | "
              f"{r['oi'][0]:.2f} ({r['oi'][1]:.2f}) | - | {r['io'][2]:.1f} / {r['oi'][2]:.1f} / - |",
              flush=True)
        for t in args.decode_tokens:
            xd = torch.randn(t, 1, args.hidden, generator=gen).to(device=device, dtype=dtype)

            def decode(m, xd=xd):
                @torch.no_grad()
                def step():
                    for _ in range(10):
                        m(xd, generating=True)
                return step

            r = timed({"io": decode(io), "oi": decode(oi), "ar": decode(arranged)}, args.repeats, device)
            print(f"| {name} | decode x10 | {t} | {r['io'][0]:.2f} ({r['io'][1]:.2f}) | {r['oi'][0]:.2f} "
                  f"({r['oi'][1]:.2f}) | {r['ar'][0]:.2f} ({r['ar'][1]:.2f}) | {r['io'][2]:.1f} / "
                  f"{r['oi'][2]:.1f} / {r['ar'][2]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
