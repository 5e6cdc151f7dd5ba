"""Peak memory and start-up of the whole `infer.py hf_dir=DIR` process, beside transformers' own load and
`generate` of the same directory.

    python bench/load_memory.py                      # this checkout, fp32 and bf16
    python bench/load_memory.py --before ../main     # and another checkout's infer.py beside it

Builds a random MixtralForCausalLM (fixed seed; hidden 512, 8 layers, 8 experts top-2, intermediate 1024,
8/2 heads, a 512-token BPE tokenizer: 106.5M parameters) and save_pretrained's it, fp32, into a temporary
directory. Each side is a fresh process, one torch thread (OMP_NUM_THREADS=1), greedy, EOS off, the same 8
prompts in one batch: `infer.py hf_dir=DIR dtype=D`, and a script that runs
`AutoModelForCausalLM.from_pretrained(DIR, dtype=D)` + `generate`. Peak RSS is the child's own
(os.wait4's ru_maxrss: the whole process, imports included), which a loaded machine does not change (the
directory is built in a child too: Linux counts the RSS a child is forked with into its peak);
start-up is the median wall and CPU time of --repeats runs that make 1 token (imports, load, one prefill),
which load does change (CPU seconds less).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

PROMPTS = ["The quick brown fox jumps over", "Once upon a time there was", "In the beginning the",
           "A cat sat on", "Numbers go one two three", "The river runs to the sea and",
           "She opened the door and saw",
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
    p.add_argument("--repeats", type=int, default=3, help="start-up runs per side (median)")
    p.add_argument("--build-into", type=Path, default=None, help=argparse.SUPPRESS)  # the child that builds
    p.add_argument("--ckpt", action="store_true", help="also `infer.py ckpt=` of the same weights as a "
                   "train.py checkpoint (its model and moe_opt config, state_dict under model.)")
    return p.parse_args()


def build(directory: Path) -> float:
    """The random Mixtral directory (config, fp32 safetensors, tokenizer); its parameters in millions."""
    import torch
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


def checkpoint(directory: Path, path: Path) -> None:
    """The directory's weights as a train.py checkpoint: what model_from_checkpoint reads."""
    from dataclasses import asdict

    import torch

    from moe.hf import from_hf
    from moe.model.expert_layout import recorded

    model = from_hf(directory)
    cfg = {"model": asdict(model.model_config), "moe_opt": asdict(model.moe_opt)}
    torch.save(recorded({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                         "hyper_parameters": {"cfg": cfg}, "global_step": 0}), path)  # as train.py records it


def measured(command: list[str], cwd: Path, env: dict) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MiB) of one child process run to its end."""
    t0 = time.perf_counter()
    child = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{out.decode()[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024  # ru_maxrss is KiB on Linux


def built(tmp: Path, ckpt: bool) -> None:
    """In a child process: the directory (and the checkpoint), and the header line."""
    import torch
    import transformers

    params = build(tmp / "mixtral")
    if ckpt:
        checkpoint(tmp / "mixtral", tmp / "mixtral.ckpt")
    print(f"# random MixtralForCausalLM, {params:.1f}M parameters, files fp32; {platform.machine()}, "
          f"{os.cpu_count()} CPUs, 1 thread; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; batch {len(PROMPTS)}, greedy")


def main() -> None:
    args = parse()
    if args.build_into:
        built(args.build_into, args.ckpt)
        return
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        directory, prompts = Path(tmp) / "mixtral", Path(tmp) / "prompts.txt"
        header = subprocess.run([sys.executable, __file__, "--build-into", tmp] + ["--ckpt"] * args.ckpt,
                                check=True, capture_output=True, text=True).stdout
        print(header.strip().splitlines()[-1])
        prompts.write_text("\n".join(PROMPTS) + "\n")
        ckpt = Path(tmp) / "mixtral.ckpt"
        sides = {"ours": ROOT} | ({"before": args.before.resolve()} if args.before else {})
        print("| dtype | new tokens | side | peak RSS MiB | whole run s | whole run CPU s "
              "| start-up (1 token) s | start-up CPU s |")
        print("|---|---|---|---|---|---|---|---|")
        for dtype, n in zip(args.dtypes, args.new_tokens, strict=True):
            name = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
            runs = {side: lambda k, c=checkout, d=dtype: measured(
                [sys.executable, "infer.py", f"hf_dir={directory}", f"prompts_file={prompts}", "device=cpu",
                 f"dtype={d}", f"max_new_tokens={k}", "stop_at_eos=false", "greedy=true",
                 f"batch_size={len(PROMPTS)}"], c, env | {"PYTHONPATH": str(c)})
                for side, checkout in sides.items()}
            if args.ckpt:
                runs |= {f"{side}, ckpt=": lambda k, c=checkout, d=dtype: measured(
                    [sys.executable, "infer.py", f"ckpt={ckpt}", f"tokenizer={directory}",
                     f"prompts_file={prompts}", "device=cpu", f"dtype={d}", f"max_new_tokens={k}",
                     "stop_at_eos=false", "greedy=true", f"batch_size={len(PROMPTS)}"], c,
                    env | {"PYTHONPATH": str(c)}) for side, checkout in sides.items()}
            runs["transformers"] = lambda k, d=name: measured(
                [sys.executable, "-c", TRANSFORMERS_SIDE, str(directory), d, str(k), str(prompts)], ROOT, env)
            starts = {side: [] for side in runs}
            for _ in range(args.repeats):  # start-up runs interleaved, so load changes hit every side alike
                for side, run in runs.items():
                    starts[side].append(run(1)[:2])
            for side, run in runs.items():
                wall, cpu, peak = run(n)
                start = [statistics.median(t) for t in zip(*starts[side], strict=True)]
                print(f"| {dtype} | {n} | {side} | {peak:,.0f} | {wall:.1f} | {cpu:.1f} | {start[0]:.1f} | "
                      f"{start[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
