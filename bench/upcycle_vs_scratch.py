"""Upcycled vs from-scratch MoE on the bundled data: docs/ROUTING.md's table.

1. Train a dense model (`model=tiny` with one expert, top-1: exactly a SwiGLU MLP) for --dense-steps.
2. Write it as a transformers Mistral directory (what `model.upcycle_from_hf` takes).
3. From there, --moe-steps more of each: the upcycled MoE (8 experts top-2, every expert a copy of
   the dense MLP), the same MoE from scratch, and the dense model trained on.
Every run is `python train.py ...` in its own process; the figures come from their summary.json.

    .venv/bin/python bench/upcycle_vs_scratch.py                     # 300 + 300 steps
    .venv/bin/python bench/upcycle_vs_scratch.py --dense-steps 100 --moe-steps 100
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

COMMON = ["moe_opt=dropless", "resume=true", "trainer.progress_bar=false",
          "trainer.checkpoint_every_n_steps=100"]
MOE = ["model.num_experts=8", "model.top_k=2"]
DENSE = ["model.num_experts=1", "model.top_k=1", "moe_opt.normalize_top_k=true"]  # weight 1.0: a plain MLP


def train(run_dir: Path, *overrides: str) -> dict:
    command = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", *COMMON, *overrides]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads((run_dir / "summary.json").read_text())


def first_loss(run_dir: Path, after: int = 0) -> float:
    """The training loss of the first logged step past `after` (where this run's own training began)."""
    import csv

    with open(run_dir / "metrics.csv", newline="") as f:
        return float(next(r for r in csv.DictReader(f) if r["loss"] and int(r["step"]) > after)["loss"])


def write_mistral(run_dir: Path, out: Path) -> None:
    """Our one-expert checkpoint as MistralForCausalLM weights: the expert is the MLP, the router goes."""
    from safetensors.torch import load_file, save_file
    from transformers import MistralConfig

    from moe.hf import to_hf
    from moe.infer.load import model_from_checkpoint

    model, _ = model_from_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    mixtral = out / "mixtral"
    to_hf(model).save_pretrained(mixtral)
    tensors = {}
    for file in mixtral.glob("*.safetensors"):
        for key, value in load_file(file).items():
            if key.endswith("block_sparse_moe.gate.weight"):
                continue
            for ours, theirs in (("experts.0.w1", "gate_proj"), ("experts.0.w3", "up_proj"),
                                 ("experts.0.w2", "down_proj")):
                key = key.replace(f"block_sparse_moe.{ours}", f"mlp.{theirs}")
            tensors[key] = value.contiguous()
    c = model.model_config
    MistralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                  num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim or c.hidden_size // c.num_heads,
                  max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                  rope_theta=c.rope_theta, sliding_window=c.sliding_window,
                  tie_word_embeddings=c.tie_word_embeddings).save_pretrained(out)
    save_file(tensors, out / "model.safetensors")
    shutil.rmtree(mixtral)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (run_dir / "tokenizer" / name).exists():
            shutil.copy(run_dir / "tokenizer" / name, out / name)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense-steps", type=int, default=300)
    p.add_argument("--moe-steps", type=int, default=300)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="upcycle-"))
    dense_run, dense_hf = work / "dense", work / "dense_hf"
    dense = train(dense_run, *DENSE, f"trainer.max_steps={args.dense_steps}")
    write_mistral(dense_run, dense_hf)
    total = args.dense_steps + args.moe_steps
    continued = f"dense trained on, +{args.moe_steps} steps ({total} in all)"
    runs = {  # label -> (run dir, overrides, the step its own training began after)
        f"MoE from scratch, {args.moe_steps} steps": (
            work / "scratch", [f"trainer.max_steps={args.moe_steps}", *MOE], 0),
        f"MoE upcycled from the dense, +{args.moe_steps} steps": (work / "upcycled", [
            f"model.upcycle_from_hf={dense_hf}", f"data.tokenizer={dense_hf}", *MOE,
            f"trainer.max_steps={args.moe_steps}"], 0),
        continued: (dense_run, [*DENSE, f"trainer.max_steps={total}"], args.dense_steps),
    }
    print(f"work dir: {work}\n")
    print("| run | params (total / active) | first logged loss | final training loss | val loss |")
    print("|---|---|---|---|---|")
    rows = [(f"dense, {args.dense_steps} steps", dense, dense_run, 0)]
    rows += [(label, None, run_dir, after) for label, (run_dir, _, after) in runs.items()]
    for label, summary, run_dir, after in rows:
        if summary is None:
            summary = train(run_dir, *runs[label][1])
        config = summary["config"]
        print(f"| {label} | {config['params_total'] / 1e6:.2f}M / {config['params_active'] / 1e6:.2f}M | "
              f"{first_loss(run_dir, after):.4f} | {summary['final_loss']:.4f} | "
              f"{summary['final_val_loss']:.4f} |", flush=True)

if __name__ == "__main__":
    main()
