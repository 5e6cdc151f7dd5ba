"""MoE layer forward+backward: this repo's layer vs transformers' Mixtral block, KARAKURI's published loop
and a dense floor, same weights, one table.

    .venv/bin/python bench/moe_layer.py            # H=1024 F=2816 E=8 T=4096 fp32, top-2 and top-1
    .venv/bin/python bench/moe_layer.py --quick    # small shapes, seconds

Time: median wall time of one forward + backward (y.backward(g)) after warm-up, its
minimum, and the median CPU seconds the step used (all threads of this process; steadier
than wall time when other jobs share the cores). The variants are interleaved round by
round in one process so contention from other processes hits them alike.
Memory, each variant in a fresh subprocess, one step after a warm-up:
  alloc  = peak bytes of torch tensors allocated during the step (parameter grads
           included), from the torch profiler's allocator events ("Total Allocated");
  rss    = peak RSS during the step minus RSS before it (VmHWM reset via
           /proc/self/clear_refs), i.e. what the OS saw, allocator caching included.
"diff" is the max abs difference of the output from this layer (dropless).

Variants:
  ours-dropless, ours-cf1.25  moe.moe_layer.MoELayer (sorted dispatch, grouped_mm or loop)
  hf-grouped_mm               transformers MixtralSparseMoeBlock, experts_implementation
                              "grouped_mm" (what a MixtralForCausalLM gets by default)
  hf-eager                    the same block with its eager per-expert loop (what a bare
                              block built from a config gets: no experts_implementation)
  karakuri                    a faithful copy of KARAKURI LM 8x7B's published layer, bugs included: each
                              expert's output is scaled by the SUM of the token's top-k
                              weights (not its own weight), no renormalisation, biased gate,
                              `self.num_experts` never set (we set it), k hard-coded to 2
                              (we pass k for the top-1 row)
  dense                       floor: one SwiGLU over the T*k routed rows, same shapes
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe.config import MoEOptConfig  # noqa: E402
from moe.model.moe import MoELayer, grouped_mm_works  # noqa: E402

VARIANTS = ["ours-dropless", "ours-cf1.25", "hf-grouped_mm", "hf-eager", "karakuri", "dense"]


# ---- KARAKURI LM 8x7B's MoE layer as published (only `self.num_experts` and `k` added so it runs) ----
class Expert(nn.Module):
    """The published code does not define Expert; Mixtral's SwiGLU (w1 gate, w3 up, w2 down)."""

    def __init__(self, hidden_size, expert_size):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, expert_size, bias=False)
        self.w3 = nn.Linear(hidden_size, expert_size, bias=False)
        self.w2 = nn.Linear(expert_size, hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class KarakuriPublishedMoELayer(nn.Module):
    def __init__(self, hidden_size, expert_size, num_experts, k=2):
        super().__init__()
        self.experts = nn.ModuleList([Expert(hidden_size, expert_size) for _ in range(num_experts)])
        self.gate = nn.Linear(hidden_size, num_experts)
        self.num_experts, self.k = num_experts, k  # not set in the published code

    def forward(self, x):
        logits = self.gate(x)  # [batch*seq_len, num_experts]
        weights = torch.softmax(logits, dim=-1)
        topk_weights, topk_indices = torch.topk(weights, k=self.k)
        # sparse compute
        output = torch.zeros_like(x)
        for expert_idx in range(self.num_experts):
            mask = (topk_indices == expert_idx).any(-1)
            if mask.any():
                expert_out = self.experts[expert_idx](x[mask])
                output[mask] += expert_out * topk_weights[mask].sum(-1, keepdim=True)
        return output


# ---- building every variant from the same weights ----
def make_weights(H, F_, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(E, H, generator=g) * 0.02,
        "gate_up": torch.randn(E, H, 2 * F_, generator=g) * 0.02,
        "down": torch.randn(E, F_, H, generator=g) * 0.02,
    }


def build(variant, w, k):
    """-> fn(x_TH) returning y_TH, and the module (for zeroing grads)."""
    E, H, F2 = w["gate_up"].shape
    F_ = F2 // 2
    if variant.startswith("ours"):
        cf = None if variant == "ours-dropless" else 1.25
        m = MoELayer(H, F_, E, k, MoEOptConfig(capacity_factor=cf, eval_capacity_factor=cf))
        with torch.no_grad():
            m.router.weight.copy_(w["router"])
            m.experts.gate_up.copy_(w["gate_up"])
            m.experts.down.copy_(w["down"])
        return (lambda x: m(x[None])[0][0]), m
    if variant.startswith("hf"):
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(hidden_size=H, intermediate_size=F_, num_local_experts=E, num_experts_per_tok=k)
        cfg._experts_implementation = variant.split("-", 1)[1]
        m = MixtralSparseMoeBlock(cfg)
        with torch.no_grad():
            m.gate.weight.copy_(w["router"])
            m.experts.gate_up_proj.copy_(w["gate_up"].transpose(1, 2))
            m.experts.down_proj.copy_(w["down"].transpose(1, 2))
        return (lambda x: m(x[None])[0]), m
    if variant == "karakuri":
        m = KarakuriPublishedMoELayer(H, F_, E, k)
        with torch.no_grad():
            m.gate.weight.copy_(w["router"])
            m.gate.bias.zero_()
            for e, ex in enumerate(m.experts):
                ex.w1.weight.copy_(w["gate_up"][e, :, :F_].T)
                ex.w3.weight.copy_(w["gate_up"][e, :, F_:].T)
                ex.w2.weight.copy_(w["down"][e].T)
        return m, m
    if variant == "dense":
        m = nn.ParameterDict({k_: nn.Parameter(w[k_][0].clone()) for k_ in ("gate_up", "down")})

        def dense(x):
            x_NH = x.repeat_interleave(k, dim=0)
            gate, up = (x_NH @ m["gate_up"]).chunk(2, dim=-1)
            return ((F.silu(gate) * up) @ m["down"]).view(x.shape[0], k, -1).sum(1)

        return dense, m
    raise ValueError(variant)


def step(fn, module, x, g):
    module.zero_grad(set_to_none=True)
    x.grad = None
    y = fn(x)
    y.backward(g)
    return y


# ---- memory: one variant per fresh process ----
def _rss_mib():
    s = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\s+(\d+)", s).group(1)) / 1024 for k in ("VmRSS", "VmHWM")}


def measure_memory(variant, shape):
    T, H, F_, E, k = shape
    w = make_weights(H, F_, E)
    fn, module = build(variant, w, k)
    del w
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    step(fn, module, x, g)  # warm-up (lazy init, grouped_mm probe)
    module.zero_grad(set_to_none=True)
    x.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_mib()["VmRSS"]
    step(fn, module, x, g)
    rss = _rss_mib()["VmHWM"] - before
    module.zero_grad(set_to_none=True)
    x.grad = None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(fn, module, x, g)
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        events = json.load(open(tmp.name))["traceEvents"]
    alloc = max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")
    return {"alloc_mib": alloc / 2**20, "rss_mib": rss}


# ---- time: all variants in one process, interleaved ----
def measure_time(variants, shape, warmup, iters):
    T, H, F_, E, k = shape
    w = make_weights(H, F_, E)
    built = {v: build(v, w, k) for v in variants}
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    outs = {}
    for r in range(warmup + iters):
        for v in variants:
            t0, c0 = time.perf_counter(), time.process_time()
            y = step(*built[v], x, g)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if r >= warmup:
                times[v].append(dt)
                cpu[v].append(dc)
            outs[v] = y.detach()
        print(f"  round {r + 1}/{warmup + iters}: " + ", ".join(f"{v} {times[v][-1]:.2f}s" for v in variants
              if times[v] and r >= warmup), file=sys.stderr, flush=True)
    ref = outs.get("ours-dropless")
    res = {}
    for v in variants:
        diff = float((outs[v] - ref).abs().max()) if ref is not None and v != "dense" else float("nan")
        res[v] = {"median_s": statistics.median(times[v]), "min_s": min(times[v]),
                  "cpu_s": statistics.median(cpu[v]), "diff": diff}
    return res


def keep_freed_memory():
    """mallopt(M_MMAP_MAX, 0) and a huge M_TRIM_THRESHOLD: freed blocks stay in the heap for reuse."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4
    ok = libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 2**40)
    if not ok:
        raise RuntimeError("mallopt failed (not glibc?)")


def machine(keep_freed: bool):
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gmm = grouped_mm_works(torch.device("cpu"), torch.float32)
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"python {platform.python_version()}, grouped_mm fp32 usable: {gmm}, "
        f"page faults per step: {'avoided (--keep-freed-memory)' if keep_freed else 'glibc default'}"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes (H=256 F=512 T=512)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--top-k", type=int, nargs="+", default=[2, 1])
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant memory subprocesses")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice). 1 is steadiest on a shared machine: "
                   "with more threads than free cores, OpenMP barriers spin and inflate every op")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="glibc: no mmap for big blocks, no trimming, so freed tensors are reused instead of "
                   "returned to the OS and page-faulted back in every step (what jemalloc/tcmalloc do)")
    p.add_argument("--_memory", nargs=2, metavar=("VARIANT", "SHAPE_JSON"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.keep_freed_memory:
        keep_freed_memory()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a._memory:
        print(json.dumps(measure_memory(a._memory[0], json.loads(a._memory[1]))))
        return

    H, F_, E, T = (256, 512, 8, 512) if a.quick else (1024, 2816, 8, 4096)
    print(f"machine: {machine(a.keep_freed_memory)}")
    for k in a.top_k:
        shape = [T, H, F_, E, k]
        print(f"\nH={H} F={F_} E={E} k={k} T={T} fp32, forward+backward, "
              f"median of {a.iters} after {a.warmup} warm-up")
        res = measure_time(a.variants, shape, a.warmup, a.iters)
        if not a.no_memory:
            for v in a.variants:
                out = subprocess.run(
                    [sys.executable, __file__, "--_memory", v, json.dumps(shape)]
                    + (["--threads", str(a.threads)] if a.threads else [])
                    + (["--keep-freed-memory"] if a.keep_freed_memory else []),
                    capture_output=True, text=True, check=True,
                )
                res[v].update(json.loads(out.stdout.strip().splitlines()[-1]))
        dense = res.get("dense")
        print("| variant | median s | min s | CPU s | vs dense (median / CPU) | alloc MiB | rss MiB | diff |")
        print("|---|---|---|---|---|---|---|---|")
        for v in a.variants:
            r = res[v]
            rel = "-"
            if dense:
                rel = f"{r['median_s'] / dense['median_s']:.2f}x / {r['cpu_s'] / dense['cpu_s']:.2f}x"
            mem = f"{r.get('alloc_mib', float('nan')):.0f} | {r.get('rss_mib', float('nan')):.0f}"
            diff = "-" if r["diff"] != r["diff"] else f"{r['diff']:.1e}"
            times = f"{r['median_s']:.3f} | {r['min_s']:.3f} | {r['cpu_s']:.3f}"
            print(f"| {v} | {times} | {rel} | {mem} | {diff} |")


if __name__ == "__main__":
    main()
