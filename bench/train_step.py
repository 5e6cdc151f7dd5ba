"""Tokens/s of one full training step (forward, backward, AdamW) for our model vs transformers' Mixtral.

Same config, same weights (`from_hf` of the HF model), same batch, same process. Steps are
interleaved (A, B, C, A, B, C, ...) so a neighbour loading the CPU hurts every variant
alike; the figures are medians over --steps of wall time and of process CPU time (the
latter is steadier on a shared machine, most of all with --threads 1). Both losses include
the load-balance loss (HF: output_router_logits=True + labels; ours: CE + aux_loss_coeff*aux
+ z_loss_coeff*z).

    .venv/bin/python bench/train_step.py                 # default config, prints a markdown table
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
from moe.hf import from_hf  # noqa: E402
from moe.parallel.apply import apply_compile  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="add a row for our model with apply_compile")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--hf-experts", default=None, help="transformers experts_implementation")
    p.add_argument("--hf-eager", action="store_true",
                   help="add a row for transformers with experts_implementation=eager (its per-expert loop)")
    return p.parse_args()


def hf_step(model, opt, ids):
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss.detach()


def our_step(model, opt, ids):
    """As LitMoE computes it: labels already shifted (-100 at the end), logits never sliced."""
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    out = model(ids)
    lm = F.cross_entropy(out.logits_BSV.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    loss = lm + model.moe_opt.aux_loss_coeff * out.aux_loss + model.moe_opt.z_loss_coeff * out.z_loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


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


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    hf_cfg = MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        num_local_experts=args.experts, num_experts_per_tok=args.top_k, max_position_embeddings=args.seq,
        router_aux_loss_coef=0.01, rope_parameters={"rope_type": "default", "rope_theta": 1.0e6},
    )
    kwargs = {} if args.hf_experts is None else {"experts_implementation": args.hf_experts}
    hf = MixtralForCausalLM._from_config(hf_cfg, **kwargs).train()
    dropless = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, normalize_top_k=True,
                            aux_loss_coeff=0.01, z_loss_coeff=0.0)
    capped = MoEOptConfig(capacity_factor=1.25, normalize_top_k=True, aux_loss_coeff=0.01, z_loss_coeff=0.0)
    variants = {
        f"transformers MixtralForCausalLM (experts={hf.config._experts_implementation}, "
        f"attn={hf.config._attn_implementation})": (hf, hf_step),
        "ours, dropless": (from_hf(hf, dropless).train(), our_step),
        "ours, capacity_factor 1.25": (from_hf(hf, capped).train(), our_step),
    }
    if args.hf_eager:
        loop = MixtralForCausalLM._from_config(hf_cfg, experts_implementation="eager").train()
        loop.load_state_dict(hf.state_dict())
        variants["transformers MixtralForCausalLM (experts=eager loop, attn=sdpa)"] = (loop, hf_step)
    if args.compile:
        variants["ours, dropless, apply_compile"] = (apply_compile(from_hf(hf, dropless).train()), our_step)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, (m, _) in variants.items()}

    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu_times: dict[str, list[float]] = {name: [] for name in variants}
    first_loss = {}
    for i in range(args.warmup + args.steps):
        for name, (model, step) in variants.items():
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step(model, opts[name], ids)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            first_loss.setdefault(name, loss.item())
            if i >= args.warmup:
                times[name].append(dt)
                cpu_times[name].append(dc)

    tokens = args.batch * args.seq
    n_active = variants["ours, dropless"][0].num_params(active_only=True)
    print(f"machine: {machine()}")
    print(f"config: hidden {args.hidden}, intermediate {args.intermediate}, layers {args.layers}, heads "
          f"{args.heads}/{args.kv_heads} kv, experts {args.experts} top-{args.top_k}, vocab {args.vocab}, "
          f"seq {args.seq}, batch {args.batch}, fp32, {n_active / 1e6:.1f}M active params; "
          f"median of {args.steps} interleaved steps after {args.warmup} warm-up")
    base = statistics.median(times[next(iter(variants))])
    cpu_base = statistics.median(cpu_times[next(iter(variants))])
    print("\n| variant | step ms (median) | tokens/s | vs transformers | CPU-time ms | vs (CPU time) "
          "| first loss |")
    print("|---|---|---|---|---|---|---|")
    for name, ts in times.items():
        med, cpu = statistics.median(ts), statistics.median(cpu_times[name])
        row = [name, f"{med * 1e3:.0f}", f"{tokens / med:,.0f}", f"{base / med:.2f}x", f"{cpu * 1e3:.0f}",
               f"{cpu_base / cpu:.2f}x", f"{first_loss[name]:.4f}"]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
