"""MLA generation: the latent KV cache (decode through the absorbed projections) against the expanded per-head
cache, same weights, same run.

    python bench/mla_cache.py                        # CPU defaults: batch 1 and 4, a 512-token prompt
    python bench/mla_cache.py --device cuda --dtype bf16 --heads 128 --kv-rank 512 --rope 64 \
        --nope 128 --v 128  # DeepSeek-V3's attention

Both sides generate greedily from the same left-padded prompts with EOS off (the script checks the tokens
are identical). Decode tok/s counts the new tokens after the first over the decode time (the prefill is
the same expanded attention on both sides); the cache bytes are `Generation.cache_bytes` at the end.
Median of --repeats runs after a warm-up, the two sides interleaved.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from moe.config import ModelConfig, MoEOptConfig  # noqa: E402
from moe.infer.generate import generate, left_pad  # noqa: E402
from moe.model import MoETransformer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--q-rank", type=int, default=192)
    p.add_argument("--kv-rank", type=int, default=128)
    p.add_argument("--nope", type=int, default=32)
    p.add_argument("--rope", type=int, default=16)
    p.add_argument("--v", type=int, default=32)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-len", type=int, default=512, help="longest prompt; others are shorter (padding)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    return p.parse_args()


def build(args) -> MoETransformer:
    cfg = ModelConfig(name="bench_mla", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.hidden // 2, num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=args.heads, num_experts=8, top_k=2, attention="mla",
                      q_lora_rank=args.q_rank,
                      kv_lora_rank=args.kv_rank, qk_nope_head_dim=args.nope, qk_rope_head_dim=args.rope,
                      v_head_dim=args.v, max_position_embeddings=args.prompt_len + args.new_tokens)
    torch.manual_seed(0)
    return MoETransformer(cfg, MoEOptConfig(capacity_factor=None, eval_capacity_factor=None)).eval()


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = build(args).to(device=device, dtype=DTYPES[args.dtype])
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"# model: hidden {args.hidden}, layers {args.layers}, heads {args.heads}, kv_lora_rank "
          f"{args.kv_rank}, qk {args.nope}+{args.rope}, v {args.v}, 8 experts top-2, vocab {args.vocab}; "
          f"{params:.1f}M params")
    print(f"# device {device} ({platform.machine()}, {torch.get_num_threads()} threads), {args.dtype}, "
          f"torch {torch.__version__}; prompt {args.prompt_len}, {args.new_tokens} new tokens; median of "
          f"{args.repeats}, interleaved")
    print("| batch | latent decode tok/s | expanded decode tok/s | speed-up | latent cache MiB "
          "| expanded cache MiB | ratio | prefill s (latent / expanded) | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(1)
    for batch in args.batch:
        lengths = [max(1, args.prompt_len - 7 * i) for i in range(batch)]
        ids, mask = left_pad([torch.randint(0, args.vocab, (n,), generator=gen).tolist() for n in lengths], 0)
        ids, mask = ids.to(device), mask.to(device)
        runs = {True: [], False: []}
        for i in range(args.repeats + 1):  # the first of each is the warm-up
            for latent in (True, False):
                out = generate(model, ids, mask, max_new_tokens=args.new_tokens, latent_cache=latent)
                if i:
                    runs[latent].append(out)
        med = statistics.median
        decode = {k: med(batch * (args.new_tokens - 1) / r.decode_s for r in v) for k, v in runs.items()}
        prefill = {k: med(r.prefill_s for r in v) for k, v in runs.items()}
        mib = {k: v[0].cache_bytes / 2**20 for k, v in runs.items()}
        same = runs[True][0].tokens == runs[False][0].tokens
        print(f"| {batch} | {decode[True]:.1f} | {decode[False]:.1f} | {decode[True] / decode[False]:.2f}x | "
              f"{mib[True]:.2f} | {mib[False]:.2f} | {mib[False] / mib[True]:.1f}x | "
              f"{prefill[True]:.2f} / {prefill[False]:.2f} | {'yes' if same else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
