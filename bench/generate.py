"""Generation throughput: this repo's KV-cache generator vs transformers `generate`, same weights, same run.

    python bench/generate.py                       # CPU defaults: small model, batch 1 and 4, 3 lengths
    python bench/generate.py --dtype fp32 bf16 fp16 --batch 1 8 --new-tokens 32   # the dtype rows
    python bench/generate.py --device cuda --dtype bf16 --hidden 1024 --layers 8

Both sides run greedy on identical left-padded prompts with EOS disabled, so they produce the
same number of tokens (the script checks the tokens are identical too). Tokens/s counts new
tokens only, prefill included; the figure is the median of --repeats runs after a warm-up.
Time to first token is a one-token run of each side (prefill and the first pick), median too.
--expert-layout stores our experts in a layout other than the product's default; --no-arrange keeps them
in the stored memory order while generating (moe.model.moe.arrange_for_generation), to measure what it buys.
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from moe.config import ModelConfig, MoEOptConfig  # noqa: E402
from moe.hf import to_hf  # noqa: E402
from moe.infer.generate import generate, left_pad  # noqa: E402
from moe.model import MoETransformer  # noqa: E402
from moe.model.expert_layout import EXPERT_LAYOUT, IN_OUT, OUT_IN, storing  # noqa: E402

LAYOUTS = {"in_out": IN_OUT, "out_in": OUT_IN}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--window", type=int, default=None, help="sliding window (default: none)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--new-tokens", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt; others are shorter (padding)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), nargs="+", default=["fp32"])
    p.add_argument("--expert-layout", choices=list(LAYOUTS), default=None,
                   help="the layout our experts are stored in (default: the product's, EXPERT_LAYOUT)")
    p.add_argument("--no-arrange", action="store_true",
                   help="generate from the stored memory order (generate(arrange_experts=False))")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    return p.parse_args()


def build(args) -> MoETransformer:
    heads = max(1, args.hidden // 64)
    cfg = ModelConfig(name="bench", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=2 * args.hidden, num_layers=args.layers, num_heads=heads,
                      num_kv_heads=max(1, heads // 4), num_experts=args.experts, top_k=args.top_k,
                      sliding_window=args.window, max_position_embeddings=4096)
    torch.manual_seed(0)
    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None, normalize_top_k=True)
    return MoETransformer(cfg, opt).eval()


def timed_pair(ours, theirs, device, repeats: int):
    """(median wall s, median CPU s, best wall s) of each side; runs interleaved so load changes hit both
    alike. CPU seconds (this process) are the steadier figure on a shared CPU machine.
    """
    ours(), theirs()  # warm-up (allocator, kernels, lazy init)
    wall: tuple[list[float], list[float]] = ([], [])
    cpu: tuple[list[float], list[float]] = ([], [])
    results = [None, None]
    for _ in range(repeats):
        for i, fn in enumerate((ours, theirs)):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            results[i] = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall[i].append(time.perf_counter() - t0)
            cpu[i].append(time.process_time() - c0)
    med = statistics.median
    return (med(wall[0]), med(cpu[0]), min(wall[0])), (med(wall[1]), med(cpu[1]), min(wall[1])), results


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    layout = LAYOUTS[args.expert_layout] if args.expert_layout else EXPERT_LAYOUT
    with storing(layout):
        built = build(args)
    hf_fp32 = to_hf(built).eval()
    params = sum(p.numel() for p in built.parameters()) / 1e6
    print(f"# model: hidden {args.hidden}, layers {args.layers}, experts {args.experts} top-{args.top_k}, "
          f"vocab {args.vocab}, heads {built.model_config.num_heads}/{built.model_config.num_kv_heads} kv, "
          f"window {args.window}; {params:.1f}M params; experts stored {list(layout.dims)}, "
          f"{'not ' if args.no_arrange else ''}arranged for generation")
    import transformers

    print(f"# device {device} ({platform.machine()}, {torch.get_num_threads()} threads), "
          f"torch {torch.__version__}, transformers {transformers.__version__}; median of {args.repeats}, "
          "interleaved")
    print("| dtype | batch | new tokens | ours TTFT ms | transformers TTFT ms | ours tok/s | "
          "transformers tok/s | ratio | ratio (best) | ours tok/CPU-s | transformers tok/CPU-s | ratio (CPU) "
          "| same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(1)
    batches = {}
    for batch in args.batch:
        lengths = [max(1, args.prompt_len - 7 * i) for i in range(batch)]
        prompts = [torch.randint(0, args.vocab, (n,), generator=gen).tolist() for n in lengths]
        ids, mask = left_pad(prompts, pad_token_id=0)
        batches[batch] = ids.to(device), mask.to(device)
    for name in args.dtype:
        dtype = DTYPES[name]
        model = copy.deepcopy(built).to(device=device, dtype=dtype)
        hf = copy.deepcopy(hf_fp32).to(device=device, dtype=dtype).eval()
        for batch, (ids, mask) in batches.items():
            for n in [1, *args.new_tokens]:
                def ours(n=n, ids=ids, mask=mask, model=model):
                    return generate(model, ids, mask, max_new_tokens=n,
                                    arrange_experts=not args.no_arrange).tokens

                @torch.no_grad()
                def theirs(n=n, ids=ids, mask=mask, hf=hf):
                    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0, eos_token_id=None)
                    return out[:, ids.shape[1]:].tolist()

                (ours_s, ours_c, ours_b), (hf_s, hf_c, hf_b), (a, b) = timed_pair(ours, theirs, device,
                                                                                  args.repeats)
                if n == 1:
                    ttft = ours_s, hf_s
                    continue
                toks = batch * n
                print(f"| {name} | {batch} | {n} | {1e3 * ttft[0]:.1f} | {1e3 * ttft[1]:.1f} | "
                      f"{toks / ours_s:.1f} | {toks / hf_s:.1f} | {hf_s / ours_s:.2f}x | "
                      f"{hf_b / ours_b:.2f}x | {toks / ours_c:.1f} | {toks / hf_c:.1f} | "
                      f"{hf_c / ours_c:.2f}x | {'yes' if a == b else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
