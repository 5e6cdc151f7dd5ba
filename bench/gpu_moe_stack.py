"""The GPU tier: tokens/s and MFU of a Mixtral-shaped MoE stack on one GPU, with natural routing and with
routing forced to balance side by side (NVIDIA's headline MoE figures force balance), grouped GEMM on;
FP8 (torchao's float8 training) as an option. docs/BENCHMARKS.md records the figures with the card's name.

    .venv/bin/python bench/gpu_moe_stack.py                      # on a CUDA GPU
    .venv/bin/python bench/gpu_moe_stack.py --fp8                # + torchao float8 linears (sm89+, torchao)
    .venv/bin/python bench/gpu_moe_stack.py --fp8-experts        # the experts' GEMMs in FP8 (sm90+)
    .venv/bin/python bench/gpu_moe_stack.py --swiglu eager       # the peer of the fused SwiGLU kernels
    .venv/bin/python bench/gpu_moe_stack.py --compile            # + compiled as model.compile=true does
    .venv/bin/python bench/gpu_moe_stack.py --compile all        # + the MoE layers compiled with their block
    .venv/bin/python bench/gpu_moe_stack.py --accumulate 8       # one SGD step per 8 micro-batches
    .venv/bin/python bench/gpu_moe_stack.py --profile prof.txt   # + one step's kernels, by device time
    .venv/bin/python bench/gpu_moe_stack.py --cpu-smoke          # a tiny shape on the CPU: checks the script

The stack is moe.model.MoETransformer with Mixtral 8x7B's block (hidden 4096, 8 experts of 14336, top-2,
GQA 32/8) and --layers blocks (default 4: 5.9B parameters, bf16 weights, what one 80 GB card holds with
SGD's step), micro-batch x 4096 tokens, the chunked LM head and loss; each step is forward, backward and
an SGD update (`--accumulate N`: one update per N micro-batches, as a run's global batch). MFU is counted
as summary.json counts it (moe.config.size.flops_per_token: 6 x the activated parameters without the input
embedding, a lookup, plus attention's 6 x layers x heads x (qk + v dims) x seq per token, as torchtitan and
Megatron count) over the card's dense bf16 peak (--peak-tflops, default from the card's name).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}  # dense bf16


def balanced_top_k(scores_TE, k, *args, **kwargs):
    """Forced balance: token t's picks are experts (t*k + j) mod E, weighted by its router's scores for them
    (torchtitan's _debug_force_load_balance, NVIDIA's benchmark setting)."""
    T, E = scores_TE.shape
    idx_TK = (torch.arange(T, device=scores_TE.device).unsqueeze(1) * k
              + torch.arange(k, device=scores_TE.device)) % E
    weights_TK = scores_TE.gather(1, idx_TK)
    return weights_TK / weights_TK.sum(-1, keepdim=True), idx_TK


def build(args, device):
    from moe.config.schema import ModelConfig, MoEOptConfig
    from moe.model.model import MoETransformer

    if args.cpu_smoke:
        cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, num_experts=8, top_k=2)
    else:
        cfg = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=args.layers,
                          num_heads=32, num_kv_heads=8, num_experts=8, top_k=2, max_position_embeddings=4096)
    opt = MoEOptConfig(capacity_factor=None, eval_capacity_factor=None,
                       weights_in_activation=args.weights_in_activation, fp8_experts=args.fp8_experts)
    with torch.device(device):
        model = MoETransformer(cfg, opt, init_seed=0).to(torch.bfloat16)
    if args.fp8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, name: "attn" in name)
    if args.compile == "blocks":  # model.compile=true: the blocks, the MoE regions around the experts
        from moe.parallel.apply import apply_compile

        apply_compile(model)
    elif args.compile == "all":  # the MoE layers too: in one process their shapes no longer depend on routing
        mode = "reduce-overhead" if args.cuda_graphs else None  # each block's graphs replayed as CUDA graphs
        for block in model.layers:
            block.compile(mode=mode)
    return model, cfg


def train_step(model, ids, optimizer, micro_batches: int = 1) -> None:
    """One optimizer step over `micro_batches` forward + backward passes of `ids` (gradient accumulation, as
    a real run's global batch: the update's cost is shared by them). Each micro-batch begins a new round of
    CUDA graphs (--cuda-graphs: the last one's outputs are done with once its backward ran)."""
    for _ in range(micro_batches):
        torch.compiler.cudagraph_mark_step_begin()  # nothing without CUDA graphs
        out = model(ids[:, :-1], labels_BS=ids[:, 1:])
        (out.loss / micro_batches).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def profile(model, cfg, args, device, path: Path) -> None:
    """One step (natural routing) under torch.profiler: its kernels and ops by device time, to `path`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    seq = 32 if args.cpu_smoke else args.seq_len
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, seq + 1), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    train_step(model, ids, optimizer)  # warm-up
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        train_step(model, ids, optimizer)
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=40))
    print(f"profile of one step: {path}")


def tokens_per_s(model, cfg, args, device, balanced: bool) -> float:
    import moe.model.moe as moe_module

    natural = moe_module.top_k_routing
    moe_module.top_k_routing = balanced_top_k if balanced else natural
    try:
        seq = 32 if args.cpu_smoke else args.seq_len
        ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, seq + 1), device=device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
        times = []
        for step in range(args.warmup + args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            train_step(model, ids, optimizer, args.accumulate)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        return args.accumulate * args.micro_batch * seq / (sum(times) / len(times))
    finally:
        moe_module.top_k_routing = natural


def refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches per optimizer step (the SGD update's cost shared by them)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--fp8", action="store_true", help="torchao float8 training, attention linears")
    parser.add_argument("--compile", nargs="?", const="blocks", choices=["blocks", "all"], default=None,
                        help="torch.compile each block (blocks: as model.compile=true, the MoE layers' "
                             "routing, dispatch, combine and SwiGLU as regions; all: the MoE layers with "
                             "their blocks)")
    parser.add_argument("--profile", type=Path, default=None, help="write one step's profile table here")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="with --compile all: torch.compile's reduce-overhead mode, each block's graphs "
                             "captured and replayed as CUDA graphs (one process, dropless: static shapes)")
    parser.add_argument("--weights-in-activation", action="store_true",
                        help="moe_opt.weights_in_activation: the routing weights in the experts' SwiGLU, the "
                             "k outputs summed in bf16")
    parser.add_argument("--fp8-experts", action="store_true",
                        help="moe_opt.fp8_experts: the experts' grouped GEMMs, forward and backward, in "
                             "float8 e4m3, rowwise scales (torch._scaled_grouped_mm: compute capability 9+)")
    parser.add_argument("--swiglu", choices=["fused", "eager"], default="fused",
                        help="the experts' SwiGLU outside torch.compile: the Triton kernels "
                             "(moe/model/fused_swiglu.py, CUDA) or the eager formula")
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on the CPU (no figures)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        refuse("bench/gpu_moe_stack.py measures a CUDA GPU and this machine has none (torch sees no CUDA "
               "device). Fix: run it on a GPU machine, or pass --cpu-smoke to check the script here.")
    if args.fp8 and (args.cpu_smoke or torch.cuda.get_device_capability() < (8, 9)):
        refuse("--fp8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+: L40S, H100) and "
               "torchao; this run has none. Fix: drop --fp8, or run on such a card.")
    if args.fp8_experts and not args.cpu_smoke:
        from moe.model.fp8 import fp8_kernel

        if not fp8_kernel(torch.device("cuda")):  # probed here, before anything compiles
            refuse("--fp8-experts needs FP8 grouped GEMMs (torch._scaled_grouped_mm: CUDA compute capability "
                   f"9.0+, H100/H200) and this card or torch has none ({torch.cuda.get_device_name()}, torch "
                   f"{torch.__version__}). Fix: drop --fp8-experts, or run on such a card.")
    if args.cuda_graphs and args.compile != "all":
        refuse("--cuda-graphs captures whole compiled blocks and needs --compile all (with --compile the MoE "
               "layers run eager between graphs). Fix: add --compile all.")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    import moe.model.fused_swiglu as fused_swiglu

    fused_swiglu.ENABLED = args.swiglu == "fused"
    name = "CPU (smoke)" if args.cpu_smoke else torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    model, cfg = build(args, device)
    from moe.config.size import flops_per_token, param_breakdown

    sizes = param_breakdown(cfg)
    seq = 32 if args.cpu_smoke else args.seq_len
    flops = flops_per_token(cfg, seq)
    print(f"{name}: {cfg.num_layers} Mixtral-shaped blocks, {sizes.total / 1e9:.2f}B parameters "
          f"({sizes.active / 1e9:.2f}B active), micro-batch {args.micro_batch} x {seq}"
          + (f" x {args.accumulate} per step" if args.accumulate > 1 else "") + ", bf16"
          + (", fp8 attention linears" if args.fp8 else "")
          + (f", compiled: {args.compile}" if args.compile else "")
          + ((", CUDA graphs skipped (torch captures CUDA only)" if args.cpu_smoke else ", CUDA graphs")
             if args.cuda_graphs else "")
          + (", routing weights in the SwiGLU" if args.weights_in_activation else "")
          + ((", FP8 experts (emulated)" if args.cpu_smoke else ", FP8 experts") if args.fp8_experts else "")
          + (", eager SwiGLU" if args.swiglu == "eager" and not args.compile else ""))
    print("| routing | tokens/s | MFU (moe.config.size's count: no input embedding) |")
    print("|---|---|---|")
    for label, balanced in (("natural (the router's own picks)", False), ("forced balance", True)):
        rate = tokens_per_s(model, cfg, args, device, balanced)
        mfu = f"{100 * rate * flops / (peak * 1e12):.1f}%" if peak else "- (pass --peak-tflops)"
        print(f"| {label} | {rate:,.0f} | {mfu} |")
    if args.profile:
        profile(model, cfg, args, device, args.profile)


if __name__ == "__main__":
    main()
