"""Tokens/s and peak memory of a full training step (forward, backward, AdamW): ours vs transformers.

For each shape: the same config, the same weights (`from_hf` of the HF model), the same batch, the
same process, and both with torch's fused AdamW (transformers' Trainer default for torch >= 2.8,
training_args.py:806-811; ours: moe.module.optim.build_optimizer). Steps are interleaved (A, B, C,
A, B, C, ...) so a neighbour loading the CPU hurts every variant alike; figures are medians over
--steps of wall time. Both losses include the load-balance loss (HF: output_router_logits=True +
labels; ours: as LitMoE.micro_batch_loss, the chunked LM head + cross-entropy plus the router terms). Each row
also shows where the step's time goes (forward / backward / optimizer) and the step's peak memory
(torch's MemTracker, one extra step per variant).

    .venv/bin/python bench/train_step.py                 # every shape, markdown tables
    .venv/bin/python bench/train_step.py --shapes small  # one shape
    .venv/bin/python bench/train_step.py --compile       # also our model with apply_compile
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.config import MoEOptConfig  # noqa: E402
from moe.config.size import param_breakdown  # noqa: E402
from moe.hf import from_hf  # noqa: E402
from moe.module.optim import FUSED_ADAMW_DEVICES  # noqa: E402
from moe.parallel.apply import apply_compile  # noqa: E402

# name -> (hidden, intermediate, layers, heads, kv heads, experts, top_k, vocab, seq, batch)
SHAPES = {
    "small": (256, 512, 4, 8, 2, 8, 2, 8192, 256, 4),
    "wide-vocab": (512, 1024, 2, 8, 2, 8, 2, 32000, 256, 4),
    "top1-1k-vocab": (1024, 2048, 2, 16, 4, 8, 1, 1024, 256, 2),
    "deep": (384, 768, 8, 6, 2, 4, 2, 4096, 128, 4),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="add a row for our model with apply_compile")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--hf-experts", default=None, help="transformers experts_implementation")
    return p.parse_args()


def hf_step(model, opt, ids, split):
    t0 = time.perf_counter()
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    t1 = time.perf_counter()
    out.loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    split.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return out.loss.detach()


def our_step(model, opt, ids, split):
    """As LitMoE.micro_batch_loss computes it: labels shifted by the data module (-100 at the end)."""
    t0 = time.perf_counter()
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    out = model(ids, labels_BS=labels)
    loss = out.loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    split.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return loss.detach()


def peak_mib(model, opt, step, ids) -> float:
    """Peak of everything live during one step (weights, grads, optimizer state, activations)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step(model, opt, ids, [])
    return max(kinds["Total"] for kinds in tracker.get_tracker_snapshot("peak").values()) / 2**20


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"python {platform.python_version()}")


def bench_shape(name: str, args) -> list[str]:
    from transformers import MixtralConfig, MixtralForCausalLM

    hidden, inter, layers, heads, kv, experts, k, vocab, seq, batch = SHAPES[name]
    torch.manual_seed(0)
    hf_cfg = MixtralConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, num_local_experts=experts, num_experts_per_tok=k,
        max_position_embeddings=seq, router_aux_loss_coef=0.01,
        rope_parameters={"rope_type": "default", "rope_theta": 1.0e6},
    )
    kwargs = {} if args.hf_experts is None else {"experts_implementation": args.hf_experts}
    hf = MixtralForCausalLM._from_config(hf_cfg, **kwargs).train()
    dropless = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, normalize_top_k=True,
                            aux_loss_coeff=0.01, z_loss_coeff=0.0)
    capped = MoEOptConfig(capacity_factor=1.25, normalize_top_k=True, aux_loss_coeff=0.01, z_loss_coeff=0.0)
    variants = {
        (f"transformers (experts={hf.config._experts_implementation}, "
         f"attn={hf.config._attn_implementation})"): (hf, hf_step),
        "ours, dropless": (from_hf(hf, dropless).train(), our_step),
        "ours, capacity_factor 1.25": (from_hf(hf, capped).train(), our_step),
    }
    if args.compile:
        variants["ours, dropless, apply_compile"] = (apply_compile(from_hf(hf, dropless).train()), our_step)
    assert {"cpu"} <= FUSED_ADAMW_DEVICES
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for n, (m, _) in variants.items()}

    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {n: [] for n in variants}
    splits: dict[str, list[tuple]] = {n: [] for n in variants}
    first_loss = {}
    for i in range(args.warmup + args.steps):
        for n, (model, step) in variants.items():
            t0 = time.perf_counter()
            loss = step(model, opts[n], ids, splits[n])
            first_loss.setdefault(n, loss.item())
            if i < args.warmup:
                splits[n].pop()
            else:
                times[n].append(time.perf_counter() - t0)
    peaks = {n: peak_mib(model, opts[n], step, ids) for n, (model, step) in variants.items()}

    tokens = batch * seq
    from moe.hf import model_config_from_hf

    active = param_breakdown(model_config_from_hf(hf.config)).active
    lines = [f"\n**{name}**: hidden {hidden}, intermediate {inter}, layers {layers}, heads {heads}/{kv} kv, "
             f"experts {experts} top-{k}, vocab {vocab}, seq {seq}, batch {batch}, fp32, "
             f"{active / 1e6:.1f}M active params; median of {args.steps} interleaved steps\n",
             "| variant | step ms | tokens/s | vs transformers | fwd / bwd / opt ms | peak MiB | vs "
             "| first loss |",
             "|---|---|---|---|---|---|---|---|"]
    base = statistics.median(times[next(iter(variants))])
    base_peak = peaks[next(iter(variants))]
    for n, ts in times.items():
        med = statistics.median(ts)
        phases = " / ".join(f"{statistics.median(p) * 1e3:.0f}" for p in zip(*splits[n], strict=True))
        row = [n, f"{med * 1e3:.0f}", f"{tokens / med:,.0f}", f"{base / med:.2f}x", phases,
               f"{peaks[n]:.0f}", f"{peaks[n] / base_peak:.2f}x", f"{first_loss[n]:.4f}"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {machine()}")
    for name in args.shapes:
        print("\n".join(bench_shape(name, args)), flush=True)


if __name__ == "__main__":
    main()
