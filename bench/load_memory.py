"""Peak memory and start-up of the whole `infer.py hf_dir=DIR` process, beside transformers' own load and
`generate` of the same directory.

    python bench/load_memory.py                      # this checkout, fp32 and bf16
    python bench/load_memory.py --before ../main     # and another checkout's infer.py beside it

Builds a random MixtralForCausalLM (fixed seed; hidden 512, 8 layers, 8 experts top-2, intermediate 1024,
8/2 heads, a 512-token BPE tokenizer: 106.5M parameters) and save_pretrained's it, fp32, into a temporary
directory. Each side is a fresh process, one torch thread (OMP_NUM_THREADS=1), greedy, EOS off, the same 8
prompts in one batch: `infer.py hf_dir=DIR dtype=D`, and a script that runs
`AutoModelForCausalLM.from_pretrained(DIR, dtype=D)` + `generate`. Peak RSS is the child's own
(os.wait4's ru_maxrss: the whole process, imports included), which a loaded machine does not change;
start-up is the wall time of a run that makes 1 token (imports, load, one prefill), which load does.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

PROMPTS = ["The quick brown fox jumps over", "Once upon a time there was", "In the beginning the", "A cat sat on",
           "Numbers go one two three", "The river runs to the sea and", "She opened the door and saw",
           "Tomorrow we will"]
TEXT = ["the quick brown fox jumps over the lazy dog", "once upon a time there was a king and a cat",
        "numbers go one two three four five six seven", "the river runs to the sea, she opened the door"]

TRANSFORMERS_SIDE = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, dtype, n = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(path)
tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
batch = tok(open(sys.argv[4]).read().splitlines(), return_tensors="pt", padding=True)
with torch.no_grad():
    out = model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=None)
print(out.shape)
"""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, default=None, help="another checkout whose infer.py runs beside")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--new-tokens", type=int, nargs="+", default=[128, 32], help="per dtype")
    return p.parse_args()


def build(directory: Path) -> float:
    """The random Mixtral directory (config, fp32 safetensors, tokenizer); its parameters in millions."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from moe.data.tokenizer import save_tokenizer, train_bpe

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=4096, rope_theta=1e6)
    model = MixtralForCausalLM(config).eval()
    model.save_pretrained(directory)
    save_tokenizer(train_bpe(TEXT * 20, 512, ["<|endoftext|>", "<|pad|>"], show_progress=False), directory,
                   eos="<|endoftext|>", pad="<|pad|>")
    return sum(p.numel() for p in model.parameters()) / 1e6


def measured(command: list[str], cwd: Path, env: dict) -> tuple[float, float]:
    """(wall s, peak RSS MiB) of one child process run to its end."""
    t0 = time.perf_counter()
    child = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{out.decode()[-2000:]}")
    return wall, usage.ru_maxrss / 1024  # ru_maxrss is KiB on Linux


def main() -> None:
    args = parse()
    import transformers

    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        directory, prompts = Path(tmp) / "mixtral", Path(tmp) / "prompts.txt"
        params = build(directory)
        prompts.write_text("\n".join(PROMPTS) + "\n")
        sides = {"ours": ROOT} | ({"before": args.before.resolve()} if args.before else {})
        print(f"# random MixtralForCausalLM, {params:.1f}M parameters, files fp32; {platform.machine()}, "
              f"{os.cpu_count()} CPUs, 1 thread; torch {torch.__version__}, transformers "
              f"{transformers.__version__}; batch {len(PROMPTS)}, greedy")
        print("| dtype | new tokens | side | peak RSS MiB | whole run s | start-up (1 token) s |")
        print("|---|---|---|---|---|---|")
        for dtype, n in zip(args.dtypes, args.new_tokens, strict=True):
            name = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
            runs = {side: lambda k, c=checkout: measured(
                [sys.executable, "infer.py", f"hf_dir={directory}", f"prompts_file={prompts}", "device=cpu",
                 f"dtype={dtype}", f"max_new_tokens={k}", "stop_at_eos=false", "greedy=true",
                 f"batch_size={len(PROMPTS)}"], c, env | {"PYTHONPATH": str(c)})
                for side, checkout in sides.items()}
            runs["transformers"] = lambda k: measured(
                [sys.executable, "-c", TRANSFORMERS_SIDE, str(directory), name, str(k), str(prompts)], ROOT, env)
            for side, run in runs.items():  # one side after another, each its start-up run then its whole run
                start, _ = run(1)
                wall, peak = run(n)
                print(f"| {dtype} | {n} | {side} | {peak:,.0f} | {wall:.1f} | {start:.1f} |", flush=True)


if __name__ == "__main__":
    main()
